//! The replayer: runs a policy over a trace's allocation ops on a `sim` device,
//! and the capacity search built on it.

use crate::model::Op;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmalloc_alloc::{build, Allocator, Policy, PolicyOptions};
use vmmalloc_device::cost::CostModel;
use vmmalloc_device::sim::{SimConfig, SimDevice};
use vmmalloc_device::{round_up, Call, CallCounts, Device, Stream, MIB};

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The policy.
    pub policy: Policy,
    /// Simulated device memory in bytes.
    pub capacity: u64,
    /// Allocation granularity of the simulated device.
    pub granularity: u64,
    /// Cost model of the simulated device.
    pub cost: CostModel,
    /// The cost model's name as reports show it (a preset name or a file).
    pub cost_label: String,
    /// Policy options.
    pub options: PolicyOptions,
    /// Stop at the first out-of-memory (capacity search) instead of skipping the
    /// failed allocation and going on (reports).
    pub stop_at_oom: bool,
    /// Record up to this many (op index, live, reserved) samples of memory over time (0: none).
    pub timeline_samples: usize,
    /// Run `validate()` every this many ops (0: never) — slow, for tests.
    pub validate_every: usize,
    /// Replay only the ops up to and including this op index (`None`: all),
    /// e.g. to look at the allocator right after a given event with
    /// [`replay_keeping`].
    pub stop_after: Option<usize>,
}

impl ReplayConfig {
    /// A config with defaults for `policy` on a device of `capacity` bytes.
    pub fn new(policy: Policy, capacity: u64) -> Self {
        ReplayConfig {
            policy,
            capacity,
            granularity: 2 * MIB,
            cost: CostModel::default(),
            cost_label: CostModel::PRESETS[0].to_string(),
            options: PolicyOptions::default(),
            stop_at_oom: false,
            timeline_samples: 0,
            validate_every: 0,
            stop_after: None,
        }
    }
}

/// One sample of memory over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Index of the op after which the sample was taken.
    pub op: usize,
    /// Requested bytes of live allocations.
    pub live: u64,
    /// Bytes the allocator held from the device (`reserved_bytes`).
    pub reserved: u64,
}

/// What a replay measured.
#[derive(Debug, Clone)]
pub struct ReplayResult {
    /// The policy.
    pub policy: Policy,
    /// Device capacity used.
    pub capacity: u64,
    /// Whether every allocation succeeded.
    pub ok: bool,
    /// Out-of-memory errors.
    pub ooms: u64,
    /// Op index of the first out-of-memory.
    pub first_oom: Option<usize>,
    /// The first out-of-memory message.
    pub oom_message: Option<String>,
    /// Ops replayed.
    pub ops: usize,
    /// Peak of requested live bytes during the replay.
    pub peak_live: u64,
    /// Index of the op after which `peak_live` was first reached (`None`: no
    /// allocation succeeded).
    pub peak_live_op: Option<usize>,
    /// Requested bytes of the allocations live when the replay stopped.
    pub final_live: u64,
    /// Allocations live when the replay stopped.
    pub final_live_allocs: usize,
    /// Peak reserved bytes (`reserved_bytes.all.peak`).
    pub peak_reserved: u64,
    /// Allocator retries (`num_alloc_retries`).
    pub retries: u64,
    /// Synchronizations forced (device, stream and event syncs at the device).
    pub syncs: u64,
    /// Device calls per kind made while the trace ran. Teardown (the
    /// allocator giving everything back when it is dropped) is excluded:
    /// a training process pays it once at exit, and PyTorch's allocators
    /// leave it to the driver. It is counted in `teardown_calls`.
    pub driver_calls: CallCounts,
    /// Modeled driver time while the trace ran, microseconds (teardown
    /// excluded, see `teardown_driver_us`).
    pub modeled_driver_us: f64,
    /// Modeled time of the `cuMemCreate` calls among `modeled_driver_us`.
    pub modeled_create_us: f64,
    /// Device calls the allocator made when it was dropped.
    pub teardown_calls: CallCounts,
    /// Modeled driver time of the teardown, microseconds.
    pub teardown_driver_us: f64,
    /// CPU time of the replay loop.
    pub cpu_time: Duration,
    /// Memory over time (if asked for).
    pub timeline: Vec<Sample>,
    /// An error that is not out-of-memory (a policy bug or a bad trace), if any.
    pub error: Option<String>,
}

