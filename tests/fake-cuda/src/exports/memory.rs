//! Memory information, plain allocations, host<->device copies and
//! page-locked host memory (`cuMemHostAlloc` / `cuMemFreeHost`).
//!
//! All of them need a current context (`CUDA_ERROR_INVALID_CONTEXT` without
//! one). Copies go to whichever device owns the device address (unified
//! addressing) and must stay inside mapped, accessible memory or one plain
//! allocation; the model's code otherwise (`CUDA_ERROR_ILLEGAL_ADDRESS`, 700).
#![allow(non_snake_case)]

use crate::state::fake;
use crate::{put, run, Fail};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::ffi::{c_uint, c_void};
use std::sync::Mutex;
use vmm_sys::{CUdeviceptr, CUresult, CUDA_ERROR_OUT_OF_MEMORY};
use vmmalloc_device::Device;

/// `CUresult cuMemGetInfo_v2(size_t *free, size_t *total)` of the current
/// context's device: free = capacity minus physical memory in use.
///
/// # Safety
/// As `cuda.h` requires: `free`, `total` are each null or valid for what this call reads or writes through them.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    run("cuMemGetInfo_v2", || {
        let f = fake()?;
        if free.is_null() || total.is_null() {
            return Err(Fail::invalid("free or total is NULL"));
        }
        let dev = f.current()?;
        let info = f.host(dev).mem_info()?;
        // SAFETY: both are non-null (checked above) and writable (cuda.h).
        unsafe {
            put(free, info.free as usize, "free")?;
            put(total, info.total as usize, "total")
        }
    })
}

/// `CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`: a read-write
/// anonymous mapping on the current context's device, charged against its
/// capacity in 512-byte units (`CUDA_ERROR_OUT_OF_MEMORY` past it); size 0 is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// As `cuda.h` requires: `dptr` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    run("cuMemAlloc_v2", || {
        let f = fake()?;
        if dptr.is_null() {
            return Err(Fail::invalid("dptr is NULL"));
        }
        let dev = f.current()?;
        let host = f.host(dev);
        let addr = host.alloc(bytesize as u64)?;
        f.add_plain(addr, bytesize as u64, dev, host);
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(dptr, addr, "dptr") }
    })
}

/// `CUresult cuMemFree_v2(CUdeviceptr dptr)`: exactly a pointer `cuMemAlloc`
/// returned, once (completes queued work first, as the driver's implicit
/// synchronization does).
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    run("cuMemFree_v2", || {
        let f = fake()?;
        f.current()?;
        let (_, host) = f.judge(dptr);
        host.free(dptr)?;
        f.remove_plain(dptr);
        super::ipc::forget(dptr);
        Ok(())
    })
}

/// `CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost,
/// size_t ByteCount)`: synchronous copy into mapped, accessible device memory.
///
/// # Safety
/// As `cuda.h` requires: `srcHost` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
) -> CUresult {
    run("cuMemcpyHtoD_v2", || {
        let f = fake()?;
        f.current()?;
        if ByteCount == 0 {
            return Ok(());
        }
        if srcHost.is_null() {
            return Err(Fail::invalid("srcHost is NULL"));
        }
        // SAFETY: `srcHost` is readable for `ByteCount` bytes for the duration
        // of the call (cuda.h); the slice is only read, and the device side is
        // written with `ptr::copy`, which tolerates overlap.
        let src = unsafe { std::slice::from_raw_parts(srcHost.cast::<u8>(), ByteCount) };
        let (_, host) = f.judge(dstDevice);
        Ok(host.copy_to_device(dstDevice, src)?)
    })
}

/// `CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t
/// ByteCount)`: synchronous copy out of mapped, accessible device memory.
///
/// # Safety
/// As `cuda.h` requires: `dstHost` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    run("cuMemcpyDtoH_v2", || {
        let f = fake()?;
        f.current()?;
        if ByteCount == 0 {
            return Ok(());
        }
        if dstHost.is_null() {
            return Err(Fail::invalid("dstHost is NULL"));
        }
        // SAFETY: `dstHost` is writable for `ByteCount` bytes for the duration
        // of the call and not accessed by anyone else meanwhile (cuda.h).
        let dst = unsafe { std::slice::from_raw_parts_mut(dstHost.cast::<u8>(), ByteCount) };
        let (_, host) = f.judge(srcDevice);
        Ok(host.copy_from_device(srcDevice, dst)?)
    })
}

