//! Physical pages: the page pool, mapping pages under a block, unmapping
//! runs, and rolling back a half-done mapping.
//!
//! Invariants (checked by `validate`): every handle is in exactly one place —
//! mapped at one page of one segment, or in the pool; `stats.pages_mapped` and
//! `stats.pages_pooled` equal those counts; mapped pages are accessible unless
//! listed in `unready`.

use super::reclaim::Exclude;
use super::Inner;
use crate::AllocError;
use vmmalloc_device::{Call, Device, DeviceError, PhysHandle};

/// Why pages could not be provided.
#[derive(Debug)]
pub(crate) enum Backing {
    /// Not enough physical memory: this many pages are still lacking.
    Short(u64),
    /// A device call failed (not out-of-memory); the operation was rolled back.
    Fail(AllocError),
}

impl Inner {
    /// Address of page `p` of segment `seg`.
    #[inline]
    fn page_addr(&self, seg: u32, p: u64) -> u64 {
        self.seg(seg).base + p * self.layout.page
    }

    /// Updates the stats after `n` pages of `seg` were mapped (recorded in the
    /// segment with [`super::segment::Segment::set_mapped`]); `before` is the
    /// segment's inactive split from before the first of them. One update per
    /// run gives the same counters, peaks included, as one per page: every
    /// page moves them the same way.
    fn note_mapped(&mut self, seg: u32, n: u64, before: (i64, i64)) {
        self.split_changed(seg, before);
        let k = self.seg(seg).kind as usize;
        self.counters
            .reserved_bytes
            .add(k, (n * self.layout.page) as i64);
        self.stats.pages_mapped += n;
    }

    /// Records that pages `[first, first + count)` of `seg` were unmapped;
    /// their handles go to the pool.
    fn note_unmapped(&mut self, seg: u32, first: u64, count: u64) {
        let before = self.seg(seg).inactive_split(self.layout.page);
        for p in first..first + count {
            if let Some(h) = self.seg_mut(seg).clear_mapped(p) {
                self.pool_put(h);
            }
        }
        self.split_changed(seg, before);
        let k = self.seg(seg).kind as usize;
        self.counters
            .reserved_bytes
            .add(k, -((count * self.layout.page) as i64));
        self.stats.pages_mapped -= count;
        if !self.unready.is_empty() {
            let pages = first..first + count;
            self.unready
                .retain(|&(s, q)| !(s == seg && pages.contains(&q)));
        }
    }

    /// Puts a handle in the pool.
    #[inline]
    pub(super) fn pool_put(&mut self, h: PhysHandle) {
        self.pool.push(h);
        self.stats.pages_pooled = self.pool.len() as u64;
    }

    /// Moves up to `n - got.len()` pooled handles into `got`.
    fn pool_take(&mut self, got: &mut Vec<PhysHandle>, n: u64) {
        while (got.len() as u64) < n {
            match self.pool.pop() {
                Some(h) => got.push(h),
                None => break,
            }
        }
        self.stats.pages_pooled = self.pool.len() as u64;
    }

    /// Releases pooled handles above the release threshold. Stops at the first
    /// failed release (the handle stays pooled).
    pub(super) fn trim_pool<D: Device + ?Sized>(&mut self, dev: &D) {
        let page = self.layout.page;
        while (self.pool.len() as u64).saturating_mul(page) > self.release_threshold {
            let Some(h) = self.pool.pop() else { break };
            if self.release_handle(dev, h).is_err() {
                self.pool.push(h);
                break;
            }
        }
        self.stats.pages_pooled = self.pool.len() as u64;
    }

    /// Releases every pooled handle; failed ones stay pooled, the first error
    /// is returned.
    pub(super) fn release_pool<D: Device + ?Sized>(&mut self, dev: &D) -> Result<(), DeviceError> {
        let mut kept = Vec::new();
        let mut first_err = None;
        while let Some(h) = self.pool.pop() {
            if let Err(e) = self.release_handle(dev, h) {
                kept.push(h);
                first_err.get_or_insert(e);
            }
        }
        self.pool = kept;
        self.stats.pages_pooled = self.pool.len() as u64;
        first_err.map_or(Ok(()), Err)
    }