impl ReplayResult {
    /// Device calls that touch memory (everything but event queries/records and info).
    pub fn memory_calls(&self) -> u64 {
        [
            Call::Reserve,
            Call::AddressFree,
            Call::Create,
            Call::Release,
            Call::Map,
            Call::Unmap,
            Call::SetAccess,
            Call::Alloc,
            Call::Free,
        ]
        .iter()
        .map(|c| self.driver_calls.get(*c))
        .sum()
    }
}

/// Replays `ops` with `config`.
pub fn replay(ops: &[Op], config: &ReplayConfig) -> ReplayResult {
    replay_keeping(ops, config).finish()
}

/// A replay whose allocator is still alive: look at its `stats()` and
/// `snapshot()` where the replay stopped (after the last op, at the first
/// out-of-memory with `stop_at_oom`, or after `stop_after`), then call
/// [`Replayed::finish`] for the teardown figures.
pub struct Replayed {
    /// What the replay measured up to the stop. The teardown fields are zero
    /// until [`Replayed::finish`].
    pub result: ReplayResult,
    /// The allocator (`None` if it could not be created; `result.error` says why).
    pub allocator: Option<Box<dyn Allocator>>,
    /// The simulated device it runs on.
    pub device: Arc<SimDevice>,
}

impl std::fmt::Debug for Replayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayed")
            .field("result", &self.result)
            .field("allocator", &self.allocator.as_ref().map(|a| a.name()))
            .finish_non_exhaustive()
    }
}

impl Replayed {
    /// Drops the allocator and returns the result with the teardown counted
    /// (what [`replay`] returns).
    pub fn finish(self) -> ReplayResult {
        let Replayed {
            mut result,
            allocator,
            device,
        } = self;
        if allocator.is_some() {
            let counts = device.counts();
            let modeled_us = device.modeled_us();
            drop(allocator);
            result.teardown_calls = device.counts().since(&counts);
            result.teardown_driver_us = device.modeled_us() - modeled_us;
        }
        result
    }
}

/// Replays `ops` with `config` and keeps the allocator alive where the replay
/// stopped. [`replay`] is this followed by [`Replayed::finish`].
pub fn replay_keeping(ops: &[Op], config: &ReplayConfig) -> Replayed {
    let mut sim_config = SimConfig::with_capacity(config.capacity);
    sim_config.granularity = config.granularity;
    sim_config.cost = config.cost;
    let sim = Arc::new(SimDevice::new(sim_config));
    let device: Arc<dyn Device> = sim.clone();
    let mut result = ReplayResult {
        policy: config.policy,
        capacity: config.capacity,
        ok: true,
        ooms: 0,
        first_oom: None,
        oom_message: None,
        ops: 0,
        peak_live: 0,
        peak_live_op: None,
        final_live: 0,
        final_live_allocs: 0,
        peak_reserved: 0,
        retries: 0,
        syncs: 0,
        driver_calls: CallCounts::default(),
        modeled_driver_us: 0.0,
        modeled_create_us: 0.0,
        teardown_calls: CallCounts::default(),
        teardown_driver_us: 0.0,
        cpu_time: Duration::ZERO,
        timeline: Vec::new(),
        error: None,
    };
    let alloc = match build(config.policy, device, &config.options) {
        Ok(a) => a,
        Err(e) => {
            result.ok = false;
            result.error = Some(format!("creating {}: {e}", config.policy));
            return Replayed {
                result,
                allocator: None,
                device: sim,
            };
        }
    };
    let ops = match config.stop_after {
        Some(last) => &ops[..ops.len().min(last.saturating_add(1))],
        None => ops,
    };
    let start = Instant::now();
    result.final_live = run_ops(&*alloc, &sim, ops, config, &mut result);
    result.cpu_time = start.elapsed();
    let stats = alloc.stats();
    result.peak_reserved = stats.reserved_bytes.all().peak.max(0) as u64;
    result.retries = stats.num_alloc_retries;
    let counts = sim.counts();
    result.syncs = counts.syncs();
    result.modeled_driver_us = sim.modeled_us();
    result.modeled_create_us = sim.modeled_us_of(Call::Create);
    result.driver_calls = counts;
    Replayed {
        result,
        allocator: Some(alloc),
        device: sim,
    }
}

