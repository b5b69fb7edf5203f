//! Test hooks: extra exports, not part of `cuda.h`, that let a test look
//! inside the fake (live objects, model invariants, call counts, why the last
//! call failed) and queue work on a stream as a kernel launch would.
//! Tests find them with `dlsym` on the already loaded library.
#![allow(non_snake_case)]

use crate::state::fake;
use crate::{call_count, last_error, put, run, Fail};
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use vmm_sys::{
    CUdeviceptr, CUresult, CUstream, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS,
};
use vmmalloc_device::Introspect;

/// Live objects of one device (`fakeCudaLive`). All fields are counts except
/// `physical_bytes`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FakeCudaLive {
    /// Reservations not yet freed.
    pub reservations: u64,
    /// Allocation handles not yet released.
    pub handles: u64,
    /// Mappings not yet unmapped.
    pub mappings: u64,
    /// `cuMemAlloc` allocations not yet freed.
    pub plain_allocs: u64,
    /// Physical memory in use, bytes.
    pub physical_bytes: u64,
    /// Events not yet destroyed.
    pub events: u64,
    /// Streams created (never destroyed through the entry points vmm-sys loads).
    pub streams: u64,
    /// Outstanding `cuDevicePrimaryCtxRetain`s.
    pub primary_refs: u64,
    /// Objects that were still live when the device's primary context was
    /// destroyed by its last release (leaks the driver cleaned up).
    pub destroyed_live: u64,
}

/// `CUresult fakeCudaLive(int ordinal, FakeCudaLive *out)`.
///
/// # Safety
/// As `cuda.h` requires: `out` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaLive(ordinal: c_int, out: *mut FakeCudaLive) -> CUresult {
    run("fakeCudaLive", || {
        let l = fake()?.live(ordinal)?;
        let v = FakeCudaLive {
            reservations: l.model.reservations as u64,
            handles: l.model.handles as u64,
            mappings: l.model.mappings as u64,
            plain_allocs: l.model.plain_allocs as u64,
            physical_bytes: l.model.physical_bytes,
            events: l.events,
            streams: l.streams,
            primary_refs: u64::from(l.primary_refs),
            destroyed_live: l.destroyed_live,
        };
        // SAFETY: the caller passes null or a writable FakeCudaLive.
        unsafe { put(out, v, "out") }
    })
}

/// `CUresult fakeCudaCheck(int ordinal)`: checks the device's model and host
/// bookkeeping invariants; `CUDA_ERROR_UNKNOWN` (with the reason in
/// `fakeCudaLastError`) if one is broken.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaCheck(ordinal: c_int) -> CUresult {
    run("fakeCudaCheck", || {
        let f = fake()?;
        f.device(ordinal)?;
        f.host(ordinal as usize)
            .check()
            .map_err(|e| Fail::new(CUDA_ERROR_UNKNOWN, format!("device {ordinal}: {e}")))
    })
}

/// `CUresult fakeCudaSubmitWork(CUstream stream, CUdeviceptr addr, size_t len)`:
/// queues a work item on `stream` (null: the current context's default stream)
/// that uses `[addr, addr+len)` (len 0: no memory), as a kernel launch would.
/// It stays pending until a stream, event or context synchronize.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaSubmitWork(
    stream: CUstream,
    addr: CUdeviceptr,
    len: usize,
) -> CUresult {
    run("fakeCudaSubmitWork", || {
        let s = fake()?.stream(stream.expose_provenance())?;
        s.host.streams().submit(s.inner, addr, len as u64)?;
        Ok(())
    })
}

/// `CUresult fakeCudaCallCount(const char *entry, unsigned long long *count)`:
/// calls made to a CUDA entry point since the library was loaded (failed and
/// injected ones included). Works before `cuInit`.
///
/// # Safety
/// As `cuda.h` requires: `entry`, `count` are each null or valid for what this call reads or writes through them.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaCallCount(entry: *const c_char, count: *mut u64) -> CUresult {
    run("fakeCudaCallCount", || {
        if entry.is_null() {
            return Err(Fail::invalid("entry is NULL"));
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(entry) }.to_string_lossy();
        let n = call_count(&name)
            .ok_or_else(|| Fail::invalid(format!("`{name}` is not an entry point")))?;
        // SAFETY: the caller passes null or a writable unsigned long long.
        unsafe { put(count, n, "count") }
    })
}

/// `CUresult fakeCudaLastError(char *buf, size_t len)`: why the last failed
/// call on this thread failed (`"cuMemMap -> CUDA_ERROR_INVALID_VALUE (1):
/// map: range is already mapped: ..."`), NUL-terminated and truncated to
/// `len`; empty if none failed. Does not change the recorded error itself.
///
/// # Safety
/// As `cuda.h` requires: `buf` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaLastError(buf: *mut c_char, len: usize) -> CUresult {
    let done = catch_unwind(AssertUnwindSafe(|| {
        if buf.is_null() || len == 0 {
            return CUDA_ERROR_INVALID_VALUE;
        }
        let text = last_error().replace('\0', " ");
        let n = text.len().min(len - 1);
        // SAFETY: `buf` is writable for `len` bytes (the caller's contract);
        // we write `n + 1 <= len` bytes from our own string.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
            buf.add(n).write(0);
        }
        CUDA_SUCCESS
    }));
    done.unwrap_or(CUDA_ERROR_UNKNOWN)
}

/// `CUresult fakeCudaContextDepth(int *depth)`: the depth of the calling
/// thread's context stack (0: no context current).
///
/// # Safety
/// `depth` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaContextDepth(depth: *mut c_int) -> CUresult {
    run("fakeCudaContextDepth", || {
        let d = crate::state::context_depth() as c_int;
        // SAFETY: null or writable (function contract).
        unsafe { put(depth, d, "depth") }
    })
}

/// `CUresult fakeCudaPinned(unsigned long long *bytes, unsigned long long *count)`:
/// bytes and number of page-locked host allocations (`cuMemHostAlloc`) not
/// yet freed with `cuMemFreeHost`, process-wide. Works before `cuInit`.
///
/// # Safety
/// `bytes` and `count` are each null or writable.
#[no_mangle]
pub unsafe extern "C" fn fakeCudaPinned(bytes: *mut u64, count: *mut u64) -> CUresult {
    run("fakeCudaPinned", || {
        let (b, n) = crate::exports::memory::pinned_live();
        // SAFETY: null or writable (function contract).
        unsafe {
            put(bytes, b, "bytes")?;
            put(count, n, "count")
        }
    })
}
