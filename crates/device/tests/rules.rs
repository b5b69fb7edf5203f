//! One test per driver rule (DESIGN.md, "Driver rules the models enforce"), on
//! both CPU backends: each breaks the rule and expects the `Rule` variant, its
//! CUDA result code, and a model left exactly as it was.
//!
//! Every scenario is a generic function over the device; `on_both!` makes a
//! `rule_<name>_sim` and a `rule_<name>_host` test of it.

use std::fmt::Debug;
use vmmalloc_device::host::HostDevice;
use vmmalloc_device::model::LiveCounts;
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{
    Device, DeviceError, DeviceResult, Event, Introspect, PhysHandle, Rule, Stream, MIB,
};

const CAPACITY: u64 = 64 * MIB;

fn sim() -> SimDevice {
    SimDevice::with_capacity(CAPACITY)
}

fn host() -> HostDevice {
    HostDevice::with_capacity(CAPACITY).expect("host device")
}

macro_rules! on_both {
    ($scenario:ident, $sim:ident, $host:ident) => {
        #[test]
        fn $sim() {
            $scenario(&sim());
        }
        #[test]
        fn $host() {
            $scenario(&host());
        }
    };
}

/// What must not change when a call is refused.
#[derive(Debug, PartialEq)]
struct Snap {
    live: LiveCounts,
    free: u64,
}

fn snap<D: Device + Introspect>(d: &D) -> Snap {
    d.check().expect("model invariants");
    Snap {
        live: d.live(),
        free: d.mem_info().unwrap().free,
    }
}

/// Asserts that `r` broke `rule` with CUDA code `code`, and that nothing changed.
#[track_caller]
fn refused<D: Device + Introspect, T: Debug>(
    d: &D,
    before: &Snap,
    r: DeviceResult<T>,
    rule: Rule,
    code: u32,
) {
    let e = r.expect_err(&format!("expected {rule:?}"));
    assert_eq!(e.broken_rule(), Some(rule), "{e}");
    assert_eq!(e.cuda_code(), code, "{e}");
    assert_eq!(rule.cuda_code(), code);
    assert!(!e.is_out_of_memory());
    d.check().expect("model invariants after a refused call");
    assert_eq!(&snap(d), before, "a refused call changed the model ({e})");
}

fn g<D: Device>(d: &D) -> u64 {
    d.caps().granularity
}

/// A reservation of `n` granules with one handle of `m` granules mapped (and
/// made accessible) at its start.
fn mapped<D: Device>(d: &D, n: u64, m: u64) -> (u64, PhysHandle) {
    let g = g(d);
    let va = d.reserve(n * g, 0).unwrap();
    let h = d.create(m * g).unwrap();
    d.map(va, m * g, h).unwrap();
    d.set_access(va, m * g).unwrap();
    (va, h)
}

fn teardown<D: Device>(d: &D, va: u64, n: u64, maps: &[(u64, u64)], handles: &[PhysHandle]) {
    for &(a, s) in maps {
        d.unmap(a, s).unwrap();
    }
    for &h in handles {
        d.release(h).unwrap();
    }
    d.free_reservation(va, n * g(d)).unwrap();
}

#[track_caller]
fn empty<D: Device + Introspect>(d: &D) {
    d.check().unwrap();
    assert!(d.live().is_empty(), "{:?}", d.live());
    assert_eq!(d.mem_info().unwrap().free, CAPACITY);
}

// --- Sizes, addresses and alignments are multiples of the granularity -------

fn misaligned_reserve<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let s = snap(d);
    refused(d, &s, d.reserve(g + g / 2, 0), Rule::Misaligned, 1);
    refused(d, &s, d.reserve(g / 2, 0), Rule::Misaligned, 1);
    refused(d, &s, d.reserve(g, g / 2), Rule::Misaligned, 1);
    refused(d, &s, d.reserve(g, 3 * g), Rule::Misaligned, 1);
    empty(d);
}
on_both!(
    misaligned_reserve,
    rule_misaligned_reserve_sim,
    rule_misaligned_reserve_host
);

fn misaligned_create<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let s = snap(d);
    refused(d, &s, d.create(g / 2), Rule::Misaligned, 1);
    refused(d, &s, d.create(g + 4096), Rule::Misaligned, 1);
    empty(d);
}
on_both!(
    misaligned_create,
    rule_misaligned_create_sim,
    rule_misaligned_create_host
);

