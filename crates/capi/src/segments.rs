//! The C ABI of segment following (issue 43): NCCL user-buffer registration
//! under vmmalloc. The torch companion calls it when PyTorch attaches an
//! allocator trace tracker (ProcessGroupNCCL's register hook,
//! `TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`, or `register_mem_pool`),
//! and hands each change to the trackers as a `SEGMENT_ALLOC` /
//! `SEGMENT_FREE` trace entry.
//!
//! ```c
//! // action 1: [addr, addr + size) was mapped and made accessible (register
//! // it); 0: it is about to be unmapped or moved (deregister it now).
//! typedef void (*VmmallocSegmentFn)(void* ctx, int action, int device,
//!     uint64_t addr, uint64_t size, uint64_t stream, uint64_t pool_hi,
//!     uint64_t pool_lo);
//! // Every device, present and future; NULL stops. 0, or -1 (the policy
//! // cannot follow segments, or nccl_register:False).
//! int vmmalloc_follow_segments(VmmallocSegmentFn fn, void* ctx);
//! // Changes sent on `device` since following began.
//! int vmmalloc_segment_changes(int device, uint64_t* added, uint64_t* removed);
//! ```
//!
//! The ranges are the segments `snapshot()` reports (each contiguous run of
//! mapped pages: `vmmalloc_visit_segments`), so what ProcessGroupNCCL
//! registers from a snapshot (`initNCCLComm`, `register_mem_pool`) is
//! deregistered by the same address later (NCCLUtils.cpp
//! `NCCLComm::deregisterSegment` refuses any other). See
//! crates/alloc/src/expandable/physical/follow.rs for when changes are sent.

use crate::config::LogLevel::Error as LError;
use crate::{diag, entry, runtime};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use vmmalloc_alloc::{Allocator, SegmentChange, SegmentSink};

/// The callback: `(ctx, action, device, addr, size, stream, pool_hi, pool_lo)`.
pub type SegmentFn = unsafe extern "C" fn(*mut c_void, c_int, c_int, u64, u64, u64, u64, u64);

/// The callback and its context, as set by [`vmmalloc_follow_segments`].
#[derive(Clone, Copy)]
pub(crate) struct Follow {
    f: SegmentFn,
    ctx: usize,
}

/// What [`vmmalloc_follow_segments`] set last; applied to devices created
/// later (`runtime.rs`).
static FOLLOW: parking_lot::Mutex<Option<Follow>> = parking_lot::Mutex::new(None);

/// The sink of one device: calls the C callback with its ordinal.
struct CSink {
    follow: Follow,
    ordinal: c_int,
}

impl SegmentSink for CSink {
    fn change(&self, c: &SegmentChange) {
        // SAFETY: the caller of vmmalloc_follow_segments promised a callback
        // valid until it is replaced, that does not unwind and calls no
        // vmmalloc_* function; ctx is passed back unchanged.
        unsafe {
            (self.follow.f)(
                self.follow.ctx as *mut c_void,
                c_int::from(c.registered),
                self.ordinal,
                c.addr,
                c.bytes,
                c.stream.0,
                c.pool.0,
                c.pool.1,
            )
        }
    }
}

/// Starts (or stops) following on `allocator` of device `ordinal` with what
/// was set. Errors: the policy cannot follow.
fn apply(follow: Option<Follow>, ordinal: u32, allocator: &dyn Allocator) -> Result<(), String> {
    let Some(f) = allocator.as_segment_follow() else {
        return match follow {
            None => Ok(()),
            Some(_) => Err(format!(
                "the {} policy cannot follow segments for NCCL registration (expandable can)",
                allocator.name()
            )),
        };
    };
    let sink = follow.map(|follow| {
        Arc::new(CSink {
            follow,
            ordinal: ordinal as c_int,
        }) as Arc<dyn SegmentSink>
    });
    f.follow_segments(sink).map_err(|e| e.to_string())
}

/// Applies what was set to a device being created (`runtime.rs`).
pub(crate) fn apply_to_new(ordinal: u32, allocator: &dyn Allocator) -> Result<(), String> {
    let follow = *FOLLOW.lock();
    match follow {
        Some(_) => apply(follow, ordinal, allocator),
        None => Ok(()),
    }
}

/// Starts following the registrable segments of every device, present and
/// future, sending each change to `f` with `ctx` (NULL: stops). Returns 0,
/// or -1 with the reason in `vmmalloc_last_error()`: `nccl_register:False`
/// in the configuration, or a device whose policy cannot follow (only
/// `expandable` can).
///
/// # Safety
///
/// `f` must stay callable until it is replaced, must not unwind and must not
/// call any `vmmalloc_*` function: it runs under the allocator's lock, on the
/// thread whose call mapped or unmapped the memory.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_follow_segments(f: Option<SegmentFn>, ctx: *mut c_void) -> c_int {
    entry("vmmalloc_follow_segments", -1, || {
        let rt = runtime::runtime();
        let follow = f.map(|f| Follow {
            f,
            ctx: ctx as usize,
        });
        if follow.is_some() {
            match rt.config() {
                Ok(c) if !c.nccl_register => {
                    diag::fail(
                        rt.log_level(),
                        LError,
                        "vmmalloc_follow_segments: nccl_register:False in VMMALLOC_CONF: \
                         NCCL's register hook is not served",
                    );
                    return -1;
                }
                Ok(_) => {}
                Err(e) => {
                    diag::fail(
                        rt.log_level(),
                        LError,
                        &format!("vmmalloc_follow_segments: {e}"),
                    );
                    return -1;
                }
            }
        }
        let _g = rt.creating_lock();
        *FOLLOW.lock() = follow;
        for d in rt.active_devices() {
            if let Err(m) = apply(follow, d.ordinal, &*d.allocator) {
                diag::fail(
                    rt.log_level(),
                    LError,
                    &format!("vmmalloc_follow_segments: device {}: {m}", d.ordinal),
                );
                return -1;
            }
        }
        0
    })
}

/// Writes the changes sent on `device` since following began: `added`
/// (registrations) and `removed` (deregistrations). Returns 0, or -1 (a bad
/// ordinal or NULL pointers; a device not yet used, or a policy without
/// following, reports 0 and 0).
///
/// # Safety
///
/// `added` and `removed` must be valid for writing one `uint64_t` each.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_segment_changes(
    device: c_int,
    added: *mut u64,
    removed: *mut u64,
) -> c_int {
    entry("vmmalloc_segment_changes", -1, || {
        let rt = runtime::runtime();
        if added.is_null() || removed.is_null() {
            diag::fail(
                rt.log_level(),
                LError,
                "vmmalloc_segment_changes: NULL pointer",
            );
            return -1;
        }
        let ordinal = match rt.check_ordinal(device) {
            Ok(o) => o,
            Err(m) => {
                diag::fail(
                    rt.log_level(),
                    LError,
                    &format!("vmmalloc_segment_changes({device}): {m}"),
                );
                return -1;
            }
        };
        let (a, r) = rt
            .existing(ordinal)
            .and_then(|d| d.allocator.as_segment_follow().map(|f| f.segment_changes()))
            .unwrap_or((0, 0));
        // SAFETY: both checked non-NULL; the caller promised they are valid.
        unsafe {
            *added = a;
            *removed = r;
        }
        0
    })
}
