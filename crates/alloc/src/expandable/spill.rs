//! Spill (`spill:true`): when device memory is exhausted after the chunk
//! pool, new handles and a targeted reclaim, the pages a request lacks are
//! backed by **host-located** chunks ([`Device::create_on_host`]: `cuMemCreate`
//! with a host NUMA location, CUDA 12.2+) mapped into the same virtual range.
//! The program continues, slower (every access crosses the interconnect),
//! instead of failing. The peer that shows users want it: mmgp's allocator
//! (WanGP) spills tensors to pinned system RAM on consumer GPUs.
//!
//! - Host chunks never count against the device limit (`limit_pages`), and
//!   never enter the chunk pool: when unmapped they are released
//!   (`host_free`, then `cuMemRelease` at the next trim).
//! - **Migration back** at a quiet point ([`Inner::migrate_spilled`], run by
//!   `empty_cache` and by `migrate_spilled()`): host chunks lying wholly in
//!   free space are unmapped and released (after waiting for their stream);
//!   host chunks under live blocks move to a device chunk when the limit has
//!   room and no other stream uses those blocks (`record_stream`, pending
//!   frees): wait for the owning stream, copy the bytes out, unmap the host
//!   chunk, map the device chunk at the same address, give access, copy the
//!   bytes back. A failure puts the host chunk back where it was.
//!
//! The spill state lives in the physical layer (`physical/spilled.rs`, with
//! its invariants), which makes the host creates (a request's host runs,
//! [`Ask::host`](super::physical::Ask::host), in `physical/back.rs`) and
//! does the accounting (`note_mapping`, `give_back`, `release_host_free`);
//! this file holds the decisions: when to spill, how much, and migrating
//! back.

use super::ladder::{Backing, Need, Short};
use super::physical::{Ask, Backed, Chunk, Pages, Shortfall, Target};
use super::Inner;
use vmmalloc_device::{Device, DeviceError};

