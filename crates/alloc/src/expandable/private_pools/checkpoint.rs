//! Checkpoints and restore (`setCheckpointPoolState`).
//!
//! A checkpoint is the list of the pool's live blocks; it holds nothing.
//! [`Inner::restore_pool`] frees every block of the pool and allocates the
//! checkpointed ones again at their addresses (their pages stayed mapped:
//! the pool is pinned).

use super::super::blocks::BlockState;
use super::super::Inner;
use super::err;
use crate::pools::{pool_name, PoolBlock, PoolId, Restored};
use crate::AllocResult;
use vmmalloc_device::{Device, Stream};

impl Inner {
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
    pub(in crate::expandable) fn pool_live_blocks(
        &self,
        id: PoolId,
    ) -> AllocResult<Vec<PoolBlock>> {
        Ok(self.live_blocks_of(self.pool_number(id)?))
    }

    /// `setCheckpointPoolState` (see the module docs). Nothing changes when
    /// it fails.
    pub(in crate::expandable) fn restore_pool<D: Device + ?Sized>(
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
            if b.size == 0 || b.size % super::super::blocks::MIN_BLOCK != 0 || b.requested > b.size
            {
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
}