fn misaligned_map<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    let s = snap(d);
    refused(d, &s, d.map(va + g / 2, g, h), Rule::Misaligned, 1);
    refused(d, &s, d.map(va + 4096, g, h), Rule::Misaligned, 1);
    refused(d, &s, d.map(va, g / 2, h), Rule::Misaligned, 1);
    teardown(d, va, 4, &[], &[h]);
    empty(d);
}
on_both!(
    misaligned_map,
    rule_misaligned_map_sim,
    rule_misaligned_map_host
);

fn misaligned_unmap<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h) = mapped(d, 2, 2);
    let s = snap(d);
    refused(d, &s, d.unmap(va + g / 2, g), Rule::Misaligned, 1);
    refused(d, &s, d.unmap(va, g / 2), Rule::Misaligned, 1);
    refused(d, &s, d.unmap(va, 2 * g - 4096), Rule::Misaligned, 1);
    teardown(d, va, 2, &[(va, 2 * g)], &[h]);
    empty(d);
}
on_both!(
    misaligned_unmap,
    rule_misaligned_unmap_sim,
    rule_misaligned_unmap_host
);

fn misaligned_set_access<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(2 * g).unwrap();
    d.map(va, 2 * g, h).unwrap();
    let s = snap(d);
    refused(d, &s, d.set_access(va + g / 2, g), Rule::Misaligned, 1);
    refused(d, &s, d.set_access(va, g / 2), Rule::Misaligned, 1);
    assert!(!d.is_accessible(va, 1));
    teardown(d, va, 2, &[(va, 2 * g)], &[h]);
    empty(d);
}
on_both!(
    misaligned_set_access,
    rule_misaligned_set_access_sim,
    rule_misaligned_set_access_host
);

fn zero_size<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    let s = snap(d);
    refused(d, &s, d.reserve(0, 0), Rule::ZeroSize, 1);
    refused(d, &s, d.create(0), Rule::ZeroSize, 1);
    refused(d, &s, d.map(va, 0, h), Rule::ZeroSize, 1);
    refused(d, &s, d.unmap(va, 0), Rule::ZeroSize, 1);
    refused(d, &s, d.set_access(va, 0), Rule::ZeroSize, 1);
    refused(d, &s, d.alloc(0), Rule::ZeroSize, 1);
    teardown(d, va, 2, &[], &[h]);
    empty(d);
}
on_both!(zero_size, rule_zero_size_sim, rule_zero_size_host);

// --- cuMemMap maps a whole handle into an unmapped part of one reservation ---

fn map_partial_handle<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let h = d.create(2 * g).unwrap();
    let s = snap(d);
    refused(d, &s, d.map(va, g, h), Rule::PartialHandleMap, 1);
    refused(d, &s, d.map(va, 3 * g, h), Rule::PartialHandleMap, 1);
    d.map(va, 2 * g, h).unwrap();
    teardown(d, va, 4, &[(va, 2 * g)], &[h]);
    empty(d);
}
on_both!(
    map_partial_handle,
    rule_map_partial_handle_sim,
    rule_map_partial_handle_host
);

fn map_outside_reservation<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    let s = snap(d);
    refused(d, &s, d.map(va + 2 * g, g, h), Rule::OutsideReservation, 1);
    refused(
        d,
        &s,
        d.map(va.saturating_sub(4 * g), g, h),
        Rule::OutsideReservation,
        1,
    );
    // An aligned address no reservation holds, and one whose end overflows.
    refused(d, &s, d.map(g, g, h), Rule::OutsideReservation, 1);
    refused(
        d,
        &s,
        d.map(u64::MAX / g * g, g, h),
        Rule::OutsideReservation,
        1,
    );
    teardown(d, va, 2, &[], &[h]);
    empty(d);
}
on_both!(
    map_outside_reservation,
    rule_map_outside_reservation_sim,
    rule_map_outside_reservation_host
);

