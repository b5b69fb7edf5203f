//! Private pools: the memory of CUDA graphs and `torch.cuda.MemPool`s, as
//! PyTorch's caching allocator keeps it (`c10/cuda/CUDACachingAllocator.cpp`,
//! `PrivatePool`, `beginAllocateToPool`, `endAllocateToPool`, `releasePool`,
//! `create_or_incref_pool`, `getCheckpointState`, `setCheckpointPoolState`).
//!
//! A pool is an *owner* of memory inside the allocator: its blocks live in
//! segments of their own (never shared with the main pool or another pool),
//! its pages stay mapped while it has users (a graph replays at the
//! addresses it captured, those of the blocks it freed during capture
//! included), and it counts in the allocator's statistics like any other
//! memory. Only `expandable` has pools; the other policies refuse every call
//! here with [`AllocError::Pool`](crate::AllocError::Pool).
//!
//! The protocol, as PyTorch's allocator follows it:
//! - [`PrivatePools::begin_allocate_to_pool`] creates the pool (use count 1)
//!   or adds a user, and starts a *capture* into it: allocations the caller
//!   routes there ([`PrivatePools::pool_malloc`]) come from the pool. Two
//!   captures into one pool at once are refused ("already recording").
//!   [`PrivatePools::end_allocate_to_pool`] ends it.
//! - While any capture is underway, a free of a block that other streams
//!   used (`record_stream`) is deferred until no capture is underway
//!   (PyTorch's `needs_events_deferred_until_no_capture`: an event recorded
//!   during capture cannot be queried); every other free returns the block
//!   to its owner at once, so the same capture reuses it.
//! - [`PrivatePools::release_pool`] removes a user. At zero the pool is
//!   *freeable*: once the device has been synchronized (graph replays may
//!   still run), its free pages go back like the main pool's
//!   (`empty_cache`, or under memory pressure), and it disappears with its
//!   last block.
//! - A checkpoint is the list of the pool's live blocks
//!   ([`PrivatePools::pool_live_blocks`]): it holds no memory.
//!   [`PrivatePools::restore_pool`] frees every block of the pool and
//!   allocates the checkpointed ones again at their addresses.
//! - [`PrivatePools::pause_pool`] / [`PrivatePools::resume_pool`] give a
//!   pool's physical memory back and map it again at the same addresses
//!   (docs/pytorch.md, "Pausing a graph's pool").

use crate::{AllocResult, Allocation, Stats, Stream};

/// PyTorch's `MempoolId_t` (`std::pair<CaptureId_t, CaptureId_t>`). `(0, 0)`
/// names the main pool and is never a private pool.
pub type PoolId = (u64, u64);

/// A pool id as PyTorch prints it: `(1, 2)`.
pub fn pool_name(id: PoolId) -> String {
    format!("({}, {})", id.0, id.1)
}

/// A live block of a pool, as a checkpoint records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolBlock {
    /// Device address.
    pub ptr: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes the allocator set aside.
    pub size: u64,
    /// The stream it was allocated on.
    pub stream: Stream,
}

/// What [`PrivatePools::restore_pool`] did: the pointers it freed
/// (PyTorch's `ptrs_freed`) and the blocks it allocated again
/// (`dataptrs_allocd`), both in address order. A block live before the
/// restore and in the checkpoint is in both lists, as in PyTorch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Pointers freed.
    pub freed: Vec<u64>,
    /// Blocks allocated again, as the checkpoint recorded them.
    pub allocated: Vec<PoolBlock>,
}

/// One pool's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PoolStats {
    /// The pool's share of the allocator's statistics (current values, in
    /// `memory_stats()` shape: `allocation`, `allocated_bytes`,
    /// `reserved_bytes` (mapped pages), `active`, `active_bytes`,
    /// `requested_bytes`, `segment`; peaks equal current values).
    pub stats: Stats,
    /// Live blocks.
    pub live_blocks: u64,
    /// Users (PyTorch's `use_count`).
    pub use_count: u32,
    /// Whether a capture allocates into it now.
    pub recording: bool,
    /// Whether it is paused ([`PrivatePools::pause_pool`]).
    pub paused: bool,
    /// Bytes of host backups held while paused.
    pub backup_bytes: u64,
}

