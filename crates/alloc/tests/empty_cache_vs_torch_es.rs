//! What live blocks keep mapped after `empty_cache()`: never more under
//! `expandable` than under PyTorch's expandable segments (the `torch-es`
//! replica), for the same sequence of allocations and frees (issue 40).
//!
//! PyTorch's expandable segments map the large pool in 20 MiB pages and the
//! small pool in 2 MiB pages (`CUDACachingAllocator.cpp`, `ExpandableSegment`,
//! `kLargeBuffer` / `kSmallBuffer`) and `empty_cache()` unmaps every page no
//! live block touches (`release_cached_blocks` → `unmap_block`). `expandable`
//! maps chunks of up to `max_chunk` (1 GiB) and gives a chunk back only
//! whole, so it must never let a small block sit in a large chunk it leaves
//! mostly free (`pages.rs`, "Big chunks stay whole").
//!
//! Both allocators replay each sequence on a simulated device of their own,
//! large enough that neither runs out of memory; after every `empty_cache()`
//! (random ones and a final one) the physical bytes each device holds are
//! compared, and `validate()` runs after every step.

use proptest::prelude::*;
use std::sync::Arc;
use vmmalloc_alloc::caching::CachingConfig;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::Allocator;
use vmmalloc_alloc_harness::{Harness, Op, Outcome};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Introspect, GIB, MIB};

/// A device no sequence below fills: at most 48 live blocks of 2 GiB.
const CAPACITY: u64 = 160 * GIB;

/// Sizes from 512 B to 2 GiB: log-uniform (mostly small), a quarter of them
/// 20 MiB – 2 GiB (the handles that matter), a few just around PyTorch's
/// size-class edges.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => (9u32..=31, any::<u64>()).prop_map(|(b, r)| (1u64 << b) + r % (1u64 << b)),
        3 => (20 * MIB)..=(2 * GIB),
        1 => prop::sample::select(vec![
            512,
            MIB,
            MIB + 512,
            2 * MIB,
            10 * MIB - 512,
            10 * MIB,
            20 * MIB,
            20 * MIB + 1,
            GIB,
        ]),
    ]
}

fn op(streams: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (size(), 0..streams).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        6 => any::<usize>().prop_map(|slot| Op::Free { slot }),
        1 => Just(Op::EmptyCache),
    ]
}

/// Streams (1 to 4) and a sequence with at most 48 blocks live at once.
fn case() -> impl Strategy<Value = (usize, Vec<Op>)> {
    (1usize..=4).prop_flat_map(|streams| {
        (
            Just(streams),
            prop::collection::vec(op(streams), 1..80).prop_map(|ops| {
                let mut live = 0usize;
                ops.into_iter()
                    .filter(|o| match o {
                        Op::Malloc { .. } if live >= 48 => false,
                        Op::Malloc { .. } => {
                            live += 1;
                            true
                        }
                        Op::Free { .. } => {
                            live = live.saturating_sub(1);
                            true
                        }
                        _ => true,
                    })
                    .collect()
            }),
        )
    })
}

/// Physical bytes a device holds.
fn held(dev: &SimDevice) -> u64 {
    dev.live().physical_bytes
}

