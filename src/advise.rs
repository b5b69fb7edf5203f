//! `vmmalloc advise SNAPSHOT [--gpu SIZE]`: which policy and which settings
//! fit a given GPU, judged by replaying the trace under each candidate (never
//! by a rule of thumb), with the headroom left and the modeled driver cost;
//! ends with the exact `PYTORCH_CUDA_ALLOC_CONF` or `VMMALLOC_CONF` line.
//!
//! The candidates are our `expandable` policy and PyTorch's caching
//! allocator with each of its fragmentation knobs (`PYTORCH_CUDA_ALLOC_CONF`,
//! `c10/cuda/CUDAAllocatorConfig.cpp` and `CUDACachingAllocator.cpp`):
//! `expandable_segments:True` (the `torch-es` replica), `max_split_size_mb`
//! (blocks at least this large are never split), `roundup_power2_divisions`
//! (requests rounded up to a power-of-two division, so freed blocks are
//! reused by similar sizes) and `garbage_collection_threshold` (cached blocks
//! freed before the limit is reached; it acts only once
//! `torch.cuda.set_per_process_memory_fraction` is set).

use crate::compare::{gib, TightCapacity};
use crate::device_size::unlimited_capacity;
use crate::replay_cmd::format_bytes;
use anyhow::{bail, Context, Result};
use std::sync::Mutex;
use vmmalloc_alloc::PolicySpec;
use vmmalloc_trace::replay::{min_capacity, replay, ReplayConfig};
use vmmalloc_trace::DeviceTrace;

/// Arguments of `vmmalloc advise`.
#[derive(clap::Args, Debug)]
pub struct AdviseArgs {
    /// A PyTorch snapshot (.pickle), a text trace or a workload name.
    pub input: String,
    /// The GPU memory to fit in, e.g. `24GiB` or `80GiB` (default: the
    /// tightest device `compare` uses, 1.05 × peak live).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub gpu: Option<String>,
    /// The simulated device: cost model and granularity.
    #[command(flatten)]
    pub sim: crate::compare::SimArgs,
}

/// One setting evaluated: the policy spec replayed and how a user sets it.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The policy spec replayed (`caching:max_split_size_mb=128`).
    pub spec: &'static str,
    /// Whether it is PyTorch's own allocator (no plug-in needed).
    pub pytorch: bool,
    /// The environment line that selects it.
    pub env: &'static str,
    /// Anything else the user must do.
    pub also: &'static str,
}

/// The candidates, ours first: the default, then its two settings for
/// processes where live tensors must never move (docs/expandable.md,
/// "Unpinning": other host threads launching work on a tensor's memory
/// while an allocation runs): no unpinning (pins stay until their blocks
/// are freed: fewest calls), and the default before unpinning (free chunks
/// split ahead of need once live bytes pass 2/5 of the limit, no mapping
/// ahead: no pins, more calls).
pub const CANDIDATES: [Candidate; 10] = [
    Candidate {
        spec: "expandable",
        pytorch: false,
        env: "VMMALLOC_CONF=backend:expandable",
        also: "run under the plug-in: VMMALLOC_CONF=backend:expandable python -m vmmalloc train.py",
    },
    Candidate {
        spec: "expandable:unpin=0",
        pytorch: false,
        env: "VMMALLOC_CONF=backend:expandable,unpin:false",
        also: "run under the plug-in: VMMALLOC_CONF=backend:expandable,unpin:false python -m vmmalloc train.py",
    },
    Candidate {
        spec: "expandable:split_threshold=0.4,unpin=0,grow_granule=0",
        pytorch: false,
        env: "VMMALLOC_CONF=backend:expandable,split_threshold:0.4,unpin:false,grow_mb:0",
        also: "run under the plug-in: VMMALLOC_CONF=backend:expandable,split_threshold:0.4,unpin:false,grow_mb:0 python -m vmmalloc train.py",
    },
    Candidate {
        spec: "caching",
        pytorch: true,
        env: "unset PYTORCH_CUDA_ALLOC_CONF",
        also: "",
    },
    Candidate {
        spec: "torch-es",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        also: "",
    },
    Candidate {
        spec: "caching:max_split_size_mb=128",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128",
        also: "",
    },
    Candidate {
        spec: "caching:max_split_size_mb=512",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512",
        also: "",
    },
    Candidate {
        spec: "caching:roundup_power2_divisions=4",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4",
        also: "",
    },
    Candidate {
        spec: "caching:garbage_collection_threshold=0.8,memory_fraction=1.0",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8",
        also: "and call torch.cuda.set_per_process_memory_fraction(1.0) before the first CUDA allocation \
               (the threshold acts only with a fraction set)",
    },
    Candidate {
        spec: "torch-es:roundup_power2_divisions=4",
        pytorch: true,
        env: "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,roundup_power2_divisions:4",
        also: "",
    },
];

