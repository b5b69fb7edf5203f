//! Segments (one address slice per (stream, pool)) and their page tables.
//!
//! A segment covers `[base, base + len)` of an arena; its blocks tile that
//! range. Page `i` covers `[base + i·page, base + (i+1)·page)`.
//! Invariants (checked by `validate`):
//! - `mapped[i]` ⇔ `handles[i].is_some()` (for `i < handles.len()`; pages
//!   beyond are unmapped); `mapped_pages` = number of set bits;
//! - every page that overlaps an allocated or pending-free block is mapped;
//! - `active_blocks`, `active_bytes`, `free_blocks` equal a recount of the
//!   segment's blocks;
//! - `tail` is the segment's last block when that block is free, else `NIL`;
//!   the tail is the one free block kept out of the free index (it is the
//!   block of last resort, so the common "grow at the end, shrink back" pattern
//!   never touches the index).

use super::blocks::{FreeIndex, PoolKind};
use bitvec::vec::BitVec;
use vmmalloc_device::{PhysHandle, Stream};

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
    /// Handle mapped at each page (grown on demand up to the highest mapped page).
    pub handles: Vec<Option<PhysHandle>>,
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

    /// Whether every page in `[first, last]` is mapped.
    #[inline]
    pub fn all_mapped(&self, first: u64, last: u64) -> bool {
        let (f, l) = (first as usize, last as usize);
        if f == l {
            let bits = usize::BITS as usize;
            return self.mapped.as_raw_slice()[f / bits] >> (f % bits) & 1 == 1;
        }
        self.mapped[f..=l].all()
    }

    /// The whole pages inside `[addr, end)`, as a half-open page range.
    pub fn whole_pages(&self, page: u64, addr: u64, end: u64) -> (u64, u64) {
        let first = (addr - self.base).div_ceil(page);
        let last = (end - self.base) / page;
        (first, last.max(first))
    }

    /// Records that `handle` is now mapped at page `i`.
    pub fn set_mapped(&mut self, i: u64, handle: PhysHandle) {
        let i = i as usize;
        if self.handles.len() <= i {
            self.handles.resize(i + 1, None);
        }
        self.handles[i] = Some(handle);
        self.mapped.set(i, true);
        self.mapped_pages += 1;
    }

    /// Records that page `i` is no longer mapped; returns its handle.
    pub fn clear_mapped(&mut self, i: u64) -> Option<PhysHandle> {
        let i = i as usize;
        let h = self.handles.get_mut(i).and_then(Option::take);
        if self.mapped[i] {
            self.mapped.set(i, false);
            self.mapped_pages -= 1;
        }
        h
    }

    /// Runs of mapped pages in the half-open range `[from, to)`, as `(first, count)`.
    pub fn mapped_runs(&self, from: u64, to: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let to = to.min(self.mapped.len() as u64);
        if from >= to {
            return runs;
        }
        for i in self.mapped[from as usize..to as usize].iter_ones() {
            let p = from + i as u64;
            match runs.last_mut() {
                Some((s, n)) if *s + *n == p => *n += 1,
                _ => runs.push((p, 1)),
            }
        }
        runs
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
                (self.mapped_pages * page) as i64 - self.active_bytes as i64,
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
    /// A stream never used before.
    pub fn new(stream: Stream) -> Self {
        StreamEntry {
            stream,
            synced_at: 0,
            pools: [StreamPool::default(), StreamPool::default()],
        }
    }
}
