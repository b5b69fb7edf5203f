//! `vmmalloc bench`: the cache-hit malloc + free pair and 1-vs-2-thread
//! throughput of every policy, measured side by side in one run.

use crate::compare::parse_policies;
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use vmmalloc_alloc::bench::{bench_pair, thread_scaling};
use vmmalloc_alloc::{build, Policy, PolicyOptions};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, Stream, GIB};

/// Arguments of `vmmalloc bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Policies to measure, comma-separated.
    #[arg(
        long,
        default_value = "expandable,caching,torch-es,native",
        value_delimiter = ','
    )]
    pub policies: Vec<String>,
    /// Device backend: `sim` (bookkeeping only) or `host` (real CPU memory).
    #[arg(long, default_value = "sim")]
    pub device: String,
    /// Write the results as JSON to FILE (`-` for standard output).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Timed pairs per policy and round.
    #[arg(long, default_value_t = 200_000)]
    pub iters: u64,
    /// Rounds; each round measures every policy once, in turn, and the median
    /// round is reported (so noise hits every policy alike).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

fn device(kind: &str) -> Result<Arc<dyn Device>> {
    Ok(match kind {
        "sim" => Arc::new(SimDevice::with_capacity(80 * GIB)),
        "host" => Arc::new(
            HostDevice::new(HostConfig::with_capacity(4 * GIB))
                .context("creating the host device")?,
        ),
        other => bail!("unknown device `{other}`; valid devices: sim, host"),
    })
}

#[derive(Default, Clone)]
struct Figures {
    median: Vec<f64>,
    p99: Vec<f64>,
    one: Vec<f64>,
    two: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(policy: Policy, kind: &str, iters: u64) -> Result<(f64, f64, f64, f64)> {
    let dev = device(kind)?;
    let side = dev.create_stream().context("creating a stream")?;
    let alloc = build(policy, dev, &PolicyOptions::default())?;
    let (med, p99) = bench_pair(&*alloc, iters)?;
    let scaling = thread_scaling(&*alloc, [Stream::DEFAULT, side], iters)?;
    Ok((med, p99, scaling.one, scaling.two))
}

/// Runs `vmmalloc bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let policies = parse_policies(&args.policies)?;
    if args.rounds == 0 || args.iters == 0 {
        bail!("--rounds and --iters must be positive");
    }
    device(&args.device)?;
    let mut figs: Vec<Figures> = vec![Figures::default(); policies.len()];
    for _ in 0..args.rounds {
        for (i, p) in policies.iter().enumerate() {
            let (med, p99, one, two) = measure(*p, &args.device, args.iters)
                .with_context(|| format!("benchmarking {p}"))?;
            figs[i].median.push(med);
            figs[i].p99.push(p99);
            figs[i].one.push(one);
            figs[i].two.push(two);
        }
    }
    let mut pols = Map::new();
    let to_stdout = args.json.as_deref() == Some("-");
    if !to_stdout {
        println!(
            "{:<12} {:>16} {:>14} {:>16} {:>16} {:>8}",
            "policy",
            "pair ns median",
            "pair ns p99",
            "1 thread pairs/s",
            "2 threads pairs/s",
            "2t / 1t"
        );
    }
    for (p, f) in policies.iter().zip(&figs) {
        let (med, p99, one, two) = (
            median(&f.median),
            median(&f.p99),
            median(&f.one),
            median(&f.two),
        );
        pols.insert(
            p.name().to_string(),
            json!({"pair_ns_median": med, "pair_ns_p99": p99, "threads": {"1": one, "2": two}}),
        );
        if !to_stdout {
            println!(
                "{:<12} {med:>16.1} {p99:>14.1} {one:>16.0} {two:>17.0} {:>8.2}",
                p.name(),
                two / one
            );
        }
    }
    if !to_stdout {
        if let Some(first) = figs.first() {
            let base = median(&first.median);
            for (p, f) in policies.iter().zip(&figs).skip(1) {
                println!(
                    "ratio {} / {}: {:.2}",
                    policies[0],
                    p,
                    base / median(&f.median)
                );
            }
        }
        println!(
            "device {}, {} pairs of 1 MiB per policy and round, median of {} rounds",
            args.device, args.iters, args.rounds
        );
    }
    let doc = json!({"device": args.device, "policies": Value::Object(pols)});
    if let Some(j) = &args.json {
        let text = serde_json::to_string_pretty(&doc)?;
        if j == "-" {
            println!("{text}");
        } else {
            std::fs::write(j, text + "\n").with_context(|| format!("writing {j}"))?;
        }
    }
    Ok(())
}
