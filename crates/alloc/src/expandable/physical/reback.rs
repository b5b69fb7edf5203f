//! Re-backing a run of chunks with equal handles at the same addresses
//! (issue 40, item 2): what PyTorch's expandable-segments IPC format needs.
//!
//! PyTorch's consumer (`ExpandableSegment::fromShared`, reached from
//! `getIpcDevPtr` in c10/cuda/CUDACachingAllocator.cpp) reads one
//! `segment_size` from the handle's `ShareHeader` and maps handle *i* at
//! `base + i * segment_size`: the exported range must be a run of handles of
//! one size. The allocator's chunks under a block are often not (the ladder
//! cuts a request at `max_chunk`, a growing tail maps ahead by
//! `grow_granule`, unpinning leaves exact chunks). [`Physical::reback_equal`]
//! makes pages `[r0, r1)` of a segment, which are whole chunks, into
//! `(r1 - r0) / s` handles of `s` pages each, holding the same bytes at the
//! same addresses:
//!
//! 1. **beside** (room under the limit for the new handles, pooled ones of
//!    that size first): the new handles are mapped in a scratch
//!    reservation and filled from the range with one `cuMemcpyDtoD` (as
//!    unpinning fills its new chunks, `moves.rs`); then the old chunks are unmapped (one
//!    call), the new ones mapped and made accessible, and the old handles
//!    pooled (host-located ones, from spill, go to their release list). A
//!    failure before the old chunks are unmapped changes nothing; one after
//!    maps the old chunks back (they still hold every byte);
//! 2. **through host memory** (no room): the range's bytes go to pageable
//!    host memory, the old chunks are unmapped and released, the new
//!    handles created in the memory they freed (the budget keeps the
//!    credit, [`super::budget::Budget::begin_keep`]), mapped, made accessible
//!    and filled back. A failure after a release re-creates chunks of the old
//!    sizes and copies the bytes back (as unpinning's `restore_released`).
//!    Host-located chunks take only the first way.
//!
//! The caller synchronizes the device first (the block layer, `ipc.rs`):
//! the copies see every write queued before the export, on every stream.
//! The driver's rules are unpinning's (`moves.rs`): `cuMemUnmap` takes whole
//! mappings and `cuMemMap`'s offset must be 0 (cuda.h), so the range is
//! whole chunks and every page of it is copied.

use super::budget::Charge;
use super::chunks::Chunk;
use super::moves::Move;
use super::observe::Owner;
use super::Physical;
use vmmalloc_device::{Call, Device, DeviceError, HostBuffer, PhysHandle};

/// The handle size, in pages, for a run of `pages` pages re-backed with
/// equal handles: the largest divisor of `pages` not above `max` (the
/// allocator's largest chunk), so that the fewest handles (and descriptors)
/// carry it without making handles larger than the allocator ever does.
pub(crate) fn equal_handle_pages(pages: u64, max: u64) -> u64 {
    let max = max.max(1);
    if pages <= max {
        return pages.max(1);
    }
    let mut best = 1;
    let mut d = 1;
    while d * d <= pages {
        if pages.is_multiple_of(d) {
            let e = pages / d;
            if d <= max {
                best = best.max(d);
            }
            if e <= max {
                best = best.max(e);
            }
        }
        d += 1;
    }
    best
}

/// With padding: `(handle pages, pad pages)` for a run of `pages` pages
/// extended at its end: the fewest handles not above `max` pages
/// (`ceil(pages / max)`), each as small as carries the run, so the padding
/// is under one page per handle.
pub(crate) fn padded_handle_pages(pages: u64, max: u64) -> (u64, u64) {
    let max = max.max(1);
    let n = pages.div_ceil(max).max(1);
    let s = pages.div_ceil(n);
    (s, n * s - pages)
}

