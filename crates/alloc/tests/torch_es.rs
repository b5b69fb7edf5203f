//! The `torch-es` policy: PyTorch's `expandable_segments:True`, one test per
//! rule, each named after the function of `c10/cuda/CUDACachingAllocator.cpp`
//! (`ExpandableSegment::*`, `DeviceCachingAllocator::*`) it mirrors.

use std::sync::Arc;
use vmmalloc_alloc::caching::sizes::{round_size, K_LARGE_BUFFER, K_SMALL_BUFFER};
use vmmalloc_alloc::caching::CachingConfig;
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::{AllocError, Allocator, BlockState};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, CallCounts, Device, Introspect, Stream, GIB, MIB};

const S0: Stream = Stream::DEFAULT;

fn setup(capacity: u64) -> (Arc<SimDevice>, TorchEsAllocator<Arc<SimDevice>>) {
    let dev = Arc::new(SimDevice::with_capacity(capacity));
    let a = TorchEsAllocator::new(dev.clone(), CachingConfig::default()).unwrap();
    (dev, a)
}

fn calls(dev: &SimDevice, since: &CallCounts, c: Call) -> u64 {
    dev.counts().since(since).get(c)
}

#[test]
fn expandable_segment_reserves_one_and_an_eighth_of_device_memory() {
    let (dev, a) = setup(GIB);
    a.malloc(1_500_000, S0).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 1);
    let seg = &snap.segments[0];
    assert!(seg.is_expandable);
    // ceil(1.125 GiB / 20 MiB) = 58 pages of 20 MiB.
    assert_eq!(seg.total_size, 58 * K_LARGE_BUFFER);
    assert!(seg.total_size >= GIB + GIB / 8);
    assert_eq!(dev.counts().get(Call::Reserve), 1);
    assert_eq!(dev.live().reservations, 1);
    a.validate().unwrap();
}

#[test]
fn map_a_1_5_mb_request_maps_one_20_mib_page() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(1_500_000, S0).unwrap();
    let c = dev.counts();
    assert_eq!(
        (
            c.get(Call::Create),
            c.get(Call::Map),
            c.get(Call::SetAccess)
        ),
        (1, 1, 1)
    );
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all().current, K_LARGE_BUFFER as i64);
    assert_eq!(s.pages_mapped, 1);
    assert_eq!(s.num_device_alloc, 1);
    assert_eq!(
        s.segment.all().current,
        0,
        "PyTorch counts no segments for expandable memory"
    );
    // should_split under expandable segments: the rest of the page stays free.
    assert_eq!(x.size, round_size(1_500_000, &CachingConfig::default()));
    a.validate().unwrap();
}

#[test]
fn alloc_block_maps_the_rounded_request_not_get_allocation_size() {
    // The plain allocator reserves 12 MiB for 12 MB; expandable segments map
    // whole 20 MiB pages for the rounded request instead.
    let (dev, a) = setup(GIB);
    let x = a.malloc(12_000_000, S0).unwrap();
    assert_eq!(x.size, 12_000_256);
    assert_eq!(a.stats().reserved_bytes.all().current, 20 * MIB as i64);
    let y = a.malloc(12_000_000, S0).unwrap();
    assert_eq!(
        y.ptr,
        x.ptr + x.size,
        "the next block follows in the same segment"
    );
    assert_eq!(a.stats().reserved_bytes.all().current, 40 * MIB as i64);
    assert_eq!(dev.counts().get(Call::Create), 2);
    a.validate().unwrap();
}

#[test]
fn map_and_set_access_one_set_access_per_mapped_range() {
    let (dev, a) = setup(GIB);
    a.malloc(50 * MIB, S0).unwrap();
    let c = dev.counts();
    assert_eq!(c.get(Call::Create), 3, "one cuMemCreate per 20 MiB page");
    assert_eq!(c.get(Call::Map), 3, "one cuMemMap per page");
    assert_eq!(
        c.get(Call::SetAccess),
        1,
        "one cuMemSetAccess over the mapped range"
    );
    assert_eq!(a.stats().num_device_alloc, 1, "one map_block");
    assert_eq!(a.stats().driver_calls, c);
    a.validate().unwrap();
}

#[test]
fn find_expandable_block_small_pool_uses_2_mib_pages_in_its_own_segment() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(100_000, S0).unwrap();
    let y = a.malloc(3 * MIB, S0).unwrap();
    let snap = a.snapshot();
    assert_eq!(snap.segments.len(), 2, "one segment per (stream, pool)");
    let small = snap
        .segments
        .iter()
        .find(|s| s.segment_type == "small")
        .unwrap();
    assert!(small.address <= x.ptr && x.ptr < small.address + small.total_size);
    assert_eq!(
        small.total_size,
        576 * K_SMALL_BUFFER,
        "ceil(1.125 GiB / 2 MiB) pages"
    );
    assert!(!(small.address <= y.ptr && y.ptr < small.address + small.total_size));
    let s = a.stats();
    assert_eq!(
        s.reserved_bytes
            .get(vmmalloc_alloc::StatType::Small)
            .current,
        K_SMALL_BUFFER as i64
    );
    assert_eq!(dev.counts().get(Call::Reserve), 2);
    a.validate().unwrap();
}