/// Replays `ops` under both policies; returns, for every `empty_cache()`
/// (the last one added at the end), the bytes each held afterwards.
fn replay(streams: usize, ops: &[Op]) -> Result<Vec<(u64, u64)>, TestCaseError> {
    let dev_x = Arc::new(SimDevice::with_capacity(CAPACITY));
    let dev_t = Arc::new(SimDevice::with_capacity(CAPACITY));
    let x = ExpandableAllocator::new(dev_x.clone(), ExpandableConfig::default())
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let t = TorchEsAllocator::new(dev_t.clone(), CachingConfig::default())
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut hx = Harness::new(&x, &*dev_x, streams).map_err(TestCaseError::fail)?;
    let mut ht = Harness::new(&t, &*dev_t, streams).map_err(TestCaseError::fail)?;
    ht.pytorch_stats = true;
    let mut out = Vec::new();
    for (i, o) in ops.iter().chain([&Op::EmptyCache]).enumerate() {
        for (name, h) in [("expandable", &mut hx), ("torch-es", &mut ht)] {
            let r = h
                .apply(o)
                .map_err(|e| TestCaseError::fail(format!("{name} step {i} {o:?}: {e}")))?;
            prop_assert_eq!(r, Outcome::Done, "{} step {} {:?}", name, i, o);
            h.check()
                .map_err(|e| TestCaseError::fail(format!("{name} after step {i} {o:?}: {e}")))?;
        }
        if *o == Op::EmptyCache {
            out.push((held(&dev_x), held(&dev_t)));
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn after_empty_cache_expandable_holds_no_more_than_torch_es((streams, ops) in case()) {
        for (k, (ours, theirs)) in replay(streams, &ops)?.into_iter().enumerate() {
            prop_assert!(
                ours <= theirs,
                "empty_cache #{}: expandable holds {} MiB, torch-es {} MiB",
                k,
                ours / MIB,
                theirs / MIB
            );
        }
    }
}

/// The case that found it: 2 MiB, 1 GiB, 2 MiB, free the 1 GiB block,
/// `empty_cache()`. Before, the second 2 MiB block sat in the pages mapped
/// ahead of the 1 GiB block's handle and kept 1040 MiB mapped; PyTorch's
/// expandable segments keep one 20 MiB page per live block (40 MiB).
#[test]
fn a_small_block_after_a_large_one_does_not_pin_its_handle() {
    let ops = [
        Op::Malloc {
            size: 2 * MIB,
            stream: 0,
        },
        Op::Malloc {
            size: GIB,
            stream: 0,
        },
        Op::Malloc {
            size: 2 * MIB,
            stream: 0,
        },
        Op::Free { slot: 1 },
    ];
    let held = replay(1, &ops).unwrap();
    let (ours, theirs) = *held.last().unwrap();
    assert_eq!(theirs, 40 * MIB);
    assert!(ours <= 40 * MIB, "expandable keeps {} MiB", ours / MIB);
}

/// A small block placed where a freed 1 GiB block was: the 1 GiB handle is
/// split (unmapped into the pool) rather than pinned, so `empty_cache()`
/// gives it back.
#[test]
fn a_small_block_in_a_freed_large_blocks_place_does_not_pin_its_handle() {
    let ops = [
        Op::Malloc {
            size: GIB,
            stream: 0,
        },
        Op::Malloc {
            size: 2 * MIB,
            stream: 0,
        },
        Op::Free { slot: 0 },
        Op::Malloc {
            size: 3 * MIB,
            stream: 0,
        },
    ];
    let held = replay(1, &ops).unwrap();
    let (ours, theirs) = *held.last().unwrap();
    assert!(
        ours <= theirs,
        "expandable {} MiB, torch-es {} MiB",
        ours / MIB,
        theirs / MIB
    );
    assert!(ours <= 40 * MIB, "expandable keeps {} MiB", ours / MIB);
}

/// A training loop's same-sized large tensors find their chunks again: after
/// the first iteration, no driver call (the rules above cost nothing there).
#[test]
fn a_repeating_loop_makes_no_call_after_its_first_iteration() {
    let dev = Arc::new(SimDevice::with_capacity(16 * GIB));
    let x = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let sizes = [3 * MIB, 700 * MIB, 40 * MIB, 512, 300 * MIB, 5 * MIB, GIB];
    let s = vmmalloc_device::Stream::DEFAULT;
    let mut counts = Vec::new();
    for _ in 0..3 {
        let live: Vec<_> = sizes.iter().map(|&n| x.malloc(n, s).unwrap()).collect();
        // Free the large ones first, then allocate small ones in their place.
        for a in live.iter().filter(|a| a.size >= 20 * MIB) {
            x.free(a.ptr).unwrap();
        }
        let small: Vec<_> = (0..4).map(|_| x.malloc(4 * MIB, s).unwrap()).collect();
        for a in small
            .iter()
            .chain(live.iter().filter(|a| a.size < 20 * MIB))
        {
            x.free(a.ptr).unwrap();
        }
        x.validate().unwrap();
        counts.push(dev.counts().total());
    }
    assert_eq!(
        counts[1], counts[2],
        "calls per iteration after the first: {counts:?}"
    );
}
