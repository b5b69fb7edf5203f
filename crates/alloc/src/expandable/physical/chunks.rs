//! One segment's chunk table: which of its pages are mapped, and by which
//! physical handle.
//!
//! Physical memory is mapped in **chunks**: one handle of one or more whole
//! pages, mapped at its first page. Page `i` of a segment covers
//! `[base + i·page, base + (i+1)·page)`. The tables belong to the physical
//! layer ([`super::Physical`]), which maps and unmaps through the
//! driver and records it here; the rest of the allocator reads them.
//!
//! Invariants (checked by [`ChunkTable::validate`]): chunks do not overlap
//! and lie inside the segment; `mapped[i]` ⇔ page `i` lies in a chunk;
//! `mapped_pages` = number of set bits = pages of all chunks.

use bitvec::vec::BitVec;
use std::collections::BTreeMap;
use vmmalloc_device::PhysHandle;

/// One mapped physical chunk: a handle of `pages` whole pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The `cuMemCreate` handle.
    pub handle: PhysHandle,
    /// Its size in pages.
    pub pages: u64,
}

/// The chunk table of one segment (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ChunkTable {
    /// Address of page 0.
    base: u64,
    /// Which pages are mapped (one bit per page of the segment).
    mapped: BitVec,
    /// Mapped chunks by first page.
    chunks: BTreeMap<u64, Chunk>,
    /// Number of mapped pages.
    mapped_pages: u64,
    /// Whether the pages must stay where they are: a private pool's
    /// segment while a CUDA graph may replay it (`private_pools/`). The
    /// physical layer refuses to unmap or move them.
    pinned: bool,
}

impl ChunkTable {
    /// The table of a segment at `base` of `pages` pages, nothing mapped.
    pub fn new(base: u64, pages: u64) -> ChunkTable {
        ChunkTable {
            base,
            mapped: BitVec::repeat(false, pages as usize),
            chunks: BTreeMap::new(),
            mapped_pages: 0,
            pinned: false,
        }
    }

    /// Whether the pages are pinned (see the field).
    #[inline]
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Pins or unpins the pages.
    pub fn set_pinned(&mut self, pinned: bool) {
        self.pinned = pinned;
    }

    /// Address of page 0 of the segment.
    #[inline]
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Pages of the segment (mapped or not).
    #[inline]
    pub fn len(&self) -> u64 {
        self.mapped.len() as u64
    }

    /// Number of mapped pages.
    #[inline]
    pub fn mapped_pages(&self) -> u64 {
        self.mapped_pages
    }

    /// Whether no chunk is mapped.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Number of mapped chunks.
    #[inline]
    pub fn chunk_count(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// Whether page `p` is mapped.
    #[inline]
    pub fn is_mapped(&self, p: u64) -> bool {
        self.mapped[p as usize]
    }

    /// Whether a chunk starts at page `first`.
    #[inline]
    pub fn has_chunk_at(&self, first: u64) -> bool {
        self.chunks.contains_key(&first)
    }

    /// Every chunk, ascending, as `(first page, chunk)`.
    #[inline]
    pub fn chunks(&self) -> impl DoubleEndedIterator<Item = (u64, Chunk)> + '_ {
        self.chunks.iter().map(|(&f, &c)| (f, c))
    }

    /// Whether every page in `[first, last]` is mapped. Compares whole
    /// bitmap words (bit `i` is bit `i % usize::BITS` of word `i / usize::BITS`).
    #[inline]
    pub fn all_mapped(&self, first: u64, last: u64) -> bool {
        const BITS: usize = usize::BITS as usize;
        let (f, l) = (first as usize, last as usize);
        let words = self.mapped.as_raw_slice();
        let (fw, lw) = (f / BITS, l / BITS);
        let head = !0usize << (f % BITS);
        let tail = !0usize >> (BITS - 1 - l % BITS);
        if fw == lw {
            let m = head & tail;
            return words[fw] & m == m;
        }
        words[fw] & head == head
            && words[fw + 1..lw].iter().all(|&w| w == !0)
            && words[lw] & tail == tail
    }

    /// Records that `chunk` is now mapped at pages `[first, first + chunk.pages)`.
    pub fn add(&mut self, first: u64, chunk: Chunk) {
        let (f, n) = (first as usize, chunk.pages as usize);
        self.mapped[f..f + n].fill(true);
        self.mapped_pages += chunk.pages;
        self.chunks.insert(first, chunk);
    }

    /// Records that the chunk at `first` is no longer mapped; returns it.
    pub fn remove(&mut self, first: u64) -> Option<Chunk> {
        let c = self.chunks.remove(&first)?;
        let (f, n) = (first as usize, c.pages as usize);
        self.mapped[f..f + n].fill(false);
        self.mapped_pages -= c.pages;
        Some(c)
    }

