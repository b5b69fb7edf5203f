//! Segments: one address slice per (stream, pool), tiled by its blocks.
//!
//! A segment covers `[base, base + len)` of an arena; its blocks tile that
//! range. Page `i` covers `[base + i·page, base + (i+1)·page)`. Which pages
//! are mapped, and by which handle, is the physical layer's chunk table of
//! the segment (`physical/chunks.rs`, held by the physical layer).
//! Invariants (checked by `validate`):
//! - every page that overlaps an allocated or pending-free block is mapped;
//! - `active_blocks`, `active_bytes`, `free_blocks` equal a recount of the
//!   segment's blocks;
//! - `tail` is the segment's last block when that block is free, else `NIL`;
//!   the tail is the one free block kept out of the free index (it is the
//!   block of last resort, so the common "grow at the end, shrink back" pattern
//!   never touches the index).

use super::blocks::PoolKind;
use super::free_index::FreeIndex;
use vmmalloc_device::Stream;

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
    pub fn page_span(&self, layout: &super::physical::Layout, addr: u64, len: u64) -> (u64, u64) {
        let off = addr - self.base;
        (layout.page_of(off), layout.page_of(off + len - 1))
    }

    /// The whole pages inside `[addr, end)`, as a half-open page range.
    pub fn whole_pages(&self, page: u64, addr: u64, end: u64) -> (u64, u64) {
        let first = (addr - self.base).div_ceil(page);
        let last = (end - self.base) / page;
        (first, last.max(first))
    }

    /// The segment's contribution to `inactive_split_bytes` and `inactive_split`:
    /// free bytes on mapped pages and free blocks, counted only while the
    /// segment holds an active block (a wholly free segment is not "split").
    /// `mapped_pages`: the segment's mapped pages (its chunk table's).
    #[inline]
    pub fn inactive_split(&self, mapped_pages: u64, page: u64) -> (i64, i64) {
        if self.active_blocks == 0 {
            (0, 0)
        } else {
            (
                // Never negative: only a paused segment ([`super::sleep`])
                // holds active bytes on unmapped pages.
                ((mapped_pages * page) as i64 - self.active_bytes as i64).max(0),
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
    /// The tag of the blocks in this entry's segments (0 = the default tag;
    /// always 0 in a private pool's entries: pools ignore tags).
    pub tag: u32,
    /// The private pool owning this entry's segments (`private_pools/`):
    /// 0 for the main pool, else the pool's slot + 1.
    pub pool: u32,
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
    /// A (stream, tag, pool) never used before.
    pub fn new(stream: Stream, tag: u32, pool: u32) -> Self {
        StreamEntry {
            stream,
            tag,
            pool,
            synced_at: 0,
            pools: [StreamPool::default(), StreamPool::default()],
        }
    }
}
