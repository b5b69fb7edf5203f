//! Exporting the physical memory under an allocation (IPC).
//!
//! [`crate::Export::export`] answers "which physical chunks lie under
//! this allocation, and where": an allocation may span several chunks (one
//! `cuMemCreate` handle each), and its pointer may start anywhere inside the
//! first one. The caller (the C ABI's IPC module) exports each chunk's
//! handle as a POSIX file descriptor ([`vmmalloc_device::Device::export_fd`])
//! and a consumer maps them, in order, into a fresh reservation.
//!
//! While an allocation is exported its chunks stay exactly where they are:
//! the allocator never unmaps, remaps, unpins, spills or pauses them
//! (unpinning skips them, `pause` of a tag holding one fails naming it).
//! Freeing the allocation ends the export (as [`crate::Export::unexport`]).
//!
//! PyTorch's expandable-segments format (`'e'`) names one `segment_size`
//! for all handles, and PyTorch's consumer (`ExpandableSegment::fromShared`,
//! c10/cuda/CUDACachingAllocator.cpp) maps handle *i* at `base + i *
//! segment_size`. [`crate::Export::export_equal`] answers chunks of one
//! size: where the chunks under the allocation differ, the whole chunks
//! under it are re-backed once, before the export, with equal handles at
//! the same addresses (the device synchronized first, the bytes copied on
//! the device, or through host memory when there is no room beside;
//! `expandable/physical/reback.rs`). The handle size is the largest divisor
//! of the run's pages not above the largest chunk (`max_chunk`). Refused
//! while a graph is being captured (the synchronize would invalidate it)
//! and when a chunk of the run is already exported (its handles are in
//! other processes' hands). Once exported the chunks stay put as above, so
//! the run stays equal as long as it is exported; after the export ends,
//! unpinning, spill or pause may change it again, and the next export
//! re-backs again.

use vmmalloc_device::PhysHandle;

/// One physical chunk under an exported allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportedChunk {
    /// Device address where the chunk is mapped (its first byte).
    pub addr: u64,
    /// Bytes of the chunk (a multiple of the granularity).
    pub size: u64,
    /// The handle to export.
    pub handle: PhysHandle,
}

/// The chunks under one allocation, in address order and contiguous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedRange {
    /// The allocation's pointer.
    pub ptr: u64,
    /// Bytes the allocation holds (its block size, ≥ what was requested).
    pub size: u64,
    /// The chunks covering `[ptr, ptr + size)`; the first starts at or
    /// before `ptr`, they follow each other without gaps, the last ends at
    /// or after `ptr + size`.
    pub chunks: Vec<ExportedChunk>,
    /// Bytes this call re-backed with equal handles
    /// ([`crate::Export::export_equal`]; 0 when nothing moved).
    pub rebacked_bytes: u64,
}

impl ExportedRange {
    /// Offset of `ptr` within the first chunk.
    pub fn offset(&self) -> u64 {
        self.chunks.first().map_or(0, |c| self.ptr - c.addr)
    }

    /// Bytes of all chunks.
    pub fn mapped_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.size).sum()
    }
}
