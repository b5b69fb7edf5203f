//! Growable regions as one more kind of table of the physical layer: a
//! region's own reservation and its stack of chunks, mapped and unmapped
//! only at its end (the block layer's side — sizes, stats, where the
//! handles come from — is `growable.rs`, which has the design).
//!
//! A region owns its address reservation (`cuMemAddressReserve` of
//! `max_bytes` rounded up to the page), not an arena slice. Its chunks form
//! a stack from the base: chunk `i` covers pages `[first_i, first_i +
//! pages_i)` with `first_0 = 0`, `first_{i+1} = first_i + pages_i`. Its
//! chunks count in the layer's pages and handles mapped like a segment's,
//! and their handles go back through [`Physical::give_back`].
//!
//! Invariants (checked by `validate`, [`Physical::validate_regions`]):
//! chunks stack from page 0 without gaps; `mapped_pages` is their sum and
//! covers `size`; pages `[0, accessible)` are accessible and `accessible ≥
//! ceil(size / page)`.

use super::observe::Owner;
use super::Physical;
use super::Planned;
use std::collections::HashSet;
use vmmalloc_device::{Device, DeviceError, DeviceResult, PhysHandle, Stream};

/// One growable region.
#[derive(Debug)]
pub(crate) struct Region {
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

impl Region {
    /// First page of chunk `i`.
    fn first_page(&self, i: usize) -> u64 {
        self.chunks[..i].iter().map(|c| c.1).sum()
    }
}

/// What growable regions add to `validate()`'s recount.
#[derive(Debug, Default)]
pub(crate) struct RegionRecount {
    /// Regions (each one reservation, one allocation, one active block).
    pub regions: u64,
    /// Mapped pages.
    pub pages: u64,
    /// Mapped chunks.
    pub chunks: u64,
    /// Sum of the current sizes.
    pub requested: u64,
}

impl Physical {
    /// The regions, by base address.
    pub fn regions(&self) -> impl Iterator<Item = &Region> + '_ {
        self.regions.values()
    }

    /// Region `ptr`, if there is one.
    pub fn region(&self, ptr: u64) -> Option<&Region> {
        self.regions.get(&ptr)
    }

    /// Region `ptr`, mutably (its size: the block layer's).
    pub fn region_mut(&mut self, ptr: u64) -> Option<&mut Region> {
        self.regions.get_mut(&ptr)
    }

