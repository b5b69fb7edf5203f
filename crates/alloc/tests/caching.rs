//! The `caching` policy, one test per rule of PyTorch's caching allocator,
//! each named after the function of `c10/cuda/CUDACachingAllocator.cpp` (or of
//! `c10/core/AllocatorConfig.cpp`) it mirrors.

use std::sync::Arc;
use vmmalloc_alloc::caching::sizes::{
    get_allocation_size, get_pool, round_size, roundup_power2_next_division, should_split,
    PoolKind, K_LARGE_BUFFER, K_SMALL_BUFFER,
};
use vmmalloc_alloc::caching::{CachingAllocator, CachingConfig};
use vmmalloc_alloc::{AllocError, Allocator, BlockState, StatType};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, Stream, GIB, MIB};

const S0: Stream = Stream::DEFAULT;

fn setup(capacity: u64, conf: &str) -> (Arc<SimDevice>, CachingAllocator<Arc<SimDevice>>) {
    let dev = Arc::new(SimDevice::with_capacity(capacity));
    let a = CachingAllocator::new(dev.clone(), CachingConfig::parse(conf).unwrap()).unwrap();
    (dev, a)
}

fn cur(a: &impl Allocator, f: impl Fn(&vmmalloc_alloc::Stats) -> i64) -> i64 {
    f(&a.stats())
}

#[test]
fn round_size_rounds_up_to_512_bytes() {
    let c = CachingConfig::default();
    assert_eq!(round_size(1, &c), 512);
    assert_eq!(round_size(512, &c), 512);
    assert_eq!(round_size(513, &c), 1024);
    assert_eq!(round_size(MIB + 1, &c), MIB + 512);
    assert_eq!(round_size(1_500_000, &c), 1_500_160);
}

#[test]
fn round_size_with_roundup_power2_divisions_follows_pytorch_docs() {
    // PyTorch's comment on roundup_power2_next_division: 1200 with 4 divisions -> 1280.
    assert_eq!(roundup_power2_next_division(1200, 4), 1280);
    let c = CachingConfig::parse("roundup_power2_divisions:4").unwrap();
    // round_size applies divisions only above kMinBlockSize * divisions = 2048 bytes.
    assert_eq!(round_size(1200, &c), 1536);
    // 1.2 MiB lies in [1 MiB, 2 MiB), steps of 256 KiB: 1.25 MiB.
    assert_eq!(round_size(1_258_291, &c), 1_310_720);
    // 300 MiB lies in [256 MiB, 512 MiB), steps of 64 MiB: 320 MiB.
    assert_eq!(round_size(300 * MIB, &c), 320 * MIB);
    // Powers of two stay.
    assert_eq!(round_size(256 * MIB, &c), 256 * MIB);
    // Without the option: plain 512-byte rounding.
    assert_eq!(
        round_size(300 * MIB + 1, &CachingConfig::default()),
        300 * MIB + 512
    );
}

#[test]
fn roundup_power2_divisions_bracket_form_fills_the_16_intervals() {
    // The example of PyTorch's documentation.
    let c = CachingConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
    // `256:1` names the interval starting at 256 MiB (index log2(256) = 8) and
    // fills every interval below it; `>` fills every interval after 1024 MiB's.
    let mut want = [1u64; 16];
    want[9] = 2;
    want[10] = 4;
    want[11..].fill(8);
    assert_eq!(c.roundup_power2_divisions, want);
    assert_eq!(c.roundup_power2_divisions(100 * MIB), 1);
    assert_eq!(c.roundup_power2_divisions(300 * MIB), 1);
    assert_eq!(c.roundup_power2_divisions(600 * MIB), 2);
    assert_eq!(c.roundup_power2_divisions(GIB + GIB / 2), 4);
    assert_eq!(c.roundup_power2_divisions(3 * GIB), 8);
    assert_eq!(
        c.roundup_power2_divisions(100 * GIB),
        8,
        "the last interval covers everything above 32 GiB"
    );
    // 600 MiB with 2 divisions of [512 MiB, 1 GiB): 768 MiB.
    assert_eq!(round_size(600 * MIB, &c), 768 * MIB);
    // Sizes below 1 MiB use the first interval.
    assert_eq!(c.roundup_power2_divisions(1000), 1);
}