/// One candidate's figures, over every device of the trace.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The candidate.
    pub candidate: Candidate,
    /// Whether it replays without out-of-memory on every device, cold and steady.
    pub fits: bool,
    /// Largest smallest-device it needs over the devices (`None`: none found).
    pub min_capacity: Option<u64>,
    /// GPU size minus `min_capacity` (smallest over the devices).
    pub headroom: Option<u64>,
    /// Modeled driver time of the first pass, ms (sum over devices).
    pub cold_ms: f64,
    /// Modeled driver time of a further pass, ms (`None`: no steady pass).
    pub steady_ms: Option<f64>,
}

/// Evaluates every candidate on `devices`, each judged on the GPU of the
/// same index in `gpus` (bytes, already checked: [`gpu_sizes`]).
pub fn evaluate(
    devices: &[&DeviceTrace],
    gpus: &[u64],
    base: &ReplayConfig,
) -> Result<Vec<Verdict>> {
    let specs: Vec<PolicySpec> = CANDIDATES
        .iter()
        .map(|c| {
            c.spec
                .parse()
                .with_context(|| format!("candidate `{}`", c.spec))
        })
        .collect::<Result<_>>()?;
    let out: Mutex<Vec<(usize, Verdict)>> = Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(specs.len());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                let mut v = Verdict {
                    candidate: CANDIDATES[i].clone(),
                    fits: true,
                    min_capacity: Some(0),
                    headroom: None,
                    cold_ms: 0.0,
                    steady_ms: Some(0.0),
                };
                let mut headroom: Option<u64> = None;
                for (dt, &cap) in devices.iter().zip(gpus) {
                    let ops = dt.replay_ops();
                    let peak = dt.peak_live_bytes();
                    let mut cfg = base.clone();
                    cfg.policy = spec.policy;
                    cfg.options = spec.options.clone();
                    // Search beyond the GPU: how far a setting misses counts too.
                    let search = min_capacity(ops, peak, &cfg, unlimited_capacity(peak, cap));
                    v.min_capacity = match (v.min_capacity, search.min_capacity) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                    let h = search.min_capacity.filter(|&m| m <= cap).map(|m| cap - m);
                    headroom = match (headroom, h) {
                        (None, h) if v.fits => h,
                        (Some(a), Some(b)) => Some(a.min(b)),
                        _ => None,
                    };
                    cfg.capacity = cap;
                    cfg.steady = true;
                    cfg.pre_trace_ops = dt.pre_trace().len();
                    let r = replay(ops, &cfg);
                    let steady_ok = r.steady.as_ref().is_some_and(|s| s.ok);
                    v.fits &= r.ok && steady_ok && h.is_some();
                    if !v.fits {
                        headroom = None;
                    }
                    v.cold_ms += r.modeled_driver_us / 1000.0;
                    v.steady_ms = v
                        .steady_ms
                        .zip(r.steady.as_ref())
                        .map(|(a, s)| a + s.modeled_driver_us / 1000.0);
                }
                v.headroom = headroom;
                out.lock().unwrap_or_else(|e| e.into_inner()).push((i, v));
            });
        }
    });
    let mut v = out.into_inner().unwrap_or_else(|e| e.into_inner());
    v.sort_by_key(|(i, _)| *i);
    Ok(v.into_iter().map(|(_, v)| v).collect())
}

