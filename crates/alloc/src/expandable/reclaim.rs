//! Targeted reclaim: unmap just enough whole free chunks, least recently
//! freed first, waiting only for the streams that last used them.
//!
//! Only a chunk that lies wholly inside a free block can be unmapped
//! (`cuMemUnmap` covers whole mappings, and a chunk is one mapping).
//! A free block's pages were last used by work on its segment's stream (work
//! on other streams was waited for through events before the block became
//! free). Before unmapping chunks of a block freed at tick `t` on stream `S`,
//! the allocator synchronizes `S` unless it already did so at a tick ≥ `t`.
//! It never synchronizes the whole device.

use super::blocks::NIL;
use super::Inner;
use vmmalloc_device::{Device, DeviceError};

/// Pages a reclaim must leave alone: `(segment, first page, last page)`, the
/// pages of the request being served; no chunk overlapping them is unmapped.
pub(crate) type Exclude = Option<(u32, u64, u64)>;

/// A free block with whole free chunks: `(freed_at, block)`.
type Candidate = (u64, u32);

/// Groups chunks `(first, pages)` (ascending) into runs of adjacent ones,
/// as `(first, pages)`.
fn runs_of(chunks: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(f, n) in chunks {
        match out.last_mut() {
            Some(r) if r.0 + r.1 == f => r.1 += n,
            _ => out.push((f, n)),
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

    /// Chunks lying wholly inside free block `idx`, except those overlapping
    /// `exclude`, as `(first page, pages)`, ascending.
    fn free_chunks(&self, idx: u32, exclude: Exclude) -> Vec<(u64, u64)> {
        let b = &self.slab[idx];
        let s = self.seg(b.seg);
        let (wf, wl) = s.whole_pages(self.layout.page, b.addr, b.end());
        let x = exclude.and_then(|(xs, x0, x1)| (xs == b.seg).then_some((x0, x1)));
        self.table(b.seg)
            .chunks_within(wf, wl)
            .filter(|(f, c)| x.is_none_or(|(x0, x1)| f + c.pages <= x0 || *f > x1))
            .map(|(f, c)| (f, c.pages))
            .collect()
    }

    /// Pages of whole free chunks of free block `idx`, minus `exclude`
    /// (none in a pinned segment: a graph pool's pages never go back while
    /// a graph may replay them).
    fn free_pages(&self, idx: u32, exclude: Exclude) -> u64 {
        let b = &self.slab[idx];
        if self.table(b.seg).pinned() {
            return 0;
        }
        let s = self.seg(b.seg);
        let (wf, wl) = s.whole_pages(self.layout.page, b.addr, b.end());
        if wf >= wl || self.table(b.seg).mapped_count(wf, wl) == 0 {
            return 0;
        }
        self.free_chunks(idx, exclude).iter().map(|c| c.1).sum()
    }

    /// Free blocks holding whole free chunks, in every stream and pool.
    fn candidates(&self, exclude: Exclude) -> Vec<Candidate> {
        self.free_blocks(self.layout.page)
            .filter(|&idx| self.free_pages(idx, exclude) > 0)
            .map(|idx| (self.slab[idx].freed_at, idx))
            .collect()
    }

    /// Pages of whole free chunks a reclaim could take, counted up to `cap`:
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

    /// Whether the stream of entry `owner` may be synchronized now: not
    /// while it is capturing a CUDA graph (synchronizing a capturing stream
    /// fails and invalidates the capture: CUDA Programming Guide,
    /// "Prohibited and Unhandled Operations"). Asked only while a capture
    /// is underway ([`super::private_pools`]).
    pub(super) fn may_wait<D: Device + ?Sized>(&self, dev: &D, owner: u32) -> bool {
        self.pools.captures == 0
            || !dev
                .is_capturing(self.streams[owner as usize].stream)
                .unwrap_or(true)
    }

    /// Waits for all work queued so far on the stream of entry `owner`.
    pub(super) fn wait_stream<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: u32,
    ) -> Result<(), DeviceError> {
        let stream = self.streams[owner as usize].stream;
        self.phys.sync_stream(dev, stream)?;
        self.stats.num_stream_syncs += 1;
        self.streams[owner as usize].synced_at = self.tick;
        Ok(())
    }

    /// Unmaps whole free chunks into the pool until at least `want` pages are
    /// reclaimed (oldest free blocks first, highest chunks of a block first).
    /// Returns the pages reclaimed (more than `want` when a chunk is larger
    /// than what was still lacking; fewer when not enough are free).
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
                && (!self.may_wait(dev, owner) || self.wait_stream(dev, owner).is_err())
            {
                unsafe_streams.push(owner);
                continue;
            }
            // Highest chunks first; one unmap per run of adjacent chunks.
            let chunks = self.free_chunks(idx, exclude);
            let mut take = 0;
            let mut n = 0;
            for &(_, pages) in chunks.iter().rev() {
                if got + take >= want {
                    break;
                }
                take += pages;
                n += 1;
            }
            for (first, count) in runs_of(&chunks[chunks.len() - n..]).into_iter().rev() {
                if self.unmap_run(dev, seg, first, count).is_ok() {
                    got += count;
                }
            }
        }
        if got > 0 {
            self.stats.reclaims += 1;
            self.stats.reclaimed_bytes += got * self.layout.page;
        }
        got
    }

    /// Unmaps every whole free chunk of every segment into the pool (for
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
                if !self.may_wait(dev, owner) {
                    unsafe_streams.push(owner);
                    continue;
                }
                if let Err(e) = self.wait_stream(dev, owner) {
                    unsafe_streams.push(owner);
                    first_err.get_or_insert(e);
                    continue;
                }
            }
            for (first, count) in runs_of(&self.free_chunks(idx, None)) {
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
    use super::runs_of;

    #[test]
    fn adjacent_chunks_form_one_run() {
        assert_eq!(runs_of(&[(0, 2), (2, 8), (12, 1)]), vec![(0, 10), (12, 1)]);
        assert_eq!(runs_of(&[]), vec![]);
        assert_eq!(runs_of(&[(5, 1)]), vec![(5, 1)]);
    }
}
