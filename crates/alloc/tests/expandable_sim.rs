//! The expandable allocator's worked scenarios on the `sim` device, one test
//! per case of the spec (issue 3 and docs/expandable.md).

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig, DEFAULT_SPLIT_SLACK};
use vmmalloc_alloc::{AllocError, Allocator, BlockState, StatType, Stream};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, CallCounts, Device, Introspect, GIB, MIB};

/// The default options without mapping ahead (`grow_granule: 0`): each
/// block maps exactly the pages it needs, so the layouts these tests
/// count are exact.
fn exact() -> ExpandableConfig {
    ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    }
}

type Alloc = ExpandableAllocator<Arc<SimDevice>>;

fn setup(capacity: u64, cfg: ExpandableConfig) -> (Arc<SimDevice>, Alloc) {
    let dev = Arc::new(SimDevice::with_capacity(capacity));
    let a = ExpandableAllocator::new(dev.clone(), cfg).expect("valid options");
    (dev, a)
}

fn since(dev: &SimDevice, before: &CallCounts) -> CallCounts {
    dev.counts().since(before)
}

#[test]
fn cache_hit_reuses_the_block_without_device_calls() {
    let (dev, a) = setup(GIB, exact());
    let x = a.malloc(MIB, Stream::DEFAULT).unwrap();
    assert_eq!(x.size, MIB);
    a.free(x.ptr).unwrap();
    let before = dev.counts();
    for _ in 0..100 {
        let y = a.malloc(MIB, Stream::DEFAULT).unwrap();
        assert_eq!(y.ptr, x.ptr);
        a.free(y.ptr).unwrap();
    }
    assert_eq!(since(&dev, &before).total(), 0);
    a.validate().unwrap();
    // The allocator's own count of device calls matches the device's.
    assert_eq!(a.stats().driver_calls, dev.counts());
}

#[test]
fn blocks_split_and_merge_at_512_bytes() {
    let (_dev, a) = setup(GIB, exact());
    let s = Stream::DEFAULT;
    let x = a.malloc(1, s).unwrap();
    let y = a.malloc(513, s).unwrap();
    let z = a.malloc(512, s).unwrap();
    assert_eq!((x.size, y.size, z.size), (512, 1024, 512));
    assert_eq!(y.ptr, x.ptr + 512);
    assert_eq!(z.ptr, y.ptr + 1024);
    a.free(y.ptr).unwrap();
    a.validate().unwrap();
    // The 1 KiB hole is reused by best fit before the tail.
    let w = a.malloc(1000, s).unwrap();
    assert_eq!(w.ptr, y.ptr);
    a.free(x.ptr).unwrap();
    a.free(w.ptr).unwrap();
    a.free(z.ptr).unwrap();
    a.validate().unwrap();
    // Everything merged back: one segment, one free block (mapped page + unmapped rest).
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    let kinds: Vec<BlockState> = snap.segments[0].blocks.iter().map(|b| b.state).collect();
    assert_eq!(kinds, vec![BlockState::Inactive, BlockState::Unmapped]);
    assert_eq!(snap.segments[0].blocks[0].size, 2 * MIB);
    let st = a.stats();
    assert_eq!(st.inactive_split.all().current, 0);
    assert_eq!(
        st.reserved_bytes.get(StatType::Small).current,
        2 * MIB as i64
    );
}

