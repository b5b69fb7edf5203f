//! Raw streams and events, and the keys an allocator uses for the special
//! streams (see the parent module's "Special streams").

use super::*;

pub(super) fn raw_stream(value: usize) -> CUstream {
    std::ptr::with_exposed_provenance_mut::<CUstream_st>(value)
}

/// Marks [`stream_key`]'s per-thread keys: no user-space pointer has these
/// bits set (x86-64 and AArch64 user addresses stay below 2^57).
pub(super) const PER_THREAD_TAG: u64 = 0xF000_0000_0000_0000;

pub(super) static NEXT_THREAD_TOKEN: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's token in per-thread stream keys (unique in the process).
    static THREAD_TOKEN: u64 = NEXT_THREAD_TOKEN.fetch_add(1, Ordering::Relaxed);
}

pub(super) fn thread_token() -> u64 {
    THREAD_TOKEN.with(|t| *t)
}

/// The [`Stream`] an allocator should key a raw `CUstream` value on:
/// `CU_STREAM_LEGACY` (0x1) is [`Stream::DEFAULT`] (the same legacy default
/// stream as null), `CU_STREAM_PER_THREAD` (0x2) a key unique to the calling
/// thread (its per-thread default stream), anything else the value itself.
/// [`CudaDevice`] accepts these keys from any thread (see the module docs).
pub fn stream_key(raw: u64) -> Stream {
    match raw as usize {
        CU_STREAM_LEGACY => Stream::DEFAULT,
        CU_STREAM_PER_THREAD => Stream(PER_THREAD_TAG | (thread_token() << 4) | 0x2),
        _ => Stream(raw),
    }
}

/// Whether `s` is a [`stream_key`] per-thread key (of any thread).
pub fn is_per_thread_key(s: Stream) -> bool {
    s.0 & PER_THREAD_TAG == PER_THREAD_TAG && s.0 & 0xf == 0x2
}

/// What a [`Stream`] means to the driver, from the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamRef {
    /// A `CUstream` value to pass as is (null, `CU_STREAM_LEGACY`,
    /// `CU_STREAM_PER_THREAD` of this thread, or a real stream).
    Raw(CUstream),
    /// Another thread's per-thread default stream, which this thread cannot name.
    OtherThread,
}

pub(super) fn stream_ref(s: Stream) -> StreamRef {
    if is_per_thread_key(s) {
        if (s.0 & !PER_THREAD_TAG) >> 4 == thread_token() {
            StreamRef::Raw(raw_stream(CU_STREAM_PER_THREAD))
        } else {
            StreamRef::OtherThread
        }
    } else {
        StreamRef::Raw(raw_stream(s.0 as usize))
    }
}

pub(super) fn event_ptr(e: Event) -> CUevent {
    std::ptr::with_exposed_provenance_mut::<CUevent_st>(e.0 as usize)
}