/// Runs the ops; returns the requested bytes live where it stopped.
fn run_ops(
    alloc: &dyn Allocator,
    sim: &SimDevice,
    ops: &[Op],
    config: &ReplayConfig,
    result: &mut ReplayResult,
) -> u64 {
    // Dense id -> pointer (u64::MAX: not live / failed).
    let mut ptrs: Vec<u64> = Vec::new();
    let mut sizes: Vec<u64> = Vec::new();
    // Trace stream -> device stream; traces use a handful, so a list beats a map,
    // and the last one used is checked first.
    let mut streams: Vec<(u64, Stream)> = Vec::new();
    let mut last_stream: Option<(u64, Stream)> = None;
    let mut live: u64 = 0;
    let sample_every = ops
        .len()
        .checked_div(config.timeline_samples)
        .map_or(usize::MAX, |n| n.max(1));
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { id, size, stream } => {
                let id = id as usize;
                if ptrs.len() <= id {
                    ptrs.resize(id + 1, u64::MAX);
                    sizes.resize(id + 1, 0);
                }
                let known = match last_stream {
                    Some((t, s)) if t == stream => Some(s),
                    _ => streams.iter().find(|e| e.0 == stream).map(|e| e.1),
                };
                let s = match known {
                    Some(s) => s,
                    None => {
                        let s = if stream == 0 {
                            Stream::DEFAULT
                        } else {
                            match sim.create_stream() {
                                Ok(s) => s,
                                Err(e) => {
                                    result.error = Some(format!("op {i}: creating a stream: {e}"));
                                    result.ok = false;
                                    return live;
                                }
                            }
                        };
                        streams.push((stream, s));
                        s
                    }
                };
                last_stream = Some((stream, s));
                match alloc.malloc(size, s) {
                    Ok(a) => {
                        ptrs[id] = a.ptr;
                        sizes[id] = size;
                        live += size;
                        result.final_live_allocs += 1;
                        if live > result.peak_live {
                            result.peak_live = live;
                            result.peak_live_op = Some(i);
                        }
                    }
                    Err(e) if e.is_out_of_memory() => {
                        result.ok = false;
                        result.ooms += 1;
                        if result.first_oom.is_none() {
                            result.first_oom = Some(i);
                            result.oom_message = Some(e.to_string());
                        }
                        if config.stop_at_oom {
                            result.ops = i + 1;
                            return live;
                        }
                    }
                    Err(e) => {
                        result.ok = false;
                        result.error = Some(format!("op {i}: malloc({size}) failed: {e}"));
                        result.ops = i + 1;
                        return live;
                    }
                }
            }
            Op::Free { id } => {
                let id = id as usize;
                let ptr = ptrs.get(id).copied().unwrap_or(u64::MAX);
                if ptr != u64::MAX {
                    if let Err(e) = alloc.free(ptr) {
                        result.ok = false;
                        result.error = Some(format!("op {i}: free({ptr:#x}) failed: {e}"));
                        result.ops = i + 1;
                        return live;
                    }
                    ptrs[id] = u64::MAX;
                    live -= sizes[id];
                    result.final_live_allocs -= 1;
                }
            }
        }
        if config.validate_every > 0 && i % config.validate_every == 0 {
            if let Err(e) = alloc.validate() {
                result.ok = false;
                result.error = Some(format!("op {i}: invariant broken: {e}"));
                result.ops = i + 1;
                return live;
            }
        }
        if i % sample_every == 0 {
            let reserved = alloc.stats().reserved_bytes.all().current.max(0) as u64;
            result.timeline.push(Sample {
                op: i,
                live,
                reserved,
            });
        }
    }
    result.ops = ops.len();
    live
}

