//! Private pools (issue 32): CUDA-graph and MemPool memory inside the
//! expandable allocator with PyTorch's semantics (`CUDACachingAllocator.cpp`),
//! on `sim` (a capture model that refuses what the driver refuses) and `host`
//! (real bytes), with `validate()` after every step.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::pools::{PoolBlock, PoolId, PrivatePools};
use vmmalloc_alloc::{AllocError, Allocator, BlockState, Policy, PolicyOptions, StatType, Stream};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, GIB, MIB};

type Sim = ExpandableAllocator<Arc<SimDevice>>;

fn sim(capacity: u64) -> (Arc<SimDevice>, Sim) {
    let dev = Arc::new(SimDevice::with_capacity(capacity));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    (dev, a)
}

fn host(capacity: u64) -> (Arc<HostDevice>, ExpandableAllocator<Arc<HostDevice>>) {
    let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    (dev, a)
}

fn pool_err<T: std::fmt::Debug>(r: Result<T, AllocError>, text: &str) {
    match r {
        Err(AllocError::Pool(m)) => assert!(m.contains(text), "{m:?} lacks {text:?}"),
        other => panic!("expected a pool error with {text:?}, got {other:?}"),
    }
}

fn reserved<A: PrivatePools>(a: &A, id: PoolId) -> i64 {
    a.pool_stats(id).unwrap().stats.reserved_bytes.all().current
}

/// Row 1: inside one capture, a temporary allocated and freed 50 times
/// comes back at the same address: the pool holds one copy, not 50.
#[test]
fn frees_during_capture_are_reused_by_the_same_capture() {
    let (dev, a) = sim(8 * GIB);
    let s = dev.create_stream().unwrap();
    let id = (1, 1);
    a.begin_allocate_to_pool(id).unwrap();
    dev.begin_capture(s).unwrap();
    let mut first = None;
    for _ in 0..50 {
        let t = a.pool_malloc(id, 16 * MIB, s).unwrap();
        assert_eq!(*first.get_or_insert(t.ptr), t.ptr, "not reused");
        a.free(t.ptr).unwrap();
        a.validate().unwrap();
    }
    a.end_allocate_to_pool(id).unwrap();
    dev.end_capture(s)
        .expect("nothing forbidden happened during the capture");
    let r = reserved(&a, id);
    assert!(
        r >= 16 * MIB as i64 && r <= 20 * MIB as i64,
        "pool holds {r} bytes"
    );
    assert_eq!(
        a.stats().reserved_bytes.all().current,
        r,
        "pool bytes are the allocator's"
    );
}

/// Row 2: inside a capture (or `use_mem_pool`), a main-allocator free is
/// not deferred: its bytes are free at once and the next main allocation
/// of that size reuses them.
#[test]
fn main_allocator_frees_are_not_deferred_by_a_capture() {
    let (dev, a) = sim(8 * GIB);
    let s = dev.create_stream().unwrap();
    let x = a.malloc(64 * MIB, s).unwrap();
    a.begin_allocate_to_pool((0, 5)).unwrap();
    let before = a.stats().allocated_bytes.all().current;
    a.free(x.ptr).unwrap();
    assert_eq!(
        before - a.stats().allocated_bytes.all().current,
        x.size as i64,
        "the free took effect at once"
    );
    let y = a.malloc(64 * MIB, s).unwrap();
    assert_eq!(y.ptr, x.ptr, "the main allocator reused the freed block");
    // The pool's own allocation does not take the main pool's block.
    let p = a.pool_malloc((0, 5), 64 * MIB, s).unwrap();
    assert_ne!(p.ptr, y.ptr);
    assert_eq!(a.pool_of(p.ptr), Some((0, 5)));
    assert_eq!(a.pool_of(y.ptr), None);
    a.end_allocate_to_pool((0, 5)).unwrap();
    a.validate().unwrap();
}

/// A block used on another stream and freed during a capture waits until
/// no capture is underway (no event recorded or queried during capture),
/// then comes back after its event.
#[test]
fn record_stream_blocks_freed_during_capture_wait_for_the_capture() {
    let (dev, a) = sim(8 * GIB);
    let s = dev.create_stream().unwrap();
    let other = dev.create_stream().unwrap();
    let id = (2, 1);
    a.begin_allocate_to_pool(id).unwrap();
    dev.begin_capture(s).unwrap();
    let shared = a.pool_malloc(id, 4 * MIB, s).unwrap();
    a.record_stream(shared.ptr, other).unwrap();
    let calls = dev.counts();
    a.free(shared.ptr).unwrap();
    assert_eq!(
        dev.counts().get(Call::EventRecord),
        calls.get(Call::EventRecord)
    );
    a.validate().unwrap();
    let state = |a: &Sim| {
        a.snapshot()
            .segments
            .iter()
            .flat_map(|g| g.blocks.iter())
            .find(|b| b.address == shared.ptr)
            .map(|b| b.state)
    };
    assert_eq!(state(&a), Some(BlockState::ActivePendingFree));
    // The capture does not reuse it.
    let n = a.pool_malloc(id, 4 * MIB, s).unwrap();
    assert_ne!(n.ptr, shared.ptr);
    a.end_allocate_to_pool(id).unwrap();
    dev.end_capture(s).expect("no forbidden call");
    // The next allocation after the capture records the event; once the
    // other stream's work is done the block is free again.
    dev.synchronize_stream(other).unwrap();
    let _m = a.malloc(MIB, s).unwrap();
    a.validate().unwrap();
    let _m2 = a.malloc(MIB, s).unwrap();
    assert_ne!(state(&a), Some(BlockState::ActivePendingFree));
    a.validate().unwrap();
}

