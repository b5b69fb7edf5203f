//! Growable regions: one reservation of `max_bytes`, physical chunks mapped
//! and unmapped only at its end, so the region grows and shrinks in place and
//! its address never moves (the vAttention idea, Prabhu et al., ASPLOS'25,
//! as a general API; kvcached builds elastic KV caches the same way).
//!
//! # Shape
//!
//! A region owns its own address reservation (`cuMemAddressReserve` of
//! `max_bytes` rounded up to the page) — not an arena slice: a region's
//! maximum may be far larger than a slice, and a region never holds blocks.
//! Its chunks form a stack from the base: chunk `i` covers pages
//! `[first_i, first_i + pages_i)` with `first_0 = 0`, `first_{i+1} = first_i + pages_i`.
//!
//! - **Grow** to `n` bytes: the pages `[mapped, ceil(n / page))` are backed by
//!   chunks from the same chunk pool, limit (memory fraction) and targeted
//!   reclaim as every block ([`Inner::acquire`]), mapped, and made
//!   accessible by one `set_access` over the new run. Immediate: the new
//!   pages were not in use by any stream.
//! - **Shrink** to `n` bytes: the chunks lying wholly at or above page
//!   `ceil(n / page)` are unmapped in one call and pooled, after waiting for
//!   the region's stream (the pages may still be read by queued work: the
//!   driver rule "pages used by queued work must not be unmapped",
//!   DESIGN.md). A chunk that straddles the new end stays mapped.
//! - A failed grow or shrink leaves the old size, the old mapping and the
//!   old stats: the chunks it mapped are unmapped again and pooled.
//!
//! # Stats
//!
//! A region counts as one allocation and one active block of the large pool
//! whose `allocated_bytes`/`active_bytes`/`reserved_bytes` are its mapped
//! bytes and whose `requested_bytes` is its current size; its chunks count in
//! `pages_mapped`/`handles_mapped` like every other chunk.
//!
//! Invariants (checked by `validate`): chunks stack from page 0 without
//! gaps; `mapped_pages` is their sum and covers `size`; pages
//! `[0, accessible)` are accessible and `accessible ≥ ceil(size / page)`.

use super::blocks::PoolKind;
use super::ladder::Need;
use super::pages::{Backing, Planned};
use super::Inner;
use crate::{AllocError, AllocResult};
use vmmalloc_device::{round_up, Call, Device, DeviceError, PhysHandle, Stream};

/// One growable region.
#[derive(Debug)]
pub(crate) struct Growable {
    /// First byte (the reservation's base; the address users see).
    pub base: u64,
    /// The maximum size the caller asked for.
    pub max_bytes: u64,
    /// Bytes reserved (`max_bytes` rounded up to the page).
    pub reserved: u64,
    /// The current size in bytes.
    pub size: u64,
    /// Mapped chunks, ascending from page 0: `(handle, pages)`.
    pub chunks: Vec<(PhysHandle, u64)>,
    /// Sum of the chunks' pages.
    pub mapped_pages: u64,
    /// Pages `[0, accessible)` have had `set_access`; pages above were
    /// mapped by a grow whose rollback failed to unmap them.
    pub accessible: u64,
    /// The stream whose work uses the region (waited for before a shrink).
    pub stream: Stream,
}

impl Growable {
    /// First page of chunk `i`.
    fn first_page(&self, i: usize) -> u64 {
        self.chunks[..i].iter().map(|c| c.1).sum()
    }
}

/// What [`crate::growable::Growable::growable_info`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrowableInfo {
    /// The region's address (never changes).
    pub ptr: u64,
    /// Current size in bytes.
    pub size: u64,
    /// Maximum size in bytes.
    pub max_bytes: u64,
    /// Bytes of physical memory mapped (≥ `size`, whole pages).
    pub mapped: u64,
    /// Physical chunks (handles) mapped.
    pub chunks: u64,
}

impl Inner {
    fn growable_mut(&mut self, ptr: u64) -> AllocResult<&mut Growable> {
        self.growables
            .get_mut(&ptr)
            .ok_or(AllocError::InvalidPointer { ptr })
    }

    /// Applies a change of `dpages` mapped pages and `dhandles` chunks of a
    /// region, and of `dreq` requested bytes, to the stats.
    fn note_growable(&mut self, dpages: i64, dhandles: i64, dreq: i64) {
        let bytes = dpages * self.layout.page as i64;
        let k = PoolKind::Large as usize;
        let c = &mut self.counters;
        c.allocated_bytes.add(k, bytes);
        c.active_bytes.add(k, bytes);
        c.reserved_bytes.add(k, bytes);
        c.requested_bytes.add(k, dreq);
        self.stats.pages_mapped = (self.stats.pages_mapped as i64 + dpages) as u64;
        self.stats.handles_mapped = (self.stats.handles_mapped as i64 + dhandles) as u64;
    }