impl Physical {
    /// Whether pages `[r0, r1)` of `seg` are whole chunks of `s` pages each.
    pub fn is_equal_run(&self, seg: u32, r0: u64, r1: u64, s: u64) -> bool {
        let t = self.table(seg);
        let mut p = r0;
        for (f, c) in t.chunks_within(r0, r1) {
            if f != p || c.pages != s {
                return false;
            }
            p = f + c.pages;
        }
        p == r1
    }

    /// Re-backs pages `[r0, r1)` of `seg` (whole chunks, all mapped and
    /// accessible) with handles of `s` pages each covering `[r0, r1 + pad)`
    /// (`s` divides `r1 + pad - r0`; the `pad` pages after the run are
    /// unmapped and become mapped free memory), at the same addresses, the
    /// bytes copied (see the module docs). With `pad` the second way
    /// (through host memory) is not taken: out of memory instead. On an
    /// error the range is as it was: the old chunks, or (after a release)
    /// chunks of the old sizes holding the same bytes.
    pub fn reback_equal<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        (r0, r1): (u64, u64),
        s: u64,
        pad: u64,
    ) -> Result<(), DeviceError> {
        let end = r1 + pad;
        debug_assert!(s > 0 && (end - r0).is_multiple_of(s));
        let olds: Vec<(u64, Chunk)> = self.table(seg).chunks_within(r0, r1).collect();
        debug_assert_eq!(
            olds.iter().map(|(_, c)| c.pages).sum::<u64>(),
            r1 - r0,
            "the range is whole chunks"
        );
        debug_assert!(pad == 0 || self.table(seg).mapped_count(r1, end) == 0);
        // The new handles' runs, as unpinning's move of one "chunk" covering
        // the range whose live runs are the equal handles.
        let mv = Move {
            seg,
            first: r0,
            chunk: Chunk {
                handle: olds[0].1.handle,
                pages: end - r0,
            },
            live: (r0..end).step_by(s as usize).map(|f| (f, s)).collect(),
            live_pages: end - r0,
        };
        let old_pages = r1 - r0;
        let no_room = |me: &Self| DeviceError::OutOfMemory {
            call: Call::Create,
            requested: (end - r0) * me.page(),
            free: 0,
            total: 0,
        };
        match self.room_handles(dev, &mv)? {
            Some(handles) => self.reback_beside(dev, &mv, old_pages, &olds, handles),
            None if pad > 0 || olds.iter().any(|(_, c)| self.is_host(c.handle)) => {
                Err(no_room(self))
            }
            None => {
                let saved = self.save_run(dev, &mv, old_pages)?;
                self.budget.begin_keep();
                let r = self.reback_in_place(dev, &mv, &olds, &saved);
                self.budget.end_keep();
                r
            }
        }
    }

    /// The first `old` pages of `mv`'s range, copied to a host buffer of the
    /// whole range (the rest zero). A device that holds no bytes (`sim`)
    /// still gets the call and refuses it.
    fn save_run<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        mv: &Move,
        old: u64,
    ) -> Result<HostBuffer, DeviceError> {
        let page = self.page();
        let mut buf = HostBuffer::heap(mv.live_pages * page).ok_or(DeviceError::OutOfMemory {
            call: Call::HostAlloc,
            requested: mv.live_pages * page,
            free: 0,
            total: 0,
        })?;
        let addr = self.page_addr(mv.seg, mv.first);
        match self.copy_from_device(dev, addr, &mut buf[..(old * page) as usize]) {
            Ok(()) | Err(DeviceError::Unsupported { .. }) => Ok(buf),
            Err(e) => Err(e),
        }
    }

    /// Fills `handles` (the runs of `mv`, one after another) with the first
    /// `old` pages of the range on the device: mapped in a scratch
    /// reservation, made accessible with one call, one `cuMemcpyDtoD`
    /// (which [`Device::copy_device`] waits for), unmapped, the reservation
    /// freed. On failure nothing stays mapped; the handles are the caller's.
    fn fill_beside<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        mv: &Move,
        old: u64,
        handles: &[PhysHandle],
    ) -> Result<(), DeviceError> {
        let page = self.page();
        let len = mv.live_pages * page;
        let scratch = self.raw_reserve(dev, Owner::Scratch, len, 0)?;
        let (mut mapped, mut count) = (0, 0);
        let mut result = Ok(());
        for (&(_, n), &h) in mv.live.iter().zip(handles) {
            if let Err(e) = self.raw_map(dev, Owner::Scratch, scratch + mapped, n * page, h) {
                result = Err(e);
                break;
            }
            mapped += n * page;
            count += 1;
        }
        if result.is_ok() {
            result = self.raw_set_access(dev, Owner::Scratch, scratch, len);
        }
        if result.is_ok() {
            let from = self.page_addr(mv.seg, mv.first);
            match self.copy_device(dev, scratch, from, old * page) {
                Ok(()) | Err(DeviceError::Unsupported { .. }) => {}
                Err(e) => result = Err(e),
            }
        }
        self.release_scratch(dev, (scratch, len), (mapped, count), &mv.live, "re-backing");
        result
    }

    /// The first way: the new handles are in hand.
    fn reback_beside<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        mv: &Move,
        old: u64,
        olds: &[(u64, Chunk)],
        handles: Vec<PhysHandle>,
    ) -> Result<(), DeviceError> {
        let pool_new = |me: &mut Self, hs: &[PhysHandle]| {
            for (&h, &(_, n)) in hs.iter().zip(&mv.live) {
                me.give_back(h, n);
            }
        };
        if let Err(e) = self.fill_beside(dev, mv, old, &handles) {
            pool_new(self, &handles);
            return Err(e);
        }
        if let Err(e) = self.unmap_olds(dev, mv.seg, olds) {
            pool_new(self, &handles);
            return Err(e);
        }
        if let Err(e) = self.map_live(dev, mv, &handles, None) {
            pool_new(self, &handles);
            self.map_olds_back(dev, mv.seg, olds);
            return Err(e);
        }
        for &(f, c) in olds {
            self.record_unmapped(mv.seg, f);
            self.give_back(c.handle, c.pages);
        }
        self.record_new(mv, &handles);
        Ok(())
    }

    /// The second way, while the budget keeps credits: `saved` holds the
    /// range's bytes.
    fn reback_in_place<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        mv: &Move,
        olds: &[(u64, Chunk)],
        saved: &HostBuffer,
    ) -> Result<(), DeviceError> {
        self.unmap_olds(dev, mv.seg, olds)?;
        for (j, &(_, c)) in olds.iter().enumerate() {
            if let Err(e) = self.raw_release(dev, c.handle, c.pages) {
                self.restore_olds(dev, mv, olds, j, saved);
                return Err(e);
            }
        }
        let mut handles = Vec::with_capacity(mv.live.len());
        let mut fail = None;
        for &(_, n) in &mv.live {
            // In the memory the old chunks' release freed: a replacement.
            match self.raw_create(dev, n, Charge::Replace) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    fail = Some(e);
                    break;
                }
            }
        }
        if fail.is_none() {
            match self.map_live(dev, mv, &handles, Some(saved)) {
                Ok(()) => {
                    for &(f, _) in olds {
                        self.record_unmapped(mv.seg, f);
                    }
                    self.record_new(mv, &handles);
                    return Ok(());
                }
                Err(e) => fail = Some(e),
            }
        }
        for (h, &(_, n)) in handles.into_iter().zip(&mv.live) {
            let _ = self.raw_release(dev, h, n);
        }
        self.restore_olds(dev, mv, olds, olds.len(), saved);
        Err(fail.expect("set on every failing path"))
    }

    /// `cuMemUnmap` of the old chunks (adjacent) in one call.
    fn unmap_olds<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        olds: &[(u64, Chunk)],
    ) -> Result<(), DeviceError> {
        let addr = self.page_addr(seg, olds[0].0);
        let len = olds.iter().map(|(_, c)| c.pages).sum::<u64>() * self.page();
        self.raw_unmap(dev, Owner::Segment(seg), addr, len, olds.len() as u32)
    }

    /// Maps the old chunks (still holding their bytes) where they were; a
    /// chunk that cannot be mapped and made accessible is listed unready.
    fn map_olds_back<D: Device + ?Sized>(&mut self, dev: &D, seg: u32, olds: &[(u64, Chunk)]) {
        let owner = Owner::Segment(seg);
        for &(f, c) in olds {
            let addr = self.page_addr(seg, f);
            let len = c.pages * self.page();
            let back = self
                .raw_map(dev, owner, addr, len, c.handle)
                .and_then(|()| self.raw_set_access(dev, owner, addr, len));
            if back.is_err() {
                self.mark_unready(seg, f);
            }
        }
    }

    /// After the first `released` old chunks were released (the rest are
    /// unmapped, their handles kept): chunks of the old sizes where they
    /// were (new device handles for the released ones, else host memory as
    /// spill makes it), with `saved` copied back. A chunk for which no
    /// memory is left is recorded unmapped (its bytes are lost; logged).
    fn restore_olds<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        mv: &Move,
        olds: &[(u64, Chunk)],
        released: usize,
        saved: &HostBuffer,
    ) {
        let page = self.page();
        let mut kept = Vec::with_capacity(olds.len());
        for (j, &(f, c)) in olds.iter().enumerate() {
            if j >= released {
                kept.push((f, c));
                continue;
            }
            let h = match self.raw_create(dev, c.pages, Charge::Replace) {
                Ok(h) => Some(h),
                Err(_) => self.raw_create_on_host(dev, c.pages).ok(),
            };
            match h {
                Some(h) => {
                    self.record_swap(mv.seg, f, h);
                    kept.push((
                        f,
                        Chunk {
                            handle: h,
                            pages: c.pages,
                        },
                    ));
                }
                None => {
                    eprintln!(
                        "vmmalloc: re-backing for IPC failed and no memory was left to put {} MiB \
                         back at {:#x}",
                        (c.pages * page) >> 20,
                        self.page_addr(mv.seg, f)
                    );
                    self.record_unmapped(mv.seg, f);
                }
            }
        }
        self.map_olds_back(dev, mv.seg, &kept);
        let base = self.table(mv.seg).base();
        for &(f, c) in &kept {
            let at = ((f - mv.first) * page) as usize;
            let n = (c.pages * page) as usize;
            let _ = self.copy_to_device(dev, base + f * page, &saved[at..at + n]);
        }
    }

    /// Records the new handles of `mv` mapped at its runs.
    fn record_new(&mut self, mv: &Move, handles: &[PhysHandle]) {
        for (&(f, n), &h) in mv.live.iter().zip(handles) {
            self.record_mapped(
                mv.seg,
                f,
                Chunk {
                    handle: h,
                    pages: n,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{equal_handle_pages, padded_handle_pages};

    #[test]
    fn the_handle_size_is_the_largest_divisor_within_the_largest_chunk() {
        assert_eq!(equal_handle_pages(10, 512), 10, "one handle when it fits");
        assert_eq!(equal_handle_pages(1024, 512), 512);
        assert_eq!(equal_handle_pages(1034, 512), 94, "1034 = 2 * 11 * 47");
        assert_eq!(equal_handle_pages(1031, 512), 1, "a prime: one page each");
        assert_eq!(equal_handle_pages(4096, 64), 64);
        assert_eq!(equal_handle_pages(0, 64), 1);
        assert_eq!(
            padded_handle_pages(4099, 512),
            (456, 5),
            "9 handles, 10 MiB padding"
        );
        assert_eq!(padded_handle_pages(1024, 512), (512, 0));
        assert_eq!(padded_handle_pages(10, 512), (10, 0));
    }
}
