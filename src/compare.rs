//! `vmmalloc compare`: replay traces against every policy, find each one's
//! smallest device, and report overhead and driver cost.

use crate::device_size::unlimited_capacity;
use crate::input::{load_inputs, resolve_input};
use crate::report;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;
use vmmalloc_alloc::{split_policy_specs, Policy, PolicySpec};
use vmmalloc_device::cost::CostModel;
use vmmalloc_device::{round_up, Call, CallCounts, GIB, MIB};
use vmmalloc_trace::replay::{
    check_config, min_capacity, replay, ReplayConfig, ReplayResult, SteadyResult,
};
use vmmalloc_trace::{DeviceTrace, Trace};

/// Arguments of `vmmalloc compare`.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// Snapshots (.pickle), text traces, or workload names (`train-varlen`,
    /// `serve-kv:seed=3`, ...). Default: the bundled snapshot and every built-in workload
    /// (`vmmalloc workloads` lists them).
    pub inputs: Vec<String>,
    /// Policies to compare, comma-separated, each `NAME[:key=value,...]`
    /// with policy options, e.g. `expandable,expandable:max_chunk=20MiB,caching`
    /// (the spec as written labels its row).
    #[arg(long, default_value = "expandable,caching,torch-es,native")]
    pub policies: Vec<String>,
    /// Write the results as JSON to FILE (`-` for standard output).
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Write report.md and SVG plots to DIR.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// The simulated device: cost model and granularity.
    #[command(flatten)]
    pub sim: SimArgs,
    /// Replay every trace on a device of this size (e.g. `24GiB`, `24GB`;
    /// rounded up to the granularity) instead of the tight capacity: "does it
    /// fit my card?". The `tight` columns and JSON then describe this device.
    #[arg(
        long,
        value_name = "SIZE",
        allow_hyphen_values = true,
        conflicts_with = "tight_factor"
    )]
    pub capacity: Option<String>,
    /// The tight capacity as a multiple of each trace's peak live bytes
    /// (at least 1; rounded up to the granularity) [default: 1.05].
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    pub tight_factor: Option<String>,
    /// Exit with an error if any policy ran out of memory at the tight (or
    /// `--capacity`) device, or any replay stopped early (for scripts and CI).
    #[arg(long)]
    pub fail_on_oom: bool,
    /// Print every column (one row per trace and policy, ~200 characters
    /// wide) instead of the table that fits 100 columns.
    #[arg(long)]
    pub wide: bool,
    /// Where output folders may be created.
    #[command(flatten)]
    pub mkdir: crate::output_path::MkdirArg,
}

/// The width the default output fits (table, wrapped notes, conclusion).
pub const TERMINAL_WIDTH: usize = 100;

/// The default tight capacity: 1.05 x peak live.
pub const DEFAULT_TIGHT_FACTOR: f64 = 1.05;

/// The device the `tight` replays run on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TightCapacity {
    /// This multiple of each trace's peak live bytes.
    Factor(f64),
    /// This many bytes for every trace (`--capacity`).
    Fixed(u64),
}

impl Default for TightCapacity {
    fn default() -> Self {
        TightCapacity::Factor(DEFAULT_TIGHT_FACTOR)
    }
}

impl TightCapacity {
    /// The device for trace `trace` of `peak_live` bytes, rounded up to
    /// `granularity`, checked as every device size is
    /// ([`crate::device_size::device_size`]).
    pub fn bytes(self, trace: &str, peak_live: u64, granularity: u64) -> Result<u64> {
        match self {
            TightCapacity::Factor(f) => crate::device_size::factor_size(
                &format!(
                    "{trace}: the tight device, {} x peak live ({})",
                    crate::device_size::factor_text(f),
                    crate::replay_cmd::format_bytes(peak_live)
                ),
                f,
                peak_live,
                granularity,
            ),
            TightCapacity::Fixed(b) => crate::device_size::device_size(
                &format!("--capacity {}", crate::replay_cmd::format_bytes(b)),
                b.into(),
                granularity,
            ),
        }
    }

    /// How reports describe it: `1.05 x peak live` or `24.00 GiB (--capacity)`.
    pub fn describe(self, granularity: u64) -> String {
        match self {
            TightCapacity::Factor(f) => {
                format!("{} x peak live", crate::device_size::factor_text(f))
            }
            TightCapacity::Fixed(b) => {
                format!(
                    "{} (--capacity)",
                    crate::replay_cmd::format_bytes(round_up(b, granularity))
                )
            }
        }
    }

    /// The JSON record of the rule.
    pub fn to_json(self, granularity: u64) -> Value {
        match self {
            TightCapacity::Factor(f) => json!({"rule": "factor", "factor": f}),
            TightCapacity::Fixed(b) => {
                json!({"rule": "fixed", "asked_bytes": b, "bytes": round_up(b, granularity)})
            }
        }
    }
}