    /// Reserves a region of `max_bytes` for work on `stream`; maps nothing.
    pub(super) fn growable_create<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        max_bytes: u64,
        stream: Stream,
    ) -> AllocResult<u64> {
        if max_bytes == 0 {
            return Err(AllocError::InvalidSize {
                size: max_bytes,
                reason: "a growable region's max_bytes must be positive".into(),
            });
        }
        let page = self.layout.page;
        let reserved = max_bytes
            .checked_add(page - 1)
            .map(|_| round_up(max_bytes, page))
            .ok_or_else(|| AllocError::InvalidSize {
                size: max_bytes,
                reason: "too large to reserve".into(),
            })?;
        self.stats.driver_calls.add(Call::Reserve);
        let base = dev.reserve(reserved, page)?;
        self.growables.insert(
            base,
            Growable {
                base,
                max_bytes,
                reserved,
                size: 0,
                chunks: Vec::new(),
                mapped_pages: 0,
                accessible: 0,
                stream,
            },
        );
        let k = PoolKind::Large as usize;
        self.counters.allocation.add(k, 1);
        self.counters.active.add(k, 1);
        Ok(base)
    }

    /// The state of region `ptr`.
    pub(super) fn growable_info(&self, ptr: u64) -> AllocResult<GrowableInfo> {
        let g = self
            .growables
            .get(&ptr)
            .ok_or(AllocError::InvalidPointer { ptr })?;
        Ok(GrowableInfo {
            ptr,
            size: g.size,
            max_bytes: g.max_bytes,
            mapped: g.mapped_pages * self.layout.page,
            chunks: g.chunks.len() as u64,
        })
    }

    /// Makes region `ptr` `bytes` long (0 ≤ `bytes` ≤ `max_bytes`). On any
    /// error the region keeps its old size and mapping.
    pub(super) fn growable_resize<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        bytes: u64,
    ) -> AllocResult<()> {
        let page = self.layout.page;
        let g = self.growable_mut(ptr)?;
        if bytes > g.max_bytes {
            return Err(AllocError::InvalidSize {
                size: bytes,
                reason: format!(
                    "beyond the growable region's max_bytes ({} bytes at {ptr:#x})",
                    g.max_bytes
                ),
            });
        }
        let need = bytes.div_ceil(page);
        let (mapped, accessible, old) = (g.mapped_pages, g.accessible, g.size);
        if need > accessible && accessible < mapped {
            // Pages left mapped by a failed rollback: give access first.
            self.stats.driver_calls.add(Call::SetAccess);
            dev.set_access(ptr + accessible * page, (mapped - accessible) * page)?;
            self.growable_mut(ptr)?.accessible = mapped;
        }
        if need > mapped {
            self.growable_grow(dev, ptr, need - mapped, bytes)?;
        } else if need < mapped {
            self.growable_shrink(dev, ptr, need)?;
        }
        let g = self.growable_mut(ptr)?;
        g.size = bytes;
        self.note_growable(0, 0, bytes as i64 - old as i64);
        Ok(())
    }

    /// Maps `pages` more pages at the end of region `ptr`.
    fn growable_grow<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        pages: u64,
        bytes: u64,
    ) -> AllocResult<()> {
        let page = self.layout.page;
        let (first, stream) = {
            let g = &self.growables[&ptr];
            (g.mapped_pages, g.stream)
        };
        if pages > self.phys.limit_pages() && !self.phys.spill_enabled() {
            let lack = pages - self.phys.limit_pages();
            return Err(self.oom(dev, bytes, pages * page, stream, lack));
        }
        let (plan, handles) = match self.acquire(dev, &[(first, pages)], Need::Now, None) {
            Ok(x) => x,
            Err(Backing::Fail(e)) => return Err(e),
            Err(Backing::Short(lack)) => {
                return Err(self.oom(dev, bytes, pages * page, stream, lack));
            }
        };
        self.growable_map(dev, ptr, &plan, handles)
            .map_err(AllocError::Device)
    }

    /// Maps the chunks of `plan` at the end of region `ptr` and gives access
    /// to them with one call. On failure the chunks mapped are unmapped again
    /// and every handle is pooled.
    fn growable_map<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        plan: &[Planned],
        handles: Vec<PhysHandle>,
    ) -> Result<(), DeviceError> {
        let page = self.layout.page;
        let first = plan[0].first;
        let mut done = 0;
        let mut err = None;
        for (c, &h) in plan.iter().zip(&handles) {
            self.stats.driver_calls.add(Call::Map);
            if let Err(e) = dev.map(ptr + c.first * page, c.pages * page, h) {
                err = Some(e);
                break;
            }
            done += 1;
        }
        let pages: u64 = plan[..done].iter().map(|c| c.pages).sum();
        if err.is_none() {
            self.stats.driver_calls.add(Call::SetAccess);
            match dev.set_access(ptr + first * page, pages * page) {
                Ok(()) => {
                    let g = self.growables.get_mut(&ptr).expect("region exists");
                    for (c, &h) in plan.iter().zip(&handles) {
                        g.chunks.push((h, c.pages));
                    }
                    g.mapped_pages += pages;
                    g.accessible = g.mapped_pages;
                    for (c, &h) in plan.iter().zip(&handles) {
                        self.phys.note_mapping(&mut self.stats, h, c.pages, true);
                    }
                    self.note_growable(pages as i64, plan.len() as i64, 0);
                    return Ok(());
                }
                Err(e) => err = Some(e),
            }
        }
        // Roll back: unmap what was mapped (one call, else chunk by chunk);
        // a chunk that cannot be unmapped stays in the region, mapped but
        // without access, above `accessible`.
        for (c, &h) in plan[done..].iter().zip(&handles[done..]) {
            self.phys.give_back(h, c.pages);
        }
        let mut kept = Vec::new();
        if done > 0 {
            self.stats.driver_calls.add(Call::Unmap);
            if dev.unmap(ptr + first * page, pages * page).is_ok() {
                for (c, &h) in plan[..done].iter().zip(&handles[..done]) {
                    self.phys.give_back(h, c.pages);
                }
            } else {
                // Chunk by chunk from the top, so that what stays mapped is
                // still a stack from the old end: the first chunk that cannot
                // be unmapped stays, with every chunk below it.
                let mut stuck = false;
                for (c, &h) in plan[..done].iter().zip(&handles[..done]).rev() {
                    if !stuck {
                        self.stats.driver_calls.add(Call::Unmap);
                        stuck = dev.unmap(ptr + c.first * page, c.pages * page).is_err();
                    }
                    if stuck {
                        kept.push((h, c.pages));
                    } else {
                        self.phys.give_back(h, c.pages);
                    }
                }
                kept.reverse();
            }
        }
        if !kept.is_empty() {
            let n: u64 = kept.iter().map(|c| c.1).sum();
            let nh = kept.len() as i64;
            for &(h, p) in &kept {
                self.phys.note_mapping(&mut self.stats, h, p, true);
            }
            let g = self.growables.get_mut(&ptr).expect("region exists");
            g.chunks.extend(kept);
            g.mapped_pages += n;
            self.note_growable(n as i64, nh, 0);
        }
        self.phys.sync_stats(&mut self.stats);
        self.phys.trim(&mut self.stats, dev);
        Err(err.expect("an error caused the rollback"))
    }

    /// Unmaps the chunks of region `ptr` lying wholly at or above page
    /// `need`, after waiting for the region's stream; pools their handles.
    fn growable_shrink<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        need: u64,
    ) -> AllocResult<()> {
        let page = self.layout.page;
        let g = &self.growables[&ptr];
        // The first chunk to go: the lowest whose first page is ≥ `need`.
        let mut keep = g.chunks.len();
        let mut top = g.mapped_pages;
        while keep > 0 && top - g.chunks[keep - 1].1 >= need {
            keep -= 1;
            top -= g.chunks[keep].1;
        }
        if keep == g.chunks.len() {
            return Ok(());
        }
        let first = g.first_page(keep);
        let count = g.mapped_pages - first;
        let stream = g.stream;
        self.stats.driver_calls.add(Call::StreamSync);
        dev.synchronize_stream(stream)?;
        self.stats.num_stream_syncs += 1;
        self.stats.driver_calls.add(Call::Unmap);
        dev.unmap(ptr + first * page, count * page)?;
        let g = self.growables.get_mut(&ptr).expect("region exists");
        let gone: Vec<(PhysHandle, u64)> = g.chunks.drain(keep..).collect();
        g.mapped_pages = first;
        g.accessible = g.accessible.min(first);
        let n = gone.len() as i64;
        for (h, p) in gone {
            self.phys.give_back_unmapped(&mut self.stats, h, p);
        }
        self.phys.sync_stats(&mut self.stats);
        self.note_growable(-(count as i64), -n, 0);
        self.phys.trim(&mut self.stats, dev);
        Ok(())
    }

    /// Destroys region `ptr`: shrinks it to nothing (waiting for its stream),
    /// then frees its reservation. On failure the region stays (at size 0
    /// when the shrink succeeded).
    pub(super) fn growable_destroy<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
    ) -> AllocResult<()> {
        self.growable_resize(dev, ptr, 0)?;
        if self.growables[&ptr].mapped_pages > 0 {
            // Only chunks stuck after a failed rollback are left: unmap them.
            self.growable_shrink(dev, ptr, 0)?;
        }
        let reserved = self.growables[&ptr].reserved;
        self.stats.driver_calls.add(Call::AddressFree);
        dev.free_reservation(ptr, reserved)?;
        self.growables.remove(&ptr);
        let k = PoolKind::Large as usize;
        self.counters.allocation.add(k, -1);
        self.counters.active.add(k, -1);
        Ok(())
    }
}

