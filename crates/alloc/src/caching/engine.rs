//! The allocation and free paths of PyTorch's `DeviceCachingAllocator`
//! (`c10/cuda/CUDACachingAllocator.cpp`), one method per PyTorch function.
//!
//! The same engine runs both baselines: `expandable == false` is the plain
//! caching allocator (segments from `cudaMalloc` = [`Device::alloc`]),
//! `expandable == true` is `expandable_segments:True` (segments from the VMM
//! calls, see [`super::segment`]). Release paths, events and garbage collection
//! are in [`super::release`]; validation, snapshots and reports in [`super::inspect`].

use super::block::{Block, BlockId, BlockPool, Cursor, EsId, IntMap, SizeKey, Slab};
use super::calls::Calls;
use super::config::CachingConfig;
use super::segment::ExpandableSegment;
use super::sizes::{
    get_allocation_size, get_pool, round_size, should_split, PoolKind, K_LARGE_BUFFER,
    K_SMALL_BUFFER, ONE_EXA_BYTES,
};
use crate::{AllocError, AllocResult, Allocation, Stats};
use std::collections::{BTreeMap, VecDeque};
use vmmalloc_device::{Device, Event, MemInfo, Stream};

/// A `cudaMalloc`ed segment of the plain caching allocator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlainSegment {
    pub size: u64,
    pub pool: PoolKind,
    pub stream: Stream,
}

/// What `malloc` carries between its steps (`struct AllocParams`).
#[derive(Debug)]
pub(crate) struct AllocParams {
    /// Rounded request (`search_key.size`).
    pub size: u64,
    pub stream: Stream,
    pub pool: PoolKind,
    /// `get_allocation_size(size)`.
    pub alloc_size: u64,
    /// The block found or allocated.
    pub block: Option<BlockId>,
    /// Where `get_free_block` found `block`: the block is still filed in its
    /// pool's `blocks` there, and `alloc_found_block` takes it out (or files
    /// the split remainder in its place).
    pub cursor: Option<Cursor>,
}

/// The allocator's state, guarded by one lock (`DeviceCachingAllocator`'s members).
#[derive(Debug)]
pub(crate) struct State {
    /// `CUDAAllocatorConfig::expandable_segments()`.
    pub expandable: bool,
    pub config: CachingConfig,
    /// `stats` (driver calls and stream syncs are counted in `calls`).
    pub stats: Stats,
    /// `large_blocks`.
    pub large_blocks: BlockPool,
    /// `small_blocks`.
    pub small_blocks: BlockPool,
    pub slab: Slab,
    /// `allocated_blocks` of `NativeCachingAllocator`: live pointers.
    pub allocated_blocks: IntMap<u64, BlockId>,
    /// `cuda_events`: per stream, events recorded at free time and their block.
    pub cuda_events: BTreeMap<Stream, VecDeque<(Event, BlockId)>>,
    /// `EventPool`: events ready for reuse.
    pub event_pool: Vec<Event>,
    /// `total_allocated_memory`: bytes of segments / mapped pages.
    pub total_allocated_memory: u64,
    /// `allowed_memory_maximum`.
    pub allowed_memory_maximum: u64,
    /// `set_fraction`.
    pub set_fraction: bool,
    /// Plain segments by address.
    pub segments: BTreeMap<u64, PlainSegment>,
    /// `expandable_segments_`.
    pub expandable_segments: BTreeMap<EsId, ExpandableSegment>,
    pub next_es: EsId,
    /// Every driver call, made and counted once (`calls.rs`).
    pub calls: Calls,
}