#[test]
fn try_allocate_expandable_block_grows_the_segment_at_its_end() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(15 * MIB, S0).unwrap();
    let y = a.malloc(15 * MIB, S0).unwrap();
    let z = a.malloc(15 * MIB, S0).unwrap();
    assert_eq!(y.ptr, x.ptr + 15 * MIB);
    assert_eq!(z.ptr, y.ptr + 15 * MIB);
    assert_eq!(dev.counts().get(Call::Reserve), 1);
    assert_eq!(a.stats().reserved_bytes.all().current, 60 * MIB as i64);
    a.validate().unwrap();
}

#[test]
fn find_expandable_block_one_segment_per_stream() {
    let (dev, a) = setup(GIB);
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(5 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.malloc(5 * MIB, s2).unwrap();
    assert_eq!(dev.counts().get(Call::Reserve), 2);
    let snap = a.snapshot();
    assert_eq!(snap.segments.iter().filter(|s| s.stream == s2).count(), 1);
    assert!(snap
        .segments
        .iter()
        .any(|s| s.stream == S0 && s.address <= x.ptr));
    assert_ne!(y.ptr, x.ptr);
    a.validate().unwrap();
}

#[test]
fn should_split_under_expandable_segments_keeps_512_byte_remainders() {
    let (_dev, a) = setup(GIB);
    let x = a.malloc(20 * MIB - 512, S0).unwrap();
    assert_eq!(x.size, 20 * MIB - 512);
    let y = a.malloc(512, S0).unwrap();
    assert_ne!(y.ptr, x.ptr + x.size, "512 bytes are a small-pool request");
    let z = a.malloc(MIB + 512, S0).unwrap();
    // The 512-byte remainder is too small alone; find_expandable_block starts the
    // new page's run at it (the lowest free address), so it is used.
    assert_eq!(z.ptr, x.ptr + x.size);
    assert_eq!(
        a.stats()
            .reserved_bytes
            .get(vmmalloc_alloc::StatType::Large)
            .current,
        40 * MIB as i64
    );
    a.validate().unwrap();
}

#[test]
fn get_free_block_reuses_free_blocks_of_the_segment() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(30 * MIB, S0).unwrap();
    let _y = a.malloc(10 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let before = dev.counts();
    let z = a.malloc(25 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    assert_eq!(
        dev.counts().since(&before).total(),
        0,
        "a cache hit makes no driver call"
    );
    a.validate().unwrap();
}

#[test]
fn release_cached_blocks_unmaps_and_releases_free_pages_after_a_stream_sync() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(50 * MIB, S0).unwrap();
    dev.streams().submit(S0, x.ptr, 50 * MIB).unwrap();
    a.free(x.ptr).unwrap();
    let before = dev.counts();
    a.empty_cache().unwrap();
    assert_eq!(
        calls(&dev, &before, Call::StreamSync),
        1,
        "unmapHandles synchronizes the stream"
    );
    assert_eq!(calls(&dev, &before, Call::Unmap), 3);
    assert_eq!(calls(&dev, &before, Call::Release), 3);
    assert_eq!(
        calls(&dev, &before, Call::AddressFree),
        1,
        "an empty segment gives its reservation back"
    );
    let s = a.stats();
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.num_device_free, 1);
    assert_eq!(s.num_stream_syncs, 1);
    assert_eq!(s.reserved_bytes.all().current, 0);
    assert!(dev.live().is_empty());
    a.validate().unwrap();
}

