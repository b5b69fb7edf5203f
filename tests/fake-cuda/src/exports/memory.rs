//! Memory information, plain allocations and host<->device copies.
//!
//! All of them need a current context (`CUDA_ERROR_INVALID_CONTEXT` without
//! one). Copies go to whichever device owns the device address (unified
//! addressing) and must stay inside mapped, accessible memory or one plain
//! allocation; the model's code otherwise (`CUDA_ERROR_ILLEGAL_ADDRESS`, 700).
#![allow(non_snake_case)]

use crate::state::fake;
use crate::{put, run, Fail};
use std::ffi::c_void;
use vmm_sys::{CUdeviceptr, CUresult};
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