/// The GPU each device is judged on: `gpu` (`--gpu`, checked), or the
/// tight device `compare` uses (1.05 x the device's peak live), checked as
/// every device size is.
pub fn gpu_sizes(
    trace: &str,
    devices: &[&DeviceTrace],
    gpu: Option<u64>,
    granularity: u64,
) -> Result<Vec<u64>> {
    devices
        .iter()
        .map(|d| match gpu {
            Some(g) => Ok(g),
            None => TightCapacity::default().bytes(trace, d.peak_live_bytes(), granularity),
        })
        .collect()
}

/// The best of `verdicts` that fit: the most headroom, where headroom within
/// `tie` bytes of the best counts as equal and the lower steady (then cold)
/// driver time decides.
pub fn best<'a>(
    verdicts: impl Iterator<Item = &'a Verdict> + Clone,
    tie: u64,
) -> Option<&'a Verdict> {
    let top = verdicts
        .clone()
        .filter(|v| v.fits)
        .filter_map(|v| v.headroom)
        .max()?;
    verdicts
        .filter(|v| v.fits && v.headroom.is_some_and(|h| h + tie >= top))
        .min_by(|a, b| {
            let key = |v: &Verdict| (v.steady_ms.unwrap_or(f64::MAX), v.cold_ms);
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
}

/// The torch companion's capability table, `FEATURES` in
/// python/vmmalloc/_companion.py: the one place that says which PyTorch
/// features the plug-in serves beyond malloc and free (and which raise
/// without the companion). What `advise` says of the plug-in comes from it.
const COMPANION_SOURCE: &str = include_str!("../python/vmmalloc/_companion.py");

/// The C++ methods in the companion's capability table ([`COMPANION_SOURCE`]),
/// in its order.
pub fn companion_methods() -> Vec<&'static str> {
    let Some(start) = COMPANION_SOURCE.find("\nFEATURES = (\n") else {
        return Vec::new();
    };
    let body = &COMPANION_SOURCE[start + "\nFEATURES = (\n".len()..];
    let body = &body[..body.find("\n)\n").unwrap_or(body.len())];
    body.lines()
        .filter_map(|l| l.strip_prefix("    (\"")?.split('"').next())
        .collect()
}

/// Features of the companion's table that `advise` names as examples: (C++
/// method in the table, what a user calls it). A test checks every method
/// against the table.
pub const COMPANION_EXAMPLES: [(&str, &str); 5] = [
    ("checkPoolLiveAllocations", "CUDA graph trees"),
    ("createOrIncrefPool", "torch.cuda.MemPool"),
    ("cacheInfo", "cudnn.benchmark"),
    ("recordHistory", "_record_memory_history"),
    ("shareIpcHandle", "torch.multiprocessing"),
];

/// What the plug-in needs and cannot do (docs/pytorch.md, "Limits"), listed
/// next to every recommendation of it; the companion's part is counted
/// from its capability table ([`companion_methods`]).
pub fn plugin_limits() -> Vec<String> {
    let examples: Vec<&str> = COMPANION_EXAMPLES.iter().map(|(_, name)| *name).collect();
    vec![
        format!(
            "{} PyTorch features ({}, ...) come from its torch companion, built when enable() first \
             runs: it needs a C++20 compiler and the CUDA headers, and without it those raise; \
             `python -m vmmalloc --check` lists what works here",
            companion_methods().len(),
            examples.join(", ")
        ),
        "CUDA graphs and torch.cuda.MemPool need backend:expandable (the other backends refuse them)"
            .to_string(),
        "legacy CUDA IPC (cudaIpcGetMemHandle) does not work on its memory, as on any cuMemCreate \
         memory; torch.multiprocessing goes through the companion"
            .to_string(),
    ]
}

/// Steady driver time within this many ms per further pass (or
/// [`STEADY_TIE_FRACTION`] of the larger) counts as equal.
pub const STEADY_TIE_MS: f64 = 1.0;

