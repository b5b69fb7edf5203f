//! Giving memory back: `empty_cache`, the memory fraction, retiring
//! segments, and the final teardown on drop (the block layer's part: it
//! waits for streams and events, and the physical layer drains,
//! `physical/drain.rs`).

use super::blocks::BlockState;
use super::config::check_fraction;
use super::Inner;
use crate::{AllocError, AllocResult};
use vmmalloc_device::{Device, DeviceError, DeviceResult};

/// Runs a device call, retrying it once (teardown only: a transient failure
/// must not leak a handle or a reservation).
fn twice<T>(mut f: impl FnMut() -> DeviceResult<T>) -> DeviceResult<T> {
    f().or_else(|_| f())
}

impl Inner {
    /// Retires segment `seg` if it holds no active block and no mapped page:
    /// its slice goes back to the arena.
    pub(super) fn retire_segment_if_empty(&mut self, seg: u32) -> bool {
        let s = self.seg(seg);
        if s.active_blocks > 0 || !self.table(seg).is_empty() || self.phys.unready_in(seg) {
            return false;
        }
        // A paused pool keeps every address: its graphs replay there.
        if self.streams[s.owner as usize].pool != 0 && self.owner_paused(s.owner) {
            return false;
        }
        let (owner, kind, mut first, base) = (s.owner, s.kind, s.first, s.base);
        if first != s.tail {
            // A no_split pool's free blocks were not merged: they go with
            // the segment (the tail is last; the others are in the index).
            let tail = s.tail;
            let free = &mut self.streams[owner as usize].pools[kind as usize].free;
            while first != tail {
                let b = &self.slab[first];
                debug_assert!(b.state == BlockState::Free);
                let next = b.next;
                free.remove(b.size, b.addr, first);
                self.slab.remove(first);
                first = next;
            }
        }
        // The only block left is the free tail, which is not in the free index.
        debug_assert!(self.slab[first].state == BlockState::Free);
        let pool = &mut self.streams[owner as usize].pools[kind as usize];
        pool.segments.retain(|&x| x != seg);
        self.slab.remove(first);
        self.segments[seg as usize] = None;
        self.phys.close_table(seg);
        self.vacant_segments.push(seg);
        self.phys.give_back_slice(base, self.layout.slice);
        self.counters.segment.add(kind as usize, -1);
        true
    }

    /// Returns every cached byte: waits for pending events, unmaps every
    /// whole free page (waiting only for the streams that used them), releases
    /// every pooled handle, retires empty segments and frees empty arenas.
    pub(super) fn empty_cache<D: Device + ?Sized>(&mut self, dev: &D) -> AllocResult<()> {
        // During a capture nothing may be synchronized, unmapped or released
        // (PyTorch's `release_cached_blocks` skips its pools then too).
        if self.pools.captures > 0 {
            return Ok(());
        }
        let mut first_err: Option<DeviceError> = None;
        if !self.pools.deferred.is_empty() {
            self.flush_deferred(dev);
        }
        // Freeable graph pools: one device synchronize, then their free
        // pages go back with the rest (`private_pools/`).
        self.unpin_freeable_pools(dev);
        if let Err(e) = self.sync_pending(dev) {
            first_err.get_or_insert(e);
        }
        // A quiet point: spilled chunks go back to device memory (spill.rs).
        if let Err(e) = self.migrate_spilled(dev) {
            first_err.get_or_insert(e);
        }
        if let Err(e) = self.unmap_all_free(dev) {
            first_err.get_or_insert(e);
        }
        // Chunks that live blocks hold only in part (a small block carved
        // from a freed larger one's chunk) keep their free pages past the
        // unmapping above. Where unpinning may run (`unpin`, and under
        // `auto` no other host thread alongside: `unpin.rs`), their live
        // pages move to exact chunks at the same addresses and the old
        // handles go back below: `empty_cache()` then keeps only the pages
        // live blocks touch, less than PyTorch's expandable segments keep
        // (their 20 MiB pages). Where it may not, the placement rules keep
        // the common pins away (`alloc.rs`, `whole_pages`, `grow_to`).
        let pinned = self.unpinnable_pages();
        if pinned > 0 {
            self.unpin(dev, pinned, None);
        }
        if let Err(e) = self.phys.release_pool(dev) {
            first_err.get_or_insert(e);
        }
        let segs: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| self.segments[i as usize].is_some())
            .collect();
        for s in segs {
            self.retire_segment_if_empty(s);
        }
        self.drop_dead_pools();
        if let Err(e) = self.phys.free_empty_arenas(dev) {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), |e| Err(AllocError::Device(e)))
    }

    /// Caps mapped + pooled pages at `fraction` of device memory; releases
    /// pooled pages above the new cap at once (mapped pages are reclaimed by
    /// later allocations instead of creating new ones).
    pub(super) fn set_memory_fraction<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        fraction: f64,
    ) -> AllocResult<()> {
        check_fraction(fraction)?;
        self.phys
            .set_fraction(fraction, self.layout.limit_pages(fraction));
        self.split_above = self.layout.split_above(fraction, self.split_threshold);
        while self.phys.over_limit(self.mapped_pages(), 0) {
            if self.phys.release_largest(dev)? == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Gives everything back to the device (drop). Errors are logged.
    pub(super) fn teardown<D: Device + ?Sized>(&mut self, dev: &D) {
        let log = |what: &str, e: &DeviceError| {
            eprintln!("vmmalloc: expandable: {what} on drop failed: {e}")
        };
        // Pages may still be used by queued work: wait for the streams that own them.
        for i in 0..self.streams.len() {
            let has_pages = self.streams[i]
                .pools
                .iter()
                .any(|p| p.segments.iter().any(|&s| !self.table(s).is_empty()));
            if has_pages {
                let stream = self.streams[i].stream;
                if let Err(e) = twice(|| self.phys.sync_stream(dev, stream)) {
                    log("stream synchronize", &e);
                }
            }
        }
        self.phys.drain_regions(dev);
        for p in std::mem::take(&mut self.events.pending) {
            if let Err(e) = twice(|| self.phys.sync_event(dev, p.event)) {
                log("event synchronize", &e);
            }
            self.events.free.push(p.event);
        }
        self.phys.drain(dev);
        for ev in std::mem::take(&mut self.events.free) {
            if let Err(e) = twice(|| self.phys.destroy_event(dev, ev)) {
                log("event destroy", &e);
            }
        }
    }
}
