//! The physical layer's own state: the chunk pool, the limit (memory
//! fraction), chunks left unready, spill's host-located handles and the
//! chunks pinned by IPC export — everything about handles that is not where
//! they are mapped. The segments' chunk tables (where each handle is mapped)
//! stay with the segments (`segment.rs`).
//!
//! The rest of the allocator asks [`Physical`] questions instead of reading
//! its fields: how much room the limit has ([`Physical::room`],
//! [`Physical::over_limit`]), where an unmapped handle goes
//! ([`Physical::give_back`]), whether a chunk may move
//! ([`Physical::may_move`]: not host memory, not unready, not exported),
//! whether its handle may be exported ([`Physical::exportable`]). Calls that
//! reach the driver (releases) take the allocator's [`Stats`], where every
//! driver call and handle is counted in PyTorch's shape.
//!
//! Invariants (checked by `validate`, see `validate.rs`): the pool's counts
//! equal a recount; `stats.pages_pooled` and `stats.handles_pooled` equal
//! the pool's; no host handle is pooled; every unready chunk is mapped.

use super::config::Layout;
use super::ipc::ExportState;
use super::pool::ChunkPool;
use super::spill::SpillState;
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
        }
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
    /// process (IPC export).
    pub fn may_move(&self, seg: u32, first: u64, h: PhysHandle) -> bool {
        !(self.is_host(h) || self.is_unready(seg, first) || self.exported.pins(seg, first))
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

    /// The export marks (`ipc.rs`).
    pub fn exports(&self) -> &ExportState {
        &self.exported
    }

    /// The export marks, mutably (`ipc.rs`).
    pub fn exports_mut(&mut self) -> &mut ExportState {
        &mut self.exported
    }
}
