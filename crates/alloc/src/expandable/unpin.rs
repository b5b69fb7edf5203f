//! Unpinning: giving back the free pages of chunks that live blocks hold
//! only in part.
//!
//! A chunk is one handle and one mapping, and the driver can neither unmap
//! nor release part of one (`cuMemUnmap` takes whole mappings; `cuMemMap`'s
//! `offset` "must be zero", cuda.h). So a chunk partly under live blocks
//! keeps its other pages (*pinned*) for as long as those blocks live. When
//! an allocation still lacks pages after the pool, new handles and a
//! targeted reclaim of whole free chunks, the allocator **unpins**: for each
//! such chunk (those whose live pages fit the room first, see
//! [`Inner::unpin`]), the live pages get exact chunks of
//! their own at the same addresses and the old chunk goes to the pool, so
//! its free pages are memory again and the caller's pointers stay valid.
//!
//! One chunk:
//!
//! 1. with room beside it (the pool or the limit): exact chunks for the live
//!    runs are obtained first and filled on the device: mapped in a scratch
//!    reservation, made accessible, `cuMemcpyDtoD` from the live runs
//!    (waited for), unmapped. Then the old chunk is unmapped, the new ones
//!    are mapped at the live runs' addresses and made accessible, and the
//!    old handle is pooled. A failure maps the old chunk back; it still
//!    holds every byte;
//! 2. with no room (memory is full, the common case when this runs): the
//!    live runs' bytes go to (pageable) host memory (`cuMemcpyDtoH`), the
//!    old chunk is unmapped and **released first**, the new chunks are
//!    created in the memory it freed, mapped, made accessible and filled
//!    (`cuMemcpyHtoD`). A failure creates a chunk of the old size again (on
//!    the host, with `spill`-style host memory, if the device refuses) and
//!    copies the bytes back.
//!
//! Safety of the swap: nothing may touch those bytes while they move.
//! Blocks with another stream noted (`record_stream`) or a pending free are
//! never moved, no unpinning happens while any of the allocator's streams is
//! capturing a CUDA graph, and the device is synchronized once
//! (`cuCtxSynchronize`) before the first move of a round, which waits for
//! every stream, including streams the allocator never saw (collectives that
//! use a tensor without `record_stream`). No other host thread may launch
//! work on a live block's memory during the allocating call: by default
//! (`unpin:auto`) unpinning runs only while the allocator has no evidence
//! of another thread running alongside the caller (`threads.rs`);
//! `unpin:always` trusts the program, `unpin:false` turns unpinning off.
//! See docs/expandable.md, "Unpinning" and "Unpinning and threads".

use super::blocks::BlockState;
use super::reclaim::Exclude;
use super::segment::Chunk;
use super::threads::Refusal;
use super::{Inner, UnpinMode};
use vmmalloc_device::{Call, Device, DeviceError, HostBuffer, PhysHandle, Stream};

/// A chunk partly under live blocks.
#[derive(Debug, Clone)]
struct Pinned {
    /// Segment.
    seg: u32,
    /// First page of the chunk.
    first: u64,
    /// The chunk.
    chunk: Chunk,
    /// Runs of pages under blocks in use, `(first, pages)`, ascending and
    /// not adjacent.
    live: Vec<(u64, u64)>,
    /// Pages of `live`.
    live_pages: u64,
}

impl Pinned {
    /// Pages the chunk holds under free space only.
    fn free_pages(&self) -> u64 {
        self.chunk.pages - self.live_pages
    }
}

/// Groups the page spans `(first, last)` of blocks (ascending by first
/// page, overlapping at most on shared pages) that meet pages `[f, end)`
/// into runs `(first, pages)`.
fn live_runs(spans: &[(u64, u64)], f: u64, end: u64) -> Vec<(u64, u64)> {
    let mut live: Vec<(u64, u64)> = Vec::new();
    for &(a, z) in spans {
        if z < f || a >= end {
            continue;
        }
        let (a, z) = (a.max(f), z.min(end - 1));
        match live.last_mut() {
            Some(r) if r.0 + r.1 >= a => r.1 = r.1.max(z + 1 - r.0),
            _ => live.push((a, z + 1 - a)),
        }
    }
    live
}