#[test]
fn get_allocation_size_1_5_mb_request_reserves_a_20_mib_segment() {
    let (dev, a) = setup(GIB, "");
    let x = a.malloc(1_500_000, S0).unwrap();
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all().current, 20 * MIB as i64);
    assert_eq!(s.segment.get(StatType::Large).current, 1);
    assert_eq!(
        x.size, 1_500_160,
        "the block is the rounded request, the segment is split"
    );
    assert_eq!(s.allocated_bytes.all().current, 1_500_160);
    assert_eq!(s.requested_bytes.all().current, 1_500_000);
    assert_eq!(dev.counts().get(Call::Alloc), 1);
    a.validate().unwrap();
}

#[test]
fn get_allocation_size_12_mb_request_reserves_12_mib() {
    let (_dev, a) = setup(GIB, "");
    let x = a.malloc(12_000_000, S0).unwrap();
    assert_eq!(
        get_allocation_size(round_size(12_000_000, &CachingConfig::default())),
        12 * MIB
    );
    assert_eq!(a.stats().reserved_bytes.all().current, 12 * MIB as i64);
    // 12 MiB - 12_000_256 bytes remain: not more than 1 MiB, so the block is not split.
    assert_eq!(x.size, 12 * MIB);
    a.validate().unwrap();
}

#[test]
fn get_pool_small_requests_go_to_2_mib_small_segments() {
    assert_eq!(get_pool(MIB), PoolKind::Small);
    assert_eq!(get_pool(MIB + 512), PoolKind::Large);
    let (dev, a) = setup(GIB, "");
    let x = a.malloc(MIB, S0).unwrap();
    let y = a.malloc(MIB, S0).unwrap();
    assert_eq!(y.ptr, x.ptr + MIB, "both fit the same 2 MiB small segment");
    let _z = a.malloc(1000, S0).unwrap();
    let s = a.stats();
    assert_eq!(s.segment.get(StatType::Small).current, 2);
    assert_eq!(
        s.reserved_bytes.get(StatType::Small).current,
        2 * K_SMALL_BUFFER as i64
    );
    assert_eq!(s.reserved_bytes.get(StatType::Large).current, 0);
    assert_eq!(
        s.allocated_bytes.get(StatType::Small).current,
        (2 * MIB + 1024) as i64
    );
    assert_eq!(dev.counts().get(Call::Alloc), 2);
    a.validate().unwrap();
}