/// One policy's figures on one trace.
#[derive(Debug, Clone)]
pub struct PolicyRow {
    /// The policy.
    pub policy: Policy,
    /// The policy with its options; its label names the row.
    pub spec: PolicySpec,
    /// Smallest capacity that runs the trace.
    pub min_capacity: Option<u64>,
    /// Replay at the tight capacity (1.05 × peak live), cold then steady
    /// (`tight.steady`), priced by the chosen model and by the second
    /// preset ([`second_preset`]).
    pub tight: ReplayResult,
    /// Replay on an unlimited device, cold then steady.
    pub unlimited: ReplayResult,
}

/// Everything measured on one (trace, device).
#[derive(Debug, Clone)]
pub struct TraceRow {
    /// Trace name.
    pub name: String,
    /// Device index.
    pub device: u32,
    /// Events on that device.
    pub events: usize,
    /// Allocations replayed (pre-trace included).
    pub allocs: usize,
    /// Bytes live before the trace began.
    pub pre_trace_live: u64,
    /// Peak live requested bytes.
    pub peak_live: u64,
    /// Tight capacity used.
    pub tight_capacity: u64,
    /// How the tight capacity was chosen (`1.05 x peak live`, `--capacity`).
    pub tight_rule: String,
    /// Warnings from the reader.
    pub warnings: usize,
    /// Seconds since the first event at each replayed op (pre-trace ops at
    /// 0), where every replayed event has a time stamp; the plots' x axis.
    pub op_times_s: Option<Vec<f64>>,
    /// The preset that also prices every replay ([`second_preset`]): the
    /// `cold ms <preset>` column, JSON `modeled_driver_us_second`.
    pub second_cost: &'static str,
    /// Per policy.
    pub policies: Vec<PolicyRow>,
}

/// The preset that prices the same calls beside the chosen model, so that
/// both measured-shape presets show side by side: `a100` beside `h200` (and
/// beside an `h200` with overrides), `h200` beside anything else.
pub fn second_preset(cost_label: &str) -> &'static str {
    if cost_label == "h200" || cost_label.starts_with("h200 +") {
        "a100"
    } else {
        "h200"
    }
}

impl PolicyRow {
    /// min capacity / peak live.
    pub fn overhead(&self, peak_live: u64) -> Option<f64> {
        self.min_capacity
            .map(|c| c as f64 / peak_live.max(1) as f64)
    }

    /// The min capacity in GiB as a table cell (`-`: none found).
    pub fn min_capacity_cell(&self) -> String {
        self.min_capacity.map_or("-".into(), gib)
    }

    /// The overhead as a table cell (`-`: no min capacity).
    pub fn overhead_cell(&self, peak_live: u64) -> String {
        self.overhead(peak_live)
            .map_or("-".into(), |o| format!("{o:.3}"))
    }

    /// The row's label: the policy spec as written.
    pub fn label(&self) -> &str {
        &self.spec.label
    }

    /// Whether the tight replay fit, as a table cell (cold, and the steady
    /// pass's out-of-memory errors if it had any).
    pub fn tight_ok_cell(&self) -> String {
        let cold = if self.tight.ok {
            "yes".to_string()
        } else {
            format!("no ({} ooms)", self.tight.ooms)
        };
        match &self.tight.steady {
            Some(st) if !st.ok => format!("{cold}; steady {} ooms", st.ooms),
            _ => cold,
        }
    }

    /// The steady pass at the tight capacity as (memory calls, ms, syncs)
    /// cells (`-`: no steady pass, the cold one stopped).
    pub fn steady_cells(&self) -> [String; 3] {
        match &self.tight.steady {
            Some(st) => [
                st.memory_calls().to_string(),
                format!("{:.1}", st.modeled_driver_us / 1000.0),
                syncs_cell(&st.driver_calls),
            ],
            None => ["-".into(), "-".into(), "-".into()],
        }
    }

    /// The cold pass at the tight capacity priced by the second preset
    /// ([`second_preset`]), ms, as a cell.
    pub fn cold_second_cell(&self) -> String {
        self.tight
            .modeled_driver_us_second
            .map_or("-".into(), |us| format!("{:.1}", us / 1000.0))
    }
}

/// Syncs as a compact table cell ([`CallCounts::syncs`], one definition
/// everywhere): `0`, `65 dev` (device-wide: `cuCtxSynchronize`, each
/// `cuMemFree`), `3 s/e` (stream/event waits), or `68 (3 s/e + 65 dev)` where
/// both occur.
pub fn syncs_cell(c: &CallCounts) -> String {
    let (s, d) = (c.stream_syncs(), c.device_syncs());
    match (s, d) {
        (0, 0) => "0".into(),
        (s, 0) => format!("{s} s/e"),
        (0, d) => format!("{d} dev"),
        (s, d) => format!("{} ({s} s/e + {d} dev)", s + d),
    }
}

