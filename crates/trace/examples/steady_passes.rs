//! The steady-state cost of the second and the third iteration of a trace.
//!
//! `vmmalloc compare` reports the second replay of a trace as its steady
//! state. An allocator that adapts its physical chunks to the trace may need
//! one more iteration to settle: this example replays the trace twice back to
//! back (freeing what the first copy left live in between, pre-trace
//! allocations kept), then measures the next iteration the same way, so it
//! prints the cost of iteration 2 and of iteration 3 at the tight capacity
//! (1.05 × peak live), `a100` cost model.
//!
//! ```sh
//! cargo run --release -p vmmalloc-trace --example steady_passes -- train-varlen
//! cargo run --release -p vmmalloc-trace --example steady_passes -- serve-kv torch-es
//! ```

use std::collections::BTreeSet;
use vmmalloc_alloc::PolicySpec;
use vmmalloc_device::{round_up, MIB};
use vmmalloc_trace::model::Op;
use vmmalloc_trace::replay::{replay, ReplayConfig};
use vmmalloc_trace::Input;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(input) = args.first() else {
        return Err("usage: steady_passes INPUT [POLICY-SPEC]".into());
    };
    let spec: PolicySpec = args.get(1).map_or("expandable", |s| s.as_str()).parse()?;
    let trace = input.parse::<Input>()?.load()?;
    for dt in &trace.devices {
        let ops = dt.replay_ops();
        let pre = dt.pre_trace().len();
        let body = &ops[pre..];
        let offset = ops.iter().map(Op::id).max().map_or(0, |m| m + 1);
        // What the body leaves live, freed before its second copy.
        let mut live = BTreeSet::new();
        for o in body {
            match o {
                Op::Alloc { id, .. } | Op::Reserve { id, .. } => live.insert(*id),
                Op::Free { id } => live.remove(id),
                Op::Resize { .. } => false,
            };
        }
        let mut twice = ops.to_vec();
        twice.extend(live.iter().map(|&id| Op::Free { id }));
        twice.extend(body.iter().map(|o| match *o {
            Op::Alloc { id, size, stream } => Op::Alloc {
                id: id + offset,
                size,
                stream,
            },
            Op::Free { id } => Op::Free { id: id + offset },
            Op::Reserve { id, max, stream } => Op::Reserve {
                id: id + offset,
                max,
                stream,
            },
            Op::Resize { id, size } => Op::Resize {
                id: id + offset,
                size,
            },
        }));
        let tight = round_up((dt.peak_live_bytes() as f64 * 1.05).ceil() as u64, 2 * MIB);
        println!(
            "{} device {}: {} at {:.2} GiB (1.05 x peak live)",
            trace.name,
            dt.device(),
            spec.label,
            tight as f64 / (1u64 << 30) as f64
        );
        for (iteration, ops) in [(2, ops.to_vec()), (3, twice)] {
            let mut c = ReplayConfig::new(spec.policy, tight);
            c.options = spec.options.clone();
            c.steady = true;
            c.pre_trace_ops = pre;
            let r = replay(&ops, &c);
            match r.steady {
                Some(s) => println!(
                    "  iteration {iteration}: {} ({} memory and sync calls, {:.1} ms modeled, {} syncs)",
                    if s.ok { "ok" } else { "out of memory" },
                    s.driver_calls.total(),
                    s.modeled_driver_us / 1000.0,
                    s.driver_calls.syncs()
                ),
                None => println!("  iteration {iteration}: the first pass did not complete"),
            }
        }
    }
    Ok(())
}
