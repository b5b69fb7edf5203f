//! The fast path: `malloc`, `free`, `record_stream`, block split and merge.

use super::blocks::{Block, BlockState, PoolKind, MIN_BLOCK, NIL};
use super::ladder::{Backing, Need};
use super::segment::{Segment, StreamEntry};
use super::Inner;
use crate::caching::sizes::K_LARGE_BUFFER;
use crate::{AllocError, AllocResult, Allocation};
use vmmalloc_device::{round_up, Device, Stream};

/// Mapped + pooled memory, as a fraction of the limit, under which a
/// growing tail maps ahead to the next `grow_granule` boundary.
const AHEAD_BELOW: f64 = 0.8;

impl Inner {
    /// Index of the entry of (`stream`, tag `tag`, private pool `pool`; 0:
    /// the main pool), created on first use.
    #[inline]
    pub(super) fn stream_index(&mut self, stream: Stream, tag: u32, pool: u32) -> u32 {
        if let Some(i) = self
            .streams
            .iter()
            .position(|e| e.stream == stream && e.tag == tag && e.pool == pool)
        {
            return i as u32;
        }
        self.streams.push(StreamEntry::new(stream, tag, pool));
        self.phys.note_stream(stream);
        (self.streams.len() - 1) as u32
    }

    /// Records a change of segment `seg`'s inactive-split contribution
    /// (`before` as returned by [`Inner::inactive_split`] earlier).
    #[inline]
    pub(super) fn split_changed(&mut self, seg: u32, before: (i64, i64)) {
        let after = self.inactive_split(seg);
        let k = self.seg(seg).kind as usize;
        if after.0 != before.0 {
            self.counters
                .inactive_split_bytes
                .add(k, after.0 - before.0);
        }
        if after.1 != before.1 {
            self.counters.inactive_split.add(k, after.1 - before.1);
        }
    }

