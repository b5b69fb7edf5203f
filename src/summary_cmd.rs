//! `vmmalloc summary`: replay an input with one policy and print PyTorch's
//! `memory_summary()` table of the allocator at the end, at the peak of live
//! bytes, or at the first out-of-memory.

use crate::point::{check_points, print_out, replay_at, PointArgs};
use anyhow::Result;
use vmmalloc_alloc::summary::{summary, Context};
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
    let points = replay_at(&args.point, false)?;
    for (i, p) in points.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&p.describe());
        out.push('\n');
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
    }
    print_out(&out)?;
    check_points(&args.point, &points)
}
