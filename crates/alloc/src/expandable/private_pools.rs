//! Private pools (CUDA graphs, `torch.cuda.MemPool`) as owners of memory
//! inside the allocator, with PyTorch's semantics
//! (`c10/cuda/CUDACachingAllocator.cpp`: `PrivatePool`, `beginAllocateToPool`,
//! `endAllocateToPool`, `releasePool`, `create_or_incref_pool`, `free`'s
//! `needs_events_deferred_until_no_capture`, `setCheckpointPoolState`,
//! `release_cached_blocks`' `graph_pools_freeable`). The public protocol is
//! [`crate::pools`]'s; this file keeps the state.
//!
//! # Owners
//!
//! Every stream entry (`segment.rs`) belongs to the main pool (`pool` 0) or to
//! one private pool (`pool` = its slot + 1; slots are never reused, so a
//! stale entry never names another pool). A pool's blocks therefore live in
//! segments of their own, as a tag's do (`sleep.rs`): nothing outside the
//! pool is carved from its address ranges or its pages, and its bytes count
//! in the allocator's statistics like every other block's.
//!
//! # Pinned pages
//!
//! A CUDA graph replays at the addresses it captured, the blocks it freed
//! during capture included, and a replay may be running on any stream. So
//! while a pool has users, or until the device was synchronized after its
//! last user left, its segments are *pinned* ([`super::chunks::ChunkTable::pinned`]):
//! reclaim, splits, unpinning, spill and `empty_cache` never choose their
//! pages. A freeable pool (use count 0) is unpinned after one device
//! synchronize, at `empty_cache` or when the ladder needs memory
//! ([`Inner::unpin_freeable_pools`], as PyTorch releases freeable pools in
//! `release_cached_blocks`); from then on its free pages go back like the
//! main pool's, and the pool disappears with its last block.
//!
//! # Frees during a capture
//!
//! While a capture is underway (`captures` > 0) a freed block that other
//! streams used is *deferred* (`deferred`): it stays pending, no event is
//! recorded, until the first allocation with no capture underway
//! ([`Inner::flush_deferred`]). Every other free returns the block to its
//! owner at once, main pool or private pool, so the capture reuses it.
//!
//! # Checkpoints and restore
//!
//! A checkpoint is the list of the pool's live blocks; it holds nothing.
//! [`Inner::restore_pool`] frees every block of the pool and allocates the
//! checkpointed ones again at their addresses (their pages stayed mapped:
//! the pool is pinned).
//!
//! # Pause and resume
//!
//! [`Inner::pause_pool`] synchronizes the device (a kernel in flight must
//! not fault), copies the live blocks to host memory when asked, unmaps
//! every page the pool maps and releases the handles; every segment and
//! block stays (the addresses are the graph's). [`Inner::resume_pool`] maps
//! the same pages again (access for every device the allocator grants), and
//! copies the backups back; on failure it unmaps what it mapped and the
//! pool stays paused.

use super::blocks::BlockState;
use super::ladder::Need;
use super::pages::Backing;
use super::Inner;
use crate::pools::{pool_name, PoolBlock, PoolId, PoolStats, Restored};
use crate::stats::StatType;
use crate::{AllocError, AllocResult, Allocation, Stats};
use rustc_hash::{FxHashMap, FxHashSet};
use vmmalloc_device::{Device, DeviceResult, HostBuffer, Stream};

/// What a paused pool keeps to be resumed.
#[derive(Debug, Default)]
pub(crate) struct PausedPool {
    /// Per segment, the page runs `(first, count)` mapped at the pause.
    runs: Vec<(u32, Vec<(u64, u64)>)>,
    /// Host copies of the live blocks, by address (empty when not kept).
    backups: FxHashMap<u64, HostBuffer>,
    /// Sum of the backups' lengths.
    backup_bytes: u64,
}

/// One private pool (PyTorch's `PrivatePool`).
#[derive(Debug)]
pub(crate) struct PrivatePool {
    /// PyTorch's id.
    id: PoolId,
    /// Users: graphs, `MemPool`s, `use_mem_pool` blocks underway.
    use_count: u32,
    /// A capture allocates into it now.
    recording: bool,
    /// Its segments' pages stay put (see the module docs).
    pinned: bool,
    /// Set while paused.
    paused: Option<PausedPool>,
    /// Main-pool allocations about to run out of memory may take its free
    /// blocks (`MemPool(use_on_oom=True)`, PyTorch's `use_on_oom_pools`).
    use_on_oom: bool,
    /// Its blocks are never split nor merged (`MemPool(no_split=True)`,
    /// PyTorch's `no_split_pools`).
    no_split: bool,
}

