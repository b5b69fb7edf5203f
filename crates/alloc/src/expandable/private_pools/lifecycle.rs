//! A private pool's life: created with its first user (PyTorch's
//! `create_or_incref_pool`, `beginAllocateToPool`), users added and
//! released (`releasePool`), freeable once it has none, unpinned after one
//! device synchronize and gone with its last block (`release_cached_blocks`'
//! `graph_pools_freeable`; see "Pinned pages" in `mod.rs`).

use super::super::Inner;
use super::{err, PrivatePool};
use crate::pools::{pool_name, PoolId};
use crate::AllocResult;
use vmmalloc_device::Device;

impl Inner {
    /// Creates pool `id` with one user; returns its number.
    pub(super) fn create_pool(&mut self, id: PoolId) -> AllocResult<u32> {
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
        self.pools.ids.push(id);
        self.pools.by_id.insert(id, slot);
        self.pools.gone.remove(&id);
        Ok(slot + 1)
    }

    /// Adds a user to pool number `p` (a freeable pool is pinned again).
    pub(super) fn incref_pool(&mut self, p: u32) {
        let x = self.pool_mut(p);
        x.use_count += 1;
        if !x.pinned {
            self.set_pool_pinned(p, true);
        }
    }

    /// `create_or_incref_pool`.
    pub(in crate::expandable) fn create_or_incref_pool(&mut self, id: PoolId) -> AllocResult<()> {
        match self.pools.by_id.get(&id) {
            Some(&s) => {
                self.incref_pool(s + 1);
                Ok(())
            }
            None => self.create_pool(id).map(|_| ()),
        }
    }

    /// `releasePool`.
    pub(in crate::expandable) fn release_pool(&mut self, id: PoolId) -> AllocResult<()> {
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
    pub(in crate::expandable) fn pool_use_count(&self, id: PoolId) -> AllocResult<u32> {
        let p = self.pool_number(id)?;
        Ok(self.pool_ref(p).use_count)
    }

    /// `setNoSplit` (`MemPool(no_split=True)`, PyTorch's `no_split_pools`
    /// and `should_split`): from now on a block of pool `id` is never split
    /// nor merged. A request takes whole pages of the segment's unused end
    /// (PyTorch makes a segment of its own for it), or a free block of the
    /// pool whole; a freed block stays as it is, to be taken whole again.
    pub(in crate::expandable) fn set_no_split(&mut self, id: PoolId) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        self.pool_mut(p).no_split = true;
        Ok(())
    }

    /// Whether some pool is freeable (no users, no capture) but still pinned.
    pub(in crate::expandable) fn has_freeable_pinned(&self) -> bool {
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
    pub(in crate::expandable) fn unpin_freeable_pools<D: Device + ?Sized>(
        &mut self,
        dev: &D,
    ) -> bool {
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

    /// Removes the pools with no user, no capture and no memory left: their
    /// segments hold no block and map no page (they are retired). A
    /// freeable pool that still maps pages or holds blocks stays; its
    /// empty segments are retired unless it is paused (a paused pool keeps
    /// its addresses while it has blocks).
    pub(in crate::expandable) fn drop_dead_pools(&mut self) {
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
}
