//! Unpinning's moves: the live pages of a chunk get exact chunks of their
//! own at the same addresses, and the old chunk's handle is given back (see
//! `unpin.rs` for when and which chunks; this file is how one moves).
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
//! The driver's rules behind it: `cuMemUnmap` takes whole mappings and
//! `cuMemMap`'s `offset` "must be zero" (cuda.h), so part of a chunk can
//! neither be unmapped nor remapped; hence new handles for the live runs.

use super::budget::Charge;
use super::chunks::Chunk;
use super::observe::Owner;
use super::Physical;
use vmmalloc_device::{Call, Device, DeviceError, HostBuffer, PhysHandle};

/// One chunk to unpin: a chunk partly under live blocks.
#[derive(Debug, Clone)]
pub(crate) struct Move {
    /// Segment.
    pub seg: u32,
    /// First page of the chunk.
    pub first: u64,
    /// The chunk.
    pub chunk: Chunk,
    /// Runs of pages under blocks in use, `(first, pages)`, ascending and
    /// not adjacent.
    pub live: Vec<(u64, u64)>,
    /// Pages of `live`.
    pub live_pages: u64,
}

impl Move {
    /// Pages the chunk holds under free space only.
    pub fn free_pages(&self) -> u64 {
        self.chunk.pages - self.live_pages
    }
}

