//! `torch-es`: a replica of PyTorch's `expandable_segments:True`
//! (`struct ExpandableSegment` and the expandable paths of
//! `DeviceCachingAllocator` in `c10/cuda/CUDACachingAllocator.cpp`), the honest
//! peer of our expandable allocator.
//!
//! It is the [`caching`](crate::caching) engine with expandable segments on:
//! one segment per (stream, pool), each reserving 1⅛ × device memory of address
//! space; pages of 2 MiB (small pool) and 20 MiB (large pool), each its own
//! `cuMemCreate` + `cuMemMap`, one `cuMemSetAccess` per newly mapped range;
//! a segment grows at the lowest free address with room (normally its end);
//! requests map just the pages their rounded size needs (no 20 MiB minimum
//! segment, no 2 MiB rounding) and blocks split whenever 512 bytes remain.
//! Free pages are unmapped and released only by `empty_cache` and by the last
//! out-of-memory retry (`release_cached_blocks`), after waiting for outstanding
//! events and synchronizing the segment's stream; there is no page pool.

use crate::caching::{delegate_allocator, CachingConfig, DeviceCachingAllocator};
use crate::AllocResult;
use vmmalloc_device::Device;

/// The `torch-es` policy: PyTorch's caching allocator with
/// `expandable_segments:True` (whatever the config says).
pub struct TorchEsAllocator<D: Device>(DeviceCachingAllocator<D>);

impl<D: Device> TorchEsAllocator<D> {
    /// Creates the allocator over `device` with PyTorch's options `config`.
    pub fn new(device: D, config: CachingConfig) -> AllocResult<Self> {
        Ok(TorchEsAllocator(DeviceCachingAllocator::with_mode(
            device, config, true,
        )?))
    }
}

delegate_allocator!(TorchEsAllocator);