/// Row 3: ten recordings into one pool, each producing a 64 MiB output the
/// user then drops, with a checkpoint after each: a checkpoint holds no
/// memory, so the pool stays at one output's size.
#[test]
fn checkpoints_hold_no_memory() {
    let (dev, a) = sim(8 * GIB);
    let s = dev.create_stream().unwrap();
    let id = (3, 1);
    let mut checkpoints: Vec<Vec<PoolBlock>> = Vec::new();
    for _ in 0..10 {
        a.begin_allocate_to_pool(id).unwrap();
        let out = a.pool_malloc(id, 64 * MIB, s).unwrap();
        a.end_allocate_to_pool(id).unwrap();
        checkpoints.push(a.pool_live_blocks(id).unwrap());
        a.free(out.ptr).unwrap();
        a.validate().unwrap();
    }
    let r = reserved(&a, id);
    assert!(
        r <= 64 * MIB as i64 + 20 * MIB as i64,
        "pool holds {} MiB",
        r >> 20
    );
    // Each checkpoint names one live block.
    assert!(checkpoints.iter().all(|c| c.len() == 1));
    assert_eq!(a.pool_use_count(id).unwrap(), 10);
}

/// Restore frees every live block of the pool and allocates the
/// checkpointed ones at their addresses; the sets are PyTorch's.
#[test]
fn restore_frees_the_pool_and_reallocates_the_checkpoint() {
    let (dev, a) = sim(GIB);
    let s = dev.create_stream().unwrap();
    let id = (0, 3);
    pool_err(a.pool_live_blocks(id), "unknown pool (0, 3)");
    a.begin_allocate_to_pool(id).unwrap();
    let x = a.pool_malloc(id, 3 * MIB, s).unwrap();
    let y = a.pool_malloc(id, 512, s).unwrap();
    let z = a.pool_malloc(id, 5 * MIB, s).unwrap();
    a.end_allocate_to_pool(id).unwrap();
    let cp = a.pool_live_blocks(id).unwrap();
    let mut want: Vec<u64> = vec![x.ptr, y.ptr, z.ptr];
    want.sort_unstable();
    assert_eq!(cp.iter().map(|b| b.ptr).collect::<Vec<_>>(), want);
    // After the checkpoint y dies and w is born (it may take y's place:
    // nothing is held).
    a.free(y.ptr).unwrap();
    let w = a.pool_malloc(id, 512, s).unwrap();
    let allocated = a.stats().allocated_bytes.all().current;
    let r = a.restore_pool(id, &cp).unwrap();
    a.validate().unwrap();
    let mut freed = vec![x.ptr, z.ptr, w.ptr];
    freed.sort_unstable();
    assert_eq!(r.freed, freed);
    assert_eq!(r.allocated, cp);
    assert_eq!(a.pool_live_blocks(id).unwrap(), cp);
    assert_eq!(
        a.stats().allocated_bytes.all().current,
        allocated - w.size as i64 + y.size as i64
    );
    // Restoring twice is the same state.
    let r2 = a.restore_pool(id, &cp).unwrap();
    assert_eq!(r2.freed, want);
    assert_eq!(a.pool_live_blocks(id).unwrap(), cp);
    a.validate().unwrap();
    // A checkpoint that does not fit the pool is refused, nothing changed.
    let mut bad = cp.clone();
    bad[0].ptr = 0x1000;
    pool_err(a.restore_pool(id, &bad), "none of the pool's segments");
    let mut bad = cp.clone();
    bad[1].ptr = bad[0].ptr;
    pool_err(a.restore_pool(id, &bad), "overlaps");
    let mut bad = cp.clone();
    bad[0].stream = dev.create_stream().unwrap();
    pool_err(a.restore_pool(id, &bad), "another stream");
    assert_eq!(a.pool_live_blocks(id).unwrap(), cp);
    // Not during a capture.
    a.begin_allocate_to_pool((9, 9)).unwrap();
    pool_err(a.restore_pool(id, &cp), "capture is underway");
    a.end_allocate_to_pool((9, 9)).unwrap();
    a.validate().unwrap();
}

