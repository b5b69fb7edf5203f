//! The physical layer: the one owner of device memory in the expandable
//! allocator — every handle the allocator holds and where it is, and every
//! driver call that makes, maps, unmaps or releases memory
//! (DESIGN.md, "Owners and observers"; issue 33).
//!
//! # What it holds
//!
//! - the chunk **tables**: each segment's (which handle is mapped at which
//!   page, `chunks.rs`), and each growable region's stack of chunks
//!   (`regions.rs`): a region is one more kind of table;
//! - the address-space **arenas** segments are carved from (`arena.rs`);
//! - the chunk **pool** (`pool.rs`), the **budget** it charges before every
//!   create and credits on every release (`budget.rs`: the memory fraction
//!   today, a budget shared between processes next), chunks left unready,
//!   spill's host-located handles (`spilled.rs`) and the chunks IPC export
//!   pins (`exports.rs`);
//! - the [`Layout`] (`layout.rs`) pages and chunks are measured in.
//!
//! It imports nothing from the block layer (the rest of `expandable`).
//!
//! # What it does
//!
//! Only this module and its files call the driver for memory
//! (`calls.rs`: reserve, address free, create, map, set access, unmap,
//! release; one function per kind). Each call is one event
//! (`observe.rs`: owner, address, bytes, handles) to the observers: the
//! built-in counter is the allocator's only count of driver calls, and the
//! mapping log (`mappings.rs`), which the C ABI's history ring drains for
//! PyTorch's `segment_map` / `segment_unmap` trace entries, attaches when
//! asked; an NCCL registrar would attach the same way. Unpinning's and spill's moves of one chunk (`moves.rs`), IPC's
//! re-backing of a run of chunks with equal handles (`reback.rs`), the
//! regions' growth and shrink (`regions.rs`) and teardown (`drain.rs`, the
//! layer's drain) are its operations.
//!
//! The block layer (the rest of `expandable`) decides what to map and keeps
//! its own counters ([`super::Inner::with_seg_pages`]). On a cache miss it
//! asks one question per attempt, [`Physical::back`] (`back.rs`): "back
//! these page runs; tell me what is short". The layer plans, takes pooled
//! chunks, releases spare ones, creates within the budget, maps, gives
//! access and rolls back on failure; the block layer only makes room
//! (reclaim, unpinning), decides to spill, and asks again. Otherwise it asks
//! [`Physical`] questions instead of reading its fields: which pages of a
//! segment are mapped ([`Physical::table`]), how much room the budget has
//! ([`Physical::room`], [`Physical::over_limit`]), where an unmapped handle
//! goes ([`Physical::give_back`]), whether a chunk may move
//! ([`Physical::may_move`]: not host memory, not unready, not exported),
//! whether its handle may be exported ([`Physical::exportable`]). For its
//! streams, events and copies it gets a narrow view (`calls.rs`,
//! [`Physical::sync_stream`] and the rest) that touches no handle.
//!
//! Invariants (checked by `validate`, see `validate.rs` and
//! [`Physical::check_observed`]): every chunk table is sound
//! ([`ChunkTable::validate`]) and a retired segment's is empty; no handle is
//! mapped twice; `mapped_pages` and `mapped_handles` equal a recount of the
//! tables (segments and regions); the pool's counts equal a recount; no host
//! handle is pooled; every unready chunk is mapped; the counter's handles
//! and device bytes alive equal the tables' and the pool's, and so does the
//! budget's charge.

mod arena;
mod back;
pub(crate) mod budget;
mod calls;
mod chunks;
mod drain;
mod exports;
pub(crate) mod follow;
mod layout;
pub(crate) mod mappings;
mod moves;
pub(crate) mod observe;
mod pool;
mod reback;
mod regions;
mod spilled;
#[cfg(test)]
mod tests;

pub(crate) use arena::Arenas;
pub(crate) use back::{Ask, Backed, Pages, Planned, Shortfall, Target};
pub(crate) use chunks::{Chunk, ChunkTable};
use exports::ExportState;
pub(crate) use layout::Layout;
pub(crate) use moves::Move;
pub(crate) use pool::{ChunkPool, PoolView};
pub(crate) use reback::{equal_handle_pages, padded_handle_pages};
pub(crate) use regions::{Region, RegionRecount};
use spilled::SpillState;

