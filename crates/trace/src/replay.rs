//! The replayer: runs a policy over a trace's allocation ops on a `sim` device,
//! and the capacity search built on it.

use crate::model::Op;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use vmmalloc_alloc::pickle_snapshot::TraceEntry;
use vmmalloc_alloc::{build, Allocator, Policy, PolicyOptions};
use vmmalloc_device::adaptors::{CallHook, Hooked};
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
    /// A second cost model pricing the same calls (e.g. `linear` beside
    /// `a100`): [`ReplayResult::modeled_driver_us_second`].
    pub second_cost: Option<CostModel>,
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
    /// Replay the trace a second time (steady state, [`ReplayResult::steady`]):
    /// after the first pass, free what the trace allocated and still holds
    /// (the first `pre_trace_ops` allocations stay), then replay the ops after
    /// `pre_trace_ops` again. Needs a full first pass (no `stop_after`, and no
    /// stop at an out-of-memory).
    pub steady: bool,
    /// How many leading ops allocate what was live before the trace began
    /// ([`crate::DeviceTrace::pre_trace`]'s length): kept across passes, and
    /// not replayed in the second.
    pub pre_trace_ops: usize,
    /// Record the replay's events in PyTorch's `TraceEntry` shape
    /// ([`ReplayResult::events`]), e.g. for a snapshot's `device_traces`.
    pub record_events: bool,
    /// The trace's stacks by allocation id ([`crate::DeviceTrace::frames`]):
    /// the first out-of-memory report names where its pinning allocations
    /// came from. `None`: no stacks.
    pub frames: Option<Arc<crate::model::FrameTable>>,
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
            second_cost: None,
            options: PolicyOptions::default(),
            stop_at_oom: false,
            timeline_samples: 0,
            validate_every: 0,
            stop_after: None,
            steady: false,
            pre_trace_ops: 0,
            record_events: false,
            frames: None,
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
    /// Synchronizations forced, as [`CallCounts::syncs`] defines them:
    /// stream/event waits plus device-wide ones (`cuCtxSynchronize` and each
    /// `cuMemFree`); split them with `driver_calls.stream_syncs()` /
    /// `driver_calls.device_syncs()`.
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
    /// `modeled_driver_us` under [`ReplayConfig::second_cost`], if set.
    pub modeled_driver_us_second: Option<f64>,
    /// The second pass, if [`ReplayConfig::steady`] asked for one and the
    /// first pass ran to the end. Every other field describes the first pass
    /// (cold start), except the teardown, which follows the second.
    pub steady: Option<SteadyResult>,
    /// Device calls the allocator made when it was dropped.
    pub teardown_calls: CallCounts,
    /// Modeled driver time of the teardown, microseconds.
    pub teardown_driver_us: f64,
    /// CPU time of the replay loop (the first pass).
    pub cpu_time: Duration,
    /// Memory over time (if asked for).
    pub timeline: Vec<Sample>,
    /// The replay's events, if [`ReplayConfig::record_events`] asked for
    /// them: `alloc`, `free_requested` + `free_completed`, `oom` from the
    /// trace's ops, and `segment_map` / `segment_unmap` (VMM policies) or
    /// `segment_alloc` / `segment_free` (`cuMemAlloc` policies) from the
    /// device calls the allocator made. `time_us` is the replay clock: one
    /// µs per op plus the modeled driver time so far.
    pub events: Vec<TraceEntry>,
    /// An error that is not out-of-memory (a policy bug or a bad trace), if any.
    pub error: Option<String>,
    /// Growable regions reallocated by a policy without regions: copies made
    /// and bytes copied (0 for a policy that grows in place).
    pub region_copies: u64,
    /// Bytes those copies moved.
    pub region_copied_bytes: u64,
}

