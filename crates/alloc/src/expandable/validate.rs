//! `validate()`: every invariant, recounted from scratch, one function per
//! group (in the order [`Inner::validate`] checks them):
//!
//! - **chunks** ([`Inner::validate_chunks`]): every chunk table is sound
//!   (page bitmap and chunks agree; chunks do not overlap or leave their
//!   segment) and covers its segment; a retired slot maps nothing; no
//!   handle twice;
//! - **blocks** ([`Inner::validate_blocks`]): each segment is listed by its
//!   stream's pool; blocks tile each segment, links agree, free neighbours
//!   are merged, segment counters equal a recount; allocated blocks are
//!   exactly the live map;
//! - **mapping** ([`Inner::validate_active_mapped`]): every active byte is on
//!   a mapped page with access (not unready), and accessible on a model
//!   device (blocks of paused tags excepted);
//! - **free index** ([`Inner::validate_free_index`]): free blocks (but the
//!   tails) are exactly the free indexes; every pool lists only its own
//!   segments;
//! - **streams and events** ([`Inner::validate_events`]): a pending event
//!   names a pending-free block;
//! - **unready** ([`Inner::validate_unready`]): every unready chunk is mapped;
//! - **growable regions** (`physical/regions.rs`), **spill** (`spill.rs`),
//!   **IPC** (`ipc.rs`): checked where they live;
//! - **pool** ([`Inner::validate_pool`]): its counts equal a recount; no
//!   handle is pooled twice, pooled and mapped, or also waiting for release;
//! - **stats** ([`Inner::validate_stats`]): equal a recount; no device-wide
//!   synchronize but those before unpinning;
//! - **observers** ([`super::physical::Physical::check_observed`]): the call
//!   counter's handles and device bytes alive, and the budget's charge,
//!   equal the tables and the pool;
//! - arenas' slices match the segments;
//! - **model** ([`Inner::validate_model`]): on a model device, its own
//!   invariants hold and its live reservations, handles and mappings equal
//!   ours (the allocator must be the device's only virtual-memory user).

use super::blocks::{BlockState, NIL};
use super::physical::RegionRecount;
use super::segment::Segment;
use super::Inner;
use crate::stats::StatArray;
use std::collections::HashSet;
use vmmalloc_device::{Call, Device, Introspect};

/// Recounted values per pool: `[small, large]`.
#[derive(Default)]
struct Recount {
    allocation: [i64; 2],
    allocated_bytes: [i64; 2],
    requested_bytes: [i64; 2],
    active: [i64; 2],
    active_bytes: [i64; 2],
    reserved_bytes: [i64; 2],
    segment: [i64; 2],
    inactive_split: [i64; 2],
    inactive_split_bytes: [i64; 2],
}

/// What the chunk tables (and growable regions) hold, recounted.
#[derive(Default)]
struct Mapped {
    /// Mapped pages.
    pages: u64,
    /// Mapped chunks (handles).
    chunks: u64,
    /// Bases of the live segments (for the arenas' check).
    bases: Vec<u64>,
}

fn check_stat(name: &str, arr: &StatArray, want: [i64; 2]) -> Result<(), String> {
    let got = [arr.0[1].current, arr.0[2].current];
    if got != want || arr.0[0].current != want[0] + want[1] {
        return Err(format!(
            "stat {name}: (all, small, large) = ({}, {}, {}) but a recount gives ({}, {}, {})",
            arr.0[0].current,
            got[0],
            got[1],
            want[0] + want[1],
            want[0],
            want[1]
        ));
    }
    Ok(())
}