/// See [`STEADY_TIE_MS`].
pub const STEADY_TIE_FRACTION: f64 = 0.05;

/// Whether `a` and `b` tie: both fit, headroom within `tie` bytes of each
/// other and driver time per further pass within [`STEADY_TIE_MS`] or
/// [`STEADY_TIE_FRACTION`] (cold time is paid once and does not count).
pub fn ties(a: &Verdict, b: &Verdict, tie: u64) -> bool {
    let (Some(ha), Some(hb)) = (a.headroom, b.headroom) else {
        return false;
    };
    let (sa, sb) = (a.steady_ms.unwrap_or(0.0), b.steady_ms.unwrap_or(0.0));
    a.fits
        && b.fits
        && ha.abs_diff(hb) <= tie
        && (sa - sb).abs() <= STEADY_TIE_MS.max(STEADY_TIE_FRACTION * sa.max(sb))
}

/// The recommendation: the [`best`] overall, except that where it is the
/// plug-in and PyTorch's best setting [`ties`] with it, PyTorch's own
/// setting (nothing to install, no plug-in limits). The flag says a tie
/// decided.
pub fn recommend(verdicts: &[Verdict], tie: u64) -> Option<(&Verdict, bool)> {
    let overall = best(verdicts.iter(), tie)?;
    if overall.candidate.pytorch {
        return Some((overall, false));
    }
    match best(verdicts.iter().filter(|v| v.candidate.pytorch), tie) {
        Some(p) if ties(p, overall, tie) => Some((p, true)),
        _ => Some((overall, false)),
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |m| format!("{m:.1}"))
}

/// Runs `vmmalloc advise`.
pub fn run(args: AdviseArgs) -> Result<()> {
    let base = args.sim.base_config()?;
    let gpu = gpu_size(args.gpu.as_deref(), &base)?;
    let trace = crate::input::load_input(&args.input)?;
    let devices: Vec<&DeviceTrace> = trace.devices.iter().collect();
    let gpus = gpu_sizes(&trace.name, &devices, gpu, base.granularity)?;
    print_devices(&trace.name, &devices, &gpus, gpu);
    let verdicts = evaluate(&devices, &gpus, &base)?;
    println!();
    print_table(&verdicts);
    println!();
    print_legend(&base);
    // Headroom within 1 % of the GPU (at least one granule) is a tie.
    let gpu_ref = gpus.iter().copied().max().unwrap_or(0);
    let tie = (gpu_ref / 100).max(base.granularity);
    println!();
    print_pytorch_choice(&verdicts, tie);
    print_best(&verdicts, tie, gpu_ref)
}

/// `--gpu SIZE`: a GPU is the size it is, rounded down to whole granules.
fn gpu_size(gpu: Option<&str>, base: &ReplayConfig) -> Result<Option<u64>> {
    let Some(s) = gpu else {
        return Ok(None);
    };
    let b = crate::device_size::parse_capacity("--gpu", s, 1)?;
    let r = b / base.granularity * base.granularity;
    if r == 0 {
        bail!(
            "--gpu {s}: smaller than one {} MiB granule",
            base.granularity >> 20
        );
    }
    Ok(Some(r))
}

/// One line per device: its events, peak and the GPU it is judged on.
fn print_devices(name: &str, devices: &[&DeviceTrace], gpus: &[u64], gpu: Option<u64>) {
    for (dt, cap) in devices.iter().zip(gpus) {
        let peak = dt.peak_live_bytes();
        let head = format!(
            "{} device {}: {} events, peak live {}; judged on {}",
            name,
            dt.device(),
            dt.events().len(),
            format_bytes(peak),
            match gpu {
                Some(g) => format!("a {} GPU (--gpu)", format_bytes(g)),
                None => format!(
                    "a {} device, 1.05 x peak live (give --gpu SIZE for your card)",
                    format_bytes(*cap)
                ),
            }
        );
        print!("{}", crate::compare::wrap_hanging(&head, 0, 2));
    }
}

