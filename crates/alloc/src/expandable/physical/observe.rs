//! Events and observers: every driver call the physical layer makes is one
//! [`PhysEvent`] handed to its observers, so that whatever must follow "a
//! handle was created / mapped / unmapped / released" attaches here instead
//! of at each call site (STYLE.md, "Count at the primitive, once": mimalloc
//! counts OS calls inside `os.c`, one counter per primitive).
//!
//! - [`CallCounter`] (built in, always first): the driver calls per kind,
//!   `num_device_alloc` / `num_device_free`, and the handles and device
//!   bytes alive — the one counting site of the allocator
//!   ([`CallCounter::observe`]). `validate()` checks its totals against the
//!   tables (`physical/mod.rs`, [`super::Physical::check_observed`]).
//! - Further observers ([`Observer`], attached with
//!   [`super::Physical::attach`]): the history ring of PyTorch trace entries,
//!   an NCCL registrar, a shared budget's accounting (DESIGN.md, "Owners and
//!   observers").
//!
//! Cost: an event is a small `Copy` struct built on the stack and passed by
//! reference; delivering it is one direct call to the counter plus one
//! virtual call per attached observer — no allocation. Events happen only
//! where the driver is called, never on a cache hit.

use std::fmt;
use vmmalloc_device::{Call, Device, DeviceResult, Event, MemInfo, PhysHandle, Stream};

/// Who a memory call is made for: the table (or the part of the physical
/// layer) that owns the address or the handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Owner {
    /// A segment's chunk table (slot index).
    Segment(u32),
    /// A growable region (its base address).
    Region(u64),
    /// The address-space arenas (reserve and free of a whole arena).
    Arena,
    /// Unpinning's scratch reservation (`moves.rs`), mapped only while live
    /// bytes are copied.
    Scratch,
    /// A handle not (yet, or any more) in a table: created for a plan,
    /// released from the pool or the host release list.
    Handle,
    /// The block layer's narrow view: streams, events, copies, memory info.
    Block,
}

impl Owner {
    /// Whether the owner is a table (a segment or a region), whose mapped
    /// pages the layer counts.
    #[inline]
    pub fn is_table(self) -> bool {
        matches!(self, Owner::Segment(_) | Owner::Region(_))
    }
}

/// One driver call the physical layer made, after it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PhysEvent {
    /// The call (`cuMemCreate`, `cuMemMap`, ...).
    pub call: Call,
    /// Who it was made for.
    pub owner: Owner,
    /// First byte (mappings, reservations); 0 where the call has no address.
    pub addr: u64,
    /// Bytes it covered (a create's or release's handle size; a mapping's,
    /// an unmap's or a reservation's length); 0 where it has none.
    pub bytes: u64,
    /// Handles it covered (an unmap of a run covers every chunk in it; 1
    /// for a create, map or release; 0 for calls without handles).
    pub handles: u32,
    /// The handle, for a create, map or release.
    pub handle: Option<PhysHandle>,
    /// Whether the memory is host-located (spill): not device memory.
    pub host: bool,
    /// Whether the call succeeded.
    pub ok: bool,
}

impl PhysEvent {
    /// An event of `call` for `owner`, nothing else known yet (not ok).
    #[inline]
    pub fn new(call: Call, owner: Owner) -> PhysEvent {
        PhysEvent {
            call,
            owner,
            addr: 0,
            bytes: 0,
            handles: 0,
            handle: None,
            host: false,
            ok: false,
        }
    }

    /// The same event at `addr` covering `bytes`.
    #[inline]
    pub fn at(self, addr: u64, bytes: u64) -> PhysEvent {
        PhysEvent {
            addr,
            bytes,
            ..self
        }
    }

    /// The same event about handle `h` (one handle).
    #[inline]
    pub fn of(self, h: PhysHandle) -> PhysEvent {
        PhysEvent {
            handle: Some(h),
            handles: 1,
            ..self
        }
    }
}

