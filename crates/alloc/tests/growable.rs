//! Growable regions (docs/expandable.md, "Growable regions"): the address
//! never moves, bytes below the new end survive growth and shrink (on the
//! `host` device, real bytes), memory comes from the same chunk pool and
//! limit as blocks (a grow reclaims free chunks of segments; an
//! out-of-memory is explained), `validate()` after every step, a failure at
//! every driver call of a script leaves the old size intact, and bad input
//! is an error, never a panic.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{AllocError, Allocator, Stream};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, MIB};

const GIB: u64 = 1024 * MIB;

fn check<D: Device>(a: &ExpandableAllocator<D>) {
    a.validate().unwrap_or_else(|e| panic!("validate: {e}"));
}

#[test]
fn sim_grows_and_shrinks_in_place_with_one_chunk_per_step() {
    let dev = Arc::new(SimDevice::with_capacity(8 * GIB));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let p = a.growable_create(GIB, Stream::DEFAULT).unwrap();
    check(&a);
    assert_eq!(a.growable_info(p).unwrap().mapped, 0, "create maps nothing");
    let before = dev.introspect().unwrap().live();
    for step in 1..=512u64 {
        a.growable_resize(p, step * 2 * MIB).unwrap();
        if step % 64 == 0 {
            check(&a);
        }
    }
    let info = a.growable_info(p).unwrap();
    assert_eq!((info.ptr, info.size, info.mapped), (p, GIB, GIB));
    assert_eq!(info.chunks, 512, "one chunk per 2 MiB step, no more");
    assert_eq!(
        dev.introspect().unwrap().live().mappings,
        before.mappings + 512
    );
    let s = a.stats();
    assert_eq!(s.requested_bytes.0[0].current, GIB as i64);
    assert_eq!(s.reserved_bytes.0[0].current, GIB as i64);
    // Shrink to 100 MiB + 1 byte: 51 pages stay mapped.
    a.growable_resize(p, 100 * MIB + 1).unwrap();
    check(&a);
    let info = a.growable_info(p).unwrap();
    assert_eq!((info.size, info.mapped), (100 * MIB + 1, 102 * MIB));
    assert!(a.stats().pages_pooled > 0, "unmapped chunks are pooled");
    // The snapshot shows the region as a segment: mapped part active, rest unmapped.
    let snap = a.snapshot();
    let seg = snap
        .segments
        .iter()
        .find(|s| s.address == p)
        .expect("region in snapshot");
    assert_eq!(
        (seg.total_size, seg.allocated_size, seg.requested_size),
        (GIB, 102 * MIB, 100 * MIB + 1)
    );
    assert_eq!(seg.blocks.len(), 2);
    // Growing back reuses pooled chunks: no create.
    let creates = a.stats().driver_calls.get(Call::Create);
    a.growable_resize(p, 200 * MIB).unwrap();
    assert_eq!(a.stats().driver_calls.get(Call::Create), creates);
    check(&a);
    a.growable_destroy(p).unwrap();
    check(&a);
    assert!(matches!(
        a.growable_destroy(p),
        Err(AllocError::InvalidPointer { .. })
    ));
}

#[test]
fn host_bytes_survive_growth_and_shrink_and_the_address_never_moves() {
    let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(256 * MIB)).unwrap());
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let p = a.growable_create(64 * MIB, Stream::DEFAULT).unwrap();
    a.growable_resize(p, 3 * MIB + 17).unwrap();
    pattern_fill(&*dev, 1, p, 3 * MIB + 17).unwrap();
    // Blocks around it take and give back chunks from the same pool.
    let x = a.malloc(10 * MIB, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 2, x.ptr, x.requested).unwrap();
    for (i, size) in [20 * MIB, 5 * MIB, 40 * MIB, 3 * MIB + 17, 64 * MIB]
        .into_iter()
        .enumerate()
    {
        a.growable_resize(p, size).unwrap();
        check(&a);
        assert_eq!(a.growable_info(p).unwrap().ptr, p);
        pattern_check(&*dev, 1, p, 3 * MIB + 17).unwrap_or_else(|e| panic!("step {i}: {e}"));
        pattern_check(&*dev, 2, x.ptr, x.requested).unwrap();
        // The new tail is writable.
        if size > 3 * MIB + 17 {
            dev.copy_to_device(p + size - 1, &[0xAB]).unwrap();
        }
    }
    a.free(x.ptr).unwrap();
    a.growable_destroy(p).unwrap();
    check(&a);
}

