//! What `vmmalloc summary` and `vmmalloc snapshot` share: replay an input with
//! one policy on a simulated device and keep the allocator alive at a chosen
//! point (the end, the peak of live bytes, or the first out-of-memory).

use crate::compare::print_reader_warnings;
use crate::input::load_inputs;
use crate::replay_cmd::format_bytes;
use crate::replay_cmd::ReplayArgs;
use anyhow::{bail, Result};
use std::sync::Arc;
use vmmalloc_alloc::pickle_snapshot::{DumpFrames, TraceEntry};
use vmmalloc_alloc::Allocator;
use vmmalloc_device::sim::SimDevice;
use vmmalloc_trace::model::FrameTable;
use vmmalloc_trace::replay::{replay, replay_keeping, ReplayConfig, ReplayResult, Replayed};
use vmmalloc_trace::{DeviceTrace, Op};

/// Where in the replay to look at the allocator.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// After the last event.
    End,
    /// Right after the event where the requested live bytes peak (first time reached).
    Peak,
    /// Right at the first out-of-memory (an error if there is none).
    Oom,
}

impl At {
    /// The name as given on the command line.
    pub fn name(self) -> &'static str {
        match self {
            At::End => "end",
            At::Peak => "peak",
            At::Oom => "oom",
        }
    }
}

/// The options of `vmmalloc summary` and `vmmalloc snapshot`.
#[derive(clap::Args, Debug)]
pub struct PointArgs {
    /// The input, policy and simulated device, as for `vmmalloc replay`.
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// Where to look: after the last event, at the peak of live bytes, or at the first out-of-memory.
    #[arg(long, value_enum, default_value_t = At::End)]
    pub at: At,
}

/// One device's allocator, alive at the chosen point.
pub struct Point {
    /// The trace's name.
    pub trace: String,
    /// The trace's device ordinal.
    pub device: u32,
    /// The replay config (policy, capacity, granularity).
    pub config: ReplayConfig,
    /// Where the replay stopped.
    pub at: At,
    /// Ops in the device's trace.
    pub total_ops: usize,
    /// What the replay measured up to the point.
    pub result: ReplayResult,
    /// The allocator at the point.
    pub allocator: Box<dyn Allocator>,
    /// The simulated device it runs on.
    pub sim: Arc<SimDevice>,
    /// The stacks of the trace's allocations and of the replay's recorded
    /// events (when recording), where the input had stacks.
    pub frames: Option<DumpFrames>,
}

/// `cfg` with the stacks of `dt` (if it has any), for the out-of-memory report.
pub fn with_frames(cfg: &ReplayConfig, dt: &DeviceTrace) -> ReplayConfig {
    let mut c = cfg.clone();
    if !dt.frames().is_empty() {
        c.frames = Some(dt.frames().clone());
    }
    c
}

/// The stacks of a replay's recorded events (`events`, from replaying `ops`
/// of a first pass): each `alloc` entry gets its op's stack, and each block
/// address the stack of the allocation live there at the end.
pub fn dump_frames(events: &[TraceEntry], ops: &[Op], table: &FrameTable) -> DumpFrames {
    let mut out = DumpFrames::default();
    // Growable regions (`Reserve`/`Resize`) record events that do not pair
    // one-to-one with `Alloc` ops, and only generated workloads have them,
    // which carry no stacks: such a replay gets none.
    if table.is_empty()
        || ops
            .iter()
            .any(|op| matches!(op, Op::Reserve { .. } | Op::Resize { .. }))
    {
        return out;
    }
    let mut allocs = ops.iter().filter_map(|op| match *op {
        Op::Alloc { id, .. } => Some(id),
        _ => None,
    });
    for (i, e) in events.iter().enumerate() {
        match e.action {
            "alloc" | "oom" => {
                let Some(id) = allocs.next() else { break };
                let stack = table.get(&id);
                if e.action == "alloc" {
                    match stack {
                        Some(st) => {
                            out.trace.insert(i, st.clone());
                            out.blocks.insert(e.addr, st.clone());
                        }
                        None => {
                            out.blocks.remove(&e.addr);
                        }
                    }
                } else if let Some(st) = stack {
                    out.trace.insert(i, st.clone());
                }
            }
            "free_completed" => {
                out.blocks.remove(&e.addr);
            }
            _ => {}
        }
    }
    out
}