fn map_straddling_reservation_end<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(2 * g).unwrap();
    let s = snap(d);
    refused(d, &s, d.map(va + g, 2 * g, h), Rule::OutsideReservation, 1);
    refused(d, &s, d.map(va - g, 2 * g, h), Rule::OutsideReservation, 1);
    teardown(d, va, 2, &[], &[h]);
    empty(d);
}
on_both!(
    map_straddling_reservation_end,
    rule_map_straddling_reservation_end_sim,
    rule_map_straddling_reservation_end_host
);

#[test]
fn rule_map_straddling_two_adjacent_reservations_sim() {
    // The sim places reservations first fit, so two in a row are adjacent:
    // together they are not one reservation.
    let d = sim();
    let g = g(&d);
    let a = d.reserve(2 * g, 0).unwrap();
    let b = d.reserve(2 * g, 0).unwrap();
    assert_eq!(b, a + 2 * g);
    let h = d.create(2 * g).unwrap();
    let s = snap(&d);
    refused(&d, &s, d.map(a + g, 2 * g, h), Rule::OutsideReservation, 1);
    d.release(h).unwrap();
    d.free_reservation(a, 2 * g).unwrap();
    d.free_reservation(b, 2 * g).unwrap();
    empty(&d);
}

fn map_over_mapped<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let h1 = d.create(2 * g).unwrap();
    let h2 = d.create(g).unwrap();
    let h3 = d.create(2 * g).unwrap();
    d.map(va + g, 2 * g, h1).unwrap();
    let s = snap(d);
    refused(d, &s, d.map(va + g, g, h2), Rule::AlreadyMapped, 1);
    refused(d, &s, d.map(va + 2 * g, g, h2), Rule::AlreadyMapped, 1);
    refused(d, &s, d.map(va, 2 * g, h3), Rule::AlreadyMapped, 1);
    refused(d, &s, d.map(va + 2 * g, 2 * g, h3), Rule::AlreadyMapped, 1);
    refused(d, &s, d.map(va + g, 2 * g, h1), Rule::AlreadyMapped, 1);
    // The free granules on either side are still mappable.
    d.map(va, g, h2).unwrap();
    teardown(d, va, 4, &[(va, 3 * g)], &[h1, h2, h3]);
    empty(d);
}
on_both!(
    map_over_mapped,
    rule_map_over_mapped_sim,
    rule_map_over_mapped_host
);

// --- A new mapping is inaccessible until cuMemSetAccess over a fully mapped range

fn access_before_set_access<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    d.map(va, g, h).unwrap();
    assert!(!d.is_accessible(va, 1));
    let s = snap(d);
    let mut buf = [0u8; 16];
    refused(
        d,
        &s,
        d.copy_from_device(va, &mut buf),
        Rule::NotAccessible,
        700,
    );
    refused(
        d,
        &s,
        d.copy_to_device(va + 100, &buf),
        Rule::NotAccessible,
        700,
    );
    // Never mapped, in and out of the reservation.
    refused(
        d,
        &s,
        d.copy_from_device(va + g, &mut buf),
        Rule::NotAccessible,
        700,
    );
    refused(
        d,
        &s,
        d.copy_from_device(va + g - 8, &mut buf),
        Rule::NotAccessible,
        700,
    );
    d.set_access(va, g).unwrap();
    assert!(d.is_accessible(va, g));
    assert!(!d.is_accessible(va, g + 1));
    let copied = d.copy_to_device(va + g - 16, &buf);
    if d.caps().has_memory {
        copied.unwrap();
    } else {
        assert!(
            matches!(copied, Err(DeviceError::Unsupported { .. })),
            "{copied:?}"
        );
    }
    // After unmap the same address is inaccessible again.
    d.unmap(va, g).unwrap();
    assert!(!d.is_accessible(va, 1));
    let s = snap(d);
    refused(
        d,
        &s,
        d.copy_from_device(va, &mut buf),
        Rule::NotAccessible,
        700,
    );
    teardown(d, va, 2, &[], &[h]);
    empty(d);
}
on_both!(
    access_before_set_access,
    rule_access_before_set_access_sim,
    rule_access_before_set_access_host
);