impl Physical {
    /// Moves the live runs of `p` to exact chunks and frees the old one
    /// (beside it when there is room, else in its place). On an error the
    /// chunk is as it was (see the module docs).
    pub fn unpin_chunk<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
    ) -> Result<(), DeviceError> {
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
        p: &Move,
    ) -> Result<HostBuffer, DeviceError> {
        let page = self.page();
        let base = self.table(p.seg).base();
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
            match self.copy_from_device(dev, base + f * page, &mut buf[at..at + len]) {
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
    pub(super) fn room_handles<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
    ) -> Result<Option<Vec<PhysHandle>>, DeviceError> {
        let mut handles: Vec<PhysHandle> = Vec::with_capacity(p.live.len());
        let mut held = 0;
        let mut fail = None;
        for &(_, n) in &p.live {
            if let Some(h) = self.take_pooled(n) {
                handles.push(h);
                held += n;
                continue;
            }
            let over = |me: &Self| me.over_limit(me.device_pages(), held + n);
            while over(self) {
                match self.release_largest(dev) {
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
            match self.raw_create(dev, n, Charge::Grow) {
                Ok(h) => {
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
            return Ok(Some(handles));
        }
        for (h, &(_, n)) in handles.into_iter().zip(&p.live) {
            self.give_back(h, n);
        }
        match fail {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// With the new handles in hand: copy the live runs into them on the
    /// device ([`Physical::copy_beside`]), unmap the old chunk, map the new ones
    /// in its place, pool the old handle. A failure maps the old chunk back
    /// (it still holds every byte) and pools the new handles.
    fn swap_beside<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
        handles: Vec<PhysHandle>,
    ) -> Result<(), DeviceError> {
        let (addr, len) = self.chunk_range(p);
        let pool_new = |me: &mut Self, hs: &[PhysHandle]| {
            for (&h, &(_, n)) in hs.iter().zip(&p.live) {
                me.give_back(h, n);
            }
        };
        if let Err(e) = self.copy_beside(dev, p, &handles) {
            pool_new(self, &handles);
            return Err(e);
        }
        if let Err(e) = self.raw_unmap(dev, Owner::Segment(p.seg), addr, len, 1) {
            pool_new(self, &handles);
            return Err(e);
        }
        if let Err(e) = self.map_live(dev, p, &handles, None) {
            pool_new(self, &handles);
            self.map_back(dev, p, p.chunk.handle);
            return Err(e);
        }
        self.commit_unpin(p, &handles);
        self.pool_put(p.chunk.handle, p.chunk.pages);
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
        p: &Move,
        handles: &[PhysHandle],
    ) -> Result<(), DeviceError> {
        let page = self.page();
        let base = self.table(p.seg).base();
        let len = p.live_pages * page;
        let scratch = self.raw_reserve(dev, Owner::Scratch, len, 0)?;
        let (mut mapped, mut mapped_handles) = (0, 0);
        let mut result = Ok(());
        for (&(_, n), &h) in p.live.iter().zip(handles) {
            if let Err(e) = self.raw_map(dev, Owner::Scratch, scratch + mapped, n * page, h) {
                result = Err(e);
                break;
            }
            mapped += n * page;
            mapped_handles += 1;
        }
        if result.is_ok() {
            result = self.raw_set_access(dev, Owner::Scratch, scratch, len);
        }
        if result.is_ok() {
            let mut at = 0;
            for &(f, n) in &p.live {
                match self.copy_device(dev, scratch + at, base + f * page, n * page) {
                    Ok(()) | Err(DeviceError::Unsupported { .. }) => {}
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
                at += n * page;
            }
        }
        self.release_scratch(
            dev,
            (scratch, len),
            (mapped, mapped_handles),
            &p.live,
            "unpinning",
        );
        result
    }

    /// Takes down the scratch reservation `(address, bytes)` of a copy
    /// beside (unpinning's [`Self::copy_beside`], IPC re-backing's
    /// `fill_beside`): its first `mapped.0` bytes map `mapped.1` handles, one
    /// per run of `runs` (pages) in order. Unmaps them in one call, else run
    /// by run; then frees the reservation, with one retry. Nothing is left to
    /// roll back, so failures are only reported (as `what`'s).
    pub(super) fn release_scratch<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        (scratch, len): (u64, u64),
        (mapped, handles): (u64, u32),
        runs: &[(u64, u64)],
        what: &str,
    ) {
        let page = self.page();
        if mapped > 0
            && self
                .raw_unmap(dev, Owner::Scratch, scratch, mapped, handles)
                .is_err()
        {
            let mut at = 0;
            for &(_, n) in runs {
                if at >= mapped {
                    break;
                }
                if let Err(e) = self.raw_unmap(dev, Owner::Scratch, scratch + at, n * page, 1) {
                    eprintln!(
                        "vmmalloc: {what}: unmapping scratch {:#x}: {e}",
                        scratch + at
                    );
                }
                at += n * page;
            }
        }
        for attempt in 0..2 {
            match self.raw_free_reservation(dev, Owner::Scratch, scratch, len) {
                Ok(()) => break,
                Err(e) if attempt == 1 => {
                    eprintln!("vmmalloc: {what}: freeing scratch {scratch:#x}: {e}")
                }
                Err(_) => {}
            }
        }
    }

    /// With no room beside it: unmap and release the old chunk, create the
    /// new ones in the memory it freed, map them, copy the bytes back. A
    /// failure after the release re-creates a chunk of the old size and
    /// copies the bytes into it.
    ///
    /// The budget keeps the old chunk's credit for the replacements
    /// ([`super::budget::Budget::begin_keep`]): what is released here is
    /// never charged by another process before it is charged again here.
    fn swap_in_place<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
        saved: &HostBuffer,
    ) -> Result<(), DeviceError> {
        self.budget.begin_keep();
        let r = self.swap_in_place_kept(dev, p, saved);
        self.budget.end_keep();
        r
    }

    /// [`Self::swap_in_place`] while the budget keeps credits.
    fn swap_in_place_kept<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
        saved: &HostBuffer,
    ) -> Result<(), DeviceError> {
        let (addr, len) = self.chunk_range(p);
        self.raw_unmap(dev, Owner::Segment(p.seg), addr, len, 1)?;
        if let Err(e) = self.raw_release(dev, p.chunk.handle, p.chunk.pages) {
            self.map_back(dev, p, p.chunk.handle);
            return Err(e);
        }
        let mut handles = Vec::with_capacity(p.live.len());
        let mut fail = None;
        for &(_, n) in &p.live {
            // In the memory the old chunk's release freed: a replacement.
            match self.raw_create(dev, n, Charge::Replace) {
                Ok(h) => handles.push(h),
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
                    return Ok(());
                }
                Err(e) => fail = Some(e),
            }
        }
        for (h, &(_, n)) in handles.into_iter().zip(&p.live) {
            let _ = self.raw_release(dev, h, n);
        }
        self.restore_released(dev, p, saved);
        Err(fail.expect("set on every failing path"))
    }

    /// Bytes `[addr, addr + len)` of `p`'s chunk.
    fn chunk_range(&self, p: &Move) -> (u64, u64) {
        let page = self.page();
        (self.page_addr(p.seg, p.first), p.chunk.pages * page)
    }

    /// Maps `handles` at `p`'s live runs, makes them accessible and copies
    /// `saved` (when the bytes went through the host) back. On failure
    /// unmaps what it mapped (the handles stay the caller's).
    pub(super) fn map_live<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        p: &Move,
        handles: &[PhysHandle],
        saved: Option<&HostBuffer>,
    ) -> Result<(), DeviceError> {
        let page = self.page();
        let base = self.table(p.seg).base();
        let owner = Owner::Segment(p.seg);
        let mut mapped = 0;
        let mut result = Ok(());
        for (&(f, n), &h) in p.live.iter().zip(handles) {
            if let Err(e) = self.raw_map(dev, owner, base + f * page, n * page, h) {
                result = Err(e);
                break;
            }
            mapped += 1;
            if let Err(e) = self.raw_set_access(dev, owner, base + f * page, n * page) {
                result = Err(e);
                break;
            }
        }
        if let (Ok(()), Some(saved)) = (&result, saved) {
            let mut at = 0usize;
            for &(f, n) in &p.live {
                let len = (n * page) as usize;
                match self.copy_to_device(dev, base + f * page, &saved[at..at + len]) {
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
                let _ = self.raw_unmap(dev, owner, base + f * page, n * page, 1);
            }
        }
        result
    }

    /// Maps `handle` (holding the chunk's bytes) at `p`'s chunk again. If
    /// even that fails the chunk stays in the table, listed as unready
    /// (mapped, maybe inaccessible), so that a later access retries it.
    fn map_back<D: Device + ?Sized>(&mut self, dev: &D, p: &Move, handle: PhysHandle) {
        let (addr, len) = self.chunk_range(p);
        let owner = Owner::Segment(p.seg);
        let back = self
            .raw_map(dev, owner, addr, len, handle)
            .and_then(|()| self.raw_set_access(dev, owner, addr, len));
        if back.is_err() {
            self.mark_unready(p.seg, p.first);
        }
    }

    /// After the old handle of `p` was released and the swap failed: a new
    /// chunk of the old size (device memory, else host memory as `spill`
    /// makes it), mapped where the old one was, with the live bytes copied
    /// back. Only a device that refuses both (memory taken by another
    /// process in between, and no host memory) loses the bytes; that is
    /// logged.
    fn restore_released<D: Device + ?Sized>(&mut self, dev: &D, p: &Move, saved: &HostBuffer) {
        let (addr, len) = self.chunk_range(p);
        // The old chunk's release and the new handles' made the room: a
        // replacement.
        let handle = match self.raw_create(dev, p.chunk.pages, Charge::Replace) {
            Ok(h) => Some(h),
            Err(_) => self.raw_create_on_host(dev, p.chunk.pages).ok(),
        };
        let Some(handle) = handle else {
            eprintln!(
                "vmmalloc: unpinning failed and no memory was left to put {} MiB of live tensors back at {addr:#x}",
                len >> 20
            );
            // The pages are gone from the device: record them unmapped.
            self.record_unmapped(p.seg, p.first);
            return;
        };
        self.record_swap(p.seg, p.first, handle);
        self.map_back(dev, p, handle);
        let page = self.page();
        let base = self.table(p.seg).base();
        let mut at = 0usize;
        for &(f, n) in &p.live {
            let n = (n * page) as usize;
            let _ = self.copy_to_device(dev, base + f * page, &saved[at..at + n]);
            at += n;
        }
    }

    /// Records a finished unpin in the chunk table: the old chunk out, the
    /// new ones in (the old handle is the caller's).
    fn commit_unpin(&mut self, p: &Move, handles: &[PhysHandle]) {
        self.record_unmapped(p.seg, p.first);
        for (&(f, n), &h) in p.live.iter().zip(handles) {
            let chunk = Chunk {
                handle: h,
                pages: n,
            };
            self.record_mapped(p.seg, f, chunk);
        }
    }

    /// Moves the chunk at page `first` of `seg` (`c`) into handle `new` of
    /// the same size, at the same addresses: its bytes go through host
    /// memory (`cuMemcpyDtoH`, unmap, map `new`, access, `cuMemcpyHtoD`).
    /// Spill uses it to bring a host-located chunk back to device memory.
    /// On a failure before `new` is mapped, `new` is pooled and `c` mapped
    /// back (listed unready if even that fails). Once `new` is mapped the
    /// old handle goes back ([`Physical::give_back`]: a host handle to its
    /// release list), even if copying the bytes back then fails.
    pub fn rehome_chunk<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        f: u64,
        c: Chunk,
        new: PhysHandle,
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, f);
        let len = c.pages * self.page();
        let owner = Owner::Segment(seg);
        // The bytes (`sim` holds none: its copies are unsupported).
        let mut bytes = vec![0u8; len as usize];
        let carry = match self.copy_from_device(dev, addr, &mut bytes) {
            Ok(()) => true,
            Err(DeviceError::Unsupported { .. }) => false,
            Err(e) => {
                self.pool_put(new, c.pages);
                return Err(e);
            }
        };
        if let Err(e) = self.raw_unmap(dev, owner, addr, len, 1) {
            self.pool_put(new, c.pages);
            return Err(e);
        }
        let mapped = self.raw_map(dev, owner, addr, len, new).and_then(|()| {
            let access = self.raw_set_access(dev, owner, addr, len);
            if access.is_err() {
                let _ = self.raw_unmap(dev, owner, addr, len, 1);
            }
            access
        });
        if let Err(e) = mapped {
            // Put the host chunk back where it was.
            self.pool_put(new, c.pages);
            let back = self
                .raw_map(dev, owner, addr, len, c.handle)
                .and_then(|()| self.raw_set_access(dev, owner, addr, len));
            if back.is_err() {
                self.mark_unready(seg, f);
            }
            return Err(e);
        }
        // Recorded before the bytes go back: `new` is mapped there now,
        // whatever the copy does.
        self.record_swap(seg, f, new);
        self.give_back(c.handle, c.pages);
        if carry {
            self.copy_to_device(dev, addr, &bytes)?;
        }
        Ok(())
    }
}
