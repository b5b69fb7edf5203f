//! `cargo bench -p vmmalloc-alloc --bench follow`: what following the
//! registrable segments costs (issue 43, NCCL user-buffer registration;
//! crates/alloc/src/expandable/physical/follow.rs). The expandable policy on
//! the `sim` device, one allocator that never follows ("off") beside one
//! that follows with a [`SegmentSink`] that counts ("on": the sink stands
//! for ProcessGroupNCCL's register hook, i.e. `ncclCommRegister` /
//! `ncclCommDeregister`, whose own cost is NCCL's and not measured here):
//!
//! - `miss 2 MiB` / `miss 64 MiB`: a malloc that misses the cache (after
//!   `empty_cache`, so pages are created, mapped and made accessible) +
//!   free + `empty_cache` (the pages unmapped and released): every
//!   iteration maps and unmaps, so every iteration sends changes;
//! - `hit`: a cache-hit malloc + free pair of 1 MiB: no driver call, so no
//!   change — following must cost nothing here.
//!
//! Criterion measures each variant; then interleaved rounds (each round
//! times a batch of every variant back to back, in an order that rotates)
//! print each variant's median and the median of the per-round ratios on /
//! off, which a noisy, shared machine moves less than two criterion runs.
//!
//! Last, the built-in workloads the repo replays (`vmmalloc replay
//! --workload`: train-varlen, serve-kv, frag-adversary, rl-colocate; the
//! trace crate's generators) and a synthetic mix of random mallocs, frees
//! and `empty_cache` calls (fixed seed) run on a following allocator; the
//! bench prints the changes sent beside the driver's map and unmap calls
//! and asserts the bound follow.rs states: after every operation, changes
//! ≤ 3 × (maps + unmaps) it made, so none on a cache hit.
//!
//! `cargo test -p vmmalloc-alloc --bench follow` (CI) runs each criterion
//! variant once, one small round, and the workloads at reduced sizes: it
//! checks the bench works and the bound holds. Nothing asserts a speed.

use criterion::{BenchmarkId, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vmmalloc_alloc::bench::PAIR_SIZE;
use vmmalloc_alloc::{build, Allocator, Policy, PolicyOptions, SegmentChange, SegmentSink, Stream};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, GIB, MIB};
use vmmalloc_test_support::median;
use vmmalloc_trace::model::Op;

/// The sink standing for NCCL's register hook: counts registrations and
/// deregistrations (and the bytes named, so the work is not optimised away).
#[derive(Debug, Default)]
struct Counting {
    /// Changes with `registered` (SEGMENT_ALLOC: `ncclCommRegister`).
    added: AtomicU64,
    /// Changes without (SEGMENT_FREE: `ncclCommDeregister`).
    removed: AtomicU64,
    /// Bytes named by all changes.
    bytes: AtomicU64,
}

impl SegmentSink for Counting {
    fn change(&self, c: &SegmentChange) {
        let n = if c.registered {
            &self.added
        } else {
            &self.removed
        };
        n.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(c.bytes, Ordering::Relaxed);
    }
}

impl Counting {
    /// Changes received so far.
    fn total(&self) -> u64 {
        self.added.load(Ordering::Relaxed) + self.removed.load(Ordering::Relaxed)
    }
}

/// One allocator under test: the expandable policy as `build` makes it (what
/// replays and the C ABI use) on its own 80 GiB sim device; following with
/// a [`Counting`] sink when `sink` is set.
struct Subject {
    /// The simulated device (its call counts are the driver calls).
    sim: Arc<SimDevice>,
    /// The allocator.
    alloc: Box<dyn Allocator>,
    /// The sink, when following.
    sink: Option<Arc<Counting>>,
}

impl Subject {
    /// A fresh allocator on a sim device of `capacity` bytes, following
    /// when `follow`.
    fn new(capacity: u64, follow: bool) -> Subject {
        let sim = Arc::new(SimDevice::with_capacity(capacity));
        let dev: Arc<dyn Device> = sim.clone();
        let alloc = build(Policy::Expandable, dev, &PolicyOptions::default()).expect("expandable");
        let sink = follow.then(|| {
            let sink = Arc::new(Counting::default());
            alloc
                .as_segment_follow()
                .expect("expandable follows segments")
                .follow_segments(Some(sink.clone() as Arc<dyn SegmentSink>))
                .expect("follow");
            sink
        });
        Subject { sim, alloc, sink }
    }