#[test]
fn a_grow_reclaims_free_chunks_and_an_impossible_one_is_explained() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let x = a.malloc(40 * MIB, Stream::DEFAULT).unwrap();
    a.free(x.ptr).unwrap();
    let s1 = dev.create_stream().unwrap();
    let p = a.growable_create(GIB, s1).unwrap();
    // 60 MiB needs the 40 MiB cached by the freed block.
    a.growable_resize(p, 60 * MIB).unwrap();
    check(&a);
    assert!(a.stats().num_alloc_retries > 0, "a targeted reclaim ran");
    // Beyond the device: out of memory, explained, old size kept.
    let e = a.growable_resize(p, 100 * MIB).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains("lacking"), "{e}");
    assert_eq!(a.growable_info(p).unwrap().size, 60 * MIB);
    check(&a);
    // Blocks now fail too: the region's pages count against the limit.
    assert!(a.malloc(8 * MIB, Stream::DEFAULT).is_err());
    a.growable_resize(p, 0).unwrap();
    a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    check(&a);
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = ExpandableAllocator::new(dev, ExpandableConfig::default()).unwrap();
    assert!(matches!(
        a.growable_create(0, Stream::DEFAULT),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(a.growable_create(u64::MAX, Stream::DEFAULT).is_err());
    let p = a.growable_create(10 * MIB, Stream::DEFAULT).unwrap();
    a.growable_resize(p, 4 * MIB).unwrap();
    let e = a.growable_resize(p, 10 * MIB + 1).unwrap_err();
    assert!(e.to_string().contains("max_bytes"), "{e}");
    assert_eq!(a.growable_info(p).unwrap().size, 4 * MIB);
    let x = a.malloc(MIB, Stream::DEFAULT).unwrap();
    for bad in [x.ptr, p + 512, 0] {
        assert!(matches!(
            a.growable_resize(bad, MIB),
            Err(AllocError::InvalidPointer { .. })
        ));
        assert!(a.growable_destroy(bad).is_err());
    }
    assert!(a.free(p).is_err(), "free() does not take a region");
    check(&a);
    a.growable_destroy(p).unwrap();
    assert!(a.growable_destroy(p).is_err(), "destroy twice");
    check(&a);
}

/// A script of region operations among blocks; returns the allocator's
/// state after each step, or the first broken invariant.
fn faulty_run(plan: FaultPlan) -> Result<Arc<FaultInjecting<Arc<SimDevice>>>, String> {
    let dev = Arc::new(FaultInjecting::with_plan(
        Arc::new(SimDevice::with_capacity(64 * MIB)),
        FaultPlan::None,
    ));
    {
        let cfg = ExpandableConfig {
            max_chunk: Some(8 * MIB),
            release_threshold: 0,
            ..ExpandableConfig::default()
        };
        let a = ExpandableAllocator::new(dev.clone(), cfg).map_err(|e| e.to_string())?;
        dev.hook().set_plan(plan);
        let x = a.malloc(30 * MIB, Stream::DEFAULT).ok();
        let p = match a.growable_create(GIB, Stream::DEFAULT) {
            Ok(p) => p,
            Err(_) => return Ok(dev.clone()),
        };
        let mut size = 0;
        for (i, want) in [20 * MIB, 2 * MIB, 24 * MIB, 6 * MIB + 1]
            .into_iter()
            .enumerate()
        {
            if i == 2 {
                if let Some(x) = &x {
                    a.free(x.ptr).map_err(|e| e.to_string())?;
                }
            }
            match a.growable_resize(p, want) {
                Ok(()) => size = want,
                Err(AllocError::Device(_)) | Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => return Err(format!("step {i}: unexpected {e}")),
            }
            let info = a.growable_info(p).map_err(|e| e.to_string())?;
            if info.size != size || info.mapped < size {
                return Err(format!(
                    "step {i}: size {} mapped {}, want {size}",
                    info.size, info.mapped
                ));
            }
            a.validate().map_err(|e| format!("step {i}: {e}"))?;
        }
        let _ = a.growable_destroy(p);
        a.validate().map_err(|e| format!("destroy: {e}"))?;
    }
    let live = dev.inner().live();
    if (live.reservations, live.handles, live.mappings) != (0, 0, 0) {
        return Err(format!("leaked after drop: {live:?}"));
    }
    Ok(dev)
}

#[test]
fn a_failure_at_every_driver_call_keeps_the_old_size() {
    let clean = faulty_run(FaultPlan::None).expect("clean run");
    let mut runs = 0;
    for call in [
        Call::Reserve,
        Call::Create,
        Call::Map,
        Call::SetAccess,
        Call::Unmap,
        Call::Release,
        Call::StreamSync,
        Call::AddressFree,
    ] {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let plan = FaultPlan::Nth { call, n, kind };
                let dev = faulty_run(plan.clone())
                    .unwrap_or_else(|e| panic!("{call} #{n} failing with {kind:?}: {e}"));
                assert_eq!(dev.hook().injected(), 1, "{plan:?} was delivered");
                runs += 1;
            }
        }
    }
    assert!(runs > 40, "only {runs} faulty runs");
}

