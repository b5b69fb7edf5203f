//! Private pools (CUDA graphs, `torch.cuda.MemPool`) as owners of memory
//! inside the allocator, with PyTorch's semantics
//! (`c10/cuda/CUDACachingAllocator.cpp`: `PrivatePool`, `beginAllocateToPool`,
//! `endAllocateToPool`, `releasePool`, `create_or_incref_pool`, `free`'s
//! `needs_events_deferred_until_no_capture`, `setCheckpointPoolState`,
//! `release_cached_blocks`' `graph_pools_freeable`). The public protocol is
//! [`crate::pools`]'s; these files keep the state, one concept each:
//! this file the table of pools and their owners (which segments are
//! whose, pinned or paused); `lifecycle.rs` creation, users, release and
//! freeable pools; `capture.rs` allocating into a pool and the frees
//! deferred by captures; `oom.rs` the last resort of a main-pool
//! allocation (`use_on_oom`); `checkpoint.rs` checkpoints and restore;
//! `pause.rs` pause and resume (over the one mechanism, `../pause.rs`);
//! `validate.rs` the invariants.
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
//! last user left, its segments are *pinned* ([`super::physical::ChunkTable::pinned`]):
//! reclaim, splits, unpinning, spill and `empty_cache` never choose their
//! pages. A freeable pool (use count 0) is unpinned after one device
//! synchronize, at `empty_cache` or when the ladder needs memory
//! ([`Inner::unpin_freeable_pools`], as PyTorch releases freeable pools in
//! `release_cached_blocks`); from then on its free pages go back like the
//! main pool's, and the pool disappears with its last block.

mod capture;
mod checkpoint;
mod lifecycle;
mod oom;
mod pause;
mod validate;

use super::blocks::BlockState;
use super::pause::Paused;
use super::Inner;
use crate::pools::{pool_name, PoolId, PoolStats};
use crate::stats::StatType;
use crate::{AllocError, AllocResult, Stats};
use rustc_hash::{FxHashMap, FxHashSet};

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
    /// Set while paused (`pause.rs`).
    paused: Option<Paused>,
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
    /// The id of every pool by slot, gone ones included (slots are not
    /// reused): the pages of a pool's segments may be unmapped after the
    /// pool has gone, and still count for its id
    /// ([`Inner::note_pool_reserved`]).
    ids: Vec<PoolId>,
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
            if p.paused.as_mut().is_some_and(|x| x.forget(ptr)) {
                return;
            }
        }
    }
}

/// A pool error saying `text`.
fn err(text: String) -> AllocError {
    AllocError::Pool(text)
}

impl Inner {
    /// Counts `bytes` (negative: unmapped) mapped under segment `seg` for
    /// its private pool, if it has one: PyTorch 2.13+'s
    /// `reserved_bytes_by_private_pools` (`Stats`), which keeps a pool's
    /// entry, `current` 0, after the pool has gone. Called wherever the
    /// device's `reserved_bytes` moves for a segment (`pages.rs`), with the
    /// same amounts, so the pool's peaks are the same as per page.
    pub(super) fn note_pool_reserved(&mut self, seg: u32, bytes: i64) {
        let s = self.seg(seg);
        let p = self.streams[s.owner as usize].pool;
        if p == 0 || bytes == 0 {
            return;
        }
        let t = match s.kind {
            super::blocks::PoolKind::Small => StatType::Small,
            super::blocks::PoolKind::Large => StatType::Large,
        };
        let id = self.pools.ids[p as usize - 1];
        self.stats
            .reserved_bytes_by_private_pools
            .entry(id)
            .or_default()
            .update(t, bytes);
    }

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

    /// The segment follower's tag of stream entry `owner`'s segments: its
    /// stream and pool (`physical/follow.rs`).
    pub(in crate::expandable) fn owner_tag(&self, owner: u32) -> super::physical::follow::Tag {
        super::physical::follow::Tag {
            stream: self.streams[owner as usize].stream,
            pool: self.owner_pool_id(owner),
        }
    }

    /// Whether stream entry `owner` belongs to a `no_split` pool.
    #[inline]
    pub(super) fn owner_no_split(&self, owner: u32) -> bool {
        let p = self.streams[owner as usize].pool;
        p != 0 && self.pools.get(p).is_some_and(|x| x.no_split)
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
        self.owned_segments(|e| e.pool == p)
    }

    /// Pins or unpins pool number `p` and its segments.
    fn set_pool_pinned(&mut self, p: u32, pinned: bool) {
        self.pool_mut(p).pinned = pinned;
        for s in self.pool_segments(p) {
            self.phys.set_pinned(s, pinned);
        }
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
            backup_bytes: x.paused.as_ref().map_or(0, Paused::backup_bytes),
        })
    }
}