/// The private pools of one allocator and the frees deferred by captures.
#[derive(Debug, Default)]
pub(crate) struct PoolTable {
    /// Pools by slot (`None`: gone; slots are not reused).
    slots: Vec<Option<PrivatePool>>,
    /// Slot of each live pool's id.
    by_id: FxHashMap<PoolId, u32>,
    /// Ids of pools that existed and are gone (to name the error).
    gone: FxHashSet<PoolId>,
    /// Captures underway (PyTorch's `captures_underway`).
    pub captures: u32,
    /// Blocks freed during a capture that wait for it to end (PyTorch's
    /// `needs_events_deferred_until_no_capture`).
    pub deferred: Vec<u32>,
    /// Numbers of the pools with `use_on_oom`, in the order it was set.
    oom_pools: Vec<u32>,
}

impl PoolTable {
    /// The pool with entry number `p` (slot + 1), if it exists.
    #[inline]
    fn get(&self, p: u32) -> Option<&PrivatePool> {
        self.slots.get(p as usize - 1).and_then(Option::as_ref)
    }

    /// Whether no pool exists.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Drops the backup of a block freed at `ptr` in a paused pool.
    pub fn forget(&mut self, ptr: u64) {
        for p in self.slots.iter_mut().flatten() {
            if let Some(paused) = &mut p.paused {
                if let Some(b) = paused.backups.remove(&ptr) {
                    paused.backup_bytes -= b.len() as u64;
                    return;
                }
            }
        }
    }
}

fn err(text: String) -> AllocError {
    AllocError::Pool(text)
}

impl Inner {
    // --- Owners --------------------------------------------------------------

    /// Whether the segments of stream entry `owner` belong to a pinned pool.
    #[inline]
    pub(super) fn owner_pinned(&self, owner: u32) -> bool {
        let p = self.streams[owner as usize].pool;
        p != 0 && self.pools.get(p).is_some_and(|x| x.pinned)
    }

    /// Whether the memory of stream entry `owner` is paused: its tag's
    /// (main pool) or its private pool's.
    #[inline]
    pub(super) fn owner_paused(&self, owner: u32) -> bool {
        let e = &self.streams[owner as usize];
        if e.pool == 0 {
            self.sleep.is_paused(e.tag)
        } else {
            self.pools.get(e.pool).is_some_and(|x| x.paused.is_some())
        }
    }

    /// The id of the pool owning stream entry `owner` (`(0, 0)`: the main pool).
    pub(super) fn owner_pool_id(&self, owner: u32) -> PoolId {
        match self.streams[owner as usize].pool {
            0 => (0, 0),
            p => self.pools.get(p).map_or((0, 0), |x| x.id),
        }
    }

    /// The entry number (slot + 1) of pool `id`, or the error naming it.
    fn pool_number(&self, id: PoolId) -> AllocResult<u32> {
        match self.pools.by_id.get(&id) {
            Some(&s) => Ok(s + 1),
            None if self.pools.gone.contains(&id) => Err(err(format!(
                "unknown pool {}: it was released and has gone (its last block was freed)",
                pool_name(id)
            ))),
            None => Err(err(format!(
                "unknown pool {}: no beginAllocateToPool or MemPool created it",
                pool_name(id)
            ))),
        }
    }

    fn pool_mut(&mut self, p: u32) -> &mut PrivatePool {
        match self.pools.slots[p as usize - 1].as_mut() {
            Some(x) => x,
            None => unreachable!("pool {p} is gone but still referenced"),
        }
    }

    fn pool_ref(&self, p: u32) -> &PrivatePool {
        match self.pools.get(p) {
            Some(x) => x,
            None => unreachable!("pool {p} is gone but still referenced"),
        }
    }

    /// Live segments of pool number `p`.
    fn pool_segments(&self, p: u32) -> Vec<u32> {
        (0..self.segments.len() as u32)
            .filter(|&i| {
                self.segments[i as usize]
                    .as_ref()
                    .is_some_and(|s| self.streams[s.owner as usize].pool == p)
            })
            .collect()
    }

    /// Pins or unpins pool number `p` and its segments.
    fn set_pool_pinned(&mut self, p: u32, pinned: bool) {
        self.pool_mut(p).pinned = pinned;
        for s in self.pool_segments(p) {
            self.phys.set_pinned(s, pinned);
        }
    }