/// Use counts and the errors of the protocol, as PyTorch raises them.
#[test]
fn protocol_errors_and_use_counts() {
    let (_dev, a) = sim(GIB);
    let id = (4, 2);
    pool_err(a.end_allocate_to_pool(id), "unknown pool (4, 2)");
    pool_err(a.release_pool(id), "unknown pool");
    pool_err(a.pool_malloc(id, 8, Stream::DEFAULT), "unknown pool");
    pool_err(a.begin_allocate_to_pool((0, 0)), "main pool");
    a.create_or_incref_pool(id).unwrap(); // MemPool()
    a.begin_allocate_to_pool(id).unwrap(); // use_mem_pool
    assert_eq!(a.pool_use_count(id).unwrap(), 2);
    // Nested use_mem_pool on the same pool raises and changes nothing.
    pool_err(
        a.begin_allocate_to_pool(id),
        "already recording to mempool_id (4, 2)",
    );
    assert_eq!(a.pool_use_count(id).unwrap(), 2);
    a.end_allocate_to_pool(id).unwrap();
    pool_err(a.end_allocate_to_pool(id), "not currently recording");
    a.release_pool(id).unwrap();
    assert_eq!(a.pool_use_count(id).unwrap(), 1, "the MemPool still lives");
    let b = a.pool_malloc(id, MIB, Stream::DEFAULT).unwrap();
    a.release_pool(id).unwrap(); // ~MemPool: freeable, a block is live
    assert_eq!(a.pool_use_count(id).unwrap(), 0);
    pool_err(a.release_pool(id), "released already");
    pool_err(a.pool_malloc(id, 8, Stream::DEFAULT), "released");
    a.free(b.ptr).unwrap();
    a.empty_cache().unwrap();
    pool_err(a.pool_use_count(id), "has gone");
    assert!(a.pool_ids().is_empty());
    a.validate().unwrap();
}

/// Pool bytes are in the allocator's statistics (PyTorch's aggregate
/// stats include private pools), per pool too, and the snapshot's
/// segments carry their pool id.
#[test]
fn pool_bytes_count_in_the_stats_and_the_snapshot() {
    let (_dev, a) = sim(4 * GIB);
    let main = a.malloc(10 * MIB, Stream::DEFAULT).unwrap();
    let id = (7, 7);
    a.create_or_incref_pool(id).unwrap();
    let blocks: Vec<_> = (0..10)
        .map(|_| a.pool_malloc(id, 64 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    let s = a.stats();
    let ps = a.pool_stats(id).unwrap();
    assert_eq!(ps.live_blocks, 10);
    assert_eq!(ps.stats.allocated_bytes.all().current, 640 * MIB as i64);
    assert_eq!(
        s.allocated_bytes.all().current,
        640 * MIB as i64 + main.size as i64
    );
    assert!(s.reserved_bytes.all().current >= 650 * MIB as i64);
    let snap = a.snapshot();
    for b in &blocks {
        let seg = snap
            .segments
            .iter()
            .find(|g| g.blocks.iter().any(|x| x.address == b.ptr))
            .unwrap();
        assert_eq!(seg.pool, id);
    }
    let main_seg = snap
        .segments
        .iter()
        .find(|g| g.blocks.iter().any(|x| x.address == main.ptr))
        .unwrap();
    assert_eq!(main_seg.pool, (0, 0));
}

/// A pool's pages stay where they are while it has users: with the device
/// full and the pool's free memory in two ranges, neither reclaim nor
/// unpinning nor empty_cache takes them. After the last user leaves, one
/// device synchronize and empty_cache give them back.
#[test]
fn pinned_pool_pages_never_move_and_go_back_when_freeable() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let config = ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), config).unwrap();
    let s = dev.create_stream().unwrap();
    let id = (0, 7);
    a.begin_allocate_to_pool(id).unwrap();
    let x = a.pool_malloc(id, 24 * MIB, s).unwrap();
    let c = a.pool_malloc(id, 8 * MIB, s).unwrap(); // the graph's output, kept
    let y = a.pool_malloc(id, 24 * MIB, s).unwrap();
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.end_allocate_to_pool(id).unwrap();
    let m = a.malloc(8 * MIB, s).unwrap(); // the device is full now
    let r = a.malloc(40 * MIB, s);
    assert!(
        r.is_err(),
        "the main allocator took pinned pool pages: {r:?}"
    );
    a.empty_cache().unwrap();
    let model = dev.introspect().unwrap();
    for b in [x, y, c] {
        assert!(model.is_accessible(b.ptr, b.size), "{:#x} moved", b.ptr);
    }
    a.validate().unwrap();
    assert_eq!(reserved(&a, id), 56 * MIB as i64);
    // The graph is destroyed: the pool is freeable; empty_cache synchronizes
    // the device once and returns its free pages.
    a.release_pool(id).unwrap();
    let syncs = a.stats().num_sync_all_streams;
    a.empty_cache().unwrap();
    assert_eq!(a.stats().num_sync_all_streams, syncs + 1);
    assert_eq!(
        reserved(&a, id),
        8 * MIB as i64,
        "only the kept output stays"
    );
    let big = a.malloc(40 * MIB, s).unwrap();
    a.validate().unwrap();
    a.free(big.ptr).unwrap();
    a.free(c.ptr).unwrap();
    a.free(m.ptr).unwrap();
    a.empty_cache().unwrap();
    assert!(a.pool_ids().is_empty(), "the pool went with its last block");
    let info = dev.mem_info().unwrap();
    assert_eq!(info.free, info.total);
}

