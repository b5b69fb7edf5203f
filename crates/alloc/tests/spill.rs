//! Spill (`spill:true`, docs/expandable.md "Spill and pressure"): work that
//! needs 1.2× the device memory completes with host-located chunks mapped
//! into the same ranges (stats report the spilled bytes) and fails with the
//! usual explanation without spill; bytes survive spill and the migration
//! back at a quiet point (`host`, real bytes); a failure at every driver call
//! leaves a valid allocator and nothing leaked.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{AllocError, Allocator, Stream};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, MIB};

fn cfg(spill: bool) -> ExpandableConfig {
    ExpandableConfig {
        spill,
        max_chunk: Some(8 * MIB),
        ..ExpandableConfig::default()
    }
}

/// 1.2 × 64 MiB live at the peak: ten 8 MiB blocks minus a few frees.
fn work<D: Device>(a: &ExpandableAllocator<D>) -> Result<Vec<u64>, AllocError> {
    let mut live = Vec::new();
    for i in 0..12 {
        live.push(a.malloc(8 * MIB - 4096, Stream::DEFAULT)?.ptr);
        a.validate().unwrap();
        if i % 5 == 4 {
            a.free(live.remove(0))?;
        }
    }
    Ok(live)
}

#[test]
fn sim_completes_a_1_2x_workload_with_spill_and_fails_without() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), cfg(false)).unwrap();
    let e = work(&a).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(
        e.to_string().contains("lacking"),
        "the usual explanation: {e}"
    );
    drop(a);

    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), cfg(true)).unwrap();
    let live = work(&a).expect("spill completes it");
    let s = a.stats();
    assert_eq!(live.len(), 10, "80 MiB live on a 64 MiB device");
    assert!(s.spilled_bytes >= 16 * MIB, "spilled {}", s.spilled_bytes);
    assert!(s.num_spills > 0);
    assert!(dev.live().host_bytes >= 16 * MIB);
    assert!(dev.live().physical_bytes <= 64 * MIB);
    // The quiet point: frees make room; spilled chunks move back.
    for &p in &live[..4] {
        a.free(p).unwrap();
    }
    a.migrate_spilled().unwrap();
    a.validate().unwrap();
    let s = a.stats();
    assert_eq!(s.spilled_bytes, 0, "all back on the device");
    assert!(s.spill_migrations > 0);
    assert_eq!(dev.live().host_bytes, 0);
}

#[test]
fn host_bytes_survive_spill_and_migration_back() {
    let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(64 * MIB)).unwrap());
    let a = ExpandableAllocator::new(dev.clone(), cfg(true)).unwrap();
    let blocks: Vec<_> = (0..10)
        .map(|_| a.malloc(8 * MIB - 4096, Stream::DEFAULT).unwrap())
        .collect();
    for (i, b) in blocks.iter().enumerate() {
        pattern_fill(&*dev, i as u64, b.ptr, b.requested).unwrap();
    }
    assert!(a.stats().spilled_bytes > 0);
    a.validate().unwrap();
    for b in &blocks[..3] {
        a.free(b.ptr).unwrap();
    }
    a.empty_cache().unwrap(); // a quiet point
    a.validate().unwrap();
    assert_eq!(a.stats().spilled_bytes, 0);
    for (i, b) in blocks.iter().enumerate().skip(3) {
        pattern_check(&*dev, i as u64, b.ptr, b.requested).unwrap();
    }
}

#[test]
fn the_host_limit_and_growable_regions() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    dev.set_host_capacity(16 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), cfg(true)).unwrap();
    let g = a.growable_create(1024 * MIB, Stream::DEFAULT).unwrap();
    a.growable_resize(g, 56 * MIB).unwrap();
    assert_eq!(a.stats().spilled_bytes, 0);
    a.growable_resize(g, 72 * MIB).unwrap();
    assert_eq!(
        a.stats().spilled_bytes,
        8 * MIB,
        "8 MiB of the growth on the device, the 8 MiB it lacked on the host"
    );
    a.validate().unwrap();
    // Host memory is finite as well: the usual out-of-memory after it.
    let e = a.growable_resize(g, 100 * MIB).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains("host memory (spill)"), "{e}");
    a.growable_resize(g, 8 * MIB).unwrap();
    assert_eq!(a.stats().spilled_bytes, 0);
    a.validate().unwrap();
}

