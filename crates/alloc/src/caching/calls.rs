//! The caching replica's driver calls: one method per call kind, each the
//! only place in `caching/` where that call is made. Each makes the call and
//! hands one [`PhysEvent`] to the observers expandable's physical layer uses
//! (`expandable/physical/observe.rs`), the [`CallCounter`] first, which
//! counts it — failed calls included, as the driver charges them and the
//! `sim` device counts them (STYLE.md, "Count at the primitive, once").
//!
//! Owners, as the counter reads them: an expandable segment's reservation
//! and its page mappings are `Owner::Segment(id)` (its page table, so the
//! counter's mapped figures follow the pages); a page's create and release
//! are `Owner::Handle`; plain segments (`cuMemAlloc` / `cuMemFree`), streams,
//! events and the memory query are `Owner::Block`, the block layer's view.
//! Streams, events and the memory query are made through
//! [`Calls::observers`] (`Observers::sync_stream` and the rest), the one
//! definition expandable's physical layer uses too.

use crate::expandable::observe::{CallCounter, Observers, Owner, PhysEvent};
use vmmalloc_device::{Call, CallCounts, Device, DeviceError, DeviceResult, PhysHandle};

/// The driver calls made, counted once each as they are made, and the
/// physical handles whose release failed (retried on teardown).
///
/// Invariant (checked by `validate()`): the counter's `handles_alive` and
/// `device_bytes_alive` are the pages mapped in expandable segments plus
/// the orphans.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    /// The observers, the counter first. Streams, events and the memory
    /// query are made through them directly (`Observers::sync_stream` and
    /// the rest: the narrow view expandable's physical layer uses too).
    pub observers: Observers,
    /// Handles (and their bytes) whose `cuMemRelease` failed.
    pub orphans: Vec<(PhysHandle, u64)>,
}

impl Calls {
    /// Delivers `ev`, marked with `r`'s outcome, to the observers; returns `r`.
    #[inline]
    fn emit<T>(&mut self, ev: PhysEvent, r: DeviceResult<T>) -> DeviceResult<T> {
        self.observers.emit_result(ev, r)
    }

    /// The counter: calls per kind and the handles they left alive.
    pub fn counter(&self) -> &CallCounter {
        &self.observers.counter
    }

    /// Calls per kind, failed ones included.
    pub fn counts(&self) -> CallCounts {
        self.observers.counter.calls
    }