fn set_access_not_fully_mapped<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let h1 = d.create(g).unwrap();
    let h2 = d.create(g).unwrap();
    d.map(va, g, h1).unwrap();
    d.map(va + 2 * g, g, h2).unwrap();
    let s = snap(d);
    refused(d, &s, d.set_access(va, 3 * g), Rule::NotMapped, 1);
    refused(d, &s, d.set_access(va + g, g), Rule::NotMapped, 1);
    refused(d, &s, d.set_access(va + 2 * g, 2 * g), Rule::NotMapped, 1);
    assert!(!d.is_accessible(va, g) && !d.is_accessible(va + 2 * g, g));
    teardown(d, va, 4, &[(va, g), (va + 2 * g, g)], &[h1, h2]);
    empty(d);
}
on_both!(
    set_access_not_fully_mapped,
    rule_set_access_not_fully_mapped_sim,
    rule_set_access_not_fully_mapped_host
);

// --- cuMemUnmap covers whole mappings, never part of one -------------------

fn unmap_partial<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h1) = mapped(d, 4, 2);
    let h2 = d.create(2 * g).unwrap();
    d.map(va + 2 * g, 2 * g, h2).unwrap();
    let s = snap(d);
    refused(d, &s, d.unmap(va, g), Rule::PartialUnmap, 1);
    refused(d, &s, d.unmap(va + g, g), Rule::PartialUnmap, 1);
    refused(d, &s, d.unmap(va, 3 * g), Rule::PartialUnmap, 1);
    refused(d, &s, d.unmap(va + g, 2 * g), Rule::PartialUnmap, 1);
    // Whole mappings, one or several at once, are fine.
    teardown(d, va, 4, &[(va, 4 * g)], &[h1, h2]);
    empty(d);
}
on_both!(
    unmap_partial,
    rule_unmap_partial_sim,
    rule_unmap_partial_host
);

fn unmap_unmapped<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h) = mapped(d, 4, 1);
    let s = snap(d);
    refused(d, &s, d.unmap(va + g, g), Rule::NotMapped, 1);
    refused(d, &s, d.unmap(va, 2 * g), Rule::NotMapped, 1);
    refused(d, &s, d.unmap(va + 4 * g, g), Rule::NotMapped, 1);
    refused(d, &s, d.unmap(u64::MAX / g * g, g), Rule::NotMapped, 1);
    d.unmap(va, g).unwrap();
    let s = snap(d);
    refused(d, &s, d.unmap(va, g), Rule::NotMapped, 1);
    teardown(d, va, 4, &[], &[h]);
    empty(d);
}
on_both!(
    unmap_unmapped,
    rule_unmap_unmapped_sim,
    rule_unmap_unmapped_host
);

// --- cuMemRelease of a mapped handle succeeds; memory returns at the last unmap

fn release_mapped_keeps_memory<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h) = mapped(d, 2, 2);
    let free = d.mem_info().unwrap().free;
    assert_eq!(free, CAPACITY - 2 * g);
    d.release(h).unwrap();
    assert_eq!(
        d.mem_info().unwrap().free,
        free,
        "memory came back while still mapped"
    );
    assert_eq!(d.live().handles, 0);
    assert_eq!(d.live().mappings, 1);
    assert_eq!(d.live().physical_bytes, 2 * g);
    assert!(d.is_accessible(va, 2 * g));
    d.check().unwrap();
    d.unmap(va, 2 * g).unwrap();
    assert_eq!(d.mem_info().unwrap().free, CAPACITY);
    d.free_reservation(va, 2 * g).unwrap();
    empty(d);
}
on_both!(
    release_mapped_keeps_memory,
    rule_release_mapped_keeps_memory_sim,
    rule_release_mapped_keeps_memory_host
);

fn double_release<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    d.release(h).unwrap();
    let s = snap(d);
    refused(d, &s, d.release(h), Rule::UnknownHandle, 1);
    refused(d, &s, d.map(va, g, h), Rule::UnknownHandle, 1);
    refused(d, &s, d.export_fd(h), Rule::UnknownHandle, 1);
    refused(
        d,
        &s,
        d.release(PhysHandle(0xdead_beef)),
        Rule::UnknownHandle,
        1,
    );
    d.free_reservation(va, 2 * g).unwrap();
    empty(d);
}
on_both!(
    double_release,
    rule_double_release_sim,
    rule_double_release_host
);