use crate::ipc::ExportedChunk;
use crate::Stats;
use budget::{Budget, LocalBudget};
use observe::{Observer, Observers, Owner};
use std::collections::BTreeMap;
use vmmalloc_device::{Device, DeviceError, PhysHandle, Stream};

/// Physical state of one allocator (see the module docs).
#[derive(Debug)]
pub(crate) struct Physical {
    /// Bytes of one page.
    page: u64,
    /// Pages of the largest chunk a plan makes (`max_chunk`).
    max_chunk_pages: u64,
    /// How much device memory may be held: charged before every create,
    /// credited on every release (`budget.rs`).
    budget: Box<dyn Budget>,
    /// Who sees the driver calls (`observe.rs`); the counter first.
    observers: Observers,
    /// Pooled bytes kept before releasing handles.
    release_threshold: u64,
    /// Unmapped chunks whose handle is kept (the chunk pool).
    pool: ChunkPool,
    /// Chunks that are mapped but not yet accessible, `(segment, first
    /// page)`: only after a `set_access` failed and the rollback unmap failed too.
    unready: Vec<(u32, u64)>,
    /// Host-located chunks (`spill:true`, `spilled.rs`).
    spill: SpillState,
    /// Blocks exported to other processes and the chunks they pin
    /// (`exports.rs`).
    exported: ExportState,
    /// The chunk table of each segment slot (empty for a retired slot).
    tables: Vec<ChunkTable>,
    /// Growable regions by base address (`regions.rs`).
    regions: BTreeMap<u64, Region>,
    /// Address-space reservations segments are carved from (`arena.rs`).
    arenas: Arenas,
    /// Pages mapped in all tables (segments and regions, host chunks too).
    mapped_pages: u64,
    /// Chunks (handles) mapped in all tables.
    mapped_handles: u64,
    /// The segment follower's state (`follow.rs`), once something followed
    /// the segments (its observer is attached then).
    follow: Option<std::sync::Arc<parking_lot::Mutex<follow::FollowState>>>,
    /// The streams the allocator serves (`note_stream`).
    served_streams: Vec<Stream>,
}

impl Physical {
    /// The physical layer of a new allocator: empty pool, the local budget
    /// of `fraction` of the device, only the counter observing.
    pub fn new(layout: &Layout, fraction: f64, release_threshold: u64, spill: bool) -> Physical {
        Physical {
            page: layout.page,
            max_chunk_pages: layout.max_chunk_pages,
            budget: Box::new(LocalBudget::new(fraction, layout.limit_pages(fraction))),
            observers: Observers::default(),
            release_threshold,
            pool: ChunkPool::default(),
            unready: Vec::new(),
            spill: SpillState {
                enabled: spill,
                ..Default::default()
            },
            exported: ExportState::default(),
            tables: Vec::new(),
            regions: BTreeMap::new(),
            arenas: Arenas::default(),
            mapped_pages: 0,
            mapped_handles: 0,
            follow: None,
            served_streams: Vec::new(),
        }
    }

    /// Starts following the segments for `sink` (`follow.rs`): attaches the
    /// follower on first use, takes the runs mapped now as known (the
    /// snapshot reports them) with each table's tag from `tag_of` (regions:
    /// their stream, the default pool).
    pub fn start_follow(
        &mut self,
        sink: std::sync::Arc<dyn crate::SegmentSink>,
        tag_of: impl Fn(u32) -> follow::Tag,
    ) {
        let state = match &self.follow {
            Some(s) => std::sync::Arc::clone(s),
            None => {
                let s =
                    std::sync::Arc::new(parking_lot::Mutex::new(follow::FollowState::default()));
                self.attach(Box::new(follow::Follower(std::sync::Arc::clone(&s))));
                self.follow = Some(std::sync::Arc::clone(&s));
                s
            }
        };
        let mut tags = std::collections::HashMap::new();
        for i in 0..self.tables.len() as u32 {
            tags.insert(Owner::Segment(i), tag_of(i));
        }
        for g in self.regions.values() {
            tags.insert(Owner::Region(g.base), follow::Tag::region(g.stream));
        }
        state.lock().start(sink, self.accessible_runs(), tags);
    }