/// The fragmentation scenario of docs/expandable.md: a 1 GiB device filled
/// with 8 MiB blocks, every other one freed (512 MiB free in 64 gaps of
/// 8 MiB), then one 256 MiB request — larger than any gap, smaller than the
/// free total. Each 8 MiB block was backed by one 8 MiB chunk, so each gap is
/// a whole free chunk: the request succeeds by moving 32 of them (128 pages),
/// waiting only for the one stream that used them; no device-wide
/// synchronize, no create, no release.
#[test]
fn fragmentation_scenario_succeeds_without_device_sync() {
    let (dev, a) = setup(GIB, exact());
    let s = dev.create_stream().unwrap();
    let blocks: Vec<_> = (0..128).map(|_| a.malloc(8 * MIB, s).unwrap()).collect();
    assert_eq!(dev.mem_info().unwrap().free, 0, "the device is full");
    assert!(a.malloc(8 * MIB, s).unwrap_err().is_out_of_memory());
    // Kernels still queued on the stream use every block.
    for b in &blocks {
        dev.streams().submit(s, b.ptr, b.size).unwrap();
    }
    for b in blocks.iter().step_by(2) {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
    let st = a.stats();
    assert_eq!(st.allocated_bytes.all().current as u64, 512 * MIB);
    assert_eq!(st.reserved_bytes.all().current as u64, GIB);
    let (before, us) = (dev.counts(), dev.modeled_us());
    let big = a.malloc(256 * MIB, s).expect("enough pages are free");
    let c = since(&dev, &before);
    eprintln!(
        "fragmentation scenario: calls {:?}, modeled driver time {:.0} us",
        c.nonzero(),
        dev.modeled_us() - us
    );
    assert_eq!(c.get(Call::DeviceSync), 0);
    assert_eq!(
        c.get(Call::StreamSync),
        1,
        "one wait for the stream that used the pages"
    );
    assert_eq!(
        (c.get(Call::Create), c.get(Call::Release)),
        (0, 0),
        "pages move, never re-created"
    );
    assert_eq!(c.get(Call::Unmap), 32, "one unmap per reclaimed 8 MiB gap");
    assert_eq!(c.get(Call::Map), 32, "one map per moved 8 MiB chunk");
    assert_eq!(
        c.get(Call::SetAccess),
        1,
        "one set_access for the contiguous run"
    );
    let st = a.stats();
    assert_eq!((st.reclaims, st.reclaimed_bytes), (1, 256 * MIB));
    assert_eq!(st.num_sync_all_streams, 0);
    assert_eq!(st.reserved_bytes.all().current as u64, GIB);
    a.validate().unwrap();
    // Least recently freed first: the first 32 gaps were unmapped, the last 32 stay mapped.
    let snap = a.snapshot();
    let gap_state = |i: usize| {
        let ptr = blocks[2 * i].ptr;
        snap.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .find(|b| b.address <= ptr && ptr < b.address + b.size)
            .map(|b| b.state)
            .unwrap()
    };
    assert!((0..32).all(|i| gap_state(i) == BlockState::Unmapped));
    assert!((32..64).all(|i| gap_state(i) == BlockState::Inactive));
    a.free(big.ptr).unwrap();
    for b in blocks.iter().skip(1).step_by(2) {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
    drop(a);
    assert!(dev.live().is_empty());
}

/// One iteration of a training-like workload over two streams: weights-like
/// long-lived blocks, activations of many sizes freed out of order.
fn iteration(a: &Alloc, streams: [Stream; 2], step: u64) -> Vec<u64> {
    let sizes = [
        4096,
        300 * MIB,
        1 << 20,
        3 * MIB + 17,
        128,
        64 * MIB,
        700 << 10,
        12 * MIB,
        33,
        150 * MIB,
    ];
    let mut live = Vec::new();
    let mut kept = Vec::new();
    for (i, &sz) in sizes.iter().enumerate() {
        let s = streams[i % 2];
        live.push(a.malloc(sz + step % 3, s).unwrap().ptr);
        if i % 3 == 2 {
            a.free(live.remove(i % live.len())).unwrap();
        }
    }
    kept.push(live.pop().unwrap());
    for p in live {
        a.free(p).unwrap();
    }
    kept
}

#[test]
fn steady_state_second_iteration_makes_no_device_calls() {
    let (dev, a) = setup(80 * GIB, exact());
    let streams = [Stream::DEFAULT, dev.create_stream().unwrap()];
    let first = iteration(&a, streams, 0);
    for p in first {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
    let before = dev.counts();
    let second = iteration(&a, streams, 0);
    assert_eq!(
        since(&dev, &before).total(),
        0,
        "{:?}",
        since(&dev, &before).nonzero()
    );
    for p in second {
        a.free(p).unwrap();
    }
    assert_eq!(since(&dev, &before).total(), 0);
    a.validate().unwrap();
}

/// 1000 iterations of a varying-size workload: 20 cycles of the same 50
/// iteration shapes (sequence lengths), so demand repeats exactly. Reserved
/// memory must stay flat: no cycle after the warm-up maps more than the
/// warm-up did.
#[test]
fn no_creep_over_1000_iterations_of_varying_sizes() {
    let (dev, a) = setup(16 * GIB, exact());
    let s = Stream::DEFAULT;
    let weights: Vec<u64> = (0..8)
        .map(|i| a.malloc((i + 1) * 37 * MIB, s).unwrap().ptr)
        .collect();
    let mut carried: Vec<u64> = Vec::new();
    let mut cycle_max = vec![0i64; 20];
    let mut calls_after_warmup = CallCounts::default();
    for it in 0..1000u64 {
        if it == 100 {
            calls_after_warmup = dev.counts();
        }
        // The shape of iteration `it` depends only on `it % 50`.
        let mut rng = vmmalloc_alloc_harness::SplitMix(1000 + it % 50);
        let seq = 1 + rng.below(64);
        let mut acts = Vec::new();
        for layer in 0..12u64 {
            let sz = seq * (256 << 10) * (1 + layer % 3) + rng.below(4096);
            acts.push(a.malloc(sz, s).unwrap().ptr);
            if layer % 4 == 3 {
                let i = rng.below(acts.len() as u64) as usize;
                a.free(acts.swap_remove(i)).unwrap();
            }
        }
        // Frees in a shuffled order; one block lives into the next iteration.
        while acts.len() > 1 {
            let i = rng.below(acts.len() as u64) as usize;
            a.free(acts.swap_remove(i)).unwrap();
        }
        for p in carried.drain(..) {
            a.free(p).unwrap();
        }
        carried.extend(acts);
        let c = &mut cycle_max[(it / 50) as usize];
        *c = (*c).max(a.stats().reserved_bytes.all().current);
        if it % 250 == 0 {
            a.validate().unwrap();
        }
    }
    eprintln!(
        "max reserved per 50-iteration cycle (MiB): {:?}",
        cycle_max.iter().map(|r| r >> 20).collect::<Vec<_>>()
    );
    let warm = cycle_max[0].max(cycle_max[1]);
    assert!(
        cycle_max[2..].iter().all(|&r| r <= warm),
        "reserved memory crept past the warm-up's {warm} bytes: {cycle_max:?}"
    );
    let later = dev.counts().since(&calls_after_warmup);
    assert_eq!(
        later.total(),
        0,
        "device calls after the warm-up: {:?}",
        later.nonzero()
    );
    assert_eq!(a.stats().num_ooms, 0);
    for p in carried.into_iter().chain(weights) {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
    drop(a);
    assert!(dev.live().is_empty());
}

/// Work queued on stream A uses the pages of A's freed blocks. A reclaim for
/// stream B must wait for A (one stream sync), never for the device, and must
/// not stall stream C, which owns none of those pages.
#[test]
fn reclaim_waits_only_for_the_stream_that_used_the_pages() {
    let (dev, a) = setup(256 * MIB, exact());
    let (sa, sb, sc) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let c_block = a.malloc(16 * MIB, sc).unwrap();
    dev.streams().submit(sc, c_block.ptr, c_block.size).unwrap();
    let a_blocks: Vec<_> = (0..15).map(|_| a.malloc(16 * MIB, sa).unwrap()).collect();
    for b in &a_blocks {
        dev.streams().submit(sa, b.ptr, b.size).unwrap();
        a.free(b.ptr).unwrap();
    }
    // The model refuses to unmap pages that queued work uses.
    let err = dev.unmap(a_blocks[0].ptr, 16 * MIB).unwrap_err();
    assert_eq!(
        err.broken_rule(),
        Some(vmmalloc_device::Rule::InUseByStream)
    );
    let before = dev.counts();
    let on_b = a.malloc(100 * MIB, sb).expect("A's free pages move to B");
    let c = since(&dev, &before);
    assert_eq!(c.get(Call::DeviceSync), 0);
    assert_eq!(c.get(Call::StreamSync), 1);
    assert_eq!(dev.streams().pending_items(sa), 0, "A was waited for");
    assert_eq!(dev.streams().pending_items(sc), 1, "C was not stalled");
    assert_eq!(a.stats().num_stream_syncs, 1);
    a.validate().unwrap();
    // A second reclaim of A's pages needs no new wait: nothing was freed on A since.
    let before = dev.counts();
    let more = a.malloc(100 * MIB, sb).unwrap();
    assert_eq!(since(&dev, &before).syncs(), 0);
    for p in [on_b.ptr, more.ptr, c_block.ptr] {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

#[test]
fn record_stream_delays_reuse_until_the_event_completes() {
    let (dev, a) = setup(GIB, exact());
    let (sa, sb) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = a.malloc(MIB, sa).unwrap();
    a.record_stream(x.ptr, sb).unwrap();
    a.record_stream(x.ptr, sa).unwrap(); // its own stream: nothing to do
    dev.streams().submit(sb, x.ptr, x.size).unwrap();
    let before = dev.counts();
    a.free(x.ptr).unwrap();
    let c = since(&dev, &before);
    assert_eq!((c.get(Call::EventCreate), c.get(Call::EventRecord)), (1, 1));
    assert_eq!(
        a.stats().active.all().current,
        1,
        "pending free is still active"
    );
    assert_eq!(a.stats().allocation.all().current, 0);
    a.validate().unwrap();
    let y = a.malloc(MIB, sa).unwrap();
    assert_ne!(y.ptr, x.ptr, "the block waits for stream B");
    let snap = a.snapshot();
    assert!(snap.segments[0]
        .blocks
        .iter()
        .any(|b| b.state == BlockState::ActivePendingFree));
    dev.streams().complete(sb).unwrap();
    let z = a.malloc(MIB, sa).unwrap();
    assert_eq!(z.ptr, x.ptr, "reused once the event completed");
    a.validate().unwrap();
    // The event went back to the pool: the next record_stream creates none.
    a.record_stream(z.ptr, sb).unwrap();
    let before = dev.counts();
    a.free(z.ptr).unwrap();
    assert_eq!(since(&dev, &before).get(Call::EventCreate), 0);
    a.free(y.ptr).unwrap();
    drop(a);
    assert!(dev.live().is_empty());
    assert_eq!(dev.streams().live_events(), 0);
}

#[test]
fn pending_frees_are_waited_for_before_giving_up() {
    let (dev, a) = setup(64 * MIB, exact());
    let (sa, sb) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = a.malloc(48 * MIB, sa).unwrap();
    a.record_stream(x.ptr, sb).unwrap();
    dev.streams().submit(sb, x.ptr, x.size).unwrap();
    a.free(x.ptr).unwrap();
    // Only the pending block's pages can serve this: wait for its event (no device sync).
    let y = a.malloc(40 * MIB, sa).unwrap();
    let c = dev.counts();
    assert_eq!(c.get(Call::DeviceSync), 0);
    assert_eq!(c.get(Call::EventSync), 1);
    a.free(y.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn out_of_memory_explains_itself() {
    let (dev, a) = setup(64 * MIB, exact());
    let s = dev.create_stream().unwrap();
    let live = a.malloc(40 * MIB, s).unwrap();
    let small = a.malloc(1000, Stream::DEFAULT).unwrap();
    let e = a.malloc(30 * MIB, s).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else {
        panic!("{e}")
    };
    assert_eq!(r.policy, "expandable");
    assert_eq!(
        (r.requested, r.rounded, r.capacity),
        (30 * MIB, 30 * MIB, 64 * MIB)
    );
    assert_eq!(r.live, 40 * MIB + 1024);
    assert_eq!(r.pooled, 0);
    assert_eq!(
        r.cached,
        2 * MIB - 1024,
        "the small pool's page is mapped but mostly free"
    );
    assert_eq!(r.largest_free, 2 * MIB - 1024);
    assert_eq!(r.per_stream.len(), 2);
    let mine = r.per_stream.iter().find(|u| u.stream == s).unwrap();
    assert_eq!((mine.live, mine.cached), (40 * MIB, 0));
    let text = e.to_string();
    eprintln!("{text}");
    assert!(text.contains("Tried to allocate 30.00 MiB"), "{text}");
    assert!(text.contains("Live tensors"), "{text}");
    // 15 pages needed; 21 mapped (20 live + the small pool's), 32 in all, none reclaimable.
    assert!(
        text.contains("8.00 MiB of physical pages (4 pages of 2.00 MiB) were lacking"),
        "{text}"
    );
    assert_eq!(a.stats().num_ooms, 1);
    a.validate().unwrap();
    // Nothing was lost: freeing makes room.
    a.free(live.ptr).unwrap();
    let ok = a.malloc(30 * MIB, s).unwrap();
    for p in [ok.ptr, small.ptr] {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

#[test]
fn memory_fraction_caps_mapped_plus_pooled_pages() {
    let cfg = ExpandableConfig {
        memory_fraction: 0.5,
        ..exact()
    };
    let (dev, a) = setup(GIB, cfg);
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let e = a.malloc(600 * MIB, s1).unwrap_err();
    let AllocError::OutOfMemory(r) = e else {
        panic!()
    };
    // PyTorch's wording: the device's capacity, then "<limit> allowed".
    assert_eq!(r.capacity, GIB);
    assert_eq!(r.allowed, Some(512 * MIB));
    assert!(r.hint.contains("memory fraction"), "{}", r.hint);
    let x = a.malloc(400 * MIB, s1).unwrap();
    a.free(x.ptr).unwrap();
    // 400 MiB mapped but free on s1: a 300 MiB request on s2 must reclaim, not create past 512 MiB.
    let y = a.malloc(300 * MIB, s2).unwrap();
    let st = a.stats();
    assert!(st.reclaims >= 1);
    assert!((st.pages_mapped + st.pages_pooled) * 2 * MIB <= 512 * MIB);
    assert!(dev.live().physical_bytes <= 512 * MIB);
    // Lowering the fraction releases pooled pages above the new cap.
    a.set_memory_fraction(0.25).unwrap();
    assert!(a.set_memory_fraction(-0.1).is_err());
    assert!(a.set_memory_fraction(f64::NAN).is_err());
    assert!(a.set_memory_fraction(1.5).is_err());
    a.free(y.ptr).unwrap();
    let z = a.malloc(200 * MIB, s1).unwrap();
    a.validate().unwrap();
    a.free(z.ptr).unwrap();
    a.empty_cache().unwrap();
    a.set_memory_fraction(1.0).unwrap();
    a.validate().unwrap();
}

#[test]
fn one_set_access_per_contiguous_run_and_page_size_option() {
    let (dev, a) = setup(GIB, exact());
    let x = a.malloc(64 * MIB, Stream::DEFAULT).unwrap();
    let c = dev.counts();
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (1, 1, 1),
        "one 64 MiB chunk backs the block"
    );
    a.free(x.ptr).unwrap();
    // With 2 MiB chunks the same block takes 32 handles, and still one set_access.
    let (dev2, a2) = setup(
        GIB,
        ExpandableConfig {
            max_chunk: Some(2 * MIB),
            ..exact()
        },
    );
    let y = a2.malloc(64 * MIB, Stream::DEFAULT).unwrap();
    let c = dev2.counts();
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (32, 32, 1)
    );
    a2.free(y.ptr).unwrap();

    let cfg = ExpandableConfig {
        page_size: Some(8 * MIB),
        ..exact()
    };
    let (dev, a) = setup(GIB, cfg);
    assert_eq!(a.page_size(), 8 * MIB);
    let x = a.malloc(1, Stream::DEFAULT).unwrap();
    let y = a.malloc(9 * MIB, Stream::DEFAULT).unwrap();
    let c = dev.counts();
    assert_eq!(
        c.get(Call::Create),
        2,
        "one 8 MiB page for the small pool, one 16 MiB chunk of two pages for the large"
    );
    assert_eq!(dev.live().physical_bytes, 24 * MIB);
    a.validate().unwrap();
    for p in [x.ptr, y.ptr] {
        a.free(p).unwrap();
    }
    drop(a);
    assert!(dev.live().is_empty());
}

#[test]
fn bad_options_and_inputs_are_errors_that_change_nothing() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    for (cfg, key) in [
        (
            ExpandableConfig {
                page_size: Some(3 * MIB),
                ..Default::default()
            },
            "page_size",
        ),
        (
            ExpandableConfig {
                arena_size: Some(MIB),
                ..Default::default()
            },
            "arena_size",
        ),
        (
            ExpandableConfig {
                memory_fraction: 2.0,
                ..Default::default()
            },
            "memory_fraction",
        ),
    ] {
        match ExpandableAllocator::new(dev.clone(), cfg) {
            Err(AllocError::InvalidOption(m)) => assert!(m.contains(key), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted a bad {key}"),
        }
    }
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    assert!(matches!(
        a.malloc(0, Stream::DEFAULT),
        Err(AllocError::InvalidSize { .. })
    ));
    // Beyond the device: an out-of-memory, counted and explained.
    match a.malloc(GIB + 1, Stream::DEFAULT) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!(r.requested, GIB + 1);
            assert!(r.hint.contains("request alone exceeds"), "{}", r.hint);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.stats().num_ooms, 1);
    let x = a.malloc(100, Stream::DEFAULT).unwrap();
    assert!(matches!(
        a.free(x.ptr + 512),
        Err(AllocError::InvalidPointer { .. })
    ));
    assert!(matches!(
        a.record_stream(0xdead000, Stream::DEFAULT),
        Err(AllocError::InvalidPointer { .. })
    ));
    a.free(x.ptr).unwrap();
    assert!(matches!(
        a.free(x.ptr),
        Err(AllocError::InvalidPointer { .. })
    ));
    a.validate().unwrap();
    assert_eq!(a.stats().allocation.all().current, 0);
}

#[test]
fn a_fragmented_slice_opens_another_segment() {
    let (dev, a) = setup(64 * MIB, exact());
    let s = Stream::DEFAULT;
    let b: Vec<_> = (0..3).map(|_| a.malloc(16 * MIB, s).unwrap()).collect();
    a.free(b[1].ptr).unwrap();
    // No gap in the 64 MiB slice holds 24 MiB (16 MiB hole, 16 MiB tail): a
    // second segment opens and takes 4 pages from the hole.
    let c = a.malloc(24 * MIB, s).unwrap();
    assert_eq!(a.stats().segment.all().current, 2);
    assert_eq!(a.stats().reclaimed_bytes, 8 * MIB);
    assert_eq!(dev.counts().get(Call::DeviceSync), 0);
    a.validate().unwrap();
    for p in [b[0].ptr, b[2].ptr, c.ptr] {
        a.free(p).unwrap();
    }
    a.empty_cache().unwrap();
    assert!(
        dev.live().is_empty(),
        "empty_cache gives back pages, segments and arenas"
    );
    assert_eq!(a.stats().segment.all().current, 0);
    a.validate().unwrap();
    // And it starts again from nothing.
    let d = a.malloc(10 * MIB, s).unwrap();
    a.free(d.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn address_space_runs_out_only_into_another_arena() {
    let cfg = ExpandableConfig {
        arena_size: Some(GIB),
        ..exact()
    };
    let (dev, a) = setup(GIB, cfg);
    let mut ptrs = Vec::new();
    for _ in 0..5 {
        let s = dev.create_stream().unwrap();
        ptrs.push(a.malloc(8 * MIB, s).unwrap().ptr);
    }
    assert_eq!(
        dev.live().reservations,
        5,
        "one slice per arena: five arenas"
    );
    a.validate().unwrap();
    for p in ptrs {
        a.free(p).unwrap();
    }
    drop(a);
    assert!(dev.live().is_empty());
}

#[test]
fn empty_cache_keeps_live_blocks_and_releases_the_rest() {
    let (dev, a) = setup(GIB, exact());
    let s = dev.create_stream().unwrap();
    let keep = a.malloc(10 * MIB, s).unwrap();
    let gone = a.malloc(100 * MIB, s).unwrap();
    dev.streams().submit(s, gone.ptr, gone.size).unwrap();
    a.free(gone.ptr).unwrap();
    let before = dev.counts();
    a.empty_cache().unwrap();
    let c = since(&dev, &before);
    assert_eq!(c.get(Call::DeviceSync), 0);
    assert_eq!(c.get(Call::StreamSync), 1);
    assert_eq!(
        c.get(Call::Release),
        1,
        "the freed block's one 100 MiB chunk"
    );
    assert_eq!(dev.live().handles, 1);
    assert_eq!(a.stats().reserved_bytes.all().current as u64, 10 * MIB);
    assert_eq!(a.stats().num_device_free, 1);
    a.validate().unwrap();
    a.free(keep.ptr).unwrap();
}

#[test]
fn drop_gives_back_everything_even_with_live_and_pending_blocks() {
    let (dev, a) = setup(GIB, exact());
    let (sa, sb) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = a.malloc(5 * MIB, sa).unwrap();
    let _y = a.malloc(700, sb).unwrap();
    a.record_stream(x.ptr, sb).unwrap();
    dev.streams().submit(sb, x.ptr, x.size).unwrap();
    dev.streams().submit(sa, x.ptr, x.size).unwrap();
    a.free(x.ptr).unwrap();
    drop(a);
    assert!(dev.live().is_empty(), "{:?}", dev.live());
    assert_eq!(dev.streams().live_events(), 0);
}

#[test]
fn gib_sized_requests_on_a_141_gib_device() {
    let (dev, a) = setup(141 * GIB, exact());
    let x = a.malloc(100 * GIB, Stream::DEFAULT).unwrap();
    let y = a.malloc(40 * GIB, Stream::DEFAULT).unwrap();
    assert!(a
        .malloc(2 * GIB, Stream::DEFAULT)
        .unwrap_err()
        .is_out_of_memory());
    a.free(x.ptr).unwrap();
    let z = a.malloc(60 * GIB, dev.create_stream().unwrap()).unwrap();
    assert_eq!(dev.counts().get(Call::DeviceSync), 0);
    a.validate().unwrap();
    for p in [y.ptr, z.ptr] {
        a.free(p).unwrap();
    }
}

/// A memory fraction of 0 is valid (PyTorch's `setMemoryFraction` accepts
/// [0, 1]): no new memory can be mapped until it is raised again (cached
/// blocks still serve, as PyTorch's limit applies to new device memory).
#[test]
fn memory_fraction_zero_allows_nothing() {
    let (_dev, a) = setup(GIB, exact());
    let x = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    a.free(x.ptr).unwrap();
    a.set_memory_fraction(0.0).unwrap();
    let cached = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    a.free(cached.ptr).unwrap();
    assert!(a
        .malloc(16 * MIB, Stream::DEFAULT)
        .unwrap_err()
        .is_out_of_memory());
    a.empty_cache().unwrap();
    assert!(a
        .malloc(MIB, Stream::DEFAULT)
        .unwrap_err()
        .is_out_of_memory());
    a.validate().unwrap();
    a.set_memory_fraction(1.0).unwrap();
    let y = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    a.free(y.ptr).unwrap();
    a.validate().unwrap();
}

/// Chunks, loose memory: a 256 MiB block is one chunk (one create, one map,
/// one set_access). Freed, then carved by a 16 MiB block while most of the
/// device is free, the chunk is reused as it is: no call at all (pinning it
/// costs memory nobody needs).
#[test]
fn a_free_chunk_is_reused_whole_while_memory_is_loose() {
    let (dev, a) = setup(4 * GIB, exact());
    let before = dev.counts();
    let big = a.malloc(256 * MIB, Stream::DEFAULT).unwrap();
    let c = since(&dev, &before);
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (1, 1, 1)
    );
    a.free(big.ptr).unwrap();
    let before = dev.counts();
    let small = a.malloc(16 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(since(&dev, &before).total(), 0);
    assert_eq!(a.stats().chunk_splits, 0);
    a.validate().unwrap();
    a.free(small.ptr).unwrap();
}

/// Splitting free chunks ahead of need once live bytes pass 2/5 of the
/// limit: the default before unpinning, and still an option.
fn splitting() -> ExpandableConfig {
    ExpandableConfig {
        split_threshold: 0.4,
        ..exact()
    }
}

/// Chunks, tight memory, `split_threshold: 0.4`: a 1 GiB device holds 768 MiB of live blocks and one
/// freed 128 MiB chunk (one handle). A 16 MiB block carved from that chunk
/// would pin all of it, so the chunk is split: its stream is waited for, it
/// is unmapped, released, and the block gets an exact 16 MiB chunk. A 200 MiB
/// request then finds 200 MiB (of 240 free): impossible had the 128 MiB chunk
/// stayed pinned with 112 MiB unreachable inside it.
#[test]
fn a_free_chunk_is_split_when_memory_is_tight() {
    let (dev, a) = setup(GIB, splitting());
    let s = dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
    let big = a.malloc(128 * MIB, s).unwrap();
    dev.streams().submit(s, big.ptr, big.size).unwrap();
    a.free(big.ptr).unwrap();
    let before = dev.counts();
    let small = a.malloc(16 * MIB, s).unwrap();
    let c = since(&dev, &before);
    assert_eq!(a.stats().chunk_splits, 1);
    assert_eq!(
        c.get(Call::StreamSync),
        1,
        "the chunk's stream is waited for"
    );
    assert_eq!(
        (c.get(Call::Unmap), c.get(Call::Create), c.get(Call::Map)),
        (1, 1, 1)
    );
    assert_eq!(a.stats().pages_mapped * 2 * MIB, 6 * 128 * MIB + 16 * MIB);
    a.validate().unwrap();
    let other = dev.create_stream().unwrap();
    let y = a
        .malloc(200 * MIB, other)
        .expect("the split left no free memory pinned");
    a.validate().unwrap();
    for p in [small.ptr, y.ptr]
        .into_iter()
        .chain(live.iter().map(|l| l.ptr))
    {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

/// Edge pages, tight memory: a block that ends inside a page gets that page
/// as a chunk of its own, so a neighbour sharing the page cannot pin the
/// block's big chunk. On a 1 GiB device with 512 MiB live (above the split
/// threshold), a 101 MiB block is backed by a 50-page chunk and a 1-page
/// chunk (one set_access over both). An 11 MiB block shares its last page.
/// Once the 101 MiB block is freed, its 50-page chunk is wholly free and a
/// 480 MiB request on another stream reclaims it; had it been one 51-page
/// chunk, the live neighbour would have pinned all of it and the request
/// would lack 100 MiB.
#[test]
fn a_shared_last_page_gets_a_chunk_of_its_own_when_memory_is_tight() {
    let (dev, a) = setup(GIB, splitting());
    let live: Vec<_> = (0..4)
        .map(|_| a.malloc(128 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    let before = dev.counts();
    let b = a.malloc(101 * MIB, Stream::DEFAULT).unwrap();
    let c = since(&dev, &before);
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (2, 2, 1),
        "a 50-page chunk, a 1-page chunk for the shared last page, one set_access"
    );
    let n = a.malloc(11 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(
        n.ptr,
        b.ptr + 101 * MIB,
        "the neighbour shares the last page"
    );
    a.validate().unwrap();
    a.free(b.ptr).unwrap();
    let other = dev.create_stream().unwrap();
    let y = a
        .malloc(480 * MIB, other)
        .expect("the freed block's big chunk is wholly free, so it is reclaimed");
    assert!(a.stats().reclaims > 0);
    a.validate().unwrap();
    for p in [n.ptr, y.ptr].into_iter().chain(live.iter().map(|l| l.ptr)) {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

/// While memory is loose nothing is cut: the same 101 MiB block is one chunk.
#[test]
fn edge_pages_are_not_cut_while_memory_is_loose() {
    let (dev, a) = setup(4 * GIB, exact());
    let before = dev.counts();
    let b = a.malloc(101 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(since(&dev, &before).get(Call::Create), 1);
    a.free(b.ptr).unwrap();
    a.validate().unwrap();
}

/// While chunks are split (`split_threshold` below 1), a large block of
/// whole pages starts on a page boundary: after a 3.5 MiB
/// block (which ends mid-page), an 8 MiB block goes at 4 MiB, not 3.5 MiB,
/// so it covers exactly four pages. Freed and asked for again, the same
/// size finds its chunks as they are: no driver call. The 0.5 MiB before it
/// stays a free block of its own, which merges back once its neighbours go.
#[test]
fn a_block_of_whole_pages_starts_on_a_page_boundary() {
    let (dev, a) = setup(4 * GIB, splitting());
    let x = a.malloc(3 * MIB + 512 * 1024, Stream::DEFAULT).unwrap();
    let y = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(y.ptr, x.ptr + 4 * MIB);
    assert_eq!((y.ptr - x.ptr) % (2 * MIB), 0);
    a.validate().unwrap();
    a.free(y.ptr).unwrap();
    let before = dev.counts();
    let z = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(z.ptr, y.ptr);
    assert_eq!(since(&dev, &before).total(), 0);
    // A size that is not a whole number of pages packs right after x.
    a.free(z.ptr).unwrap();
    let w = a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(w.ptr, x.ptr + 3 * MIB + 512 * 1024);
    a.validate().unwrap();
    a.free(w.ptr).unwrap();
    a.free(x.ptr).unwrap();
    a.validate().unwrap();
    assert_eq!(a.stats().inactive_split.all().current, 0);
}

/// The default grows a segment's tail to 20 MiB boundaries while memory has
/// room: a 3 MiB block maps one 20 MiB chunk (one create, map and set
/// access), and the 5 MiB block after it costs no call. Near the limit
/// (mapped + pooled at 4/5 of it or more) a block maps just its own pages.
#[test]
fn a_growing_tail_maps_ahead_to_20_mib_while_memory_has_room() {
    let (dev, a) = setup(4 * GIB, ExpandableConfig::default());
    let before = dev.counts();
    let x = a.malloc(3 * MIB, Stream::DEFAULT).unwrap();
    let c = since(&dev, &before);
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (1, 1, 1)
    );
    assert_eq!(a.stats().pages_mapped * 2 * MIB, 20 * MIB);
    let before = dev.counts();
    let y = a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(y.ptr, x.ptr + 3 * MIB);
    assert_eq!(since(&dev, &before).total(), 0, "already mapped ahead");
    a.validate().unwrap();

    let (dev, a) = setup(64 * MIB, ExpandableConfig::default());
    let big = a.malloc(50 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(
        a.stats().pages_mapped * 2 * MIB,
        50 * MIB,
        "a block of more than 20 MiB maps nothing ahead (issue 40)"
    );
    let before = dev.counts();
    let _rest: Vec<_> = (0..5)
        .map(|_| a.malloc(2 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    // 10 MiB in two chunks: max_chunk is 1/8 of this 64 MiB device.
    assert_eq!(since(&dev, &before).get(Call::Create), 2);
    assert_eq!(
        a.stats().pages_mapped * 2 * MIB,
        60 * MIB,
        "the first small block after it maps ahead to 60 MiB, in a chunk of its own"
    );
    let before = dev.counts();
    let last = a.malloc(2 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(last.ptr, big.ptr + 60 * MIB);
    assert_eq!(since(&dev, &before).get(Call::Create), 1);
    assert_eq!(
        a.stats().pages_mapped * 2 * MIB,
        62 * MIB,
        "at 60 of 64 MiB nothing is mapped ahead"
    );
    a.validate().unwrap();
}

/// Pages mapped ahead come only from memory to spare: with a 40 MiB
/// granule on a 64 MiB device, a freed 40 MiB chunk on one stream and
/// 24 MiB unmapped, a 4 MiB block on another stream would need 40 MiB to
/// map ahead. It maps just its own 4 MiB rather than reclaim the freed
/// chunk for pages nobody asked for.
#[test]
fn mapping_ahead_never_reclaims() {
    let cfg = ExpandableConfig {
        grow_granule: 40 * MIB,
        ..ExpandableConfig::default()
    };
    let (dev, a) = setup(64 * MIB, cfg);
    let x = a.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(a.stats().pages_mapped * 2 * MIB, 40 * MIB);
    a.free(x.ptr).unwrap();
    let s = dev.create_stream().unwrap();
    let before = dev.counts();
    let _y = a.malloc(4 * MIB, s).unwrap();
    let c = since(&dev, &before);
    assert_eq!((c.get(Call::Unmap), c.get(Call::StreamSync)), (0, 0));
    assert_eq!(a.stats().reclaims, 0);
    assert_eq!(a.stats().pages_mapped * 2 * MIB, 44 * MIB);
    a.validate().unwrap();
}

/// Without splitting (the default) blocks pack at 512 B: the 8 MiB block
/// goes right after the 3.5 MiB one, so a loop's layout does not drift.
#[test]
fn without_splitting_whole_page_blocks_pack_at_512_bytes() {
    let (_dev, a) = setup(4 * GIB, exact());
    let x = a.malloc(3 * MIB + 512 * 1024, Stream::DEFAULT).unwrap();
    let y = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(y.ptr, x.ptr + 3 * MIB + 512 * 1024);
    a.validate().unwrap();
}

/// The split slack: with memory tight, a freed 20 MiB chunk (10 pages) that
/// a 16 MiB block covers but for 2 pages is reused whole (pinning 4 MiB
/// costs less than a stream wait, an unmap and a new handle), while with
/// `split_slack: 0` it is split.
#[test]
fn a_chunk_left_nearly_covered_is_pinned_within_the_split_slack() {
    for (slack, splits) in [(DEFAULT_SPLIT_SLACK, 0), (0, 1)] {
        let cfg = ExpandableConfig {
            split_slack: slack,
            ..splitting()
        };
        let (dev, a) = setup(GIB, cfg);
        let live: Vec<_> = (0..6)
            .map(|_| a.malloc(128 * MIB, Stream::DEFAULT).unwrap())
            .collect();
        let freed = a.malloc(20 * MIB, Stream::DEFAULT).unwrap();
        a.free(freed.ptr).unwrap();
        let before = dev.counts();
        let small = a.malloc(16 * MIB, Stream::DEFAULT).unwrap();
        let c = since(&dev, &before);
        assert_eq!(a.stats().chunk_splits, splits, "slack {slack}");
        if splits == 0 {
            assert_eq!(c.total(), 0, "reused whole: no call");
        } else {
            assert_eq!((c.get(Call::Unmap), c.get(Call::Create)), (1, 1));
        }
        a.validate().unwrap();
        a.free(small.ptr).unwrap();
        for l in live {
            a.free(l.ptr).unwrap();
        }
        a.validate().unwrap();
    }
}