impl Inner {
    /// With `spill:true`, after the device lacked `lacking` pages for `runs`
    /// in `target`: the first pages of `runs` from device memory (what it
    /// can give), the last `lacking` from host memory; all from the host
    /// when the device part fails after all. Mapped in ascending order,
    /// device chunks first.
    pub(super) fn back_spilling<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        runs: &[(u64, u64)],
        need: Need,
        exclude: super::reclaim::Exclude,
        lacking: u64,
    ) -> (Backed, Result<(), Backing>) {
        let total: u64 = runs.iter().map(|r| r.1).sum();
        let on_device = total.saturating_sub(lacking);
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        let mut left = on_device;
        for &(a, n) in runs {
            let d = n.min(left);
            left -= d;
            if d > 0 {
                head.push((a, d));
            }
            if d < n {
                tail.push((a + d, n - d));
            }
        }
        if head.is_empty() {
            return self.back_on_host(dev, target, runs, lacking);
        }
        match self.back_device(dev, target, Pages::Runs(&head), &tail, need, exclude) {
            (_, Err(Short::Device(_))) => self.back_on_host(dev, target, runs, lacking),
            (backed, r) => (backed, r.map_err(|e| e.into_backing(lacking))),
        }
    }

    /// With `spill:true`, backs `runs` (`(first, count)`, unmapped) in
    /// `target` with new host-located chunks only, after the device said no:
    /// `lacking` again when the host is full too (or the backend has no host
    /// memory). Created handles are released on failure.
    fn back_on_host<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        runs: &[(u64, u64)],
        lacking: u64,
    ) -> (Backed, Result<(), Backing>) {
        let ask = Ask {
            pages: Pages::Runs(&[]),
            host: runs,
            ahead: false,
            driver_full: false,
        };
        let (backed, r) = self.phys.back(dev, target, ask);
        if backed.spilled {
            self.stats.num_spills += 1;
        }
        let r = r.map_err(|e| match e {
            Shortfall::Fail(e) => Backing::Fail(e.into()),
            // With no device runs only the host can be short.
            _ => Backing::Short(lacking),
        });
        (backed, r)
    }

    /// The quiet-point work of spill: releases host chunks in free space,
    /// and moves host chunks under live blocks back to device memory while
    /// the limit has room. Returns the first error (the rest still ran).
    pub(super) fn migrate_spilled<D: Device + ?Sized>(
        &mut self,
        dev: &D,
    ) -> Result<(), DeviceError> {
        if !self.phys.has_host() {
            return Ok(());
        }
        let mut first_err = None;
        let segs: Vec<u32> = (0..self.segments.len() as u32)
            .filter(|&i| self.segments[i as usize].is_some())
            .collect();
        for seg in segs {
            if self.table(seg).pinned() {
                continue; // a graph pool's pages stay where they are
            }
            let host: Vec<(u64, Chunk)> = self
                .table(seg)
                .chunks()
                .filter(|(_, c)| self.phys.is_host(c.handle))
                .collect();
            for (f, c) in host {
                // The reclaim that made room for an earlier chunk of this
                // list may have unmapped this one (a host chunk in free
                // space): it is gone, nothing to migrate.
                if self.table(seg).chunk_at(f) != Some((f, c)) {
                    continue;
                }
                if let Err(e) = self.migrate_chunk(dev, seg, f, c) {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.phys.release_host_free(dev);
        first_err.map_or(Ok(()), Err)
    }

    /// What lies on pages `[f, f + n)` of `seg`: `(any active block, any
    /// block another stream uses or that waits for events)`.
    fn chunk_users(&self, seg: u32, f: u64, n: u64) -> (bool, bool) {
        let s = self.seg(seg);
        let (lo, hi) = (
            s.base + f * self.layout.page,
            s.base + (f + n) * self.layout.page,
        );
        let (mut active, mut shared) = (false, false);
        for b in self.blocks_in(s) {
            if b.addr >= hi {
                break;
            }
            if b.end() > lo && b.state != super::blocks::BlockState::Free {
                active = true;
                shared |= b.streams.is_some() || b.state == super::blocks::BlockState::PendingFree;
            }
        }
        (active, shared)
    }

    /// Migrates (or, in free space, drops) the host chunk at page `f` of `seg`.
    fn migrate_chunk<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        f: u64,
        c: Chunk,
    ) -> Result<(), DeviceError> {
        let (active, shared) = self.chunk_users(seg, f, c.pages);
        if shared {
            return Ok(());
        }
        let owner = self.seg(seg).owner;
        // Whatever lies there was last used on the owning stream.
        self.wait_stream(dev, owner)?;
        if !active {
            return self.unmap_run(dev, seg, f, c.pages);
        }
        // Room on the device: a pooled chunk of the size, else free device
        // chunks reclaimed and spare pooled ones released, within the limit.
        let over = |me: &Self| me.phys.over_limit(me.mapped_pages(), c.pages);
        let mut pooled = self.phys.take_pooled(c.pages);
        if pooled.is_none() && over(self) {
            // Saturating: a shared budget's limit may have moved since `over`.
            let lack = (self.mapped_pages() + self.phys.pool().pages() + c.pages)
                .saturating_sub(self.phys.limit_pages());
            self.reclaim(dev, lack, Some((seg, f, f + c.pages - 1)));
            pooled = self.phys.take_pooled(c.pages);
            while pooled.is_none() && over(self) {
                if self.phys.release_largest(dev)? == 0 {
                    break;
                }
            }
        }
        if pooled.is_none() && over(self) {
            return Ok(());
        }
        let new = match pooled {
            Some(h) => h,
            None => match self.phys.create(dev, c.pages) {
                Ok(h) => h,
                Err(e) if e.is_out_of_memory() => return Ok(()),
                Err(e) => return Err(e),
            },
        };
        self.phys.rehome_chunk(dev, seg, f, c, new)?;
        self.stats.spill_migrations += 1;
        Ok(())
    }

    /// `validate()` for spill: recounts spilled pages from the segments'
    /// and regions' chunks; no host handle is pooled.
    pub(super) fn validate_spill(&self) -> Result<(), String> {
        let mut pages = 0;
        let mut seen = 0usize;
        for t in self.phys.tables() {
            for (_, c) in t.chunks() {
                if self.phys.is_host(c.handle) {
                    pages += c.pages;
                    seen += 1;
                }
            }
        }
        for g in self.phys.regions() {
            for &(h, p) in &g.chunks {
                if self.phys.is_host(h) {
                    pages += p;
                    seen += 1;
                }
            }
        }
        if pages != self.phys.spilled_pages() {
            return Err(format!(
                "spilled pages {} but host chunks mapped hold {pages}",
                self.phys.spilled_pages()
            ));
        }
        if seen + self.phys.host_free().len() != self.phys.host_count() {
            return Err(format!(
                "{} host handles alive, {seen} mapped + {} to release",
                self.phys.host_count(),
                self.phys.host_free().len()
            ));
        }
        if self.phys.pool().iter().any(|(h, _)| self.phys.is_host(h)) {
            return Err("a host-located chunk is in the chunk pool".into());
        }
        Ok(())
    }
}