/// Under memory pressure (no empty_cache), a freeable pool's free pages
/// are reclaimed after one device synchronize, as PyTorch releases
/// freeable pools when an allocation fails.
#[test]
fn freeable_pool_pages_serve_allocations_under_pressure() {
    let (dev, a) = sim(64 * MIB);
    let s = dev.create_stream().unwrap();
    let id = (5, 5);
    a.begin_allocate_to_pool(id).unwrap();
    let t = a.pool_malloc(id, 48 * MIB, s).unwrap();
    a.free(t.ptr).unwrap();
    a.end_allocate_to_pool(id).unwrap();
    assert!(
        a.malloc(40 * MIB, s).is_err(),
        "pinned: the pool keeps its pages"
    );
    a.release_pool(id).unwrap();
    let m = a.malloc(40 * MIB, s).unwrap();
    a.validate().unwrap();
    a.free(m.ptr).unwrap();
}

/// `MemPool(use_on_oom=True)` (PyTorch's `use_on_oom_pools`, after its
/// `test_mempool_use_on_oom`): a main-pool allocation that finds no memory
/// takes a free block of such a pool, in that pool (its stats, its free
/// list afterwards), never one of a pool without the flag; no
/// out-of-memory is counted then. Allocations into a pool take nothing,
/// and turning the flag off (as `~MemPool` does) ends it.
#[test]
fn use_on_oom_pools_lend_their_free_blocks_to_the_main_pool() {
    let (dev, a) = sim(64 * MIB);
    let s = dev.create_stream().unwrap();
    let (use_it, not_it, other) = ((7, 1), (7, 2), (7, 3));
    for id in [use_it, not_it, other] {
        a.create_or_incref_pool(id).unwrap();
    }
    let b = a.pool_malloc(not_it, 20 * MIB, s).unwrap();
    a.free(b.ptr).unwrap();
    let u = a.pool_malloc(use_it, 20 * MIB, s).unwrap();
    a.free(u.ptr).unwrap();
    let live = a.malloc(10 * MIB, s).unwrap();
    a.validate().unwrap();
    // 40 MiB pinned in the two pools, 10 MiB live: 14 MiB left.
    assert!(a.malloc(20 * MIB, s).unwrap_err().is_out_of_memory());
    let ooms = a.stats().num_ooms;
    pool_err(a.set_use_on_oom((9, 9), true), "(9, 9)");
    a.set_use_on_oom(use_it, true).unwrap();
    a.validate().unwrap();
    let before = a
        .pool_stats(use_it)
        .unwrap()
        .stats
        .allocated_bytes
        .all()
        .current;
    let m = a
        .malloc(20 * MIB, s)
        .expect("served from the use_on_oom pool");
    a.validate().unwrap();
    assert_eq!(m.ptr, u.ptr, "the pool's free block");
    assert_eq!(a.pool_of(m.ptr), Some(use_it));
    assert_eq!(a.stats().num_ooms, ooms, "no out-of-memory counted");
    let during = a
        .pool_stats(use_it)
        .unwrap()
        .stats
        .allocated_bytes
        .all()
        .current;
    assert_eq!(during - before, 20 * MIB as i64, "counted in the pool");
    // Nothing else fits: the pool without the flag lends nothing, and an
    // allocation into a pool does not fall back.
    assert!(a.malloc(20 * MIB, s).unwrap_err().is_out_of_memory());
    assert!(a
        .pool_malloc(other, 20 * MIB, s)
        .unwrap_err()
        .is_out_of_memory());
    a.free(m.ptr).unwrap();
    a.validate().unwrap();
    assert_eq!(
        a.pool_stats(use_it)
            .unwrap()
            .stats
            .allocated_bytes
            .all()
            .current,
        before
    );
    // The block went back to its pool: a pool allocation finds it.
    let again = a.pool_malloc(use_it, 20 * MIB, s).unwrap();
    assert_eq!(again.ptr, u.ptr);
    a.free(again.ptr).unwrap();
    a.set_use_on_oom(use_it, false).unwrap();
    assert!(a.malloc(20 * MIB, s).unwrap_err().is_out_of_memory());
    a.validate().unwrap();
    // A pool that goes away leaves the list.
    a.set_use_on_oom(use_it, true).unwrap();
    a.release_pool(use_it).unwrap();
    a.free(live.ptr).unwrap();
    a.empty_cache().unwrap();
    a.validate().unwrap();
}

