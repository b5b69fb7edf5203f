//! Giving memory back: `empty_cache`, the memory fraction, retiring
//! segments, and the final teardown on drop.

use super::blocks::BlockState;
use super::config::check_fraction;
use super::Inner;
use crate::{AllocError, AllocResult};
use vmmalloc_device::{Call, Device, DeviceError, DeviceResult};

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
        let (owner, kind, first, base) = (s.owner, s.kind, s.first, s.base);
        // The only block is the free tail, which is not in the free index.
        debug_assert!(self.slab[first].state == BlockState::Free && s.tail == first);
        let pool = &mut self.streams[owner as usize].pools[kind as usize];
        pool.segments.retain(|&x| x != seg);
        self.slab.remove(first);
        self.segments[seg as usize] = None;
        self.phys.close_table(seg);
        self.vacant_segments.push(seg);
        self.arenas.give_back(base, self.layout.slice);
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
        // pages go back with the rest (`private_pools.rs`).
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
        if let Err(e) = self.phys.release_pool(&mut self.stats, dev) {
            first_err.get_or_insert(e);
        }
        let segs: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| self.segments[i as usize].is_some())
            .collect();
        for s in segs {
            self.retire_segment_if_empty(s);
        }
        self.drop_dead_pools();
        if let Err(e) = self.arenas.free_empty(dev, &mut self.stats) {
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
            if self.phys.release_largest(&mut self.stats, dev)? == 0 {
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
                self.stats.driver_calls.add(Call::StreamSync);
                if let Err(e) = twice(|| dev.synchronize_stream(stream)) {
                    log("stream synchronize", &e);
                }
            }
        }
        self.teardown_growables(dev);
        for p in std::mem::take(&mut self.events.pending) {
            self.stats.driver_calls.add(Call::EventSync);
            if let Err(e) = twice(|| dev.synchronize_event(p.event)) {
                log("event synchronize", &e);
            }
            self.events.free.push(p.event);
        }
        let page = self.layout.page;
        for seg in 0..self.segments.len() as u32 {
            if self.segments[seg as usize].is_none() {
                continue;
            }
            let runs = self.table(seg).mapped_runs(0, self.table(seg).len());
            for (first, count) in runs {
                self.stats.driver_calls.add(Call::Unmap);
                let addr = self.phys.page_addr(seg, first);
                match twice(|| dev.unmap(addr, count * page)) {
                    Ok(()) => {}
                    Err(e) => log("unmap", &e),
                }
            }
            for (_, c) in self.phys.take_all_chunks(seg) {
                // Host-located chunks too: the pool is released below.
                self.phys.put_pooled(c.handle, c.pages);
            }
        }
        for h in self.phys.drain_host_free() {
            self.stats.driver_calls.add(Call::Release);
            if let Err(e) = twice(|| dev.release(h)) {
                log("release", &e);
            }
        }
        for (h, _) in self.phys.drain_pool() {
            self.stats.driver_calls.add(Call::Release);
            if let Err(e) = twice(|| dev.release(h)) {
                log("release", &e);
            }
        }
        for ev in std::mem::take(&mut self.events.free) {
            self.stats.driver_calls.add(Call::EventDestroy);
            if let Err(e) = twice(|| dev.destroy_event(ev)) {
                log("event destroy", &e);
            }
        }
        for a in std::mem::take(&mut self.arenas.list) {
            self.stats.driver_calls.add(Call::AddressFree);
            if let Err(e) = twice(|| dev.free_reservation(a.base, a.size)) {
                log("address free", &e);
            }
        }
    }
}
