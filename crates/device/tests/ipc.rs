//! The device layer's IPC consumer (`vmmalloc_device::ipc`): a mapped
//! import of exported handles sees the producer's bytes, a failed step is
//! rolled back leaving nothing behind, closing waits for the stream named
//! and tries every step, and a dropped import is closed.
//!
//! `sim` exports and imports within one device (its descriptors are
//! numbers, not open files); `host` exports real memfd descriptors that
//! another device imports.

use std::os::fd::{FromRawFd, OwnedFd};
use vmmalloc_device::adaptors::{CallHook, FaultInjecting, FaultKind, FaultPlan, Hooked};
use vmmalloc_device::host::HostDevice;
use vmmalloc_device::ipc::{CloseFailure, ImportStep, MappedImport};
use vmmalloc_device::sim::{SimConfig, SimDevice};
use vmmalloc_device::{
    Call, Device, DeviceError, DeviceResult, Introspect, PhysHandle, Rule, Stream, GIB, MIB,
};

const G: u64 = 2 * MIB;

fn sim() -> SimDevice {
    SimDevice::new(SimConfig::with_capacity(GIB))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 10) as u8)
        .collect()
}

/// A producer's allocation: chunks of `sizes` mapped in order and
/// accessible, and one exported descriptor per chunk.
struct Produced {
    va: u64,
    len: u64,
    handles: Vec<PhysHandle>,
    chunks: Vec<(i32, u64)>,
}

fn produce<D: Device>(d: &D, sizes: &[u64]) -> Produced {
    let len = sizes.iter().sum();
    let va = d.reserve(len, 0).unwrap();
    let (mut at, mut handles, mut chunks) = (va, Vec::new(), Vec::new());
    for &size in sizes {
        let h = d.create(size).unwrap();
        d.map(at, size, h).unwrap();
        chunks.push((d.export_fd(h).unwrap(), size));
        handles.push(h);
        at += size;
    }
    d.set_access(va, len).unwrap();
    Produced {
        va,
        len,
        handles,
        chunks,
    }
}

impl Produced {
    fn tear_down<D: Device>(self, d: &D) {
        d.unmap(self.va, self.len).unwrap();
        for h in self.handles {
            d.release(h).unwrap();
        }
        d.free_reservation(self.va, self.len).unwrap();
    }
}