/// `MemPool(no_split=True)` (PyTorch's `no_split_pools`, `should_split`):
/// blocks are whole pages, freed neighbours are not merged, a free block is
/// taken whole by a smaller request; the same steps in an ordinary pool
/// merge and split. On `host` (real bytes, checked), then the pool goes
/// with its segments; `validate()` after every step.
#[test]
fn no_split_pools_never_split_nor_merge_their_blocks() {
    let (dev, a) = host(256 * MIB);
    let s = Stream::DEFAULT;
    let (unsplit, plain) = ((8, 1), (8, 2));
    a.create_or_incref_pool(unsplit).unwrap();
    a.create_or_incref_pool(plain).unwrap();
    pool_err(a.set_no_split((9, 9)), "(9, 9)");
    a.set_no_split(unsplit).unwrap();
    let size_of = |id: PoolId, ptr: u64| {
        a.pool_live_blocks(id)
            .unwrap()
            .iter()
            .find(|b| b.ptr == ptr)
            .map(|b| b.size)
            .expect("live in the pool")
    };
    let mut steps = Vec::new();
    for id in [unsplit, plain] {
        // A small request: a whole page in the no_split pool.
        let small = a.pool_malloc(id, 1000, s).unwrap();
        let small_size = size_of(id, small.ptr);
        let xs: Vec<_> = (0..3)
            .map(|_| a.pool_malloc(id, 6 * MIB, s).unwrap())
            .collect();
        for (i, x) in xs.iter().enumerate() {
            pattern_fill(&*dev, i as u64, x.ptr, 6 * MIB).unwrap();
        }
        a.free(xs[0].ptr).unwrap();
        a.free(xs[1].ptr).unwrap();
        a.validate().unwrap();
        // 10 MiB fits only in the two freed blocks merged.
        let ten = a.pool_malloc(id, 10 * MIB, s).unwrap();
        a.validate().unwrap();
        let four = a.pool_malloc(id, 4 * MIB, s).unwrap();
        a.validate().unwrap();
        let four_size = size_of(id, four.ptr);
        pattern_check(&*dev, 2, xs[2].ptr, 6 * MIB).unwrap();
        steps.push((
            small_size,
            ten.ptr == xs[0].ptr,
            four.ptr,
            four_size,
            xs[0].ptr,
            xs[1].ptr,
        ));
        for p in [small.ptr, ten.ptr, four.ptr, xs[2].ptr] {
            a.free(p).unwrap();
            a.validate().unwrap();
        }
    }
    let page = 2 * MIB;
    let (small, merged, four, four_size, x0, x1) = steps[0];
    assert_eq!(small, page, "no_split: a small request takes a whole page");
    assert!(!merged, "no_split: the freed neighbours were merged");
    assert!(
        four == x0 || four == x1,
        "no_split: a freed block is reused"
    );
    assert_eq!(four_size, 6 * MIB, "no_split: the 6 MiB block was split");
    let (small, merged, _, four_size, _, _) = steps[1];
    assert!(small < page, "an ordinary pool packs small blocks");
    assert!(merged, "an ordinary pool merges freed neighbours");
    assert_eq!(four_size, 4 * MIB, "an ordinary pool splits");
    // No checkpoint restore on unmerged blocks.
    pool_err(a.restore_pool(unsplit, &[]), "no_split");
    // Both pools go, segments and all.
    a.release_pool(unsplit).unwrap();
    a.release_pool(plain).unwrap();
    a.empty_cache().unwrap();
    a.validate().unwrap();
    assert!(a.pool_ids().is_empty(), "pools left: {:?}", a.pool_ids());
    assert_eq!(a.stats().reserved_bytes.all().current, 0);
}

/// Part 2: a pool paused with its contents kept gives its memory back (the
/// device's free memory rises by at least the pool's size), another tensor
/// uses it, and after resume every block has its bytes at its address.
#[test]
fn pause_keeps_contents_and_resumes_at_the_same_addresses() {
    let (dev, a) = host(96 * MIB);
    let s = dev.create_stream().unwrap();
    let id = (8, 1);
    a.begin_allocate_to_pool(id).unwrap();
    let out = a.pool_malloc(id, 6 * MIB + 100, s).unwrap();
    let tmp = a.pool_malloc(id, 16 * MIB, s).unwrap();
    let small = a.pool_malloc(id, 4000, s).unwrap();
    a.free(tmp.ptr).unwrap();
    a.end_allocate_to_pool(id).unwrap();
    pattern_fill(&*dev, 1, out.ptr, out.size).unwrap();
    pattern_fill(&*dev, 2, small.ptr, small.size).unwrap();
    let pool_bytes = reserved(&a, id) as u64;
    let free_before = dev.mem_info().unwrap().free;
    let released = a.pause_pool(id, true).unwrap();
    a.validate().unwrap();
    assert!(
        released >= pool_bytes,
        "released {released} of {pool_bytes}"
    );
    assert!(dev.mem_info().unwrap().free - free_before >= pool_bytes);
    assert!(!dev.introspect().unwrap().is_accessible(out.ptr, 1));
    let ps = a.pool_stats(id).unwrap();
    assert!(ps.paused && ps.backup_bytes == out.size + small.size);
    assert_eq!(ps.stats.reserved_bytes.all().current, 0);
    // Pausing twice, allocating, capturing into it: clear errors.
    pool_err(a.pause_pool(id, true), "paused already");
    pool_err(a.pool_malloc(id, MIB, s), "paused");
    pool_err(a.begin_allocate_to_pool(id), "paused");
    // Its memory is usable by others while paused.
    let other = a.malloc(80 * MIB, s).unwrap();
    pattern_fill(&*dev, 3, other.ptr, other.size).unwrap();
    // Resume needs that memory: out of memory, still paused, nothing mapped.
    let e = a.resume_pool(id).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains("(8, 1)"), "{e}");
    assert!(a.pool_stats(id).unwrap().paused);
    assert_eq!(reserved(&a, id), 0);
    a.validate().unwrap();
    a.free(other.ptr).unwrap();
    let mapped = a.resume_pool(id).unwrap();
    assert_eq!(mapped, pool_bytes);
    a.validate().unwrap();
    pattern_check(&*dev, 1, out.ptr, out.size).unwrap();
    pattern_check(&*dev, 2, small.ptr, small.size).unwrap();
    // Every page mapped before is mapped again: the freed temporary's too
    // (a graph's replay uses it).
    assert!(dev.introspect().unwrap().is_accessible(tmp.ptr, tmp.size));
    pool_err(a.resume_pool(id), "not paused");
    // Discarding: the pages come back, the bytes do not have to.
    a.pause_pool(id, false).unwrap();
    assert_eq!(a.pool_stats(id).unwrap().backup_bytes, 0);
    a.resume_pool(id).unwrap();
    assert!(dev.introspect().unwrap().is_accessible(out.ptr, out.size));
    a.validate().unwrap();
}

