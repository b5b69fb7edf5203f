//! The driver calls: one function per call kind, each the only place in the
//! expandable allocator where that call is made. Each makes the call and
//! hands one [`PhysEvent`] to the observers (`observe.rs`), which count it.
//!
//! - Memory calls (`cuMemAddressReserve`, `cuMemAddressFree`, `cuMemCreate`
//!   on the device or the host, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`,
//!   `cuMemRelease`) are private to the physical layer (`physical/`): the
//!   rest of the allocator asks the layer for pages instead. A create is
//!   charged to the budget first and credited back when it fails; a
//!   release of device memory credits it (`budget.rs`).
//! - The block layer's narrow view ([`Physical::sync_stream`] and the
//!   rest): streams, events, copies and the memory query, which the block
//!   layer needs for stream safety, pausing and unpinning. They touch no
//!   handle, and are counted here all the same.

use super::budget::Charge;
use super::observe::{Owner, PhysEvent};
use super::Physical;
use vmmalloc_device::{Call, Device, DeviceResult, Event, MemInfo, PhysHandle, Stream};

impl Physical {
    /// Delivers `ev`, marked with `r`'s outcome, to the observers; returns `r`.
    #[inline]
    fn emit<T>(&mut self, ev: PhysEvent, r: DeviceResult<T>) -> DeviceResult<T> {
        self.observers.emit_result(ev, r)
    }

