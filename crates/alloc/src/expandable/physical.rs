//! The physical layer: the handles the allocator holds and where they are —
//! the segments' chunk tables (which handle is mapped at which page,
//! `chunks.rs`), the chunk pool, the limit (memory fraction), chunks left
//! unready, spill's host-located handles and the chunks pinned by IPC
//! export. (Growable regions keep their own stack of chunks, `growable.rs`:
//! a region is not a segment and maps only at its end; they take from and
//! give back to this pool, count under this limit and spill's accounting.)
//!
//! It makes the driver calls that move handles (`cuMemMap`,
//! `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`) and records them; the
//! block layer (the rest of `expandable`) decides what to map and keeps its
//! own counters. The rest of the allocator asks [`Physical`] questions
//! instead of reading its fields: which pages of a segment are mapped
//! ([`Physical::table`]), how much room the limit has ([`Physical::room`],
//! [`Physical::over_limit`]), where an unmapped handle goes
//! ([`Physical::give_back`]), whether a chunk may move
//! ([`Physical::may_move`]: not host memory, not unready, not exported),
//! whether its handle may be exported ([`Physical::exportable`]). Calls that
//! reach the driver take the allocator's [`Stats`], where every driver call
//! and handle is counted in PyTorch's shape.
//!
//! Invariants (checked by `validate`, see `validate.rs`): every chunk table
//! is sound ([`ChunkTable::validate`]) and a retired segment's is empty; no
//! handle is mapped twice; `stats.pages_mapped` and `stats.handles_mapped`
//! equal a recount of the tables (and the regions'); the pool's counts equal
//! a recount; `stats.pages_pooled` and `stats.handles_pooled` equal the
//! pool's; no host handle is pooled; every unready chunk is mapped.

use super::chunks::{Chunk, ChunkTable};
use super::config::Layout;
use super::ipc::ExportState;
use super::pool::ChunkPool;
use super::spill::SpillState;
use crate::ipc::ExportedChunk;
use crate::Stats;
use vmmalloc_device::{Call, Device, DeviceError, PhysHandle};

/// Physical state of one allocator (see the module docs).
#[derive(Debug)]
pub(crate) struct Physical {
    /// Bytes of one page.
    page: u64,
    /// The memory fraction in force.
    fraction: f64,
    /// Most device pages that may be mapped + pooled (from the memory fraction).
    limit_pages: u64,
    /// Pooled bytes kept before releasing handles.
    release_threshold: u64,
    /// Unmapped chunks whose handle is kept (the chunk pool).
    pool: ChunkPool,
    /// Chunks that are mapped but not yet accessible, `(segment, first
    /// page)`: only after a `set_access` failed and the rollback unmap failed too.
    unready: Vec<(u32, u64)>,
    /// Host-located chunks (`spill:true`, `spill.rs`).
    spill: SpillState,
    /// Blocks exported to other processes and the chunks they pin (`ipc.rs`).
    exported: ExportState,
    /// The chunk table of each segment slot (empty for a retired slot).
    tables: Vec<ChunkTable>,
}

impl Physical {
    /// The physical layer of a new allocator: empty pool, the limit of
    /// `fraction` of the device.
    pub fn new(layout: &Layout, fraction: f64, release_threshold: u64, spill: bool) -> Physical {
        Physical {
            page: layout.page,
            fraction,
            limit_pages: layout.limit_pages(fraction),
            release_threshold,
            pool: ChunkPool::default(),
            unready: Vec::new(),
            spill: SpillState {
                enabled: spill,
                ..Default::default()
            },
            exported: ExportState::default(),
            tables: Vec::new(),
        }
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
    }

    /// Address of page `p` of segment `seg`.
    #[inline]
    pub fn page_addr(&self, seg: u32, p: u64) -> u64 {
        self.tables[seg as usize].base() + p * self.page
    }