#[test]
fn should_split_thresholds() {
    let max = u64::MAX;
    // Small pool: a remainder of 512 bytes is enough.
    assert!(should_split(
        2 * MIB,
        2 * MIB - 512,
        PoolKind::Small,
        false,
        max
    ));
    assert!(!should_split(
        2 * MIB,
        2 * MIB - 511,
        PoolKind::Small,
        false,
        max
    ));
    // Large pool: more than 1 MiB must remain.
    assert!(!should_split(
        20 * MIB,
        19 * MIB,
        PoolKind::Large,
        false,
        max
    ));
    assert!(should_split(
        20 * MIB,
        19 * MIB - 512,
        PoolKind::Large,
        false,
        max
    ));
    // ... and the request must be below max_split_size.
    assert!(!should_split(
        200 * MIB,
        100 * MIB,
        PoolKind::Large,
        false,
        64 * MIB
    ));
    // Expandable segments: 512 bytes in the large pool too.
    assert!(should_split(
        20 * MIB,
        20 * MIB - 512,
        PoolKind::Large,
        true,
        max
    ));

    // On the allocator: a cached 20 MiB segment serves 19 MiB whole, 18.5 MiB split.
    let (_dev, a) = setup(GIB, "");
    let x = a.malloc(5 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.malloc(19 * MIB, S0).unwrap();
    assert_eq!((y.ptr, y.size), (x.ptr, 20 * MIB));
    a.free(y.ptr).unwrap();
    let z = a.malloc(18 * MIB + MIB / 2, S0).unwrap();
    assert_eq!((z.ptr, z.size), (x.ptr, 18 * MIB + MIB / 2));
    assert_eq!(
        a.stats().inactive_split_bytes.all().current,
        (MIB + MIB / 2) as i64
    );
    a.validate().unwrap();
}

#[test]
fn get_free_block_does_not_split_a_100_mib_block_for_small_requests_with_max_split_size_mb_64() {
    let (_dev, a) = setup(GIB, "max_split_size_mb:64");
    let big = a.malloc(100 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    // 1 MiB is a small-pool request: a new 2 MiB small segment.
    let x = a.malloc(MIB, S0).unwrap();
    // 1.5 MiB is a large-pool request below max_split_size: the oversize block is refused.
    let y = a.malloc(MIB + MIB / 2, S0).unwrap();
    assert_ne!(x.ptr, big.ptr);
    assert_ne!(y.ptr, big.ptr);
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all().current, (100 + 2 + 20) * MIB as i64);
    assert_eq!(s.oversize_segments.current, 1);
    assert_eq!(s.max_split_size, 64 * MIB as i64);
    a.validate().unwrap();
}

#[test]
fn get_free_block_oversize_request_takes_a_block_at_most_20_mib_larger() {
    let (_dev, a) = setup(GIB, "max_split_size_mb:64");
    let big = a.malloc(100 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    // 100 >= 70 + 20: refused, a new segment.
    let x = a.malloc(70 * MIB, S0).unwrap();
    assert_ne!(x.ptr, big.ptr);
    a.free(x.ptr).unwrap();
    // 100 < 85 + 20: reused whole, not split (request >= max_split_size).
    let y = a.malloc(85 * MIB, S0).unwrap();
    assert_eq!((y.ptr, y.size), (big.ptr, 100 * MIB));
    let s = a.stats();
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(s.allocated_bytes.all().current, 100 * MIB as i64);
    assert_eq!(s.requested_bytes.all().current, 85 * MIB as i64);
    a.validate().unwrap();
}

#[test]
fn release_available_cached_blocks_frees_the_smallest_sufficient_oversize_block() {
    let (_dev, a) = setup(256 * MIB, "max_split_size_mb:64");
    let x = a.malloc(150 * MIB, S0).unwrap();
    let y = a.malloc(100 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    // 120 MiB: no cached block fits (150 >= 120 + 20), the device has 6 MiB:
    // the 150 MiB block is freed and the allocation retried, without counting a retry.
    let z = a.malloc(120 * MIB, S0).unwrap();
    assert_eq!(z.size, 120 * MIB);
    let s = a.stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(
        s.num_sync_all_streams, 0,
        "release_cached_blocks was not needed"
    );
    assert_eq!(s.reserved_bytes.all().current, 220 * MIB as i64);
    a.validate().unwrap();
}

#[test]
fn release_available_cached_blocks_frees_several_oversize_blocks_largest_first() {
    let (_dev, a) = setup(256 * MIB, "max_split_size_mb:64");
    let x = a.malloc(80 * MIB, S0).unwrap();
    let y = a.malloc(90 * MIB, S0).unwrap();
    let w = a.malloc(70 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.free(w.ptr).unwrap();
    // 150 MiB: no single cached block covers it; 90 then 80 are freed (170 >= 150).
    let z = a.malloc(150 * MIB, S0).unwrap();
    assert_eq!(z.size, 150 * MIB);
    let s = a.stats();
    assert_eq!(s.num_device_free, 2);
    assert_eq!(s.num_alloc_retries, 0);
    assert_eq!(s.reserved_bytes.all().current, (70 + 150) * MIB as i64);
    a.validate().unwrap();
}

#[test]
fn release_cached_blocks_retry_path_counts_exactly_one_retry() {
    let (dev, a) = setup(64 * MIB, "");
    let x = a.malloc(30 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.malloc(40 * MIB, S0).unwrap();
    assert_eq!(y.size, 40 * MIB);
    let s = a.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_device_alloc, 2);
    // cudaMalloc(30), cudaMalloc(40) failed, cudaFree(30), cudaMalloc(40).
    assert_eq!(dev.counts().get(Call::Alloc), 3);
    assert_eq!(dev.counts().get(Call::Free), 1);
    assert_eq!(
        s.driver_calls.get(Call::Alloc),
        3,
        "the allocator counts failed calls too"
    );
    a.validate().unwrap();
}

#[test]
fn malloc_raises_out_of_memory_after_one_retry_with_a_full_report() {
    let (_dev, a) = setup(64 * MIB, "");
    let x = a.malloc(40 * MIB, S0).unwrap();
    let small = a.malloc(1000, S0).unwrap();
    let e = a.malloc(40 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else {
        panic!("expected out of memory, got {e}")
    };
    assert_eq!(r.policy, "caching");
    assert_eq!(r.requested, 40 * MIB);
    assert_eq!(r.rounded, 40 * MIB);
    assert_eq!(r.capacity, 64 * MIB);
    assert_eq!(r.device_free, 64 * MIB - 40 * MIB - 2 * MIB);
    assert_eq!(r.live, 40 * MIB + 1024);
    assert_eq!(r.cached, 2 * MIB - 1024);
    assert_eq!(r.largest_free, 2 * MIB - 1024);
    assert_eq!(r.per_stream.len(), 1);
    assert_eq!(r.per_stream[0].live, 40 * MIB + 1024);
    assert!(r.hint.contains("expandable_segments:True"), "{}", r.hint);
    assert!(e.to_string().contains("Tried to allocate 40.00 MiB"), "{e}");
    let s = a.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 1));
    a.validate().unwrap();
    a.free(x.ptr).unwrap();
    a.free(small.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn free_block_try_merge_blocks_merge_neighbours_and_track_inactive_split() {
    let (_dev, a) = setup(GIB, "");
    let x = a.malloc(2 * MIB, S0).unwrap();
    let y = a.malloc(2 * MIB, S0).unwrap();
    let z = a.malloc(2 * MIB, S0).unwrap();
    assert_eq!(
        (y.ptr, z.ptr),
        (x.ptr + 2 * MIB, x.ptr + 4 * MIB),
        "one 20 MiB segment, split in order"
    );
    let split = |a: &CachingAllocator<Arc<SimDevice>>| {
        let s = a.stats();
        (
            s.inactive_split.all().current,
            s.inactive_split_bytes.all().current / MIB as i64,
        )
    };
    assert_eq!(split(&a), (1, 14));
    a.free(y.ptr).unwrap();
    assert_eq!(split(&a), (2, 16));
    a.free(x.ptr).unwrap();
    assert_eq!(split(&a), (2, 18), "x merged with y");
    a.validate().unwrap();
    a.free(z.ptr).unwrap();
    assert_eq!(split(&a), (0, 0), "the segment is whole again");
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert_eq!(snap.segments[0].blocks.len(), 1);
    assert_eq!(snap.segments[0].blocks[0].state, BlockState::Inactive);
    assert_eq!(snap.segments[0].blocks[0].size, 20 * MIB);
    a.validate().unwrap();
}

#[test]
fn record_stream_insert_events_process_events_defer_reuse_until_the_event_completes() {
    let (dev, a) = setup(GIB, "");
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, S0).unwrap(); // its own stream: ignored
    a.record_stream(x.ptr, s2).unwrap();
    dev.streams().submit(s2, x.ptr, 4 * MIB).unwrap();
    a.free(x.ptr).unwrap();
    let s = a.stats();
    assert_eq!(
        s.allocation.all().current,
        0,
        "allocation counts drop at once"
    );
    assert_eq!(
        s.active.all().current,
        1,
        "the block stays active until its event completes"
    );
    assert_eq!(s.requested_bytes.all().current, 4 * MIB as i64);
    let pending = a.snapshot().segments[0].blocks[0].clone();
    assert_eq!(
        (pending.address, pending.state),
        (x.ptr, BlockState::ActivePendingFree)
    );
    a.validate().unwrap();

    // Not reused while the work on s2 is pending.
    let y = a.malloc(4 * MIB, S0).unwrap();
    assert_ne!(y.ptr, x.ptr);
    a.free(y.ptr).unwrap();
    a.validate().unwrap();

    // Completed: the next malloc processes the event and reuses the block.
    dev.streams().complete(s2).unwrap();
    let z = a.malloc(4 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    let s = a.stats();
    assert_eq!(s.active.all().current, 1);
    assert_eq!(s.driver_calls.get(Call::EventRecord), 1);
    assert!(s.driver_calls.get(Call::EventQuery) >= 2);
    a.validate().unwrap();
}

#[test]
fn synchronize_and_free_events_runs_in_empty_cache() {
    let (dev, a) = setup(GIB, "");
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(30 * MIB, S0).unwrap();
    a.record_stream(x.ptr, s2).unwrap();
    dev.streams().submit(s2, x.ptr, 30 * MIB).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    let s = a.stats();
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.driver_calls.get(Call::EventSync), 1);
    assert_eq!(s.num_stream_syncs, 1);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert_eq!(dev.streams().pending_items(s2), 0);
    assert_eq!(dev.live().plain_allocs, 0);
    a.validate().unwrap();
}

#[test]
fn garbage_collect_cached_blocks_only_with_a_memory_fraction() {
    let run = |fraction: Option<f64>| {
        let (_dev, a) = setup(GIB, "garbage_collection_threshold:0.5");
        if let Some(f) = fraction {
            a.set_memory_fraction(f).unwrap();
        }
        let xs: Vec<_> = (0..4).map(|_| a.malloc(100 * MIB, S0).unwrap()).collect();
        for x in xs {
            a.free(x.ptr).unwrap();
        }
        // 150 MiB fits no cached block; with a fraction of 0.5 (512 MiB allowed)
        // 400 MiB held exceeds the 256 MiB threshold: aged blocks are freed first.
        a.malloc(150 * MIB, S0).unwrap();
        a.validate().unwrap();
        a.stats()
    };
    let without = run(None);
    assert_eq!(without.num_device_free, 0);
    assert_eq!(without.reserved_bytes.all().current, 550 * MIB as i64);
    let with = run(Some(0.5));
    assert_eq!(with.num_device_free, 4);
    assert_eq!(with.num_alloc_retries, 0);
    assert_eq!(
        with.num_sync_all_streams, 0,
        "garbage collection does not synchronize"
    );
    assert_eq!(with.reserved_bytes.all().current, 150 * MIB as i64);
}

#[test]
fn garbage_collect_cached_blocks_frees_old_blocks_before_recent_ones() {
    let (dev, a) = setup(GIB, "garbage_collection_threshold:0.6");
    a.set_memory_fraction(0.5).unwrap();
    let s2 = dev.create_stream().unwrap();
    let old = a.malloc(150 * MIB, S0).unwrap();
    let recent = a.malloc(150 * MIB, S0).unwrap();
    a.free(old.ptr).unwrap();
    // Lookups in the large pool (any stream) age the cached blocks.
    for _ in 0..4 {
        let t = a.malloc(30 * MIB, s2).unwrap();
        a.free(t.ptr).unwrap();
    }
    a.free(recent.ptr).unwrap();
    assert_eq!(
        a.stats().reserved_bytes.all().current,
        330 * MIB as i64,
        "above the 307 MiB threshold"
    );
    // Nothing cached fits 200 MiB: blocks at least as old as the average
    // (ages 5, 1, 1) go, which frees the old block only.
    let _n = a.malloc(200 * MIB, S0).unwrap();
    let snap = a.snapshot();
    assert!(
        snap.segments.iter().any(|s| s.address == recent.ptr),
        "recent block kept"
    );
    assert!(
        snap.segments.iter().all(|s| s.address != old.ptr),
        "old block freed"
    );
    let s = a.stats();
    assert_eq!(s.num_device_free, 1);
    assert_eq!(
        s.reserved_bytes.all().current,
        (150 + 30 + 200) * MIB as i64
    );
    a.validate().unwrap();
}

#[test]
fn set_memory_fraction_limits_allowed_memory_maximum() {
    let (_dev, a) = setup(GIB, "");
    a.set_memory_fraction(0.25).unwrap();
    a.malloc(200 * MIB, S0).unwrap();
    let e = a.malloc(100 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else {
        panic!("{e}")
    };
    // The capacity is the device's (PyTorch: "total capacity of <device total>
    // of which <free> is free. <limit> allowed;").
    assert_eq!(r.capacity, GIB);
    // PyTorch puts the limit before "Of the allocated memory".
    assert_eq!(r.allowed, Some(256 * MIB));
    assert!(
        e.to_string()
            .contains("256.00 MiB allowed; Of the allocated memory"),
        "{e}"
    );
    assert!(a.set_memory_fraction(1.5).is_err());
    a.validate().unwrap();
}

#[test]
fn get_free_block_never_serves_another_stream() {
    let (dev, a) = setup(GIB, "");
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(30 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.malloc(30 * MIB, s2).unwrap();
    assert_ne!(y.ptr, x.ptr);
    assert_eq!(a.stats().segment.all().current, 2);
    let z = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    a.validate().unwrap();
}

#[test]
fn stats_follow_pytorch_semantics() {
    let (_dev, a) = setup(GIB, "");
    let x = a.malloc(3 * MIB + 1, S0).unwrap();
    let s = a.stats();
    assert_eq!(
        s.allocated_bytes.all().current,
        (3 * MIB + 512) as i64,
        "rounded block size"
    );
    assert_eq!(
        s.requested_bytes.all().current,
        (3 * MIB + 1) as i64,
        "bytes asked for"
    );
    assert_eq!(s.active_bytes.all().current, (3 * MIB + 512) as i64);
    assert_eq!(s.reserved_bytes.all().current, K_LARGE_BUFFER as i64);
    assert_eq!(s.allocation.get(StatType::Large).current, 1);
    assert_eq!(s.max_split_size, i64::MAX);
    a.free(x.ptr).unwrap();
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all().current, 0);
    assert_eq!(s.allocated_bytes.all().peak, (3 * MIB + 512) as i64);
    assert_eq!(s.allocated_bytes.all().freed, (3 * MIB + 512) as i64);
    assert_eq!(
        s.reserved_bytes.all().current,
        K_LARGE_BUFFER as i64,
        "cached, not returned"
    );
    a.reset_peak_stats();
    assert_eq!(a.stats().allocated_bytes.all().peak, 0);
    let m = a.stats().to_map();
    assert_eq!(
        m["reserved_bytes.large_pool.current"],
        K_LARGE_BUFFER as i64
    );
    assert_eq!(cur(&a, |s| s.num_device_alloc as i64), 1);
}

#[test]
fn driver_calls_match_the_device() {
    let (dev, a) = setup(GIB, "");
    let s2 = dev.create_stream().unwrap();
    let before = dev.counts();
    let x = a.malloc(5 * MIB, S0).unwrap();
    let y = a.malloc(50 * MIB, S0).unwrap();
    a.record_stream(x.ptr, s2).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    let got = dev.counts().since(&before);
    assert_eq!(a.stats().driver_calls, got);
}

#[test]
fn invalid_requests_change_nothing() {
    let (_dev, a) = setup(GIB, "");
    assert!(matches!(
        a.malloc(0, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.malloc(1 << 62, S0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        a.free(0x1234),
        Err(AllocError::InvalidPointer { .. })
    ));
    let x = a.malloc(MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    assert!(
        matches!(a.free(x.ptr), Err(AllocError::InvalidPointer { .. })),
        "double free"
    );
    assert!(matches!(
        a.record_stream(x.ptr, S0),
        Err(AllocError::InvalidPointer { .. })
    ));
    // Beyond the device: PyTorch's full retry path, then out of memory.
    assert!(a.malloc(2 * GIB, S0).unwrap_err().is_out_of_memory());
    a.validate().unwrap();
}

#[test]
fn alloc_block_driver_failure_is_returned_and_rolled_back() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    let faulty = Arc::new(FaultInjecting::with_plan(dev.clone(), FaultPlan::None));
    let a = CachingAllocator::new(faulty.clone(), CachingConfig::default()).unwrap();
    let keep = a.malloc(30 * MIB, S0).unwrap();
    let x = a.malloc(30 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let before = a.stats();
    faulty.hook().set_plan(FaultPlan::Nth {
        call: Call::Alloc,
        n: 3,
        kind: FaultKind::Driver(999),
    });
    let e = a.malloc(50 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::Device(_)), "{e}");
    let after = a.stats();
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    a.validate().unwrap();
    // cudaFree failing inside empty_cache: the cached segment stays cached.
    faulty.hook().set_plan(FaultPlan::Nth {
        call: Call::Free,
        n: 1,
        kind: FaultKind::Driver(999),
    });
    assert!(a.empty_cache().is_err());
    assert_eq!(a.stats().reserved_bytes.all().current, 60 * MIB as i64);
    a.validate().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.all().current, 30 * MIB as i64);
    a.free(keep.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn insert_events_failure_keeps_the_allocation_live() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    let faulty = Arc::new(FaultInjecting::with_plan(dev.clone(), FaultPlan::None));
    let a = CachingAllocator::new(faulty.clone(), CachingConfig::default()).unwrap();
    let s2 = faulty.create_stream().unwrap();
    let x = a.malloc(4 * MIB, S0).unwrap();
    a.record_stream(x.ptr, s2).unwrap();
    faulty.hook().set_plan(FaultPlan::Nth {
        call: Call::EventRecord,
        n: 1,
        kind: FaultKind::Driver(999),
    });
    assert!(a.free(x.ptr).is_err());
    assert_eq!(a.stats().allocation.all().current, 1);
    a.validate().unwrap();
    a.free(x.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn drop_returns_everything_to_the_device() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    {
        let a = CachingAllocator::new(dev.clone(), CachingConfig::default()).unwrap();
        let s2 = dev.create_stream().unwrap();
        let _live = a.malloc(7 * MIB, S0).unwrap();
        let cached = a.malloc(40 * MIB, S0).unwrap();
        a.free(cached.ptr).unwrap();
        let pending = a.malloc(MIB, S0).unwrap();
        a.record_stream(pending.ptr, s2).unwrap();
        dev.streams().submit(s2, pending.ptr, MIB).unwrap();
        a.free(pending.ptr).unwrap();
        assert!(!dev.live().is_empty());
        a.validate().unwrap();
    }
    assert!(dev.live().is_empty(), "{:?}", dev.live());
    assert_eq!(dev.streams().live_events(), 0);
    dev.check().unwrap();
}

#[test]
fn config_parse_reads_pytorch_cuda_alloc_conf() {
    let c = CachingConfig::parse(
        "max_split_size_mb:128, roundup_power2_divisions:4,garbage_collection_threshold:0.6,expandable_segments:True",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 128 * MIB);
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    assert_eq!(c.garbage_collection_threshold, 0.6);
    assert!(c.expandable_segments);
    assert_eq!(c.max_non_split_rounding_size, 20 * MIB);
    let c = CachingConfig::parse(
        "max_non_split_rounding_mb:40,backend:native,release_lock_on_cudamalloc:True",
    )
    .unwrap();
    assert_eq!(c.max_non_split_rounding_size, 40 * MIB);
    assert!(c.release_lock_on_cudamalloc);
    assert_eq!(CachingConfig::parse("").unwrap(), CachingConfig::default());
}

#[test]
fn config_parse_errors_are_worded_as_pytorch_words_them() {
    let e = |s: &str| CachingConfig::parse(s).unwrap_err().to_string();
    assert!(e("max_split_size:128")
        .contains("Unrecognized key 'max_split_size' in Accelerator allocator config."));
    assert!(e("max_split_size_mb:10")
        .contains("CachingAllocator option max_split_size_mb too small, must be >= 20"));
    assert!(e("max_non_split_rounding_mb:5")
        .contains("max_non_split_rounding_mb too small, must be >= 20"));
    assert!(e("garbage_collection_threshold:1.5")
        .contains("garbage_collect_threshold is invalid, set it in (0.0, 1.0)"));
    assert!(e("roundup_power2_divisions:3")
        .contains("For roundups, the divisions has to be power of 2"));
    assert!(e("roundup_power2_divisions:[256:3]").contains("power of 2 or 0 to disable roundup"));
    assert!(e("roundup_power2_divisions:[300:2]")
        .contains("For roundups, the intervals have to be power of 2"));
    assert!(e("roundup_power2_divisions:[256:2").contains("Expected closing bracket"));
    assert!(e("expandable_segments:yes")
        .contains("Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'"));
    assert!(e("backend:foo")
        .contains("Unknown allocator backend, options are native and cudaMallocAsync"));
    assert!(e("max_split_size_mb:abc").contains("max_split_size_mb"));
    assert!(
        e("max_split_size_mb").contains("expecting max_split_size_mb value")
            || e("max_split_size_mb").contains("expected :")
    );
    assert!(e("max_split_size_mb:128;expandable_segments:True").contains("max_split_size_mb"));
}
