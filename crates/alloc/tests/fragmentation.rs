//! The classic fragmentation scenario on the `sim` device, run on the three
//! baselines: PyTorch's plain caching allocator runs out of memory although the
//! free memory would suffice; PyTorch's expandable segments survive only by a
//! full flush (synchronize, unmap and release every free page, map again);
//! `native` survives.
//!
//! The workload, on a 440 MiB device:
//! 1. 60 activations of 6 MiB, then a 6 MiB tensor S that stays;
//! 2. the 60 activations are freed;
//! 3. 20 tensors of 15 MiB that stay (e.g. the next layer's outputs);
//! 4. one 100 MiB request.
//!
//! `caching` packs three 6 MiB blocks per 20 MiB segment (`get_allocation_size`),
//! then each 15 MiB tensor splits one of those segments (`should_split`): every
//! segment holds a live block, none can be released, 134 MiB are free in 5 MiB
//! slivers. `torch-es` packs the 15 MiB tensors contiguously, leaving three whole
//! free 20 MiB pages between them and S, which only `release_cached_blocks` (the
//! last retry) unmaps so that they can be mapped again at the segment's end.

use std::sync::Arc;
use vmmalloc_alloc::caching::{CachingAllocator, CachingConfig};
use vmmalloc_alloc::native::NativeAllocator;
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Stats};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, CallCounts, Device, Introspect, Stream, MIB};

const CAPACITY: u64 = 440 * MIB;
const REQUEST: u64 = 100 * MIB;
const S0: Stream = Stream::DEFAULT;

struct Outcome {
    result: Result<Allocation, AllocError>,
    /// Stats just before the final request.
    before: Stats,
    /// Device free memory just before the final request.
    device_free_before: u64,
    /// Stats after it.
    after: Stats,
    /// Device calls made by the final request.
    last_calls: CallCounts,
    /// Device calls over the whole run.
    all_calls: CallCounts,
}

fn step(a: &dyn Allocator, r: Result<Allocation, AllocError>) -> Allocation {
    a.validate().unwrap();
    r.unwrap_or_else(|e| panic!("{}: the setup must fit: {e}", a.name()))
}

fn run(dev: &Arc<SimDevice>, a: &dyn Allocator) -> Outcome {
    let acts: Vec<_> = (0..60).map(|_| step(a, a.malloc(6 * MIB, S0))).collect();
    let _s = step(a, a.malloc(6 * MIB, S0));
    for x in acts {
        a.free(x.ptr).unwrap();
        a.validate().unwrap();
    }
    let _kept: Vec<_> = (0..20).map(|_| step(a, a.malloc(15 * MIB, S0))).collect();
    let before = a.stats();
    let device_free_before = dev.mem_info().unwrap().free;
    let calls_before = dev.counts();
    let result = a.malloc(REQUEST, S0);
    a.validate().unwrap();
    Outcome {
        result,
        before,
        device_free_before,
        after: a.stats(),
        last_calls: dev.counts().since(&calls_before),
        all_calls: dev.counts(),
    }
}

#[test]
fn caching_runs_out_of_memory_although_free_memory_would_suffice() {
    let dev = Arc::new(SimDevice::with_capacity(CAPACITY));
    let a = CachingAllocator::new(dev.clone(), CachingConfig::default()).unwrap();
    let o = run(&dev, &a);
    let e = o.result.unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    let cached =
        (o.before.reserved_bytes.all().current - o.before.allocated_bytes.all().current) as u64;
    assert_eq!(cached, 114 * MIB, "20 slivers of 5 MiB + 14 MiB next to S");
    assert_eq!(o.device_free_before, 20 * MIB);
    assert!(
        cached + o.device_free_before >= REQUEST,
        "the free memory would suffice"
    );
    assert!(
        a.cache_info() < REQUEST,
        "but no free block holds the request"
    );
    let AllocError::OutOfMemory(r) = &e else {
        unreachable!()
    };
    assert_eq!(r.largest_free, 14 * MIB);
    assert_eq!(r.cached, 114 * MIB);
    // release_cached_blocks found no whole segment to free: one retry, no cudaFree.
    assert_eq!(o.after.num_alloc_retries, 1);
    assert_eq!(o.after.num_ooms, 1);
    assert_eq!(o.last_calls.get(Call::Free), 0);
    assert_eq!(
        o.last_calls.get(Call::Alloc),
        2,
        "cudaMalloc, then the retry"
    );
    assert_eq!(o.after.segment.all().current, 21);
}

#[test]
fn torch_es_survives_only_through_a_full_flush() {
    let dev = Arc::new(SimDevice::with_capacity(CAPACITY));
    let a = TorchEsAllocator::new(dev.clone(), CachingConfig::default()).unwrap();
    let o = run(&dev, &a);
    let x = o
        .result
        .unwrap_or_else(|e| panic!("torch-es should survive: {e}"));
    assert_eq!(x.size, REQUEST);
    // Before the request, only 3 pages were free on the device: mapping at the
    // segment's end alone could not hold 100 MiB.
    assert_eq!(o.device_free_before, 60 * MIB);
    assert_eq!(o.before.num_sync_all_streams, 0);
    assert_eq!(
        o.all_calls.get(Call::Unmap) - o.last_calls.get(Call::Unmap),
        0,
        "no page was unmapped before"
    );
    // The flush: synchronize, unmap and release the three free pages, retry.
    assert_eq!(o.after.num_alloc_retries, 1);
    assert_eq!(o.after.num_sync_all_streams, 1);
    assert_eq!(o.after.num_ooms, 0);
    assert_eq!(o.last_calls.get(Call::StreamSync), 1);
    assert_eq!(o.last_calls.get(Call::Unmap), 3);
    // 3 pages created and released by the failed attempt, 3 released by the flush.
    assert_eq!(o.last_calls.get(Call::Release), 6);
    // 4 creates in the failed attempt (the 4th out of memory), 5 in the retry.
    assert_eq!(o.last_calls.get(Call::Create), 9);
    assert_eq!(o.last_calls.get(Call::Map), 5);
    assert_eq!(o.after.reserved_bytes.all().current, 420 * MIB as i64);
    assert!(dev.modeled_us() > 0.0);
}

#[test]
fn native_survives() {
    let dev = Arc::new(SimDevice::with_capacity(CAPACITY));
    let a = NativeAllocator::new(dev.clone()).unwrap();
    let o = run(&dev, &a);
    assert_eq!(o.result.unwrap().requested, REQUEST);
    assert_eq!(o.last_calls.get(Call::Alloc), 1);
    assert_eq!(o.all_calls.get(Call::Alloc), 60 + 1 + 20 + 1);
    assert_eq!(dev.live().plain_allocs, 1 + 20 + 1);
}