    /// Reserves a region of `reserved` bytes (whole pages) for a caller's
    /// `max_bytes` and work on `stream`; maps nothing. Returns its base.
    pub fn region_create<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        max_bytes: u64,
        reserved: u64,
        stream: Stream,
    ) -> DeviceResult<u64> {
        // The base is not known before the call: the event's address is.
        let base = self.raw_reserve(dev, Owner::Region(0), reserved, self.page)?;
        self.regions.insert(
            base,
            Region {
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
        self.tag_table(Owner::Region(base), super::follow::Tag::region(stream));
        Ok(base)
    }

    /// Gives access to the pages of region `ptr` a failed rollback left
    /// mapped without it (`[accessible, mapped_pages)`), if any.
    pub fn region_give_access<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
    ) -> DeviceResult<()> {
        let page = self.page;
        let g = &self.regions[&ptr];
        let (mapped, accessible) = (g.mapped_pages, g.accessible);
        if accessible >= mapped {
            return Ok(());
        }
        let addr = ptr + accessible * page;
        self.raw_set_access(dev, Owner::Region(ptr), addr, (mapped - accessible) * page)?;
        self.regions
            .get_mut(&ptr)
            .expect("region exists")
            .accessible = mapped;
        Ok(())
    }

    /// Maps the chunks of `plan` at the end of region `ptr` and gives access
    /// to them with one call. Returns the pages added: all of `plan`'s on
    /// success. On failure the chunks mapped are unmapped again and every
    /// handle goes back ([`Physical::give_back`]); a chunk that cannot be
    /// unmapped stays in the region, mapped but without access, above
    /// `accessible`: the error comes with the pages that stayed.
    pub fn region_map<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        plan: &[Planned],
        handles: Vec<PhysHandle>,
    ) -> Result<u64, (DeviceError, u64)> {
        let page = self.page;
        let owner = Owner::Region(ptr);
        let first = plan[0].first;
        let mut done = 0;
        let mut err = None;
        for (c, &h) in plan.iter().zip(&handles) {
            if let Err(e) = self.raw_map(dev, owner, ptr + c.first * page, c.pages * page, h) {
                err = Some(e);
                break;
            }
            done += 1;
        }
        let pages: u64 = plan[..done].iter().map(|c| c.pages).sum();
        if err.is_none() {
            match self.raw_set_access(dev, owner, ptr + first * page, pages * page) {
                Ok(()) => {
                    let g = self.regions.get_mut(&ptr).expect("region exists");
                    for (c, &h) in plan.iter().zip(&handles) {
                        g.chunks.push((h, c.pages));
                    }
                    g.mapped_pages += pages;
                    g.accessible = g.mapped_pages;
                    for (c, &h) in plan.iter().zip(&handles) {
                        self.note_mapping(h, c.pages, true);
                    }
                    return Ok(pages);
                }
                Err(e) => err = Some(e),
            }
        }
        // Roll back: unmap what was mapped (one call, else chunk by chunk);
        // a chunk that cannot be unmapped stays in the region, mapped but
        // without access, above `accessible`.
        for (c, &h) in plan[done..].iter().zip(&handles[done..]) {
            self.give_back(h, c.pages);
        }
        let mut kept = Vec::new();
        if done > 0 {
            let all = self.raw_unmap(dev, owner, ptr + first * page, pages * page, done as u32);
            if all.is_ok() {
                for (c, &h) in plan[..done].iter().zip(&handles[..done]) {
                    self.give_back(h, c.pages);
                }
            } else {
                // Chunk by chunk from the top, so that what stays mapped is
                // still a stack from the old end: the first chunk that cannot
                // be unmapped stays, with every chunk below it.
                let mut stuck = false;
                for (c, &h) in plan[..done].iter().zip(&handles[..done]).rev() {
                    if !stuck {
                        let addr = ptr + c.first * page;
                        stuck = self.raw_unmap(dev, owner, addr, c.pages * page, 1).is_err();
                    }
                    if stuck {
                        kept.push((h, c.pages));
                    } else {
                        self.give_back(h, c.pages);
                    }
                }
                kept.reverse();
            }
        }
        let n: u64 = kept.iter().map(|c| c.1).sum();
        if !kept.is_empty() {
            for &(h, p) in &kept {
                self.note_mapping(h, p, true);
            }
            let g = self.regions.get_mut(&ptr).expect("region exists");
            g.chunks.extend(kept);
            g.mapped_pages += n;
        }
        self.trim(dev);
        Err((err.expect("an error caused the rollback"), n))
    }

    /// Where a shrink of region `ptr` to `need` pages starts: the index of
    /// the lowest chunk whose first page is ≥ `need`, or `None` when no
    /// chunk lies wholly at or above it (a chunk that straddles the new end
    /// stays mapped).
    pub fn region_cut(&self, ptr: u64, need: u64) -> Option<usize> {
        let g = &self.regions[&ptr];
        let mut keep = g.chunks.len();
        let mut top = g.mapped_pages;
        while keep > 0 && top - g.chunks[keep - 1].1 >= need {
            keep -= 1;
            top -= g.chunks[keep].1;
        }
        (keep < g.chunks.len()).then_some(keep)
    }

    /// Unmaps the chunks of region `ptr` from index `keep` up in one call
    /// (the caller waited for the region's stream); their handles go back.
    /// Returns `(pages, chunks)` unmapped; on failure nothing changes.
    pub fn region_unmap_from<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        keep: usize,
    ) -> DeviceResult<(u64, u64)> {
        let page = self.page;
        let g = &self.regions[&ptr];
        let first = g.first_page(keep);
        let count = g.mapped_pages - first;
        let n = (g.chunks.len() - keep) as u32;
        self.raw_unmap(dev, Owner::Region(ptr), ptr + first * page, count * page, n)?;
        let g = self.regions.get_mut(&ptr).expect("region exists");
        let gone: Vec<(PhysHandle, u64)> = g.chunks.drain(keep..).collect();
        g.mapped_pages = first;
        g.accessible = g.accessible.min(first);
        for (h, p) in gone {
            self.give_back_unmapped(h, p);
        }
        self.trim(dev);
        Ok((count, n as u64))
    }

    /// Frees region `ptr`'s reservation (it maps nothing any more) and
    /// forgets it. On failure the region stays.
    pub fn region_destroy<D: Device + ?Sized>(&mut self, dev: &D, ptr: u64) -> DeviceResult<()> {
        let g = &self.regions[&ptr];
        debug_assert_eq!(g.mapped_pages, 0, "a region is destroyed empty");
        let reserved = g.reserved;
        self.raw_free_reservation(dev, Owner::Region(ptr), ptr, reserved)?;
        self.regions.remove(&ptr);
        self.untag_table(Owner::Region(ptr));
        Ok(())
    }

    /// The drain's part for regions (drop): waits for each region's stream,
    /// unmaps its chunks (their handles go to the pool, released with it)
    /// and frees its reservation. Errors are logged, never raised; each call
    /// is tried twice.
    pub fn drain_regions<D: Device + ?Sized>(&mut self, dev: &D) {
        let page = self.page;
        for (_, g) in std::mem::take(&mut self.regions) {
            let owner = Owner::Region(g.base);
            let log = |what: &str, e: &DeviceError| {
                eprintln!(
                    "vmmalloc: growable region {:#x}: {what} on drop failed: {e}",
                    g.base
                )
            };
            if g.mapped_pages > 0 {
                if let Err(e) = self
                    .sync_stream(dev, g.stream)
                    .or_else(|_| self.sync_stream(dev, g.stream))
                {
                    log("stream synchronize", &e);
                }
                let (bytes, n) = (g.mapped_pages * page, g.chunks.len() as u32);
                if let Err(e) = self
                    .raw_unmap(dev, owner, g.base, bytes, n)
                    .or_else(|_| self.raw_unmap(dev, owner, g.base, bytes, n))
                {
                    log("unmap", &e);
                }
            }
            for (h, p) in g.chunks {
                self.give_back_unmapped(h, p);
            }
            if let Err(e) = self
                .raw_free_reservation(dev, owner, g.base, g.reserved)
                .or_else(|_| self.raw_free_reservation(dev, owner, g.base, g.reserved))
            {
                log("address free", &e);
            }
        }
    }

    /// `validate()` for growable regions: adds their pages, handles and
    /// stat contributions to the recount (`handles` collects the mapped
    /// ones, to find one mapped twice); checks each region's stack of
    /// chunks and its accessibility on a model device.
    pub fn validate_regions<D: Device + ?Sized>(
        &self,
        dev: &D,
        handles: &mut HashSet<u64>,
    ) -> Result<RegionRecount, String> {
        let page = self.page;
        let mut rc = RegionRecount::default();
        for (&base, g) in &self.regions {
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