/// The legend of [`syncs_cell`], for table footnotes.
pub const SYNCS_LEGEND: &str =
    "syncs = stream/event waits (s/e: cuStreamSynchronize, cuEventSynchronize) + device-wide \
     synchronizations (dev: cuCtxSynchronize and every cuMemFree, which synchronizes the device)";

/// Measures one device trace against the policies: capacity search, then
/// the tight replays (on the device `tight` describes; `TightCapacity::default()`
/// is 1.05 x peak live) and the unlimited ones, each cold and steady, priced
/// by the chosen model and by the second preset ([`second_preset`]).
pub fn measure(
    name: &str,
    dt: &DeviceTrace,
    policies: &[PolicySpec],
    base: &ReplayConfig,
    tight: TightCapacity,
    tick: &(dyn Fn() + Sync),
) -> Result<TraceRow> {
    let ops = dt.replay_ops();
    let second = second_preset(&base.cost_label);
    let second_model = CostModel::preset(second).expect("a preset name");
    let peak_live = dt.peak_live_bytes();
    let tight_cap = tight.bytes(name, peak_live, base.granularity)?;
    let unl = unlimited_capacity(peak_live, tight_cap);
    let rows: Mutex<Vec<PolicyRow>> = Mutex::new(Vec::new());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(policies.len())
        .max(1);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(spec) = policies.get(i) else {
                    break;
                };
                let mut cfg = crate::point::with_frames(base, dt);
                cfg.policy = spec.policy;
                cfg.options = spec.options.clone();
                let search = min_capacity(ops, peak_live, &cfg, unl);
                cfg.steady = true;
                cfg.pre_trace_ops = dt.pre_trace().len();
                cfg.second_cost = Some(second_model);
                let mut tcfg = cfg.clone();
                tcfg.capacity = tight_cap;
                tcfg.timeline_samples = 400;
                let tight = replay(ops, &tcfg);
                let mut ucfg = cfg.clone();
                ucfg.capacity = unl;
                let unlimited = replay(ops, &ucfg);
                rows.lock().unwrap().push(PolicyRow {
                    policy: spec.policy,
                    spec: spec.clone(),
                    min_capacity: search.min_capacity,
                    tight,
                    unlimited,
                });
                tick();
            });
        }
    });
    let mut policies_rows = rows.into_inner().unwrap();
    policies_rows.sort_by_key(|r| policies.iter().position(|p| p.label == r.spec.label));
    Ok(TraceRow {
        name: name.to_string(),
        device: dt.device(),
        events: dt.events().len(),
        allocs: dt.allocs(),
        pre_trace_live: dt.pre_trace_live_bytes(),
        peak_live,
        tight_capacity: tight_cap,
        tight_rule: tight.describe(base.granularity),
        warnings: dt.warnings().len(),
        op_times_s: op_times_s(dt),
        second_cost: second,
        policies: policies_rows,
    })
}

/// Seconds since the first replayed event at each op of `dt.replay_ops()`
/// (pre-trace allocations at 0); `None` where an event has no time stamp.
pub fn op_times_s(dt: &DeviceTrace) -> Option<Vec<f64>> {
    let mut times = vec![0.0; dt.pre_trace().len()];
    let mut t0 = None;
    for e in dt.events().iter().filter(|e| e.kind.is_replayed()) {
        let us = e.time_us?;
        let t0 = *t0.get_or_insert(us);
        times.push((us - t0) as f64 / 1e6);
    }
    (times.len() == dt.replay_ops().len()).then_some(times)
}

fn calls_json(c: &CallCounts) -> Value {
    let mut m = Map::new();
    for call in Call::ALL {
        let n = c.get(call);
        if n > 0 {
            m.insert(call.name().to_string(), json!(n));
        }
    }
    Value::Object(m)
}

/// The `steady` object of a replay: the second pass's calls per kind, modeled
/// time and syncs, plus its out-of-memory errors (null: no second pass).
fn steady_json(st: Option<&SteadyResult>) -> Value {
    match st {
        Some(st) => json!({
            "driver_calls": calls_json(&st.driver_calls),
            "modeled_driver_us": st.modeled_driver_us,
            "modeled_driver_us_second": st.modeled_driver_us_second,
            "syncs": st.syncs,
            "stream_syncs": st.driver_calls.stream_syncs(),
            "device_syncs": st.driver_calls.device_syncs(),
            "ooms": st.ooms,
        }),
        None => Value::Null,
    }
}

