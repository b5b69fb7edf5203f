//! Looking at the state: `validate()`, snapshots, stats, the out-of-memory
//! report, and teardown.

use super::block::{BlockId, IntMap};
use super::engine::State;
use super::sizes::PoolKind;
use crate::{
    AllocError, BlockInfo, BlockState, CachingCause, OomReport, Pin, SegmentInfo, Snapshot,
    StatType, Stats, StreamUsage,
};
use std::collections::{BTreeMap, HashMap};
use vmmalloc_device::{Device, MemInfo, Stream};

/// A recount of the stats that describe current state.
#[derive(Default)]
struct Recount {
    allocation: [i64; 3],
    allocated_bytes: [i64; 3],
    active: [i64; 3],
    active_bytes: [i64; 3],
    requested_bytes: [i64; 3],
    reserved_bytes: [i64; 3],
    segment: [i64; 3],
    inactive_split: [i64; 3],
    inactive_split_bytes: [i64; 3],
    oversize_allocations: i64,
    oversize_segments: i64,
}

fn add(a: &mut [i64; 3], pool: PoolKind, v: i64) {
    a[0] += v;
    a[pool.stat_type() as usize] += v;
}

impl State {
    /// The state of a block as the snapshot names it.
    fn block_state(&self, id: BlockId) -> BlockState {
        let b = self.slab.get(id);
        if b.allocated {
            BlockState::ActiveAllocated
        } else if b.is_pending_free() {
            BlockState::ActivePendingFree
        } else if b.mapped {
            BlockState::Inactive
        } else {
            BlockState::Unmapped
        }
    }