fn import_unknown<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let h = d.create(g).unwrap();
    let fd = d.export_fd(h).unwrap();
    d.release(h).unwrap();
    let s = snap(d);
    if d.caps().has_memory {
        // An exported descriptor still open keeps the memory: "Once all
        // shareable handles are closed and the allocation is released, the
        // allocated memory referenced will be released back to the OS"
        // (CUDA Driver API, cuMemExportToShareableHandle). So importing it
        // after the release succeeds, as from another process (host: the
        // memfd is still open).
        let again = d
            .import_fd(fd)
            .expect("an open exported descriptor imports");
        d.release(again).unwrap();
    } else {
        // `sim` holds no memory behind its descriptors: the allocation is
        // gone, its descriptor names nothing any more.
        refused(d, &s, d.import_fd(fd), Rule::UnknownShareableHandle, 1);
    }
    let s = snap(d);
    refused(d, &s, d.import_fd(-1), Rule::UnknownShareableHandle, 1);
    if d.caps().has_memory {
        // SAFETY: `fd` was exported to us, and we own it.
        unsafe { libc::close(fd) };
    }
    empty(d);
}
on_both!(
    import_unknown,
    rule_import_unknown_sim,
    rule_import_unknown_host
);

// --- cuMemAddressFree takes exactly a reserved range, with nothing mapped ---

fn address_free_not_a_reservation<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let s = snap(d);
    refused(
        d,
        &s,
        d.free_reservation(va + g, 3 * g),
        Rule::NotAReservation,
        1,
    );
    refused(
        d,
        &s,
        d.free_reservation(va + g, g),
        Rule::NotAReservation,
        1,
    );
    refused(
        d,
        &s,
        d.free_reservation(va, 2 * g),
        Rule::NotAReservation,
        1,
    );
    refused(
        d,
        &s,
        d.free_reservation(va, 5 * g),
        Rule::NotAReservation,
        1,
    );
    refused(d, &s, d.free_reservation(g, g), Rule::NotAReservation, 1);
    d.free_reservation(va, 4 * g).unwrap();
    let s = snap(d);
    refused(
        d,
        &s,
        d.free_reservation(va, 4 * g),
        Rule::NotAReservation,
        1,
    );
    empty(d);
}
on_both!(
    address_free_not_a_reservation,
    rule_address_free_not_a_reservation_sim,
    rule_address_free_not_a_reservation_host
);

fn address_free_in_use<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let va = d.reserve(4 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    d.map(va + 3 * g, g, h).unwrap();
    d.release(h).unwrap();
    let s = snap(d);
    // Still mapped even though its handle is released.
    refused(
        d,
        &s,
        d.free_reservation(va, 4 * g),
        Rule::ReservationInUse,
        1,
    );
    d.unmap(va + 3 * g, g).unwrap();
    d.free_reservation(va, 4 * g).unwrap();
    empty(d);
}
on_both!(
    address_free_in_use,
    rule_address_free_in_use_sim,
    rule_address_free_in_use_host
);

// --- cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY; recoverable ----------

fn create_beyond_capacity<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let s = snap(d);
    let e = d.create(CAPACITY + g).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(e.cuda_code(), 2);
    assert!(
        matches!(e, DeviceError::OutOfMemory { requested, free, total, .. }
            if requested == CAPACITY + g && free == CAPACITY && total == CAPACITY),
        "{e:?}"
    );
    assert_eq!(snap(d), s);
    // Fill the device, fail, free one, succeed.
    let hs: Vec<PhysHandle> = (0..CAPACITY / g).map(|_| d.create(g).unwrap()).collect();
    let full = snap(d);
    assert_eq!(full.free, 0);
    let e = d.create(g).unwrap_err();
    assert!(e.is_out_of_memory() && e.cuda_code() == 2, "{e}");
    let e = d.alloc(1).unwrap_err();
    assert!(e.is_out_of_memory() && e.cuda_code() == 2, "{e}");
    assert_eq!(snap(d), full);
    d.release(hs[3]).unwrap();
    let again = d.create(g).unwrap();
    for &h in hs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, h)| h)
    {
        d.release(h).unwrap();
    }
    d.release(again).unwrap();
    empty(d);
}
on_both!(
    create_beyond_capacity,
    rule_create_beyond_capacity_sim,
    rule_create_beyond_capacity_host
);

// --- Pages used by queued work must not be unmapped ------------------------