    /// Records that the chunk at `first` is now backed by `handle` (same
    /// pages); returns the old chunk.
    pub fn replace(&mut self, first: u64, handle: PhysHandle) -> Option<Chunk> {
        let c = self.chunks.get_mut(&first)?;
        let old = *c;
        c.handle = handle;
        Some(old)
    }

    /// Removes every chunk (teardown); returns them ascending.
    pub fn take_all(&mut self) -> Vec<(u64, Chunk)> {
        self.mapped.fill(false);
        self.mapped_pages = 0;
        std::mem::take(&mut self.chunks).into_iter().collect()
    }

    /// The chunk holding page `p`, as `(first page, chunk)`.
    #[inline]
    pub fn chunk_at(&self, p: u64) -> Option<(u64, Chunk)> {
        let (&f, &c) = self.chunks.range(..=p).next_back()?;
        (p < f + c.pages).then_some((f, c))
    }

    /// Chunks lying wholly inside pages `[from, to)`, ascending, as
    /// `(first page, chunk)`.
    #[inline]
    pub fn chunks_within(
        &self,
        from: u64,
        to: u64,
    ) -> impl DoubleEndedIterator<Item = (u64, Chunk)> + '_ {
        self.chunks
            .range(from..to.max(from))
            .filter(move |(&f, c)| f + c.pages <= to)
            .map(|(&f, &c)| (f, c))
    }

    /// Chunks overlapping pages `[from, to)`, ascending.
    pub fn chunks_overlapping(&self, from: u64, to: u64) -> Vec<(u64, Chunk)> {
        let mut out: Vec<(u64, Chunk)> = self.chunk_at(from).into_iter().collect();
        let start = if out.is_empty() { from } else { from + 1 };
        out.extend(
            self.chunks
                .range(start..to.max(start))
                .map(|(&f, &c)| (f, c)),
        );
        out
    }

    /// Runs of mapped pages in the half-open range `[from, to)`, as `(first, count)`.
    pub fn mapped_runs(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        self.for_each_mapped_run(from, to, |f, n| runs.push((f, n)));
        runs
    }

    /// Calls `f(first, count)` for each run of mapped pages in the half-open
    /// range `[from, to)`, ascending. Scans the bitmap a word at a time.
    #[inline]
    pub fn for_each_mapped_run(&self, from: u64, to: u64, mut f: impl FnMut(u64, u64)) {
        let to = to.min(self.mapped.len() as u64) as usize;
        let mut p = from as usize;
        while p < to {
            let bits = &self.mapped[p..to];
            let Some(start) = bits.first_one() else { break };
            let len = bits[start..].first_zero().unwrap_or(bits.len() - start);
            f((p + start) as u64, len as u64);
            p += start + len;
        }
    }

    /// Runs of unmapped pages in the half-open range `[from, to)`, as
    /// `(first, count)`, ascending.
    pub fn unmapped_runs(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let to = to.min(self.mapped.len() as u64) as usize;
        let mut runs = Vec::new();
        let mut p = from as usize;
        while p < to {
            let bits = &self.mapped[p..to];
            let Some(start) = bits.first_zero() else {
                break;
            };
            let len = bits[start..].first_one().unwrap_or(bits.len() - start);
            runs.push(((p + start) as u64, len as u64));
            p += start + len;
        }
        runs
    }

    /// Number of mapped pages in the half-open range `[from, to)`.
    #[inline]
    pub fn mapped_count(&self, from: u64, to: u64) -> u64 {
        let to = to.min(self.mapped.len() as u64);
        if from >= to {
            return 0;
        }
        self.mapped[from as usize..to as usize].count_ones() as u64
    }

    /// Checks the invariants of the module docs.
    pub fn validate(&self) -> Result<(), String> {
        if self.mapped.count_ones() as u64 != self.mapped_pages {
            return Err(format!(
                "mapped_pages {} but {} bits set",
                self.mapped_pages,
                self.mapped.count_ones()
            ));
        }
        let mut covered = 0u64;
        let mut prev_end = 0u64;
        for (&f, c) in &self.chunks {
            if c.pages == 0 || f < prev_end || f + c.pages > self.len() {
                return Err(format!(
                    "chunk at page {f} ({} pages) overlaps another or leaves the segment",
                    c.pages
                ));
            }
            if !self.mapped[f as usize..(f + c.pages) as usize].all() {
                return Err(format!("chunk at page {f} is not marked mapped"));
            }
            covered += c.pages;
            prev_end = f + c.pages;
        }
        if covered != self.mapped_pages {
            return Err(format!(
                "chunks cover {covered} pages but {} are marked mapped",
                self.mapped_pages
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Chunk, ChunkTable};
    use vmmalloc_device::PhysHandle;

    /// `all_mapped` agrees with a bit-by-bit check on every range.
    #[test]
    fn all_mapped_matches_a_bit_loop() {
        let mut t = ChunkTable::new(0, 300);
        for i in (0..300).filter(|i| !matches!(i, 5 | 130 | 255)) {
            t.mapped.set(i, true);
        }
        for f in 0..300u64 {
            for l in f..300u64 {
                let want = (f..=l).all(|i| t.is_mapped(i));
                assert_eq!(t.all_mapped(f, l), want, "[{f}, {l}]");
            }
        }
    }

    /// Adding, replacing and removing chunks keeps the bitmap, the count
    /// and the runs in step; `validate` catches a table out of step.
    #[test]
    fn chunks_bits_and_runs_stay_in_step() {
        let mut t = ChunkTable::new(1 << 30, 16);
        let c = |h: u64, pages: u64| Chunk {
            handle: PhysHandle(h),
            pages,
        };
        t.add(2, c(1, 3));
        t.add(5, c(2, 1));
        t.add(10, c(3, 4));
        assert_eq!(t.mapped_pages(), 8);
        assert_eq!(t.mapped_runs(0, 16), vec![(2, 4), (10, 4)]);
        assert_eq!(t.unmapped_runs(0, 16), vec![(0, 2), (6, 4), (14, 2)]);
        assert_eq!(t.chunk_at(4), Some((2, c(1, 3))));
        assert_eq!(t.chunk_at(6), None);
        let within: Vec<u64> = t.chunks_within(2, 12).map(|(f, _)| f).collect();
        assert_eq!(within, vec![2, 5]);
        let over: Vec<u64> = t.chunks_overlapping(3, 11).iter().map(|x| x.0).collect();
        assert_eq!(over, vec![2, 5, 10]);
        assert_eq!(t.mapped_count(3, 12), 5);
        assert_eq!(t.replace(5, PhysHandle(9)), Some(c(2, 1)));
        assert_eq!(t.chunk_at(5), Some((5, c(9, 1))));
        assert_eq!(t.remove(2), Some(c(1, 3)));
        assert_eq!(t.remove(2), None);
        assert_eq!(t.mapped_pages(), 5);
        t.validate().unwrap();
        t.mapped.set(0, true);
        assert!(t.validate().is_err());
        t.mapped.set(0, false);
        let all = t.take_all();
        assert_eq!(all.len(), 2);
        assert!(t.is_empty() && t.mapped_pages() == 0 && t.mapped_count(0, 16) == 0);
        t.validate().unwrap();
    }

    proptest::proptest! {
        /// Random adds (where the pages are free) and removes agree with a
        /// page-by-page oracle: the bitmap, the count, the runs, the chunk
        /// lookups, and `validate`.
        #[test]
        fn random_adds_and_removes_match_a_page_oracle(
            ops in proptest::collection::vec((0u64..96, 1u64..9, proptest::bool::ANY), 1..80)
        ) {
            const N: u64 = 96;
            let mut t = ChunkTable::new(0, N);
            let mut owner: Vec<Option<u64>> = vec![None; N as usize];
            for (i, &(first, pages, add)) in ops.iter().enumerate() {
                let pages = pages.min(N - first);
                if add && (first..first + pages).all(|p| owner[p as usize].is_none()) {
                    t.add(first, Chunk { handle: PhysHandle(i as u64), pages });
                    for p in first..first + pages {
                        owner[p as usize] = Some(first);
                    }
                } else if !add {
                    let want = owner[first as usize] == Some(first);
                    let got = t.remove(first);
                    proptest::prop_assert_eq!(got.is_some(), want);
                    if let Some(c) = got {
                        for p in first..first + c.pages {
                            owner[p as usize] = None;
                        }
                    }
                }
                t.validate().map_err(proptest::test_runner::TestCaseError::fail)?;
                let mapped = owner.iter().filter(|o| o.is_some()).count() as u64;
                proptest::prop_assert_eq!(t.mapped_pages(), mapped);
                for p in 0..N {
                    proptest::prop_assert_eq!(t.is_mapped(p), owner[p as usize].is_some());
                    proptest::prop_assert_eq!(t.chunk_at(p).map(|c| c.0), owner[p as usize]);
                }
                let (a, b) = (first.min(N - 1), (first + pages).min(N));
                let ones = (a..b).filter(|&p| owner[p as usize].is_some()).count() as u64;
                proptest::prop_assert_eq!(t.mapped_count(a, b), ones);
                proptest::prop_assert_eq!(t.all_mapped(a, b - 1), ones == b - a);
                let run_pages: u64 = t.mapped_runs(0, N).iter().map(|r| r.1).sum();
                let gap_pages: u64 = t.unmapped_runs(0, N).iter().map(|r| r.1).sum();
                proptest::prop_assert_eq!((run_pages, gap_pages), (mapped, N - mapped));
            }
        }
    }
}
