//! Importing PyTorch's legacy CUDA IPC handles (`'c'` + `cudaIpcMemHandle_t`):
//! memory of PyTorch's default caching allocator (`cudaMalloc` segments),
//! which `DeviceCachingAllocator::shareIpcHandle` exports with
//! `cudaIpcGetMemHandle` on the segment's base block and
//! `NativeCachingAllocator::getIpcDevPtr` opens with `cudaIpcOpenMemHandle`
//! (c10/cuda/CUDACachingAllocator.cpp).
//!
//! vmmalloc opens it the same way, through the driver: `cuIpcOpenMemHandle`
//! with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` (the only flag the call takes,
//! cuda.h) in the target device's primary context (the one the CUDA runtime,
//! and so PyTorch, uses), and closes it with `cuIpcCloseMemHandle`. The
//! driver counts references: opening the same handle again in the same
//! context returns the same pointer (cuda.h, `cuIpcOpenMemHandle`), so two
//! imports of one handle are two closes. Only `device:cuda` can do this: the
//! memory is a `cuMemAlloc` allocation that only the driver can map.

use std::sync::Arc;
use vmm_sys::{
    CUcontext, CUdevice, CUdeviceptr, CUipcMemHandle, Driver, CU_IPC_HANDLE_SIZE,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
};

/// One opened legacy handle: close it with [`Opened::close`].
#[derive(Debug)]
pub struct Opened {
    driver: Arc<Driver>,
    dev: CUdevice,
    /// The retained primary context, as an address (`CUcontext` is a raw
    /// pointer, which would make this type neither `Send` nor `Sync`).
    ctx: usize,
    /// The pointer `cuIpcOpenMemHandle` returned.
    pub dptr: u64,
}

/// Runs `f` with `ctx` current on this thread, then restores the previous one.
fn in_context<T>(
    driver: &Driver,
    ctx: usize,
    f: impl FnOnce() -> Result<T, String>,
) -> Result<T, String> {
    // SAFETY: `ctx` is a primary context this module retained and has not
    // released; pushing it changes only this thread's context stack, which
    // the pop below restores.
    unsafe { driver.ctx_push_current(std::ptr::with_exposed_provenance_mut(ctx)) }
        .map_err(|e| format!("making device's primary context current: {e}"))?;
    let r = f();
    // SAFETY: pops exactly the context pushed above.
    let popped = unsafe { driver.ctx_pop_current() };
    match (r, popped) {
        (Ok(v), Ok(_)) => Ok(v),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(format!("restoring the caller's context: {e}")),
    }
}

/// Opens `handle` (64 bytes) on device ordinal `ordinal`.
pub fn open(ordinal: u32, handle: &[u8; CU_IPC_HANDLE_SIZE]) -> Result<Opened, String> {
    let driver = Driver::global().map_err(|e| format!("loading the CUDA driver: {e}"))?;
    let dev = driver
        .device_get(ordinal as i32)
        .map_err(|e| format!("device {ordinal}: {e}"))?;
    let ctx: CUcontext = driver
        .device_primary_ctx_retain(dev)
        .map_err(|e| format!("device {ordinal}: retaining its primary context: {e}"))?;
    let ctx = ctx.expose_provenance();
    let h = CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let opened = in_context(&driver, ctx, || {
        driver
            .ipc_open_mem_handle(h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            .map_err(|e| e.to_string())
    });
    match opened {
        Ok(dptr) => Ok(Opened {
            driver,
            dev,
            ctx,
            dptr,
        }),
        Err(e) => {
            // Roll back the retain.
            // SAFETY: releases the retain made above, which nothing else uses.
            let _ = unsafe { driver.device_primary_ctx_release(dev) };
            Err(e)
        }
    }
}

impl Opened {
    /// `cuIpcCloseMemHandle` of the pointer, then releases the primary
    /// context retained by [`open`]. The caller has waited for the work
    /// that used the mapping.
    pub fn close(self) -> Result<(), String> {
        let p: CUdeviceptr = self.dptr;
        let r = in_context(&self.driver, self.ctx, || {
            // SAFETY: `p` is what cuIpcOpenMemHandle returned for this
            // import, closed once (the import is removed from the registry
            // before this call); the caller waited for the work using it.
            unsafe { self.driver.ipc_close_mem_handle(p) }.map_err(|e| e.to_string())
        });
        // SAFETY: releases the retain `open` made, once.
        let released = unsafe { self.driver.device_primary_ctx_release(self.dev) };
        r?;
        released.map_err(|e| format!("releasing the primary context: {e}"))
    }
}
