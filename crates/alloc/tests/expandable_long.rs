//! Long seeded random runs of the expandable allocator with multi-size
//! chunks: 100,000 operations per CI run in total over `sim` and `host`, with
//! `validate()`, the device model's check and the shadow model after every
//! step. Memory is tight in every run, so chunks are reclaimed, split, pooled,
//! released and re-created many times (each run asserts that it happened).

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::Allocator;
use vmmalloc_alloc_harness::{Harness, OpMix, Outcome, RandomOps};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, Introspect, GIB, MIB};

/// Runs `n` seeded ops; returns the allocator's stats and the number of
/// out-of-memory outcomes.
fn run<D: Device + Introspect + 'static>(
    dev: Arc<D>,
    cfg: ExpandableConfig,
    seed: u64,
    mix: OpMix,
    n: usize,
) -> (vmmalloc_alloc::Stats, usize) {
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let mut ooms = 0;
    {
        let mut h = Harness::new(&a, &*dev, mix.streams).unwrap();
        let mut gen = RandomOps::new(seed, mix);
        for i in 0..n {
            let op = gen.next_op();
            let out = h
                .apply(&op)
                .unwrap_or_else(|e| panic!("seed {seed} step {i} {op:?}: {e}"));
            if matches!(out, Outcome::Oom(_)) {
                ooms += 1;
            }
            h.check()
                .unwrap_or_else(|e| panic!("seed {seed} after step {i} {op:?}: {e}"));
        }
        h.finish().unwrap();
    }
    let st = a.stats();
    drop(a);
    assert!(
        dev.live().is_empty(),
        "seed {seed}: after drop the device holds {:?}",
        dev.live()
    );
    (st, ooms)
}

fn mix(max_size: u64) -> OpMix {
    OpMix {
        min_size: 1,
        max_size,
        streams: 3,
        weights: [45, 35, 3, 8, 8, 1],
    }
}

/// 60,000 ops on a 2 GiB sim device: sizes up to 384 MiB, adaptive chunks
/// (the default: never split, unpin when short), then chunks capped at
/// 16 MiB and a 4 MiB page with a release threshold, both splitting above
/// 2/5 of the limit.
#[test]
fn sim_60k_ops_with_multi_size_chunks() {
    let configs = [
        ExpandableConfig::default(),
        ExpandableConfig {
            max_chunk: Some(16 * MIB),
            split_threshold: 0.4,
            ..ExpandableConfig::default()
        },
        ExpandableConfig {
            page_size: Some(4 * MIB),
            release_threshold: 64 * MIB,
            split_threshold: 0.4,
            ..ExpandableConfig::default()
        },
    ];
    let (mut reclaims, mut splits, mut unpins) = (0, 0, 0);
    for (i, cfg) in configs.into_iter().enumerate() {
        let (st, ooms) = run(
            Arc::new(SimDevice::with_capacity(2 * GIB)),
            cfg,
            11 + i as u64,
            mix(384 * MIB),
            20_000,
        );
        assert!(
            st.driver_calls.get(vmmalloc_device::Call::Create) > 100,
            "config {i}: {st:?}"
        );
        assert!(ooms > 0, "config {i}: the run must reach the limit");
        reclaims += st.reclaims;
        splits += st.chunk_splits;
        unpins += st.chunk_unpins;
    }
    assert!(reclaims > 100, "only {reclaims} reclaims");
    assert!(splits > 10, "only {splits} chunk splits");
    assert!(unpins > 10, "only {unpins} chunks unpinned");
}

/// 40,000 ops on a 96 MiB host device with real bytes: every live byte is
/// checked at free and after every reclaim (the harness's pattern checks):
/// the default (live pages move when chunks are unpinned), then splitting.
#[test]
fn host_40k_ops_keep_every_byte() {
    for (i, cfg) in [
        ExpandableConfig::default(),
        // Small chunks, splitting, and no split slack: every partly covered
        // chunk is split.
        ExpandableConfig {
            max_chunk: Some(8 * MIB),
            split_threshold: 0.4,
            split_slack: 0,
            ..ExpandableConfig::default()
        },
    ]
    .into_iter()
    .enumerate()
    {
        let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(96 * MIB)).unwrap());
        let (st, ooms) = run(dev, cfg, 101 + i as u64, mix(20 * MIB), 20_000);
        let moved = if i == 0 {
            st.chunk_unpins > 10 && st.unpin_copied_bytes > 0
        } else {
            st.chunk_splits > 0
        };
        assert!(ooms > 0 && st.reclaims > 10 && moved, "config {i}: {st:?}");
    }
}