/// What the second pass of a steady-state replay measured: the cost every
/// later iteration of a training or serving loop pays. It counts from the end
/// of the first pass, so the frees of what the first pass left live are in it.
#[derive(Debug, Clone, Default)]
pub struct SteadyResult {
    /// Whether every allocation of the second pass succeeded.
    pub ok: bool,
    /// Out-of-memory errors in the second pass (reported, not hidden).
    pub ooms: u64,
    /// Op index (into the replayed ops) of the second pass's first out-of-memory.
    pub first_oom: Option<usize>,
    /// Its message.
    pub oom_message: Option<String>,
    /// Trace allocations still live after the first pass, freed before the second.
    pub freed_between: usize,
    /// Peak of requested live bytes during the second pass.
    pub peak_live: u64,
    /// Allocator retries (`num_alloc_retries`) in the second pass.
    pub retries: u64,
    /// Synchronizations in the second pass ([`CallCounts::syncs`]).
    pub syncs: u64,
    /// Device calls per kind in the second pass.
    pub driver_calls: CallCounts,
    /// Modeled driver time of the second pass, microseconds.
    pub modeled_driver_us: f64,
    /// The same under [`ReplayConfig::second_cost`], if set.
    pub modeled_driver_us_second: Option<f64>,
    /// An error that is not out-of-memory, if any.
    pub error: Option<String>,
}

impl SteadyResult {
    /// Device calls that touch memory (see [`ReplayResult::memory_calls`]).
    pub fn memory_calls(&self) -> u64 {
        memory_calls(&self.driver_calls)
    }
}

/// The memory calls among `counts` (reserve, create, map, set access, unmap,
/// release, address free, alloc, free).
pub fn memory_calls(counts: &CallCounts) -> u64 {
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
    .map(|c| counts.get(*c))
    .sum()
}