/// The JSON document (schema version 2: `syncs` counts every `cuMemFree` as
/// a device-wide sync, split into `stream_syncs` + `device_syncs`; see
/// docs/guide.md); `cost_model` names the cost model
/// (a preset or a file, see [`CostModel::select`]).
pub fn to_json(rows: &[TraceRow], cost_model: &str) -> Value {
    let traces: Vec<Value> = rows
        .iter()
        .map(|t| {
            let mut pols = Map::new();
            for p in &t.policies {
                pols.insert(
                    p.label().to_string(),
                    json!({
                        "min_capacity_bytes": p.min_capacity,
                        "overhead": p.overhead(t.peak_live),
                        "tight": {
                            "capacity_bytes": t.tight_capacity,
                            "ok": p.tight.ok,
                            "ooms": p.tight.ooms,
                            "retries": p.tight.retries,
                            "region_copies": p.tight.region_copies,
                            "region_copied_bytes": p.tight.region_copied_bytes,
                            "syncs": p.tight.syncs,
                            "stream_syncs": p.tight.driver_calls.stream_syncs(),
                            "device_syncs": p.tight.driver_calls.device_syncs(),
                            "driver_calls": calls_json(&p.tight.driver_calls),
                            "modeled_driver_us": p.tight.modeled_driver_us,
                            "modeled_driver_us_second": p.tight.modeled_driver_us_second,
                            "steady": steady_json(p.tight.steady.as_ref()),
                        },
                        "unlimited": {
                            "peak_reserved_bytes": p.unlimited.peak_reserved,
                            "driver_calls": calls_json(&p.unlimited.driver_calls),
                            "modeled_driver_us": p.unlimited.modeled_driver_us,
                            "modeled_driver_us_second": p.unlimited.modeled_driver_us_second,
                            "steady": steady_json(p.unlimited.steady.as_ref()),
                        },
                    }),
                );
            }
            json!({
                "name": t.name,
                "device": t.device,
                "events": t.events,
                "allocs": t.allocs,
                "pre_trace_live_bytes": t.pre_trace_live,
                "peak_live_bytes": t.peak_live,
                "tight_capacity_bytes": t.tight_capacity,
                "reader_warnings": t.warnings,
                "policies": Value::Object(pols),
            })
        })
        .collect();
    json!({
        "version": 2,
        "cost_model": cost_model,
        "second_cost_model": second_preset(cost_model),
        "traces": traces,
    })
}

/// Formats bytes as GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / GIB as f64)
}

/// Wraps `text` at spaces so that no line is longer than `width` (a word
/// longer than that stands alone); ends with a newline.
pub fn wrap(text: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            out.push_str(&line);
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// `text` wrapped to [`TERMINAL_WIDTH`], its first line indented by
/// `indent` spaces and the others by `hang`; each of its own lines starts
/// a new one, keeping its own indentation (and 2 more where it wraps).
/// Ends with a newline.
pub fn wrap_hanging(text: &str, indent: usize, hang: usize) -> String {
    let mut out = String::new();
    for (n, para) in text.lines().enumerate() {
        let own = para.len() - para.trim_start().len();
        let (first, rest) = if n == 0 {
            (indent + own, hang + own + 2 * usize::from(own > 0))
        } else {
            (hang + own, hang + own + 2 * usize::from(own > 0))
        };
        let width = TERMINAL_WIDTH.saturating_sub(first.max(rest)).max(20);
        for (i, l) in wrap(para, width).lines().enumerate() {
            let pad = if i == 0 { first } else { rest };
            out.push_str(&format!("{:pad$}{l}\n", ""));
        }
    }
    out
}

/// Aligns `lines` (first: the header) in columns, the first `left` ones
/// left-aligned and the rest right-aligned, two spaces apart, with a rule
/// under the header.
/// (`--wide`'s table: as wide as its cells).
pub fn align(lines: &[Vec<String>], left: usize) -> String {
    align_within(lines, left, usize::MAX)
}

/// [`align`] for a default output: the table fits [`TERMINAL_WIDTH`]. Where
/// it would not, the first column narrows (to its header at least) and a
/// cell too long for it gets a line of its own, the row's other cells on
/// the next line.
pub fn align_fit(lines: &[Vec<String>], left: usize) -> String {
    align_within(lines, left, TERMINAL_WIDTH)
}

/// [`align`] within `width` columns (see [`align_fit`]).
fn align_within(lines: &[Vec<String>], left: usize, width: usize) -> String {
    let mut widths: Vec<usize> = (0..lines[0].len())
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let rest: usize = widths[1..].iter().map(|w| w + 2).sum();
    widths[0] = widths[0]
        .min(width.saturating_sub(rest))
        .max(lines[0][0].chars().count());
    let mut out = String::new();
    for (n, l) in lines.iter().enumerate() {
        let own_line = l[0].chars().count() > widths[0];
        if own_line {
            out.push_str(&l[0]);
            out.push('\n');
        }
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let c = if i == 0 && own_line { "" } else { c.as_str() };
                if i < left {
                    format!("{c:<w$}", w = widths[i])
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
        if n == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            out.push_str(&rule.join("  "));
            out.push('\n');
        }
    }
    out
}

/// The default table, under 100 columns: one block per trace (a heading with
/// its peak live and tight device), one row per policy, cold and steady side
/// by side in one cell (`cold / steady`).
pub fn narrow_table(rows: &[TraceRow]) -> String {
    let mut out = String::new();
    for (i, t) in rows.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&format!(
            "{} (device {}): peak live {}, tight device {}\n",
            t.name,
            t.device,
            crate::replay_cmd::format_bytes(t.peak_live),
            crate::replay_cmd::format_bytes(t.tight_capacity)
        ));
        let mut lines: Vec<Vec<String>> = vec![[
            "policy",
            "min cap GiB",
            "overhead",
            "tight",
            "calls",
            "driver ms",
            "syncs",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()];
        for p in &t.policies {
            let steady = p.tight.steady.as_ref();
            let tight = if p.fits() {
                "ok".to_string()
            } else {
                format!(
                    "no ({}/{} OOMs)",
                    p.tight.ooms,
                    steady.map_or("-".to_string(), |s| s.ooms.to_string())
                )
            };
            let pair = |cold: String, st: Option<String>| {
                format!("{cold} / {}", st.unwrap_or_else(|| "-".into()))
            };
            lines.push(vec![
                p.label().to_string(),
                p.min_capacity_cell(),
                p.overhead_cell(t.peak_live),
                tight,
                pair(
                    p.tight.memory_calls().to_string(),
                    steady.map(|s| s.memory_calls().to_string()),
                ),
                pair(p.cold_ms_cell(), p.steady_ms_cell()),
                pair(
                    p.tight.driver_calls.syncs().to_string(),
                    steady.map(|s| s.driver_calls.syncs().to_string()),
                ),
            ]);
        }
        out.push_str(&align_fit(&lines, 1));
        for note in steady_notes(t) {
            for l in wrap(&note, TERMINAL_WIDTH - 2).lines() {
                out.push_str(&format!("  {l}\n"));
            }
        }
    }
    out
}