/// Something that follows the physical layer's driver calls. Called once
/// per call, after it returned, under the allocator's lock: keep it short
/// and never call back into the allocator.
pub(crate) trait Observer: Send + Sync + fmt::Debug {
    /// Sees one call.
    fn observe(&mut self, ev: &PhysEvent);

    /// Sees an unmap about to be made (the event not yet marked ok): whoever
    /// must act while the memory is still mapped (NCCL deregistration,
    /// `follow.rs`) acts here. Nothing by default.
    fn before(&mut self, _ev: &PhysEvent) {}
}

/// The driver-call counter: the one place where the expandable allocator
/// counts its driver calls and the handles they leave alive.
///
/// Invariants (checked by `validate()`): `handles_alive` equals the mapped,
/// pooled and to-be-released handles of the tables; `device_bytes_alive`
/// equals the device pages mapped and pooled, times the page size;
/// `table_bytes_mapped` and `table_handles_mapped` equal the tables' pages
/// and chunks mapped.
#[derive(Debug, Default, Clone)]
pub(crate) struct CallCounter {
    /// Calls per kind, failed ones included (the driver charges those too).
    pub calls: vmmalloc_device::CallCounts,
    /// Successful creates of device (not host) memory: PyTorch's
    /// `num_device_alloc`.
    pub device_allocs: u64,
    /// Successful releases: PyTorch's `num_device_free`.
    pub device_frees: u64,
    /// Handles created and not yet released (device and host).
    pub handles_alive: u64,
    /// Bytes of device (not host) handles created and not yet released.
    pub device_bytes_alive: u64,
    /// Bytes mapped in tables (segments and regions; not unpinning's
    /// scratch): successful maps less successful unmaps.
    pub table_bytes_mapped: u64,
    /// Handles mapped in tables, the same way (an unmap of a run covers
    /// every chunk in it).
    pub table_handles_mapped: u64,
}

impl Observer for CallCounter {
    #[inline]
    fn observe(&mut self, ev: &PhysEvent) {
        self.calls.add(ev.call);
        if !ev.ok {
            return;
        }
        match ev.call {
            Call::Create => {
                self.handles_alive += 1;
                if !ev.host {
                    self.device_allocs += 1;
                    self.device_bytes_alive += ev.bytes;
                }
            }
            Call::Release => {
                self.device_frees += 1;
                self.handles_alive -= 1;
                if !ev.host {
                    self.device_bytes_alive -= ev.bytes;
                }
            }
            Call::Map if ev.owner.is_table() => {
                self.table_bytes_mapped += ev.bytes;
                self.table_handles_mapped += u64::from(ev.handles);
            }
            Call::Unmap if ev.owner.is_table() => {
                self.table_bytes_mapped -= ev.bytes;
                self.table_handles_mapped -= u64::from(ev.handles);
            }
            _ => {}
        }
    }
}

/// The observers of one physical layer: the counter, then the attached ones
/// in attachment order.
#[derive(Debug, Default)]
pub(crate) struct Observers {
    /// The built-in counter (read by `stats()` and `validate()`).
    pub counter: CallCounter,
    /// Observers attached by later features.
    pub attached: Vec<Box<dyn Observer>>,
}

impl Observers {
    /// Delivers `ev` to every observer.
    #[inline]
    pub fn emit(&mut self, ev: &PhysEvent) {
        self.counter.observe(ev);
        for o in &mut self.attached {
            o.observe(ev);
        }
    }

    /// Announces `ev`, a call about to be made, to the attached observers
    /// ([`Observer::before`]; the counter counts calls once they returned).
    #[inline]
    pub fn announce(&mut self, ev: &PhysEvent) {
        for o in &mut self.attached {
            o.before(ev);
        }
    }

    /// Delivers `ev`, marked with `r`'s outcome (failed calls count too),
    /// to every observer; returns `r`.
    #[inline]
    pub fn emit_result<T>(&mut self, ev: PhysEvent, r: DeviceResult<T>) -> DeviceResult<T> {
        self.emit(&PhysEvent {
            ok: r.is_ok(),
            ..ev
        });
        r
    }

