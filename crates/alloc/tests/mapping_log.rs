//! The mapping log (`MappingLog::log_mappings` / `take_mappings`, reached by `Allocator::as_mapping_log`, issue 33):
//! the physical layer's observer reports every table map and unmap, so that
//! replaying the reported changes in order gives exactly the memory the
//! allocator's snapshot shows mapped, after any operation — unpinning's
//! moves, reclaim, empty_cache and sleep included.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeSet;
use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{
    set_thread_tag, Allocator, BlockState, MappingChange, MappingLog, Sleep, Stream,
};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, MIB};

/// The page size every mapping is a multiple of (the default granularity).
const PAGE: u64 = 2 * MIB;

/// Mapped pages as the log tells them.
#[derive(Default)]
struct Model {
    pages: BTreeSet<u64>,
    maps: usize,
    unmaps: usize,
}

impl Model {
    /// Applies `changes`, checking each against what is mapped already.
    fn apply(&mut self, changes: &[MappingChange], what: &str) {
        for c in changes {
            assert!(
                c.bytes > 0 && c.addr % PAGE == 0 && c.bytes % PAGE == 0,
                "{what}: {c:?}"
            );
            for p in (c.addr..c.addr + c.bytes).step_by(PAGE as usize) {
                if c.mapped {
                    assert!(self.pages.insert(p), "{what}: {p:#x} mapped twice ({c:?})");
                } else {
                    assert!(
                        self.pages.remove(&p),
                        "{what}: {p:#x} unmapped but not mapped ({c:?})"
                    );
                }
            }
            if c.mapped {
                self.maps += 1;
            } else {
                self.unmaps += 1;
            }
        }
    }
}

/// The pages `a`'s snapshot shows with memory behind them.
fn mapped_pages(a: &dyn Allocator) -> BTreeSet<u64> {
    let mut pages = BTreeSet::new();
    for seg in a.snapshot().segments {
        assert!(seg.is_expandable);
        for b in seg
            .blocks
            .iter()
            .filter(|b| !matches!(b.state, BlockState::Unmapped | BlockState::Paused))
        {
            let (first, end) = (
                b.address / PAGE * PAGE,
                (b.address + b.size).div_ceil(PAGE) * PAGE,
            );
            pages.extend((first..end).step_by(PAGE as usize));
        }
    }
    pages
}

/// Takes the log, applies it and checks it against the snapshot.
fn check(a: &dyn Allocator, model: &mut Model, what: &str) -> Vec<MappingChange> {
    let mut changes = Vec::new();
    a.as_mapping_log()
        .expect("expandable keeps a mapping log")
        .take_mappings(&mut changes);
    model.apply(&changes, what);
    assert_eq!(
        model.pages,
        mapped_pages(a),
        "{what}: the log and the snapshot differ"
    );
    a.validate().unwrap_or_else(|e| panic!("{what}: {e}"));
    changes
}