fn faulty(plan: FaultPlan) -> Result<Arc<FaultInjecting<Arc<SimDevice>>>, String> {
    let dev = Arc::new(FaultInjecting::with_plan(
        Arc::new(SimDevice::with_capacity(64 * MIB)),
        FaultPlan::None,
    ));
    {
        let a = ExpandableAllocator::new(dev.clone(), cfg(true)).map_err(|e| e.to_string())?;
        dev.hook().set_plan(plan);
        let mut live = Vec::new();
        for _ in 0..10 {
            if let Ok(x) = a.malloc(8 * MIB - 4096, Stream::DEFAULT) {
                live.push(x.ptr);
            }
            a.validate()?;
        }
        for p in live.drain(..3) {
            a.free(p).map_err(|e| e.to_string())?;
        }
        let _ = a.migrate_spilled();
        a.validate()?;
        let _ = a.empty_cache();
        a.validate()?;
    }
    let l = dev.inner().live();
    if !l.is_empty() {
        return Err(format!("leaked: {l:?}"));
    }
    Ok(dev)
}

#[test]
fn a_failure_at_every_driver_call_of_spill_and_migration() {
    let clean = faulty(FaultPlan::None).unwrap();
    let mut runs = 0;
    for call in [
        Call::Create,
        Call::Map,
        Call::SetAccess,
        Call::Unmap,
        Call::Release,
        Call::StreamSync,
    ] {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                faulty(FaultPlan::Nth { call, n, kind })
                    .unwrap_or_else(|e| panic!("{call} #{n} {kind:?}: {e}"));
                runs += 1;
            }
        }
    }
    assert!(runs > 50, "{runs}");
}

/// Pages mapped ahead of a growing segment's tail are a bet on the next
/// allocation, made only from memory to spare: when the device has none
/// (here another process holds most of it), they are not mapped at all —
/// never spilled to host memory, and no live chunk migrates for them.
#[test]
fn pages_mapped_ahead_of_need_never_spill() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    // Another process holds 56 MiB: 8 MiB of the device are free.
    let other = dev.alloc(56 * MIB).unwrap();
    let a = ExpandableAllocator::new(dev.clone(), cfg(true)).unwrap();
    let p = a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    a.validate().unwrap();
    let s = a.stats();
    assert_eq!(
        (s.num_spills, s.spilled_bytes),
        (0, 0),
        "a 4 MiB request fits the free 8 MiB: nothing spills"
    );
    assert_eq!(dev.live().host_bytes, 0);
    a.free(p.ptr).unwrap();
    drop(a);
    dev.free(other).unwrap();
}

/// On `host` (real bytes, real copies), a failure at each copy of the
/// migration back (`cuMemcpyDtoH` before the swap, `cuMemcpyHtoD` after
/// it) leaves a valid allocator whose chunk table names the handle really
/// mapped there, and nothing leaked once it is dropped; the other blocks
/// keep their bytes.
#[test]
fn a_failed_copy_while_migrating_back_loses_no_handle() {
    for call in [Call::CopyDtoH, Call::CopyHtoD] {
        let host = Arc::new(HostDevice::new(HostConfig::with_capacity(64 * MIB)).unwrap());
        let dev = Arc::new(FaultInjecting::with_plan(host.clone(), FaultPlan::None));
        {
            let a = ExpandableAllocator::new(dev.clone(), cfg(true)).unwrap();
            let blocks: Vec<_> = (0..10)
                .map(|_| a.malloc(8 * MIB - 4096, Stream::DEFAULT).unwrap())
                .collect();
            for (i, b) in blocks.iter().enumerate() {
                pattern_fill(&*host, i as u64, b.ptr, b.requested).unwrap();
            }
            assert!(a.stats().spilled_bytes > 0);
            for b in &blocks[..3] {
                a.free(b.ptr).unwrap();
            }
            let seen = dev.hook().seen(call);
            dev.hook().set_plan(FaultPlan::Nth {
                call,
                n: seen + 1,
                kind: FaultKind::Driver(999),
            });
            assert!(
                a.migrate_spilled().is_err(),
                "{call}: the failure is reported"
            );
            a.validate().unwrap_or_else(|e| panic!("{call}: {e}"));
            dev.hook().set_plan(FaultPlan::None);
            a.migrate_spilled().unwrap();
            a.validate().unwrap();
            // A failed read leaves the bytes where they were; a failed
            // write loses that one 8 MiB chunk's bytes only (it overlaps
            // at most two of the blocks).
            let intact = blocks
                .iter()
                .enumerate()
                .skip(3)
                .filter(|(i, b)| pattern_check(&*host, *i as u64, b.ptr, b.requested).is_ok())
                .count();
            let want = if call == Call::CopyDtoH { 7 } else { 5 };
            assert!(intact >= want, "{call}: {intact} blocks intact");
        }
        let l = host.live();
        assert!(l.is_empty(), "{call}: leaked {l:?}");
    }
}