    /// `cuMemRelease`, counted.
    pub(super) fn release_handle<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        h: PhysHandle,
    ) -> Result<(), DeviceError> {
        self.stats.driver_calls.add(Call::Release);
        dev.release(h)?;
        self.stats.num_device_free += 1;
        Ok(())
    }

    /// Unmaps pages `[first, first + count)` of `seg` in one call; their
    /// handles go to the pool. On failure nothing changes.
    pub(super) fn unmap_run<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, first);
        self.stats.driver_calls.add(Call::Unmap);
        dev.unmap(addr, count * self.layout.page)?;
        self.note_unmapped(seg, first, count);
        Ok(())
    }

    /// Makes pages `[p0, p1]` of `seg` mapped and accessible, taking pages
    /// from the pool, the driver, or a targeted reclaim. On failure every page
    /// this call mapped is unmapped again (handles go to the pool).
    pub(super) fn back_pages<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        p0: u64,
        p1: u64,
    ) -> Result<(), Backing> {
        self.fix_unready(dev, seg, p0, p1)
            .map_err(|e| Backing::Fail(e.into()))?;
        let missing: Vec<u64> = {
            let s = self.seg(seg);
            (p0..=p1).filter(|&p| !s.mapped[p as usize]).collect()
        };
        if missing.is_empty() {
            return Ok(());
        }
        let n = missing.len() as u64;
        if n > self.limit_pages {
            return Err(Backing::Short(n - self.limit_pages));
        }
        let handles = self.acquire(dev, n, Some((seg, p0, p1)))?;
        self.map_pages(dev, seg, &missing, handles)
            .map_err(|e| Backing::Fail(e.into()))
    }

    /// Gives access to mapped-but-unready pages inside `[p0, p1]` of `seg`.
    fn fix_unready<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        p0: u64,
        p1: u64,
    ) -> Result<(), DeviceError> {
        let todo: Vec<u64> = self
            .unready
            .iter()
            .filter(|&&(s, p)| s == seg && (p0..=p1).contains(&p))
            .map(|&(_, p)| p)
            .collect();
        for p in todo {
            let addr = self.page_addr(seg, p);
            self.stats.driver_calls.add(Call::SetAccess);
            dev.set_access(addr, self.layout.page)?;
            self.unready.retain(|&(s, q)| !(s == seg && q == p));
        }
        Ok(())
    }

    /// `n` handles: pooled first, then created, then reclaimed. On shortage,
    /// handles created by this call are released again and the others go
    /// back to the pool.
    pub(super) fn acquire<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        n: u64,
        exclude: Exclude,
    ) -> Result<Vec<PhysHandle>, Backing> {
        let mut got = Vec::with_capacity(n as usize);
        self.pool_take(&mut got, n);
        if got.len() as u64 == n {
            return Ok(got);
        }
        let want = n - got.len() as u64;
        let held = self.mapped_pages() + self.pool.len() as u64 + got.len() as u64;
        let headroom = self.limit_pages.saturating_sub(held);
        let mut shortfall = 0;
        if want > headroom {
            // Proactive: creating the rest would pass the memory limit.
            let lack = want - headroom;
            let reclaimable = self.reclaimable(exclude, lack);
            if reclaimable < lack {
                shortfall = lack - reclaimable;
            } else {
                self.stats.num_alloc_retries += 1;
                self.reclaim(dev, lack, exclude);
                self.pool_take(&mut got, n);
            }
        }
        // The handles this call creates: `got[created]` (creates append to
        // `got` in one stretch, after the pooled handles taken so far).
        let mut created = got.len()..got.len();
        while shortfall == 0 && (got.len() as u64) < n {
            let held = self.mapped_pages() + self.pool.len() as u64 + got.len() as u64;
            if held >= self.limit_pages {
                break;
            }
            self.stats.driver_calls.add(Call::Create);
            match dev.create(self.layout.page) {
                Ok(h) => {
                    self.stats.num_device_alloc += 1;
                    got.push(h);
                    created.end = got.len();
                }
                Err(e) if e.is_out_of_memory() => {
                    // The driver is out of memory: take free pages from elsewhere.
                    let lack = n - got.len() as u64;
                    if self.reclaimable(exclude, lack) >= lack {
                        self.stats.num_alloc_retries += 1;
                        self.reclaim(dev, lack, exclude);
                        self.pool_take(&mut got, n);
                    }
                    break;
                }
                Err(e) => {
                    self.give_back(dev, got, created);
                    return Err(Backing::Fail(e.into()));
                }
            }
        }
        if (got.len() as u64) < n {
            let lacking = if shortfall > 0 {
                shortfall
            } else {
                n - got.len() as u64
            };
            self.give_back(dev, got, created);
            return Err(Backing::Short(lacking));
        }
        Ok(got)
    }

    /// Undoes a failed [`Inner::acquire`]: releases the handles it created
    /// (`got[created]`), pools the others.
    fn give_back<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        got: Vec<PhysHandle>,
        created: std::ops::Range<usize>,
    ) {
        for (i, h) in got.into_iter().enumerate() {
            if !created.contains(&i) || self.release_handle(dev, h).is_err() {
                self.pool_put(h);
            }
        }
        self.trim_pool(dev);
    }

    /// Maps `handles` at the `pages` of `seg` (ascending), one `set_access`
    /// per contiguous run. On failure, unmaps what it mapped.
    fn map_pages<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        pages: &[u64],
        mut handles: Vec<PhysHandle>,
    ) -> Result<(), DeviceError> {
        let page = self.layout.page;
        // Pages are mapped in order, so the ones this call mapped are always
        // `pages[..done]`.
        let mut done = 0;
        let mut i = 0;
        while i < pages.len() {
            let start = pages[i];
            let mut count = 1;
            while i + (count as usize) < pages.len() && pages[i + count as usize] == start + count {
                count += 1;
            }
            let before = self.seg(seg).inactive_split(page);
            for p in start..start + count {
                let Some(h) = handles.pop() else {
                    unreachable!("acquire returned one handle per missing page")
                };
                let addr = self.page_addr(seg, p);
                self.stats.driver_calls.add(Call::Map);
                match dev.map(addr, page, h) {
                    Ok(()) => {
                        self.seg_mut(seg).set_mapped(p, h);
                        done += 1;
                    }
                    Err(e) => {
                        self.note_mapped(seg, p - start, before);
                        self.pool_put(h);
                        return Err(self.undo_mapping(dev, seg, &pages[..done], handles, e));
                    }
                }
            }
            self.note_mapped(seg, count, before);
            let addr = self.page_addr(seg, start);
            self.stats.driver_calls.add(Call::SetAccess);
            if let Err(e) = dev.set_access(addr, count * page) {
                return Err(self.undo_mapping(dev, seg, &pages[..done], handles, e));
            }
            i += count as usize;
        }
        Ok(())
    }

    /// Rolls back pages mapped by a failed [`Inner::map_pages`]: unmaps them
    /// (run by run, then page by page), pools their handles and the unused
    /// ones. A page that cannot be unmapped stays mapped and is listed as
    /// unready (mapped, maybe inaccessible). Returns `err`.
    fn undo_mapping<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        done: &[u64],
        unused: Vec<PhysHandle>,
        err: DeviceError,
    ) -> DeviceError {
        for h in unused {
            self.pool_put(h);
        }
        let mut i = 0;
        while i < done.len() {
            let start = done[i];
            let mut count = 1;
            while i + (count as usize) < done.len() && done[i + count as usize] == start + count {
                count += 1;
            }
            if self.unmap_run(dev, seg, start, count).is_err() {
                for p in start..start + count {
                    if self.unmap_run(dev, seg, p, 1).is_err() {
                        self.unready.push((seg, p));
                    }
                }
            }
            i += count as usize;
        }
        self.trim_pool(dev);
        err
    }
}
