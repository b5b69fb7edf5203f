//! Fault injection: for each device call kind the allocator uses and each
//! position N in a scripted workload, fail the Nth call (with a driver error,
//! then with out-of-memory). The failed operation returns an error or succeeds
//! by another route, `validate()` holds after every step, and after the
//! allocator is dropped the device holds no handle, mapping, reservation or
//! event.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{AllocError, Allocator, Sleep, Stream};
use vmmalloc_alloc_harness::{Harness, Op};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, MIB};

/// The default options without mapping ahead (`grow_granule: 0`): each
/// block maps exactly the pages it needs, so the layouts these tests
/// count are exact.
fn exact() -> ExpandableConfig {
    ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    }
}

type Dev = FaultInjecting<Arc<SimDevice>>;

/// A workload that makes every kind of call the allocator uses: growth,
/// small and large pools, record_stream events (create, record, query, sync),
/// targeted reclaim after a stream wait, an out-of-memory report, empty_cache
/// (unmap, release, address free) and a fresh arena afterwards.
fn script() -> Vec<Op> {
    use Op::*;
    let m = |size, stream| Malloc { size, stream };
    vec![
        m(6 * MIB, 0),  // slot 0
        m(100, 0),      // slot 1: small pool
        m(10 * MIB, 1), // slot 2
        RecordStream { slot: 0, stream: 1 },
        Free { slot: 0 }, // event recorded on stream 1
        m(2 * MIB, 0),    // event queried (pending)
        Complete { stream: 1 },
        m(1000, 0), // event completes: block freed
        m(20 * MIB, 1),
        m(16 * MIB, 0),
        Submit { slot: 3 },
        Free { slot: 3 },
        Free { slot: 3 },
        m(30 * MIB, 2), // reclaim: wait for the owning stream, unmap, map, set_access
        m(60 * MIB, 2), // out of memory: explained
        RecordStream { slot: 1, stream: 2 },
        Free { slot: 1 },
        EmptyCache, // event sync, unmap, release, address free
        Free { slot: 0 },
        EmptyCache,
        m(3 * MIB, 1), // a new segment in a retired slice
        RecordStream { slot: 0, stream: 0 },
    ]
}

/// Runs the script over a fault-injecting device; returns the calls seen
/// per kind (drop included) or a description of the first broken invariant.
/// A 28 MiB block stays live and a 24 MiB one (three 8 MiB chunks: an eighth
/// of the 64 MiB device each) is freed; a 4 MiB block carved from it while
/// memory is tight (28 MiB live, over 2/5 of the device) splits the first chunk:
/// stream wait, unmap, release, create, map, set_access.
/// Splitting above 2/5 of the limit (the default before unpinning) with no
/// split slack, so that the 4 MiB block of [`split_script`] splits the
/// 8 MiB chunk it covers half of.
fn split_cfg() -> ExpandableConfig {
    ExpandableConfig {
        split_slack: 0,
        ..edge_cfg()
    }
}

/// Splits and edge chunks above 2/5 of the limit (the default before
/// unpinning made never splitting the default).
fn edge_cfg() -> ExpandableConfig {
    ExpandableConfig {
        split_threshold: 0.4,
        ..exact()
    }
}

fn split_script() -> Vec<Op> {
    use Op::*;
    vec![
        Malloc {
            size: 28 * MIB,
            stream: 0,
        },
        Malloc {
            size: 24 * MIB,
            stream: 0,
        },
        Submit { slot: 1 },
        Free { slot: 1 },
        Malloc {
            size: 4 * MIB,
            stream: 0,
        },
        Malloc {
            size: 30 * MIB,
            stream: 1,
        },
    ]
}

fn run(plan: FaultPlan, cfg: ExpandableConfig) -> Result<Dev, String> {
    run_script(plan, cfg, &script())
}