    /// Walks a segment from the block at `head`: the blocks in address order.
    fn walk(&self, by_ptr: &IntMap<u64, BlockId>, head: u64) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut cur = by_ptr.get(&head).copied();
        while let Some(id) = cur {
            out.push(id);
            cur = self.slab.get(id).next;
            if out.len() > self.slab.len() {
                break; // a cycle; validate() reports it
            }
        }
        out
    }

    /// Every segment as (start, size, pool, stream, expandable).
    fn segment_ranges(&self) -> Vec<(u64, u64, PoolKind, Stream, bool)> {
        let mut v: Vec<_> = self
            .segments
            .iter()
            .map(|(&p, s)| (p, s.size, s.pool, s.stream, false))
            .chain(self.expandable_segments.values().map(|es| {
                let pool = if es.segment_size == super::sizes::K_SMALL_BUFFER {
                    PoolKind::Small
                } else {
                    PoolKind::Large
                };
                (es.ptr, es.size(), pool, es.stream, true)
            }))
            .collect();
        v.sort_by_key(|s| s.0);
        v
    }

    /// Stats as PyTorch reports them, plus our driver-call counts.
    pub fn stats_view(&self) -> Stats {
        let mut s = self.stats.clone();
        s.driver_calls = self.calls.counts();
        // Stream and event waits: `cuStreamSynchronize` before unmapping
        // pages, `cuEventSynchronize` when freeing every event's block.
        s.num_stream_syncs = s.driver_calls.stream_syncs();
        s.pages_mapped = self
            .expandable_segments
            .values()
            .map(|e| e.mapped_pages())
            .sum();
        s
    }

    /// PyTorch's `snapshot()` in our [`Snapshot`] shape: one entry per segment
    /// (an expandable segment is one entry covering its whole reservation, its
    /// unmapped ranges as [`BlockState::Unmapped`] blocks).
    pub fn snapshot<D: Device>(&self, dev: &D) -> Snapshot {
        let (by_ptr, _) = self.slab.by_ptr();
        let mut segments = Vec::new();
        for (start, total, pool, stream, expandable) in self.segment_ranges() {
            let mut info = SegmentInfo {
                address: start,
                total_size: total,
                stream,
                segment_type: pool.name(),
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                is_expandable: expandable,
                pool: (0, 0),
                blocks: Vec::new(),
            };
            for id in self.walk(&by_ptr, start) {
                let b = self.slab.get(id);
                let state = self.block_state(id);
                let active = matches!(
                    state,
                    BlockState::ActiveAllocated | BlockState::ActivePendingFree
                );
                if b.allocated {
                    info.allocated_size += b.size;
                }
                if active {
                    info.active_size += b.size;
                    info.requested_size += b.requested_size;
                }
                info.blocks.push(BlockInfo {
                    address: b.ptr,
                    size: b.size,
                    requested_size: if active { b.requested_size } else { 0 },
                    state,
                });
            }
            segments.push(info);
        }
        Snapshot {
            device: dev.caps().ordinal,
            segments,
            mapped_bytes: self.total_allocated_memory,
            pooled_bytes: 0,
        }
    }

    /// The out-of-memory error `malloc` raises, with PyTorch's figures.
    pub fn out_of_memory<D: Device>(
        &self,
        dev: &D,
        policy: &'static str,
        orig_size: u64,
        alloc_size: u64,
        info: Option<MemInfo>,
    ) -> AllocError {
        let total = info.map_or(dev.caps().total_memory, |i| i.total);
        let allocated = self.stats.allocated_bytes.all().current.max(0) as u64;
        let reserved = self.stats.reserved_bytes.all().current.max(0) as u64;
        let mut per: BTreeMap<Stream, (u64, u64)> = BTreeMap::new();
        let mut largest_free = 0;
        for (_, b) in self.slab.iter() {
            if !b.mapped {
                continue;
            }
            let e = per.entry(b.stream).or_default();
            if b.allocated {
                e.0 += b.size;
            } else if b.is_allocatable() {
                e.1 += b.size;
                largest_free = largest_free.max(b.size);
            }
        }
        let hint = if self.expandable {
            "Every free page was already unmapped and released (release_cached_blocks); the remaining reserved \
             memory lies in pages shared with live tensors."
                .to_string()
        } else {
            "If reserved but unallocated memory is large try setting \
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
                .to_string()
        };
        // Units (segments; pages of expandable segments) with both live and
        // free (mapped) bytes, and the live blocks in them: PyTorch releases
        // only wholly free segments (`release_cached_blocks`) and, with
        // expandable segments, only wholly free pages (`unmap_block`).
        let (by_ptr, _) = self.slab.by_ptr();
        let ranges = self.segment_ranges();
        // unit start -> (unit size, free bytes, live blocks as (ptr, size))
        type Unit = (u64, u64, Vec<(u64, u64)>);
        let mut units: BTreeMap<u64, Unit> = BTreeMap::new();
        for &(start, total, _, _, expandable) in &ranges {
            let page = if expandable {
                self.expandable_segments
                    .values()
                    .find(|es| es.ptr == start)
                    .map_or(total, |es| es.segment_size)
            } else {
                total
            }
            .max(1);
            for id in self.walk(&by_ptr, start) {
                let b = self.slab.get(id);
                let free = b.mapped && !b.allocated && b.is_allocatable();
                if !(free || b.allocated) {
                    continue;
                }
                let mut at = b.ptr;
                let end = b.ptr + b.size;
                while at < end {
                    let unit = start + (at - start) / page * page;
                    let upto = (unit + page).min(end);
                    let u = units.entry(unit).or_insert((
                        page.min(start + total - unit),
                        0,
                        Vec::new(),
                    ));
                    if free {
                        u.1 += upto - at;
                    } else if u.2.last().is_none_or(|l| l.0 != b.ptr) {
                        u.2.push((b.ptr, b.size));
                    }
                    at = upto;
                }
            }
        }
        let mut fragmented = 0;
        let mut fragmented_free = 0;
        let mut pins = Vec::new();
        for (unit, (size, free, live)) in units {
            if free == 0 || live.is_empty() {
                continue;
            }
            fragmented += 1;
            fragmented_free += free;
            if let Some(&(ptr, bsize)) = live.iter().max_by_key(|l| l.1) {
                pins.push(Pin {
                    ptr,
                    size: bsize,
                    segment: unit,
                    segment_size: size,
                    segment_free: free,
                    live_blocks: live.len(),
                    frames: None,
                });
            }
        }
        pins.sort_by_key(|p| std::cmp::Reverse((p.segment_free, p.segment)));
        pins.truncate(CachingCause::MAX_PINS);
        let caching = Some(Box::new(CachingCause {
            round_size: super::sizes::round_size(orig_size, &self.config),
            segments: ranges.len(),
            unit: if self.expandable { "page" } else { "segment" },
            fragmented,
            fragmented_free,
            pins,
        }));
        AllocError::OutOfMemory(Box::new(OomReport {
            policy,
            device: dev.caps().ordinal,
            requested: orig_size,
            rounded: alloc_size,
            capacity: total,
            allowed: (self.set_fraction && self.allowed_memory_maximum < total)
                .then_some(self.allowed_memory_maximum),
            device_free: info.map_or(0, |i| i.free),
            live: allocated,
            cached: reserved.saturating_sub(allocated),
            pooled: 0,
            largest_free,
            per_stream: per
                .into_iter()
                .map(|(stream, (live, cached))| StreamUsage {
                    stream,
                    live,
                    cached,
                })
                .collect(),
            hint,
            caching,
        }))
    }

    /// Checks every invariant; the first broken one is described.
    pub fn validate<D: Device>(&self, dev: &D) -> Result<(), String> {
        let mut rc = Recount::default();
        // 1. Segments do not overlap; each is tiled by its blocks.
        self.check_segments(&mut rc)?;
        // 2. Pool sets match block states; stats recount.
        self.check_blocks(&mut rc)?;
        self.check_stats(&rc)?;
        self.check_call_counter()?;
        // 3. The device agrees.
        self.check_device(dev)
    }

    /// Segments do not overlap, each is tiled by its blocks, expandable
    /// segments hold handles for exactly their mapped pages, and every block
    /// lies in a segment; counts segments and reserved bytes into `rc`.
    fn check_segments(&self, rc: &mut Recount) -> Result<(), String> {
        let (by_ptr, shared) = self.slab.by_ptr();
        if let Some(p) = shared {
            return Err(format!("two blocks start at {p:#x}"));
        }
        let mut end = 0;
        let mut seen = 0usize;
        for (start, size, pool, stream, expandable) in self.segment_ranges() {
            if start < end {
                return Err(format!("segment {start:#x} overlaps the previous one"));
            }
            end = start + size;
            let ids = self.walk(&by_ptr, start);
            self.check_tiling(&ids, (start, size, pool, stream, expandable))?;
            seen += ids.len();
            if expandable {
                self.check_expandable_pages(start, pool, &ids, rc)?;
            } else {
                add(&mut rc.segment, pool, 1);
                add(&mut rc.reserved_bytes, pool, size as i64);
                if size >= self.config.max_split_size {
                    rc.oversize_segments += 1;
                }
            }
        }
        if seen != self.slab.len() {
            return Err(format!(
                "{} blocks exist but {seen} lie in segments",
                self.slab.len()
            ));
        }
        Ok(())
    }

    /// The blocks `ids` of the segment `(start, size, pool, stream,
    /// expandable)` follow one another without gaps, agree with it and with
    /// their links, and free neighbours were merged.
    fn check_tiling(
        &self,
        ids: &[BlockId],
        (start, size, pool, stream, expandable): (u64, u64, PoolKind, Stream, bool),
    ) -> Result<(), String> {
        let mut cursor = start;
        let mut prev: Option<BlockId> = None;
        for &id in ids {
            let b = self.slab.get(id);
            if b.ptr != cursor {
                return Err(format!(
                    "segment {start:#x}: block at {:#x}, expected {cursor:#x}",
                    b.ptr
                ));
            }
            if b.prev != prev {
                return Err(format!("block {:#x}: prev link broken", b.ptr));
            }
            if b.size == 0 {
                return Err(format!("block {:#x} is empty", b.ptr));
            }
            if b.pool != pool || b.stream != stream || b.segment.is_some() != expandable {
                return Err(format!(
                    "block {:#x} disagrees with its segment (pool/stream/kind)",
                    b.ptr
                ));
            }
            if let (Some(p), true) = (prev, b.is_allocatable()) {
                let pb = self.slab.get(p);
                if pb.is_allocatable() && pb.mapped == b.mapped {
                    return Err(format!(
                        "free neighbours {:#x} and {:#x} were not merged",
                        pb.ptr, b.ptr
                    ));
                }
            }
            cursor += b.size;
            prev = Some(id);
        }
        if cursor != start + size {
            return Err(format!(
                "segment {start:#x}: blocks cover {:#x} of {size:#x} bytes",
                cursor - start
            ));
        }
        Ok(())
    }

    /// Pages with a handle are exactly the pages under mapped blocks of the
    /// expandable segment at `start` (unmapped blocks are page-aligned, the
    /// handle list is trimmed); counts the mapped bytes into `rc`.
    fn check_expandable_pages(
        &self,
        start: u64,
        pool: PoolKind,
        ids: &[BlockId],
        rc: &mut Recount,
    ) -> Result<(), String> {
        let es = self
            .expandable_segments
            .values()
            .find(|e| e.ptr == start)
            .ok_or("expandable segment vanished")?;
        let pages = es.max_handles as usize;
        let mut want = vec![false; pages];
        for &id in ids {
            let b = self.slab.get(id);
            if !b.mapped {
                if !(b.ptr - start).is_multiple_of(es.segment_size)
                    || !b.size.is_multiple_of(es.segment_size)
                {
                    return Err(format!("unmapped block {:#x} is not page-aligned", b.ptr));
                }
                continue;
            }
            let first = ((b.ptr - start) / es.segment_size) as usize;
            let last = ((b.ptr + b.size - 1 - start) / es.segment_size) as usize;
            want[first..=last].iter_mut().for_each(|w| *w = true);
            add(&mut rc.reserved_bytes, pool, b.size as i64);
        }
        for (i, w) in want.iter().enumerate() {
            let has = es.handles.get(i).is_some_and(|h| h.is_some());
            if has != *w {
                return Err(format!(
                    "segment {start:#x} page {i}: handle {has}, mapped blocks {w}"
                ));
            }
        }
        if matches!(es.handles.last(), Some(None)) {
            return Err(format!("segment {start:#x}: handles not trimmed"));
        }
        Ok(())
    }

    /// Each block is filed in the pool sets its state says, agrees with the
    /// pointer table and the event queues; the pool sets list nothing else;
    /// counts the block stats into `rc`.
    fn check_blocks(&self, rc: &mut Recount) -> Result<(), String> {
        let mut events: HashMap<BlockId, u32> = HashMap::new();
        for q in self.cuda_events.values() {
            for &(_, id) in q {
                *events.entry(id).or_default() += 1;
            }
        }
        let mut in_blocks = 0;
        let mut in_unmapped = 0;
        for (id, b) in self.slab.iter() {
            let pool = self.pool(b.pool);
            if pool.kind != b.pool {
                return Err(format!("block {:#x} is filed under the wrong pool", b.ptr));
            }
            let listed = pool.blocks.contains(&b.size_key(id));
            let listed_unmapped = pool.unmapped.contains(&b.addr_key(id));
            let free_mapped = b.is_allocatable() && b.mapped;
            if listed != free_mapped {
                return Err(format!(
                    "block {:#x}: in free set {listed}, free and mapped {free_mapped}",
                    b.ptr
                ));
            }
            if listed_unmapped == b.mapped {
                return Err(format!(
                    "block {:#x}: in unmapped set {listed_unmapped}, mapped {}",
                    b.ptr, b.mapped
                ));
            }
            if !b.mapped && !b.is_allocatable() {
                return Err(format!("unmapped block {:#x} is in use", b.ptr));
            }
            in_blocks += listed as usize;
            in_unmapped += listed_unmapped as usize;
            if b.allocated != (self.allocated_blocks.get(&b.ptr) == Some(&id)) {
                return Err(format!(
                    "block {:#x}: allocated flag disagrees with the pointer table",
                    b.ptr
                ));
            }
            if !b.allocated && !b.stream_uses.is_empty() {
                return Err(format!("free block {:#x} still lists stream uses", b.ptr));
            }
            if events.get(&id).copied().unwrap_or(0) != b.event_count {
                return Err(format!(
                    "block {:#x}: event_count {} disagrees with queued events",
                    b.ptr, b.event_count
                ));
            }
            let active = b.allocated || b.is_pending_free();
            if b.allocated {
                add(&mut rc.allocation, b.pool, 1);
                add(&mut rc.allocated_bytes, b.pool, b.size as i64);
                if b.size >= self.config.max_split_size {
                    rc.oversize_allocations += 1;
                }
            }
            if active {
                add(&mut rc.active, b.pool, 1);
                add(&mut rc.active_bytes, b.pool, b.size as i64);
                add(&mut rc.requested_bytes, b.pool, b.requested_size as i64);
            }
            if free_mapped && b.segment.is_none() && b.is_split() {
                add(&mut rc.inactive_split, b.pool, 1);
                add(&mut rc.inactive_split_bytes, b.pool, b.size as i64);
            }
        }
        let listed: usize = [&self.small_blocks, &self.large_blocks]
            .iter()
            .map(|p| p.blocks.len())
            .sum();
        let listed_u: usize = [&self.small_blocks, &self.large_blocks]
            .iter()
            .map(|p| p.unmapped.len())
            .sum();
        if listed != in_blocks || listed_u != in_unmapped {
            return Err(format!(
                "pool sets list {listed}+{listed_u} blocks, {in_blocks}+{in_unmapped} of them live"
            ));
        }
        if self.allocated_blocks.len() as i64 != rc.allocation[0] {
            return Err("the pointer table holds stale entries".into());
        }
        Ok(())
    }

    /// The stats of current state equal the recount `rc`; no empty event
    /// queue is kept.
    fn check_stats(&self, rc: &Recount) -> Result<(), String> {
        let s = &self.stats;
        let arrays: [(&str, &crate::stats::StatArray, &[i64; 3]); 9] = [
            ("allocation", &s.allocation, &rc.allocation),
            ("allocated_bytes", &s.allocated_bytes, &rc.allocated_bytes),
            ("active", &s.active, &rc.active),
            ("active_bytes", &s.active_bytes, &rc.active_bytes),
            ("requested_bytes", &s.requested_bytes, &rc.requested_bytes),
            ("reserved_bytes", &s.reserved_bytes, &rc.reserved_bytes),
            ("segment", &s.segment, &rc.segment),
            ("inactive_split", &s.inactive_split, &rc.inactive_split),
            (
                "inactive_split_bytes",
                &s.inactive_split_bytes,
                &rc.inactive_split_bytes,
            ),
        ];
        for (name, arr, want) in arrays {
            for (t, tn) in [
                (StatType::All, "all"),
                (StatType::Small, "small_pool"),
                (StatType::Large, "large_pool"),
            ] {
                let got = arr.get(t).current;
                if got != want[t as usize] {
                    return Err(format!(
                        "stat {name}.{tn}.current is {got}, recount {}",
                        want[t as usize]
                    ));
                }
            }
        }
        if s.oversize_allocations.current != rc.oversize_allocations
            || s.oversize_segments.current != rc.oversize_segments
        {
            return Err("oversize stats disagree with a recount".into());
        }
        if self.total_allocated_memory as i64 != rc.reserved_bytes[0] {
            return Err(format!(
                "total_allocated_memory {} != reserved recount {}",
                self.total_allocated_memory, rc.reserved_bytes[0]
            ));
        }
        for q in self.cuda_events.values() {
            if q.is_empty() {
                return Err("an empty event queue was kept".into());
            }
        }
        Ok(())
    }

    /// The driver-call counter agrees: every page handle created and not
    /// released is mapped in a segment, or an orphan.
    fn check_call_counter(&self) -> Result<(), String> {
        let c = self.calls.counter();
        let (pages, page_bytes) = self.expandable_segments.values().fold((0, 0), |(n, b), e| {
            (n + e.mapped_pages(), b + e.mapped_pages() * e.segment_size)
        });
        let orphan_bytes: u64 = self.calls.orphans.iter().map(|o| o.1).sum();
        let orphans = self.calls.orphans.len() as u64;
        if c.handles_alive != pages + orphans || c.device_bytes_alive != page_bytes + orphan_bytes {
            return Err(format!(
                "the driver-call counter has {} handles ({} bytes) alive, the segments map {pages} \
                 pages ({page_bytes} bytes) and {orphans} release(s) failed ({orphan_bytes} bytes)",
                c.handles_alive, c.device_bytes_alive
            ));
        }
        Ok(())
    }

    /// The device (where it can be introspected) holds at least what the
    /// allocator thinks it mapped, and its own checks pass.
    fn check_device<D: Device>(&self, dev: &D) -> Result<(), String> {
        let Some(i) = dev.introspect() else {
            return Ok(());
        };
        for (_, b) in self.slab.iter() {
            if b.mapped && !i.is_accessible(b.ptr, b.size) {
                return Err(format!(
                    "block {:#x} (+{:#x}) is not accessible on the device",
                    b.ptr, b.size
                ));
            }
        }
        let live = i.live();
        let pages: u64 = self
            .expandable_segments
            .values()
            .map(|e| e.mapped_pages())
            .sum();
        if live.plain_allocs < self.segments.len()
            || live.reservations < self.expandable_segments.len()
            || (live.handles as u64) < pages
            || (live.mappings as u64) < pages
            || live.physical_bytes < self.total_allocated_memory
        {
            return Err(format!(
                "device holds {live:?}, allocator {} segments, {} expandable segments, {pages} pages, {} bytes",
                self.segments.len(),
                self.expandable_segments.len(),
                self.total_allocated_memory
            ));
        }
        i.check()?;
        Ok(())
    }

    /// Gives everything back to the device (errors are logged): events, plain
    /// segments (`cudaFree` synchronizes), then, after a device synchronize,
    /// every page and reservation of the expandable segments.
    pub fn teardown<D: Device>(&mut self, dev: &D, policy: &str) {
        let mut events: Vec<_> = std::mem::take(&mut self.event_pool);
        for q in std::mem::take(&mut self.cuda_events).into_values() {
            events.extend(q.into_iter().map(|(ev, _)| ev));
        }
        for ev in events {
            if let Err(e) = self.calls.observers.destroy_event(dev, ev) {
                eprintln!("vmmalloc: {policy}: destroying an event on drop failed: {e}");
            }
        }
        for (ptr, seg) in std::mem::take(&mut self.segments) {
            if let Err(e) = self.calls.free(dev, ptr, seg.size) {
                eprintln!("vmmalloc: {policy}: freeing segment {ptr:#x} on drop failed: {e}");
            }
        }
        if !self.expandable_segments.is_empty() {
            if let Err(e) = self.calls.observers.sync_device(dev) {
                eprintln!("vmmalloc: {policy}: device synchronize on drop failed: {e}");
            }
        }
        for (_, mut es) in std::mem::take(&mut self.expandable_segments) {
            es.destroy(dev, &mut self.calls);
        }
        for (h, bytes) in std::mem::take(&mut self.calls.orphans) {
            self.calls.release(dev, h, bytes);
        }
        if !self.calls.orphans.is_empty() {
            eprintln!(
                "vmmalloc: {policy}: {} orphaned handle(s) could not be released on drop",
                self.calls.orphans.len()
            );
        }
    }
}
