//! Region mode (issue 24): vmmalloc as the allocator of a
//! `torch.cuda.MemPool` while PyTorch's own allocator stays current.
//!
//! ```c
//! // CUDAPluggableAllocator(path, "vmmalloc_region_malloc", "vmmalloc_free"),
//! // wrapped in torch.cuda.MemPool(...) and entered with torch.cuda.use_mem_pool.
//! void* vmmalloc_region_malloc(size_t size, int device, void* stream);
//! ```
//!
//! Inside a MemPool with a custom allocator, PyTorch's caching allocator asks
//! that allocator for whole segments (`allocPrimitive` in
//! c10/cuda/CUDACachingAllocator.cpp: `*ptr = ...->allocator()->raw_alloc(size);
//! return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;`). A NULL answer is
//! its out-of-memory protocol: it then frees the pool's cached blocks, retries,
//! and raises `torch.cuda.OutOfMemoryError` itself. `vmmalloc_malloc` throws
//! instead (`on_oom:raise`), which would skip that retry, so region mode uses
//! this entry point, which never throws.

use std::ffi::{c_int, c_void};

/// Allocates `size` bytes on `device` for `stream` as [`super::vmmalloc_try_malloc`]
/// does (tagged with the calling thread's tag), returning the pointer, or NULL
/// on any failure (the reason in `vmmalloc_last_error`, logged as every
/// failure is). Never throws, whatever `on_oom` says (except `on_oom:abort`,
/// which still aborts). NULL for size 0.
#[no_mangle]
pub extern "C" fn vmmalloc_region_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // The rc only classifies the failure; NULL carries it to PyTorch.
    let _ = super::try_malloc(
        "vmmalloc_region_malloc",
        size,
        device,
        stream,
        None,
        &mut out,
    );
    out
}