/// The table of settings, fitted to the terminal width.
fn print_table(verdicts: &[Verdict]) {
    let header = [
        "setting (replayed as)",
        "fits",
        "needs GiB",
        "headroom GiB",
        "cold ms",
        "steady ms",
    ];
    let rows: Vec<[String; 6]> = verdicts
        .iter()
        .map(|v| {
            [
                v.candidate.spec.to_string(),
                if v.fits { "yes" } else { "no" }.to_string(),
                v.min_capacity.map_or("-".into(), gib),
                v.headroom.map_or("-".into(), gib),
                // The driver time of a replay that ran out of memory means nothing.
                if v.fits {
                    format!("{:.1}", v.cold_ms)
                } else {
                    "-".into()
                },
                if v.fits { ms(v.steady_ms) } else { "-".into() },
            ]
        })
        .collect();
    let width = crate::compare::TERMINAL_WIDTH;
    let mut w: Vec<usize> = (0..6)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    // The table fits the terminal width: a setting too long for the first
    // column gets a line of its own, its figures on the next.
    let figures: usize = w[1..].iter().map(|x| x + 2).sum();
    w[0] = w[0].min(width.saturating_sub(figures)).max(header[0].len());
    let line = |cells: [&str; 6]| {
        let mut s = if cells[0].len() > w[0] {
            format!("{}\n{:<w0$}", cells[0], "", w0 = w[0])
        } else {
            format!("{:<w0$}", cells[0], w0 = w[0])
        };
        for i in 1..6 {
            s.push_str(&format!("  {:>wi$}", cells[i], wi = w[i]));
        }
        println!("{}", s.trim_end());
    };
    line(header);
    for r in &rows {
        line([&r[0], &r[1], &r[2], &r[3], &r[4], &r[5]]);
    }
}

/// What the table's columns mean and how the best is chosen.
fn print_legend(base: &ReplayConfig) {
    print!(
        "{}",
        crate::compare::wrap(
            &format!(
                "needs: the smallest device that replays the trace (bisection to {} MiB); headroom: the GPU minus that; \
                 cold / steady ms: modeled driver time ({} cost model) of the first replay on the GPU and of a further one \
                 (every later iteration). Each setting was replayed, not estimated. Best: the most headroom, where \
                 headroom within 1 % of the GPU counts as a tie and the lower driver time per further pass decides; \
                 where PyTorch's best setting ties with the plug-in (headroom within 1 %, driver time per further pass \
                 within 1 ms or 5 %), stay with PyTorch's.",
                base.granularity >> 20,
                base.cost_label
            ),
            crate::compare::TERMINAL_WIDTH
        )
    );
}

/// `who: setting — headroom, driver time.`, wrapped to the width.
fn say(who: &str, v: &Verdict) {
    print!(
        "{}",
        crate::compare::wrap(
            &format!(
                "{who}: {} — headroom {}, driver time {:.1} ms cold, {} ms per further pass.",
                v.candidate.spec,
                v.headroom.map_or("-".into(), format_bytes),
                v.cold_ms,
                ms(v.steady_ms)
            ),
            crate::compare::TERMINAL_WIDTH
        )
    );
}

/// An indented paragraph, wrapped to the width.
fn indented(text: &str) {
    for l in crate::compare::wrap(text, crate::compare::TERMINAL_WIDTH - 2).lines() {
        println!("  {l}");
    }
}

/// PyTorch's best setting (or the closest to fitting, or that none fits).
fn print_pytorch_choice(verdicts: &[Verdict], tie: u64) {
    match best(verdicts.iter().filter(|v| v.candidate.pytorch), tie) {
        Some(v) => {
            say("Keeping PyTorch's allocator", v);
            println!(
                "  {}{}",
                v.candidate.env,
                if v.candidate.also.is_empty() {
                    String::new()
                } else {
                    format!("  ({})", v.candidate.also)
                }
            );
        }
        None => match verdicts
            .iter()
            .filter(|v| v.candidate.pytorch)
            .filter_map(|v| Some((v.min_capacity?, v)))
            .min_by_key(|(m, _)| *m)
        {
            Some((m, v)) => print!(
                "{}",
                crate::compare::wrap(
                    &format!(
                        "Keeping PyTorch's allocator: no setting of it fits; the closest, {}, needs {}.",
                        v.candidate.spec,
                        format_bytes(m)
                    ),
                    crate::compare::TERMINAL_WIDTH
                )
            ),
            None => println!("Keeping PyTorch's allocator: no setting of it fits."),
        },
    }
}