    /// `cuMemAddressReserve` of segment `seg`'s range.
    pub fn reserve<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        size: u64,
        align: u64,
    ) -> DeviceResult<u64> {
        let r = dev.reserve(size, align);
        let addr = *r.as_ref().unwrap_or(&0);
        let ev = PhysEvent::new(Call::Reserve, Owner::Segment(seg)).at(addr, size);
        self.emit(ev, r)
    }

    /// `cuMemAddressFree` of segment `seg`'s range `[addr, addr + size)`.
    pub fn free_reservation<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        addr: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let r = dev.free_reservation(addr, size);
        let ev = PhysEvent::new(Call::AddressFree, Owner::Segment(seg)).at(addr, size);
        self.emit(ev, r)
    }

    /// `cuMemCreate` of one page of `bytes`.
    pub fn create<D: Device + ?Sized>(&mut self, dev: &D, bytes: u64) -> DeviceResult<PhysHandle> {
        let r = dev.create(bytes);
        let mut ev = PhysEvent::new(Call::Create, Owner::Handle).at(0, bytes);
        if let Ok(h) = r {
            ev = ev.of(h);
        }
        self.emit(ev, r)
    }

    /// `cuMemRelease` of page `h` (`bytes` long); a failure keeps it as an
    /// orphan, released again on teardown.
    pub fn release<D: Device + ?Sized>(&mut self, dev: &D, h: PhysHandle, bytes: u64) {
        let r = dev.release(h);
        let ev = PhysEvent::new(Call::Release, Owner::Handle)
            .at(0, bytes)
            .of(h);
        if let Err(e) = self.emit(ev, r) {
            eprintln!("vmmalloc: releasing a physical handle failed ({e}); retrying on teardown");
            self.orphans.push((h, bytes));
        }
    }

    /// `cuMemMap` of page `h` (`bytes` long) at `addr` in segment `seg`.
    pub fn map<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        addr: u64,
        bytes: u64,
        h: PhysHandle,
    ) -> DeviceResult<()> {
        let r = dev.map(addr, bytes, h);
        let ev = PhysEvent::new(Call::Map, Owner::Segment(seg))
            .at(addr, bytes)
            .of(h);
        self.emit(ev, r)
    }

    /// `cuMemSetAccess` on `[addr, addr + bytes)` of segment `seg`.
    pub fn set_access<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        addr: u64,
        bytes: u64,
    ) -> DeviceResult<()> {
        let r = dev.set_access(addr, bytes);
        let ev = PhysEvent::new(Call::SetAccess, Owner::Segment(seg)).at(addr, bytes);
        self.emit(ev, r)
    }

    /// `cuMemUnmap` of one page (`bytes` long) at `addr` in segment `seg`.
    pub fn unmap<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        addr: u64,
        bytes: u64,
    ) -> DeviceResult<()> {
        let r = dev.unmap(addr, bytes);
        let mut ev = PhysEvent::new(Call::Unmap, Owner::Segment(seg)).at(addr, bytes);
        ev.handles = 1;
        self.emit(ev, r)
    }

    /// `cuMemAlloc` of a plain segment of `size` bytes.
    pub fn alloc<D: Device + ?Sized>(&mut self, dev: &D, size: u64) -> DeviceResult<u64> {
        let r = dev.alloc(size);
        let addr = *r.as_ref().unwrap_or(&0);
        self.emit(PhysEvent::new(Call::Alloc, Owner::Block).at(addr, size), r)
    }

    /// `cuMemFree` of the plain segment at `ptr` (`size` bytes).
    pub fn free<D: Device + ?Sized>(&mut self, dev: &D, ptr: u64, size: u64) -> DeviceResult<()> {
        let r = dev.free(ptr);
        self.emit(PhysEvent::new(Call::Free, Owner::Block).at(ptr, size), r)
    }

    /// Logs a failure during a rollback.
    pub fn note_failure(&mut self, e: &DeviceError) {
        eprintln!("vmmalloc: a driver call failed while rolling back: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::{CachingConfig, DeviceCachingAllocator};
    use crate::Allocator;
    use std::sync::Arc;
    use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
    use vmmalloc_device::sim::SimDevice;
    use vmmalloc_device::{Stream, GIB, MIB};

    /// A workload that makes every kind of call both modes make: plain or
    /// expandable segments grown and shrunk, events recorded, queried and
    /// waited for, the memory query of `set_memory_fraction`.
    fn workload<D: Device>(a: &DeviceCachingAllocator<D>, s2: Stream) {
        let s0 = Stream::DEFAULT;
        let _ = a.set_memory_fraction(0.9);
        let x = a.malloc(50 * MIB, s0);
        let y = a.malloc(1000, s0);
        if let Ok(y) = &y {
            let _ = a.record_stream(y.ptr, s2);
        }
        for p in [x, y].into_iter().flatten() {
            let _ = a.free(p.ptr);
        }
        let _ = a.malloc(3 * MIB, s0).map(|z| a.free(z.ptr));
        let _ = a.empty_cache();
        let _ = a.malloc(70 * MIB, s0).map(|z| a.free(z.ptr));
        let _ = a.empty_cache();
    }

    /// Counting at the primitive: whichever call fails (each kind, each
    /// time it is made), the replica's counts equal the calls that reached
    /// the device, failed ones included, and `validate()` (which checks the
    /// counter's live handles against the segments' pages) passes.
    #[test]
    fn counts_equal_the_calls_made_whatever_fails() {
        for expandable in [false, true] {
            let clean = Arc::new(FaultInjecting::with_plan(
                SimDevice::with_capacity(GIB),
                FaultPlan::None,
            ));
            let s2 = clean.create_stream().unwrap();
            let a = DeviceCachingAllocator::with_mode(
                clean.clone(),
                CachingConfig::default(),
                expandable,
            )
            .unwrap();
            workload(&a, s2);
            let kinds: Vec<(Call, u64)> = Call::ALL
                .iter()
                .map(|&c| (c, clean.hook().seen(c)))
                .filter(|&(c, n)| n > 0 && c != Call::StreamCreate)
                .collect();
            assert!(kinds.len() >= 6, "{kinds:?}");
            let mut runs = 0;
            for (call, times) in kinds {
                for n in 1..=times {
                    let plan = FaultPlan::Nth {
                        call,
                        n,
                        kind: FaultKind::Driver(999),
                    };
                    let dev = Arc::new(FaultInjecting::with_plan(
                        SimDevice::with_capacity(GIB),
                        FaultPlan::None,
                    ));
                    let s2 = dev.create_stream().unwrap();
                    dev.hook().set_plan(plan);
                    let a = DeviceCachingAllocator::with_mode(
                        dev.clone(),
                        CachingConfig::default(),
                        expandable,
                    )
                    .unwrap();
                    workload(&a, s2);
                    let seen = dev.hook().seen(call);
                    assert!(seen >= n, "{call} #{n} not reached");
                    let mut made = CallCounts::default();
                    for c in Call::ALL {
                        made.0[c.index()] = dev.hook().seen(c);
                    }
                    made.0[Call::StreamCreate.index()] = 0;
                    assert_eq!(a.stats().driver_calls, made, "{call} #{n} failed");
                    a.validate()
                        .unwrap_or_else(|e| panic!("{call} #{n} failed: {e}"));
                    runs += 1;
                }
            }
            assert!(runs >= 10, "{runs}");
        }
    }
}