/// PyTorch 2.13+'s `reserved_bytes_by_private_pools`
/// (c10/core/CachingDeviceAllocator.h): each private pool's mapped bytes by
/// id, small and large; the main pool has no entry, nor has a pool that never
/// mapped memory; a pool that has gone keeps its entry with `current` 0 and
/// its totals until a reset; pause and resume move it as they move the
/// device's `reserved_bytes`. `validate()` recounts it after every step.
#[test]
fn each_private_pool_counts_its_reserved_bytes_and_keeps_its_entry_when_gone() {
    let (dev, a) = host(256 * MIB);
    let s = dev.create_stream().unwrap();
    let (g, m) = ((0, 1), (3, 0));
    a.begin_allocate_to_pool(g).unwrap();
    let x = a.pool_malloc(g, 30 * MIB, s).unwrap();
    let y = a.pool_malloc(g, 1000, s).unwrap();
    a.end_allocate_to_pool(g).unwrap();
    a.create_or_incref_pool(m).unwrap();
    a.create_or_incref_pool((4, 0)).unwrap();
    let z = a.pool_malloc(m, 8 * MIB, s).unwrap();
    let main = a.malloc(4 * MIB, s).unwrap();
    a.validate().unwrap();
    let st = a.stats();
    let by = &st.reserved_bytes_by_private_pools;
    assert_eq!(by.keys().copied().collect::<Vec<_>>(), vec![g, m], "{by:?}");
    for id in [g, m] {
        let want = a.pool_stats(id).unwrap().stats.reserved_bytes;
        assert_eq!(by[&id].0.map(|x| x.current), want.0.map(|x| x.current));
    }
    assert!(by[&g].get(StatType::Small).current > 0 && by[&g].get(StatType::Large).current > 0);
    let total: i64 = by.values().map(|x| x.all().current).sum();
    assert!(
        total < st.reserved_bytes.all().current,
        "the main pool's bytes are not a pool's"
    );
    let flat = st.to_map();
    assert_eq!(
        flat["reserved_bytes_by_private_pools.3_0.large_pool.current"],
        by[&m].get(StatType::Large).current
    );
    let peak = by[&g].all().current;
    // Pause: its pages go, the entry follows; resume brings them back.
    a.pause_pool(m, true).unwrap();
    a.validate().unwrap();
    assert_eq!(
        a.stats().reserved_bytes_by_private_pools[&m].all().current,
        0
    );
    a.resume_pool(m).unwrap();
    a.validate().unwrap();
    assert_eq!(
        a.stats().reserved_bytes_by_private_pools[&m].all().current,
        by[&m].all().current
    );
    // Graph pool g freed, released, given back: gone, its entry kept.
    a.free(x.ptr).unwrap();
    a.free(y.ptr).unwrap();
    a.release_pool(g).unwrap();
    a.empty_cache().unwrap();
    a.validate().unwrap();
    assert!(a.pool_use_count(g).is_err(), "pool g has gone");
    let e = *a.stats().reserved_bytes_by_private_pools[&g].all();
    assert_eq!(
        (e.current, e.peak, e.allocated, e.freed),
        (0, peak, peak, peak)
    );
    a.reset_peak_stats();
    let st = a.stats();
    assert_eq!(st.reserved_bytes_by_private_pools[&g].all().peak, 0);
    let mm = st.reserved_bytes_by_private_pools[&m].all();
    assert_eq!(mm.peak, mm.current);
    a.free(z.ptr).unwrap();
    a.free(main.ptr).unwrap();
    a.validate().unwrap();
}