    /// Allocates `size` bytes on `stream` from the main pool, under the
    /// calling thread's tag.
    pub(super) fn malloc<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        size: u64,
        stream: Stream,
    ) -> AllocResult<Allocation> {
        // Sleep and wake: each tag has stream entries (so segments) of its own.
        let tag = super::tags::current_tag_id();
        if self.sleep.is_paused(tag) {
            return Err(self.paused_error(tag));
        }
        self.malloc_owned(dev, size, stream, tag, 0)
    }

    /// Allocates `size` bytes on `stream` in the segments of tag `tag` and
    /// private pool `pool` (0: the main pool; see `private_pools/`).
    pub(super) fn malloc_owned<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        size: u64,
        stream: Stream,
        tag: u32,
        pool: u32,
    ) -> AllocResult<Allocation> {
        if size == 0 {
            return Err(AllocError::InvalidSize {
                size,
                reason: "size must be positive".into(),
            });
        }
        if size > self.layout.total {
            // Beyond the whole device: an out-of-memory like any other, as
            // PyTorch's allocator reports it (CUDACachingAllocator.cpp
            // `malloc`: `TORCH_CHECK_WITH(OutOfMemoryError, ...)`), counted
            // and explained ("The request alone exceeds the memory limit").
            let page = self.layout.page;
            let lacking = size.div_ceil(page).saturating_sub(self.phys.limit_pages());
            return Err(self.oom(dev, size, round_up(size, MIN_BLOCK), stream, lacking));
        }
        let rounded = round_up(size, MIN_BLOCK);
        if !self.pools.deferred.is_empty() && self.pools.captures == 0 {
            self.flush_deferred(dev);
        }
        if !self.events.pending.is_empty() {
            self.process_events(dev);
        }
        let kind = PoolKind::for_size(rounded);
        let owner = self.stream_index(stream, tag, pool);
        // A no_split pool's blocks are whole pages, each taken whole.
        let no_split = self.owner_no_split(owner);
        let need = if no_split {
            round_up(rounded, self.layout.page)
        } else {
            rounded
        };
        let mut waited_for_events = false;
        let mut rechecked = false;
        loop {
            let (idx, new_seg) = match self.find_free(owner, kind, need) {
                Some(i) => (i, None),
                None => {
                    let (seg, i) = self.new_segment(dev, owner, kind)?;
                    (i, Some(seg))
                }
            };
            let seg = self.slab[idx].seg;
            // PyTorch's `should_split` is false in a no_split pool: a free
            // block is taken whole; the unused end gives whole pages.
            let rounded = if no_split && self.seg(seg).tail != idx {
                self.slab[idx].size
            } else {
                need
            };
            // The block goes at `addr`: the free block's start, or its first
            // page boundary (split off only once the pages are backed).
            let addr = self.page_aligned_start(idx, rounded, kind);
            let (p0, p1) = self.seg(seg).page_span(&self.layout, addr, rounded);
            // Fast path. When memory is tight, `back_pages` may first split
            // free chunks the block would cover only in part.
            if self.table(seg).all_mapped(p0, p1) && !self.phys.has_unready() && !self.tight() {
                let idx = self.carve_at(idx, addr);
                return Ok(self.take_block(idx, size, rounded, stream));
            }
            // The free block's whole pages: chunks inside them are wholly free.
            let room = {
                let b = &self.slab[idx];
                self.seg(seg).whole_pages(self.layout.page, b.addr, b.end())
            };
            let freed_at = self.slab[idx].freed_at;
            let shared = {
                let (page, base) = (self.layout.page, self.seg(seg).base);
                (
                    !(addr - base).is_multiple_of(page),
                    !(addr + rounded - base).is_multiple_of(page),
                )
            };
            // Growing the segment's tail while memory has room: map up to the
            // next `grow_granule` boundary (one chunk), so that the next
            // small blocks carved from the tail find their pages mapped.
            // Only from memory to spare: no reclaim, unpin or release for
            // pages nobody asked for yet.
            let ahead = self.grow_to(seg, idx, p1, room.1, rounded);
            let mut backed = Err(Backing::Short(0));
            if ahead > p1 {
                backed = self.back_pages(
                    dev,
                    seg,
                    (p0, ahead),
                    Need::Ahead,
                    (shared.0, false),
                    room,
                    freed_at,
                );
            }
            if ahead == p1 || matches!(backed, Err(Backing::Short(_))) {
                backed = self.back_pages(dev, seg, (p0, p1), Need::Now, shared, room, freed_at);
            }
            match backed {
                Ok(()) => {
                    let idx = self.carve_at(idx, addr);
                    return Ok(self.take_block(idx, size, rounded, stream));
                }
                Err(e) => {
                    if let Some(s) = new_seg {
                        self.retire_segment_if_empty(s);
                    }
                    match e {
                        Backing::Fail(e) => return Err(e),
                        Backing::Short(_)
                            if !waited_for_events && !self.events.pending.is_empty() =>
                        {
                            // Last resort before giving up: blocks waiting for other
                            // streams' events. Wait for those events (not the device)
                            // and try again from the top: merges may change blocks.
                            waited_for_events = true;
                            // A failed event wait leaves its block pending; the retry
                            // then fails with the out-of-memory report.
                            let _ = self.sync_pending(dev);
                        }
                        Backing::Short(_) if !rechecked && self.phys.budget_recheck() => {
                            // A shared budget found dead members' bytes
                            // (share.rs): plan again with the larger limit.
                            rechecked = true;
                        }
                        Backing::Short(lacking) => {
                            if self.streams[owner as usize].pool == 0 {
                                if let Some(a) =
                                    self.malloc_from_oom_pools(size, rounded, stream, tag, kind)
                                {
                                    return Ok(a);
                                }
                            }
                            self.phys.trim(dev);
                            return Err(self.oom(dev, size, rounded, stream, lacking));
                        }
                    }
                }
            }
        }
    }

    /// Where `need` bytes fit in stream entry `owner`'s `kind` pool: the
    /// best fit among the free blocks inside its segments, else a segment's
    /// free tail (the rest of its slice: the block of last resort).
    pub(super) fn find_free(&self, owner: u32, kind: PoolKind, need: u64) -> Option<u32> {
        let pool = &self.streams[owner as usize].pools[kind as usize];
        pool.free.best_fit(need).or_else(|| {
            pool.segments
                .iter()
                .map(|&s| self.seg(s).tail)
                .find(|&t| t != NIL && self.slab[t].size >= need)
        })
    }

    /// The last page to map for a block whose last page is `p1`, carved from
    /// free block `idx` of `seg` (whose whole pages end before page `end`):
    /// `p1` itself, or, when `idx` is the segment's tail and mapped + pooled
    /// memory is under [`AHEAD_BELOW`] of the limit, the page before the next
    /// `grow_granule` boundary. PyTorch's expandable segments grow the large
    /// pool in 20 MiB pages (`CUDACachingAllocator.cpp`, `ExpandableSegment`,
    /// `kLargeBuffer`): a run of small tensors then costs one map and one
    /// `cuMemSetAccess` per 20 MiB, not one per tensor. Here the pages ahead
    /// join the block's own chunk (one handle). A chunk so shared is pinned
    /// by whichever of its blocks lives longest; near the limit nothing is
    /// mapped ahead, and unpinning gives such pages back when memory runs
    /// short (`unpin.rs`).
    ///
    /// Not after a block of more than 20 MiB (`rounded` bytes; PyTorch's
    /// expandable-segment page, `kLargeBuffer`): the pages ahead would join
    /// its handle, and the first small block carved from them would pin the
    /// whole handle after the large block is freed, past `empty_cache()`
    /// (issue 40: 2 MiB, 1 GiB and 2 MiB allocated, the 1 GiB freed, kept
    /// 1040 MiB mapped; PyTorch's expandable segments keep 40). The next
    /// small block maps a chunk of its own, with the pages ahead of it.
    fn grow_to(&self, seg: u32, idx: u32, p1: u64, end: u64, rounded: u64) -> u64 {
        let granule = self.layout.grow_pages;
        if granule <= 1 || self.seg(seg).tail != idx || rounded > K_LARGE_BUFFER {
            return p1;
        }
        // A no_split pool's block has chunks of its own: its free blocks are
        // never merged, so pages mapped ahead into its chunk could never go
        // back while the block lives, nor with it.
        let owner = self.seg(seg).owner;
        if self.owner_no_split(owner) {
            return p1;
        }
        let held = (self.mapped_pages() + self.phys.pool().pages()) as f64;
        if held >= AHEAD_BELOW * self.phys.limit_pages() as f64 {
            return p1;
        }
        ((p1 + 1).next_multiple_of(granule).min(end)).max(p1 + 1) - 1
    }

    /// Where a large request of `rounded` bytes, a whole number of pages,
    /// starts inside free block `idx`: on the first page boundary in it when
    /// the request still fits there, so that it covers exactly its own pages
    /// and shares none with its neighbours; otherwise at the free block's
    /// start. [`Inner::carve_at`] then splits the bytes before it off.
    ///
    /// A block sharing a page with a neighbour keeps the neighbour's chunk
    /// pinned after the neighbour is freed (see `pages.rs`, "Edge pages"),
    /// and same-sized tensors of a training loop, placed at whole pages,
    /// find the chunks their predecessors left at the same spot, with no
    /// split. The cost is less than one page of free bytes before the block,
    /// which smaller blocks can still use.
    ///
    /// Only while chunks are split (`split_threshold` below 1). Without
    /// splitting (the default) an edge page pins nothing for good
    /// (unpinning gives such pages back when memory runs short), and packing
    /// at 512 B keeps a loop's layout the same in every iteration: aligned,
    /// the bytes skipped before a block shift the second iteration's peak
    /// layout past the first's (on cs336_lm_step at 80 GiB, 36 MiB: the
    /// second pass then made 3 calls instead of none).
    #[inline]
    pub(super) fn page_aligned_start(&self, idx: u32, rounded: u64, kind: PoolKind) -> u64 {
        let b = &self.slab[idx];
        let page = self.layout.page;
        if kind != PoolKind::Large || !rounded.is_multiple_of(page) || self.split_threshold >= 1.0 {
            return b.addr;
        }
        let base = self.seg(b.seg).base;
        let aligned = base + round_up(b.addr - base, page);
        if aligned + rounded > b.end() {
            return b.addr;
        }
        aligned
    }

    /// The free block to carve a request at `addr` from: `idx` itself when
    /// it starts there, else the part of it from `addr` on (split off).
    #[inline]
    pub(super) fn carve_at(&mut self, idx: u32, addr: u64) -> u32 {
        if self.slab[idx].addr == addr {
            idx
        } else {
            self.split_free_at(idx, addr)
        }
    }

    /// Splits free block `idx` at `at` (strictly inside it): `idx` keeps
    /// `[addr, at)`, a new free block gets `[at, end)` and is returned. Both
    /// are filed (or the back one becomes the segment's tail).
    fn split_free_at(&mut self, idx: u32, at: u64) -> u32 {
        let (addr, size, seg, freed_at) = {
            let b = &self.slab[idx];
            (b.addr, b.size, b.seg, b.freed_at)
        };
        debug_assert!(at > addr && at < addr + size && self.slab[idx].state == BlockState::Free);
        let (owner, kind) = {
            let s = self.seg(seg);
            (s.owner, s.kind)
        };
        let before = self.inactive_split(seg);
        let is_tail = self.seg(seg).tail == idx;
        let back = self.link_free_after(idx, at, addr + size - at, freed_at);
        self.slab[idx].size = at - addr;
        let free = &mut self.streams[owner as usize].pools[kind as usize].free;
        if is_tail {
            // The front is no longer the segment's last block.
            free.insert(at - addr, addr, idx);
            self.seg_mut(seg).tail = back;
        } else {
            free.remove(size, addr, idx);
            free.insert(at - addr, addr, idx);
            free.insert(addr + size - at, at, back);
        }
        self.seg_mut(seg).free_blocks += 1;
        self.split_changed(seg, before);
        back
    }

    /// Inserts a free block `[at, at + size)` right after block `idx` in
    /// its segment's address links, freed at tick `freed_at`; files it
    /// nowhere (the caller does). Returns it.
    fn link_free_after(&mut self, idx: u32, at: u64, size: u64, freed_at: u64) -> u32 {
        let (next, seg) = (self.slab[idx].next, self.slab[idx].seg);
        let new = self.slab.insert(Block {
            addr: at,
            size,
            requested: 0,
            freed_at,
            prev: idx,
            next,
            seg,
            state: BlockState::Free,
            pending_events: 0,
            streams: None,
        });
        if next != NIL {
            self.slab[next].prev = new;
        }
        self.slab[idx].next = new;
        new
    }

    /// Opens a new segment for (`owner`, `kind`): one arena slice, covered by a
    /// single free block. Returns `(segment, block)`.
    fn new_segment<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: u32,
        kind: PoolKind,
    ) -> AllocResult<(u32, u32)> {
        let l = self.layout;
        let base = self.phys.take_slice(dev, l.slice, l.slices_per_arena)?;
        let pages = l.slice.div_ceil(l.page);
        let seg_idx = match self.vacant_segments.pop() {
            Some(i) => i,
            None => {
                self.segments.push(None);
                (self.segments.len() - 1) as u32
            }
        };
        let block = self.slab.insert(Block {
            addr: base,
            size: l.slice,
            requested: 0,
            freed_at: 0,
            prev: NIL,
            next: NIL,
            seg: seg_idx,
            state: BlockState::Free,
            pending_events: 0,
            streams: None,
        });
        self.segments[seg_idx as usize] = Some(Segment {
            base,
            len: l.slice,
            owner,
            kind,
            first: block,
            tail: block,
            active_blocks: 0,
            active_bytes: 0,
            free_blocks: 1,
        });
        self.phys.open_table(seg_idx, base, pages);
        let tag = self.owner_tag(owner);
        self.phys
            .tag_table(super::physical::observe::Owner::Segment(seg_idx), tag);
        if self.owner_pinned(owner) {
            self.phys.set_pinned(seg_idx, true);
        }
        let pool = &mut self.streams[owner as usize].pools[kind as usize];
        pool.segments.push(seg_idx);
        self.counters.segment.add(kind as usize, 1);
        Ok((seg_idx, block))
    }

    /// Turns free block `idx` (whose pages are mapped) into an allocation of
    /// `rounded` bytes, splitting off the remainder.
    #[inline]
    pub(super) fn take_block(
        &mut self,
        idx: u32,
        size: u64,
        rounded: u64,
        stream: Stream,
    ) -> Allocation {
        let (bsize, addr, seg) = {
            let b = &self.slab[idx];
            (b.size, b.addr, b.seg)
        };
        let (owner, kind) = {
            let s = self.seg(seg);
            (s.owner, s.kind)
        };
        let before = self.inactive_split(seg);
        let is_tail = self.seg(seg).tail == idx;
        if !is_tail {
            let free = &mut self.streams[owner as usize].pools[kind as usize].free;
            free.remove(bsize, addr, idx);
        }
        if bsize > rounded {
            let freed_at = self.slab[idx].freed_at;
            let rest = self.link_free_after(idx, addr + rounded, bsize - rounded, freed_at);
            if is_tail {
                self.seg_mut(seg).tail = rest;
            } else {
                self.streams[owner as usize].pools[kind as usize]
                    .free
                    .insert(bsize - rounded, addr + rounded, rest);
            }
        } else {
            let s = self.seg_mut(seg);
            s.free_blocks -= 1;
            if is_tail {
                s.tail = NIL;
            }
        }
        let b = &mut self.slab[idx];
        b.size = rounded;
        b.requested = size;
        b.state = BlockState::Allocated;
        let s = self.seg_mut(seg);
        s.active_blocks += 1;
        s.active_bytes += rounded;
        self.split_changed(seg, before);
        self.live.insert(addr, idx);
        let k = kind as usize;
        let c = &mut self.counters;
        c.allocation.add(k, 1);
        c.active.add(k, 1);
        c.allocated_bytes.add(k, rounded as i64);
        c.active_bytes.add(k, rounded as i64);
        c.requested_bytes.add(k, size as i64);
        Allocation {
            ptr: addr,
            requested: size,
            size: rounded,
            stream,
        }
    }

    /// Frees the allocation at `ptr`.
    pub(super) fn free<D: Device + ?Sized>(&mut self, dev: &D, ptr: u64) -> AllocResult<()> {
        let Some(idx) = self.live.remove(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let mut pending = false;
        // During a capture, a block other streams used waits until no
        // capture is underway: an event recorded now could not be queried
        // (PyTorch's `needs_events_deferred_until_no_capture`). Any other
        // block goes back to its owner at once, for the capture to reuse.
        let deferred = self.pools.captures > 0 && self.slab[idx].streams.is_some();
        if self.slab[idx].streams.is_some() && !deferred {
            match self.record_free_events(dev, idx) {
                Ok(n) => pending = n > 0,
                Err(e) => {
                    self.live.insert(ptr, idx);
                    return Err(e);
                }
            }
        }
        // A paused block may be freed: its backup is dropped.
        self.sleep.forget(ptr);
        if !self.pools.is_empty() {
            self.pools.forget(ptr);
        }
        // Freeing ends an IPC export.
        self.phys.exports_mut().forget(ptr);
        let (size, requested, seg) = {
            let b = &self.slab[idx];
            (b.size, b.requested, b.seg)
        };
        let k = self.seg(seg).kind as usize;
        let c = &mut self.counters;
        c.allocation.add(k, -1);
        c.allocated_bytes.add(k, -(size as i64));
        c.requested_bytes.add(k, -(requested as i64));
        if pending || deferred {
            self.slab[idx].state = BlockState::PendingFree;
            if deferred {
                self.pools.deferred.push(idx);
            }
        } else {
            self.free_block(idx);
        }
        Ok(())
    }

    /// Makes an allocated or pending-free block free: merges it with free
    /// neighbours and files it in the free index.
    pub(super) fn free_block(&mut self, idx: u32) {
        self.tick += 1;
        let seg = self.slab[idx].seg;
        let (owner, kind) = {
            let s = self.seg(seg);
            (s.owner, s.kind)
        };
        let before = self.inactive_split(seg);
        let size = self.slab[idx].size;
        {
            let s = self.seg_mut(seg);
            s.active_blocks -= 1;
            s.active_bytes -= size;
            s.free_blocks += 1;
        }
        let tick = self.tick;
        let b = &mut self.slab[idx];
        b.state = BlockState::Free;
        b.requested = 0;
        b.freed_at = tick;
        let (prev, next) = (b.prev, b.next);
        // A no_split pool's blocks stay as they are (PyTorch never split
        // them, so it has nothing to merge).
        let merge = !self.owner_no_split(owner);
        let free = &mut self.streams[owner as usize].pools[kind as usize].free;
        let mut merged = 0;
        if merge && prev != NIL && self.slab[prev].state == BlockState::Free {
            let p = &self.slab[prev];
            free.remove(p.size, p.addr, prev);
            let (paddr, psize, pprev, pfreed) = (p.addr, p.size, p.prev, p.freed_at);
            let b = &mut self.slab[idx];
            b.addr = paddr;
            b.size += psize;
            b.prev = pprev;
            b.freed_at = b.freed_at.max(pfreed);
            if pprev != NIL {
                self.slab[pprev].next = idx;
            } else {
                self.seg_mut(seg).first = idx;
            }
            self.slab.remove(prev);
            merged += 1;
        }
        let next_is_tail = self.seg(seg).tail == next;
        let free = &mut self.streams[owner as usize].pools[kind as usize].free;
        if merge && next != NIL && self.slab[next].state == BlockState::Free {
            let n = &self.slab[next];
            if !next_is_tail {
                free.remove(n.size, n.addr, next);
            }
            let (nsize, nnext, nfreed) = (n.size, n.next, n.freed_at);
            let b = &mut self.slab[idx];
            b.size += nsize;
            b.next = nnext;
            b.freed_at = b.freed_at.max(nfreed);
            if nnext != NIL {
                self.slab[nnext].prev = idx;
            }
            self.slab.remove(next);
            merged += 1;
        }
        let b = &self.slab[idx];
        if b.next == NIL {
            // The last block of the segment: it becomes (or stays) the tail.
            self.seg_mut(seg).tail = idx;
        } else {
            let (size, addr) = (b.size, b.addr);
            self.streams[owner as usize].pools[kind as usize]
                .free
                .insert(size, addr, idx);
        }
        self.seg_mut(seg).free_blocks -= merged;
        self.split_changed(seg, before);
        let k = kind as usize;
        self.counters.active.add(k, -1);
        self.counters.active_bytes.add(k, -(size as i64));
    }

    /// Notes that `stream` uses the allocation at `ptr` too.
    pub(super) fn record_stream(&mut self, ptr: u64, stream: Stream) -> AllocResult<()> {
        let Some(&idx) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let seg = self.slab[idx].seg;
        let owner = self.seg(seg).owner;
        if self.streams[owner as usize].stream == stream {
            return Ok(());
        }
        match &mut self.slab[idx].streams {
            Some(v) if v.contains(&stream) => {}
            Some(v) => v.push(stream),
            v @ None => *v = Some(Box::new(vec![stream])),
        }
        Ok(())
    }
}