/// The result of a capacity search for one policy.
#[derive(Debug, Clone)]
pub struct CapacitySearch {
    /// Smallest capacity (multiple of the granularity) that replays without out-of-memory,
    /// or `None` if even the upper bound failed.
    pub min_capacity: Option<u64>,
    /// Replays run.
    pub probes: usize,
}

/// Finds, by bisection to the granularity, the smallest device capacity with
/// which `config.policy` replays `ops` without out-of-memory. `peak_live` is
/// the trace's peak live bytes (the lower bound); the search gives up above
/// `max_capacity`.
pub fn min_capacity(
    ops: &[Op],
    peak_live: u64,
    config: &ReplayConfig,
    max_capacity: u64,
) -> CapacitySearch {
    let g = config.granularity;
    let runs = |cap: u64| {
        let mut c = config.clone();
        c.capacity = cap;
        c.stop_at_oom = true;
        c.timeline_samples = 0;
        let r = replay(ops, &c);
        r.ok
    };
    let mut probes = 0;
    // Lowest capacity that may work: the peak of live bytes, in whole granules.
    let mut lo = round_up(peak_live.max(1), g).saturating_sub(g); // known (or assumed) to fail
    let mut hi = round_up((peak_live as f64 * 1.05) as u64 + g, g).min(max_capacity);
    loop {
        probes += 1;
        if runs(hi) {
            break;
        }
        lo = hi;
        if hi >= max_capacity {
            return CapacitySearch {
                min_capacity: None,
                probes,
            };
        }
        hi = round_up((hi * 2).min(max_capacity), g);
    }
    while hi - lo > g {
        let mid = lo + ((hi - lo) / g / 2) * g;
        probes += 1;
        if runs(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    CapacitySearch {
        min_capacity: Some(hi),
        probes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops() -> Vec<Op> {
        // 3 allocations of 3 MiB + 100 B live at the peak, on two streams.
        let s = 3 * MIB + 100;
        vec![
            Op::Alloc {
                id: 0,
                size: s,
                stream: 0,
            },
            Op::Alloc {
                id: 1,
                size: s,
                stream: 5,
            },
            Op::Free { id: 0 },
            Op::Alloc {
                id: 2,
                size: s,
                stream: 0,
            },
            Op::Alloc {
                id: 3,
                size: s,
                stream: 5,
            },
            Op::Free { id: 1 },
            Op::Free { id: 2 },
            Op::Free { id: 3 },
        ]
    }

    #[test]
    fn replay_counts_live_bytes_and_calls() {
        let mut cfg = ReplayConfig::new(Policy::Native, 64 * MIB);
        cfg.timeline_samples = 100;
        cfg.validate_every = 1;
        let r = replay(&ops(), &cfg);
        assert!(r.ok, "{:?}", r.error);
        assert_eq!(r.peak_live, 3 * (3 * MIB + 100));
        assert_eq!(r.driver_calls.get(Call::Alloc), 4);
        assert_eq!(r.driver_calls.get(Call::Free), 4);
        assert_eq!(r.timeline.len(), 8);
        assert!(r.modeled_driver_us > 0.0);
        assert_eq!(
            r.teardown_calls.total(),
            0,
            "native frees everything in the trace"
        );
    }

    #[test]
    fn teardown_is_counted_apart_from_the_trace() {
        // The trace leaves one block live: whatever the allocator gives back
        // when dropped is teardown, not trace work.
        let mut trace = ops();
        trace.pop();
        let cfg = ReplayConfig::new(Policy::Expandable, 64 * MIB);
        let r = replay(&trace, &cfg);
        assert!(r.ok, "{:?}", r.error);
        assert!(r.teardown_calls.get(Call::Release) > 0);
        assert!(r.teardown_calls.get(Call::Unmap) > 0);
        assert!(r.teardown_driver_us > 0.0);
        // Every page created during the trace is released, by the trace or
        // at teardown.
        assert_eq!(
            r.driver_calls.get(Call::Create),
            r.driver_calls.get(Call::Release) + r.teardown_calls.get(Call::Release)
        );
    }

    #[test]
    fn out_of_memory_is_counted_and_skipped() {
        let cfg = ReplayConfig::new(Policy::Native, 8 * MIB);
        let r = replay(&ops(), &cfg);
        assert!(!r.ok);
        assert_eq!(r.ooms, 1);
        assert_eq!(r.first_oom, Some(4));
        assert!(r.oom_message.unwrap().contains("Tried to allocate"));
        assert!(
            r.error.is_none(),
            "the free of a failed allocation is skipped"
        );
        let mut stop = cfg.clone();
        stop.stop_at_oom = true;
        assert_eq!(replay(&ops(), &stop).ops, 5);
    }

    #[test]
    fn peak_and_final_live_are_located() {
        let s = 3 * MIB + 100;
        let r = replay(&ops(), &ReplayConfig::new(Policy::Native, 64 * MIB));
        // Live after each op: 1, 2, 1, 2, 3, 2, 1, 0 allocations.
        assert_eq!(r.peak_live_op, Some(4));
        assert_eq!(r.peak_live, 3 * s);
        assert_eq!((r.final_live, r.final_live_allocs), (0, 0));
    }

    #[test]
    fn replay_keeping_stops_after_an_op_with_the_allocator_alive() {
        let s = 3 * MIB + 100;
        for policy in Policy::ALL {
            let mut cfg = ReplayConfig::new(policy, 64 * MIB);
            cfg.stop_after = Some(4);
            let kept = replay_keeping(&ops(), &cfg);
            assert!(kept.result.ok, "{policy}: {:?}", kept.result.error);
            assert_eq!(kept.result.ops, 5);
            assert_eq!(kept.result.final_live, 3 * s);
            assert_eq!(kept.result.final_live_allocs, 3);
            let alloc = kept.allocator.as_ref().unwrap();
            let stats = alloc.stats();
            assert_eq!(stats.requested_bytes.all().current, (3 * s) as i64);
            assert_eq!(stats.allocation.all().current, 3);
            let active: u64 = alloc
                .snapshot()
                .segments
                .iter()
                .flat_map(|g| &g.blocks)
                .filter(|b| b.state == vmmalloc_alloc::BlockState::ActiveAllocated)
                .map(|b| b.requested_size)
                .sum();
            assert_eq!(active, 3 * s);
            let r = kept.finish();
            assert!(
                r.teardown_calls.total() > 0,
                "{policy}: three blocks to free"
            );
        }
        // Past the end: the whole trace, as replay() runs it.
        let mut cfg = ReplayConfig::new(Policy::Native, 64 * MIB);
        cfg.stop_after = Some(100);
        let r = replay(&ops(), &cfg);
        let full = replay(&ops(), &ReplayConfig::new(Policy::Native, 64 * MIB));
        assert_eq!((r.ops, r.driver_calls), (full.ops, full.driver_calls));
    }

    #[test]
    fn capacity_search_finds_the_smallest_device() {
        let peak = 3 * (3 * MIB + 100);
        let cfg = ReplayConfig::new(Policy::Native, 0);
        let s = min_capacity(&ops(), peak, &cfg, 1 << 40);
        // native charges 512-byte-rounded sizes: 3 x (3 MiB + 512) fits in 10 MiB, not in 8 MiB.
        assert_eq!(s.min_capacity, Some(10 * MIB));
        let below = ReplayConfig::new(Policy::Native, 8 * MIB);
        assert!(!replay(&ops(), &below).ok);
        assert!(s.probes >= 2);
    }

    #[test]
    fn capacity_search_gives_up_above_the_limit() {
        let cfg = ReplayConfig::new(Policy::Native, 0);
        let s = min_capacity(&ops(), 3 * (3 * MIB + 100), &cfg, 4 * MIB);
        assert_eq!(s.min_capacity, None);
    }
}