/// The private pools of one allocator (see the module docs).
pub trait PrivatePools {
    /// `create_or_incref_pool` (every `torch.cuda.MemPool`): creates pool
    /// `id` with one user, or adds one.
    fn create_or_incref_pool(&self, id: PoolId) -> AllocResult<()>;

    /// `beginAllocateToPool`: creates pool `id` or adds a user, and starts a
    /// capture into it. Refused (nothing changed) while a capture into `id`
    /// is underway, or while it is paused.
    fn begin_allocate_to_pool(&self, id: PoolId) -> AllocResult<()>;

    /// `endAllocateToPool`: the capture into `id` ended. Refused when none
    /// is underway.
    fn end_allocate_to_pool(&self, id: PoolId) -> AllocResult<()>;

    /// `releasePool`: one user of `id` is gone. Refused when it has none.
    fn release_pool(&self, id: PoolId) -> AllocResult<()>;

    /// `getPoolUseCount`.
    fn pool_use_count(&self, id: PoolId) -> AllocResult<u32>;

    /// `setUseOnOOM` (`MemPool(use_on_oom=True)`; `~MemPool` turns it off):
    /// a main-pool allocation that would otherwise run out of memory takes
    /// a free block of pool `id` (same stream, pages mapped already), which
    /// then belongs to the pool, as PyTorch's `malloc` falls back on its
    /// `use_on_oom_pools` with `get_free_block`. Refused for an unknown pool.
    fn set_use_on_oom(&self, id: PoolId, on: bool) -> AllocResult<()>;

    /// `setNoSplit` (`MemPool(no_split=True)`): from now on no block of pool
    /// `id` is split or merged, as PyTorch's `should_split` answers for its
    /// `no_split_pools`: a request takes a free block of the pool whole, or
    /// whole pages of new memory (PyTorch makes a segment of its own for
    /// it); a freed block stays as it is. Refused for an unknown pool.
    fn set_no_split(&self, id: PoolId) -> AllocResult<()>;

    /// Allocates `size` bytes on `stream` from pool `id`.
    fn pool_malloc(&self, id: PoolId, size: u64, stream: Stream) -> AllocResult<Allocation>;

    /// The pool's live blocks in address order (a free deferred during a
    /// capture counts as done, as for PyTorch).
    fn pool_live_blocks(&self, id: PoolId) -> AllocResult<Vec<PoolBlock>>;

    /// `setCheckpointPoolState`: frees every live block of pool `id` and
    /// allocates `blocks` (a checkpoint of the same pool) again at their
    /// addresses. Checked before anything changes: refused during a
    /// capture, while paused, or when a block does not fit the pool's
    /// segments.
    fn restore_pool(&self, id: PoolId, blocks: &[PoolBlock]) -> AllocResult<Restored>;

    /// The pool's figures.
    fn pool_stats(&self, id: PoolId) -> AllocResult<PoolStats>;

    /// The pools that exist, with their ids.
    fn pool_ids(&self) -> Vec<PoolId>;

    /// The pool owning live (or pending-free) block `ptr`; `None` for the main pool.
    fn pool_of(&self, ptr: u64) -> Option<PoolId>;

    /// Pauses pool `id`: synchronizes the device, copies its live blocks to
    /// host memory when `keep`, unmaps every page it maps and releases the
    /// physical memory; its addresses stay reserved. Returns the bytes
    /// released. Refused (nothing changed) during a capture or when it is
    /// paused already.
    fn pause_pool(&self, id: PoolId, keep: bool) -> AllocResult<u64>;

    /// Resumes pool `id`: maps physical memory at every page it mapped
    /// before the pause, grants access, copies the backups back. On failure
    /// (out of memory included) nothing stays mapped and the pool stays
    /// paused. Returns the bytes mapped.
    fn resume_pool(&self, id: PoolId) -> AllocResult<u64>;

    /// Captures underway (PyTorch's `captures_underway.size()`): while there
    /// is one, nothing may synchronize the device or query a capturing
    /// stream's events, and `empty_cache` returns nothing.
    fn captures_underway(&self) -> u32;

    /// Frees deferred by captures and not applied yet (blocks with
    /// `record_stream` uses freed during a capture).
    fn deferred_frees(&self) -> u64;
}