impl Inner {
    /// Checks every invariant, group by group (module docs); describes the
    /// first broken one.
    pub(super) fn validate<D: Device + ?Sized>(&self, dev: &D) -> Result<(), String> {
        let page = self.layout.page;
        let model = dev.introspect();
        let mut rc = Recount::default();
        let mut handles: HashSet<u64> = HashSet::new();
        let mut mapped = self.validate_chunks(&mut handles, &mut rc)?;
        let free_seen = self.validate_blocks(&mut rc)?;
        self.validate_active_mapped(model)?;
        self.validate_free_index(&free_seen)?;
        self.validate_events()?;
        self.validate_pools()?;
        self.validate_unready()?;
        let g = self.phys.validate_regions(dev, &mut handles)?;
        mapped.pages += g.pages;
        mapped.chunks += g.chunks;
        let large = super::blocks::PoolKind::Large as usize;
        let gbytes = (g.pages * page) as i64;
        rc.allocation[large] += g.regions as i64;
        rc.active[large] += g.regions as i64;
        rc.allocated_bytes[large] += gbytes;
        rc.active_bytes[large] += gbytes;
        rc.reserved_bytes[large] += gbytes;
        rc.requested_bytes[large] += g.requested as i64;
        self.validate_spill()?;
        self.validate_ipc()?;
        self.validate_pool(&mut handles)?;
        self.validate_stats(&rc, &mapped)?;
        self.phys.check_observed(mapped.chunks)?;
        self.phys.check_follow()?;
        self.phys.arenas().check(&mapped.bases, self.layout.slice)?;
        self.validate_model(model, &g, &mapped)
    }

