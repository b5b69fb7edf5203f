//! Growable regions: one reservation of `max_bytes`, physical chunks mapped
//! and unmapped only at its end, so the region grows and shrinks in place and
//! its address never moves (the vAttention idea, Prabhu et al., ASPLOS'25,
//! as a general API; kvcached builds elastic KV caches the same way).
//!
//! # Shape
//!
//! The region itself — its reservation and its stack of chunks — is a table
//! of the physical layer (`physical/regions.rs`, which makes its driver
//! calls); this file is the block layer's side: sizes, where the pages come
//! from, the stats. A region owns its own address reservation (`cuMemAddressReserve` of
//! `max_bytes` rounded up to the page) — not an arena slice: a region's
//! maximum may be far larger than a slice, and a region never holds blocks.
//! Its chunks form a stack from the base: chunk `i` covers pages
//! `[first_i, first_i + pages_i)` with `first_0 = 0`, `first_{i+1} = first_i + pages_i`.
//!
//! - **Grow** to `n` bytes: the pages `[mapped, ceil(n / page))` are backed by
//!   chunks from the same chunk pool, limit (memory fraction) and targeted
//!   reclaim as every block ([`Inner::back_runs`]), mapped, and made
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
use super::ladder::{Backing, Need};
use super::physical::{Pages, Target};
use super::Inner;
use crate::{AllocError, AllocResult};
use vmmalloc_device::{round_up, Device, Stream};

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
    fn growable_mut(&mut self, ptr: u64) -> AllocResult<&mut super::physical::Region> {
        self.phys
            .region_mut(ptr)
            .ok_or(AllocError::InvalidPointer { ptr })
    }

    /// Applies a change of `dpages` mapped pages of a region, and of `dreq`
    /// requested bytes, to the stats (its pages and handles mapped are the
    /// physical layer's).
    fn note_growable(&mut self, dpages: i64, dreq: i64) {
        let bytes = dpages * self.layout.page as i64;
        let k = PoolKind::Large as usize;
        let c = &mut self.counters;
        c.allocated_bytes.add(k, bytes);
        c.active_bytes.add(k, bytes);
        c.reserved_bytes.add(k, bytes);
        c.requested_bytes.add(k, dreq);
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
        let base = self.phys.region_create(dev, max_bytes, reserved, stream)?;
        let k = PoolKind::Large as usize;
        self.counters.allocation.add(k, 1);
        self.counters.active.add(k, 1);
        Ok(base)
    }

    /// The state of region `ptr`.
    pub(super) fn growable_info(&self, ptr: u64) -> AllocResult<GrowableInfo> {
        let g = self
            .phys
            .region(ptr)
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
            self.phys.region_give_access(dev, ptr)?;
        }
        if need > mapped {
            self.growable_grow(dev, ptr, need - mapped, bytes)?;
        } else if need < mapped {
            self.growable_shrink(dev, ptr, need)?;
        }
        let g = self.growable_mut(ptr)?;
        g.size = bytes;
        self.note_growable(0, bytes as i64 - old as i64);
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
            let g = self.phys.region(ptr).expect("region exists");
            (g.mapped_pages, g.stream)
        };
        // One read of the limit (a shared budget's may change between two).
        let limit = self.phys.limit_pages();
        if pages > limit && !self.phys.spill_enabled() {
            let lack = pages - limit;
            return Err(self.oom(dev, bytes, pages * page, stream, lack));
        }
        let target = Target::Region(ptr);
        let runs = [(first, pages)];
        let (backed, r) = self.back_runs(dev, target, Pages::Runs(&runs), Need::Now, None);
        // Pages the region kept: all on success, chunks whose rollback
        // failed otherwise.
        self.note_growable(backed.kept as i64, 0);
        match r {
            Ok(()) => Ok(()),
            Err(Backing::Fail(e)) => Err(e),
            Err(Backing::Short(lack)) => Err(self.oom(dev, bytes, pages * page, stream, lack)),
        }
    }

    /// Unmaps the chunks of region `ptr` lying wholly at or above page
    /// `need`, after waiting for the region's stream; pools their handles.
    fn growable_shrink<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
        need: u64,
    ) -> AllocResult<()> {
        let Some(keep) = self.phys.region_cut(ptr, need) else {
            return Ok(());
        };
        let stream = self.phys.region(ptr).expect("region exists").stream;
        self.phys.sync_stream(dev, stream)?;
        self.stats.num_stream_syncs += 1;
        let (pages, _) = self.phys.region_unmap_from(dev, ptr, keep)?;
        self.note_growable(-(pages as i64), 0);
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
        if self.phys.region(ptr).expect("region exists").mapped_pages > 0 {
            // Only chunks stuck after a failed rollback are left: unmap them.
            self.growable_shrink(dev, ptr, 0)?;
        }
        self.phys.region_destroy(dev, ptr)?;
        let k = PoolKind::Large as usize;
        self.counters.allocation.add(k, -1);
        self.counters.active.add(k, -1);
        Ok(())
    }
}
