//! The device's primary context: retained once, released on drop, and made
//! current for the length of a call (see the parent module's "Contexts").

use super::*;

/// A retained primary context; released exactly once, on drop.
pub(super) struct PrimaryContext {
    pub(super) driver: Arc<Driver>,
    pub(super) dev: CUdevice,
    /// Invariant: a live context on which this value holds one retain.
    pub(super) ctx: CUcontext,
}

// SAFETY: a CUcontext is a driver handle that may be used (made current,
// released) from any thread; the driver API is thread-safe.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for Send; `&PrimaryContext` only reads the pointer value.
unsafe impl Sync for PrimaryContext {}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: this value owns one retain of the device's primary context
        // (taken in `CudaDevice::primary`) and releases it once, here.
        match unsafe { self.driver.device_primary_ctx_release(self.dev) } {
            Ok(()) => {}
            // The driver is shutting down at process exit: nothing to release.
            Err(e) if e.code == CUDA_ERROR_DEINITIALIZED => {}
            Err(e) => eprintln!(
                "vmmalloc: releasing the primary context of CUDA device {}: {}",
                self.dev,
                describe(&self.driver, e)
            ),
        }
    }
}

/// Frees page-locked memory from `cuMemHostAlloc` with `held`'s context
/// current (pushed if another is, popped after), then drops `held` (its
/// retain keeps the context, which owns the allocation, alive until now).
/// Errors are reported on stderr: this runs in a destructor.
pub(super) fn free_pinned(held: PrimaryContext, p: std::ptr::NonNull<u8>) {
    let driver = &held.driver;
    let report = |what: &str, e: CuError| {
        if e.code != CUDA_ERROR_DEINITIALIZED {
            eprintln!(
                "vmmalloc: {what} a pinned host buffer: {}",
                describe(driver, e)
            );
        }
    };
    let pushed = match driver.ctx_get_current() {
        Ok(c) if c == held.ctx => false,
        // SAFETY: `held.ctx` is live (retained by `held`); popped below on
        // this thread.
        Ok(_) => match unsafe { driver.ctx_push_current(held.ctx) } {
            Ok(()) => true,
            Err(e) => return report("making the context current to free", e),
        },
        Err(e) => return report("querying the context to free", e),
    };
    // SAFETY: `p` came from `cuMemHostAlloc` (CudaDevice::alloc_host_buffer),
    // is freed once (the HostBuffer that owned it is being dropped), and
    // copies into or out of it are synchronous, so nothing uses it.
    if let Err(e) = unsafe { driver.mem_free_host(p.as_ptr().cast()) } {
        report("freeing", e);
    }
    if pushed {
        // SAFETY: balances the push above, on the same thread.
        if let Err(e) = unsafe { driver.ctx_pop_current() } {
            report("restoring the caller's context after freeing", e);
        }
    }
}

/// While alive, the device's primary context is current on this thread;
/// dropping it pops the context if it was pushed, so the thread's current
/// context is again what it was (see the module docs). Not `Send`: the pop
/// must happen on the thread that pushed.
#[must_use = "the context is popped when the scope is dropped"]
pub struct ContextScope<'a> {
    pub(super) driver: &'a Driver,
    pub(super) pushed: bool,
    pub(super) _not_send: PhantomData<*const ()>,
}

impl ContextScope<'_> {
    /// Whether entering pushed the primary context (false: it was current already).
    pub fn pushed(&self) -> bool {
        self.pushed
    }
}

impl Drop for ContextScope<'_> {
    fn drop(&mut self) {
        if self.pushed {
            // SAFETY: balances the cuCtxPushCurrent made by `CudaDevice::enter`
            // on this thread (the scope is not Send); whatever the caller did
            // in between ran on top of our push.
            if let Err(e) = unsafe { self.driver.ctx_pop_current() } {
                if e.code != CUDA_ERROR_DEINITIALIZED {
                    eprintln!(
                        "vmmalloc: restoring the caller's CUDA context: {}",
                        describe(self.driver, e)
                    );
                }
            }
        }
    }
}