/// One line per policy that fits the tight device yet makes more calls per
/// further pass there than on the unlimited device: the steady column's
/// cost is the lack of room (pages unmapped to make room and mapped again
/// on every pass), not the policy's steady state; printed under the trace's
/// rows, indented.
pub fn steady_notes(t: &TraceRow) -> Vec<String> {
    t.policies
        .iter()
        .filter(|p| p.fits())
        .filter_map(|p| {
            let tight = p.tight.steady.as_ref()?.memory_calls();
            let roomy = p.unlimited.steady.as_ref()?.memory_calls();
            (tight > roomy).then(|| {
                format!(
                    "{}: steady {tight} calls here, {roomy} on {} (unlimited): it unmaps to make room each pass",
                    p.label(),
                    crate::replay_cmd::format_bytes(p.unlimited.capacity)
                )
            })
        })
        .collect()
}

/// The comparison table with every column (plain text, aligned; `--wide`).
pub fn table(rows: &[TraceRow]) -> String {
    let header = [
        "trace",
        "dev",
        "peak live GiB",
        "policy",
        "min cap GiB",
        "overhead",
        "tight ok",
        "cold calls",
        "cold ms",
        "cold ms 2nd",
        "cold syncs",
        "steady calls",
        "steady ms",
        "steady syncs",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    let second = rows.first().map_or("h200", |t| t.second_cost);
    lines[0][9] = format!("cold ms {second}");
    // Growable regions (serve-kv:growable=1): the copies a policy without
    // regions made to reallocate them, shown when any policy made one.
    let copies = rows
        .iter()
        .flat_map(|t| &t.policies)
        .any(|p| p.tight.region_copies > 0);
    if copies {
        lines[0].push("copies".into());
    }
    for t in rows {
        for p in &t.policies {
            let [steady_calls, steady_ms, steady_syncs] = p.steady_cells();
            lines.push(vec![
                t.name.clone(),
                t.device.to_string(),
                gib(t.peak_live),
                p.label().to_string(),
                p.min_capacity_cell(),
                p.overhead_cell(t.peak_live),
                p.tight_ok_cell(),
                p.tight.memory_calls().to_string(),
                format!("{:.1}", p.tight.modeled_driver_us / 1000.0),
                p.cold_second_cell(),
                syncs_cell(&p.tight.driver_calls),
                steady_calls,
                steady_ms,
                steady_syncs,
            ]);
            if copies {
                let l = lines.last_mut().expect("just pushed");
                l.push(p.tight.region_copies.to_string());
            }
        }
    }
    // The first four columns (trace, device, peak, policy) left-aligned.
    align(&lines, 4)
}

/// Prints the reader's warnings about one device trace, each with its text,
/// on standard error (`warning: TRACE device D: TEXT`).
pub fn print_reader_warnings(trace: &str, dt: &DeviceTrace) {
    for w in dt.warnings() {
        eprintln!("warning: {trace} device {}: {w}", dt.device());
    }
}

/// Parses a list of policy specs, `NAME[:key=value,...]` (see
/// [`PolicySpec`]); a spec given twice is measured once.
pub fn parse_policy_specs(items: &[String]) -> Result<Vec<PolicySpec>> {
    let mut out: Vec<PolicySpec> = Vec::new();
    for item in split_policy_specs(items) {
        let spec: PolicySpec = item.parse()?;
        if !out.iter().any(|s| s.label == spec.label) {
            out.push(spec);
        }
    }
    if out.is_empty() {
        bail!("no policies given");
    }
    Ok(out)
}

/// The options that describe the simulated device, shared by `compare`,
/// `replay` (and `summary`, `snapshot`) and `advise`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Cost model: a preset (`h200`, the default: measured on an H200 on
    /// 2026-12-04; `a100`: published A100 figures; `linear`) and/or
    /// overrides, e.g. `a100`, `create=40,unmap.per_handle=20`, `a100,map=2`
    /// (µs). Any preset prices any trace, whatever GPU recorded it; reports
    /// name the preset.
    #[arg(long, value_name = "[PRESET][,KEY=US,...]")]
    pub cost: Option<String>,
    /// Cost model from a JSON file (as `vmmalloc calibrate` writes); `--cost`
    /// overrides apply on top.
    #[arg(long, value_name = "FILE")]
    pub cost_file: Option<PathBuf>,
    /// Device granularity in MiB for the simulated device.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = crate::whole_number::<u64>)]
    pub granularity_mb: u64,
}