fn run_script(plan: FaultPlan, cfg: ExpandableConfig, ops: &[Op]) -> Result<Dev, String> {
    let dev = Arc::new(FaultInjecting::with_plan(
        Arc::new(SimDevice::with_capacity(64 * MIB)),
        FaultPlan::None,
    ));
    {
        let a = ExpandableAllocator::new(dev.clone(), cfg).map_err(|e| e.to_string())?;
        let mut h = Harness::new(&a, &*dev, 3)?;
        h.tolerate_device_errors = true;
        dev.hook().set_plan(plan);
        for (i, op) in ops.iter().enumerate() {
            let out = h.apply(op).map_err(|e| format!("step {i} {op:?}: {e}"))?;
            h.check()
                .map_err(|e| format!("after step {i} {op:?} ({out:?}): {e}"))?;
        }
        // Leave some work queued and blocks live: drop must cope.
        if let Some(l) = h.live.first() {
            dev.inner()
                .streams()
                .submit(l.alloc.stream, l.alloc.ptr, l.alloc.size)
                .map_err(|e| e.to_string())?;
        }
    }
    let inner = dev.inner();
    if !inner.live().is_empty() {
        return Err(format!("after drop the device holds {:?}", inner.live()));
    }
    if inner.streams().live_events() != 0 {
        return Err(format!(
            "after drop {} events are alive",
            inner.streams().live_events()
        ));
    }
    Arc::try_unwrap(dev).map_err(|_| "device still shared".to_string())
}

#[test]
fn every_failed_call_is_survived_and_nothing_leaks() {
    let clean = run(FaultPlan::None, exact()).expect("clean run");
    let kinds: Vec<(Call, u64)> = Call::ALL
        .iter()
        .filter(|c| **c != Call::StreamCreate)
        .map(|&c| (c, clean.hook().seen(c)))
        .filter(|&(_, n)| n > 0)
        .collect();
    eprintln!("calls in the scripted workload: {kinds:?}");
    for must in [
        Call::Reserve,
        Call::AddressFree,
        Call::Create,
        Call::Release,
        Call::Map,
        Call::Unmap,
        Call::SetAccess,
        Call::MemInfo,
        Call::StreamSync,
        Call::EventCreate,
        Call::EventRecord,
        Call::EventQuery,
        Call::EventSync,
        Call::EventDestroy,
    ] {
        assert!(
            kinds.iter().any(|k| k.0 == must),
            "the script never calls {must}"
        );
    }
    let mut runs = 0;
    for &(call, seen) in &kinds {
        for n in 1..=seen {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let plan = FaultPlan::Nth { call, n, kind };
                let dev = run(plan.clone(), exact())
                    .unwrap_or_else(|e| panic!("{call} #{n} failing with {kind:?}: {e}"));
                assert_eq!(dev.hook().injected(), 1, "{plan:?} was delivered");
                runs += 1;
            }
        }
    }
    eprintln!("{runs} faulty runs survived");
}

/// The same sweep with the default options: blocks that grow a tail map
/// ahead to 20 MiB, the script's 60 MiB request unpins, and every call of
/// both paths fails once.
#[test]
fn every_failed_call_with_the_defaults_is_survived() {
    let cfg = ExpandableConfig::default;
    let clean = run(FaultPlan::None, cfg()).expect("clean run");
    assert!(
        clean.hook().seen(Call::DeviceSync) > 0 && clean.hook().seen(Call::CopyDtoD) > 0,
        "the script must unpin"
    );
    let mut runs = 0;
    for &call in Call::ALL.iter().filter(|c| **c != Call::StreamCreate) {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let plan = FaultPlan::Nth { call, n, kind };
                run(plan, cfg())
                    .unwrap_or_else(|e| panic!("{call} #{n} failing with {kind:?}: {e}"));
                runs += 1;
            }
        }
    }
    assert!(runs > 50, "{runs}");
}

#[test]
fn faults_with_a_zero_release_threshold_and_big_pages() {
    let cfg = ExpandableConfig {
        page_size: Some(4 * MIB),
        release_threshold: 0,
        ..exact()
    };
    let clean = run(FaultPlan::None, cfg.clone()).expect("clean run");
    for call in [
        Call::Create,
        Call::Map,
        Call::SetAccess,
        Call::Unmap,
        Call::Release,
    ] {
        for n in 1..=clean.hook().seen(call) {
            let plan = FaultPlan::Nth {
                call,
                n,
                kind: FaultKind::Driver(1),
            };
            run(plan, cfg.clone()).unwrap_or_else(|e| panic!("{call} #{n}: {e}"));
        }
    }
}

fn sim_with(plan: FaultPlan) -> Arc<Dev> {
    Arc::new(FaultInjecting::with_plan(
        Arc::new(SimDevice::with_capacity(256 * MIB)),
        plan,
    ))
}

