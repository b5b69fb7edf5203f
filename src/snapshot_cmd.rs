//! `vmmalloc snapshot`: replay an input with one policy and write the
//! allocator's segments and blocks at the chosen point as a snapshot pickle in
//! PyTorch's schema (`torch.cuda._memory_viz`, pytorch.org/memory_viz, and
//! `vmmalloc replay` read it), with the replay's events up to that point as
//! `device_traces` (`alloc`, `free_requested`, `free_completed`, `oom`, and
//! `segment_map`/`segment_unmap` or `segment_alloc`/`segment_free` from the
//! allocator's device calls), so memory_viz shows each policy's timeline.

use crate::compare::gib;
use crate::point::{print_out, replay_at, PointArgs};
use anyhow::{Context as _, Result};
use std::path::PathBuf;
use vmmalloc_alloc::pickle_snapshot::{self, DeviceDump, Setting};
use vmmalloc_alloc::{BlockState, Policy};

/// Arguments of `vmmalloc snapshot`.
#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    /// The input, policy, device and point.
    #[command(flatten)]
    pub point: PointArgs,
    /// The pickle to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Where output folders may be created.
    #[command(flatten)]
    pub mkdir: crate::output_path::MkdirArg,
}

/// Runs `vmmalloc snapshot`.
pub fn run(args: SnapshotArgs) -> Result<()> {
    crate::output_path::prepare_file("--out", &args.out, args.mkdir.mkdir)?;
    let inputs = crate::output_path::input_files(
        std::slice::from_ref(&args.point.replay.input),
        &[args.point.replay.sim.cost_file.as_deref()],
    );
    crate::output_path::refuse_inputs("--out", &args.out, &inputs)?;
    let points = replay_at(&args.point, true)?;
    let snaps: Vec<_> = points
        .iter()
        .map(|p| {
            let mut s = p.allocator.snapshot();
            // The simulated device is ordinal 0; the snapshot names the trace's device.
            s.device = p.device;
            s
        })
        .collect();
    let parts: Vec<DeviceDump<'_>> = snaps
        .iter()
        .zip(&points)
        .map(|(snapshot, p)| DeviceDump {
            snapshot,
            trace: Some(&p.result.events),
            frames: p.frames.as_ref(),
        })
        .collect();
    // Every point shares the policy, capacity and granularity.
    let cfg = &points[0].config;
    let settings: Vec<(&str, Setting)> = vec![
        ("backend", cfg.policy.name().into()),
        ("device", "sim".into()),
        ("capacity_gb", gib(cfg.capacity).into()),
        ("granularity_mb", (cfg.granularity >> 20).to_string().into()),
        ("input", args.point.replay.input.clone().into()),
        ("at", args.point.at.name().into()),
        (
            "expandable_segments",
            matches!(cfg.policy, Policy::Expandable | Policy::TorchEs).into(),
        ),
    ];
    crate::output_path::write_via_temp(&args.out, |tmp| {
        pickle_snapshot::write(tmp, &parts, &settings)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("writing the snapshot to {}", args.out.display()))
    })?;
    let what: Vec<String> = points
        .iter()
        .zip(&snaps)
        .map(|(p, s)| {
            let blocks = s.segments.iter().flat_map(|g| &g.blocks);
            let active: u64 = blocks
                .clone()
                .filter(|b| b.state == BlockState::ActiveAllocated)
                .map(|b| b.size)
                .sum();
            format!(
                "{} ({} segments, {} blocks, {active} bytes in active blocks)",
                p.describe(),
                s.segments.len(),
                blocks.count()
            )
        })
        .collect();
    print_out(&crate::compare::wrap_hanging(
        &format!("wrote {}: {}", args.out.display(), what.join("; ")),
        0,
        2,
    ))?;
    crate::point::check_points(&args.point, &points)
}