/// `CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
/// size_t ByteCount)`: copies between mapped, accessible device ranges
/// (each checked as `cuMemcpyDtoH_v2` / `cuMemcpyHtoD_v2` check theirs).
/// The fake completes it before returning; the real driver may still be
/// copying (docs/fake-cuda.md).
#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    run("cuMemcpyDtoD_v2", || {
        let f = fake()?;
        f.current()?;
        if ByteCount == 0 {
            return Ok(());
        }
        let mut buf = vec![0u8; ByteCount];
        let (_, from) = f.judge(srcDevice);
        from.copy_from_device(srcDevice, &mut buf)?;
        let (_, to) = f.judge(dstDevice);
        Ok(to.copy_to_device(dstDevice, &buf)?)
    })
}

/// The `CU_MEMHOSTALLOC_*` flags cuda.h defines: `PORTABLE` (0x01),
/// `DEVICEMAP` (0x02), `WRITECOMBINED` (0x04). Any other bit is
/// `CUDA_ERROR_INVALID_VALUE`, as the driver answers.
const CU_MEMHOSTALLOC_VALID: c_uint = 0x01 | 0x02 | 0x04;

/// Page-locked host allocations not yet freed: address -> (bytes, context
/// current when they were made).
static PINNED: Mutex<BTreeMap<usize, (usize, usize)>> = Mutex::new(BTreeMap::new());

/// Bytes and count of live `cuMemHostAlloc` allocations (`fakeCudaPinned`).
pub fn pinned_live() -> (u64, u64) {
    let p = PINNED.lock().unwrap_or_else(|e| e.into_inner());
    (p.values().map(|v| v.0 as u64).sum(), p.len() as u64)
}

/// Alignment of fake pinned memory (the driver returns page-aligned memory).
const PINNED_ALIGN: usize = 4096;

/// `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`:
/// zeroed, page-aligned host memory (the fake cannot lock pages; nothing
/// else differs for a caller). Needs a current context
/// (`CUDA_ERROR_INVALID_CONTEXT`); flags other than the `CU_MEMHOSTALLOC_*`
/// bits, a null `pp` or `bytesize` 0 are `CUDA_ERROR_INVALID_VALUE`; host
/// memory exhausted is `CUDA_ERROR_OUT_OF_MEMORY`.
///
/// # Safety
/// As `cuda.h` requires: `pp` is null or valid for what this call writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    Flags: c_uint,
) -> CUresult {
    run("cuMemHostAlloc", || {
        let f = fake()?;
        let ctx_dev = f.current()?;
        if pp.is_null() {
            return Err(Fail::invalid("pp is NULL"));
        }
        if Flags & !CU_MEMHOSTALLOC_VALID != 0 {
            return Err(Fail::invalid(format!(
                "Flags {Flags:#x} has bits outside CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED"
            )));
        }
        if bytesize == 0 {
            return Err(Fail::invalid("bytesize is 0"));
        }
        let layout = Layout::from_size_align(bytesize, PINNED_ALIGN)
            .map_err(|_| Fail::invalid(format!("bytesize {bytesize} is too large")))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Fail::new(
                CUDA_ERROR_OUT_OF_MEMORY,
                format!("no host memory for {bytesize} bytes"),
            ));
        }
        let addr = p.expose_provenance();
        PINNED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, (bytesize, f.device(ctx_dev as i32)?.context()));
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(pp, p.cast::<c_void>(), "pp") }
    })
}

/// `CUresult cuMemFreeHost(void *p)`: exactly a pointer `cuMemHostAlloc`
/// returned, once, with a context current (`CUDA_ERROR_INVALID_CONTEXT`
/// without one); any other pointer is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// No pointer is dereferenced before the fake has found it in its own table.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    run("cuMemFreeHost", || {
        let f = fake()?;
        f.current()?;
        let addr = p.expose_provenance();
        let Some((len, _ctx)) = PINNED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&addr)
        else {
            return Err(Fail::invalid(format!(
                "{addr:#x} is not a live cuMemHostAlloc allocation"
            )));
        };
        // SAFETY: `p` came from `alloc_zeroed` with this layout (it was in
        // PINNED, removed just now, so it is freed once).
        unsafe {
            dealloc(
                p.cast::<u8>(),
                Layout::from_size_align_unchecked(len, PINNED_ALIGN),
            )
        };
        Ok(())
    })
}