/// The recommendation and its environment line (with the plug-in's limits
/// where it is the plug-in), or the error that nothing fits.
fn print_best(verdicts: &[Verdict], tie: u64, gpu_ref: u64) -> Result<()> {
    let width = crate::compare::TERMINAL_WIDTH;
    let Some((v, tied)) = recommend(verdicts, tie) else {
        let closest = verdicts
            .iter()
            .filter_map(|v| Some((v.min_capacity?, v)))
            .min_by_key(|(m, _)| *m);
        match closest {
            Some((m, v)) => bail!(
                "nothing fits on {}; the closest, {}, needs {}",
                format_bytes(gpu_ref),
                v.candidate.spec,
                format_bytes(m)
            ),
            None => bail!(
                "nothing fits on {}, nor on any device up to 8 x peak live",
                format_bytes(gpu_ref)
            ),
        }
    };
    say("Best", v);
    if tied {
        let plugin = best(verdicts.iter(), tie).expect("a best exists");
        indented(&format!(
            "{} ties with it (headroom {}, {} ms per further pass): staying with PyTorch's own allocator \
             needs no plug-in and keeps everything PyTorch supports.",
            plugin.candidate.spec,
            plugin.headroom.map_or("-".into(), format_bytes),
            ms(plugin.steady_ms)
        ));
    }
    if !v.candidate.also.is_empty() {
        indented(v.candidate.also);
    }
    if !v.candidate.pytorch {
        println!("  What the plug-in needs, and its limits (docs/pytorch.md, \"Limits\"):");
        for l in plugin_limits() {
            for (i, part) in crate::compare::wrap(&l, width - 4).lines().enumerate() {
                println!("  {} {part}", if i == 0 { "-" } else { " " });
            }
        }
    }
    println!("{}", v.candidate.env);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_limits_come_from_the_companions_capability_table() {
        let methods = companion_methods();
        // The table as the Python package reads it: one entry per line
        // that opens a tuple (continuation lines open none).
        let start = COMPANION_SOURCE.find("\nFEATURES = (\n").unwrap();
        let end = start + COMPANION_SOURCE[start..].find("\n)\n").unwrap();
        let entries = COMPANION_SOURCE[start..end].matches("\n    (\"").count();
        assert!(entries >= 15, "{entries}");
        assert_eq!(methods.len(), entries);
        for (m, _) in COMPANION_EXAMPLES {
            assert!(
                methods.contains(&m),
                "{m} is not in the companion's FEATURES"
            );
        }
        let text = plugin_limits().join(" ");
        assert!(
            text.contains(&format!("{} PyTorch features", methods.len())),
            "{text}"
        );
        for stale in [
            "does not support yet",
            "cudnn.benchmark = True raises",
            "history raises",
        ] {
            assert!(!text.contains(stale), "{text}");
        }
    }

    #[test]
    fn every_candidate_parses_and_is_set_by_its_line() {
        for c in CANDIDATES {
            let spec: PolicySpec = c.spec.parse().unwrap();
            assert_eq!(c.pytorch, spec.policy.name() != "expandable", "{}", c.spec);
            if !c.pytorch {
                // The VMMALLOC_CONF line (keys as crates/capi/src/config.rs
                // parses them) sets the same expandable options as the spec.
                let conf = c.env.strip_prefix("VMMALLOC_CONF=").unwrap();
                let mut want = vmmalloc_alloc::expandable::ExpandableConfig::default();
                for item in conf.split(',') {
                    let (k, v) = item.split_once(':').unwrap();
                    match k {
                        "backend" => assert_eq!(v, "expandable"),
                        "split_threshold" => want.split_threshold = v.parse().unwrap(),
                        "split_slack_mb" => want.split_slack = v.parse::<u64>().unwrap() << 20,
                        "unpin" => want.unpin = v.parse().unwrap(),
                        "grow_mb" => want.grow_granule = v.parse::<u64>().unwrap() << 20,
                        other => panic!("{}: key {other} not checked here", c.spec),
                    }
                }
                assert_eq!(
                    (
                        want.split_threshold,
                        want.split_slack,
                        want.unpin,
                        want.grow_granule
                    ),
                    (
                        spec.options.expandable.split_threshold,
                        spec.options.expandable.split_slack,
                        spec.options.expandable.unpin,
                        spec.options.expandable.grow_granule
                    ),
                    "{}",
                    c.spec
                );
                assert!(c.also.contains(conf), "{}", c.spec);
                // The same line after `expandable:` is a policy spec with the
                // same options (one parser, both spellings).
                let opts = conf.trim_start_matches("backend:expandable");
                let as_spec: PolicySpec = format!("expandable:{}", opts.trim_start_matches(','))
                    .trim_end_matches(':')
                    .parse()
                    .unwrap();
                assert_eq!(as_spec.options, spec.options, "{}", c.spec);
            }
            if c.pytorch && spec.options.caching != Default::default() {
                // The env line carries the same PyTorch options as the spec.
                let conf = c.env.strip_prefix("PYTORCH_CUDA_ALLOC_CONF=").unwrap();
                let parsed = vmmalloc_alloc::caching::CachingConfig::parse(conf).unwrap();
                let mut want = spec.options.caching.clone();
                want.expandable_segments = parsed.expandable_segments;
                assert_eq!(parsed, want, "{}", c.spec);
                assert_eq!(parsed.expandable_segments, spec.policy.name() == "torch-es");
            }
        }
    }

    fn verdict(spec: &'static str, fits: bool, headroom: Option<u64>, steady: f64) -> Verdict {
        Verdict {
            candidate: CANDIDATES.iter().find(|c| c.spec == spec).unwrap().clone(),
            fits,
            min_capacity: Some(1),
            headroom,
            cold_ms: 1.0,
            steady_ms: Some(steady),
        }
    }

    #[test]
    fn best_takes_the_most_headroom_and_breaks_ties_by_driver_time() {
        let v = [
            verdict("expandable", true, Some(100), 5.0),
            verdict("caching", true, Some(98), 1.0),
            verdict("torch-es", true, Some(50), 0.5),
            verdict("caching:max_split_size_mb=128", false, None, 0.1),
        ];
        assert_eq!(best(v.iter(), 0).unwrap().candidate.spec, "expandable");
        assert_eq!(best(v.iter(), 2).unwrap().candidate.spec, "caching");
        assert!(best(v[3..].iter(), 2).is_none());
    }

    #[test]
    fn a_tie_with_pytorch_stays_with_pytorch() {
        // Headroom within the tie and steady time within 1 ms: PyTorch's.
        let v = [
            verdict("expandable", true, Some(100), 0.5),
            verdict("caching", true, Some(99), 1.0),
        ];
        let (r, tied) = recommend(&v, 2).unwrap();
        assert_eq!((r.candidate.spec, tied), ("caching", true));
        // Not a tie on headroom: ours.
        let (r, tied) = recommend(&v, 0).unwrap();
        assert_eq!((r.candidate.spec, tied), ("expandable", false));
        // Not a tie on steady time (10 ms against 1 ms): ours.
        let v = [
            verdict("expandable", true, Some(100), 1.0),
            verdict("caching", true, Some(100), 10.0),
        ];
        assert_eq!(recommend(&v, 2).unwrap().0.candidate.spec, "expandable");
        // Only ours fits: ours.
        let v = [
            verdict("expandable", true, Some(100), 1.0),
            verdict("caching", false, None, 0.0),
        ];
        assert_eq!(recommend(&v, 2).unwrap().0.candidate.spec, "expandable");
    }
}