    /// `cuMemMap`s handle `h` of `pages` pages at page `first` of `seg` and
    /// records it (counted in `stats`; access is [`Physical::set_access`]'s).
    /// On failure nothing is recorded and the handle is still the caller's.
    pub fn map_chunk<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
        dev: &D,
        seg: u32,
        first: u64,
        h: PhysHandle,
        pages: u64,
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, first);
        stats.driver_calls.add(Call::Map);
        dev.map(addr, pages * self.page, h)?;
        self.record_mapped(stats, seg, first, Chunk { handle: h, pages });
        Ok(())
    }

    /// Records that `chunk` was mapped at page `first` of `seg` by the
    /// caller (unpinning maps its own): the table, `pages_mapped`,
    /// `handles_mapped` and the spill accounting.
    pub fn record_mapped(&mut self, stats: &mut Stats, seg: u32, first: u64, chunk: Chunk) {
        self.tables[seg as usize].add(first, chunk);
        self.note_mapping(stats, chunk.handle, chunk.pages, true);
        stats.pages_mapped += chunk.pages;
        stats.handles_mapped += 1;
    }

    /// Records that the chunk at page `first` of `seg` is no longer mapped
    /// (the caller unmapped it, or its pages are lost); returns it. The
    /// handle is the caller's.
    pub fn record_unmapped(&mut self, stats: &mut Stats, seg: u32, first: u64) -> Option<Chunk> {
        let c = self.tables[seg as usize].remove(first)?;
        self.note_mapping(stats, c.handle, c.pages, false);
        stats.pages_mapped -= c.pages;
        stats.handles_mapped -= 1;
        self.forget_unready(seg, &[first]);
        Some(c)
    }

    /// Records that the chunk at page `first` of `seg` is now backed by
    /// handle `h` (same pages; the caller remapped it); returns the old
    /// chunk, whose handle is the caller's.
    pub fn record_swap(
        &mut self,
        stats: &mut Stats,
        seg: u32,
        first: u64,
        h: PhysHandle,
    ) -> Option<Chunk> {
        let old = self.tables[seg as usize].replace(first, h)?;
        self.note_mapping(stats, old.handle, old.pages, false);
        self.note_mapping(stats, h, old.pages, true);
        Some(old)
    }

    /// `cuMemSetAccess` on pages `[first, first + pages)` of `seg` (counted).
    pub fn set_access<D: Device + ?Sized>(
        &self,
        stats: &mut Stats,
        dev: &D,
        seg: u32,
        first: u64,
        pages: u64,
    ) -> Result<(), DeviceError> {
        stats.driver_calls.add(Call::SetAccess);
        dev.set_access(self.page_addr(seg, first), pages * self.page)
    }

    /// `cuMemUnmap`s pages `[first, first + count)` of `seg`, which are
    /// whole chunks, in one call; their handles go back
    /// ([`Physical::give_back`]). On failure nothing changes.
    pub fn unmap_run<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
    ) -> Result<(), DeviceError> {
        stats.driver_calls.add(Call::Unmap);
        dev.unmap(self.page_addr(seg, first), count * self.page)?;
        let firsts: Vec<u64> = self.tables[seg as usize]
            .chunks_within(first, first + count)
            .map(|(f, _)| f)
            .collect();
        let mut pages = 0;
        for f in firsts {
            if let Some(c) = self.record_unmapped(stats, seg, f) {
                pages += c.pages;
                self.give_back(c.handle, c.pages);
            }
        }
        self.sync_stats(stats);
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
        stats: &mut Stats,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
        mark_unready: bool,
    ) -> Result<(), DeviceError> {
        let Err(e) = self.unmap_run(stats, dev, seg, first, count) else {
            return Ok(());
        };
        let chunks: Vec<(u64, u64)> = self.tables[seg as usize]
            .chunks_within(first, first + count)
            .map(|(f, c)| (f, c.pages))
            .collect();
        for (f, n) in chunks {
            if self.unmap_run(stats, dev, seg, f, n).is_err() && mark_unready {
                self.mark_unready(seg, f);
            }
        }
        Err(e)
    }

    /// Gives access to the unready chunks overlapping pages `[p0, p1]` of `seg`.
    pub fn fix_unready<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
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
            self.set_access(stats, dev, seg, f, c.pages)?;
            self.mark_ready(seg, f);
        }
        Ok(())
    }

    /// Removes every chunk of segment `seg`'s table without a driver call
    /// (teardown unmaps the runs itself first); returns them ascending.
    pub fn take_all_chunks(&mut self, seg: u32) -> Vec<(u64, Chunk)> {
        self.tables[seg as usize].take_all()
    }

    // --- The limit -------------------------------------------------------

    /// The memory fraction in force.
    #[inline]
    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    /// Most device pages that may be mapped + pooled.
    #[inline]
    pub fn limit_pages(&self) -> u64 {
        self.limit_pages
    }

    /// Sets the memory fraction and the limit it gives (pages already
    /// held above it are the caller's to release).
    pub fn set_fraction(&mut self, fraction: f64, limit_pages: u64) {
        self.fraction = fraction;
        self.limit_pages = limit_pages;
    }

    /// Device pages mapped (segments and regions; host-located, spilled
    /// pages are not device memory), from the allocator's `stats`.
    #[inline]
    pub fn device_pages(&self, stats: &Stats) -> u64 {
        stats.pages_mapped - self.spill.spilled_pages
    }

    /// Pages the limit still has room for, with `mapped` device pages mapped
    /// (pooled pages count as held).
    #[inline]
    pub fn room(&self, mapped: u64) -> u64 {
        self.limit_pages.saturating_sub(mapped + self.pool.pages())
    }

    /// Whether `mapped` device pages, the pool and `extra` more pages exceed
    /// the limit.
    #[inline]
    pub fn over_limit(&self, mapped: u64, extra: u64) -> bool {
        mapped + self.pool.pages() + extra > self.limit_pages
    }

    // --- The pool ----------------------------------------------------------

    /// The chunk pool, to read (its sizes plan a request).
    #[inline]
    pub fn pool(&self) -> &ChunkPool {
        &self.pool
    }

    /// Takes a pooled chunk of exactly `pages` pages (the stats are the
    /// caller's to sync, [`Physical::sync_stats`]).
    #[inline]
    pub fn take_pooled(&mut self, pages: u64) -> Option<PhysHandle> {
        self.pool.take(pages)
    }

    /// Puts a device handle of `pages` pages in the pool as it is (no
    /// host check: teardown, which releases the whole pool next).
    #[inline]
    pub fn put_pooled(&mut self, h: PhysHandle, pages: u64) {
        self.pool.put(h, pages);
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
    pub fn give_back_unmapped(&mut self, stats: &mut Stats, h: PhysHandle, pages: u64) {
        self.note_mapping(stats, h, pages, false);
        self.give_back(h, pages);
    }

    /// Puts a chunk of `pages` pages in the pool ([`Physical::give_back`])
    /// and syncs the stats.
    #[inline]
    pub fn pool_put(&mut self, stats: &mut Stats, h: PhysHandle, pages: u64) {
        self.give_back(h, pages);
        self.sync_stats(stats);
    }

    /// Copies the pool's size into the stats.
    #[inline]
    pub fn sync_stats(&self, stats: &mut Stats) {
        stats.pages_pooled = self.pool.pages();
        stats.handles_pooled = self.pool.count();
    }

    /// `cuMemRelease`, counted.
    pub fn release_handle<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
        dev: &D,
        h: PhysHandle,
    ) -> Result<(), DeviceError> {
        stats.driver_calls.add(Call::Release);
        dev.release(h)?;
        stats.num_device_free += 1;
        Ok(())
    }

    /// Releases the largest pooled chunk; returns its pages (0 when the pool
    /// is empty). A chunk whose release fails stays pooled.
    pub fn release_largest<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
        dev: &D,
    ) -> Result<u64, DeviceError> {
        let Some((h, pages)) = self.pool.take_largest() else {
            return Ok(0);
        };
        let r = self.release_handle(stats, dev, h);
        if r.is_err() {
            self.pool.put(h, pages);
        }
        self.sync_stats(stats);
        r.map(|()| pages)
    }

    /// Releases every pooled chunk; failed ones stay pooled, the first error
    /// is returned.
    pub fn release_pool<D: Device + ?Sized>(
        &mut self,
        stats: &mut Stats,
        dev: &D,
    ) -> Result<(), DeviceError> {
        let mut first_err = None;
        for (h, pages) in self.pool.drain() {
            if let Err(e) = self.release_handle(stats, dev, h) {
                self.pool.put(h, pages);
                first_err.get_or_insert(e);
            }
        }
        self.sync_stats(stats);
        first_err.map_or(Ok(()), Err)
    }

    /// Releases the unmapped host chunks, then pooled chunks (largest first)
    /// while the pool holds more than the release threshold. Stops at the
    /// first failed release (the chunk stays pooled).
    pub fn trim<D: Device + ?Sized>(&mut self, stats: &mut Stats, dev: &D) {
        if !self.spill.host_free.is_empty() {
            self.release_host_free(stats, dev);
        }
        while self.pool.pages().saturating_mul(self.page) > self.release_threshold {
            if self.release_largest(stats, dev).is_err() {
                break;
            }
        }
    }

    /// Removes every pooled chunk (teardown releases them).
    pub fn drain_pool(&mut self) -> Vec<(PhysHandle, u64)> {
        self.pool.drain()
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

    /// Notes a new host-located handle (`cuMemCreate` with a host
    /// location): it never enters the pool, and is released when unmapped.
    pub fn add_host(&mut self, h: PhysHandle) {
        self.spill.host.insert(h.0);
    }

    /// Host handle `h` is no longer mapped: released at the next trim.
    pub fn drop_host(&mut self, h: PhysHandle) {
        self.spill.host_free.push(h);
    }

    /// Notes that chunk `h` of `pages` pages was mapped (or, with `mapped`
    /// false, unmapped): keeps `spilled_pages` and the spill stats.
    pub fn note_mapping(&mut self, stats: &mut Stats, h: PhysHandle, pages: u64, mapped: bool) {
        if !self.spill.host.contains(&h.0) {
            return;
        }
        if mapped {
            self.spill.spilled_pages += pages;
        } else {
            self.spill.spilled_pages -= pages;
        }
        let bytes = self.spill.spilled_pages * self.page;
        stats.spilled_bytes = bytes;
        stats.spilled_bytes_peak = stats.spilled_bytes_peak.max(bytes);
    }

    /// Releases the unmapped host chunks; a failed release stays listed.
    pub fn release_host_free<D: Device + ?Sized>(&mut self, stats: &mut Stats, dev: &D) {
        for h in std::mem::take(&mut self.spill.host_free) {
            if self.release_handle(stats, dev, h).is_ok() {
                self.spill.host.remove(&h.0);
            } else {
                self.spill.host_free.push(h);
            }
        }
    }

    /// Removes the unmapped host handles (teardown releases them).
    pub fn drain_host_free(&mut self) -> Vec<PhysHandle> {
        std::mem::take(&mut self.spill.host_free)
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

    /// The export marks (`ipc.rs`).
    pub fn exports(&self) -> &ExportState {
        &self.exported
    }

    /// The export marks, mutably (`ipc.rs`).
    pub fn exports_mut(&mut self) -> &mut ExportState {
        &mut self.exported
    }
}
