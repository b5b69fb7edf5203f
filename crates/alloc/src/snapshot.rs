//! A point-in-time picture of an allocator's segments and blocks
//! (the shape of PyTorch's `torch.cuda.memory_snapshot()`).

use serde::Serialize;
use vmmalloc_device::Stream;

/// State of a block, as PyTorch names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BlockState {
    /// Allocated to a live tensor.
    ActiveAllocated,
    /// Freed by the caller, waiting for stream events before reuse.
    ActivePendingFree,
    /// Free and mapped.
    Inactive,
    /// Free address space without physical pages behind it (expandable segments).
    Unmapped,
    /// Allocated to a live tensor whose tag is paused (sleep and wake): no
    /// physical memory behind it until resume. Not a PyTorch state.
    Paused,
}

impl BlockState {
    /// PyTorch's string for the state (`active_allocated`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
            BlockState::Unmapped => "unmapped",
            BlockState::Paused => "paused",
        }
    }
}

/// One block inside a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// Device address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes requested by the caller (0 when free).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
}

/// One segment: a contiguous range the allocator manages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    /// Device address.
    pub address: u64,
    /// Bytes of address space (for expandable segments: mapped + unmapped tail).
    pub total_size: u64,
    /// Stream that owns the segment.
    pub stream: Stream,
    /// `"small"` or `"large"` pool.
    pub segment_type: &'static str,
    /// Bytes in active blocks.
    pub allocated_size: u64,
    /// Bytes in active or pending-free blocks.
    pub active_size: u64,
    /// Bytes requested by callers.
    pub requested_size: u64,
    /// Whether the segment grows by mapping pages.
    pub is_expandable: bool,
    /// The private pool owning the segment (PyTorch's `segment_pool_id`;
    /// `(0, 0)`: the main pool).
    pub pool: (u64, u64),
    /// Blocks in address order, covering the segment.
    pub blocks: Vec<BlockInfo>,
}

/// Segments and blocks, plus page-pool figures.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Snapshot {
    /// Device ordinal.
    pub device: u32,
    /// Segments in address order.
    pub segments: Vec<SegmentInfo>,
    /// Bytes of physical pages mapped.
    pub mapped_bytes: u64,
    /// Bytes of physical pages held unmapped in the pool.
    pub pooled_bytes: u64,
}
