//! `Device::create_on_host` (spill): host-located chunks map into device
//! reservations like device chunks, are charged to the host limit and never
//! to device memory, on `sim` and `host` (with real bytes), and every adaptor
//! forwards the call.

use std::sync::Arc;
use vmmalloc_device::adaptors::{CapacityLimit, FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, MIB};

fn exercise<D: Device + Introspect>(d: &D) {
    let free0 = d.mem_info().unwrap().free;
    let base = d.reserve(8 * MIB, 2 * MIB).unwrap();
    let h = d.create_on_host(4 * MIB).unwrap();
    assert_eq!(
        d.mem_info().unwrap().free,
        free0,
        "host chunks use no device memory"
    );
    assert_eq!(d.live().host_bytes, 4 * MIB);
    d.map(base, 4 * MIB, h).unwrap();
    d.set_access(base, 4 * MIB).unwrap();
    assert!(d.is_accessible(base, 4 * MIB));
    // The host limit (set by the caller to 6 MiB) refuses a second 4 MiB chunk.
    let e = d.create_on_host(4 * MIB).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    d.release(h).unwrap();
    assert_eq!(d.live().host_bytes, 4 * MIB, "still mapped");
    d.unmap(base, 4 * MIB).unwrap();
    assert_eq!(d.live().host_bytes, 0);
    d.free_reservation(base, 8 * MIB).unwrap();
    d.check().unwrap();
    assert!(d.live().is_empty());
}

#[test]
fn sim_host_chunks_are_charged_to_the_host() {
    let d = SimDevice::with_capacity(64 * MIB);
    d.set_host_capacity(6 * MIB);
    exercise(&d);
}

#[test]
fn host_host_chunks_hold_real_bytes() {
    let d = HostDevice::new(HostConfig::with_capacity(64 * MIB)).unwrap();
    d.set_host_capacity(6 * MIB);
    let base = d.reserve(4 * MIB, 2 * MIB).unwrap();
    let h = d.create_on_host(4 * MIB).unwrap();
    d.map(base, 4 * MIB, h).unwrap();
    d.set_access(base, 4 * MIB).unwrap();
    d.copy_to_device(base + MIB, b"spilled").unwrap();
    let mut buf = [0u8; 7];
    d.copy_from_device(base + MIB, &mut buf).unwrap();
    assert_eq!(&buf, b"spilled");
    d.unmap(base, 4 * MIB).unwrap();
    d.release(h).unwrap();
    d.free_reservation(base, 4 * MIB).unwrap();
    exercise(&d);
}

#[test]
fn adaptors_forward_create_on_host() {
    let sim = Arc::new(SimDevice::with_capacity(64 * MIB));
    sim.set_host_capacity(64 * MIB);
    // The capacity limit (device memory) does not charge host chunks.
    let lim = CapacityLimit::new(sim.clone(), 2 * MIB);
    let h = lim.create_on_host(8 * MIB).unwrap();
    lim.release(h).unwrap();
    // Fault injection sees it as a create.
    let f = FaultInjecting::with_plan(
        sim.clone(),
        FaultPlan::Nth {
            call: Call::Create,
            n: 1,
            kind: FaultKind::OutOfMemory,
        },
    );
    assert!(f.create_on_host(2 * MIB).unwrap_err().is_out_of_memory());
    let h = f.create_on_host(2 * MIB).unwrap();
    f.release(h).unwrap();
    // Through Arc (the forwarding macro).
    let h = (&sim as &Arc<SimDevice>).create_on_host(2 * MIB).unwrap();
    sim.release(h).unwrap();
    assert!(sim.live().is_empty());
}