impl Point {
    /// A line saying which trace, device, policy and point this is, and what is live there.
    pub fn describe(&self) -> String {
        let r = &self.result;
        let where_ = match self.at {
            At::End => format!("at the end ({} of {} ops)", r.ops, self.total_ops),
            At::Peak => format!(
                "at the peak of live bytes (after {} of {} ops)",
                r.ops, self.total_ops
            ),
            At::Oom => format!(
                "at the first out-of-memory (event {}; {} of {} ops)",
                r.first_oom.unwrap_or(0),
                r.ops,
                self.total_ops
            ),
        };
        format!(
            "{} device {} — policy {} on a {} simulated device, {where_}: {} live allocations, {} ({} bytes) requested",
            self.trace,
            self.device,
            self.config.policy,
            format_bytes(self.config.capacity),
            r.final_live_allocs,
            format_bytes(r.final_live),
            r.final_live,
        )
    }
}

/// After the output is written: an error if a replay stopped early on an
/// error that is not out-of-memory (stopping at `--at peak` / `--at oom` is
/// not one) or, with `--fail-on-oom`, if any allocation up to the point ran
/// out of memory.
pub fn check_points(args: &PointArgs, points: &[Point]) -> Result<()> {
    let mut failures = Vec::new();
    for p in points {
        let what = format!("{} device {}", p.trace, p.device);
        if let Some(e) = &p.result.error {
            failures.push(format!(
                "{what}: the replay stopped after {} of {} ops: {e}",
                p.result.ops, p.total_ops
            ));
        }
        if args.replay.fail_on_oom && p.result.ooms > 0 {
            failures.push(format!(
                "{what}: {} out-of-memory errors with policy {} on a {} device (--fail-on-oom)",
                p.result.ooms,
                p.config.policy,
                format_bytes(p.config.capacity)
            ));
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// Writes `text` to stdout; a closed pipe (`| head`) ends the output quietly.
pub fn print_out(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Replays `args.input` and returns each selected device's allocator at
/// `args.at`; `record_events` keeps the replay's events up to that point
/// (`Point::result.events`).
pub fn replay_at(args: &PointArgs, record_events: bool) -> Result<Vec<Point>> {
    let cfg = args.replay.config()?;
    if let Some(note) = args.replay.capacity_note(&cfg) {
        eprintln!("note: {note}");
    }
    let policy = cfg.policy;
    let traces = load_inputs(std::slice::from_ref(&args.replay.input))?;
    args.replay.check_device(&traces)?;
    let mut points = Vec::new();
    for t in &traces {
        for dt in t.devices.iter().filter(|d| args.replay.selects(d.device())) {
            print_reader_warnings(&t.name, dt);
            let ops = dt.replay_ops();
            let what = format!("{} device {}", t.name, dt.device());
            let mut c = cfg.clone();
            match args.at {
                At::End => {}
                At::Peak => {
                    let full = replay(ops, &cfg);
                    match full.peak_live_op {
                        Some(op) => c.stop_after = Some(op),
                        None => bail!(
                            "{what}: no allocation succeeded with policy {policy} on a {} device, so there is no peak of live bytes",
                            format_bytes(cfg.capacity)
                        ),
                    }
                }
                At::Oom => c.stop_at_oom = true,
            }
            c.record_events = record_events;
            if !dt.frames().is_empty() {
                c.frames = Some(dt.frames().clone());
            }
            let Replayed {
                result: r,
                allocator,
                device: sim,
            } = replay_keeping(ops, &c);
            let Some(allocator) = allocator else {
                bail!(
                    "{what}: {}",
                    r.error
                        .as_deref()
                        .unwrap_or("the allocator was not created")
                );
            };
            if args.at == At::Oom && r.first_oom.is_none() {
                bail!(
                    "{what}: no out-of-memory with policy {policy} on a {} device (peak live {}), so --at oom has nothing to show; try a smaller --capacity",
                    format_bytes(cfg.capacity),
                    format_bytes(r.peak_live)
                );
            }
            if let Some(e) = &r.error {
                eprintln!("warning: {what}: the replay stopped early: {e}");
            }
            let frames = (record_events && !dt.frames().is_empty())
                .then(|| dump_frames(&r.events, ops, dt.frames()));
            points.push(Point {
                trace: t.name.clone(),
                device: dt.device(),
                config: c,
                at: args.at,
                total_ops: ops.len(),
                result: r,
                allocator,
                sim,
                frames,
            });
        }
    }
    if points.is_empty() {
        bail!("no device of the input matched");
    }
    Ok(points)
}