/// Two `host` devices, as two processes would have: the consumer maps the
/// producer's memfd descriptors and both see the same bytes; closing leaves
/// the consumer with nothing, and the producer's memory intact.
#[test]
fn an_import_shares_the_producers_bytes_and_closes_clean() {
    let producer = HostDevice::with_capacity(GIB).unwrap();
    let consumer = HostDevice::with_capacity(GIB).unwrap();
    let p = produce(&producer, &[G, 2 * G]);
    let n = p.len as usize;
    producer.copy_to_device(p.va, &pattern(1, n)).unwrap();
    let m = MappedImport::map(&consumer, &p.chunks).unwrap();
    assert_eq!((m.len(), m.is_empty()), (3 * G, false));
    let mut back = vec![0u8; n];
    consumer.copy_from_device(m.base(), &mut back).unwrap();
    assert!(
        back == pattern(1, n),
        "the consumer reads the producer's bytes"
    );
    consumer.copy_to_device(m.base(), &pattern(2, n)).unwrap();
    producer.copy_from_device(p.va, &mut back).unwrap();
    assert!(back == pattern(2, n), "the producer reads the consumer's");
    let live = consumer.live();
    assert_eq!((live.reservations, live.handles, live.mappings), (1, 2, 2));
    m.close(Stream::DEFAULT).unwrap();
    assert!(consumer.live().is_empty(), "{:?}", consumer.live());
    consumer.check().unwrap();
    producer.copy_from_device(p.va, &mut back).unwrap();
    assert!(
        back == pattern(2, n),
        "the producer's memory outlives the import"
    );
    for &(fd, _) in &p.chunks {
        // SAFETY: export_fd gave this test the descriptor; closed once here.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    p.tear_down(&producer);
    assert!(producer.live().is_empty());
}

/// Every call an import makes is failed once in turn: the import fails at
/// that step, says which, and leaves nothing of itself behind.
#[test]
fn each_failed_step_is_rolled_back_leaving_nothing() {
    let sizes = [G, 4 * G, G];
    let clean = sim();
    let p = produce(&clean, &sizes);
    let probe = FaultInjecting::with_plan(&clean, FaultPlan::None);
    MappedImport::map(&probe, &p.chunks)
        .unwrap()
        .close(Stream::DEFAULT)
        .unwrap();
    let made: Vec<(Call, u64)> = [Call::Reserve, Call::Import, Call::Map, Call::SetAccess]
        .into_iter()
        .map(|c| (c, probe.hook().seen(c)))
        .collect();
    assert_eq!(
        made,
        [
            (Call::Reserve, 1),
            (Call::Import, 3),
            (Call::Map, 3),
            (Call::SetAccess, 1)
        ]
    );
    let mut runs = 0;
    for (call, times) in made {
        for n in 1..=times {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let d = sim();
                let p = produce(&d, &sizes);
                let before = d.live();
                let faulty = FaultInjecting::with_plan(&d, FaultPlan::Nth { call, n, kind });
                let e = MappedImport::map(&faulty, &p.chunks).unwrap_err();
                let index = n as usize - 1;
                let (step, bytes) = match call {
                    Call::Reserve => (ImportStep::Reserve, 6 * G),
                    Call::Import => (ImportStep::Import { index }, sizes[index]),
                    Call::Map => (ImportStep::Map { index }, sizes[index]),
                    _ => (ImportStep::SetAccess, 6 * G),
                };
                assert_eq!((e.step, e.bytes), (step, bytes), "{call} #{n}: {e}");
                assert_eq!(e.error.call(), Some(call), "{e}");
                assert!(e.rollback.is_empty(), "{e}");
                assert_eq!(d.live(), before, "{call} #{n} left {e}");
                d.check().unwrap();
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 16);
}

/// A hook that fails every call of the kinds listed.
#[derive(Debug)]
struct Refuse(Vec<Call>);

impl CallHook for Refuse {
    fn before(&self, call: Call, _bytes: u64) -> DeviceResult<()> {
        if self.0.contains(&call) {
            return Err(DeviceError::Driver {
                call,
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
                detail: "refused by the test".into(),
            });
        }
        Ok(())
    }
}

/// A rollback that fails too is reported with the error, not swallowed.
#[test]
fn a_failed_rollback_is_reported() {
    let d = sim();
    let p = produce(&d, &[G, G]);
    let faulty = Hooked::new(&d, Refuse(vec![Call::SetAccess, Call::Unmap]));
    let e = MappedImport::map(&faulty, &p.chunks).unwrap_err();
    assert_eq!(e.step, ImportStep::SetAccess);
    // The unmap failed, so the still-mapped reservation cannot be freed.
    let calls: Vec<_> = e.rollback.iter().map(DeviceError::call).collect();
    assert_eq!(calls, [Some(Call::Unmap), Some(Call::AddressFree)], "{e}");
    assert_eq!(
        e.rollback[1].broken_rule(),
        Some(Rule::ReservationInUse),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with("granting access to the import: ") && text.contains("; rolling back: "),
        "{text}"
    );
}

/// Closing waits for the work queued on the stream it names (the model
/// refuses to unmap pages that queued work uses); a stream the device does
/// not know falls back on waiting for the whole device.
#[test]
fn close_waits_for_the_stream() {
    let d = sim();
    let p = produce(&d, &[2 * G, G]);
    let before = d.live();
    let s = d.create_stream().unwrap();
    let m = MappedImport::map(&d, &p.chunks).unwrap();
    d.streams().submit(s, m.base() + G, 16).unwrap();
    let e = d.unmap(m.base(), m.len()).unwrap_err();
    assert_eq!(e.broken_rule(), Some(Rule::InUseByStream), "{e}");
    m.close(s).unwrap();
    assert_eq!(d.streams().pending_items(s), 0);
    assert_eq!(d.live(), before);

    let m = MappedImport::map(&d, &p.chunks).unwrap();
    d.streams().submit(s, m.base(), 16).unwrap();
    m.close(Stream(0xdead_0000)).unwrap();
    assert_eq!(d.live(), before);
    d.check().unwrap();
}

/// Every teardown step is tried; the error lists each that failed: here the
/// event on an unknown stream and then the device-wide wait, the unmap, and
/// so the free of the still-mapped reservation (the releases succeed: the
/// driver frees a released handle's memory once its last mapping goes).
#[test]
fn close_reports_every_failed_step() {
    let d = sim();
    let p = produce(&d, &[G, G]);
    let refusing = Hooked::new(
        &d,
        Refuse(vec![Call::Unmap, Call::EventRecord, Call::DeviceSync]),
    );
    let m = MappedImport::map(&refusing, &p.chunks).unwrap();
    let (base, len) = (m.base(), m.len());
    let e = m.close(Stream(0xdead_0000)).unwrap_err();
    let kinds: Vec<&str> =
        e.0.iter()
            .map(|f| match f {
                CloseFailure::Wait { .. } => "wait",
                CloseFailure::Unmap(_) => "unmap",
                CloseFailure::Release(_) => "release",
                CloseFailure::FreeReservation(_) => "free",
                CloseFailure::IpcClose(_) => "ipc_close",
            })
            .collect();
    assert_eq!(kinds, ["wait", "unmap", "free"], "{e}");
    let text = e.to_string();
    assert!(
        text.contains("; unmap: ") && text.contains("; free reservation: "),
        "{text}"
    );
    // What the refusals left: the consumer's mapping and reservation.
    d.unmap(base, len).unwrap();
    d.free_reservation(base, len).unwrap();
    p.tear_down(&d);
    assert!(d.live().is_empty(), "{:?}", d.live());
}

/// An import dropped without closing is closed (after a device-wide wait).
#[test]
fn a_dropped_import_is_closed() {
    let d = sim();
    let p = produce(&d, &[G]);
    let before = d.live();
    let s = d.create_stream().unwrap();
    let m = MappedImport::map(&d, &p.chunks).unwrap();
    d.streams().submit(s, m.base(), 8).unwrap();
    drop(m);
    assert_eq!(d.live(), before);
    assert_eq!(d.streams().pending_items(s), 0);
}