#[test]
fn a_failed_map_rolls_back_and_pools_the_pages() {
    let dev = sim_with(FaultPlan::Nth {
        call: Call::Map,
        n: 5,
        kind: FaultKind::Driver(999),
    });
    // 8 MiB chunks: the 64 MiB block is backed by 8 handles.
    let cfg = ExpandableConfig {
        max_chunk: Some(8 * MIB),
        ..exact()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let e = a.malloc(64 * MIB, Stream::DEFAULT).unwrap_err();
    assert!(matches!(e, AllocError::Device(_)), "{e}");
    a.validate().unwrap();
    let st = a.stats();
    assert_eq!(
        (st.pages_mapped, st.pages_pooled, st.handles_pooled),
        (0, 32, 8),
        "the 4 mapped chunks were unmapped"
    );
    assert_eq!(st.allocation.all().current, 0);
    // The pooled chunks serve the retry without a single create.
    let x = a.malloc(64 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(dev.hook().seen(Call::Create), 8);
    assert_eq!(a.stats().handles_mapped, 8);
    a.validate().unwrap();
    a.free(x.ptr).unwrap();
}

#[test]
fn a_zero_release_threshold_releases_rolled_back_pages() {
    let dev = sim_with(FaultPlan::Nth {
        call: Call::SetAccess,
        n: 1,
        kind: FaultKind::Driver(999),
    });
    let cfg = ExpandableConfig {
        release_threshold: 0,
        ..exact()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    assert!(a.malloc(16 * MIB, Stream::DEFAULT).is_err());
    let st = a.stats();
    assert_eq!(
        (st.pages_mapped, st.pages_pooled, st.num_device_free),
        (0, 0, 1),
        "the block's one 16 MiB chunk was released"
    );
    assert_eq!(dev.inner().live().handles, 0);
    a.validate().unwrap();
}

#[test]
fn create_out_of_memory_reclaims_instead_of_failing() {
    // The driver reports out-of-memory once while free pages sit in another
    // stream's segment: the allocator moves them instead of failing.
    let dev = sim_with(FaultPlan::None);
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    let s1 = dev.create_stream().unwrap();
    let x = a.malloc(32 * MIB, Stream::DEFAULT).unwrap();
    a.free(x.ptr).unwrap();
    dev.hook().set_plan(FaultPlan::Nth {
        call: Call::Create,
        n: dev.hook().seen(Call::Create) + 1,
        kind: FaultKind::OutOfMemory,
    });
    let y = a.malloc(8 * MIB, s1).unwrap();
    let st = a.stats();
    // Reclaim takes whole chunks: the freed block's one 32 MiB chunk. The
    // driver being full, it is released and an 8 MiB chunk created instead.
    assert_eq!(
        (st.num_alloc_retries, st.reclaims, st.reclaimed_bytes),
        (1, 1, 32 * MIB)
    );
    assert_eq!(
        (st.num_device_free, st.handles_mapped, st.pages_pooled),
        (1, 1, 0)
    );
    assert_eq!(st.num_ooms, 0);
    a.validate().unwrap();
    a.free(y.ptr).unwrap();
}

#[test]
fn a_double_fault_leaves_pages_unready_until_access_is_granted() {
    let dev = sim_with(FaultPlan::Random {
        calls: vec![Call::SetAccess, Call::Unmap],
        p: 1.0,
        seed: 1,
        kind: FaultKind::Driver(999),
    });
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    assert!(a.malloc(4 * MIB, Stream::DEFAULT).is_err());
    a.validate().unwrap();
    assert_eq!(a.stats().pages_mapped, 2, "the pages could not be unmapped");
    dev.hook().set_plan(FaultPlan::None);
    let x = a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    assert!(dev.introspect().unwrap().is_accessible(x.ptr, x.size));
    a.validate().unwrap();
    a.free(x.ptr).unwrap();
    drop(a);
    assert!(dev.inner().live().is_empty());
}

#[test]
fn a_failed_event_record_falls_back_to_a_stream_wait() {
    let dev = sim_with(FaultPlan::Nth {
        call: Call::EventRecord,
        n: 1,
        kind: FaultKind::Driver(999),
    });
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    let s1 = dev.create_stream().unwrap();
    let x = a.malloc(MIB, Stream::DEFAULT).unwrap();
    a.record_stream(x.ptr, s1).unwrap();
    dev.inner().streams().submit(s1, x.ptr, x.size).unwrap();
    a.free(x.ptr).unwrap();
    assert_eq!(
        dev.inner().streams().pending_items(s1),
        0,
        "the stream was waited for instead"
    );
    assert_eq!(
        a.stats().active.all().current,
        0,
        "so the block is free at once"
    );
    a.validate().unwrap();
    // When the wait fails too, the free fails and changes nothing.
    dev.hook().set_plan(FaultPlan::Random {
        calls: vec![Call::EventRecord, Call::StreamSync],
        p: 1.0,
        seed: 1,
        kind: FaultKind::Driver(999),
    });
    let y = a.malloc(MIB, Stream::DEFAULT).unwrap();
    a.record_stream(y.ptr, s1).unwrap();
    assert!(a.free(y.ptr).is_err());
    assert_eq!(a.stats().allocation.all().current, 1);
    a.validate().unwrap();
    dev.hook().set_plan(FaultPlan::None);
    a.free(y.ptr).unwrap();
    a.validate().unwrap();
}

/// The fault sweep over the chunk-split path: every call of `split_script`
/// fails once (driver error, then out-of-memory); the run survives with a
/// valid state and nothing leaks.
#[test]
fn every_failed_call_of_a_chunk_split_is_survived() {
    let stats = {
        let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
        let a = ExpandableAllocator::new(dev.clone(), split_cfg()).unwrap();
        let mut h = Harness::new(&a, &*dev, 3).unwrap();
        for op in split_script() {
            h.apply(&op).unwrap();
            h.check().unwrap();
        }
        drop(h);
        a.stats()
    };
    assert_eq!(stats.chunk_splits, 1, "{stats:?}");
    let clean = run_script(FaultPlan::None, split_cfg(), &split_script()).expect("clean run");
    let mut runs = 0;
    for &call in Call::ALL.iter().filter(|c| **c != Call::StreamCreate) {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let plan = FaultPlan::Nth { call, n, kind };
                run_script(plan, split_cfg(), &split_script())
                    .unwrap_or_else(|e| panic!("{call} #{n} failing with {kind:?}: {e}"));
                runs += 1;
            }
        }
    }
    assert!(runs > 20, "{runs}");
}

/// With memory tight (28 MiB live on the 64 MiB device, whose largest chunk
/// is 8 MiB, an eighth of it), an 11.5 MiB block ends inside its last page:
/// its run of six pages is backed by a 4-page and a 1-page chunk plus a
/// one-page edge chunk (pages.rs, `cut_edge_pages`). Then it is freed and a
/// 10 MiB block takes the two body chunks as they are, with no call.
fn edge_script() -> Vec<Op> {
    use Op::*;
    let m = |size, stream| Malloc { size, stream };
    vec![
        m(28 * MIB, 0),           // slot 0: pages 0-13 (8+8+8+4 MiB), tight from here
        m(3 * MIB, 0),            // slot 1: pages 14-15, too short a run for an edge chunk
        m(11 * MIB + MIB / 2, 0), // slot 2: pages 16-19, 20, edge page 21
        m(2 * MIB + MIB / 2, 0),  // slot 3: the rest of page 21 and page 22
        Free { slot: 2 },
        m(10 * MIB, 0), // pages 16-20: both chunks reused whole
        Free { slot: 3 },
        EmptyCache,
    ]
}

/// The fault sweep over the edge-chunk path: every call of `edge_script`
/// fails once (driver error, then out-of-memory); a run whose edge chunk
/// cannot be created or mapped rolls the body chunks back, the state stays
/// valid after every step and nothing leaks at drop.
#[test]
fn every_failed_call_of_an_edge_chunk_is_survived() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), edge_cfg()).unwrap();
    let mut creates = Vec::new();
    let mut ptrs = Vec::new();
    for size in [28 * MIB, 3 * MIB, 11 * MIB + MIB / 2, 2 * MIB + MIB / 2] {
        let before = dev.counts();
        ptrs.push(a.malloc(size, Stream::DEFAULT).unwrap().ptr);
        creates.push(dev.counts().since(&before).get(Call::Create));
        a.validate().unwrap();
    }
    assert_eq!(creates, vec![4, 1, 3, 1]);
    a.free(ptrs[2]).unwrap();
    let before = dev.counts();
    let again = a.malloc(10 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(again.ptr, ptrs[2] + MIB);
    assert_eq!(dev.counts().since(&before).total(), 0);
    drop(a);

    let clean = run_script(FaultPlan::None, edge_cfg(), &edge_script()).expect("clean run");
    let mut runs = 0;
    for &call in Call::ALL.iter().filter(|c| **c != Call::StreamCreate) {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let plan = FaultPlan::Nth { call, n, kind };
                run_script(plan, edge_cfg(), &edge_script())
                    .unwrap_or_else(|e| panic!("{call} #{n} failing with {kind:?}: {e}"));
                runs += 1;
            }
        }
    }
    assert!(runs > 20, "{runs}");
}