    /// Creates pool `id` with one user; returns its number.
    fn create_pool(&mut self, id: PoolId) -> AllocResult<u32> {
        if id == (0, 0) {
            return Err(err(
                "pool (0, 0) is the main pool, not a private pool".to_string()
            ));
        }
        let slot = self.pools.slots.len() as u32;
        self.pools.slots.push(Some(PrivatePool {
            id,
            use_count: 1,
            recording: false,
            pinned: true,
            paused: None,
            use_on_oom: false,
            no_split: false,
        }));
        self.pools.by_id.insert(id, slot);
        self.pools.gone.remove(&id);
        Ok(slot + 1)
    }

    /// Adds a user to pool number `p` (a freeable pool is pinned again).
    fn incref_pool(&mut self, p: u32) {
        let x = self.pool_mut(p);
        x.use_count += 1;
        if !x.pinned {
            self.set_pool_pinned(p, true);
        }
    }

    // --- The protocol ----------------------------------------------------------

    /// `create_or_incref_pool`.
    pub(super) fn create_or_incref_pool(&mut self, id: PoolId) -> AllocResult<()> {
        match self.pools.by_id.get(&id) {
            Some(&s) => {
                self.incref_pool(s + 1);
                Ok(())
            }
            None => self.create_pool(id).map(|_| ()),
        }
    }

    /// `beginAllocateToPool`.
    pub(super) fn begin_allocate_to_pool(&mut self, id: PoolId) -> AllocResult<()> {
        let p = match self.pools.by_id.get(&id) {
            Some(&s) => {
                let x = self.pool_ref(s + 1);
                if x.recording {
                    // PyTorch's words (TORCH_CHECK in beginAllocateToPool).
                    return Err(err(format!(
                        "beginAllocateToPool: already recording to mempool_id {} (nothing changed)",
                        pool_name(id)
                    )));
                }
                if x.paused.is_some() {
                    return Err(err(format!(
                        "beginAllocateToPool: pool {} is paused; resume it first (nothing changed)",
                        pool_name(id)
                    )));
                }
                self.incref_pool(s + 1);
                s + 1
            }
            None => self.create_pool(id)?,
        };
        self.pool_mut(p).recording = true;
        self.pools.captures += 1;
        Ok(())
    }