    /// Driver `cuMemMap` + `cuMemUnmap` calls made so far.
    fn map_unmap_calls(&self) -> u64 {
        let c = self.sim.counts();
        c.get(Call::Map) + c.get(Call::Unmap)
    }

    /// Changes sent so far (0 when not following).
    fn changes(&self) -> u64 {
        self.sink.as_ref().map_or(0, |s| s.total())
    }
}

/// The variants timed, in report order: (name, bytes, cache miss).
const VARIANTS: [(&str, u64, bool); 3] = [
    ("miss 2 MiB", 2 * MIB, true),
    ("miss 64 MiB", 64 * MIB, true),
    ("hit 1 MiB", PAIR_SIZE, false),
];

/// One iteration of a variant: malloc + free, and `empty_cache` after a
/// miss (so that the next malloc misses again).
fn step(a: &dyn Allocator, bytes: u64, miss: bool) {
    let x = a.malloc(bytes, Stream::DEFAULT).expect("malloc");
    a.free(std::hint::black_box(x.ptr)).expect("free");
    if miss {
        a.empty_cache().expect("empty_cache");
    }
}

/// Readies `s` for variant `(bytes, miss)`: a hit needs its block cached, a
/// miss an empty cache.
fn prepare(s: &Subject, bytes: u64, miss: bool) {
    step(&*s.alloc, bytes, false);
    if miss {
        s.alloc.empty_cache().expect("empty_cache");
    }
}

/// Criterion: every variant off and on.
fn criterion_part(c: &mut Criterion, off: &Subject, on: &Subject) {
    for (name, bytes, miss) in VARIANTS {
        let mut g = c.benchmark_group(format!("follow/{name}"));
        for (label, s) in [("off", off), ("on", on)] {
            prepare(s, bytes, miss);
            g.bench_function(BenchmarkId::from_parameter(label), |b| {
                b.iter(|| step(&*s.alloc, bytes, miss))
            });
        }
        g.finish();
    }
}

/// Times `iters` iterations of a variant on `s` (after [`prepare`], not
/// timed): nanoseconds per iteration, and the changes sent and driver maps
/// + unmaps made by the timed iterations.
fn batch(s: &Subject, bytes: u64, miss: bool, iters: usize) -> (f64, u64, u64) {
    prepare(s, bytes, miss);
    let (c0, d0) = (s.changes(), s.map_unmap_calls());
    let t = Instant::now();
    for _ in 0..iters {
        step(&*s.alloc, bytes, miss);
    }
    let ns = t.elapsed().as_nanos() as f64 / iters as f64;
    (ns, s.changes() - c0, s.map_unmap_calls() - d0)
}

/// Interleaved rounds of every variant off and on; prints medians, ratios
/// and the changes and driver calls per iteration.
fn rounds(off: &Subject, on: &Subject, quick: bool) {
    let rounds = if quick { 1 } else { 21 };
    println!(
        "follow: interleaved rounds ({rounds}), expandable on sim, off = never following, \
         on = following with a counting sink{}",
        if quick {
            " (test mode: unoptimised, one small round, measures nothing)"
        } else {
            ""
        }
    );
    println!(
        "{:<12} {:>10} {:>13} {:>13} {:>17} {:>16} {:>20}",
        "variant",
        "iters",
        "off median",
        "on median",
        "ratio on/off",
        "changes/iter",
        "map+unmap/iter"
    );
    for (name, bytes, miss) in VARIANTS {
        let iters = match (quick, miss) {
            (true, _) => 20,
            (false, true) if bytes > 2 * MIB => 2_000,
            (false, true) => 20_000,
            (false, false) => 1_000_000,
        };
        let (mut ns_off, mut ns_on, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut changes, mut calls) = (0, 0);
        for r in 0..rounds {
            let ((a, _, _), (b, dc, dd)) = if r % 2 == 0 {
                let a = batch(off, bytes, miss, iters);
                (a, batch(on, bytes, miss, iters))
            } else {
                let b = batch(on, bytes, miss, iters);
                (batch(off, bytes, miss, iters), b)
            };
            changes += dc;
            calls += dd;
            ns_off.push(a);
            ns_on.push(b);
            ratio.push(b / a);
        }
        let n = (rounds * iters) as f64;
        let unit = |ns: f64| {
            if ns >= 10_000.0 {
                format!("{:.2} us", ns / 1e3)
            } else {
                format!("{ns:.1} ns")
            }
        };
        println!(
            "{:<12} {:>10} {:>13} {:>13} {:>17.3} {:>16.2} {:>20.2}",
            name,
            iters,
            unit(median(&mut ns_off)),
            unit(median(&mut ns_on)),
            median(&mut ratio),
            changes as f64 / n,
            calls as f64 / n
        );
        if !miss {
            assert_eq!(changes, 0, "{name}: a cache hit sent changes");
        }
    }
}