    /// Whether making `[addr, addr + bytes)` of `owner` accessible joins
    /// registered runs (`follow.rs`).
    #[inline]
    pub(super) fn follow_joins(&self, owner: Owner, addr: u64, bytes: u64) -> bool {
        self.follow
            .as_ref()
            .is_some_and(|s| s.lock().joins(owner, addr, addr + bytes))
    }

    /// Whether unmapping `[addr, addr + bytes)` of `owner` leaves part of a
    /// registered run mapped (`follow.rs`).
    #[inline]
    pub(super) fn follow_splits(&self, owner: Owner, addr: u64, bytes: u64) -> bool {
        self.follow
            .as_ref()
            .is_some_and(|s| s.lock().splits(owner, addr, addr + bytes))
    }

    /// Counts a device synchronize made (`synced`) or left out during a
    /// graph capture before a join or a split.
    pub(super) fn note_follow_sync(&mut self, synced: bool) {
        if let Some(s) = &self.follow {
            let mut s = s.lock();
            if synced {
                s.syncs += 1;
            } else {
                s.unsynced += 1;
            }
        }
    }

    /// Notes a stream the allocator serves (asked whether it captures before
    /// a device synchronize, `calls.rs`).
    pub fn note_stream(&mut self, s: Stream) {
        if !self.served_streams.contains(&s) {
            self.served_streams.push(s);
        }
    }

    /// Device synchronizes made before joins and splits of registered runs.
    pub fn follow_syncs(&self) -> u64 {
        self.follow.as_ref().map_or(0, |s| s.lock().syncs)
    }

    /// Stops following the segments.
    pub fn stop_follow(&mut self) {
        if let Some(s) = &self.follow {
            s.lock().stop();
        }
    }

    /// Notes the tag of table `owner`, opened while following.
    pub fn tag_table(&mut self, owner: Owner, tag: follow::Tag) {
        if let Some(s) = &self.follow {
            s.lock().tag(owner, tag);
        }
    }

    /// Forgets the tag of table `owner`, gone.
    pub fn untag_table(&mut self, owner: Owner) {
        if let Some(s) = &self.follow {
            s.lock().untag(owner);
        }
    }

    /// The runs known as registered (empty unless following).
    pub fn followed(&self) -> Vec<crate::SegmentChange> {
        self.follow
            .as_ref()
            .map_or_else(Vec::new, |s| s.lock().known())
    }

    /// Changes the follower sent: (added, removed).
    pub fn follow_counts(&self) -> (u64, u64) {
        self.follow.as_ref().map_or((0, 0), |s| s.lock().counts())
    }

    /// The mapped, accessible runs of every table, `(owner, first byte,
    /// bytes)`, by address: what the follower must know.
    fn accessible_runs(&self) -> Vec<(Owner, u64, u64)> {
        let mut runs = Vec::new();
        for (i, t) in self.tables.iter().enumerate() {
            t.for_each_mapped_run(0, t.len(), |f, n| {
                runs.push((
                    Owner::Segment(i as u32),
                    t.base() + f * self.page,
                    n * self.page,
                ));
            });
        }
        for g in self.regions.values() {
            if g.accessible > 0 {
                runs.push((Owner::Region(g.base), g.base, g.accessible * self.page));
            }
        }
        runs.sort_by_key(|r| r.1);
        runs
    }

    /// Checks the follower's runs against the tables' (`validate()`); not
    /// while a chunk is unready (mapped without access after a failed
    /// rollback).
    pub fn check_follow(&self) -> Result<(), String> {
        match &self.follow {
            Some(s) if self.unready.is_empty() => s.lock().check(&self.accessible_runs()),
            _ => Ok(()),
        }
    }

    /// Attaches `o`: it sees every driver call from now on, after the
    /// counter (`observe.rs`).
    pub fn attach(&mut self, o: Box<dyn Observer>) {
        self.observers.attached.push(o);
    }

    /// Replaces the budget (a shared one, issue 33 part 2): `b` must have
    /// charged what this layer holds now (see [`Physical::held_pages`]).
    pub fn set_budget(&mut self, b: Box<dyn Budget>) {
        self.budget = b;
    }