fn unmap_in_use_by_stream_sync<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h) = mapped(d, 2, 2);
    let stream = d.create_stream().unwrap();
    d.streams().submit(stream, va + g + 100, 8).unwrap();
    let s = snap(d);
    refused(d, &s, d.unmap(va, 2 * g), Rule::InUseByStream, 700);
    d.synchronize_stream(stream).unwrap();
    assert_eq!(d.streams().pending_items(stream), 0);
    teardown(d, va, 2, &[(va, 2 * g)], &[h]);
    empty(d);
}
on_both!(
    unmap_in_use_by_stream_sync,
    rule_unmap_in_use_by_stream_sync_sim,
    rule_unmap_in_use_by_stream_sync_host
);

fn unmap_in_use_by_stream_event<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let (va, h) = mapped(d, 2, 2);
    let stream = d.create_stream().unwrap();
    let other = d.create_stream().unwrap();
    d.streams().submit(stream, va, 2 * g).unwrap();
    let ev = d.create_event().unwrap();
    d.record_event(ev, stream).unwrap();
    // Work queued after the event, on memory elsewhere, does not hold the pages.
    d.streams().submit(stream, 0, 0).unwrap();
    // Work on another stream that uses the pages does, until it is done.
    d.streams().submit(other, va, g).unwrap();
    assert!(!d.query_event(ev).unwrap());
    let s = snap(d);
    refused(d, &s, d.unmap(va, 2 * g), Rule::InUseByStream, 700);
    d.synchronize_event(ev).unwrap();
    assert!(d.query_event(ev).unwrap());
    refused(d, &s, d.unmap(va, 2 * g), Rule::InUseByStream, 700);
    d.synchronize().unwrap();
    d.destroy_event(ev).unwrap();
    teardown(d, va, 2, &[(va, 2 * g)], &[h]);
    empty(d);
}
on_both!(
    unmap_in_use_by_stream_event,
    rule_unmap_in_use_by_stream_event_sim,
    rule_unmap_in_use_by_stream_event_host
);

// --- Unknown streams, events and pointers ----------------------------------

fn unknown_stream<D: Device + Introspect>(d: &D) {
    let bad = Stream(0xdead_0000);
    let ev = d.create_event().unwrap();
    let s = snap(d);
    refused(d, &s, d.synchronize_stream(bad), Rule::UnknownStream, 400);
    refused(d, &s, d.record_event(ev, bad), Rule::UnknownStream, 400);
    d.destroy_event(ev).unwrap();
    empty(d);
}
on_both!(
    unknown_stream,
    rule_unknown_stream_sim,
    rule_unknown_stream_host
);

fn unknown_event<D: Device + Introspect>(d: &D) {
    let ev = d.create_event().unwrap();
    d.destroy_event(ev).unwrap();
    let s = snap(d);
    for bad in [ev, Event(0xdead_0000)] {
        refused(d, &s, d.query_event(bad), Rule::UnknownEvent, 400);
        refused(d, &s, d.synchronize_event(bad), Rule::UnknownEvent, 400);
        refused(
            d,
            &s,
            d.record_event(bad, Stream::DEFAULT),
            Rule::UnknownEvent,
            400,
        );
        refused(d, &s, d.destroy_event(bad), Rule::UnknownEvent, 400);
    }
    empty(d);
}
on_both!(
    unknown_event,
    rule_unknown_event_sim,
    rule_unknown_event_host
);

fn free_unknown_pointer<D: Device + Introspect>(d: &D) {
    let g = g(d);
    let p = d.alloc(1000).unwrap();
    let va = d.reserve(g, 0).unwrap();
    let s = snap(d);
    refused(d, &s, d.free(p + 8), Rule::UnknownPointer, 1);
    refused(d, &s, d.free(va), Rule::UnknownPointer, 1);
    refused(d, &s, d.free(0x1234), Rule::UnknownPointer, 1);
    d.free(p).unwrap();
    let s = snap(d);
    refused(d, &s, d.free(p), Rule::UnknownPointer, 1);
    d.free_reservation(va, g).unwrap();
    empty(d);
}
on_both!(
    free_unknown_pointer,
    rule_free_unknown_pointer_sim,
    rule_free_unknown_pointer_host
);