impl SimArgs {
    /// The base replay config these options describe (cost model and
    /// granularity; the policy and the capacity are set by the caller).
    pub fn base_config(&self) -> Result<ReplayConfig> {
        let mut cfg = ReplayConfig::new(Policy::Expandable, 0);
        let (model, label) = CostModel::select(self.cost.as_deref(), self.cost_file.as_deref())?;
        cfg.cost = model;
        cfg.cost_label = label;
        cfg.granularity = crate::device_size::granularity(self.granularity_mb)?;
        Ok(cfg)
    }
}

/// What "min cap" means, as the notes under the table say it.
pub const MIN_CAP_LEGEND: &str = "min cap = the smallest device on which the policy replays the \
     trace without out-of-memory (a search to the granularity)";

/// What "calls" counts, as the notes under the table say it.
pub const CALLS_LEGEND: &str = "driver memory calls (reserve, create, map, set access, unmap, \
     release, address free, alloc, free)";

/// What the "unlimited" device of the steady notes is.
pub const UNLIMITED_LEGEND: &str = "unlimited = a device of 8 x peak live, at least 80 GiB, where \
     memory never runs short";

/// Runs `vmmalloc compare`.
pub fn run(args: CompareArgs) -> Result<()> {
    refuse_outputs_over_inputs(&args)?;
    let policies = parse_policy_specs(&args.policies)?;
    let base = args.sim.base_config()?;
    let tight = tight_capacity(&args, &base)?;
    // Where the results go, before anything runs.
    prepare_outputs(&args)?;
    let traces = load_inputs(&args.inputs)?;
    check_every_config(&traces, &policies, &base, tight)?;
    for t in &traces {
        for dt in &t.devices {
            print_reader_warnings(&t.name, dt);
        }
    }
    // Sleep and wake: rl-colocate's per-phase memory (src/sleep_table.rs).
    let sleep_section = crate::sleep_table::section(
        &traces.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
        &policies,
    )?;
    let rows = measure_all(&traces, &policies, &base, tight)?;
    let json_to_stdout = args.json.as_deref() == Some("-");
    if !json_to_stdout {
        print_tables(&args, &rows, &base, tight, &sleep_section);
    }
    if let Some(j) = &args.json {
        write_json(j, &args.inputs, &rows, &base, tight)?;
    }
    if let Some(dir) = &args.out {
        report::write(dir, &rows, &base, &sleep_section)
            .with_context(|| format!("writing the report to {}", dir.display()))?;
        if !json_to_stdout {
            println!(
                "report written to {} and {}",
                dir.join("report.md").display(),
                dir.join("report.html").display()
            );
        }
    }
    let failures = failures(&rows, args.fail_on_oom);
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// No output over an input: `--out` and `--json` refuse to overwrite one.
fn refuse_outputs_over_inputs(args: &CompareArgs) -> Result<()> {
    let input_files =
        crate::output_path::input_files(&args.inputs, &[args.sim.cost_file.as_deref()]);
    if let Some(dir) = &args.out {
        crate::output_path::refuse_inputs_in_dir("--out", dir, &input_files)?;
    }
    if let Some(j) = args.json.as_deref().filter(|j| *j != "-") {
        crate::output_path::refuse_inputs("--json", std::path::Path::new(j), &input_files)?;
    }
    Ok(())
}

/// The tight device: `--capacity`, `--tight-factor` or the default.
fn tight_capacity(args: &CompareArgs, base: &ReplayConfig) -> Result<TightCapacity> {
    Ok(match (&args.capacity, &args.tight_factor) {
        (Some(c), _) => {
            crate::device_size::parse_capacity("--capacity", c, base.granularity)?;
            TightCapacity::Fixed(crate::replay_cmd::parse_size(c)?)
        }
        (None, Some(f)) => {
            TightCapacity::Factor(crate::device_size::parse_factor("--tight-factor", f)?)
        }
        (None, None) => TightCapacity::default(),
    })
}

/// Creates (with `--mkdir`) or checks the `--out` folder and `--json` file.
fn prepare_outputs(args: &CompareArgs) -> Result<()> {
    let mkdir = args.mkdir.mkdir;
    if let Some(dir) = &args.out {
        crate::output_path::prepare_dir("--out", dir, mkdir)?;
    }
    if let Some(j) = args.json.as_deref().filter(|j| *j != "-") {
        crate::output_path::prepare_file("--json", std::path::Path::new(j), mkdir)?;
    }
    Ok(())
}

/// Every device size and every policy's options, before anything runs.
fn check_every_config(
    traces: &[Trace],
    policies: &[PolicySpec],
    base: &ReplayConfig,
    tight: TightCapacity,
) -> Result<()> {
    for t in traces {
        for dt in &t.devices {
            let cap = tight.bytes(&t.name, dt.peak_live_bytes(), base.granularity)?;
            for spec in policies {
                let mut cfg = base.clone();
                cfg.policy = spec.policy;
                cfg.options = spec.options.clone();
                cfg.capacity = cap;
                check_config(&cfg)
                    .map_err(|e| anyhow::anyhow!("--policies {}: {e}", spec.label))?;
            }
        }
    }
    Ok(())
}

/// Every policy on every device of every trace, with a progress bar shown
/// once the work takes over a second.
fn measure_all(
    traces: &[Trace],
    policies: &[PolicySpec],
    base: &ReplayConfig,
    tight: TightCapacity,
) -> Result<Vec<TraceRow>> {
    let total: u64 =
        traces.iter().map(|t| t.devices.len() as u64).sum::<u64>() * policies.len() as u64;
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}")
            .unwrap()
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let shown = std::sync::atomic::AtomicBool::new(false);
    let tick = || {
        bar.inc(1);
        if started.elapsed().as_secs_f64() > 1.0
            && !shown.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    };
    let mut rows = Vec::new();
    for t in traces {
        for dt in &t.devices {
            bar.set_message(format!("{} (device {})", t.name, dt.device()));
            rows.push(measure(&t.name, dt, policies, base, tight, &tick)?);
        }
    }
    bar.finish_and_clear();
    Ok(rows)
}