    /// Device pages held between operations: mapped (not host-located) and
    /// pooled — what the budget has charged then. (Inside an operation the
    /// budget has also charged the handles created and not yet mapped.)
    pub fn held_pages(&self) -> u64 {
        self.device_pages() + self.pool.pages()
    }

    /// Copies the layer's figures into `s` (a `stats()` read): the driver
    /// calls and device allocs/frees the counter saw, pages and handles
    /// mapped and pooled, spilled bytes.
    pub fn fill_stats(&self, s: &mut Stats) {
        let c = &self.observers.counter;
        s.driver_calls = c.calls;
        s.num_device_alloc = c.device_allocs;
        s.num_device_free = c.device_frees;
        s.pages_mapped = self.mapped_pages;
        s.handles_mapped = self.mapped_handles;
        s.pages_pooled = self.pool.pages();
        s.handles_pooled = self.pool.count();
        s.spilled_bytes = self.spill.spilled_pages * self.page;
        s.spilled_bytes_peak = self.spill.spilled_peak_bytes;
    }

    /// `validate()`: the observers' totals equal the tables. The counter's
    /// table maps less unmaps are the pages and chunks the tables map
    /// (`mapped_chunks`, the recount of segments and regions); its handles
    /// alive are those chunks, the pooled ones and the host handles waiting
    /// for release; its device bytes alive are the device pages mapped and
    /// pooled; the budget has charged exactly those pages.
    pub fn check_observed(&self, mapped_chunks: u64) -> Result<(), String> {
        let c = &self.observers.counter;
        let mapped = (self.mapped_pages * self.page, self.mapped_handles);
        if (c.table_bytes_mapped, c.table_handles_mapped) != mapped
            || self.mapped_handles != mapped_chunks
        {
            return Err(format!(
                "the call counter saw {} bytes in {} handles mapped in tables; the tables map {} bytes \
                 in {} handles (recount: {mapped_chunks} handles)",
                c.table_bytes_mapped, c.table_handles_mapped, mapped.0, mapped.1
            ));
        }
        let handles = mapped_chunks + self.pool.count() + self.spill.host_free.len() as u64;
        if c.handles_alive != handles {
            return Err(format!(
                "the call counter saw {} handles created and not released; the tables hold {handles} \
                 ({mapped_chunks} mapped, {} pooled, {} host handles to release)",
                c.handles_alive,
                self.pool.count(),
                self.spill.host_free.len()
            ));
        }
        let held = self.held_pages();
        if c.device_bytes_alive != held * self.page {
            return Err(format!(
                "the call counter saw {} device bytes created and not released; the tables hold {} \
                 ({} pages mapped on the device, {} pooled)",
                c.device_bytes_alive,
                held * self.page,
                self.device_pages(),
                self.pool.pages()
            ));
        }
        if self.budget.charged() != held {
            return Err(format!(
                "the budget has {} pages charged; the tables hold {held} device pages",
                self.budget.charged()
            ));
        }
        Ok(())
    }

    /// Bytes of one page.
    #[inline]
    pub fn page(&self) -> u64 {
        self.page
    }

    // --- Chunk tables ------------------------------------------------------

    /// The chunk table of segment `seg`.
    #[inline]
    pub fn table(&self, seg: u32) -> &ChunkTable {
        &self.tables[seg as usize]
    }

    /// The chunk tables of every segment slot, by slot (a retired slot's is
    /// empty).
    pub fn tables(&self) -> &[ChunkTable] {
        &self.tables
    }

    /// A new segment in slot `seg` at `base`, `pages` pages long, nothing
    /// mapped.
    pub fn open_table(&mut self, seg: u32, base: u64, pages: u64) {
        let i = seg as usize;
        if self.tables.len() <= i {
            self.tables.resize_with(i + 1, ChunkTable::default);
        }
        debug_assert!(self.tables[i].is_empty(), "slot {seg} still maps chunks");
        self.tables[i] = ChunkTable::new(base, pages);
    }

    /// Pins (or unpins) the pages of segment `seg`: while pinned, nothing
    /// may choose them to unmap or move ([`Physical::may_move`],
    /// [`ChunkTable::pinned`]): a private pool's pages while a CUDA graph may
    /// replay them (`private_pools.rs`).
    pub fn set_pinned(&mut self, seg: u32, pinned: bool) {
        self.tables[seg as usize].set_pinned(pinned);
    }