impl Inner {
    /// Drop: waits for each region's stream, unmaps its chunks (their
    /// handles go to the pool, released with it) and frees its reservation.
    /// Errors are logged, never raised; each call is tried twice.
    pub(super) fn teardown_growables<D: Device + ?Sized>(&mut self, dev: &D) {
        let page = self.layout.page;
        for (_, g) in std::mem::take(&mut self.growables) {
            let log = |what: &str, e: &DeviceError| {
                eprintln!(
                    "vmmalloc: growable region {:#x}: {what} on drop failed: {e}",
                    g.base
                )
            };
            if g.mapped_pages > 0 {
                self.stats.driver_calls.add(Call::StreamSync);
                if let Err(e) = dev
                    .synchronize_stream(g.stream)
                    .or_else(|_| dev.synchronize_stream(g.stream))
                {
                    log("stream synchronize", &e);
                }
                self.stats.driver_calls.add(Call::Unmap);
                let bytes = g.mapped_pages * page;
                if let Err(e) = dev
                    .unmap(g.base, bytes)
                    .or_else(|_| dev.unmap(g.base, bytes))
                {
                    log("unmap", &e);
                }
            }
            for (h, p) in g.chunks {
                self.phys.give_back_unmapped(&mut self.stats, h, p);
            }
            self.stats.driver_calls.add(Call::AddressFree);
            if let Err(e) = dev
                .free_reservation(g.base, g.reserved)
                .or_else(|_| dev.free_reservation(g.base, g.reserved))
            {
                log("address free", &e);
            }
        }
    }

