//! The drain: everything the physical layer holds goes back to the driver
//! when the allocator is dropped (`teardown.rs` waits for the streams and
//! events first, then drains). Errors are logged, never raised, and each
//! call is tried twice: a transient failure must not leak a handle or a
//! reservation (DESIGN.md, "Bad input and faults": `Drop` logs and carries
//! on).

use super::observe::Owner;
use super::Physical;
use vmmalloc_device::{Device, DeviceError, DeviceResult};

/// Runs a device call, retrying it once.
fn twice<T>(mut f: impl FnMut() -> DeviceResult<T>) -> DeviceResult<T> {
    f().or_else(|_| f())
}

/// Logs a failed call of the drain.
fn log(what: &str, e: &DeviceError) {
    eprintln!("vmmalloc: expandable: {what} on drop failed: {e}")
}

impl Physical {
    /// Unmaps every segment's mapped runs, releases every handle (pooled,
    /// mapped, host-located) and frees every arena. The streams and events
    /// that may still use the pages were waited for by the caller.
    pub fn drain<D: Device + ?Sized>(&mut self, dev: &D) {
        let page = self.page;
        for seg in 0..self.tables.len() as u32 {
            let t = &self.tables[seg as usize];
            if t.is_empty() {
                continue;
            }
            let runs: Vec<(u64, u64, u32)> = t
                .mapped_runs(0, t.len())
                .into_iter()
                .map(|(first, count)| {
                    let n = t.chunks_within(first, first + count).count() as u32;
                    (first, count, n)
                })
                .collect();
            for (first, count, n) in runs {
                let addr = self.page_addr(seg, first);
                let owner = Owner::Segment(seg);
                if let Err(e) = twice(|| self.raw_unmap(dev, owner, addr, count * page, n)) {
                    log("unmap", &e);
                }
            }
            for (_, c) in self.tables[seg as usize].take_all() {
                // Host-located chunks too: the pool is released below.
                self.note_mapping(c.handle, c.pages, false);
                self.pool.put(c.handle, c.pages);
            }
        }
        for h in std::mem::take(&mut self.spill.host_free) {
            if let Err(e) = twice(|| self.raw_release(dev, h, 0)) {
                log("release", &e);
            }
        }
        for (h, pages) in self.pool.drain() {
            if let Err(e) = twice(|| self.raw_release(dev, h, pages)) {
                log("release", &e);
            }
        }
        for a in std::mem::take(&mut self.arenas.list) {
            let (base, size) = (a.base, a.size);
            if let Err(e) = twice(|| self.raw_free_reservation(dev, Owner::Arena, base, size)) {
                log("address free", &e);
            }
        }
    }
}