impl State {
    pub fn new(config: CachingConfig, expandable: bool) -> State {
        let stats = Stats {
            max_split_size: if config.has_split_limit() {
                config.max_split_size as i64
            } else {
                i64::MAX
            },
            ..Stats::default()
        };
        State {
            expandable,
            config,
            stats,
            large_blocks: BlockPool::new(PoolKind::Large),
            small_blocks: BlockPool::new(PoolKind::Small),
            slab: Slab::default(),
            allocated_blocks: IntMap::default(),
            cuda_events: BTreeMap::new(),
            event_pool: Vec::new(),
            total_allocated_memory: 0,
            allowed_memory_maximum: 0,
            set_fraction: false,
            segments: BTreeMap::new(),
            expandable_segments: BTreeMap::new(),
            next_es: 1,
            calls: Calls::default(),
        }
    }

    pub fn pool(&self, kind: PoolKind) -> &BlockPool {
        match kind {
            PoolKind::Small => &self.small_blocks,
            PoolKind::Large => &self.large_blocks,
        }
    }

    pub fn pool_mut(&mut self, kind: PoolKind) -> &mut BlockPool {
        match kind {
            PoolKind::Small => &mut self.small_blocks,
            PoolKind::Large => &mut self.large_blocks,
        }
    }

    /// `BlockPool::insert_into_blocks`: stamps the block's age base and inserts it.
    pub fn insert_into_blocks(&mut self, id: BlockId) {
        let kind = self.slab.get(id).pool;
        let count = self.pool(kind).get_free_blocks_call_count;
        let b = self.slab.get_mut(id);
        b.gc_count_base = count;
        let key = b.size_key(id);
        let inserted = self.pool_mut(kind).blocks.insert(key);
        debug_assert!(inserted, "block inserted twice");
    }

    /// [`State::insert_into_blocks`] for a block whose key changed while a stale
    /// key of it stayed in the set at `c`: the new key replaces the stale one.
    fn refile_at(&mut self, c: Cursor, id: BlockId) {
        let kind = self.slab.get(id).pool;
        let count = self.pool(kind).get_free_blocks_call_count;
        let b = self.slab.get_mut(id);
        b.gc_count_base = count;
        let key = b.size_key(id);
        self.pool_mut(kind).blocks.replace_at(c, key);
    }

    /// Removes a free mapped block from its pool's `blocks`.
    pub fn erase_from_blocks(&mut self, id: BlockId) {
        let b = self.slab.get(id);
        let (kind, key) = (b.pool, b.size_key(id));
        let erased = self.pool_mut(kind).blocks.remove(&key);
        debug_assert!(erased, "block not in its pool");
    }

    fn gc_active(&self) -> bool {
        self.set_fraction && self.config.garbage_collection_threshold > 0.0
    }

    /// `malloc`: process events; round; `get_free_block`; on a miss garbage
    /// collection (if active), then `alloc_block`, then
    /// `release_available_cached_blocks` + `alloc_block`, then
    /// `release_cached_blocks` + `alloc_block` (a retry, `num_alloc_retries`);
    /// then out-of-memory (`num_ooms`). (`trigger_free_memory_callbacks` has no
    /// callbacks to run here.)
    pub fn malloc<D: Device>(
        &mut self,
        dev: &D,
        policy: &'static str,
        orig_size: u64,
        stream: Stream,
    ) -> AllocResult<Allocation> {
        if orig_size == 0 {
            return Err(AllocError::InvalidSize {
                size: 0,
                reason: "size must be positive".into(),
            });
        }
        if orig_size >= ONE_EXA_BYTES {
            return Err(AllocError::InvalidSize {
                size: orig_size,
                reason: "CUDA out of memory. Tried to allocate more than 1EB memory.".into(),
            });
        }
        self.process_events(dev)?;
        let size = round_size(orig_size, &self.config);
        let pool = get_pool(size);
        let mut p = AllocParams {
            size,
            stream,
            pool,
            alloc_size: get_allocation_size(size),
            block: None,
            cursor: None,
        };
        let mut found = self.get_free_block(&mut p);
        if !found {
            if self.gc_active() {
                self.garbage_collect_cached_blocks(dev)?;
            }
            found = self.alloc_block(dev, &mut p, false)?;
            if !found && self.release_available_cached_blocks(dev, &p)? {
                found = self.alloc_block(dev, &mut p, false)?;
            }
            if !found && self.release_cached_blocks(dev)? {
                found = self.alloc_block(dev, &mut p, true)?;
            }
        }
        let Some(block) = p.block.filter(|_| found) else {
            let info = self.calls.observers.mem_info(dev).ok();
            self.stats.num_ooms += 1;
            return Err(self.out_of_memory(dev, policy, orig_size, p.alloc_size, info));
        };
        let split = should_split(
            self.slab.get(block).size,
            size,
            pool,
            self.expandable,
            self.config.max_split_size,
        );
        let id = self.alloc_found_block(&p, orig_size, split);
        let b = self.slab.get(id);
        Ok(Allocation {
            ptr: b.ptr,
            requested: orig_size,
            size: b.size,
            stream,
        })
    }