impl Inner {
    /// Chunks of device memory holding pages under movable live blocks and
    /// pages under free space only, except those overlapping `exclude`.
    fn pinned_chunks(&self, exclude: Exclude) -> Vec<Pinned> {
        let page = self.layout.page;
        let mut out = Vec::new();
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            if s.chunks.is_empty() {
                continue;
            }
            // Page spans (first, last) of the blocks in use, and whether
            // each may move.
            let spans: Vec<(u64, u64, bool)> = self
                .blocks_in(s)
                .filter(|b| b.state != BlockState::Free)
                .map(|b| {
                    (
                        (b.addr - s.base) / page,
                        (b.end() - 1 - s.base) / page,
                        b.state == BlockState::Allocated && b.streams.is_none(),
                    )
                })
                .collect();
            let x = exclude.and_then(|(xs, x0, x1)| (xs == si as u32).then_some((x0, x1)));
            let mut j = 0;
            for (&f, &c) in &s.chunks {
                let end = f + c.pages;
                while j < spans.len() && spans[j].1 < f {
                    j += 1;
                }
                let k = spans[j..].partition_point(|sp| sp.0 < end) + j;
                let near = &spans[j..k];
                if near.is_empty() || near.iter().any(|sp| !sp.2) {
                    continue;
                }
                // Not the request's own pages, not host memory (spill), not
                // a chunk whose access may be missing (unready), not a chunk
                // shared with another process (IPC export).
                if x.is_some_and(|(x0, x1)| f <= x1 && end > x0)
                    || !self.phys.may_move(si as u32, f, c.handle)
                {
                    continue;
                }
                let pairs: Vec<(u64, u64)> = near.iter().map(|sp| (sp.0, sp.1)).collect();
                let live = live_runs(&pairs, f, end);
                let live_pages: u64 = live.iter().map(|r| r.1).sum();
                if live_pages < c.pages {
                    out.push(Pinned {
                        seg: si as u32,
                        first: f,
                        chunk: c,
                        live,
                        live_pages,
                    });
                }
            }
        }
        out
    }

    /// Free pages that unpinning could give back now, whether or not it is
    /// on (for the out-of-memory report).
    pub(super) fn unpinnable_pages(&self) -> u64 {
        self.pinned_chunks(None)
            .iter()
            .map(Pinned::free_pages)
            .sum()
    }

    /// Whether segments of `stream` hold allocated or pending-free blocks.
    fn stream_has_live(&self, stream: Stream) -> bool {
        self.streams
            .iter()
            .filter(|e| e.stream == stream)
            .flat_map(|e| e.pools.iter().flat_map(|p| p.segments.iter()))
            .any(|&s| self.seg(s).active_blocks > 0)
    }

    /// Why unpinning may not run in the current call under `unpin:auto`
    /// (`threads.rs`); `None` under `always`, or when nothing speaks
    /// against it.
    pub(super) fn unpin_refusal(&self) -> Option<Refusal> {
        if self.unpin != UnpinMode::Auto {
            return None;
        }
        self.threads.refusal(|s| self.stream_has_live(s))
    }

    /// Unpins chunks (in the order explained inside) until at least `want` pages
    /// are free again (in the pool or released). Returns the pages freed;
    /// 0 when nothing could be unpinned (nothing changed then, apart from
    /// the synchronize).
    pub(super) fn unpin<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        want: u64,
        exclude: Exclude,
    ) -> u64 {
        if self.unpin == UnpinMode::Never || want == 0 {
            return 0;
        }
        let mut cands = self.pinned_chunks(exclude);
        if cands.is_empty() {
            return 0;
        }
        if self.unpin_refusal().is_some() {
            self.stats.unpin_refusals += 1;
            return 0;
        }
        // A synchronize during a graph capture would invalidate it (and
        // the bytes may belong to the graph): never then. Every stream this
        // allocator serves is asked, and the legacy default stream, which
        // answers "capturing" while any blocking stream of the context
        // captures (cuStreamIsCapturing, CUDA Driver API). A stream whose
        // state cannot be read counts as capturing.
        let mut streams: Vec<_> = self.streams.iter().map(|e| e.stream).collect();
        if !streams.contains(&Stream::DEFAULT) {
            streams.push(Stream::DEFAULT);
        }
        if streams.iter().any(|&s| dev.is_capturing(s).unwrap_or(true)) {
            return 0;
        }
        self.stats.driver_calls.add(Call::DeviceSync);
        self.stats.unpin_device_syncs += 1;
        if dev.synchronize().is_err() {
            return 0;
        }
        for e in &mut self.streams {
            e.synced_at = self.tick;
        }
        // Which chunk next: one whose live pages fit in the room under the
        // limit moves on the device (a map and a device copy), one that does
        // not goes through pageable host memory twice (release first), about
        // 200 times dearer per byte (docs/driver.md: 0.58 against 2 × 126
        // µs per MiB on an H200). Every chunk unpinned makes room of its free
        // pages. So: among chunks that fit the room, most free pages first
        // (among equals, fewer bytes to copy). When none fits, a round trip
        // is unavoidable: the chunk with the fewest live pages among those
        // that alone give the pages still wanted, else the one with the most
        // free pages (fewer live pages among equals), after which the room
        // it made may let the rest move on the device.
        let mut got = 0;
        while got < want && !cands.is_empty() {
            let room = self.phys.limit_pages().saturating_sub(self.mapped_pages());
            let need = want - got;
            let most_free = |c: &Pinned| (std::cmp::Reverse(c.free_pages()), c.live_pages);
            let fits = |c: &Pinned| c.live_pages <= room;
            let enough = |c: &Pinned| c.free_pages() >= need;
            let pick = (0..cands.len())
                .filter(|&i| fits(&cands[i]))
                .min_by_key(|&i| most_free(&cands[i]))
                .or_else(|| {
                    (0..cands.len())
                        .filter(|&i| enough(&cands[i]))
                        .min_by_key(|&i| cands[i].live_pages)
                })
                .or_else(|| (0..cands.len()).min_by_key(|&i| most_free(&cands[i])))
                .expect("cands is not empty");
            let p = cands.swap_remove(pick);
            match self.unpin_chunk(dev, &p) {
                Ok(()) => {
                    got += p.free_pages();
                    self.stats.chunk_unpins += 1;
                    self.stats.unpinned_bytes += p.free_pages() * self.layout.page;
                    self.stats.unpin_copied_bytes += p.live_pages * self.layout.page;
                }
                Err(e) => {
                    eprintln!("vmmalloc: unpinning a chunk failed: {e}");
                    break;
                }
            }
        }
        got
    }

    /// Moves the live runs of `p` to exact chunks and frees the old one
    /// (beside it when there is room, else in its place). On an error the
    /// chunk is as it was (see the module docs).
    fn unpin_chunk<D: Device + ?Sized>(&mut self, dev: &D, p: &Pinned) -> Result<(), DeviceError> {
        match self.room_handles(dev, p)? {
            Some(handles) => self.swap_beside(dev, p, handles),
            None => {
                let saved = self.save_live(dev, p)?;
                self.swap_in_place(dev, p, &saved)
            }
        }
    }

    /// Copies the bytes of `p`'s live runs to one host buffer, runs in
    /// order. A device that holds no bytes (`sim`) still gets every copy
    /// call (so that its cost model charges them) and refuses it.
    fn save_live<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
    ) -> Result<HostBuffer, DeviceError> {
        let page = self.layout.page;
        let base = self.seg(p.seg).base;
        // Pageable memory: page-locking a buffer of this size
        // (`cuMemHostAlloc`) would cost more than the copy it speeds up.
        let mut buf = HostBuffer::heap(p.live_pages * page).ok_or(DeviceError::OutOfMemory {
            call: Call::HostAlloc,
            requested: p.live_pages * page,
            free: 0,
            total: 0,
        })?;
        let mut at = 0usize;
        for &(f, n) in &p.live {
            let len = (n * page) as usize;
            self.stats.driver_calls.add(Call::CopyDtoH);
            match dev.copy_from_device(base + f * page, &mut buf[at..at + len]) {
                Ok(()) | Err(DeviceError::Unsupported { .. }) => {}
                Err(e) => return Err(e),
            }
            at += len;
        }
        Ok(buf)
    }

    /// Handles for `p`'s live runs beside the old chunk: pooled ones of each
    /// size, else new ones within the limit (releasing pooled handles for
    /// room). `None` when the limit has no room for them; every handle
    /// obtained is pooled again then.
    fn room_handles<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
    ) -> Result<Option<Vec<PhysHandle>>, DeviceError> {
        let page = self.layout.page;
        let mut handles: Vec<PhysHandle> = Vec::with_capacity(p.live.len());
        let mut held = 0;
        let mut fail = None;
        for &(_, n) in &p.live {
            if let Some(h) = self.phys.take_pooled(n) {
                handles.push(h);
                held += n;
                continue;
            }
            let over = |me: &Self| me.phys.over_limit(me.mapped_pages(), held + n);
            while over(self) {
                match self.phys.release_largest(&mut self.stats, dev) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => {
                        fail = Some(e);
                        break;
                    }
                }
            }
            if fail.is_some() || over(self) {
                break;
            }
            self.stats.driver_calls.add(Call::Create);
            match dev.create(n * page) {
                Ok(h) => {
                    self.stats.num_device_alloc += 1;
                    handles.push(h);
                    held += n;
                }
                Err(e) if e.is_out_of_memory() => break,
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
        }
        if handles.len() == p.live.len() {
            self.phys.sync_stats(&mut self.stats);
            return Ok(Some(handles));
        }
        for (h, &(_, n)) in handles.into_iter().zip(&p.live) {
            self.phys.pool_put(&mut self.stats, h, n);
        }
        self.phys.sync_stats(&mut self.stats);
        match fail {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// With the new handles in hand: copy the live runs into them on the
    /// device ([`Inner::copy_beside`]), unmap the old chunk, map the new ones
    /// in its place, pool the old handle. A failure maps the old chunk back
    /// (it still holds every byte) and pools the new handles.
    fn swap_beside<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
        handles: Vec<PhysHandle>,
    ) -> Result<(), DeviceError> {
        let (addr, len) = self.chunk_range(p);
        let pool_new = |me: &mut Self, hs: &[PhysHandle]| {
            for (&h, &(_, n)) in hs.iter().zip(&p.live) {
                me.phys.pool_put(&mut me.stats, h, n);
            }
            me.phys.sync_stats(&mut me.stats);
        };
        if let Err(e) = self.copy_beside(dev, p, &handles) {
            pool_new(self, &handles);
            return Err(e);
        }
        self.stats.driver_calls.add(Call::Unmap);
        if let Err(e) = dev.unmap(addr, len) {
            pool_new(self, &handles);
            return Err(e);
        }
        if let Err(e) = self.map_live(dev, p, &handles, None) {
            pool_new(self, &handles);
            self.map_back(dev, p, p.chunk.handle);
            return Err(e);
        }
        self.commit_unpin(p, &handles);
        self.phys
            .pool_put(&mut self.stats, p.chunk.handle, p.chunk.pages);
        self.phys.sync_stats(&mut self.stats);
        Ok(())
    }

    /// Copies `p`'s live runs into `handles` on the device: the handles are
    /// mapped one after another in a scratch reservation, made accessible
    /// with one call, filled by `cuMemcpyDtoD` (which
    /// [`Device::copy_device`] waits for), then unmapped again and the
    /// reservation freed. Device memory moves at ~610 GiB/s, against
    /// ~12.5 GiB/s for a round trip through pageable host memory
    /// (docs/driver.md). On failure nothing stays mapped and the handles
    /// are the caller's, unchanged.
    fn copy_beside<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
        handles: &[PhysHandle],
    ) -> Result<(), DeviceError> {
        let page = self.layout.page;
        let base = self.seg(p.seg).base;
        let len = p.live_pages * page;
        self.stats.driver_calls.add(Call::Reserve);
        let scratch = dev.reserve(len, 0)?;
        let mut mapped = 0;
        let mut result = Ok(());
        for (&(_, n), &h) in p.live.iter().zip(handles) {
            self.stats.driver_calls.add(Call::Map);
            if let Err(e) = dev.map(scratch + mapped, n * page, h) {
                result = Err(e);
                break;
            }
            mapped += n * page;
        }
        if result.is_ok() {
            self.stats.driver_calls.add(Call::SetAccess);
            result = dev.set_access(scratch, len);
        }
        if result.is_ok() {
            let mut at = 0;
            for &(f, n) in &p.live {
                self.stats.driver_calls.add(Call::CopyDtoD);
                match dev.copy_device(scratch + at, base + f * page, n * page) {
                    Ok(()) | Err(DeviceError::Unsupported { .. }) => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                at += n * page;
            }
        }
        // Take the scratch mappings down: in one call, else run by run.
        if mapped > 0 {
            self.stats.driver_calls.add(Call::Unmap);
            if dev.unmap(scratch, mapped).is_err() {
                let mut at = 0;
                for &(_, n) in &p.live {
                    if at >= mapped {
                        break;
                    }
                    self.stats.driver_calls.add(Call::Unmap);
                    if let Err(e) = dev.unmap(scratch + at, n * page) {
                        eprintln!(
                            "vmmalloc: unpinning: unmapping scratch {:#x}: {e}",
                            scratch + at
                        );
                    }
                    at += n * page;
                }
            }
        }
        for attempt in 0..2 {
            self.stats.driver_calls.add(Call::AddressFree);
            match dev.free_reservation(scratch, len) {
                Ok(()) => break,
                Err(e) if attempt == 1 => {
                    eprintln!("vmmalloc: unpinning: freeing scratch {scratch:#x}: {e}")
                }
                Err(_) => {}
            }
        }
        result
    }

    /// With no room beside it: unmap and release the old chunk, create the
    /// new ones in the memory it freed, map them, copy the bytes back. A
    /// failure after the release re-creates a chunk of the old size and
    /// copies the bytes into it.
    fn swap_in_place<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
        saved: &HostBuffer,
    ) -> Result<(), DeviceError> {
        let page = self.layout.page;
        let (addr, len) = self.chunk_range(p);
        self.stats.driver_calls.add(Call::Unmap);
        dev.unmap(addr, len)?;
        if let Err(e) = self
            .phys
            .release_handle(&mut self.stats, dev, p.chunk.handle)
        {
            self.map_back(dev, p, p.chunk.handle);
            return Err(e);
        }
        let mut handles = Vec::with_capacity(p.live.len());
        let mut fail = None;
        for &(_, n) in &p.live {
            self.stats.driver_calls.add(Call::Create);
            match dev.create(n * page) {
                Ok(h) => {
                    self.stats.num_device_alloc += 1;
                    handles.push(h);
                }
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
        }
        if fail.is_none() {
            match self.map_live(dev, p, &handles, Some(saved)) {
                Ok(()) => {
                    self.commit_unpin(p, &handles);
                    self.phys.sync_stats(&mut self.stats);
                    return Ok(());
                }
                Err(e) => fail = Some(e),
            }
        }
        for h in handles {
            let _ = self.phys.release_handle(&mut self.stats, dev, h);
        }
        self.restore_released(dev, p, saved);
        Err(fail.expect("set on every failing path"))
    }

    /// Bytes `[addr, addr + len)` of `p`'s chunk.
    fn chunk_range(&self, p: &Pinned) -> (u64, u64) {
        let page = self.layout.page;
        (self.seg(p.seg).base + p.first * page, p.chunk.pages * page)
    }

    /// Maps `handles` at `p`'s live runs, makes them accessible and copies
    /// `saved` (when the bytes went through the host) back. On failure
    /// unmaps what it mapped (the handles stay the caller's).
    fn map_live<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Pinned,
        handles: &[PhysHandle],
        saved: Option<&HostBuffer>,
    ) -> Result<(), DeviceError> {
        let page = self.layout.page;
        let base = self.seg(p.seg).base;
        let mut mapped = 0;
        let mut result = Ok(());
        for (&(f, n), &h) in p.live.iter().zip(handles) {
            self.stats.driver_calls.add(Call::Map);
            if let Err(e) = dev.map(base + f * page, n * page, h) {
                result = Err(e);
                break;
            }
            mapped += 1;
            self.stats.driver_calls.add(Call::SetAccess);
            if let Err(e) = dev.set_access(base + f * page, n * page) {
                result = Err(e);
                break;
            }
        }
        if let (Ok(()), Some(saved)) = (&result, saved) {
            let mut at = 0usize;
            for &(f, n) in &p.live {
                let len = (n * page) as usize;
                self.stats.driver_calls.add(Call::CopyHtoD);
                match dev.copy_to_device(base + f * page, &saved[at..at + len]) {
                    Ok(()) | Err(DeviceError::Unsupported { .. }) => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                at += len;
            }
        }
        if result.is_err() {
            for &(f, n) in &p.live[..mapped] {
                self.stats.driver_calls.add(Call::Unmap);
                let _ = dev.unmap(base + f * page, n * page);
            }
        }
        result
    }

    /// Maps `handle` (holding the chunk's bytes) at `p`'s chunk again. If
    /// even that fails the chunk stays in the table, listed as unready
    /// (mapped, maybe inaccessible), so that a later access retries it.
    fn map_back<D: Device + ?Sized>(&mut self, dev: &D, p: &Pinned, handle: PhysHandle) {
        let (addr, len) = self.chunk_range(p);
        self.stats.driver_calls.add(Call::Map);
        let back = dev.map(addr, len, handle).and_then(|()| {
            self.stats.driver_calls.add(Call::SetAccess);
            dev.set_access(addr, len)
        });
        if back.is_err() {
            self.phys.mark_unready(p.seg, p.first);
        }
    }

    /// After the old handle of `p` was released and the swap failed: a new
    /// chunk of the old size (device memory, else host memory as `spill`
    /// makes it), mapped where the old one was, with the live bytes copied
    /// back. Only a device that refuses both (memory taken by another
    /// process in between, and no host memory) loses the bytes; that is
    /// logged.
    fn restore_released<D: Device + ?Sized>(&mut self, dev: &D, p: &Pinned, saved: &HostBuffer) {
        let (addr, len) = self.chunk_range(p);
        self.stats.driver_calls.add(Call::Create);
        let handle = match dev.create(len) {
            Ok(h) => {
                self.stats.num_device_alloc += 1;
                Some(h)
            }
            Err(_) => {
                self.stats.driver_calls.add(Call::Create);
                dev.create_on_host(len).ok().inspect(|h| {
                    self.phys.add_host(*h);
                    self.phys
                        .note_mapping(&mut self.stats, *h, p.chunk.pages, true);
                })
            }
        };
        let Some(handle) = handle else {
            eprintln!(
                "vmmalloc: unpinning failed and no memory was left to put {} MiB of live tensors back at {addr:#x}",
                len >> 20
            );
            // The pages are gone from the device: record them unmapped.
            let page = self.layout.page;
            let before = self.seg(p.seg).inactive_split(page);
            self.seg_mut(p.seg).remove_chunk(p.first);
            self.split_changed(p.seg, before);
            let k = self.seg(p.seg).kind as usize;
            self.counters
                .reserved_bytes
                .add(k, -((p.chunk.pages * page) as i64));
            self.stats.pages_mapped -= p.chunk.pages;
            self.stats.handles_mapped -= 1;
            return;
        };
        self.seg_mut(p.seg).chunks.insert(
            p.first,
            Chunk {
                handle,
                pages: p.chunk.pages,
            },
        );
        self.map_back(dev, p, handle);
        let page = self.layout.page;
        let mut at = 0usize;
        for &(f, n) in &p.live {
            let n = (n * page) as usize;
            self.stats.driver_calls.add(Call::CopyHtoD);
            let _ = dev.copy_to_device(self.seg(p.seg).base + f * page, &saved[at..at + n]);
            at += n;
        }
    }

    /// Records a finished unpin in the segment and the counters: the old
    /// chunk out, the new ones in (the old handle is the caller's).
    fn commit_unpin(&mut self, p: &Pinned, handles: &[PhysHandle]) {
        let page = self.layout.page;
        let before = self.seg(p.seg).inactive_split(page);
        let s = self.seg_mut(p.seg);
        s.remove_chunk(p.first);
        for (&(f, n), &h) in p.live.iter().zip(handles) {
            s.add_chunk(
                f,
                Chunk {
                    handle: h,
                    pages: n,
                },
            );
        }
        self.split_changed(p.seg, before);
        let k = self.seg(p.seg).kind as usize;
        let freed = p.free_pages();
        self.counters
            .reserved_bytes
            .add(k, -((freed * page) as i64));
        self.stats.pages_mapped -= freed;
        self.stats.handles_mapped += p.live.len() as u64 - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::live_runs;

    #[test]
    fn live_runs_clip_to_the_chunk_and_merge_shared_pages() {
        // Blocks on pages 0-3, 3-5 (sharing page 3), 9-12; chunk pages 2..11.
        let spans = [(0, 3), (3, 5), (9, 12)];
        assert_eq!(live_runs(&spans, 2, 11), vec![(2, 4), (9, 2)]);
        // Adjacent blocks (5 ends, 6 starts) form one run.
        assert_eq!(live_runs(&[(4, 5), (6, 7)], 0, 10), vec![(4, 4)]);
        assert_eq!(live_runs(&[(20, 30)], 0, 10), vec![]);
    }
}