impl ReplayResult {
    /// Device calls that touch memory (everything but event queries/records and info).
    pub fn memory_calls(&self) -> u64 {
        memory_calls(&self.driver_calls)
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

/// The simulated device a replay with `config` runs on.
fn sim_config(config: &ReplayConfig) -> SimConfig {
    let mut sim_config = SimConfig::with_capacity(config.capacity);
    sim_config.granularity = config.granularity;
    sim_config.cost = config.cost;
    sim_config
}

/// Creates `config`'s policy with its options on the simulated device a
/// replay would run on (capacity, granularity) and drops it: the error that
/// would stop a replay before its first op (an option the device refuses,
/// such as a `max_chunk` that is not a multiple of the page), found before
/// anything runs.
pub fn check_config(config: &ReplayConfig) -> std::result::Result<(), String> {
    let device: Arc<dyn Device> = Arc::new(SimDevice::new(sim_config(config)));
    build(config.policy, device, &config.options)
        .map(drop)
        .map_err(|e| format!("creating {}: {e}", config.policy))
}

/// Replays `ops` with `config` and keeps the allocator alive where the replay
/// stopped. [`replay`] is this followed by [`Replayed::finish`].
pub fn replay_keeping(ops: &[Op], config: &ReplayConfig) -> Replayed {
    let mut sim = SimDevice::new(sim_config(config));
    if let Some(second) = config.second_cost {
        sim = sim.also_priced_by(second);
    }
    let sim = Arc::new(sim);
    let recorder = config.record_events.then(|| {
        Arc::new(Recorder {
            sim: sim.clone(),
            events: Mutex::new(Vec::new()),
            op: AtomicU64::new(0),
            stream: AtomicU64::new(0),
            plain: Mutex::new(std::collections::HashMap::new()),
        })
    });
    let device: Arc<dyn Device> = match &recorder {
        Some(r) => Arc::new(Hooked::new(sim.clone(), RecordingHook(r.clone()))),
        None => sim.clone(),
    };
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
        modeled_driver_us_second: None,
        steady: None,
        teardown_calls: CallCounts::default(),
        teardown_driver_us: 0.0,
        cpu_time: Duration::ZERO,
        timeline: Vec::new(),
        events: Vec::new(),
        error: None,
        region_copies: 0,
        region_copied_bytes: 0,
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
    // The per-id tables sized before the clock starts (growing them is
    // not the policy's work).
    let ids = ops.iter().map(Op::id).max().map_or(0, |m| m as usize + 1);
    let mut state = OpState {
        recorder: recorder.clone(),
        ptrs: vec![u64::MAX; ids],
        sizes: vec![0; ids],
        ..OpState::default()
    };
    let start = Instant::now();
    run_ops(&*alloc, &sim, ops, 0, config, &mut result, &mut state);
    result.final_live = state.live;
    let stats = alloc.stats();
    result.peak_reserved = stats.reserved_bytes.all().peak.max(0) as u64;
    result.retries = stats.num_alloc_retries;
    let counts = sim.counts();
    result.syncs = counts.syncs();
    result.modeled_driver_us = sim.modeled_us();
    result.modeled_create_us = sim.modeled_us_of(Call::Create);
    result.modeled_driver_us_second = sim.second_modeled_us();
    result.driver_calls = counts;
    result.cpu_time = start.elapsed();
    let full_pass = result.error.is_none() && result.ops == ops.len() && !ops.is_empty();
    if config.steady && config.stop_after.is_none() && full_pass {
        result.steady = Some(steady_pass(&*alloc, &sim, ops, config, &result, &mut state));
    }
    if let Some(r) = &recorder {
        result.events = std::mem::take(&mut *lock(&r.events));
    }
    Replayed {
        result,
        allocator: Some(alloc),
        device: sim,
    }
}

/// The second pass of a steady-state replay (see [`ReplayConfig::steady`]).
fn steady_pass(
    alloc: &dyn Allocator,
    sim: &SimDevice,
    ops: &[Op],
    config: &ReplayConfig,
    first: &ReplayResult,
    state: &mut OpState,
) -> SteadyResult {
    let counts = sim.counts();
    let us = sim.modeled_us();
    let second_us = sim.second_modeled_us();
    let retries = first.retries;
    let mut steady = SteadyResult {
        ok: true,
        ..SteadyResult::default()
    };
    // Free what the trace allocated and still holds; pre-trace allocations stay.
    let pre = config.pre_trace_ops.min(ops.len());
    let mut keep = vec![false; state.ptrs.len()];
    for op in &ops[..pre] {
        if let Op::Alloc { id, .. } = *op {
            if let Some(k) = keep.get_mut(id as usize) {
                *k = true;
            }
        }
    }
    for (id, &kept) in keep.iter().enumerate() {
        let ptr = state.ptrs[id];
        if ptr == u64::MAX || kept {
            continue;
        }
        if let Err(e) = alloc.free(ptr) {
            steady.ok = false;
            steady.error = Some(format!("freeing {ptr:#x} after the first pass: {e}"));
            return steady;
        }
        state.ptrs[id] = u64::MAX;
        state.live -= state.sizes[id];
        steady.freed_between += 1;
    }
    for id in state.regions.ids() {
        match state.regions.free(alloc, id) {
            Ok(size) => state.live -= size,
            Err(e) => {
                steady.ok = false;
                steady.error = Some(format!("destroying region {id} after the first pass: {e}"));
                return steady;
            }
        }
    }
    // The second pass: a scratch result, no timeline, never stopping at an OOM.
    let mut cfg = config.clone();
    cfg.timeline_samples = 0;
    cfg.stop_at_oom = false;
    let mut pass = ReplayResult {
        ok: true,
        ..first.clone()
    };
    pass.ooms = 0;
    pass.first_oom = None;
    pass.oom_message = None;
    pass.error = None;
    pass.peak_live = 0;
    pass.final_live_allocs = first.final_live_allocs - steady.freed_between;
    pass.timeline = Vec::new();
    run_ops(alloc, sim, &ops[pre..], pre, &cfg, &mut pass, state);
    let now = sim.counts();
    steady.ok = pass.ok;
    steady.ooms = pass.ooms;
    steady.first_oom = pass.first_oom;
    steady.oom_message = pass.oom_message;
    steady.error = pass.error;
    steady.peak_live = pass.peak_live;
    steady.retries = alloc.stats().num_alloc_retries.saturating_sub(retries);
    steady.driver_calls = now.since(&counts);
    steady.syncs = steady.driver_calls.syncs();
    steady.modeled_driver_us = sim.modeled_us() - us;
    steady.modeled_driver_us_second = sim
        .second_modeled_us()
        .zip(second_us)
        .map(|(now, before)| now - before);
    steady
}

/// Records a replay's events (see [`ReplayResult::events`]).
struct Recorder {
    sim: Arc<SimDevice>,
    events: Mutex<Vec<TraceEntry>>,
    /// Index of the op being replayed.
    op: AtomicU64,
    /// Its trace stream.
    stream: AtomicU64,
    /// `cuMemAlloc` pointer -> size, for `segment_free`.
    plain: Mutex<std::collections::HashMap<u64, u64>>,
}

impl Recorder {
    fn now_us(&self) -> i64 {
        (self.op.load(Ordering::Relaxed) as f64 + self.sim.modeled_us()) as i64
    }

    fn push(&self, action: &'static str, addr: u64, size: u64, device_free: Option<u64>) {
        let entry = TraceEntry {
            action,
            addr,
            size,
            stream: self.stream.load(Ordering::Relaxed),
            time_us: self.now_us(),
            device_free,
        };
        lock(&self.events).push(entry);
    }

    fn at_op(&self, op: usize, stream: u64) {
        self.op.store(op as u64, Ordering::Relaxed);
        self.stream.store(stream, Ordering::Relaxed);
    }
}

/// Locks a mutex; a poisoned one (a panic elsewhere) is still usable here.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The hook that turns the allocator's device calls into segment events.
struct RecordingHook(Arc<Recorder>);

impl CallHook for RecordingHook {
    fn on_range(&self, call: Call, addr: u64, size: u64) {
        let r = &self.0;
        match call {
            Call::Map => r.push("segment_map", addr, size, None),
            Call::Unmap => r.push("segment_unmap", addr, size, None),
            Call::Alloc => {
                lock(&r.plain).insert(addr, size);
                r.push("segment_alloc", addr, size, None);
            }
            Call::Free => {
                let size = lock(&r.plain).remove(&addr).unwrap_or(0);
                r.push("segment_free", addr, size, None);
            }
            _ => {}
        }
    }
}

/// Names, in an out-of-memory report, the stacks of the allocations that pin
/// fragmented memory (from [`ReplayConfig::frames`]; `ptrs`: id -> pointer).
/// An allocation live before the trace began (ids below
/// [`ReplayConfig::pre_trace_ops`]) has no alloc event and so, in most
/// snapshots, no stack: the report says that rather than a bare address.
fn with_frames(
    mut e: vmmalloc_alloc::AllocError,
    ptrs: &[u64],
    config: &ReplayConfig,
) -> vmmalloc_alloc::AllocError {
    if let (Some(table), vmmalloc_alloc::AllocError::OutOfMemory(r)) = (&config.frames, &mut e) {
        if let Some(c) = r.caching.as_mut() {
            for pin in &mut c.pins {
                let id = ptrs.iter().position(|&p| p == pin.ptr);
                match id.map(|id| (id, table.get(&(id as u32)))) {
                    Some((_, Some(st))) => {
                        pin.frames = Some(vmmalloc_alloc::frames::describe(st));
                    }
                    Some((id, None)) if id < config.pre_trace_ops => {
                        pin.frames = Some("live before the trace began: no stack recorded".into());
                    }
                    _ => {}
                }
            }
        }
    }
    e
}

/// What the replay loop carries from op to op (and from pass to pass).
#[derive(Default)]
struct OpState {
    /// Records events, if asked for.
    recorder: Option<Arc<Recorder>>,
    /// Dense id -> trace stream (kept only while recording).
    id_streams: Vec<u64>,
    /// Dense id -> pointer (u64::MAX: not live / failed).
    ptrs: Vec<u64>,
    /// Dense id -> requested size.
    sizes: Vec<u64>,
    /// Trace stream -> device stream; traces use a handful, so a list beats a
    /// map, and the last one used is checked first.
    streams: Vec<(u64, Stream)>,
    last_stream: Option<(u64, Stream)>,
    /// Requested bytes live.
    live: u64,
    /// Growable regions (`Op::Reserve`).
    regions: crate::regions::Regions,
}

/// Runs the ops (`first_index`: the index of `ops[0]` among all the replayed
/// ops, for error messages and out-of-memory positions); `state.live` ends as
/// the requested bytes live where it stopped.
fn run_ops(
    alloc: &dyn Allocator,
    sim: &SimDevice,
    ops: &[Op],
    first_index: usize,
    config: &ReplayConfig,
    result: &mut ReplayResult,
    state: &mut OpState,
) {
    let env = OpEnv { alloc, sim, config };
    let sample_every = ops
        .len()
        .checked_div(config.timeline_samples)
        .map_or(usize::MAX, |n| n.max(1));
    for (j, op) in ops.iter().enumerate() {
        let i = first_index + j;
        if state.apply(&env, *op, i, result).is_break()
            || check_invariants(&env, i, result).is_break()
        {
            return;
        }
        if i.is_multiple_of(sample_every) {
            let reserved = alloc.stats().reserved_bytes.all().current.max(0) as u64;
            result.timeline.push(Sample {
                op: i,
                live: state.live,
                reserved,
            });
        }
    }
    result.ops = first_index + ops.len();
}

/// What every op of one [`run_ops`] replays against.
struct OpEnv<'a> {
    alloc: &'a dyn Allocator,
    sim: &'a SimDevice,
    config: &'a ReplayConfig,
}

/// Stops the replay: `result` says why.
type Replay<T = ()> = ControlFlow<(), T>;

/// The allocator's own checks every `config.validate_every` ops.
fn check_invariants(env: &OpEnv, i: usize, result: &mut ReplayResult) -> Replay {
    if env.config.validate_every > 0 && i.is_multiple_of(env.config.validate_every) {
        if let Err(e) = env.alloc.validate() {
            result.ok = false;
            result.error = Some(format!("op {i}: invariant broken: {e}"));
            result.ops = i + 1;
            return ControlFlow::Break(());
        }
    }
    ControlFlow::Continue(())
}

/// A failure to create the device stream for op `i`.
fn stream_failed<T>(i: usize, e: impl std::fmt::Display, result: &mut ReplayResult) -> Replay<T> {
    result.error = Some(format!("op {i}: creating a stream: {e}"));
    result.ok = false;
    ControlFlow::Break(())
}

impl OpState {
    /// Replays op `i`.
    fn apply(&mut self, env: &OpEnv, op: Op, i: usize, result: &mut ReplayResult) -> Replay {
        match op {
            Op::Alloc { id, size, stream } => {
                let s = self.device_stream(env.sim, stream, i, result)?;
                self.alloc(env, i, id as usize, size, (stream, s), result)
            }
            Op::Reserve { id, max, stream } => {
                let s = match region_stream(env.sim, &mut self.streams, stream) {
                    Ok(s) => s,
                    Err(e) => return stream_failed(i, e, result),
                };
                let r = self.regions.reserve(env.alloc, id, max, s);
                region_flow(region_failed(r, i, max, env.config, result))
            }
            Op::Resize { id, size } => {
                let r = self
                    .regions
                    .resize(env.alloc, id, size, &mut self.live, result, i);
                region_flow(region_failed(r, i, size, env.config, result))
            }
            Op::Free { id } if self.regions.contains(id) => {
                match self.regions.free(env.alloc, id) {
                    Ok(size) => {
                        self.live -= size;
                        ControlFlow::Continue(())
                    }
                    Err(e) => {
                        result.ok = false;
                        result.error = Some(format!("op {i}: destroying region {id} failed: {e}"));
                        result.ops = i + 1;
                        ControlFlow::Break(())
                    }
                }
            }
            Op::Free { id } => self.free(env.alloc, i, id as usize, result),
        }
    }