    /// `get_free_block`: the best fit by (stream, size, address) in the pool.
    /// Refuses a block of at least `max_split_size` for a smaller request, and for
    /// an oversize request a block `max_non_split_rounding_size` (20 MiB) or more
    /// larger. With expandable segments a block followed by unmapped space counts
    /// as large as it can grow.
    pub fn get_free_block(&mut self, p: &mut AllocParams) -> bool {
        let gc = self.gc_active();
        let expandable = self.expandable;
        let max_split = self.config.max_split_size;
        let rounding = self.config.max_non_split_rounding_size;
        let slab = &self.slab;
        let pool = match p.pool {
            PoolKind::Small => &mut self.small_blocks,
            PoolKind::Large => &mut self.large_blocks,
        };
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        // A cursor at the best fit: the first block of the stream not below the request.
        let blocks = &pool.blocks;
        let mut cur = blocks.cursor(p.stream, p.size, 0);
        let Some(mut it) = blocks.at(&cur) else {
            return false;
        };
        if slab.get(it.3).segment.is_some() {
            if expandable {
                let expandable_size = |id: BlockId| {
                    let b = slab.get(id);
                    b.size
                        + b.next
                            .filter(|&n| !slab.get(n).mapped)
                            .map_or(0, |n| slab.get(n).size)
                };
                loop {
                    let nc = blocks.advance(&cur);
                    let Some(next) = blocks.at(&nc) else {
                        break;
                    };
                    if !(slab.get(it.3).segment.is_some()
                        && expandable_size(next.3) < expandable_size(it.3))
                    {
                        break;
                    }
                    it = next;
                    cur = nc;
                }
            } else {
                // Expandable segments were switched off: only plain blocks qualify.
                loop {
                    cur = blocks.advance(&cur);
                    match blocks.at(&cur) {
                        None => return false,
                        Some(k) => {
                            it = k;
                            if slab.get(it.3).segment.is_none() {
                                break;
                            }
                        }
                    }
                }
            }
        }
        let block_size = it.1;
        if p.size < max_split && block_size >= max_split {
            return false;
        }
        if p.size >= max_split && block_size >= p.size.saturating_add(rounding) {
            return false;
        }
        p.block = Some(it.3);
        p.cursor = Some(cur);
        true
    }