    /// The device synchronize before a registered run is joined or split
    /// (`follow.rs`): nothing in flight may still use the registration that
    /// goes. Never during a graph capture, which it would invalidate: every
    /// stream served and the legacy default stream are asked first, as
    /// unpinning asks (`unpin.rs`; a stream whose state cannot be read
    /// counts as capturing), and then the change goes unsynchronized
    /// (counted: captured work has not run yet).
    fn follow_sync<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        let capturing = self
            .served_streams
            .iter()
            .chain(std::iter::once(&Stream::DEFAULT))
            .any(|&s| dev.is_capturing(s).unwrap_or(true));
        if capturing {
            self.note_follow_sync(false);
            return Ok(());
        }
        self.observers.sync_device(dev)?;
        self.note_follow_sync(true);
        Ok(())
    }

    // --- Memory calls (physical layer only) ----------------------------------

    /// `cuMemAddressReserve` of `size` bytes aligned to `align` for `owner`.
    pub(super) fn raw_reserve<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: Owner,
        size: u64,
        align: u64,
    ) -> DeviceResult<u64> {
        let r = dev.reserve(size, align);
        let addr = *r.as_ref().unwrap_or(&0);
        self.emit(PhysEvent::new(Call::Reserve, owner).at(addr, size), r)
    }

    /// `cuMemAddressFree` of the reservation `[addr, addr + size)`.
    pub(super) fn raw_free_reservation<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: Owner,
        addr: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let r = dev.free_reservation(addr, size);
        self.emit(PhysEvent::new(Call::AddressFree, owner).at(addr, size), r)
    }

    /// `cuMemCreate` of `pages` pages of device memory, charged to the
    /// budget first (`kind`, `budget.rs`). A refused charge makes no call and
    /// returns the out-of-memory error; a failed create credits the charge
    /// back.
    pub(super) fn raw_create<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        pages: u64,
        kind: Charge,
    ) -> DeviceResult<PhysHandle> {
        self.budget.charge(pages, self.page, kind)?;
        let bytes = pages * self.page;
        let r = dev.create(bytes);
        if r.is_err() {
            self.budget.credit(pages);
        }
        let mut ev = PhysEvent::new(Call::Create, Owner::Handle).at(0, bytes);
        if let Ok(h) = r {
            ev = ev.of(h);
        }
        self.emit(ev, r)
    }

    /// `cuMemCreate` of `pages` pages located in host memory (spill): not
    /// device memory, so not charged; the handle is noted host-located.
    pub(super) fn raw_create_on_host<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        pages: u64,
    ) -> DeviceResult<PhysHandle> {
        let bytes = pages * self.page;
        let r = dev.create_on_host(bytes);
        let mut ev = PhysEvent::new(Call::Create, Owner::Handle).at(0, bytes);
        ev.host = true;
        if let Ok(h) = r {
            self.spill.host.insert(h.0);
            ev = ev.of(h);
        }
        self.emit(ev, r)
    }

    /// `cuMemMap` of handle `h` (`bytes` long) at `addr` for `owner`.
    pub(super) fn raw_map<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: Owner,
        addr: u64,
        bytes: u64,
        h: PhysHandle,
    ) -> DeviceResult<()> {
        let r = dev.map(addr, bytes, h);
        let mut ev = PhysEvent::new(Call::Map, owner).at(addr, bytes).of(h);
        ev.host = self.is_host(h);
        self.emit(ev, r)
    }

    /// `cuMemSetAccess` (read-write for this device) on `[addr, addr + bytes)`;
    /// first a device synchronize when following segments joins this range
    /// to registered runs (`follow.rs`: nothing in flight may use the old
    /// registration when it is removed).
    pub(super) fn raw_set_access<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: Owner,
        addr: u64,
        bytes: u64,
    ) -> DeviceResult<()> {
        if self.follow_joins(owner, addr, bytes) {
            self.follow_sync(dev)?;
        }
        let r = dev.set_access(addr, bytes);
        self.emit(PhysEvent::new(Call::SetAccess, owner).at(addr, bytes), r)
    }

    /// `cuMemUnmap` of `[addr, addr + bytes)`, which holds `handles` whole
    /// mappings; announced to the observers first (`Observer::before`), and
    /// a device synchronize before that when following segments leaves part
    /// of a registered run mapped (`follow.rs`).
    pub(super) fn raw_unmap<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        owner: Owner,
        addr: u64,
        bytes: u64,
        handles: u32,
    ) -> DeviceResult<()> {
        let mut ev = PhysEvent::new(Call::Unmap, owner).at(addr, bytes);
        ev.handles = handles;
        if self.follow_splits(owner, addr, bytes) {
            self.follow_sync(dev)?;
        }
        self.observers.announce(&ev);
        let r = dev.unmap(addr, bytes);
        self.emit(ev, r)
    }

    /// `cuMemRelease` of handle `h` of `pages` pages (0 when unknown: only
    /// for host handles, which are not charged). A released device handle
    /// is credited to the budget.
    pub(super) fn raw_release<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        h: PhysHandle,
        pages: u64,
    ) -> DeviceResult<()> {
        let host = self.is_host(h);
        debug_assert!(
            host || pages > 0,
            "a device handle's release needs its size"
        );
        let r = dev.release(h);
        if r.is_ok() && !host {
            self.budget.credit(pages);
        }
        let mut ev = PhysEvent::new(Call::Release, Owner::Handle)
            .at(0, pages * self.page)
            .of(h);
        ev.host = host;
        self.emit(ev, r)
    }

    // --- The block layer's narrow view --------------------------------------

    // Streams and events: the narrow view shared with the caching replica
    // (`observe.rs`, `Observers`), where the calls are made and counted.

    /// `cuStreamSynchronize`.
    pub fn sync_stream<D: Device + ?Sized>(&mut self, dev: &D, s: Stream) -> DeviceResult<()> {
        self.observers.sync_stream(dev, s)
    }

    /// `cuCtxSynchronize` (device-wide).
    pub fn sync_device<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        self.observers.sync_device(dev)
    }

    /// `cuEventCreate`.
    pub fn create_event<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<Event> {
        self.observers.create_event(dev)
    }

    /// `cuEventRecord` of `ev` on `s`.
    pub fn record_event<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ev: Event,
        s: Stream,
    ) -> DeviceResult<()> {
        self.observers.record_event(dev, ev, s)
    }

    /// `cuEventQuery`: whether `ev` completed.
    pub fn query_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<bool> {
        self.observers.query_event(dev, ev)
    }

    /// `cuEventSynchronize`.
    pub fn sync_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<()> {
        self.observers.sync_event(dev, ev)
    }

    /// `cuEventDestroy`.
    pub fn destroy_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<()> {
        self.observers.destroy_event(dev, ev)
    }

    /// `cuMemcpyDtoH` of `dst.len()` bytes from `src`.
    pub fn copy_from_device<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        src: u64,
        dst: &mut [u8],
    ) -> DeviceResult<()> {
        let len = dst.len() as u64;
        let r = dev.copy_from_device(src, dst);
        self.emit(PhysEvent::new(Call::CopyDtoH, Owner::Block).at(src, len), r)
    }

    /// `cuMemcpyHtoD` of `src` to `dst`.
    pub fn copy_to_device<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        dst: u64,
        src: &[u8],
    ) -> DeviceResult<()> {
        let r = dev.copy_to_device(dst, src);
        let ev = PhysEvent::new(Call::CopyHtoD, Owner::Block).at(dst, src.len() as u64);
        self.emit(ev, r)
    }

    /// `cuMemcpyDtoD` of `len` bytes from `src` to `dst` (waited for).
    pub fn copy_device<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        dst: u64,
        src: u64,
        len: u64,
    ) -> DeviceResult<()> {
        let r = dev.copy_device(dst, src, len);
        self.emit(PhysEvent::new(Call::CopyDtoD, Owner::Block).at(dst, len), r)
    }

    /// `cuMemGetInfo`.
    pub fn mem_info<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<MemInfo> {
        self.observers.mem_info(dev)
    }
}
