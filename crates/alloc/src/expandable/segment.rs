//! Segments (one address slice per (stream, pool)) and their page tables.
//!
//! A segment covers `[base, base + len)` of an arena; its blocks tile that
//! range. Page `i` covers `[base + i·page, base + (i+1)·page)`.
//! Physical memory is mapped in **chunks**: one handle of one or more whole
//! pages, mapped at its first page (see [`Chunk`]).
//! Invariants (checked by `validate`):
//! - chunks do not overlap and lie inside the segment; `mapped[i]` ⇔ page `i`
//!   lies in a chunk; `mapped_pages` = number of set bits = pages of all chunks;
//! - every page that overlaps an allocated or pending-free block is mapped;
//! - `active_blocks`, `active_bytes`, `free_blocks` equal a recount of the
//!   segment's blocks;
//! - `tail` is the segment's last block when that block is free, else `NIL`;
//!   the tail is the one free block kept out of the free index (it is the
//!   block of last resort, so the common "grow at the end, shrink back" pattern
//!   never touches the index).

use super::blocks::PoolKind;
use super::free_index::FreeIndex;
use bitvec::vec::BitVec;
use std::collections::BTreeMap;
use vmmalloc_device::{PhysHandle, Stream};

/// One mapped physical chunk: a handle of `pages` whole pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The `cuMemCreate` handle.
    pub handle: PhysHandle,
    /// Its size in pages.
    pub pages: u64,
}

/// One expandable segment.
#[derive(Debug)]
pub(crate) struct Segment {
    /// First byte (a slice of an arena).
    pub base: u64,
    /// Bytes of address space.
    pub len: u64,
    /// Index of the owning [`StreamEntry`].
    pub owner: u32,
    /// Pool.
    pub kind: PoolKind,
    /// First block (lowest address).
    pub first: u32,
    /// The last block if it is free, else `NIL` (not in the free index).
    pub tail: u32,
    /// Which pages are mapped.
    pub mapped: BitVec,
    /// Mapped chunks by first page.
    pub chunks: BTreeMap<u64, Chunk>,
    /// Number of mapped pages.
    pub mapped_pages: u64,
    /// Allocated + pending-free blocks.
    pub active_blocks: u32,
    /// Bytes of allocated + pending-free blocks.
    pub active_bytes: u64,
    /// Free blocks.
    pub free_blocks: u32,
}

impl Segment {
    /// The pages `[first, last]` that hold bytes `[addr, addr + len)` (len > 0).
    #[inline]
    pub fn page_span(&self, layout: &super::config::Layout, addr: u64, len: u64) -> (u64, u64) {
        let off = addr - self.base;
        (layout.page_of(off), layout.page_of(off + len - 1))
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

    /// The whole pages inside `[addr, end)`, as a half-open page range.
    pub fn whole_pages(&self, page: u64, addr: u64, end: u64) -> (u64, u64) {
        let first = (addr - self.base).div_ceil(page);
        let last = (end - self.base) / page;
        (first, last.max(first))
    }

    /// Records that `chunk` is now mapped at pages `[first, first + chunk.pages)`.
    pub fn add_chunk(&mut self, first: u64, chunk: Chunk) {
        let (f, n) = (first as usize, chunk.pages as usize);
        self.mapped[f..f + n].fill(true);
        self.mapped_pages += chunk.pages;
        self.chunks.insert(first, chunk);
    }

    /// Records that the chunk at `first` is no longer mapped; returns it.
    pub fn remove_chunk(&mut self, first: u64) -> Option<Chunk> {
        let c = self.chunks.remove(&first)?;
        let (f, n) = (first as usize, c.pages as usize);
        self.mapped[f..f + n].fill(false);
        self.mapped_pages -= c.pages;
        Some(c)
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

    /// Bytes mapped in this segment.
    pub fn mapped_bytes(&self, page: u64) -> u64 {
        self.mapped_pages * page
    }

    /// The segment's contribution to `inactive_split_bytes` and `inactive_split`:
    /// free bytes on mapped pages and free blocks, counted only while the
    /// segment holds an active block (a wholly free segment is not "split").
    #[inline]
    pub fn inactive_split(&self, page: u64) -> (i64, i64) {
        if self.active_blocks == 0 {
            (0, 0)
        } else {
            (
                // Never negative: only a paused segment ([`super::sleep`])
                // holds active bytes on unmapped pages.
                ((self.mapped_pages * page) as i64 - self.active_bytes as i64).max(0),
                i64::from(self.free_blocks),
            )
        }
    }
}

/// Per-stream state: its two pools and when it was last waited for.
#[derive(Debug)]
pub(crate) struct StreamEntry {
    /// The stream.
    pub stream: Stream,
    /// The tag of the blocks in this entry's segments (0 = the default tag).
    pub tag: u32,
    /// Allocator tick of the last wait on this stream: blocks freed at or
    /// before it are safe to unmap without waiting again.
    pub synced_at: u64,
    /// Small and large pool.
    pub pools: [StreamPool; 2],
}

/// The segments and free blocks of one (stream, pool).
#[derive(Debug, Default)]
pub(crate) struct StreamPool {
    /// Segment indices.
    pub segments: Vec<u32>,
    /// Free blocks, best fit first.
    pub free: FreeIndex,
}

impl StreamEntry {
    /// A stream never used before, with the default tag.
    #[allow(dead_code)]
    pub fn new(stream: Stream) -> Self {
        Self::tagged(stream, 0)
    }

    /// A (stream, tag) pair never used before.
    pub fn tagged(stream: Stream, tag: u32) -> Self {
        StreamEntry {
            stream,
            tag,
            synced_at: 0,
            pools: [StreamPool::default(), StreamPool::default()],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PoolKind;
    use super::Segment;
    use bitvec::vec::BitVec;

    /// `all_mapped` agrees with a bit-by-bit check on every range.
    #[test]
    fn all_mapped_matches_a_bit_loop() {
        let mut s = Segment {
            base: 0,
            len: 300,
            owner: 0,
            kind: PoolKind::Large,
            first: 0,
            tail: 0,
            mapped: BitVec::repeat(false, 300),
            chunks: Default::default(),
            mapped_pages: 0,
            active_blocks: 0,
            active_bytes: 0,
            free_blocks: 0,
        };
        for i in (0..300).filter(|i| !matches!(i, 5 | 130 | 255)) {
            s.mapped.set(i, true);
        }
        for f in 0..300u64 {
            for l in f..300u64 {
                let want = (f..=l).all(|i| s.mapped[i as usize]);
                assert_eq!(s.all_mapped(f, l), want, "[{f}, {l}]");
            }
        }
    }
}
