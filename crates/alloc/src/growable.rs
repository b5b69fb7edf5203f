//! Growable regions as a capability of a policy: a region reserves its
//! maximum address range once and maps physical memory only as it grows,
//! without moving (docs/expandable.md, "Growable regions"). Only policies
//! built on virtual-memory mapping can offer it; [`crate::Allocator::as_growable`]
//! says which do (the others' callers reallocate and copy, as before).

use crate::{AllocResult, Stream};

pub use crate::expandable::GrowableInfo;

/// A policy that offers growable regions.
pub trait Growable: Send + Sync {
    /// Reserves a region of up to `max_bytes` for work on `stream`; maps
    /// nothing. Returns its address, which never changes.
    fn growable_create(&self, max_bytes: u64, stream: Stream) -> AllocResult<u64>;
    /// Makes region `ptr` `bytes` long (`0 ≤ bytes ≤ max_bytes`); on error the
    /// region keeps its old size.
    fn growable_resize(&self, ptr: u64, bytes: u64) -> AllocResult<()>;
    /// Unmaps and unreserves region `ptr`.
    fn growable_destroy(&self, ptr: u64) -> AllocResult<()>;
    /// Size, maximum and mapping of region `ptr`.
    fn growable_info(&self, ptr: u64) -> AllocResult<GrowableInfo>;
}

impl<D: vmmalloc_device::Device> Growable for crate::expandable::ExpandableAllocator<D> {
    fn growable_create(&self, max_bytes: u64, stream: Stream) -> AllocResult<u64> {
        crate::expandable::ExpandableAllocator::growable_create(self, max_bytes, stream)
    }
    fn growable_resize(&self, ptr: u64, bytes: u64) -> AllocResult<()> {
        crate::expandable::ExpandableAllocator::growable_resize(self, ptr, bytes)
    }
    fn growable_destroy(&self, ptr: u64) -> AllocResult<()> {
        crate::expandable::ExpandableAllocator::growable_destroy(self, ptr)
    }
    fn growable_info(&self, ptr: u64) -> AllocResult<GrowableInfo> {
        crate::expandable::ExpandableAllocator::growable_info(self, ptr)
    }
}
