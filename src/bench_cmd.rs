//! `vmmalloc bench`: the cache-hit malloc + free pair and 1-vs-2-thread
//! throughput of every policy, measured side by side in one run.

use crate::compare::parse_policy_specs;
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use vmmalloc_alloc::bench::{bench_pair, thread_scaling, PAIR_SIZE};
use vmmalloc_alloc::{build, Policy, PolicySpec};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Stream, GIB};

/// Arguments of `vmmalloc bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Policies to measure, comma-separated, each `NAME[:key=value,...]` with
    /// policy options as for `compare`, e.g. `expandable,expandable:max_chunk=20MiB`.
    #[arg(long, default_value = "expandable,caching,torch-es,native")]
    pub policies: Vec<String>,
    /// Device backend: `sim` (bookkeeping only) or `host` (real CPU memory).
    #[arg(long, default_value = "sim")]
    pub device: String,
    /// Write the results as JSON to FILE (`-` for standard output).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Timed pairs per policy and round (at least 10,000: fewer make the
    /// p99 and the throughput timings meaningless).
    #[arg(long, default_value_t = 200_000, allow_negative_numbers = true, value_parser = crate::whole_number::<u64>)]
    pub iters: u64,
    /// Rounds; each round measures every policy once, in turn, and the median
    /// round is reported (so noise hits every policy alike).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = crate::whole_number::<usize>)]
    pub rounds: usize,
    /// Where output folders may be created.
    #[command(flatten)]
    pub mkdir: crate::output_path::MkdirArg,
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

fn measure(spec: &PolicySpec, kind: &str, iters: u64) -> Result<(f64, f64, f64, f64)> {
    let dev = device(kind)?;
    let side = dev.create_stream().context("creating a stream")?;
    let alloc = build(spec.policy, dev, &spec.options)
        .with_context(|| format!("--policies {}", spec.label))?;
    let (med, p99) = bench_pair(&*alloc, iters)?;
    let scaling = thread_scaling(&*alloc, [Stream::DEFAULT, side], iters)?;
    Ok((med, p99, scaling.one, scaling.two))
}

/// The fewest `--iters` accepted: 156 batches of 64 pairs for the p99, and
/// throughput runs of ~1 ms or more per thread, well above thread start-up and
/// clock noise.
pub const MIN_ITERS: u64 = 10_000;

/// What the `sim` device means for these figures: its calls cost no time.
fn sim_note(policies: &[PolicySpec]) -> Option<String> {
    if !policies.iter().any(|s| s.policy == Policy::Native) {
        return None;
    }
    // What one pair would cost on a GPU by the default (h200) cost model.
    let m = vmmalloc_device::cost::CostModel::default();
    let pair_us = m.cost_us(Call::Alloc, PAIR_SIZE) + m.cost_us(Call::Free, PAIR_SIZE);
    Some(format!(
        "note: on `sim` a driver call costs no time, so these figures are the allocators' own CPU work: \
         native (a cuMemAlloc + cuMemFree per pair) looks cheap here, but on a GPU each of its pairs costs \
         about {pair_us:.0} us by the h200 cost model, while a cache hit of the others makes no driver call. \
         Use `vmmalloc compare` for modeled driver cost, `--device host` for real (CPU) memory calls."
    ))
}

/// Runs `vmmalloc bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    let policies = parse_policy_specs(&args.policies)?;
    if let Some(j) = args.json.as_deref().filter(|j| *j != "-") {
        crate::output_path::prepare_file("--json", std::path::Path::new(j), args.mkdir.mkdir)?;
    }
    if args.rounds == 0 {
        bail!("--rounds must be positive");
    }
    if args.iters < MIN_ITERS {
        bail!(
            "--iters {} is too few: at least {MIN_ITERS} pairs per policy and round are needed for a \
             p99 (batches of 64 pairs) and for throughput timings above thread start-up noise",
            args.iters
        );
    }
    // Every policy's options, before anything is measured.
    for spec in &policies {
        build(spec.policy, device(&args.device)?, &spec.options)
            .with_context(|| format!("--policies {}", spec.label))?;
    }
    let mut figs: Vec<Figures> = vec![Figures::default(); policies.len()];
    for _ in 0..args.rounds {
        for (i, p) in policies.iter().enumerate() {
            let (med, p99, one, two) = measure(p, &args.device, args.iters)
                .with_context(|| format!("benchmarking {}", p.label))?;
            figs[i].median.push(med);
            figs[i].p99.push(p99);
            figs[i].one.push(one);
            figs[i].two.push(two);
        }
    }
    let mut pols = Map::new();
    let to_stdout = args.json.as_deref() == Some("-");
    let mut lines: Vec<Vec<String>> = vec![[
        "policy",
        "pair ns median",
        "pair ns p99",
        "1 thread pairs/s",
        "2 threads pairs/s",
        "2t / 1t",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()];
    for (p, f) in policies.iter().zip(&figs) {
        let (med, p99, one, two) = (
            median(&f.median),
            median(&f.p99),
            median(&f.one),
            median(&f.two),
        );
        pols.insert(
            p.label.clone(),
            json!({"pair_ns_median": med, "pair_ns_p99": p99, "threads": {"1": one, "2": two}}),
        );
        lines.push(vec![
            p.label.clone(),
            format!("{med:.1}"),
            format!("{p99:.1}"),
            format!("{one:.0}"),
            format!("{two:.0}"),
            format!("{:.2}", two / one),
        ]);
    }
    if !to_stdout {
        print!("{}", crate::compare::align_fit(&lines, 1));
        let width = crate::compare::TERMINAL_WIDTH;
        if let Some(first) = figs.first() {
            let base = median(&first.median);
            for (p, f) in policies.iter().zip(&figs).skip(1) {
                let r = base / median(&f.median);
                print!(
                    "{}",
                    crate::compare::wrap(
                        &format!(
                            "pair time {} / {}: {r:.2} ({}'s median pair takes {r:.2}x {}'s; below 1: {} is faster)",
                            policies[0].label, p.label, policies[0].label, p.label, policies[0].label
                        ),
                        width
                    )
                );
            }
        }
        print!(
            "{}",
            crate::compare::wrap(
                &format!(
                    "device {}, {} pairs of 1 MiB per policy and round, median of {} round{}; \
                     2t / 1t = pairs/s with 2 threads on 2 streams divided by pairs/s with 1 thread \
                     (2.00: perfect scaling)",
                    args.device,
                    args.iters,
                    args.rounds,
                    if args.rounds == 1 { "" } else { "s" }
                ),
                width
            )
        );
        if args.device == "sim" {
            if let Some(note) = sim_note(&policies) {
                print!("{}", crate::compare::wrap(&note, width));
            }
        }
    }
    let doc = json!({
        "device": args.device,
        "iters": args.iters,
        "rounds": args.rounds,
        "pair_bytes": PAIR_SIZE,
        "policies": Value::Object(pols),
    });
    if let Some(j) = &args.json {
        let text = serde_json::to_string_pretty(&doc)?;
        if j == "-" {
            println!("{text}");
        } else {
            crate::output_path::write_file(std::path::Path::new(j), (text + "\n").as_bytes())?;
        }
    }
    Ok(())
}