    /// Segment `seg` is retired (it maps nothing).
    pub fn close_table(&mut self, seg: u32) {
        debug_assert!(self.tables[seg as usize].is_empty());
        self.tables[seg as usize] = ChunkTable::default();
        self.untag_table(Owner::Segment(seg));
    }

    /// Address of page `p` of segment `seg`.
    #[inline]
    pub fn page_addr(&self, seg: u32, p: u64) -> u64 {
        self.tables[seg as usize].base() + p * self.page
    }

    /// `cuMemMap`s handle `h` of `pages` pages at page `first` of `seg` and
    /// records it (access is [`Physical::set_access`]'s). On failure
    /// nothing is recorded and the handle is still the caller's.
    pub fn map_chunk<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        h: PhysHandle,
        pages: u64,
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, first);
        self.raw_map(dev, Owner::Segment(seg), addr, pages * self.page, h)?;
        self.record_mapped(seg, first, Chunk { handle: h, pages });
        Ok(())
    }

    /// Records that `chunk` was mapped at page `first` of `seg` by the
    /// caller (unpinning maps its own): the table, the pages and handles
    /// mapped and the spill accounting.
    pub fn record_mapped(&mut self, seg: u32, first: u64, chunk: Chunk) {
        self.tables[seg as usize].add(first, chunk);
        self.note_mapping(chunk.handle, chunk.pages, true);
    }

    /// Records that the chunk at page `first` of `seg` is no longer mapped
    /// (the caller unmapped it, or its pages are lost); returns it. The
    /// handle is the caller's.
    pub fn record_unmapped(&mut self, seg: u32, first: u64) -> Option<Chunk> {
        let c = self.tables[seg as usize].remove(first)?;
        self.note_mapping(c.handle, c.pages, false);
        self.forget_unready(seg, &[first]);
        Some(c)
    }

    /// Records that the chunk at page `first` of `seg` is now backed by
    /// handle `h` (same pages; the caller remapped it); returns the old
    /// chunk, whose handle is the caller's.
    pub fn record_swap(&mut self, seg: u32, first: u64, h: PhysHandle) -> Option<Chunk> {
        let old = self.tables[seg as usize].replace(first, h)?;
        self.note_mapping(old.handle, old.pages, false);
        self.note_mapping(h, old.pages, true);
        Some(old)
    }

    /// `cuMemSetAccess` on pages `[first, first + pages)` of `seg`.
    pub fn set_access<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        pages: u64,
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, first);
        self.raw_set_access(dev, Owner::Segment(seg), addr, pages * self.page)
    }

    /// `cuMemUnmap`s pages `[first, first + count)` of `seg`, which are
    /// whole chunks, in one call; their handles go back
    /// ([`Physical::give_back`]). On failure nothing changes.
    pub fn unmap_run<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
    ) -> Result<(), DeviceError> {
        let firsts: Vec<u64> = self.tables[seg as usize]
            .chunks_within(first, first + count)
            .map(|(f, _)| f)
            .collect();
        let addr = self.page_addr(seg, first);
        let n = firsts.len() as u32;
        self.raw_unmap(dev, Owner::Segment(seg), addr, count * self.page, n)?;
        let mut pages = 0;
        for f in firsts {
            if let Some(c) = self.record_unmapped(seg, f) {
                pages += c.pages;
                self.give_back(c.handle, c.pages);
            }
        }
        debug_assert_eq!(pages, count, "unmapped runs are whole chunks");
        Ok(())
    }

    /// Unmaps the whole chunks in pages `[first, first + count)` of `seg`:
    /// in one call, or chunk by chunk when that fails, so that as much as
    /// possible goes back. Returns the first error; a chunk that could not
    /// be unmapped stays mapped (and, with `mark_unready`, is listed unready:
    /// maybe inaccessible).
    pub fn unmap_chunks<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
        mark_unready: bool,
    ) -> Result<(), DeviceError> {
        let Err(e) = self.unmap_run(dev, seg, first, count) else {
            return Ok(());
        };
        let chunks: Vec<(u64, u64)> = self.tables[seg as usize]
            .chunks_within(first, first + count)
            .map(|(f, c)| (f, c.pages))
            .collect();
        for (f, n) in chunks {
            if self.unmap_run(dev, seg, f, n).is_err() && mark_unready {
                self.mark_unready(seg, f);
            }
        }
        Err(e)
    }

    /// Gives access to the unready chunks overlapping pages `[p0, p1]` of `seg`.
    pub fn fix_unready<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        p0: u64,
        p1: u64,
    ) -> Result<(), DeviceError> {
        if !self.has_unready() {
            return Ok(());
        }
        for (f, c) in self.tables[seg as usize].chunks_overlapping(p0, p1 + 1) {
            if !self.is_unready(seg, f) {
                continue;
            }
            self.set_access(dev, seg, f, c.pages)?;
            self.mark_ready(seg, f);
        }
        Ok(())
    }

    // --- The budget ------------------------------------------------------

    /// The memory fraction in force.
    #[inline]
    pub fn fraction(&self) -> f64 {
        self.budget.fraction()
    }

    /// Most device pages that may be mapped + pooled.
    #[inline]
    pub fn limit_pages(&self) -> u64 {
        self.budget.limit_pages()
    }

    /// Whether the budget's limit may have grown since it was planned with
    /// (`Budget::recheck`: a shared budget reaps dead members).
    pub fn budget_recheck(&mut self) -> bool {
        self.budget.recheck()
    }

    /// What the budget adds to an out-of-memory report (`Budget::explain`).
    pub fn budget_explain(&self) -> Option<String> {
        self.budget.explain()
    }

    /// Sets the memory fraction and the limit it gives (pages already
    /// held above it are the caller's to release).
    pub fn set_fraction(&mut self, fraction: f64, limit_pages: u64) {
        self.budget.set_fraction(fraction, limit_pages);
    }

    /// Device pages mapped (segments and regions; host-located, spilled
    /// pages are not device memory).
    #[inline]
    pub fn device_pages(&self) -> u64 {
        self.mapped_pages - self.spill.spilled_pages
    }

    /// Pages the budget still has room for, with `mapped` device pages
    /// mapped (pooled pages count as held).
    #[inline]
    pub fn room(&self, mapped: u64) -> u64 {
        self.budget.room(mapped + self.pool.pages())
    }

    /// Whether `mapped` device pages, the pool and `extra` more pages exceed
    /// the budget.
    #[inline]
    pub fn over_limit(&self, mapped: u64, extra: u64) -> bool {
        !self.budget.fits(mapped + self.pool.pages() + extra)
    }

    // --- The pool ----------------------------------------------------------

    /// The chunk pool, to read (its sizes plan a request).
    #[inline]
    pub fn pool(&self) -> &ChunkPool {
        &self.pool
    }

    /// Takes a pooled chunk of exactly `pages` pages.
    #[inline]
    pub fn take_pooled(&mut self, pages: u64) -> Option<PhysHandle> {
        self.pool.take(pages)
    }

    /// Where an unmapped handle goes: host chunks to the host release list
    /// (released at the next trim), device chunks to the pool.
    pub fn give_back(&mut self, h: PhysHandle, pages: u64) {
        if self.spill.host.contains(&h.0) {
            self.spill.host_free.push(h);
        } else {
            self.pool.put(h, pages);
        }
    }

    /// A chunk that was mapped and is now unmapped: updates the spill
    /// accounting and gives the handle back ([`Physical::give_back`]).
    pub fn give_back_unmapped(&mut self, h: PhysHandle, pages: u64) {
        self.note_mapping(h, pages, false);
        self.give_back(h, pages);
    }

    /// Takes `h` of `pages` pages, mapped somewhere else than a table
    /// (unpinning's scratch) or not at all, out of the caller's hands:
    /// [`Physical::give_back`].
    #[inline]
    pub fn pool_put(&mut self, h: PhysHandle, pages: u64) {
        self.give_back(h, pages);
    }

    /// Releases the largest pooled chunk; returns its pages (0 when the pool
    /// is empty). A chunk whose release fails stays pooled.
    pub fn release_largest<D: Device + ?Sized>(&mut self, dev: &D) -> Result<u64, DeviceError> {
        let Some((h, pages)) = self.pool.take_largest() else {
            return Ok(0);
        };
        let r = self.raw_release(dev, h, pages);
        if r.is_err() {
            self.pool.put(h, pages);
        }
        r.map(|()| pages)
    }

    /// Releases every pooled chunk; failed ones stay pooled, the first error
    /// is returned.
    pub fn release_pool<D: Device + ?Sized>(&mut self, dev: &D) -> Result<(), DeviceError> {
        let mut first_err = None;
        for (h, pages) in self.pool.drain() {
            if let Err(e) = self.raw_release(dev, h, pages) {
                self.pool.put(h, pages);
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Releases the unmapped host chunks, then pooled chunks (largest first)
    /// while the pool holds more than the release threshold. Stops at the
    /// first failed release (the chunk stays pooled).
    pub fn trim<D: Device + ?Sized>(&mut self, dev: &D) {
        if !self.spill.host_free.is_empty() {
            self.release_host_free(dev);
        }
        while self.pool.pages().saturating_mul(self.page) > self.release_threshold {
            if self.release_largest(dev).is_err() {
                break;
            }
        }
    }

    // --- Handles for the block layer ---------------------------------------

    /// A new handle of `pages` pages of device memory (spill's migration;
    /// a plan's creates are [`Physical::back`]'s): charged to the budget first
    /// (refused as out of memory when it has no room), `cuMemCreate`d,
    /// credited back if the create fails. Not in a table until mapped.
    pub fn create<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        pages: u64,
    ) -> Result<PhysHandle, DeviceError> {
        self.raw_create(dev, pages, budget::Charge::Grow)
    }

    /// A new handle of `pages` pages located in host memory (spill): never
    /// charged, never pooled, released when unmapped.
    pub fn create_on_host<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        pages: u64,
    ) -> Result<PhysHandle, DeviceError> {
        self.raw_create_on_host(dev, pages)
    }

    // --- Unready chunks ------------------------------------------------------

    /// Whether any chunk is listed unready.
    #[inline]
    pub fn has_unready(&self) -> bool {
        !self.unready.is_empty()
    }

    /// The unready chunks, `(segment, first page)`.
    pub fn unready(&self) -> &[(u32, u64)] {
        &self.unready
    }

    /// Whether the chunk at page `first` of segment `seg` is unready.
    #[inline]
    pub fn is_unready(&self, seg: u32, first: u64) -> bool {
        self.unready.contains(&(seg, first))
    }

    /// Lists the chunk at page `first` of `seg` as unready (mapped, maybe
    /// inaccessible): a later access gives access first.
    pub fn mark_unready(&mut self, seg: u32, first: u64) {
        self.unready.push((seg, first));
    }

    /// The chunk at page `first` of `seg` was made accessible.
    pub fn mark_ready(&mut self, seg: u32, first: u64) {
        self.unready.retain(|&u| u != (seg, first));
    }

    /// The chunks at pages `firsts` of `seg` were unmapped: no longer unready.
    pub fn forget_unready(&mut self, seg: u32, firsts: &[u64]) {
        if !self.unready.is_empty() {
            self.unready
                .retain(|&(s, q)| !(s == seg && firsts.contains(&q)));
        }
    }

    /// Whether segment `seg` has an unready chunk.
    pub fn unready_in(&self, seg: u32) -> bool {
        self.unready.iter().any(|u| u.0 == seg)
    }

    // --- Spill -----------------------------------------------------------------

    /// `spill:true`.
    #[inline]
    pub fn spill_enabled(&self) -> bool {
        self.spill.enabled
    }

    /// Whether handle `h` is host-located (spill).
    #[inline]
    pub fn is_host(&self, h: PhysHandle) -> bool {
        self.spill.host.contains(&h.0)
    }

    /// Pages of mapped host chunks (not device memory).
    #[inline]
    pub fn spilled_pages(&self) -> u64 {
        self.spill.spilled_pages
    }

    /// Whether unmapped host handles wait for their release.
    pub fn has_host_free(&self) -> bool {
        !self.spill.host_free.is_empty()
    }

    /// Whether any host-located handle is alive.
    pub fn has_host(&self) -> bool {
        !self.spill.host.is_empty()
    }

    /// Host-located handles alive (mapped, or waiting for their release).
    pub fn host_count(&self) -> usize {
        self.spill.host.len()
    }

    /// Unmapped host handles waiting for their release.
    pub fn host_free(&self) -> &[PhysHandle] {
        &self.spill.host_free
    }

    /// Host handle `h` is no longer mapped: released at the next trim.
    pub fn drop_host(&mut self, h: PhysHandle) {
        self.spill.host_free.push(h);
    }

    /// Notes that chunk `h` of `pages` pages was mapped (or, with `mapped`
    /// false, unmapped) in a table: keeps the pages and handles mapped,
    /// `spilled_pages` and the spill peak.
    pub fn note_mapping(&mut self, h: PhysHandle, pages: u64, mapped: bool) {
        if mapped {
            self.mapped_pages += pages;
            self.mapped_handles += 1;
        } else {
            self.mapped_pages -= pages;
            self.mapped_handles -= 1;
        }
        if !self.spill.host.contains(&h.0) {
            return;
        }
        if mapped {
            self.spill.spilled_pages += pages;
        } else {
            self.spill.spilled_pages -= pages;
        }
        let bytes = self.spill.spilled_pages * self.page;
        self.spill.spilled_peak_bytes = self.spill.spilled_peak_bytes.max(bytes);
    }

    /// Releases the unmapped host chunks; a failed release stays listed.
    pub fn release_host_free<D: Device + ?Sized>(&mut self, dev: &D) {
        for h in std::mem::take(&mut self.spill.host_free) {
            if self.raw_release(dev, h, 0).is_ok() {
                self.spill.host.remove(&h.0);
            } else {
                self.spill.host_free.push(h);
            }
        }
    }

    // --- Moves and export --------------------------------------------------------

    /// May the chunk at page `first` of segment `seg`, handle `h`, move to
    /// other handles (unpinning)? Not host memory (spill), not a chunk whose
    /// access may be missing (unready), not a chunk shared with another
    /// process (IPC export), not a pinned segment's (a graph pool's).
    pub fn may_move(&self, seg: u32, first: u64, h: PhysHandle) -> bool {
        !(self.tables[seg as usize].pinned()
            || self.is_host(h)
            || self.is_unready(seg, first)
            || self.exported.pins(seg, first))
    }

    /// Why the chunk at page `first` of `seg`, handle `h`, cannot be
    /// exported to another process, if it cannot.
    pub fn exportable(&self, seg: u32, first: u64, h: PhysHandle) -> Result<(), &'static str> {
        if self.is_host(h) {
            return Err(
                "part of it lives in host memory (spill:true moved it there); \
                 host-located chunks cannot be shared",
            );
        }
        if self.is_unready(seg, first) {
            return Err("a chunk under it is not accessible");
        }
        Ok(())
    }

    /// The handles under pages `[first, last]` (`span`) of segment `seg`,
    /// which block `ptr` occupies, marked exported (a second export of the
    /// same block answers the same chunks and marks nothing twice). Refused,
    /// with the reason, when a page is unmapped or a chunk not
    /// [`Physical::exportable`].
    pub fn export_range(
        &mut self,
        seg: u32,
        span: (u64, u64),
        ptr: u64,
    ) -> Result<Vec<ExportedChunk>, String> {
        let t = &self.tables[seg as usize];
        let (mut chunks, mut keys) = (Vec::new(), Vec::new());
        let mut p = span.0;
        while p <= span.1 {
            let Some((f, c)) = t.chunk_at(p) else {
                return Err(format!("page {p} of its segment is not mapped"));
            };
            self.exportable(seg, f, c.handle)
                .map_err(|why| why.to_string())?;
            chunks.push(ExportedChunk {
                addr: t.base() + f * self.page,
                size: c.pages * self.page,
                handle: c.handle,
            });
            keys.push((seg, f));
            p = f + c.pages;
        }
        self.exported.mark(ptr, keys);
        Ok(chunks)
    }

    /// The export marks (`exports.rs`).
    pub fn exports(&self) -> &ExportState {
        &self.exported
    }

    /// The export marks, mutably (`exports.rs`).
    pub fn exports_mut(&mut self) -> &mut ExportState {
        &mut self.exported
    }
}