/// What one workload did under following.
#[derive(Debug, Default)]
struct Tally {
    /// Operations run.
    ops: u64,
    /// Operations that failed (out of memory on the sim device).
    failed: u64,
    /// Changes sent: (added, removed).
    changes: (u64, u64),
    /// Driver calls: (map, unmap, set access).
    calls: (u64, u64, u64),
    /// Operations that made no map or unmap (cache hits and plain frees).
    quiet_ops: u64,
    /// The most changes one operation sent per map or unmap it made.
    worst: f64,
}

/// A workload run on a following allocator, checked after every operation:
/// at most 3 changes per map or unmap it made, none without one.
struct Checked {
    /// The workload's name, for messages.
    name: String,
    /// The following allocator.
    s: Subject,
    /// What it did so far.
    t: Tally,
}

impl Checked {
    /// A following allocator of `capacity` bytes for workload `name`.
    fn new(name: &str, capacity: u64) -> Checked {
        Checked {
            name: name.to_string(),
            s: Subject::new(capacity, true),
            t: Tally::default(),
        }
    }

    /// Runs one operation (`f` returns whether it succeeded) and checks the
    /// changes it sent against the maps and unmaps it made.
    fn op(&mut self, f: impl FnOnce(&Subject) -> bool) {
        let s = &self.s;
        let (c0, d0) = (s.changes(), s.map_unmap_calls());
        if !f(s) {
            self.t.failed += 1;
        }
        self.t.ops += 1;
        let (dc, dd) = (s.changes() - c0, s.map_unmap_calls() - d0);
        assert!(
            dc <= 3 * dd,
            "{}: operation {} sent {dc} changes for {dd} maps + unmaps",
            self.name,
            self.t.ops
        );
        if dd == 0 {
            self.t.quiet_ops += 1;
        } else {
            self.t.worst = self.t.worst.max(dc as f64 / dd as f64);
        }
    }

    /// Checks that the follower's runs are the balance of the changes and
    /// `validate()`; returns the tally.
    fn finish(self) -> Tally {
        let Checked { name, s, mut t } = self;
        let sink = s.sink.as_ref().expect("following");
        let (added, removed) = (
            sink.added.load(Ordering::Relaxed),
            sink.removed.load(Ordering::Relaxed),
        );
        let f = s.alloc.as_segment_follow().expect("follow");
        assert_eq!(f.segment_changes(), (added, removed), "{name}: counts");
        assert_eq!(
            f.followed_segments().len() as u64,
            added - removed,
            "{name}: the runs known are the balance of the changes"
        );
        s.alloc.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = s.sim.counts();
        t.changes = (added, removed);
        t.calls = (c.get(Call::Map), c.get(Call::Unmap), c.get(Call::SetAccess));
        t
    }
}

/// Replays a workload's ops (allocations, frees, growable regions) on `c`
/// as `vmmalloc replay` does, one checked operation each.
fn replay_ops(c: &mut Checked, ops: &[Op]) {
    let mut ptrs = HashMap::<u32, u64>::new();
    let mut regions = HashMap::<u32, u64>::new();
    let mut streams = HashMap::<u64, Stream>::from([(0, Stream::DEFAULT)]);
    for o in ops {
        let mut stream = |s: &Subject, n: u64| {
            *streams
                .entry(n)
                .or_insert_with(|| s.sim.create_stream().expect("stream"))
        };
        c.op(|s| match *o {
            Op::Alloc {
                id,
                size,
                stream: n,
            } => match s.alloc.malloc(size, stream(s, n)) {
                Ok(x) => {
                    ptrs.insert(id, x.ptr);
                    true
                }
                Err(_) => false,
            },
            Op::Free { id } => {
                if let Some(p) = regions.remove(&id) {
                    let g = s.alloc.as_growable().expect("growable");
                    g.growable_destroy(p).is_ok()
                } else if let Some(p) = ptrs.remove(&id) {
                    s.alloc.free(p).is_ok()
                } else {
                    true // its allocation failed
                }
            }
            Op::Reserve { id, max, stream: n } => {
                let g = s.alloc.as_growable().expect("growable");
                match g.growable_create(max, stream(s, n)) {
                    Ok(p) => {
                        regions.insert(id, p);
                        true
                    }
                    Err(_) => false,
                }
            }
            Op::Resize { id, size } => match regions.get(&id) {
                Some(&p) => {
                    let g = s.alloc.as_growable().expect("growable");
                    g.growable_resize(p, size).is_ok()
                }
                None => false,
            },
        });
    }
}