/// Pause and resume refuse during a capture; a failure at the k-th create
/// of a resume leaves no page of the pool mapped and the pool paused, and a
/// retry succeeds.
#[test]
fn resume_failures_leave_the_pool_paused() {
    let base = Arc::new(SimDevice::with_capacity(GIB));
    let dev = Arc::new(FaultInjecting::with_plan(base.clone(), FaultPlan::None));
    let config = ExpandableConfig {
        max_chunk: Some(2 * MIB),
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), config).unwrap();
    let s = dev.create_stream().unwrap();
    let id = (6, 6);
    a.begin_allocate_to_pool(id).unwrap();
    let blocks: Vec<_> = (0..4)
        .map(|_| a.pool_malloc(id, 3 * MIB, s).unwrap())
        .collect();
    pool_err(a.pause_pool(id, false), "capture is underway");
    a.end_allocate_to_pool(id).unwrap();
    let before = reserved(&a, id);
    // The sim device holds no bytes: discard the contents.
    a.pause_pool(id, false).unwrap();
    for k in 1..=3 {
        let seen = dev.hook().seen(Call::Create);
        dev.hook().set_plan(FaultPlan::Nth {
            call: Call::Create,
            n: seen + k,
            kind: FaultKind::Driver(999),
        });
        let r = a.resume_pool(id);
        dev.hook().set_plan(FaultPlan::None);
        assert!(r.is_err(), "create #{k} failed, resume succeeded");
        a.validate().unwrap();
        assert!(a.pool_stats(id).unwrap().paused);
        assert_eq!(reserved(&a, id), 0, "create #{k}: pages left mapped");
        for b in &blocks {
            assert!(!base.introspect().unwrap().is_accessible(b.ptr, 1));
        }
    }
    a.resume_pool(id).unwrap();
    assert_eq!(reserved(&a, id), before);
    a.validate().unwrap();
}

/// Only expandable has private pools.
#[test]
fn other_policies_have_no_pools() {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::with_capacity(GIB));
    for p in [Policy::Caching, Policy::TorchEs, Policy::Native] {
        let a = vmmalloc_alloc::build(p, dev.clone(), &PolicyOptions::default()).unwrap();
        assert!(a.pools().is_none(), "{p}");
    }
    let a = vmmalloc_alloc::build(Policy::Expandable, dev, &PolicyOptions::default()).unwrap();
    assert!(a.pools().is_some());
}

// ---------------------------------------------------------------------------
// The `cuda` backend over the fake libcuda (real bytes behind every mapping)

mod over_the_fake {
    use super::*;
    use std::sync::Mutex;
    use vmmalloc_device::adaptors::{CallHook, Hooked};
    use vmmalloc_device::cuda::CudaDevice;
    use vmmalloc_device::DeviceError;
    use vmmalloc_test_support::vmm_sys::Driver;
    use vmmalloc_test_support::{fake_cuda_library, in_child, FakeCuda};