#[test]
fn unmap_block_keeps_partly_used_pages_mapped() {
    let (dev, a) = setup(GIB);
    let x = a.malloc(30 * MIB, S0).unwrap();
    let y = a.malloc(10 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    // Page 0 ([0, 20) MiB) was free: unmapped. Page 1 holds y: kept, with the
    // free 10 MiB before y.
    assert_eq!(a.stats().reserved_bytes.all().current, 20 * MIB as i64);
    assert_eq!(dev.live().mappings, 1);
    let seg = &a.snapshot().segments[0];
    let states: Vec<_> = seg.blocks.iter().map(|b| (b.state, b.size / MIB)).collect();
    assert_eq!(
        states[..3],
        [
            (BlockState::Unmapped, 20),
            (BlockState::Inactive, 10),
            (BlockState::ActiveAllocated, 10)
        ]
    );
    // Mapping again fills the hole at the lowest address.
    let z = a.malloc(30 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    a.free(y.ptr).unwrap();
    a.validate().unwrap();
}

#[test]
fn malloc_out_of_memory_unmaps_another_streams_free_pages_then_retries() {
    let (dev, a) = setup(100 * MIB);
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(60 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    let before = dev.counts();
    let y = a.malloc(60 * MIB, s2).unwrap();
    assert_eq!(y.size, 60 * MIB);
    let s = a.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(calls(&dev, &before, Call::Unmap), 3);
    // Two pages fit before the flush: 3 creates, the third failing, the two
    // created released again; then the flush releases 3; then 3 creates.
    assert_eq!(calls(&dev, &before, Call::Release), 2 + 3);
    assert_eq!(calls(&dev, &before, Call::Create), 6);
    assert_eq!(s.num_ooms, 0);
    a.validate().unwrap();
    let e = a.malloc(60 * MIB, S0).unwrap_err();
    let AllocError::OutOfMemory(r) = &e else {
        panic!("{e}")
    };
    assert_eq!(r.policy, "torch-es");
    assert_eq!(r.rounded, 60 * MIB);
    assert_eq!(a.stats().num_ooms, 1);
    a.validate().unwrap();
}

#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let (dev, a) = setup(GIB);
    let s2 = dev.create_stream().unwrap();
    let x = a.malloc(8 * MIB, S0).unwrap();
    a.record_stream(x.ptr, s2).unwrap();
    dev.streams().submit(s2, x.ptr, 8 * MIB).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.malloc(8 * MIB, S0).unwrap();
    assert_ne!(y.ptr, x.ptr);
    a.validate().unwrap();
    dev.streams().complete(s2).unwrap();
    a.free(y.ptr).unwrap();
    let z = a.malloc(8 * MIB, S0).unwrap();
    assert_eq!(z.ptr, x.ptr);
    // empty_cache with an outstanding event waits for it before unmapping.
    a.record_stream(z.ptr, s2).unwrap();
    dev.streams().submit(s2, z.ptr, 8 * MIB).unwrap();
    a.free(z.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().driver_calls.get(Call::EventSync), 1);
    assert!(dev.live().is_empty());
    a.validate().unwrap();
}

#[test]
fn map_failure_is_rolled_back() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    let faulty = Arc::new(FaultInjecting::with_plan(dev.clone(), FaultPlan::None));
    let a = TorchEsAllocator::new(faulty.clone(), CachingConfig::default()).unwrap();
    faulty.hook().set_plan(FaultPlan::Nth {
        call: Call::Map,
        n: 2,
        kind: FaultKind::Driver(999),
    });
    let e = a.malloc(50 * MIB, S0).unwrap_err();
    assert!(matches!(e, AllocError::Device(_)), "{e}");
    let live = dev.live();
    assert_eq!(
        (live.handles, live.mappings, live.physical_bytes),
        (0, 0, 0),
        "pages released"
    );
    assert_eq!(a.stats().reserved_bytes.all().current, 0);
    a.validate().unwrap();
    let x = a.malloc(50 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    // An unmap failing midway: the pages already unmapped are accounted for.
    let n = faulty.hook().seen(Call::Unmap) + 2;
    faulty.hook().set_plan(FaultPlan::Nth {
        call: Call::Unmap,
        n,
        kind: FaultKind::Driver(999),
    });
    assert!(a.empty_cache().is_err());
    assert_eq!(a.stats().reserved_bytes.all().current, 40 * MIB as i64);
    a.validate().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.all().current, 0);
    a.validate().unwrap();
}

#[test]
fn create_out_of_memory_releases_the_pages_created_so_far() {
    let (dev, a) = setup(50 * MIB);
    let e = a.malloc(45 * MIB, S0).unwrap_err();
    assert!(e.is_out_of_memory());
    assert_eq!(dev.live().handles, 0);
    assert_eq!(dev.live().physical_bytes, 0);
    assert_eq!(a.stats().num_alloc_retries, 1);
    a.validate().unwrap();
}

#[test]
fn drop_returns_everything_to_the_device() {
    let dev = Arc::new(SimDevice::with_capacity(GIB));
    {
        let a = TorchEsAllocator::new(dev.clone(), CachingConfig::default()).unwrap();
        let s2 = dev.create_stream().unwrap();
        let live = a.malloc(7 * MIB, S0).unwrap();
        dev.streams().submit(S0, live.ptr, 7 * MIB).unwrap();
        let _small = a.malloc(1000, s2).unwrap();
        let cached = a.malloc(40 * MIB, S0).unwrap();
        a.free(cached.ptr).unwrap();
        let pending = a.malloc(3 * MIB, S0).unwrap();
        a.record_stream(pending.ptr, s2).unwrap();
        dev.streams().submit(s2, pending.ptr, 3 * MIB).unwrap();
        a.free(pending.ptr).unwrap();
        a.validate().unwrap();
    }
    assert!(dev.live().is_empty(), "{:?}", dev.live());
    assert_eq!(dev.streams().live_events(), 0);
    dev.check().unwrap();
}