    /// Chunks: every chunk table is sound ([`super::physical::ChunkTable::validate`]),
    /// a retired segment's is empty, and no handle is mapped twice
    /// (`handles` collects them). Recounts the reserved bytes and segments.
    fn validate_chunks(
        &self,
        handles: &mut HashSet<u64>,
        rc: &mut Recount,
    ) -> Result<Mapped, String> {
        let page = self.layout.page;
        let mut mapped = Mapped::default();
        for (si, t) in self.phys.tables().iter().enumerate() {
            let Some(Some(s)) = self.segments.get(si) else {
                if !t.is_empty() {
                    return Err(format!("retired segment {si} still maps chunks"));
                }
                continue;
            };
            if t.base() != s.base || t.len() != s.len.div_ceil(page) {
                return Err(format!(
                    "segment {si}: chunk table of {} pages at {:#x}, segment of {} bytes at {:#x}",
                    t.len(),
                    t.base(),
                    s.len,
                    s.base
                ));
            }
            t.validate().map_err(|e| format!("segment {si}: {e}"))?;
            for (_, c) in t.chunks() {
                if !handles.insert(c.handle.0) {
                    return Err(format!("handle {:#x} is mapped twice", c.handle.0));
                }
            }
            let k = s.kind as usize;
            mapped.chunks += t.chunk_count();
            mapped.pages += t.mapped_pages();
            rc.reserved_bytes[k] += (t.mapped_pages() * page) as i64;
        }
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            if si >= self.phys.tables().len() {
                return Err(format!("segment {si} has no chunk table"));
            }
            mapped.bases.push(s.base);
            rc.segment[s.kind as usize] += 1;
        }
        Ok(mapped)
    }

    /// Blocks: every segment is listed by its owner's pool; its blocks tile
    /// it with consistent links, free neighbours are merged, the tail is
    /// the last block and free, free blocks carry no allocation state,
    /// allocated ones are in the live map with sane sizes, pending ones
    /// count their events; segment counters, the slab and the live map
    /// equal a recount. Recounts the block stats; returns, per stream entry
    /// and pool, the free blocks that are not tails (for the free index).
    fn validate_blocks(&self, rc: &mut Recount) -> Result<Vec<[usize; 2]>, String> {
        let mut blocks_seen = 0usize;
        let mut allocated_seen = 0usize;
        let mut free_seen = vec![[0usize; 2]; self.streams.len()];
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let si = si as u32;
            let k = s.kind as usize;
            let owner = self
                .streams
                .get(s.owner as usize)
                .ok_or_else(|| format!("segment {si}: unknown owner {}", s.owner))?;
            if !owner.pools[k].segments.contains(&si) {
                return Err(format!("segment {si} is not listed in its stream pool"));
            }
            let (mut active_blocks, mut active_bytes, mut free_blocks) = (0u32, 0u64, 0u32);
            let mut cursor = s.base;
            let mut prev = NIL;
            let mut prev_free = false;
            let mut i = s.first;
            while i != NIL {
                let b = &self.slab[i];
                blocks_seen += 1;
                if blocks_seen > self.slab.len() {
                    return Err("block links form a cycle".into());
                }
                if b.seg != si
                    || b.prev != prev
                    || b.addr != cursor
                    || b.size == 0
                    || !b.size.is_multiple_of(512)
                {
                    return Err(format!(
                        "segment {si}: block {i} at {:#x}+{:#x} (seg {}, prev {}) breaks the tiling at {cursor:#x}",
                        b.addr, b.size, b.seg, b.prev
                    ));
                }
                match b.state {
                    BlockState::Free => {
                        free_blocks += 1;
                        if self.check_free_block(si, s, i, prev_free)? {
                            free_seen[s.owner as usize][k] += 1;
                        }
                    }
                    BlockState::Allocated | BlockState::PendingFree => {
                        active_blocks += 1;
                        active_bytes += b.size;
                        if self.check_active_block(k, i, rc)? {
                            allocated_seen += 1;
                        }
                    }
                }
                prev_free = b.state == BlockState::Free;
                cursor = b.end();
                prev = i;
                i = b.next;
            }
            let last_free = prev != NIL && self.slab[prev].state == BlockState::Free;
            if !last_free && s.tail != NIL {
                return Err(format!(
                    "segment {si}: tail {} but the last block is not free",
                    s.tail
                ));
            }
            if cursor != s.base + s.len {
                return Err(format!(
                    "segment {si}: blocks end at {cursor:#x}, segment at {:#x}",
                    s.base + s.len
                ));
            }
            if (active_blocks, active_bytes, free_blocks)
                != (s.active_blocks, s.active_bytes, s.free_blocks)
            {
                return Err(format!(
                    "segment {si}: counters (active {}, {} B, free {}) but recount ({active_blocks}, {active_bytes} B, {free_blocks})",
                    s.active_blocks, s.active_bytes, s.free_blocks
                ));
            }
            let (sb, sn) = self.inactive_split(si);
            rc.inactive_split_bytes[k] += sb;
            rc.inactive_split[k] += sn;
        }
        if blocks_seen != self.slab.len() {
            return Err(format!(
                "{} blocks stored but {blocks_seen} reachable",
                self.slab.len()
            ));
        }
        if allocated_seen != self.live.len() {
            return Err(format!(
                "live map has {} entries, {allocated_seen} allocated blocks",
                self.live.len()
            ));
        }
        Ok(free_seen)
    }

    /// One free block `i` of segment `si` (for [`Inner::validate_blocks`]):
    /// merged with a free neighbour before it (unless its pool does not
    /// split), the segment's tail exactly when it is the last block, in
    /// its pool's free index exactly when it is not the tail, and carrying
    /// no allocation state. Returns whether it is a free block that is not
    /// the tail (those the free index must hold).
    fn check_free_block(
        &self,
        si: u32,
        s: &Segment,
        i: u32,
        prev_free: bool,
    ) -> Result<bool, String> {
        let b = &self.slab[i];
        let k = s.kind as usize;
        if prev_free && !self.owner_no_split(s.owner) {
            return Err(format!(
                "free block {:#x} was not merged with its free neighbour",
                b.addr
            ));
        }
        let indexed = self.streams[s.owner as usize].pools[k]
            .free
            .contains(b.size, b.addr, i);
        let last = b.next == NIL;
        if last != (s.tail == i) {
            return Err(format!(
                "segment {si}: tail is {} but the last free block is {i}",
                s.tail
            ));
        }
        if indexed == last {
            return Err(format!(
                "free block {:#x} (last: {last}) is {} the free index",
                b.addr,
                if indexed { "in" } else { "missing from" }
            ));
        }
        if b.pending_events != 0 || b.streams.is_some() || b.requested != 0 {
            return Err(format!("free block {:#x} carries allocation state", b.addr));
        }
        Ok(!last)
    }

    /// One active block `i` of a segment of kind `k` (for
    /// [`Inner::validate_blocks`]), counted into `rc`: an allocated block is
    /// in the live map with sane sizes and no events; a pending-free block
    /// counts exactly its pending events (or waits, deferred, for a
    /// capture's end). Returns whether it is allocated.
    fn check_active_block(&self, k: usize, i: u32, rc: &mut Recount) -> Result<bool, String> {
        let b = &self.slab[i];
        rc.active[k] += 1;
        rc.active_bytes[k] += b.size as i64;
        if b.state != BlockState::Allocated {
            // A block freed during a capture waits with no event
            // (`private_pools/`, deferred).
            let n = self.events.pending.iter().filter(|p| p.block == i).count();
            let deferred = b.pending_events == 0 && self.pools.deferred.contains(&i);
            if (b.pending_events == 0 && !deferred) || n != b.pending_events as usize {
                return Err(format!(
                    "pending block {:#x}: {} events counted, {n} pending",
                    b.addr, b.pending_events
                ));
            }
            return Ok(false);
        }
        if self.live.get(&b.addr) != Some(&i) {
            return Err(format!(
                "allocated block {:#x} is missing from the live map",
                b.addr
            ));
        }
        if b.requested == 0 || b.requested > b.size || b.pending_events != 0 {
            return Err(format!(
                "allocated block {:#x} has bad sizes or events",
                b.addr
            ));
        }
        rc.allocation[k] += 1;
        rc.allocated_bytes[k] += b.size as i64;
        rc.requested_bytes[k] += b.requested as i64;
        Ok(true)
    }

    /// Mapping: every active block (allocated or pending free) lies on
    /// mapped pages, none of them unready, and is accessible on a model
    /// device — except the blocks of paused tags, which have no memory
    /// (`sleep.rs`). Runs after [`Inner::validate_blocks`]: the links are
    /// sound and every segment's owner exists.
    fn validate_active_mapped(&self, model: Option<&dyn Introspect>) -> Result<(), String> {
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let si = si as u32;
            if self.owner_paused(s.owner) {
                continue;
            }
            for b in self.blocks_in(s) {
                if b.state == BlockState::Free {
                    continue;
                }
                let (p0, p1) = s.page_span(&self.layout, b.addr, b.size);
                if !self.table(si).all_mapped(p0, p1) {
                    return Err(format!(
                        "active block {:#x}+{:#x} is not fully mapped",
                        b.addr, b.size
                    ));
                }
                if self.phys.has_unready()
                    && self
                        .table(si)
                        .chunks_overlapping(p0, p1 + 1)
                        .iter()
                        .any(|&(f, _)| self.phys.is_unready(si, f))
                {
                    return Err(format!(
                        "active block {:#x} lies on a page without access",
                        b.addr
                    ));
                }
                if let Some(m) = model {
                    if !m.is_accessible(b.addr, b.size) {
                        return Err(format!(
                            "active block {:#x}+{:#x} is not accessible on the device",
                            b.addr, b.size
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Free index: each (stream, pool)'s index holds exactly its free blocks
    /// that are not tails (`free_seen`, counted by
    /// [`Inner::validate_blocks`], which checked each one is indexed), and
    /// each pool lists only segments of its own stream and kind.
    fn validate_free_index(&self, free_seen: &[[usize; 2]]) -> Result<(), String> {
        for (e, seen) in self.streams.iter().zip(free_seen) {
            for (k, (pool, &seen)) in e.pools.iter().zip(seen.iter()).enumerate() {
                if pool.free.len() != seen {
                    return Err(format!(
                        "{}: free index has {} entries, {seen} free blocks",
                        e.stream,
                        pool.free.len(),
                    ));
                }
                for &si in &pool.segments {
                    match self.segments.get(si as usize) {
                        Some(Some(s))
                            if s.kind as usize == k
                                && self.streams[s.owner as usize].stream == e.stream => {}
                        _ => {
                            return Err(format!("{}: lists segment {si} it does not own", e.stream))
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Streams and events: every pending event names a pending-free block
    /// (the count per block is checked with the blocks).
    fn validate_events(&self) -> Result<(), String> {
        for p in &self.events.pending {
            if self.slab[p.block].state != BlockState::PendingFree {
                return Err(format!(
                    "pending event {:?} names a block that is not pending",
                    p.event
                ));
            }
        }
        Ok(())
    }

    /// Unready: every chunk listed unready is mapped.
    fn validate_unready(&self) -> Result<(), String> {
        for &(s, p) in self.phys.unready() {
            match self.segments.get(s as usize) {
                Some(Some(_)) if self.table(s).has_chunk_at(p) => {}
                _ => {
                    return Err(format!(
                        "unready chunk at page {p} of segment {s} is not mapped"
                    ))
                }
            }
        }
        Ok(())
    }

    /// Pool: no host handle waiting for release is also mapped; the pool's
    /// counts equal a recount; no pooled handle is mapped or pooled twice
    /// (`handles` holds the mapped ones).
    fn validate_pool(&self, handles: &mut HashSet<u64>) -> Result<(), String> {
        for h in self.phys.host_free() {
            if !handles.insert(h.0) {
                return Err(format!("host handle {:#x} to release is also mapped", h.0));
            }
        }
        self.phys.pool().check()?;
        for (h, _) in self.phys.pool().iter() {
            if !handles.insert(h.0) {
                return Err(format!(
                    "pooled handle {:#x} is also mapped or pooled twice",
                    h.0
                ));
            }
        }
        Ok(())
    }

    /// Stats: pages and handles mapped and pooled, and the nine stat
    /// families, equal the recounts `rc` and `mapped`; no device-wide
    /// synchronize was counted but those before unpinning.
    fn validate_stats(&self, rc: &Recount, mapped: &Mapped) -> Result<(), String> {
        let st = &self.stats();
        let (mapped_total, chunks_total) = (mapped.pages, mapped.chunks);
        if (
            st.pages_mapped,
            st.pages_pooled,
            st.handles_mapped,
            st.handles_pooled,
        ) != (
            mapped_total,
            self.phys.pool().pages(),
            chunks_total,
            self.phys.pool().count(),
        ) {
            return Err(format!(
                "stats say {} pages in {} handles mapped / {} in {} pooled, recount {mapped_total} in {chunks_total} / {} in {}",
                st.pages_mapped,
                st.handles_mapped,
                st.pages_pooled,
                st.handles_pooled,
                self.phys.pool().pages(),
                self.phys.pool().count()
            ));
        }
        check_stat("allocation", &st.allocation, rc.allocation)?;
        check_stat("allocated_bytes", &st.allocated_bytes, rc.allocated_bytes)?;
        check_stat("requested_bytes", &st.requested_bytes, rc.requested_bytes)?;
        check_stat("active", &st.active, rc.active)?;
        check_stat("active_bytes", &st.active_bytes, rc.active_bytes)?;
        check_stat("reserved_bytes", &st.reserved_bytes, rc.reserved_bytes)?;
        check_stat("segment", &st.segment, rc.segment)?;
        check_stat("inactive_split", &st.inactive_split, rc.inactive_split)?;
        check_stat(
            "inactive_split_bytes",
            &st.inactive_split_bytes,
            rc.inactive_split_bytes,
        )?;
        // Device-wide synchronizes: before unpinning, (counted as
        // PyTorch's `num_sync_all_streams`) before a graph pool's pages go
        // back or are paused (`private_pools.rs`), and before an IPC export
        // re-backs chunks (`ipc.rs`), and before a registered run is joined
        // or split (`physical/follow.rs`).
        let follow = self.phys.follow_syncs();
        if st.driver_calls.get(Call::DeviceSync)
            != st.unpin_device_syncs + st.num_sync_all_streams + st.ipc_rebacks + follow
        {
            return Err(format!(
                "{} device-wide synchronizes, {} of them before unpinning, {} for graph pools, \
                 {} before IPC re-backing and {} before registered runs changed",
                st.driver_calls.get(Call::DeviceSync),
                st.unpin_device_syncs,
                st.num_sync_all_streams,
                st.ipc_rebacks,
                follow
            ));
        }
        Ok(())
    }

    /// Model: on a model device, its own invariants hold and its live
    /// reservations, handles and mappings equal ours (arenas and regions;
    /// mapped, pooled and to-be-released handles; mapped chunks).
    fn validate_model(
        &self,
        model: Option<&dyn Introspect>,
        g: &RegionRecount,
        mapped: &Mapped,
    ) -> Result<(), String> {
        let Some(m) = model else {
            return Ok(());
        };
        m.check().map_err(|e| format!("device model: {e}"))?;
        let live = m.live();
        let chunks_total = mapped.chunks;
        let ours = (
            self.phys.arenas().list.len() + g.regions as usize,
            (chunks_total + self.phys.pool().count()) as usize + self.phys.host_free().len(),
            chunks_total as usize,
        );
        if (live.reservations, live.handles, live.mappings) != ours {
            return Err(format!(
                "device holds {} reservations, {} handles, {} mappings; the allocator accounts for {}, {}, {}",
                live.reservations, live.handles, live.mappings, ours.0, ours.1, ours.2
            ));
        }
        Ok(())
    }
}
