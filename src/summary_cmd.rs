//! `vmmalloc summary`: replay an input with one policy and print PyTorch's
//! `memory_summary()` table of the allocator at the end, at the peak of live
//! bytes, or at the first out-of-memory.

use crate::point::{check_points, print_out, replay_at, At, PointArgs};
use anyhow::Result;
use std::collections::HashMap;
use vmmalloc_alloc::pickle_snapshot::DumpFrames;
use vmmalloc_alloc::summary::format_bytes;
use vmmalloc_alloc::summary::{summary, Context};
use vmmalloc_alloc::{frames, BlockState, Snapshot};
use vmmalloc_device::Device;

/// Arguments of `vmmalloc summary`.
#[derive(clap::Args, Debug)]
pub struct SummaryArgs {
    /// The input, policy, device and point.
    #[command(flatten)]
    pub point: PointArgs,
}

/// Runs `vmmalloc summary`.
pub fn run(args: SummaryArgs) -> Result<()> {
    let mut out = String::new();
    // Recording events lets the stacks of the input follow the allocations.
    let points = replay_at(&args.point, true)?;
    for (i, p) in points.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&crate::compare::wrap(
            &p.describe(),
            crate::compare::TERMINAL_WIDTH,
        ));
        let stats = p.allocator.stats();
        let text = summary(
            &stats,
            &Context {
                device: p.device,
                backend: p.config.policy.name(),
                device_kind: "sim",
                caps: Some(p.sim.caps()),
                dropped_events: 0,
                page_size: None,
            },
        );
        out.push_str(&text);
        if let (At::Oom, Some(m)) = (p.at, &p.result.oom_message) {
            out.push_str(&format!(
                "\nThe out-of-memory error:\n{}",
                crate::compare::wrap(m, crate::compare::TERMINAL_WIDTH)
            ));
        }
        if let Some(f) = &p.frames {
            out.push_str(&by_stack(&p.allocator.snapshot(), f));
        }
    }
    print_out(&out)?;
    check_points(&args.point, &points)
}

/// The live blocks grouped by where they were allocated (the input's stacks),
/// largest first: the five largest groups and the rest.
pub fn by_stack(snap: &Snapshot, f: &DumpFrames) -> String {
    let mut groups: HashMap<String, (u64, usize)> = HashMap::new();
    for b in snap.segments.iter().flat_map(|s| &s.blocks) {
        if b.state != BlockState::ActiveAllocated {
            continue;
        }
        let key = f
            .blocks
            .get(&b.address)
            .map(|st| frames::describe(st))
            .unwrap_or_else(|| "(no stack recorded)".to_string());
        let g = groups.entry(key).or_default();
        g.0 += b.size;
        g.1 += 1;
    }
    let mut v: Vec<_> = groups.into_iter().collect();
    v.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(&b.0)));
    let mut out = String::from("\nLive memory by where it was allocated (the input's stacks):\n");
    for (k, (bytes, n)) in v.iter().take(5) {
        out.push_str(&format!(
            "  {:>12} in {n:>5} blocks  {k}\n",
            format_bytes(*bytes)
        ));
    }
    if v.len() > 5 {
        let (bytes, n) = v[5..]
            .iter()
            .fold((0, 0), |a, (_, (b, n))| (a.0 + b, a.1 + n));
        out.push_str(&format!(
            "  {:>12} in {n:>5} blocks  ({} other places)\n",
            format_bytes(bytes),
            v.len() - 5
        ));
    }
    out
}