/// The table (narrow or `--wide`), its notes, the sleep section and the
/// conclusion, on stdout.
fn print_tables(
    args: &CompareArgs,
    rows: &[TraceRow],
    base: &ReplayConfig,
    tight: TightCapacity,
    sleep_section: &str,
) {
    let rule = format!(
        "{}, rounded up to the {} MiB granularity",
        tight.describe(base.granularity),
        base.granularity / MIB
    );
    let second = second_preset(&base.cost_label);
    if args.wide {
        print!("{}", table(rows));
        println!(
            "cost model: {}. {MIN_CAP_LEGEND}; overhead = min capacity / peak live; memory calls ({CALLS_LEGEND}), modeled driver time and syncs at the tight capacity \
             ({rule}): cold = first replay, steady = second replay after freeing what the first left live \
             (what every later iteration pays); cold ms {second} = the cold calls priced by the {second} preset; teardown excluded; \
             {SYNCS_LEGEND}; {UNLIMITED_LEGEND}.",
            base.cost_label,
        );
    } else {
        print!("{}", narrow_table(rows));
        println!();
        print!(
            "{}",
            wrap(
                &format!(
                    "cost model: {}. {MIN_CAP_LEGEND}; overhead = min cap / peak live. tight: the device the \
                     calls, driver ms and syncs were measured on ({rule}): ok, or no (out-of-memory errors of \
                     the cold / steady replay). calls = {CALLS_LEGEND}. cold = first replay, steady = second \
                     replay after freeing what the first left live (what every later iteration pays); teardown \
                     excluded; syncs = stream/event waits + device-wide synchronizations (cuCtxSynchronize and \
                     every cuMemFree); {UNLIMITED_LEGEND}. --wide prints every column (syncs by kind, the cold \
                     calls priced by the {second} preset).",
                    base.cost_label
                ),
                TERMINAL_WIDTH
            )
        );
    }
    print!("{sleep_section}");
    let c = crate::conclusion::conclusion(rows);
    if !c.is_empty() {
        println!();
        print!(
            "{}",
            if args.wide {
                format!("{c}\n")
            } else {
                wrap(&c, TERMINAL_WIDTH)
            }
        );
    }
}