    /// Makes a call of the block layer's narrow view (streams, events, the
    /// memory query: no handle) and delivers its event, owned by
    /// [`Owner::Block`].
    #[inline]
    fn block_call<T>(&mut self, call: Call, r: DeviceResult<T>) -> DeviceResult<T> {
        self.emit_result(PhysEvent::new(call, Owner::Block), r)
    }

    // --- The block layer's narrow view, one definition for every policy ----
    // (expandable's physical layer and the caching replica's `Calls`).

    /// `cuStreamSynchronize`.
    pub fn sync_stream<D: Device + ?Sized>(&mut self, dev: &D, s: Stream) -> DeviceResult<()> {
        self.block_call(Call::StreamSync, dev.synchronize_stream(s))
    }

    /// `cuCtxSynchronize` (device-wide).
    pub fn sync_device<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<()> {
        self.block_call(Call::DeviceSync, dev.synchronize())
    }

    /// `cuEventCreate`.
    pub fn create_event<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<Event> {
        self.block_call(Call::EventCreate, dev.create_event())
    }

    /// `cuEventRecord` of `ev` on `s`.
    pub fn record_event<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ev: Event,
        s: Stream,
    ) -> DeviceResult<()> {
        self.block_call(Call::EventRecord, dev.record_event(ev, s))
    }

    /// `cuEventQuery`: whether `ev` completed.
    pub fn query_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<bool> {
        self.block_call(Call::EventQuery, dev.query_event(ev))
    }

    /// `cuEventSynchronize`.
    pub fn sync_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<()> {
        self.block_call(Call::EventSync, dev.synchronize_event(ev))
    }

    /// `cuEventDestroy`.
    pub fn destroy_event<D: Device + ?Sized>(&mut self, dev: &D, ev: Event) -> DeviceResult<()> {
        self.block_call(Call::EventDestroy, dev.destroy_event(ev))
    }

    /// `cuMemGetInfo`.
    pub fn mem_info<D: Device + ?Sized>(&mut self, dev: &D) -> DeviceResult<MemInfo> {
        self.block_call(Call::MemInfo, dev.mem_info())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_counts_every_call_and_tracks_what_is_alive() {
        let mut c = CallCounter::default();
        let create = PhysEvent::new(Call::Create, Owner::Handle)
            .at(0, 4 << 20)
            .of(PhysHandle(7));
        c.observe(&PhysEvent { ok: true, ..create });
        c.observe(&create); // a failed create: counted, nothing alive
        c.observe(&PhysEvent {
            ok: true,
            host: true,
            ..create
        });
        assert_eq!(c.calls.get(Call::Create), 3);
        assert_eq!((c.device_allocs, c.handles_alive), (1, 2));
        assert_eq!(c.device_bytes_alive, 4 << 20);
        let release = PhysEvent::new(Call::Release, Owner::Handle)
            .at(0, 4 << 20)
            .of(PhysHandle(7));
        c.observe(&PhysEvent {
            ok: true,
            ..release
        });
        assert_eq!(
            (c.device_frees, c.handles_alive, c.device_bytes_alive),
            (1, 1, 0)
        );
    }

    /// An attached observer sees every event, in order, after the counter.
    #[test]
    fn attached_observers_see_every_event() {
        #[derive(Debug, Default)]
        struct Log(std::sync::Arc<std::sync::Mutex<Vec<(Call, bool)>>>);
        impl Observer for Log {
            fn observe(&mut self, ev: &PhysEvent) {
                self.0.lock().unwrap().push((ev.call, ev.ok));
            }
        }
        let seen = std::sync::Arc::default();
        let mut obs = Observers::default();
        obs.attached
            .push(Box::new(Log(std::sync::Arc::clone(&seen))));
        let map = PhysEvent::new(Call::Map, Owner::Segment(0)).at(1 << 30, 2 << 20);
        obs.emit(&PhysEvent { ok: true, ..map });
        obs.emit(&PhysEvent::new(Call::Unmap, Owner::Segment(0)));
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(Call::Map, true), (Call::Unmap, false)]
        );
        assert_eq!(obs.counter.calls.total(), 2);
    }
}
