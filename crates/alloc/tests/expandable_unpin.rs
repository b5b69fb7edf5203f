//! Unpinning (`unpin.rs`): a chunk that live blocks hold only in part gives
//! its free pages back when memory runs short; the live pages move to exact
//! chunks at the same addresses with their bytes. On `sim` (calls, counters,
//! the stream rule), on `host` (real bytes, both the path with room beside
//! the old chunk and the one that releases it first), and under fault
//! injection on both.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Stream};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill, Harness, Op};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
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

/// The pinned scenario on a 1 GiB `sim` device under `cfg`: six 128 MiB
/// blocks live on a new stream, a 128 MiB block freed, and a 16 MiB block
/// carved from its chunk (pinning it). Returns the device, the allocator,
/// the stream, the live blocks and the 16 MiB block.
fn pinned(cfg: ExpandableConfig) -> (Arc<SimDevice>, Sim, Stream, Vec<Allocation>, Allocation) {
    let dev = Arc::new(SimDevice::with_capacity(1024 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let s = dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
    let big = a.malloc(128 * MIB, s).unwrap();
    a.free(big.ptr).unwrap();
    let before = dev.counts();
    let small = a.malloc(16 * MIB, s).unwrap();
    assert_eq!(small.ptr, big.ptr);
    assert_eq!(dev.counts().since(&before).total(), 0, "pinned: no call");
    (dev, a, s, live, small)
}

/// The allocator of [`pinned`].
type Sim = ExpandableAllocator<Arc<SimDevice>>;

/// On a 1 GiB device: six 128 MiB blocks live, a freed 128 MiB chunk (one
/// handle) with a 16 MiB block carved from its start. Without splitting
/// (the default) the 16 MiB block pins the whole chunk and costs no call.
/// A 200 MiB request on another stream then lacks 72 MiB that no whole free
/// chunk holds: the allocator synchronizes the device once, gives the
/// 16 MiB block a chunk of its own at the same address and pools the
/// 128 MiB handle, whose 112 free MiB serve the request.
#[test]
fn a_pinned_chunk_gives_its_free_pages_back_when_memory_runs_short() {
    let (dev, a, s, live, small) = pinned(exact());
    // Kernels still queued on `s` use the small block: the device model
    // refuses to unmap its pages until they are waited for.
    dev.streams().submit(s, small.ptr, small.size).unwrap();
    let other = dev.create_stream().unwrap();
    let before = dev.counts();
    let y = a
        .malloc(200 * MIB, other)
        .expect("the pinned chunk's free pages come back");
    let c = dev.counts().since(&before);
    let st = a.stats();
    assert_eq!(st.chunk_unpins, 1);
    assert_eq!(st.unpinned_bytes, 112 * MIB);
    assert_eq!(st.unpin_copied_bytes, 16 * MIB);
    assert_eq!(st.unpin_device_syncs, 1);
    assert_eq!(st.num_sync_all_streams, 0, "PyTorch's counter is not ours");
    assert_eq!(c.get(Call::DeviceSync), 1);
    assert_eq!(c.get(Call::StreamSync), 0, "the device sync waited for all");
    assert_eq!(
        (
            c.get(Call::CopyDtoD),
            c.get(Call::CopyDtoH),
            c.get(Call::CopyHtoD)
        ),
        (1, 0, 0),
        "with room, the live run is copied on the device (charged; `sim` holds no bytes)"
    );
    assert_eq!(
        (c.get(Call::Reserve), c.get(Call::AddressFree)),
        (1, 1),
        "through a scratch reservation"
    );
    a.validate().unwrap();
    assert_eq!(
        a.stats().pages_mapped * 2 * MIB,
        6 * 128 * MIB + 16 * MIB + 200 * MIB
    );
    for p in [small.ptr, y.ptr]
        .into_iter()
        .chain(live.iter().map(|l| l.ptr))
    {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
    drop(a);
    assert!(dev.live().is_empty());
}

/// With `unpin: false` the same request fails, and the report says so.
#[test]
fn without_unpinning_the_pinned_pages_stay_out_of_reach() {
    let (dev, a, _s, _live, _small) = pinned(ExpandableConfig {
        unpin: vmmalloc_alloc::expandable::UnpinMode::Never,
        ..exact()
    });
    let other = dev.create_stream().unwrap();
    let e = a.malloc(200 * MIB, other).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    assert!(
        e.to_string().contains(
            "112.00 MiB of free pages sit in chunks that live tensors hold in part: unpin:auto or unpin:always"
        ),
        "{e}"
    );
    assert_eq!(a.stats().chunk_unpins, 0);
    assert_eq!(dev.counts().get(Call::DeviceSync), 0);
    a.validate().unwrap();
}

/// Blocks another stream uses (`record_stream`) never move: their chunk
/// stays pinned and the request fails.
#[test]
fn blocks_used_on_other_streams_are_never_moved() {
    let (dev, a, _s, _live, small) = pinned(exact());
    let other = dev.create_stream().unwrap();
    a.record_stream(small.ptr, other).unwrap();
    assert!(matches!(
        a.malloc(200 * MIB, other),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(a.stats().chunk_unpins, 0);
    a.validate().unwrap();
}

/// Nothing moves while a stream captures a CUDA graph (a synchronize
/// would invalidate the capture): the request fails instead, and succeeds
/// once the capture has ended.
#[test]
fn nothing_moves_during_a_graph_capture() {
    let (dev, a, _s, _live, _small) = pinned(exact());
    let other = dev.create_stream().unwrap();
    let _warm = a.malloc(MIB + 512, other).unwrap();
    dev.begin_capture(other).unwrap();
    assert!(matches!(
        a.malloc(200 * MIB, other),
        Err(AllocError::OutOfMemory(_))
    ));
    assert_eq!(dev.counts().get(Call::DeviceSync), 0);
    dev.end_capture(other).unwrap();
    a.validate().unwrap();
    a.malloc(200 * MIB, other).expect("after the capture");
    assert_eq!(a.stats().chunk_unpins, 1);
    a.validate().unwrap();
}

/// On `host` (real bytes; the largest chunk is 8 MiB, an eighth of the
/// device): an 8 MiB chunk freed, a 2 MiB block carved from it (pinning it)
/// beside a live 48 MiB block, both filled with a pattern. A request on
/// another stream that needs more than the unmapped memory moves the 2 MiB
/// block's page. With 48 MiB live there is room beside the old chunk (new
/// chunk first, old one pooled); with 56 MiB every page is mapped, so the
/// old chunk is released first. Either way every byte of both live
/// blocks survives.
#[test]
fn unpinning_keeps_every_live_byte_with_and_without_room() {
    for (live, request, released) in [(48 * MIB, 12 * MIB, 0), (56 * MIB, 6 * MIB, 1)] {
        let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(64 * MIB)).unwrap());
        let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
        let x = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
        let c = a.malloc(live, Stream::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        let b = a.malloc(2 * MIB, Stream::DEFAULT).unwrap();
        assert_eq!(b.ptr, x.ptr, "carved from the freed chunk");
        pattern_fill(&*dev, 1, b.ptr, b.size).unwrap();
        pattern_fill(&*dev, 2, c.ptr, c.size).unwrap();
        let other = dev.create_stream().unwrap();
        let before = dev.counts();
        let y = a
            .malloc(request, other)
            .unwrap_or_else(|e| panic!("{live} live: {e}"));
        let calls = dev.counts().since(&before);
        assert_eq!(a.stats().chunk_unpins, 1, "{live} live");
        assert_eq!(calls.get(Call::Release), released, "{live} live: {calls:?}");
        // With room the bytes move on the device, without it through the host.
        assert_eq!(
            (calls.get(Call::CopyDtoD), calls.get(Call::CopyDtoH)),
            if released == 0 { (1, 0) } else { (0, 1) },
            "{live} live: {calls:?}"
        );
        pattern_check(&*dev, 1, b.ptr, b.size).unwrap();
        pattern_check(&*dev, 2, c.ptr, c.size).unwrap();
        pattern_fill(&*dev, 3, y.ptr, y.size).unwrap();
        a.validate().unwrap();
        for p in [b.ptr, c.ptr, y.ptr] {
            a.free(p).unwrap();
        }
        a.validate().unwrap();
        drop(a);
        assert!(dev.live().is_empty());
    }
}

/// The script of the host test as harness operations: every live block
/// carries a pattern the harness checks after pages move.
fn unpin_script(live: u64, request: u64) -> Vec<Op> {
    use Op::*;
    let m = |size| Malloc { size, stream: 0 };
    vec![
        m(8 * MIB), // slot 0: one 8 MiB chunk
        m(live),    // slot 1
        Submit { slot: 1 },
        Free { slot: 0 },
        m(2 * MIB), // slot 2: pins slot 0's chunk
        Submit { slot: 2 },
        Malloc {
            size: request,
            stream: 1,
        }, // unpins
        Free { slot: 2 },
        EmptyCache,
    ]
}

/// Runs `unpin_script` over a fault-injecting `dev` with `plan`; returns
/// the calls seen or the first broken invariant (bytes included on host).
fn run_faulty<D: Device + Introspect + 'static>(
    inner: Arc<D>,
    plan: FaultPlan,
    (live, request): (u64, u64),
) -> Result<FaultInjecting<Arc<D>>, String> {
    let dev = FaultInjecting::with_plan(inner, FaultPlan::None);
    {
        let a = ExpandableAllocator::new(&dev, exact()).map_err(|e| e.to_string())?;
        // The harness fills and checks bytes through the device itself:
        // only the allocator's calls fail.
        let mut h = Harness::new(&a, &**dev.inner(), 2)?;
        h.tolerate_device_errors = true;
        dev.hook().set_plan(plan);
        for (i, op) in unpin_script(live, request).iter().enumerate() {
            let out = h.apply(op).map_err(|e| format!("step {i} {op:?}: {e}"))?;
            h.check()
                .map_err(|e| format!("after step {i} {op:?} ({out:?}): {e}"))?;
            h.verify_all()
                .map_err(|e| format!("bytes after step {i} {op:?}: {e}"))?;
        }
    }
    if !dev.inner().live().is_empty() {
        return Err(format!(
            "after drop the device holds {:?}",
            dev.inner().live()
        ));
    }
    Ok(dev)
}

/// Every call of the unpinning script fails once (driver error, then
/// out-of-memory), on `sim` and on `host`, with and without room beside
/// the old chunk: the state is
/// valid after every step, every live byte survives, nothing leaks.
#[test]
fn every_failed_call_of_an_unpin_is_survived() {
    let host = || Arc::new(HostDevice::new(HostConfig::with_capacity(64 * MIB)).unwrap());
    let sim = || Arc::new(SimDevice::with_capacity(64 * MIB));
    for (name, runs) in [
        ("sim, no room", sweep((56 * MIB, 6 * MIB), sim)),
        ("host, room", sweep((48 * MIB, 12 * MIB), host)),
        ("host, no room", sweep((56 * MIB, 6 * MIB), host)),
    ] {
        let runs = runs.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(runs > 20, "{name}: {runs}");
    }
}

/// The clean run (which must unpin), then one run per failing call.
fn sweep<D: Device + Introspect + 'static>(
    sizes: (u64, u64),
    make: impl Fn() -> Arc<D>,
) -> Result<usize, String> {
    let clean = run_faulty(make(), FaultPlan::None, sizes)?;
    if clean.hook().seen(Call::DeviceSync) == 0 {
        return Err("the clean run did not unpin".into());
    }
    let mut runs = 0;
    for &call in Call::ALL.iter().filter(|c| **c != Call::StreamCreate) {
        for n in 1..=clean.hook().seen(call) {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                run_faulty(make(), FaultPlan::Nth { call, n, kind }, sizes)
                    .map_err(|e| format!("{call} #{n} failing with {kind:?}: {e}"))?;
                runs += 1;
            }
        }
    }
    Ok(runs)
}

/// The one case that loses bytes: with no room, the old chunk is released
/// first, and then the device refuses every create (the new chunk, the old
/// size again, and host memory). The request fails with the driver's error,
/// the lost pages are recorded as unmapped (so `validate()` names the live
/// block left without memory instead of a bookkeeping mismatch), and
/// nothing leaks at drop.
#[test]
fn a_device_that_refuses_every_create_after_the_release_loses_only_that_chunk() {
    let inner = Arc::new(SimDevice::with_capacity(64 * MIB));
    let dev = FaultInjecting::with_plan(inner.clone(), FaultPlan::None);
    {
        let a = ExpandableAllocator::new(&dev, exact()).unwrap();
        let x = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
        let _c = a.malloc(56 * MIB, Stream::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        let _b = a.malloc(2 * MIB, Stream::DEFAULT).unwrap();
        a.validate().unwrap();
        let s = dev.create_stream().unwrap();
        dev.hook().set_plan(FaultPlan::Random {
            calls: vec![Call::Create],
            p: 1.0,
            seed: 1,
            kind: FaultKind::OutOfMemory,
        });
        assert!(a.malloc(6 * MIB, s).is_err());
        dev.hook().set_plan(FaultPlan::None);
        let e = a.validate().unwrap_err();
        assert!(e.contains("is not fully mapped"), "{e}");
        assert_eq!(a.stats().chunk_unpins, 0);
    }
    assert!(inner.live().is_empty(), "{:?}", inner.live());
}