/// A synthetic mix on `c` (fixed seed): `steps` random operations, 50 %
/// mallocs of 512 B to 256 MiB (log-uniform) on one of two streams, 47 %
/// frees of a random live block (a malloc when none is live), 3 %
/// `empty_cache`; then everything freed and the cache emptied.
fn mixed(c: &mut Checked, steps: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    let mut live = Vec::<u64>::new();
    let streams = [Stream::DEFAULT, c.s.sim.create_stream().expect("stream")];
    for _ in 0..steps {
        let p: f64 = rng.gen();
        if p < 0.03 {
            c.op(|s| s.alloc.empty_cache().is_ok());
        } else if p < 0.50 && !live.is_empty() {
            let ptr = live.swap_remove(rng.gen_range(0..live.len()));
            c.op(|s| s.alloc.free(ptr).is_ok());
        } else {
            let bytes = 2f64.powf(rng.gen_range(9.0..28.0)) as u64;
            let st = streams[rng.gen_range(0..2)];
            c.op(|s| match s.alloc.malloc(bytes, st) {
                Ok(x) => {
                    live.push(x.ptr);
                    true
                }
                Err(_) => false,
            });
        }
    }
    for ptr in live {
        c.op(|s| s.alloc.free(ptr).is_ok());
    }
    c.op(|s| s.alloc.empty_cache().is_ok());
}

/// The workloads: changes sent per driver map and unmap.
fn workloads(quick: bool) {
    // Reduced in test mode (unoptimised, CI): the same generators, fewer steps.
    let specs: [&str; 4] = if quick {
        [
            "train-varlen:steps=2",
            "serve-kv:steps=200",
            "frag-adversary:rounds=1,blocks=300",
            "rl-colocate:iterations=1,gen_steps=5",
        ]
    } else {
        vmmalloc_trace::WORKLOADS
    };
    println!(
        "follow: registrations per driver call (expandable, following from the start; \
         checked after every operation: changes <= 3 x (maps + unmaps), none without one)"
    );
    println!(
        "{:<44} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>10} {:>9}",
        "workload",
        "ops",
        "added",
        "removed",
        "maps",
        "unmaps",
        "access",
        "changes/call",
        "worst op",
        "quiet ops"
    );
    let print = |name: &str, t: &Tally| {
        let calls = t.calls.0 + t.calls.1;
        println!(
            "{:<44} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12.3} {:>10.2} {:>9}{}",
            name,
            t.ops,
            t.changes.0,
            t.changes.1,
            t.calls.0,
            t.calls.1,
            t.calls.2,
            (t.changes.0 + t.changes.1) as f64 / calls.max(1) as f64,
            t.worst,
            t.quiet_ops,
            if t.failed > 0 {
                format!(" ({} failed: out of memory)", t.failed)
            } else {
                String::new()
            }
        );
    };
    for spec in specs {
        let trace = vmmalloc_trace::workload_by_name(spec)
            .unwrap_or_else(|e| panic!("workload {spec}: {e}"));
        for dt in &trace.devices {
            let name = format!("{spec} (80 GiB)");
            let mut c = Checked::new(&name, 80 * GIB);
            replay_ops(&mut c, dt.replay_ops());
            let t = c.finish();
            print(&name, &t);
        }
    }
    let steps = if quick { 500 } else { 5_000 };
    for (capacity, label) in [(80 * GIB, "80 GiB"), (GIB, "1 GiB, tight")] {
        let name = format!("mixed, {steps} steps ({label})");
        let mut c = Checked::new(&name, capacity);
        mixed(&mut c, steps);
        let t = c.finish();
        print(&name, &t);
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --bench` does not (criterion's
    // test mode: each variant once).
    let quick = !std::env::args().any(|a| a == "--bench");
    let off = Subject::new(80 * GIB, false);
    let on = Subject::new(80 * GIB, true);
    let mut c = Criterion::default().configure_from_args();
    criterion_part(&mut c, &off, &on);
    c.final_summary();
    rounds(&off, &on, quick);
    workloads(quick);
    for s in [&off, &on] {
        s.alloc.validate().expect("validate");
    }
}
