//! Targeted reclaim: unmap just enough whole free pages, least recently freed
//! first, waiting only for the streams that last used them.
//!
//! A free block's pages were last used by work on its segment's stream (work
//! on other streams was waited for through events before the block became
//! free). Before unmapping pages of a block freed at tick `t` on stream `S`,
//! the allocator synchronizes `S` unless it already did so at a tick ≥ `t`.
//! It never synchronizes the whole device.

use super::blocks::NIL;
use super::Inner;
use vmmalloc_device::{Call, Device, DeviceError};

/// Pages a reclaim must leave alone: `(segment, first page, last page)`, the
/// pages of the request being served.
pub(crate) type Exclude = Option<(u32, u64, u64)>;

/// A free block with whole mapped pages: `(freed_at, block)`.
type Candidate = (u64, u32);

/// Removes the excluded pages `[x0, x1]` from runs `(first, count)`.
fn clip(runs: Vec<(u64, u64)>, x: Option<(u64, u64)>) -> Vec<(u64, u64)> {
    let Some((x0, x1)) = x else { return runs };
    let mut out = Vec::with_capacity(runs.len() + 1);
    for (f, n) in runs {
        let end = f + n;
        if end <= x0 || f > x1 {
            out.push((f, n));
            continue;
        }
        if f < x0 {
            out.push((f, x0 - f));
        }
        if end > x1 + 1 {
            out.push((x1 + 1, end - x1 - 1));
        }
    }
    out
}

impl Inner {
    /// Every free block of at least `min_size` bytes: the free indexes' and
    /// the segments' tails. Blocks smaller than a page hold no whole page, so
    /// reclaim skips them here without looking at them.
    pub(super) fn free_blocks(&self, min_size: u64) -> impl Iterator<Item = u32> + '_ {
        let indexed = self
            .streams
            .iter()
            .flat_map(|e| e.pools.iter())
            .flat_map(move |p| p.free.iter_from(min_size));
        let tails = self
            .segments
            .iter()
            .flatten()
            .map(|s| s.tail)
            .filter(move |&t| t != NIL && self.slab[t].size >= min_size);
        indexed.chain(tails)
    }

    /// Runs of whole, mapped pages of free block `idx`, minus `exclude`.
    fn free_runs(&self, idx: u32, exclude: Exclude) -> Vec<(u64, u64)> {
        let b = &self.slab[idx];
        let s = self.seg(b.seg);
        let (wf, wl) = s.whole_pages(self.layout.page, b.addr, b.end());
        let x = exclude.and_then(|(xs, x0, x1)| (xs == b.seg).then_some((x0, x1)));
        clip(s.mapped_runs(wf, wl), x)
    }

    /// Number of whole, mapped pages of free block `idx`, minus `exclude`
    /// (the pages [`Inner::free_runs`] lists, counted a bitmap word at a time).
    fn free_pages(&self, idx: u32, exclude: Exclude) -> u64 {
        let b = &self.slab[idx];
        let s = self.seg(b.seg);
        let (wf, wl) = s.whole_pages(self.layout.page, b.addr, b.end());
        if wf >= wl {
            return 0;
        }
        let mut n = s.mapped_count(wf, wl);
        if let Some((xs, x0, x1)) = exclude {
            let (lo, hi) = (wf.max(x0), wl.min(x1 + 1));
            if xs == b.seg && lo < hi {
                n -= s.mapped_count(lo, hi);
            }
        }
        n
    }

    /// Free blocks holding whole mapped pages, in every stream and pool.
    fn candidates(&self, exclude: Exclude) -> Vec<Candidate> {
        self.free_blocks(self.layout.page)
            .filter(|&idx| self.free_pages(idx, exclude) > 0)
            .map(|idx| (self.slab[idx].freed_at, idx))
            .collect()
    }

    /// Whole free mapped pages a reclaim could take, counted up to `cap`:
    /// the exact count when it is below `cap`, else `cap` (callers only ask
    /// whether `cap` pages can be reclaimed, and how many are lacking).
    pub(super) fn reclaimable(&self, exclude: Exclude, cap: u64) -> u64 {
        let mut total = 0;
        for idx in self.free_blocks(self.layout.page) {
            total += self.free_pages(idx, exclude);
            if total >= cap {
                return cap;
            }
        }
        total
    }

    /// Waits for all work queued so far on the stream of entry `owner`.
    pub(super) fn wait_stream<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: u32,
    ) -> Result<(), DeviceError> {
        let stream = self.streams[owner as usize].stream;
        self.stats.driver_calls.add(Call::StreamSync);
        dev.synchronize_stream(stream)?;
        self.stats.num_stream_syncs += 1;
        self.streams[owner as usize].synced_at = self.tick;
        Ok(())
    }

    /// Unmaps up to `want` whole free pages (oldest free blocks first, highest
    /// pages of a block first) into the pool. Returns the pages reclaimed.
    pub(super) fn reclaim<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        want: u64,
        exclude: Exclude,
    ) -> u64 {
        let mut cands = self.candidates(exclude);
        cands.sort_unstable();
        let mut got = 0;
        let mut unsafe_streams: Vec<u32> = Vec::new();
        for (freed_at, idx) in cands {
            if got >= want {
                break;
            }
            let seg = self.slab[idx].seg;
            let owner = self.seg(seg).owner;
            if unsafe_streams.contains(&owner) {
                continue;
            }
            if freed_at > self.streams[owner as usize].synced_at
                && self.wait_stream(dev, owner).is_err()
            {
                unsafe_streams.push(owner);
                continue;
            }
            for (first, count) in self.free_runs(idx, exclude).into_iter().rev() {
                let take = count.min(want - got);
                if self.unmap_run(dev, seg, first + count - take, take).is_ok() {
                    got += take;
                }
                if got >= want {
                    break;
                }
            }
        }
        if got > 0 {
            self.stats.reclaims += 1;
            self.stats.reclaimed_bytes += got * self.layout.page;
        }
        got
    }

    /// Unmaps every whole free page of every segment into the pool (for
    /// `empty_cache` and lowering the memory fraction). Returns the first error.
    pub(super) fn unmap_all_free<D: Device + ?Sized>(
        &mut self,
        dev: &D,
    ) -> Result<(), DeviceError> {
        let mut cands = self.candidates(None);
        cands.sort_unstable();
        let mut first_err = None;
        let mut unsafe_streams: Vec<u32> = Vec::new();
        for (freed_at, idx) in cands {
            let seg = self.slab[idx].seg;
            let owner = self.seg(seg).owner;
            if unsafe_streams.contains(&owner) {
                continue;
            }
            if freed_at > self.streams[owner as usize].synced_at {
                if let Err(e) = self.wait_stream(dev, owner) {
                    unsafe_streams.push(owner);
                    first_err.get_or_insert(e);
                    continue;
                }
            }
            for (first, count) in self.free_runs(idx, None) {
                if let Err(e) = self.unmap_run(dev, seg, first, count) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::clip;

    #[test]
    fn clip_cuts_the_excluded_pages_out_of_runs() {
        assert_eq!(clip(vec![(0, 10)], Some((3, 5))), vec![(0, 3), (6, 4)]);
        assert_eq!(
            clip(vec![(0, 3), (8, 2)], Some((3, 7))),
            vec![(0, 3), (8, 2)]
        );
        assert_eq!(clip(vec![(4, 2)], Some((3, 7))), vec![]);
        assert_eq!(clip(vec![(0, 4)], None), vec![(0, 4)]);
        assert_eq!(clip(vec![(2, 4)], Some((0, 2))), vec![(3, 3)]);
    }
}