    /// `validate()` for growable regions: adds their pages, handles and
    /// stat contributions to the recount; checks each region's stack of
    /// chunks and its accessibility on a model device.
    pub(super) fn validate_growables<D: Device + ?Sized>(
        &self,
        dev: &D,
        handles: &mut std::collections::HashSet<u64>,
    ) -> Result<GrowableRecount, String> {
        let page = self.layout.page;
        let mut rc = GrowableRecount::default();
        for (&base, g) in &self.growables {
            let sum: u64 = g.chunks.iter().map(|c| c.1).sum();
            if g.base != base || sum != g.mapped_pages || g.chunks.iter().any(|c| c.1 == 0) {
                return Err(format!(
                    "growable {base:#x}: chunks sum to {sum} pages, region says {}",
                    g.mapped_pages
                ));
            }
            if g.size > g.max_bytes
                || g.reserved < g.max_bytes
                || g.mapped_pages * page > g.reserved
                || g.size.div_ceil(page) > g.accessible
                || g.accessible > g.mapped_pages
            {
                return Err(format!(
                    "growable {base:#x}: size {} max {} reserved {} mapped {} pages, accessible {}",
                    g.size, g.max_bytes, g.reserved, g.mapped_pages, g.accessible
                ));
            }
            for (h, _) in &g.chunks {
                if !handles.insert(h.0) {
                    return Err(format!("handle {:#x} is mapped twice", h.0));
                }
            }
            if let Some(m) = dev.introspect() {
                if g.accessible > 0 && !m.is_accessible(base, g.accessible * page) {
                    return Err(format!(
                        "growable {base:#x}: {} accessible pages are not accessible on the device",
                        g.accessible
                    ));
                }
            }
            rc.regions += 1;
            rc.pages += g.mapped_pages;
            rc.chunks += g.chunks.len() as u64;
            rc.requested += g.size;
        }
        Ok(rc)
    }
}

/// What growable regions add to `validate()`'s recount.
#[derive(Debug, Default)]
pub(crate) struct GrowableRecount {
    /// Regions (each one reservation, one allocation, one active block).
    pub regions: u64,
    /// Mapped pages.
    pub pages: u64,
    /// Mapped chunks.
    pub chunks: u64,
    /// Sum of the current sizes.
    pub requested: u64,
}