/// The JSON document (rows and the run's metadata) to `j` (`-`: stdout).
fn write_json(
    j: &str,
    inputs: &[String],
    rows: &[TraceRow],
    base: &ReplayConfig,
    tight: TightCapacity,
) -> Result<()> {
    let mut doc = to_json(rows, &base.cost_label);
    if let Value::Object(m) = &mut doc {
        for (k, v) in metadata_json(inputs, base, tight) {
            m.insert(k, v);
        }
    }
    let text = serde_json::to_string_pretty(&doc)?;
    if j == "-" {
        println!("{text}");
    } else {
        crate::output_path::write_file(std::path::Path::new(j), (text + "\n").as_bytes())?;
    }
    Ok(())
}

/// The replays that stopped early (each also on stderr) and, with
/// `--fail-on-oom`, those with out-of-memory errors at the tight device.
fn failures(rows: &[TraceRow], fail_on_oom: bool) -> Vec<String> {
    let mut failures: Vec<String> = Vec::new();
    for t in rows {
        for p in &t.policies {
            let steady_error = |r: &ReplayResult| r.steady.as_ref().and_then(|s| s.error.clone());
            if let Some(e) = p
                .tight
                .error
                .clone()
                .or(p.unlimited.error.clone())
                .or(steady_error(&p.tight))
                .or(steady_error(&p.unlimited))
            {
                eprintln!("error: {} on {}: {e}", p.label(), t.name);
                failures.push(format!("{} on {} stopped early: {e}", p.label(), t.name));
            }
            let ooms = p.tight.ooms + p.tight.steady.as_ref().map_or(0, |st| st.ooms);
            if fail_on_oom && ooms > 0 {
                failures.push(format!(
                    "{} on {} device {}: {ooms} out-of-memory errors at {} (--fail-on-oom)",
                    p.label(),
                    t.name,
                    t.device,
                    crate::replay_cmd::format_bytes(t.tight_capacity)
                ));
            }
        }
    }
    failures
}

/// The run's metadata for the JSON document: the tool and its version, the
/// cost model (name and every value, µs), the granularity, how the tight
/// capacity was chosen, and each input (a file with its size and FNV-1a 64
/// hash, or a workload spec).
pub fn metadata_json(
    inputs: &[String],
    base: &ReplayConfig,
    tight: TightCapacity,
) -> Map<String, Value> {
    let specs: Vec<String> = if inputs.is_empty() {
        crate::input::default_inputs()
    } else {
        inputs.to_vec()
    };
    let inputs: Vec<Value> = specs
        .iter()
        .map(|s| {
            let path = resolve_input(s);
            match std::fs::read(&path) {
                Ok(bytes) => json!({
                    "input": s,
                    // The bundled snapshot by its place in the repository,
                    // not the build machine's folder.
                    "path": path
                        .strip_prefix(concat!(env!("CARGO_MANIFEST_DIR"), "/"))
                        .unwrap_or(&path),
                    "bytes": bytes.len(),
                    "fnv1a64": format!("{:016x}", fnv1a64(&bytes)),
                }),
                Err(_) => json!({"input": s, "workload": s}),
            }
        })
        .collect();
    let mut m = Map::new();
    m.insert(
        "tool".into(),
        json!({"name": "vmmalloc", "version": env!("CARGO_PKG_VERSION")}),
    );
    m.insert("cost_model_us".into(), base.cost.to_json());
    m.insert("granularity_bytes".into(), json!(base.granularity));
    m.insert("tight_capacity".into(), tight.to_json(base.granularity));
    m.insert("syncs_definition".into(), json!(SYNCS_LEGEND));
    m.insert("inputs".into(), Value::Array(inputs));
    m
}

/// FNV-1a, 64 bits: a dependency-free fingerprint of an input file (not a
/// cryptographic hash; it tells two versions of a snapshot apart).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_snapshot_is_named_by_its_place_in_the_repository() {
        let base = ReplayConfig::new(Policy::Expandable, 0);
        let m = metadata_json(
            &["cs336_lm_step".to_string(), "serve-kv".to_string()],
            &base,
            TightCapacity::default(),
        );
        let inputs = m["inputs"].as_array().unwrap();
        assert_eq!(inputs[0]["path"], "tests/fixtures/cs336_lm_step.pickle");
        assert_eq!(inputs[1]["workload"], "serve-kv");
    }
}