    /// `endAllocateToPool`.
    pub(super) fn end_allocate_to_pool(&mut self, id: PoolId) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        if !self.pool_ref(p).recording {
            return Err(err(format!(
                "endAllocateToPool: not currently recording to mempool_id {}",
                pool_name(id)
            )));
        }
        self.pool_mut(p).recording = false;
        self.pools.captures -= 1;
        Ok(())
    }

    /// `releasePool`.
    pub(super) fn release_pool(&mut self, id: PoolId) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        let x = self.pool_mut(p);
        if x.use_count == 0 {
            return Err(err(format!(
                "releasePool: pool {} has no users left (released already)",
                pool_name(id)
            )));
        }
        x.use_count -= 1;
        if x.use_count == 0 {
            // Freeable: pinned until the device is synchronized (a replay
            // may still run), unless it has no memory at all.
            self.drop_dead_pools();
        }
        Ok(())
    }

    /// `getPoolUseCount`.
    pub(super) fn pool_use_count(&self, id: PoolId) -> AllocResult<u32> {
        let p = self.pool_number(id)?;
        Ok(self.pool_ref(p).use_count)
    }

    /// Allocates from pool `id`.
    pub(super) fn pool_malloc<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
        size: u64,
        stream: Stream,
    ) -> AllocResult<Allocation> {
        let p = self.pool_number(id)?;
        let x = self.pool_ref(p);
        if x.paused.is_some() {
            return Err(err(format!(
                "cannot allocate in pool {}: it is paused (resume it first; allocating resumes nothing)",
                pool_name(id)
            )));
        }
        if x.use_count == 0 {
            return Err(err(format!(
                "cannot allocate in pool {}: it was released (no users left)",
                pool_name(id)
            )));
        }
        self.malloc_owned(dev, size, stream, 0, p)
    }

    /// `setUseOnOOM`: whether main-pool allocations about to fail for lack
    /// of memory may take free blocks of pool `id`
    /// ([`Inner::malloc_from_oom_pools`]).
    pub(super) fn set_use_on_oom(&mut self, id: PoolId, on: bool) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        self.pool_mut(p).use_on_oom = on;
        self.pools.oom_pools.retain(|&q| q != p);
        if on {
            self.pools.oom_pools.push(p);
        }
        Ok(())
    }

    /// The last resort of a main-pool allocation that found no memory
    /// (PyTorch's `malloc`: "we are about to oom, try to use existing
    /// mempools as a last resort", `use_on_oom_pools`, `get_free_block`):
    /// a free block of a `use_on_oom` pool, on the same stream, whose pages
    /// are mapped already, in the order the pools were set; no memory is
    /// created for it. The block is the pool's (its bytes count there and
    /// go back to it when freed), as PyTorch's `mempool_params` make it.
    /// Paused pools and pools without users are skipped; `tag` other than 0
    /// (a sleep tag's allocation, which must stay in the tag's memory) and
    /// allocations into a pool take nothing.
    pub(super) fn malloc_from_oom_pools(
        &mut self,
        size: u64,
        rounded: u64,
        stream: Stream,
        tag: u32,
        kind: super::blocks::PoolKind,
    ) -> Option<Allocation> {
        if self.pools.oom_pools.is_empty() || tag != 0 {
            return None;
        }
        for p in self.pools.oom_pools.clone() {
            match self.pools.get(p) {
                Some(x) if x.paused.is_none() && x.use_count > 0 => {}
                _ => continue,
            }
            let Some(owner) = self
                .streams
                .iter()
                .position(|e| e.stream == stream && e.tag == 0 && e.pool == p)
            else {
                continue;
            };
            let Some(idx) = self.find_free(owner as u32, kind, rounded) else {
                continue;
            };
            let seg = self.slab[idx].seg;
            let addr = self.page_aligned_start(idx, rounded, kind);
            let (p0, p1) = self.seg(seg).page_span(&self.layout, addr, rounded);
            if !self.table(seg).all_mapped(p0, p1) {
                continue;
            }
            let idx = self.carve_at(idx, addr);
            return Some(self.take_block(idx, size, rounded, stream));
        }
        None
    }

    /// `setNoSplit` (`MemPool(no_split=True)`, PyTorch's `no_split_pools`
    /// and `should_split`): from now on a block of pool `id` is never split
    /// nor merged. A request takes whole pages of the segment's unused end
    /// (PyTorch makes a segment of its own for it), or a free block of the
    /// pool whole; a freed block stays as it is, to be taken whole again.
    pub(super) fn set_no_split(&mut self, id: PoolId) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        self.pool_mut(p).no_split = true;
        Ok(())
    }

    /// Whether stream entry `owner` belongs to a `no_split` pool.
    #[inline]
    pub(super) fn owner_no_split(&self, owner: u32) -> bool {
        let p = self.streams[owner as usize].pool;
        p != 0 && self.pools.get(p).is_some_and(|x| x.no_split)
    }

    /// The pool owning block `ptr` (live or pending free), if a private one.
    pub(super) fn pool_of(&self, ptr: u64) -> Option<PoolId> {
        let idx = match self.live.get(&ptr) {
            Some(&i) => i,
            None => return None,
        };
        let p = self.streams[self.seg(self.slab[idx].seg).owner as usize].pool;
        (p != 0).then(|| self.pool_ref(p).id)
    }

    /// The ids of the pools that exist.
    pub(super) fn pool_ids(&self) -> Vec<PoolId> {
        let mut v: Vec<PoolId> = self.pools.by_id.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The live blocks of pool number `p`, in address order.
    fn live_blocks_of(&self, p: u32) -> Vec<PoolBlock> {
        let mut out = Vec::new();
        for s in self.pool_segments(p) {
            let seg = self.seg(s);
            let stream = self.streams[seg.owner as usize].stream;
            for b in self.blocks_in(seg) {
                if b.state == BlockState::Allocated {
                    out.push(PoolBlock {
                        ptr: b.addr,
                        requested: b.requested,
                        size: b.size,
                        stream,
                    });
                }
            }
        }
        out.sort_unstable_by_key(|b| b.ptr);
        out
    }

    /// The live blocks of pool `id`.
    pub(super) fn pool_live_blocks(&self, id: PoolId) -> AllocResult<Vec<PoolBlock>> {
        Ok(self.live_blocks_of(self.pool_number(id)?))
    }

    /// Pool `id`'s figures (a recount of its segments).
    pub(super) fn pool_stats(&self, id: PoolId) -> AllocResult<PoolStats> {
        let p = self.pool_number(id)?;
        let mut stats = Stats::default();
        let mut live = 0;
        for s in self.pool_segments(p) {
            let seg = self.seg(s);
            let t = match seg.kind {
                super::blocks::PoolKind::Small => StatType::Small,
                super::blocks::PoolKind::Large => StatType::Large,
            };
            stats.segment.update(t, 1);
            let mapped = self.table(s).mapped_pages() * self.layout.page;
            stats.reserved_bytes.update(t, mapped as i64);
            for b in self.blocks_in(seg) {
                if b.state == BlockState::Free {
                    continue;
                }
                stats.active.update(t, 1);
                stats.active_bytes.update(t, b.size as i64);
                if b.state == BlockState::Allocated {
                    live += 1;
                    stats.allocation.update(t, 1);
                    stats.allocated_bytes.update(t, b.size as i64);
                    stats.requested_bytes.update(t, b.requested as i64);
                }
            }
        }
        stats.max_split_size = i64::MAX;
        let x = self.pool_ref(p);
        Ok(PoolStats {
            stats,
            live_blocks: live,
            use_count: x.use_count,
            recording: x.recording,
            paused: x.paused.is_some(),
            backup_bytes: x.paused.as_ref().map_or(0, |b| b.backup_bytes),
        })
    }

    // --- Deferred frees and freeable pools -------------------------------------

    /// Records the end-of-life events of the blocks freed during captures
    /// (no capture is underway now); a block with no event left is free at
    /// once. A block whose streams are still capturing (between
    /// `endAllocateToPool` and the end of the stream capture), or whose
    /// events cannot be recorded, waits for the next call.
    pub(super) fn flush_deferred<D: Device + ?Sized>(&mut self, dev: &D) {
        for idx in std::mem::take(&mut self.pools.deferred) {
            let capturing = self.slab[idx]
                .streams
                .as_ref()
                .is_some_and(|v| v.iter().any(|&s| dev.is_capturing(s).unwrap_or(true)));
            if capturing {
                self.pools.deferred.push(idx);
                continue;
            }
            match self.record_free_events(dev, idx) {
                Ok(0) => self.free_block(idx),
                Ok(_) => {}
                Err(_) => self.pools.deferred.push(idx),
            }
        }
    }

    /// Whether some pool is freeable (no users, no capture) but still pinned.
    pub(super) fn has_freeable_pinned(&self) -> bool {
        self.pools
            .slots
            .iter()
            .flatten()
            .any(|x| x.pinned && x.use_count == 0 && !x.recording)
    }

    /// Unpins the freeable pools after one device synchronize (a graph
    /// replay may still be running on any stream), so that their free pages
    /// can go back. Not while a capture is underway (a device synchronize
    /// would invalidate it). Returns whether any pool was unpinned.
    pub(super) fn unpin_freeable_pools<D: Device + ?Sized>(&mut self, dev: &D) -> bool {
        if self.pools.captures > 0 || !self.has_freeable_pinned() {
            return false;
        }
        if self.synchronize_device(dev).is_err() {
            return false;
        }
        let freeable: Vec<u32> = (1..=self.pools.slots.len() as u32)
            .filter(|&p| {
                self.pools
                    .get(p)
                    .is_some_and(|x| x.pinned && x.use_count == 0 && !x.recording)
            })
            .collect();
        for p in freeable {
            self.set_pool_pinned(p, false);
        }
        self.drop_dead_pools();
        true
    }

    /// `cuCtxSynchronize`, counted; every stream counts as waited for.
    fn synchronize_device<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        self.phys.sync_device(dev)?;
        self.stats.num_sync_all_streams += 1;
        let tick = self.tick;
        for e in &mut self.streams {
            e.synced_at = tick;
        }
        Ok(())
    }

    /// Removes the pools with no user, no capture and no memory left: their
    /// segments hold no block and map no page (they are retired). A
    /// freeable pool that still maps pages or holds blocks stays; its
    /// empty segments are retired unless it is paused (a paused pool keeps
    /// its addresses while it has blocks).
    pub(super) fn drop_dead_pools(&mut self) {
        for p in 1..=self.pools.slots.len() as u32 {
            let Some(x) = self.pools.get(p) else { continue };
            if x.use_count > 0 || x.recording {
                continue;
            }
            let paused = x.paused.is_some();
            let segs = self.pool_segments(p);
            let empty = |me: &Self, s: u32| me.seg(s).active_blocks == 0 && me.table(s).is_empty();
            if segs.iter().all(|&s| empty(self, s)) {
                // Nothing left to resume: the pause ends with the pool.
                self.pool_mut(p).paused = None;
                let mut left = 0;
                for s in segs {
                    if !self.retire_segment_if_empty(s) {
                        left += 1;
                    }
                }
                if left == 0 {
                    let id = self.pool_ref(p).id;
                    self.pools.oom_pools.retain(|&q| q != p);
                    self.pools.slots[p as usize - 1] = None;
                    self.pools.by_id.remove(&id);
                    self.pools.gone.insert(id);
                }
            } else if !paused {
                for s in segs {
                    if empty(self, s) {
                        self.retire_segment_if_empty(s);
                    }
                }
            }
        }
    }

    // --- Restore ----------------------------------------------------------------

    /// `setCheckpointPoolState` (see the module docs). Nothing changes when
    /// it fails.
    pub(super) fn restore_pool<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
        blocks: &[PoolBlock],
    ) -> AllocResult<Restored> {
        let p = self.pool_number(id)?;
        let name = pool_name(id);
        if self.pools.captures > 0 {
            return Err(err(format!(
                "setCheckpointPoolState of pool {name}: a capture is underway (nothing changed)"
            )));
        }
        if self.pool_ref(p).paused.is_some() {
            return Err(err(format!(
                "setCheckpointPoolState of pool {name}: it is paused; resume it first (nothing changed)"
            )));
        }
        if self.pool_ref(p).no_split {
            // Its free blocks are not merged: a checkpointed block may span
            // several of them.
            return Err(err(format!(
                "setCheckpointPoolState of pool {name}: it is a no_split pool (nothing changed)"
            )));
        }
        // 1. The checkpoint fits the pool: each block inside one of its
        //    segments, on that segment's stream, on mapped pages, and no two
        //    overlap.
        let segs = self.pool_segments(p);
        let mut want = blocks.to_vec();
        want.sort_unstable_by_key(|b| b.ptr);
        let mut placed = Vec::with_capacity(want.len());
        let mut end = 0;
        for b in &want {
            let bad = |why: &str| {
                err(format!(
                    "setCheckpointPoolState of pool {name}: checkpointed block {:#x}+{} {why} (nothing changed)",
                    b.ptr, b.size
                ))
            };
            if b.size == 0 || b.size % super::blocks::MIN_BLOCK != 0 || b.requested > b.size {
                return Err(bad("has bad sizes"));
            }
            if b.ptr < end {
                return Err(bad("overlaps the block before it"));
            }
            end = b.ptr + b.size;
            let Some(&s) = segs.iter().find(|&&s| {
                let g = self.seg(s);
                b.ptr >= g.base && b.ptr < g.base + g.len
            }) else {
                return Err(bad("lies in none of the pool's segments"));
            };
            let g = self.seg(s);
            if b.ptr + b.size > g.base + g.len {
                return Err(bad("reaches past its segment"));
            }
            if self.streams[g.owner as usize].stream != b.stream {
                return Err(bad("was allocated on another stream than its segment's"));
            }
            let (p0, p1) = g.page_span(&self.layout, b.ptr, b.size);
            if !self.table(s).all_mapped(p0, p1) {
                return Err(bad("lies on pages the pool no longer maps"));
            }
            placed.push(s);
        }
        // 2. Every device call first: the pool's pending frees complete and
        //    the streams its live blocks were used on are waited for.
        let in_pool = |me: &Self, idx: u32| segs.contains(&me.slab[idx].seg);
        let mut i = 0;
        while i < self.events.pending.len() {
            let pend = self.events.pending[i];
            if !in_pool(self, pend.block) {
                i += 1;
                continue;
            }
            self.phys.sync_event(dev, pend.event)?;
            self.stats.num_stream_syncs += 1;
            self.event_done(i);
        }
        let mut wait: Vec<Stream> = Vec::new();
        for &s in &segs {
            for b in self.blocks_in(self.seg(s)) {
                if let Some(v) = &b.streams {
                    wait.extend(v.iter().copied());
                }
            }
        }
        wait.sort_unstable();
        wait.dedup();
        for s in wait {
            self.phys.sync_stream(dev, s)?;
            self.stats.num_stream_syncs += 1;
        }
        // 3. Free every block of the pool (bookkeeping only from here on).
        let deferred: Vec<u32> = self
            .pools
            .deferred
            .iter()
            .copied()
            .filter(|&i| in_pool(self, i))
            .collect();
        self.pools.deferred.retain(|i| !deferred.contains(i));
        for idx in deferred {
            self.slab[idx].streams = None;
            self.free_block(idx);
        }
        let live = self.live_blocks_of(p);
        let freed: Vec<u64> = live.iter().map(|b| b.ptr).collect();
        for b in &live {
            if let Some(&idx) = self.live.get(&b.ptr) {
                self.slab[idx].streams = None;
            }
            self.free(dev, b.ptr)?;
        }
        // 4. Allocate the checkpointed blocks again at their addresses.
        for (b, &s) in want.iter().zip(&placed) {
            let Some(idx) = self
                .block_indices(self.seg(s))
                .find(|&i| self.slab[i].addr <= b.ptr && self.slab[i].end() > b.ptr)
            else {
                unreachable!("a pool segment's blocks tile it");
            };
            debug_assert_eq!(self.slab[idx].state, BlockState::Free);
            let idx = self.carve_at(idx, b.ptr);
            let a = self.take_block(idx, b.requested.max(1), b.size, b.stream);
            debug_assert_eq!(a.ptr, b.ptr);
        }
        Ok(Restored {
            freed,
            allocated: want,
        })
    }

    // --- Pause and resume ----------------------------------------------------

    /// Pauses pool `id` (see the module docs); returns the bytes released.
    pub(super) fn pause_pool<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
        keep: bool,
    ) -> AllocResult<u64> {
        let p = self.pool_number(id)?;
        let name = pool_name(id);
        let x = self.pool_ref(p);
        if x.paused.is_some() {
            return Err(err(format!(
                "pause of pool {name}: it is paused already (nothing changed)"
            )));
        }
        if x.recording || self.pools.captures > 0 {
            return Err(err(format!(
                "pause of pool {name}: a CUDA graph capture is underway; synchronize, unmap and \
                 release are illegal during capture (nothing changed)"
            )));
        }
        let segs = self.pool_segments(p);
        self.check_not_exported(&segs)?;
        self.check_no_capture(dev, "pause", &[])?;
        // A kernel in flight (a replay on any stream) must not fault.
        self.synchronize_device(dev)?;
        let mut saved = PausedPool::default();
        if keep {
            for &s in &segs {
                let blocks: Vec<(u64, u64)> = self
                    .blocks_in(self.seg(s))
                    .filter(|b| b.state == BlockState::Allocated)
                    .map(|b| (b.addr, b.size))
                    .collect();
                for (addr, size) in blocks {
                    let Some(mut buf) = self.backup_buffer(dev, size) else {
                        return Err(err(format!(
                            "pause of pool {name}: no host memory for a {size}-byte backup of block \
                             {addr:#x} (nothing changed)"
                        )));
                    };
                    if let Err(e) = self.phys.copy_from_device(dev, addr, &mut buf[..]) {
                        return Err(e.into());
                    }
                    saved.backup_bytes += size;
                    saved.backups.insert(addr, buf);
                }
            }
        }
        for &s in &segs {
            let len = self.table(s).len();
            saved.runs.push((s, self.table(s).mapped_runs(0, len)));
        }
        // Commit: from here on the pool is paused.
        self.pool_mut(p).paused = Some(saved);
        let mut first_err = None;
        for s in &segs {
            self.phys.set_pinned(*s, false);
        }
        let runs: Vec<(u32, Vec<(u64, u64)>)> = self
            .pool_ref(p)
            .paused
            .as_ref()
            .map(|x| x.runs.clone())
            .unwrap_or_default();
        for (s, rs) in &runs {
            for &(f, n) in rs {
                if let Err(e) = self.unmap_chunks(dev, *s, f, n, false) {
                    first_err.get_or_insert(e);
                }
            }
        }
        let before = self.phys.pool().pages();
        if let Err(e) = self.phys.release_pool(dev) {
            first_err.get_or_insert(e);
        }
        let released = (before - self.phys.pool().pages()) * self.layout.page;
        match first_err {
            None => Ok(released),
            Some(e) => Err(err(format!(
                "pause of pool {name}: the pool is paused and {released} bytes were released, but \
                 some memory stayed mapped or pooled: {e}"
            ))),
        }
    }

    /// Resumes pool `id` (see the module docs); returns the bytes mapped.
    pub(super) fn resume_pool<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
    ) -> AllocResult<u64> {
        let p = self.pool_number(id)?;
        let name = pool_name(id);
        let Some(paused) = self.pool_ref(p).paused.as_ref() else {
            return Err(err(format!(
                "resume of pool {name}: it is not paused (nothing changed)"
            )));
        };
        let runs = paused.runs.clone();
        self.check_no_capture(dev, "resume", &[])?;
        let page = self.layout.page;
        let mut done: Vec<(u32, Vec<(u64, u64)>)> = Vec::new();
        let mut mapped = 0;
        let mut fail = None;
        for (s, rs) in &runs {
            // Pages left mapped by a failed pause need nothing.
            let todo: Vec<(u64, u64)> = rs
                .iter()
                .flat_map(|&(f, n)| self.table(*s).unmapped_runs(f, f + n))
                .collect();
            if todo.is_empty() {
                continue;
            }
            // Pinned while mapping: nothing reclaims the pool's own pages.
            self.phys.set_pinned(*s, true);
            let need: u64 = todo.iter().map(|r| r.1).sum();
            match self.acquire_and_map(dev, *s, &todo, Need::Now, None) {
                Ok(()) => {
                    mapped += need * page;
                    done.push((*s, todo));
                }
                Err(Backing::Fail(e)) => {
                    fail = Some(e);
                    break;
                }
                Err(Backing::Short(lacking)) => {
                    let stream = self.streams[self.seg(*s).owner as usize].stream;
                    let mut e = self.oom(dev, need * page, need * page, stream, lacking);
                    if let AllocError::OutOfMemory(r) = &mut e {
                        r.hint = format!(
                            "Resuming pool {name} needs {} more bytes of physical memory; the pool \
                             stays paused. {}",
                            lacking * page,
                            r.hint
                        );
                    }
                    fail = Some(e);
                    break;
                }
            }
        }
        if fail.is_none() {
            // The pool's fields and the physical layer's, borrowed apart.
            let backups: Vec<(u64, &HostBuffer)> = match self.pools.get(p) {
                Some(x) => x.paused.as_ref(),
                None => unreachable!("pool {p} is gone but still referenced"),
            }
            .map(|x| x.backups.iter().map(|(&a, b)| (a, b)).collect())
            .unwrap_or_default();
            for (addr, buf) in backups {
                if let Err(e) = self.phys.copy_to_device(dev, addr, &buf[..]) {
                    fail = Some(e.into());
                    break;
                }
            }
        }
        if let Some(e) = fail {
            for (s, rs) in &done {
                for &(f, n) in rs {
                    let _ = self.unmap_chunks(dev, *s, f, n, false);
                }
            }
            let _ = self.phys.release_pool(dev);
            for (s, _) in &runs {
                self.phys.set_pinned(*s, false);
            }
            return Err(e);
        }
        let pinned = self.pool_ref(p).pinned;
        self.pool_mut(p).paused = None;
        self.set_pool_pinned(p, pinned);
        Ok(mapped)
    }

    // --- Checks ---------------------------------------------------------------

    /// The pools' invariants: ids and slots agree; `captures` counts the
    /// recording pools; every deferred block is pending with no event and
    /// streams to record on (`validate_blocks` checks the converse); each
    /// pool's segments are pinned as the pool is (paused pools excepted)
    /// and no main-pool segment is pinned.
    pub(super) fn validate_pools(&self) -> Result<(), String> {
        for (slot, x) in self.pools.slots.iter().enumerate() {
            let Some(x) = x else { continue };
            let listed = self.pools.oom_pools.contains(&(slot as u32 + 1));
            if listed != x.use_on_oom {
                return Err(format!(
                    "pool {}: use_on_oom is {} but the list of such pools {} it",
                    pool_name(x.id),
                    x.use_on_oom,
                    if listed { "holds" } else { "lacks" }
                ));
            }
        }
        if let Some(&p) = self
            .pools
            .oom_pools
            .iter()
            .find(|&&p| self.pools.get(p).is_none())
        {
            return Err(format!(
                "the use_on_oom list names pool number {p}, which is gone"
            ));
        }
        for (&id, &s) in &self.pools.by_id {
            match self.pools.get(s + 1) {
                Some(x) if x.id == id => {}
                _ => {
                    return Err(format!(
                        "pool {} maps to a slot of another pool",
                        pool_name(id)
                    ))
                }
            }
        }
        let live = self.pools.slots.iter().flatten().count();
        if live != self.pools.by_id.len() {
            return Err(format!(
                "{live} pool slots but {} ids",
                self.pools.by_id.len()
            ));
        }
        let recording = self
            .pools
            .slots
            .iter()
            .flatten()
            .filter(|x| x.recording)
            .count();
        if recording as u32 != self.pools.captures {
            return Err(format!(
                "{} captures underway but {recording} pools recording",
                self.pools.captures
            ));
        }
        for &idx in &self.pools.deferred {
            let b = &self.slab[idx];
            if b.state != BlockState::PendingFree || b.pending_events != 0 || b.streams.is_none() {
                return Err(format!(
                    "deferred block {:#x} is not pending without events",
                    b.addr
                ));
            }
        }
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let e = &self.streams[s.owner as usize];
            let want = if e.pool == 0 {
                false
            } else {
                match self.pools.get(e.pool) {
                    None => return Err(format!("segment {si} belongs to a pool that is gone")),
                    Some(x) if x.paused.is_some() => continue,
                    Some(x) => x.pinned,
                }
            };
            if self.table(si as u32).pinned() != want {
                return Err(format!(
                    "segment {si} is {}pinned, but its owner {}",
                    if want { "not " } else { "" },
                    if want { "is" } else { "is not" }
                ));
            }
        }
        Ok(())
    }

    /// A host buffer for a backup ([`super::sleep`]'s spare buffers first).
    fn backup_buffer<D: Device + ?Sized>(&mut self, dev: &D, len: u64) -> Option<HostBuffer> {
        self.sleep.host_buffer(dev, len)
    }
}