    /// The device stream for trace stream `stream` (created on first use;
    /// the last one used is checked first).
    fn device_stream(
        &mut self,
        sim: &SimDevice,
        stream: u64,
        i: usize,
        result: &mut ReplayResult,
    ) -> Replay<Stream> {
        let known = match self.last_stream {
            Some((t, s)) if t == stream => Some(s),
            _ => self.streams.iter().find(|e| e.0 == stream).map(|e| e.1),
        };
        let s = match known {
            Some(s) => s,
            None => {
                let s = if stream == 0 {
                    Stream::DEFAULT
                } else {
                    match sim.create_stream() {
                        Ok(s) => s,
                        Err(e) => return stream_failed(i, e, result),
                    }
                };
                self.streams.push((stream, s));
                s
            }
        };
        self.last_stream = Some((stream, s));
        ControlFlow::Continue(s)
    }

    /// `Op::Alloc` of dense id `id` on `(trace stream, device stream)`.
    fn alloc(
        &mut self,
        env: &OpEnv,
        i: usize,
        id: usize,
        size: u64,
        (stream, s): (u64, Stream),
        result: &mut ReplayResult,
    ) -> Replay {
        if self.ptrs.len() <= id {
            self.ptrs.resize(id + 1, u64::MAX);
            self.sizes.resize(id + 1, 0);
        }
        let recorder = self.recorder.as_deref();
        if let Some(r) = recorder {
            r.at_op(i, stream);
        }
        match env.alloc.malloc(size, s) {
            Ok(a) => {
                if let Some(r) = recorder {
                    r.push("alloc", a.ptr, size, None);
                    if self.id_streams.len() <= id {
                        self.id_streams.resize(id + 1, 0);
                    }
                    self.id_streams[id] = stream;
                }
                self.ptrs[id] = a.ptr;
                self.sizes[id] = size;
                self.live += size;
                result.final_live_allocs += 1;
                if self.live > result.peak_live {
                    result.peak_live = self.live;
                    result.peak_live_op = Some(i);
                }
                ControlFlow::Continue(())
            }
            // A request beyond the device is an out-of-memory too
            // (PyTorch raises OutOfMemoryError for it), whatever
            // error the policy calls it: counted, and the replay goes on.
            Err(e) if e.is_out_of_memory() || beyond_device(&e, env.config.capacity) => {
                if let Some(r) = recorder {
                    let free = env.sim.mem_info().map_or(0, |m| m.free);
                    r.push("oom", free, size, Some(free));
                }
                result.ok = false;
                result.ooms += 1;
                if result.first_oom.is_none() {
                    result.first_oom = Some(i);
                    result.oom_message = Some(with_frames(e, &self.ptrs, env.config).to_string());
                }
                if env.config.stop_at_oom {
                    result.ops = i + 1;
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            }
            Err(e) => {
                result.ok = false;
                result.error = Some(format!("op {i}: malloc({size}) failed: {e}"));
                result.ops = i + 1;
                ControlFlow::Break(())
            }
        }
    }

    /// `Op::Free` of dense id `id` (nothing if its allocation failed).
    fn free(
        &mut self,
        alloc: &dyn Allocator,
        i: usize,
        id: usize,
        result: &mut ReplayResult,
    ) -> Replay {
        let ptr = self.ptrs.get(id).copied().unwrap_or(u64::MAX);
        if ptr == u64::MAX {
            return ControlFlow::Continue(());
        }
        let recorder = self.recorder.as_deref();
        if let Some(r) = recorder {
            let stream = self.id_streams.get(id).copied().unwrap_or(0);
            r.at_op(i, stream);
            r.push("free_requested", ptr, self.sizes[id], None);
        }
        if let Err(e) = alloc.free(ptr) {
            result.ok = false;
            result.error = Some(format!("op {i}: free({ptr:#x}) failed: {e}"));
            result.ops = i + 1;
            return ControlFlow::Break(());
        }
        if let Some(r) = recorder {
            r.push("free_completed", ptr, self.sizes[id], None);
        }
        self.ptrs[id] = u64::MAX;
        self.live -= self.sizes[id];
        result.final_live_allocs -= 1;
        ControlFlow::Continue(())
    }
}

/// [`region_failed`]'s verdict as the replay's flow.
fn region_flow(stopped: bool) -> Replay {
    if stopped {
        ControlFlow::Break(())
    } else {
        ControlFlow::Continue(())
    }
}

/// Whether `e` refuses a request larger than the whole device.
fn beyond_device(e: &vmmalloc_alloc::AllocError, capacity: u64) -> bool {
    matches!(e, vmmalloc_alloc::AllocError::InvalidSize { size, .. } if *size > capacity)
}

/// The device stream for trace stream `stream` of a region (created on first use).
fn region_stream(
    sim: &SimDevice,
    streams: &mut Vec<(u64, Stream)>,
    stream: u64,
) -> Result<Stream, vmmalloc_device::DeviceError> {
    if let Some(e) = streams.iter().find(|e| e.0 == stream) {
        return Ok(e.1);
    }
    let s = if stream == 0 {
        Stream::DEFAULT
    } else {
        sim.create_stream()?
    };
    streams.push((stream, s));
    Ok(s)
}

/// Accounts a failed region op as the alloc arm does; true when the replay stops.
fn region_failed(
    r: Result<(), crate::regions::RegionError>,
    i: usize,
    size: u64,
    config: &ReplayConfig,
    result: &mut ReplayResult,
) -> bool {
    match r {
        Ok(()) => false,
        Err(crate::regions::RegionError::Oom(e)) => {
            result.ok = false;
            result.ooms += 1;
            if result.first_oom.is_none() {
                result.first_oom = Some(i);
                result.oom_message = Some(e.to_string());
            }
            if config.stop_at_oom {
                result.ops = i + 1;
                return true;
            }
            false
        }
        Err(crate::regions::RegionError::Fail(e)) => {
            result.ok = false;
            result.error = Some(format!("op {i}: region of {size} bytes: {e}"));
            result.ops = i + 1;
            true
        }
    }
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
    use vmmalloc_device::GIB;

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
    fn a_request_beyond_the_device_is_an_out_of_memory_for_every_policy() {
        // The first request (3 MiB + 100 B) is larger than a 2 MiB device.
        for policy in Policy::ALL {
            let r = replay(&ops(), &ReplayConfig::new(policy, 2 * MIB));
            assert!(r.error.is_none(), "{policy}: {:?}", r.error);
            assert_eq!(r.ops, ops().len(), "{policy}: the replay goes on");
            assert_eq!(r.ooms, 4, "{policy}: every request is counted");
            assert_eq!(r.first_oom, Some(0), "{policy}");
            let m = r.oom_message.unwrap();
            assert!(m.contains("out of memory"), "{policy}: {m}");
        }
    }

    #[test]
    fn native_frees_are_device_wide_syncs() {
        let r = replay(&ops(), &ReplayConfig::new(Policy::Native, 64 * MIB));
        assert_eq!(r.driver_calls.device_syncs(), 4, "one per cuMemFree");
        assert_eq!(r.syncs, r.driver_calls.syncs());
        assert_eq!(r.syncs, 4);
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
    fn steady_state_replays_the_trace_again_and_counts_it_apart() {
        // One pre-trace allocation (op 0, id 0) that stays, a trace that
        // leaves id 4 live at its end.
        let s = 3 * MIB + 100;
        let mut trace = vec![Op::Alloc {
            id: 0,
            size: 8 * MIB,
            stream: 0,
        }];
        trace.extend(ops().into_iter().map(|op| match op {
            Op::Alloc { id, size, stream } => Op::Alloc {
                id: id + 1,
                size,
                stream,
            },
            Op::Free { id } => Op::Free { id: id + 1 },
            other => other,
        }));
        trace.pop(); // id 4 stays live
        for policy in Policy::ALL {
            let mut cfg = ReplayConfig::new(policy, GIB);
            cfg.steady = true;
            cfg.pre_trace_ops = 1;
            cfg.validate_every = 1;
            cfg.second_cost = Some(CostModel::linear());
            let r = replay(&trace, &cfg);
            assert!(r.ok, "{policy}: {:?}", r.error);
            let st = r.steady.as_ref().expect("a full first pass");
            assert!(st.ok && st.error.is_none(), "{policy}: {st:?}");
            assert_eq!(
                st.freed_between, 1,
                "{policy}: id 4 only; the pre-trace one stays"
            );
            assert_eq!(st.peak_live, 8 * MIB + 3 * s, "{policy}");
            assert_eq!(st.ooms, 0);
            assert!(r.modeled_driver_us_second.unwrap() > 0.0);
            match policy {
                // One cuMemAlloc per request, one cuMemFree per free, in both passes:
                // 1 free between passes + 4 allocations and 3 frees of the trace.
                Policy::Native => {
                    assert_eq!(st.driver_calls.get(Call::Alloc), 4);
                    assert_eq!(st.driver_calls.get(Call::Free), 4);
                    assert!(st.modeled_driver_us > 0.0);
                    assert!(st.modeled_driver_us_second.unwrap() > 0.0);
                }
                // Caching policies reuse what the first pass mapped: no memory calls.
                _ => {
                    assert_eq!(st.memory_calls(), 0, "{policy}: {:?}", st.driver_calls);
                    assert_eq!(st.modeled_driver_us, 0.0, "{policy}");
                    assert_eq!(st.modeled_driver_us_second, Some(0.0), "{policy}");
                }
            }
            // The cold figures are the first pass alone.
            let mut cold_cfg = cfg.clone();
            cold_cfg.steady = false;
            let cold = replay(&trace, &cold_cfg);
            assert_eq!(cold.driver_calls, r.driver_calls, "{policy}");
            assert_eq!(cold.modeled_driver_us, r.modeled_driver_us, "{policy}");
            assert!(cold.steady.is_none());
        }
    }

    #[test]
    fn steady_state_reports_an_out_of_memory_in_the_second_pass() {
        let mut cfg = ReplayConfig::new(Policy::Native, 8 * MIB);
        cfg.steady = true;
        let r = replay(&ops(), &cfg);
        assert_eq!(r.ooms, 1);
        let st = r.steady.expect("the first pass ran to the end");
        assert!(!st.ok);
        assert_eq!(st.ooms, 1);
        assert_eq!(st.first_oom, Some(4));
        assert!(st.oom_message.unwrap().contains("Tried to allocate"));
        // No second pass after a stopped first pass.
        cfg.stop_at_oom = true;
        assert!(replay(&ops(), &cfg).steady.is_none());
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