    /// Records every device call that succeeded, in order, with the address
    /// range of those that act on one.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<(Call, u64)>>,
    }

    /// The hook, sharing the recorder with the test.
    struct Rec(Arc<Recorder>);

    impl CallHook for Rec {
        fn after(&self, call: Call, _bytes: u64, result: Result<(), &DeviceError>) {
            if result.is_ok() {
                self.0.calls.lock().unwrap().push((call, 0));
            }
        }
        fn on_range(&self, call: Call, addr: u64, _len: u64) {
            if let Some(last) = self
                .0
                .calls
                .lock()
                .unwrap()
                .iter_mut()
                .rev()
                .find(|c| c.0 == call)
            {
                last.1 = addr;
            }
        }
    }

    type Dev = Hooked<Arc<CudaDevice>, Rec>;

    fn open_fake() -> (Arc<Dev>, Arc<Recorder>) {
        let driver = Driver::load_from(fake_cuda_library()).expect("loading the fake libcuda");
        let cuda = Arc::new(CudaDevice::open_with(driver, 0).expect("fake device 0"));
        let rec = Arc::new(Recorder::default());
        (Arc::new(Hooked::new(cuda, Rec(rec.clone()))), rec)
    }

    fn kinds(rec: &Recorder, from: usize) -> Vec<Call> {
        rec.calls.lock().unwrap()[from..]
            .iter()
            .map(|c| c.0)
            .filter(|c| !matches!(c, Call::MemInfo | Call::HostAlloc))
            .collect()
    }

    /// Pause: synchronize, copy to host, unmap, release, and never free an
    /// address; resume: create, map at the same addresses, set access,
    /// copy back; the contents come back bitwise.
    #[test]
    fn pause_and_resume_call_order() {
        in_child(
            "over_the_fake::pause_and_resume_call_order",
            &[("FAKE_CUDA_CAPACITY_MB", "128")],
            || {
                let fake = FakeCuda::attach();
                let (dev, rec) = open_fake();
                {
                    let a =
                        ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
                    let id = (7, 1);
                    a.begin_allocate_to_pool(id).unwrap();
                    let x = a.pool_malloc(id, 24 * MIB, Stream::DEFAULT).unwrap();
                    let y = a.pool_malloc(id, 3 * MIB + 4096, Stream::DEFAULT).unwrap();
                    a.end_allocate_to_pool(id).unwrap();
                    pattern_fill(&*dev, 1, x.ptr, x.size).unwrap();
                    pattern_fill(&*dev, 2, y.ptr, y.size).unwrap();
                    let mapped_at: Vec<u64> = rec
                        .calls
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|c| c.0 == Call::Map)
                        .map(|c| c.1)
                        .collect();
                    let free0 = dev.mem_info().unwrap().free;
                    let from = rec.calls.lock().unwrap().len();
                    let released = a.pause_pool(id, true).unwrap();
                    a.validate().unwrap();
                    assert!(dev.mem_info().unwrap().free - free0 >= released);
                    let seq = kinds(&rec, from);
                    let first = |c: Call| seq.iter().position(|k| *k == c);
                    let last = |c: Call| seq.iter().rposition(|k| *k == c);
                    let sync = first(Call::DeviceSync).expect("pause synchronizes");
                    let copy = first(Call::CopyDtoH).expect("pause copies to host");
                    let unmap = first(Call::Unmap).expect("pause unmaps");
                    let release = first(Call::Release).expect("pause releases");
                    assert!(sync < copy, "{seq:?}");
                    assert!(last(Call::CopyDtoH) < Some(unmap), "{seq:?}");
                    assert!(last(Call::Unmap) < Some(release), "{seq:?}");
                    assert_eq!(first(Call::AddressFree), None, "{seq:?}");
                    assert!(
                        !seq.iter().any(|c| matches!(c, Call::Create | Call::Map)),
                        "{seq:?}"
                    );
                    assert_eq!(fake.calls("cuMemAddressFree"), 0);

                    let from = rec.calls.lock().unwrap().len();
                    assert_eq!(a.resume_pool(id).unwrap(), released);
                    a.validate().unwrap();
                    let seq = kinds(&rec, from);
                    let first = |c: Call| seq.iter().position(|k| *k == c);
                    let last = |c: Call| seq.iter().rposition(|k| *k == c);
                    let create = first(Call::Create).expect("resume creates");
                    let map = first(Call::Map).expect("resume maps");
                    let access = first(Call::SetAccess).expect("resume sets access");
                    let copy = first(Call::CopyHtoD).expect("resume copies back");
                    assert!(create < map && map < access, "{seq:?}");
                    assert!(last(Call::SetAccess) < Some(copy), "{seq:?}");
                    let remapped_at: Vec<u64> = rec.calls.lock().unwrap()[from..]
                        .iter()
                        .filter(|c| c.0 == Call::Map)
                        .map(|c| c.1)
                        .collect();
                    assert!(!remapped_at.is_empty());
                    for at in &remapped_at {
                        assert!(
                            mapped_at.iter().any(|m| m == at)
                                || (x.ptr..x.ptr + 40 * MIB).contains(at),
                            "resume mapped {at:#x}, not one of the pool's pages"
                        );
                    }
                    pattern_check(&*dev, 1, x.ptr, x.size).unwrap();
                    pattern_check(&*dev, 2, y.ptr, y.size).unwrap();
                    a.free(x.ptr).unwrap();
                    a.free(y.ptr).unwrap();
                    a.release_pool(id).unwrap();
                    a.empty_cache().unwrap();
                }
                fake.assert_clean(0);
            },
        );
    }

    /// A failure injected at the k-th `cuMemCreate` of a resume
    /// (`FAKE_CUDA_FAIL`) leaves no page of the pool mapped and the pool
    /// paused; the retry succeeds with the data.
    #[test]
    fn failed_create_during_resume_leaves_the_pool_paused() {
        // 8 MiB in a pool maps one 20 MiB grow granule: ten 2 MiB chunks
        // (max_chunk), created before the resume; the resume creates ten more.
        const BEFORE: u64 = 10;
        for k in [1u64, 4, 10] {
            let fail = format!("cuMemCreate:{}", BEFORE + k);
            in_child(
                "over_the_fake::failed_create_during_resume_leaves_the_pool_paused",
                &[("FAKE_CUDA_CAPACITY_MB", "128"), ("FAKE_CUDA_FAIL", &fail)],
                || {
                    let fake = FakeCuda::attach();
                    let (dev, _rec) = open_fake();
                    let a = ExpandableAllocator::new(
                        dev.clone(),
                        ExpandableConfig {
                            max_chunk: Some(2 * MIB),
                            ..ExpandableConfig::default()
                        },
                    )
                    .unwrap();
                    let id = (7, 2);
                    a.begin_allocate_to_pool(id).unwrap();
                    let x = a.pool_malloc(id, 8 * MIB, Stream::DEFAULT).unwrap();
                    a.end_allocate_to_pool(id).unwrap();
                    pattern_fill(&*dev, 5, x.ptr, x.size).unwrap();
                    assert_eq!(
                        fake.calls("cuMemCreate"),
                        BEFORE,
                        "the pool's chunks changed: update BEFORE ({fail})"
                    );
                    let mapped = reserved(&a, id) as u64;
                    assert_eq!(a.pause_pool(id, true).unwrap(), mapped);
                    let live = fake.live(0);
                    let e = a.resume_pool(id).unwrap_err();
                    assert!(!e.to_string().is_empty(), "{fail}: {e}");
                    a.validate().unwrap();
                    assert!(a.pool_stats(id).unwrap().paused, "{fail}: not paused");
                    assert_eq!(reserved(&a, id), 0, "{fail}: pool pages mapped");
                    assert_eq!(
                        fake.live(0),
                        live,
                        "{fail}: the failed resume left something"
                    );
                    assert_eq!(a.resume_pool(id).unwrap(), mapped);
                    a.validate().unwrap();
                    pattern_check(&*dev, 5, x.ptr, x.size).unwrap();
                    a.free(x.ptr).unwrap();
                },
            );
        }
    }
}