#[test]
fn a_shrink_waits_for_the_regions_stream_and_a_grow_does_not() {
    let dev = Arc::new(SimDevice::with_capacity(256 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let s = dev.create_stream().unwrap();
    let p = a.growable_create(128 * MIB, s).unwrap();
    a.growable_resize(p, 64 * MIB).unwrap();
    // Queued work reads the whole region: unmapping under it breaks the
    // driver rule the model enforces, unless the stream is waited for first.
    dev.streams().submit(s, p, 64 * MIB).unwrap();
    let syncs = a.stats().num_stream_syncs;
    a.growable_resize(p, 100 * MIB).unwrap();
    assert_eq!(a.stats().num_stream_syncs, syncs, "growing is immediate");
    dev.streams().submit(s, p, 100 * MIB).unwrap();
    a.growable_resize(p, 10 * MIB).unwrap();
    assert_eq!(
        a.stats().num_stream_syncs,
        syncs + 1,
        "shrinking waits once"
    );
    check(&a);
}

/// Random driver failures (a quarter of maps, unmaps, set-access calls,
/// creates and stream waits fail), so that a rollback's own unmap fails too
/// and chunks stay mapped without access: every resize either takes effect or
/// leaves the old size, `validate()` holds, and the next resize repairs access.
#[test]
fn random_faults_never_break_a_region() {
    for seed in 0..60u64 {
        let dev = Arc::new(FaultInjecting::with_plan(
            Arc::new(SimDevice::with_capacity(64 * MIB)),
            FaultPlan::None,
        ));
        {
            let cfg = ExpandableConfig {
                max_chunk: Some(4 * MIB),
                ..ExpandableConfig::default()
            };
            let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
            let p = a.growable_create(256 * MIB, Stream::DEFAULT).unwrap();
            dev.hook().set_plan(FaultPlan::Random {
                calls: vec![
                    Call::Map,
                    Call::Unmap,
                    Call::SetAccess,
                    Call::Create,
                    Call::StreamSync,
                ],
                p: 0.25,
                seed,
                kind: FaultKind::Driver(999),
            });
            let mut size = 0;
            let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            for step in 0..40 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let want = (x >> 33) % (48 * MIB);
                match a.growable_resize(p, want) {
                    Ok(()) => size = want,
                    Err(AllocError::Device(_)) | Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => panic!("seed {seed} step {step}: {e}"),
                }
                let info = a.growable_info(p).unwrap();
                assert_eq!(info.size, size, "seed {seed} step {step}");
                a.validate()
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            }
            dev.hook().set_plan(FaultPlan::None);
            a.growable_destroy(p).unwrap();
            a.validate().unwrap();
        }
        assert!(dev.inner().live().is_empty(), "seed {seed}");
    }
}