/// An unpinning move shows as the unmap of the pinned chunk's run and the
/// maps of the live pages' new chunks at the same addresses; replayed in
/// order they leave exactly what the allocator has mapped, and every
/// mapping of a segment names its stream.
#[test]
fn the_log_follows_an_unpinning_move() {
    let dev = Arc::new(SimDevice::with_capacity(1024 * MIB));
    let cfg = ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    a.log_mappings(true);
    let mut model = Model::default();
    let s = dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
    let big = a.malloc(128 * MIB, s).unwrap();
    let grown = check(&a, &mut model, "seven 128 MiB blocks");
    assert!(grown.iter().all(|c| c.mapped && c.stream == s), "{grown:?}");
    a.free(big.ptr).unwrap();
    let small = a.malloc(16 * MIB, s).unwrap();
    assert_eq!(small.ptr, big.ptr);
    assert!(check(&a, &mut model, "pinned: no call").is_empty());
    let s2 = dev.create_stream().unwrap();
    let y = a.malloc(200 * MIB, s2).unwrap();
    assert_eq!(a.stats().chunk_unpins, 1);
    let moved = check(&a, &mut model, "unpinned");
    let unmapped_run = moved
        .iter()
        .find(|c| !c.mapped && c.addr == small.ptr)
        .unwrap_or_else(|| panic!("the pinned chunk's run is unmapped: {moved:?}"));
    assert!(unmapped_run.bytes >= 128 * MIB, "{moved:?}");
    assert!(
        moved
            .iter()
            .any(|c| c.mapped && c.addr == small.ptr && c.stream == s),
        "the live pages are mapped again at their address: {moved:?}"
    );
    assert!(
        moved.iter().any(|c| c.mapped && c.stream == s2),
        "{moved:?}"
    );
    for b in live.iter().chain([&small, &y]) {
        a.free(b.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    check(&a, &mut model, "all freed, cache emptied");
    assert!(model.pages.is_empty());

    // Off: nothing is kept.
    a.log_mappings(false);
    let z = a.malloc(64 * MIB, s).unwrap();
    let mut none = Vec::new();
    a.take_mappings(&mut none);
    assert!(none.is_empty(), "{none:?}");
    a.free(z.ptr).unwrap();
}

/// Random allocations, frees, cache flushes and sleeps on a tight device
/// (reclaim, unpinning and splitting all happen): after every operation the
/// log replayed so far equals the snapshot's mapped pages.
#[test]
fn the_log_replays_to_the_snapshot_after_every_operation() {
    for seed in 0..4u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let dev = Arc::new(SimDevice::with_capacity(768 * MIB));
        let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
        let mut model = Model::default();
        // Some memory before the log starts: the model starts from the snapshot.
        let early = a.malloc(40 * MIB, Stream(0)).unwrap();
        a.log_mappings(true);
        model.pages = mapped_pages(&a);
        let streams = [
            Stream(0),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        ];
        let mut live = vec![early];
        let (mut ooms, mut sleeps) = (0, 0);
        for step in 0..400 {
            let what = format!("seed {seed} step {step}");
            match rng.gen_range(0..100) {
                0..=54 => {
                    let size = match rng.gen_range(0..3) {
                        0 => rng.gen_range(1..2 * MIB),
                        1 => rng.gen_range(2 * MIB..24 * MIB),
                        _ => rng.gen_range(24 * MIB..160 * MIB),
                    };
                    let tag = if rng.gen_range(0..4) == 0 {
                        "kv"
                    } else {
                        "default"
                    };
                    set_thread_tag(tag).unwrap();
                    match a.malloc(size, streams[rng.gen_range(0..streams.len())]) {
                        Ok(b) => live.push(b),
                        Err(_) => ooms += 1,
                    }
                    set_thread_tag("default").unwrap();
                }
                55..=89 if !live.is_empty() => {
                    let b = live.swap_remove(rng.gen_range(0..live.len()));
                    a.free(b.ptr).unwrap();
                }
                90..=94 => a.empty_cache().unwrap(),
                _ => {
                    // Sleep and wake of the tagged blocks: unmapped, then mapped again.
                    if a.pause(&["kv".to_string()], false).is_ok() {
                        sleeps += 1;
                        check(&a, &mut model, &format!("{what}: paused"));
                        let _ = a.resume(&["kv".to_string()]);
                    }
                }
            }
            check(&a, &mut model, &what);
        }
        for b in live.drain(..) {
            a.free(b.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        check(&a, &mut model, &format!("seed {seed}: drained"));
        eprintln!(
            "seed {seed}: {} maps, {} unmaps, {ooms} out-of-memory, {sleeps} sleeps, {} unpins",
            model.maps,
            model.unmaps,
            a.stats().chunk_unpins
        );
        assert!(
            model.maps > 20 && model.unmaps > 20,
            "seed {seed}: too few events to mean anything"
        );
        assert!(
            ooms > 0 || sleeps > 0,
            "seed {seed}: the device was never tight"
        );
    }
}