/// A host device behind a fault injector.
type HostDev = FaultInjecting<Arc<vmmalloc_device::host::HostDevice>>;

/// The allocator of [`split_script`]'s first steps over a 64 MiB host device
/// (real memory) behind a fault injector: 28 MiB live, 24 MiB freed (three
/// 8 MiB chunks), so that a 4 MiB block splits the first of them.
fn host_split_setup() -> (
    Arc<HostDev>,
    ExpandableAllocator<Arc<HostDev>>,
    vmmalloc_alloc::Allocation,
) {
    use vmmalloc_device::host::{HostConfig, HostDevice};
    let host = HostDevice::new(HostConfig::with_capacity(64 * MIB)).expect("host device");
    let dev = Arc::new(FaultInjecting::with_plan(Arc::new(host), FaultPlan::None));
    let a = ExpandableAllocator::new(dev.clone(), split_cfg()).unwrap();
    let live = a.malloc(28 * MIB, Stream::DEFAULT).unwrap();
    let freed = a.malloc(24 * MIB, Stream::DEFAULT).unwrap();
    a.free(freed.ptr).unwrap();
    (dev, a, live)
}

/// A panic inside the device call of a chunk split (a bug between "unmap
/// the old chunk" and "map its pieces") fails the allocator for good: that
/// call and every later one return `AllocError::Failed` naming the panic, no
/// memory is handed out, and what the panic left stays readable.
#[test]
fn a_panic_inside_a_split_fails_the_allocator_for_good() {
    // Without the fault the 4 MiB request splits, and creates a handle.
    let (dev, a, _) = host_split_setup();
    let creates = dev.hook().seen(Call::Create);
    let x = a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(a.stats().chunk_splits, 1);
    assert!(dev.hook().seen(Call::Create) > creates, "the split creates");
    a.free(x.ptr).unwrap();
    a.validate().unwrap();
    assert_eq!(a.failure(), None);
    drop(a);

    let (dev, a, live) = host_split_setup();
    let n = dev.hook().seen(Call::Create) + 1;
    dev.hook().set_plan(FaultPlan::Nth {
        call: Call::Create,
        n,
        kind: FaultKind::Panic,
    });
    let e = a.malloc(4 * MIB, Stream::DEFAULT).unwrap_err();
    assert_eq!(
        dev.hook().injected(),
        1,
        "the panic came from the split's create"
    );
    let why = "a panic in malloc: injected panic in create";
    assert!(matches!(&e, AllocError::Failed(m) if m == why), "{e}");
    assert_eq!(a.failure(), Some(why));
    dev.hook().set_plan(FaultPlan::None);
    // Every later call fails the same way and hands nothing out.
    let calls_before = dev.hook().seen(Call::Map) + dev.hook().seen(Call::Unmap);
    for r in [
        a.malloc(512, Stream::DEFAULT).map(|_| ()),
        a.malloc(64 * MIB, Stream::DEFAULT).map(|_| ()),
        a.free(live.ptr),
        a.record_stream(live.ptr, Stream::DEFAULT),
        a.empty_cache(),
        a.set_memory_fraction(0.5),
        a.pause(&[], false).map(|_| ()),
    ] {
        match r {
            Err(AllocError::Failed(m)) => assert_eq!(m, why),
            other => panic!("a failed allocator answered {other:?}"),
        }
    }
    assert_eq!(
        dev.hook().seen(Call::Map) + dev.hook().seen(Call::Unmap),
        calls_before,
        "a failed allocator touches no mapping"
    );
    let v = a.validate().unwrap_err();
    assert!(v.contains(why), "{v}");
    // What the panic left is readable: the live block is still counted.
    assert_eq!(a.stats().allocation.all().current, 1);
    assert!(!a.snapshot().segments.is_empty());
    a.reset_peak_stats();
    // Dropping it does not panic (its teardown is tried under catch_unwind).
    drop(a);
}