    /// `alloc_block`: a new segment of `alloc_size` bytes from `cudaMalloc`, or
    /// with expandable segments `try_allocate_expandable_block` for the rounded
    /// request. `Ok(false)` on out-of-memory (or past the memory fraction);
    /// other driver errors are returned. A retry counts in `num_alloc_retries`.
    pub fn alloc_block<D: Device>(
        &mut self,
        dev: &D,
        p: &mut AllocParams,
        is_retry: bool,
    ) -> AllocResult<bool> {
        let size = p.alloc_size;
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.set_fraction && self.total_allocated_memory + size > self.allowed_memory_maximum {
            return Ok(false);
        }
        if self.expandable {
            p.block = self.try_allocate_expandable_block(dev, p.stream, p.pool, p.size)?;
            return Ok(p.block.is_some());
        }
        let ptr = match self.calls.alloc(dev, size) {
            Ok(ptr) => ptr,
            Err(e) if e.is_out_of_memory() => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        self.total_allocated_memory += size;
        let id = self
            .slab
            .insert(Block::new(p.stream, size, p.pool, ptr, None));
        let st = p.pool.stat_type();
        self.stats.segment.update(st, 1);
        self.stats.reserved_bytes.update(st, size as i64);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.update(1);
        }
        self.stats.num_device_alloc += 1;
        self.segments.insert(
            ptr,
            PlainSegment {
                size,
                pool: p.pool,
                stream: p.stream,
            },
        );
        p.block = Some(id);
        Ok(true)
    }

    /// `alloc_found_block`: splits off the remainder if `split_remainder`,
    /// marks the block allocated and updates the stats (`inactive_split` only
    /// outside expandable segments, as PyTorch does).
    pub fn alloc_found_block(
        &mut self,
        p: &AllocParams,
        orig_size: u64,
        split_remainder: bool,
    ) -> BlockId {
        let size = p.size;
        let st = p.pool.stat_type();
        let mut block = p.block.expect("a block was found");
        let already_split = self.slab.get(block).is_split();
        let es = self.slab.get(block).segment;
        if let (Some(c), false) = (p.cursor, split_remainder) {
            self.pool_mut(p.pool).blocks.remove_at(c);
        }
        if split_remainder {
            let remaining = block;
            let (rptr, rprev) = {
                let r = self.slab.get(remaining);
                (r.ptr, r.prev)
            };
            let mut nb = Block::new(p.stream, size, p.pool, rptr, es);
            nb.prev = rprev;
            nb.next = Some(remaining);
            block = self.slab.insert(nb);
            if let Some(prev) = rprev {
                self.slab.get_mut(prev).next = Some(block);
            }
            self.slab.get_mut(remaining).prev = Some(block);
            self.slab.set_ptr(remaining, rptr + size);
            self.slab.get_mut(remaining).size -= size;
            match p.cursor {
                // The remainder takes the found block's place in the set.
                Some(c) => self.refile_at(c, remaining),
                None => self.insert_into_blocks(remaining),
            }
            if es.is_none() {
                if already_split {
                    // An already-split inactive block is being shrunk by size bytes.
                    self.stats.inactive_split_bytes.update(st, -(size as i64));
                } else {
                    // A new split inactive block is being created from an unsplit one.
                    let rsize = self.slab.get(remaining).size;
                    self.stats.inactive_split_bytes.update(st, rsize as i64);
                    self.stats.inactive_split.update(st, 1);
                }
            }
        } else if already_split && es.is_none() {
            // An already-split block is becoming active.
            let bsize = self.slab.get(block).size;
            self.stats.inactive_split_bytes.update(st, -(bsize as i64));
            self.stats.inactive_split.update(st, -1);
        }
        let (ptr, bsize) = {
            let b = self.slab.get_mut(block);
            b.allocated = true;
            b.requested_size = orig_size;
            (b.ptr, b.size)
        };
        self.allocated_blocks.insert(ptr, block);
        let s = &mut self.stats;
        s.allocation.update(st, 1);
        s.allocated_bytes.update(st, bsize as i64);
        s.active.update(st, 1);
        s.active_bytes.update(st, bsize as i64);
        s.requested_bytes.update(st, orig_size as i64);
        if bsize >= self.config.max_split_size {
            s.oversize_allocations.update(1);
        }
        block
    }

