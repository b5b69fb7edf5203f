//! The conformance suite on the CPU backends (`sim`, `host`), on adaptors and
//! under injected faults.

use std::sync::Arc;
use vmmalloc_device::adaptors::{Counting, FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::conformance::{self, run_all, scenarios};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, MIB};

const CAPACITY: u64 = 256 * MIB;

fn sim() -> SimDevice {
    SimDevice::with_capacity(CAPACITY)
}

fn host() -> HostDevice {
    HostDevice::with_capacity(CAPACITY).expect("host device")
}

/// Runs `run_all` and then checks that the device is back to empty.
fn passes<D: Device + Introspect>(dev: &D) {
    if let Err(e) = run_all(dev) {
        panic!("conformance failed on {}:\n{e}", dev.caps().name);
    }
    assert!(dev.live().is_empty(), "{:?}", dev.live());
    dev.check().unwrap();
}

#[test]
fn run_all_on_sim() {
    passes(&sim());
}

#[test]
fn run_all_on_host() {
    passes(&host());
}

#[test]
fn run_all_on_host_with_page_granularity() {
    passes(&HostDevice::new(HostConfig::with_capacity(CAPACITY).granularity(4096)).unwrap());
}

#[test]
fn run_all_on_a_large_sim_device() {
    passes(&SimDevice::with_capacity(141 << 30));
}

#[test]
fn run_all_through_pointers_and_adaptors() {
    let dev: Arc<dyn Device> = Arc::new(sim());
    run_all(&*dev).unwrap();
    run_all(&dev).unwrap();
    let counted = Counting::counting(host());
    run_all(&counted).unwrap();
    assert!(counted.hook().counts().get(Call::Map) > 0);
    assert!(counted.inner().live().is_empty());
    run_all(&FaultInjecting::with_plan(host(), FaultPlan::None)).unwrap();
}

#[test]
fn each_scenario_passes_alone_on_both_backends() {
    for (name, f) in scenarios::<SimDevice>() {
        let d = sim();
        f(&d).unwrap_or_else(|e| panic!("sim {name}: {e}"));
        assert!(d.live().is_empty(), "sim {name} leaked {:?}", d.live());
    }
    for (name, f) in scenarios::<HostDevice>() {
        let d = host();
        f(&d).unwrap_or_else(|e| panic!("host {name}: {e}"));
        assert!(d.live().is_empty(), "host {name} leaked {:?}", d.live());
    }
}

#[test]
fn scenarios_run_on_a_device_already_in_use() {
    // The suite compares against its own starting point, not against empty.
    let d = sim();
    let g = d.caps().granularity;
    let va = d.reserve(4 * g, 0).unwrap();
    let h = d.create(2 * g).unwrap();
    d.map(va, 2 * g, h).unwrap();
    d.set_access(va, 2 * g).unwrap();
    let p = d.alloc(100).unwrap();
    let before = d.live();
    run_all(&d).unwrap();
    assert_eq!(d.live(), before);
    d.free(p).unwrap();
    d.unmap(va, 2 * g).unwrap();
    d.release(h).unwrap();
    d.free_reservation(va, 4 * g).unwrap();
    assert!(d.live().is_empty());
}

#[test]
fn the_suite_reports_a_device_that_breaks_the_contract() {
    // A device whose memory is nearly full fails the scenarios that need
    // memory, by name, without panicking.
    let d = sim();
    let g = d.caps().granularity;
    let hogs: Vec<_> = (0..CAPACITY / g).map(|_| d.create(g).unwrap()).collect();
    let err = run_all(&d).unwrap_err();
    for name in [
        "vmm_lifecycle",
        "data_round_trip",
        "mem_info_accounting",
        "plain_alloc_free",
    ] {
        assert!(
            err.lines().any(|l| l.starts_with(&format!("{name}: "))),
            "{name} missing in:\n{err}"
        );
    }
    assert!(!err.lines().any(|l| l.starts_with("caps_sane: ")), "{err}");
    for h in hogs {
        d.release(h).unwrap();
    }
    assert!(d.live().is_empty());
}

/// Every call of every kind that a scenario makes fails once, in turn: the
/// scenario reports the failure (unless it expected an error there) and
/// leaves nothing behind unless its cleanup itself was what failed.
#[test]
fn a_failed_call_anywhere_is_reported_and_leaks_nothing() {
    // The calls whose failure a scenario expects: the second free of a
    // pointer, (on sim, which holds no bytes) the copy that must be refused,
    // and the create that must run out of memory, if it does.
    let expected = |name: &str, call: Call, n: u64, kind: FaultKind| match (name, call, n) {
        ("plain_alloc_free", Call::Free, 3) | ("data_round_trip", Call::CopyHtoD, 1) => true,
        ("oom_create", Call::Create, 1) => kind == FaultKind::OutOfMemory,
        _ => false,
    };
    let mut runs = 0;
    for (name, f) in scenarios::<FaultInjecting<SimDevice>>() {
        let clean = FaultInjecting::with_plan(sim(), FaultPlan::None);
        f(&clean).unwrap();
        for call in Call::ALL {
            for n in 1..=clean.hook().seen(call) {
                for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                    let dev = FaultInjecting::with_plan(sim(), FaultPlan::Nth { call, n, kind });
                    let r = f(&dev);
                    runs += 1;
                    assert_eq!(dev.hook().injected(), 1, "{name}: {call} #{n} not reached");
                    if expected(name, call, n, kind) {
                        continue;
                    }
                    let e = r.expect_err(&format!(
                        "{name}: injected failure of {call} #{n} not reported"
                    ));
                    let live = dev.inner().live();
                    assert!(
                        live.is_empty() || e.contains("cleanup:"),
                        "{name}: {call} #{n} failed ({e}) and left {live:?}"
                    );
                    dev.inner().check().unwrap();
                }
            }
        }
    }
    assert!(runs > 100, "only {runs} fault runs");
}

#[test]
fn individual_scenarios_are_public() {
    let d = sim();
    conformance::caps_sane(&d).unwrap();
    conformance::export_import(&d).unwrap();
    conformance::oom_create(&d).unwrap();
}
