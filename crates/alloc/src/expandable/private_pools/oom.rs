//! Out-of-memory routing: main-pool allocations about to fail may take free
//! blocks of the pools marked `use_on_oom` (`MemPool(use_on_oom=True)`,
//! PyTorch's `use_on_oom_pools`).

use super::super::Inner;
use crate::pools::PoolId;
use crate::{AllocResult, Allocation};
use vmmalloc_device::Stream;

impl Inner {
    /// `setUseOnOOM`: whether main-pool allocations about to fail for lack
    /// of memory may take free blocks of pool `id`
    /// ([`Inner::malloc_from_oom_pools`]).
    pub(in crate::expandable) fn set_use_on_oom(
        &mut self,
        id: PoolId,
        on: bool,
    ) -> AllocResult<()> {
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
    pub(in crate::expandable) fn malloc_from_oom_pools(
        &mut self,
        size: u64,
        rounded: u64,
        stream: Stream,
        tag: u32,
        kind: super::super::blocks::PoolKind,
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
}