    /// `free`: the block stops counting as allocated at once; it returns to its
    /// pool (`free_block`) now, or, if other streams used it (`recordStream`),
    /// once the events recorded on them now have completed (`insert_events`).
    pub fn free<D: Device>(&mut self, dev: &D, ptr: u64) -> AllocResult<()> {
        let Some(&id) = self.allocated_blocks.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        // Record the events first: a failure leaves the allocation live.
        let events = if self.slab.get(id).stream_uses.is_empty() {
            None
        } else {
            Some(self.record_events(dev, id)?)
        };
        self.allocated_blocks.remove(&ptr);
        let (size, st) = {
            let b = self.slab.get_mut(id);
            b.allocated = false;
            (b.size, b.pool.stat_type())
        };
        self.stats.allocation.update(st, -1);
        self.stats.allocated_bytes.update(st, -(size as i64));
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.update(-1);
        }
        match events {
            Some(events) => self.insert_events(id, events),
            None => self.free_block(id),
        }
        Ok(())
    }

    /// `recordStream`: `stream` uses the block too (ignored for its own stream).
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> AllocResult<()> {
        let Some(&id) = self.allocated_blocks.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let b = self.slab.get_mut(id);
        if b.stream != stream {
            b.stream_uses.insert(stream);
        }
        Ok(())
    }

    /// `free_block`: merges the block with free neighbours (`try_merge_blocks`),
    /// returns it to its pool and updates `active*`, `requested_bytes` and
    /// `inactive_split*`.
    pub fn free_block(&mut self, id: BlockId) {
        let (orig_size, requested, pool, es, prev, next) = {
            let b = self.slab.get(id);
            debug_assert!(b.is_allocatable(), "free_block of a busy block");
            (b.size, b.requested_size, b.pool, b.segment, b.prev, b.next)
        };
        let st = pool.stat_type();
        let mut net_blocks: i64 = 0;
        let mut net_size: i64 = 0;
        // The free neighbours absorbed, by their keys in the pool's set.
        let mut absorbed: [Option<SizeKey>; 2] = [None, None];
        for (slot, cand) in absorbed.iter_mut().zip([prev, next]) {
            if let Some((subsumed, key)) = self.merge_blocks(id, cand) {
                net_blocks -= 1;
                net_size -= subsumed as i64;
                *slot = key;
            }
        }
        // The merged block takes the place of an absorbed neighbour in the set:
        // one move instead of a removal and an insertion.
        match absorbed {
            [None, None] => self.insert_into_blocks(id),
            [Some(k), other] | [other, Some(k)] => {
                if let Some(o) = other {
                    let removed = self.pool_mut(pool).blocks.remove(&o);
                    debug_assert!(removed, "merged block was not in its pool");
                }
                let count = self.pool(pool).get_free_blocks_call_count;
                let b = self.slab.get_mut(id);
                b.gc_count_base = count;
                let key = b.size_key(id);
                let moved = self.pool_mut(pool).blocks.replace(&k, key);
                debug_assert!(moved, "merged block was not in its pool");
            }
        }
        let b = self.slab.get(id);
        if b.is_split() {
            net_blocks += 1;
            net_size += b.size as i64;
        }
        let s = &mut self.stats;
        if es.is_none() {
            if net_blocks != 0 {
                s.inactive_split.update(st, net_blocks);
            }
            if net_size != 0 {
                s.inactive_split_bytes.update(st, net_size);
            }
        }
        s.active.update(st, -1);
        s.active_bytes.update(st, -(orig_size as i64));
        s.requested_bytes.update(st, -(requested as i64));
    }

    /// `try_merge_blocks`: absorbs `src` into `dst` if `src` is free and mapped
    /// the same way; returns the bytes absorbed (0: no merge). `dst` must not be
    /// in a pool set.
    pub fn try_merge_blocks(&mut self, dst: BlockId, src: Option<BlockId>) -> u64 {
        match self.merge_blocks(dst, src) {
            Some((subsumed, Some(key))) => {
                let pool = self.slab.get(dst).pool;
                let removed = self.pool_mut(pool).blocks.remove(&key);
                debug_assert!(removed, "merged block was not in its pool");
                subsumed
            }
            Some((subsumed, None)) => subsumed,
            None => 0,
        }
    }

    /// [`State::try_merge_blocks`] but a mapped `src`'s key stays in the pool's
    /// `blocks` (stale: its block is gone) for the caller to remove or reuse:
    /// `Some((bytes absorbed, that key))` on a merge.
    fn merge_blocks(
        &mut self,
        dst: BlockId,
        src: Option<BlockId>,
    ) -> Option<(u64, Option<SizeKey>)> {
        let src = src?;
        let (s_ptr, s_size, s_prev, s_next, s_mapped, s_pool, s_alloc) = {
            let s = self.slab.get(src);
            (
                s.ptr,
                s.size,
                s.prev,
                s.next,
                s.mapped,
                s.pool,
                s.is_allocatable(),
            )
        };
        if !s_alloc || self.slab.get(dst).mapped != s_mapped {
            return None;
        }
        let s = self.slab.get(src);
        let key = if s_mapped {
            Some(s.size_key(src))
        } else {
            let k = s.addr_key(src);
            let removed = self.pool_mut(s_pool).unmapped.remove(&k);
            debug_assert!(removed, "merged block was not in its pool");
            None
        };
        if self.slab.get(dst).prev == Some(src) {
            // [src dst]
            self.slab.set_ptr(dst, s_ptr);
            self.slab.get_mut(dst).prev = s_prev;
            if let Some(pp) = s_prev {
                self.slab.get_mut(pp).next = Some(dst);
            }
        } else {
            // [dst src]
            self.slab.get_mut(dst).next = s_next;
            if let Some(nn) = s_next {
                self.slab.get_mut(nn).prev = Some(dst);
            }
        }
        self.slab.get_mut(dst).size += s_size;
        self.slab.remove(src);
        Some((s_size, key))
    }

    /// `find_expandable_block`: the lowest-addressed run of free and unmapped
    /// blocks of this stream's segment with room for `size` bytes, or a new
    /// expandable segment (`Ok(None)` if the address space ran out).
    pub fn find_expandable_block<D: Device>(
        &mut self,
        dev: &D,
        stream: Stream,
        pool: PoolKind,
        size: u64,
    ) -> AllocResult<Option<BlockId>> {
        let keys: Vec<_> = self
            .pool(pool)
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .copied()
            .collect();
        for k in keys {
            let mut c = k.2;
            if let Some(prev) = self.slab.get(c).prev {
                if self.slab.get(prev).is_allocatable() {
                    c = prev;
                }
            }
            if self.has_available_address_space(c, size) {
                return Ok(Some(c));
            }
        }
        let segment_size = if pool.is_small() {
            K_SMALL_BUFFER
        } else {
            K_LARGE_BUFFER
        };
        let es_id = self.next_es;
        // The counter's owner id; ids past u32::MAX share the last one.
        let seg = u32::try_from(es_id).unwrap_or(u32::MAX);
        let es = match ExpandableSegment::new(dev, &mut self.calls, seg, stream, segment_size) {
            Ok(es) => es,
            Err(e) if e.is_out_of_memory() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.next_es += 1;
        let mut b = Block::new(stream, es.size(), pool, es.ptr, Some(es_id));
        b.mapped = false;
        let id = self.slab.insert(b);
        let key = self.slab.get(id).addr_key(id);
        self.pool_mut(pool).unmapped.insert(key);
        self.expandable_segments.insert(es_id, es);
        Ok(Some(id))
    }

    fn has_available_address_space(&self, start: BlockId, size: u64) -> bool {
        let mut bytes = 0;
        let mut b = Some(start);
        while bytes < size {
            match b {
                Some(id) if self.slab.get(id).is_allocatable() => {
                    bytes += self.slab.get(id).size;
                    b = self.slab.get(id).next;
                }
                _ => break,
            }
        }
        bytes >= size
    }

    /// `map_block`: maps the first `size` bytes (rounded up to pages) of the
    /// unmapped block `to_map`, splits off the rest, merges with free neighbours
    /// and returns the result to the pool. `Ok(false)` on out-of-memory.
    pub fn map_block<D: Device>(
        &mut self,
        dev: &D,
        to_map: BlockId,
        size: u64,
    ) -> AllocResult<bool> {
        let (es_id, ptr, tsize, pool, stream) = {
            let b = self.slab.get(to_map);
            debug_assert!(!b.mapped && size <= b.size);
            (
                b.segment.expect("expandable block"),
                b.ptr,
                b.size,
                b.pool,
                b.stream,
            )
        };
        let es = self
            .expandable_segments
            .get_mut(&es_id)
            .expect("live segment");
        let Some((_, msize)) = es.map(dev, &mut self.calls, ptr, size)? else {
            return Ok(false);
        };
        let key = self.slab.get(to_map).addr_key(to_map);
        self.pool_mut(pool).unmapped.remove(&key);
        self.slab.get_mut(to_map).mapped = true;
        if msize < tsize {
            let next = self.slab.get(to_map).next;
            let mut r = Block::new(stream, tsize - msize, pool, ptr + msize, Some(es_id));
            r.mapped = false;
            r.prev = Some(to_map);
            r.next = next;
            let rid = self.slab.insert(r);
            self.slab.get_mut(to_map).next = Some(rid);
            if let Some(n) = next {
                self.slab.get_mut(n).prev = Some(rid);
            }
            let rkey = self.slab.get(rid).addr_key(rid);
            self.pool_mut(pool).unmapped.insert(rkey);
            self.slab.get_mut(to_map).size = msize;
        }
        let prev = self.slab.get(to_map).prev;
        self.try_merge_blocks(to_map, prev);
        let next = self.slab.get(to_map).next;
        self.try_merge_blocks(to_map, next);
        self.insert_into_blocks(to_map);
        self.total_allocated_memory += msize;
        self.stats
            .reserved_bytes
            .update(pool.stat_type(), msize as i64);
        self.stats.num_device_alloc += 1;
        Ok(true)
    }

    /// `try_allocate_expandable_block`: maps pages after the run found by
    /// `find_expandable_block` until it holds `size` bytes.
    pub fn try_allocate_expandable_block<D: Device>(
        &mut self,
        dev: &D,
        stream: Stream,
        pool: PoolKind,
        size: u64,
    ) -> AllocResult<Option<BlockId>> {
        let Some(mut candidate) = self.find_expandable_block(dev, stream, pool, size)? else {
            return Ok(None);
        };
        if !self.slab.get(candidate).mapped {
            let csize = self.slab.get(candidate).size;
            if !self.map_block(dev, candidate, csize.min(size))? {
                return Ok(None);
            }
        }
        while self.slab.get(candidate).size < size {
            // invariant: free -> unmapped -> *
            let remaining = size - self.slab.get(candidate).size;
            let Some(next) = self.slab.get(candidate).next else {
                return Ok(None);
            };
            let nb = self.slab.get(next);
            if nb.mapped || !nb.is_allocatable() {
                return Ok(None);
            }
            let nsize = nb.size;
            if !self.map_block(dev, next, remaining.min(nsize))? {
                return Ok(None);
            }
            candidate = next;
        }
        self.erase_from_blocks(candidate);
        Ok(Some(candidate))
    }

    /// `setMemoryFraction`: `allowed_memory_maximum = fraction × total`.
    pub fn set_memory_fraction<D: Device>(&mut self, dev: &D, fraction: f64) -> AllocResult<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidOption(format!(
                "invalid fraction:{fraction}. Please set within (0, 1)."
            )));
        }
        let MemInfo { total, .. } = self.calls.observers.mem_info(dev)?;
        self.allowed_memory_maximum = (fraction * total as f64) as u64;
        self.set_fraction = true;
        Ok(())
    }
}
