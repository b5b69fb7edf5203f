//! `compare --out DIR`: report.md and SVG plots.

use crate::compare::{gib, table, TraceRow};
use anyhow::Result;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;
use vmmalloc_alloc::Policy;
use vmmalloc_device::cost::CostModel;
use vmmalloc_device::GIB;
use vmmalloc_trace::replay::ReplayConfig;

/// Series styles: distinct colours (Okabe & Ito's colour-blind-safe palette,
/// black reserved for live bytes) and dash patterns (dash, gap in px; 0 =
/// solid), so that lines drawn on top of each other stay distinguishable.
const COLORS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
];
const DASHES: [(u32, u32); 6] = [(0, 0), (10, 5), (3, 4), (16, 4), (6, 8), (2, 2)];

/// Width of the legend column right of the plot area, px.
const LEGEND_W: u32 = 250;

/// The style of the `i`-th policy: colour, dash pattern and stroke width (the
/// first drawn is widest, so a later line on top of it leaves its edges
/// visible).
fn series_style(i: usize) -> (RGBColor, (u32, u32), u32) {
    (
        COLORS[i % COLORS.len()],
        DASHES[i % DASHES.len()],
        (4u32.saturating_sub(i as u32)).max(1) + 1,
    )
}

/// Draws `points` as a line in the given style (solid or dashed).
fn draw_line<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    points: Vec<(f64, f64)>,
    color: RGBColor,
    dash: (u32, u32),
    width: u32,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let style = color.stroke_width(width);
    if dash.0 == 0 {
        chart.draw_series(LineSeries::new(points, style))?;
    } else {
        chart.draw_series(DashedLineSeries::new(points, dash.0, dash.1, style))?;
    }
    Ok(())
}

/// A legend entry: a line sample (or a filled box for bars) and its text.
struct LegendEntry {
    label: String,
    color: RGBColor,
    dash: (u32, u32),
    width: u32,
    bar: bool,
}

/// Draws the legend in its own area (right of the plot, never over the data).
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[LegendEntry],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let font = ("sans-serif", 13).into_font();
    for (i, e) in entries.iter().enumerate() {
        let y = 50 + 22 * i as i32;
        if e.bar {
            area.draw(&Rectangle::new([(8, y - 6), (34, y + 6)], e.color.filled()))?;
        } else if e.dash.0 == 0 {
            area.draw(&PathElement::new(
                vec![(8, y), (34, y)],
                e.color.stroke_width(e.width),
            ))?;
        } else {
            area.draw(&DashedPathElement::new(
                vec![(8, y), (34, y)],
                e.dash.0.min(8),
                e.dash.1.min(4),
                e.color.stroke_width(e.width),
            ))?;
        }
        area.draw(&Text::new(e.label.clone(), (42, y - 7), font.clone()))?;
    }
    Ok(())
}

/// A file-name-safe version of a trace name.
pub fn slug(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The x axis of a memory plot: seconds since the first event where every
/// replayed event has a time stamp, else the op index.
fn x_of(t: &TraceRow, op: usize) -> f64 {
    match &t.op_times_s {
        Some(times) => times.get(op).or(times.last()).copied().unwrap_or(0.0),
        None => op as f64,
    }
}

/// The x-axis label of a memory plot.
pub fn x_label(t: &TraceRow) -> String {
    if t.op_times_s.is_some() {
        "time since the first recorded event (s)".to_string()
    } else {
        format!(
            "op index (allocations and frees replayed, {} in all; the trace has no time stamps)",
            t.policies
                .first()
                .and_then(|p| p.tight.timeline.last())
                .map_or(0, |s| s.op + 1)
        )
    }
}

/// Memory over time at the tight capacity: live bytes, each policy's reserved
/// bytes (distinct colour, dash and width) and the capacity; legend right of
/// the plot area.
fn plot_memory(path: &Path, t: &TraceRow) -> Result<()> {
    let root = SVGBackend::new(path, (1000 + LEGEND_W, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot_area, legend_area) = root.split_horizontally(1000);
    let max_op = t
        .policies
        .iter()
        .flat_map(|p| p.tight.timeline.last().map(|s| s.op))
        .max()
        .unwrap_or(1)
        .max(1);
    let max_x = x_of(t, max_op).max(if t.op_times_s.is_some() { 1e-6 } else { 1.0 });
    let max_y = t
        .policies
        .iter()
        .flat_map(|p| p.tight.timeline.iter().map(|s| s.reserved.max(s.live)))
        .max()
        .unwrap_or(1)
        .max(t.tight_capacity) as f64
        / GIB as f64;
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(
            format!(
                "{} (device {}): memory at a {} GiB device ({})",
                t.name,
                t.device,
                gib(t.tight_capacity),
                t.tight_rule
            ),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_x, 0f64..max_y * 1.08)?;
    chart
        .configure_mesh()
        .x_desc(x_label(t))
        .x_label_formatter(&|x| {
            if t.op_times_s.is_some() {
                // Seconds to the millisecond, without float noise.
                let s = format!("{x:.3}");
                s.trim_end_matches('0').trim_end_matches('.').to_string()
            } else {
                format!("{x:.0}")
            }
        })
        .y_desc("GiB (axis starts at 0)")
        .draw()?;
    let mut legend = Vec::new();
    let gray = RGBColor(120, 120, 120);
    draw_line(
        &mut chart,
        vec![
            (0.0, t.tight_capacity as f64 / GIB as f64),
            (max_x, t.tight_capacity as f64 / GIB as f64),
        ],
        gray,
        (4, 4),
        1,
    )?;
    legend.push(LegendEntry {
        label: format!("capacity {} GiB", gib(t.tight_capacity)),
        color: gray,
        dash: (4, 4),
        width: 1,
        bar: false,
    });
    // Live bytes first, under the policies: a dashed line that follows it
    // (native) leaves it visible between its dashes.
    if let Some(p) = t.policies.first() {
        draw_line(
            &mut chart,
            p.tight
                .timeline
                .iter()
                .map(|s| (x_of(t, s.op), s.live as f64 / GIB as f64))
                .collect(),
            BLACK,
            (0, 0),
            1,
        )?;
        legend.push(LegendEntry {
            label: "live (requested)".to_string(),
            color: BLACK,
            dash: (0, 0),
            width: 1,
            bar: false,
        });
    }
    for (i, p) in t.policies.iter().enumerate() {
        let (color, dash, width) = series_style(i);
        draw_line(
            &mut chart,
            p.tight
                .timeline
                .iter()
                .map(|s| (x_of(t, s.op), s.reserved as f64 / GIB as f64))
                .collect(),
            color,
            dash,
            width,
        )?;
        legend.push(LegendEntry {
            label: format!(
                "{} reserved{}",
                p.label(),
                if p.tight.ok { "" } else { " (OOM)" }
            ),
            color,
            dash,
            width,
            bar: false,
        });
    }
    draw_legend(&legend_area, &legend)?;
    root.present()?;
    Ok(())
}

/// The y axis of the overhead plot starts here (overhead is never below 1).
const OVERHEAD_Y0: f64 = 0.9;

fn plot_overhead(path: &Path, rows: &[TraceRow]) -> Result<()> {
    let root = SVGBackend::new(path, (1000 + LEGEND_W, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot_area, legend_area) = root.split_horizontally(1000);
    let policies: Vec<_> = rows
        .first()
        .map(|t| t.policies.iter().map(|p| p.label().to_string()).collect())
        .unwrap_or_default();
    let n_p = policies.len().max(1);
    let max_o = rows
        .iter()
        .flat_map(|t| t.policies.iter().filter_map(|p| p.overhead(t.peak_live)))
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(
            "overhead = min capacity / peak live (1.00 is perfect; no bar: never fit)",
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(
            0f64..rows.len().max(1) as f64,
            OVERHEAD_Y0..(max_o * 1.05).max(1.1),
        )?;
    let names: Vec<String> = rows
        .iter()
        .map(|t| format!("{} d{}", t.name, t.device))
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_desc("trace (device)")
        .y_desc(format!(
            "overhead (x peak live; axis starts at {OVERHEAD_Y0:.2}, not 0)"
        ))
        .draw()?;
    let mut legend = Vec::new();
    for (pi, policy) in policies.iter().enumerate() {
        let (color, _, _) = series_style(pi);
        let w = 0.8 / n_p as f64;
        chart.draw_series(rows.iter().enumerate().filter_map(|(ti, t)| {
            let o = t
                .policies
                .iter()
                .find(|p| p.label() == policy)?
                .overhead(t.peak_live)?;
            let x0 = ti as f64 + 0.1 + pi as f64 * w;
            Some(Rectangle::new(
                [(x0, OVERHEAD_Y0), (x0 + w * 0.9, o)],
                color.filled(),
            ))
        }))?;
        legend.push(LegendEntry {
            label: policy.clone(),
            color,
            dash: (0, 0),
            width: 1,
            bar: true,
        });
    }
    draw_legend(&legend_area, &legend)?;
    root.present()?;
    Ok(())
}

/// "4.14 GiB (15.6 %) less than caching (26.52 GiB)": `a` against `b`.
fn versus(a: u64, b: u64, name: &str) -> String {
    let d = a.abs_diff(b);
    if d == 0 {
        return format!("the same as {name}");
    }
    format!(
        "{} GiB ({:.1} %) {} than {name} ({} GiB)",
        gib(d),
        d as f64 * 100.0 / b as f64,
        if a < b { "less" } else { "more" },
        gib(b)
    )
}

/// Cold / steady driver ms at the tight capacity, and whether it fit.
fn cost_words(p: &crate::compare::PolicyRow) -> String {
    let steady = p.tight.steady.as_ref().map_or("-".to_string(), |s| {
        format!("{:.1}", s.modeled_driver_us / 1000.0)
    });
    let fit = if p.tight.ok {
        String::new()
    } else {
        format!(
            " (did not fit: {} out-of-memory errors, so this is the time of a failed run)",
            p.tight.ooms
        )
    };
    format!(
        "{} {:.1} / {steady} ms{fit}",
        p.label(),
        p.tight.modeled_driver_us / 1000.0
    )
}

/// What the tables show, per trace, in sentences built from the same
/// numbers: `expandable`'s smallest device against `caching` and
/// `torch-es`, the driver time of each (cold and steady), and what `native`
/// pays for its exact fit. Empty without an `expandable` row.
pub fn findings(rows: &[TraceRow]) -> String {
    let mut md = String::new();
    for t in rows {
        let pick = |p: Policy| {
            t.policies
                .iter()
                .find(|r| r.policy == p && r.spec.is_plain())
        };
        let Some(e) = pick(Policy::Expandable) else {
            continue;
        };
        let _ = write!(md, "- **{} (device {})**: ", t.name, t.device);
        let mut mem = Vec::new();
        for p in [Policy::Caching, Policy::TorchEs] {
            if let (Some(r), Some(ec)) = (pick(p), e.min_capacity) {
                match r.min_capacity {
                    Some(c) => mem.push(versus(ec, c, p.name())),
                    None => mem.push(format!("{p} found no device that fits")),
                }
            }
        }
        match e.min_capacity {
            Some(ec) => {
                let _ = write!(
                    md,
                    "expandable needs {} GiB (overhead {}){}{}. ",
                    gib(ec),
                    e.overhead_cell(t.peak_live),
                    if mem.is_empty() { "" } else { ", " },
                    mem.join(" and ")
                );
            }
            None => {
                let _ = write!(md, "expandable found no device that fits. ");
            }
        }
        let costs: Vec<String> = [Some(e), pick(Policy::Caching), pick(Policy::TorchEs)]
            .into_iter()
            .flatten()
            .map(cost_words)
            .collect();
        let _ = write!(
            md,
            "Modeled driver time at {} GiB, cold / steady (a further pass): {}.",
            gib(t.tight_capacity),
            costs.join("; ")
        );
        if let Some(n) = pick(Policy::Native) {
            let steady = |p: &crate::compare::PolicyRow| {
                p.tight
                    .steady
                    .as_ref()
                    .map(|s| s.modeled_driver_us / 1000.0)
            };
            if let (Some(ns), Some(es)) = (steady(n), steady(e)) {
                let _ = write!(
                    md,
                    " native fits in {} GiB but calls the driver for every request: {:.1} ms per further pass{}.",
                    n.min_capacity_cell(),
                    ns,
                    if es > 0.0 {
                        format!(", {:.1} × expandable's {es:.1} ms", ns / es)
                    } else {
                        String::new()
                    }
                );
            }
        }
        md.push('\n');
    }
    if md.is_empty() {
        return md;
    }
    format!("## What the results show\n\nPer trace, from the tables below (min capacity from the search; driver time at the tight capacity).\n\n{md}\n")
}

/// Modeled time of the `cuMemCreate` calls in a replay, ms.
fn create_ms(r: &vmmalloc_trace::replay::ReplayResult) -> f64 {
    r.modeled_create_us / 1000.0
}

/// `expandable` against `torch-es` per trace, with driver time split into
/// creating physical pages (the cold start, about the same for any policy
/// that maps pages) and everything else.
fn head_to_head(md: &mut String, rows: &[TraceRow]) -> Result<()> {
    let second = rows.first().map_or("h200", |t| t.second_cost);
    let pick = |t: &TraceRow, p: Policy| {
        t.policies
            .iter()
            .find(|r| r.policy == p && r.spec.is_plain())
            .cloned()
    };
    let pairs: Vec<_> = rows
        .iter()
        .filter_map(|t| Some((t, pick(t, Policy::Expandable)?, pick(t, Policy::TorchEs)?)))
        .collect();
    if pairs.is_empty() {
        return Ok(());
    }
    writeln!(md, "## expandable against torch-es at the tight capacity\n")?;
    writeln!(
        md,
        "Cold driver time split into creating physical memory (`cuMemCreate`: every policy that maps pages \
         creates about the peak once, but the cost model charges mostly per handle, so the number of handles \
         decides) and the rest (map, set access, unmap, release, reserve, syncs). ratio {second}: the same cold \
         calls priced by the `{second}` preset. A ratio is shown only where both fit.\n"
    )?;
    writeln!(md, "| trace | expandable ms (create + rest) | torch-es ms (create + rest) | ratio total | ratio rest | ratio {second} | steady ms expandable / torch-es |")?;
    writeln!(md, "|---|---:|---:|---:|---:|---:|---:|")?;
    for (t, e, s) in pairs {
        let (ec, sc) = (create_ms(&e.tight), create_ms(&s.tight));
        let (et, st) = (
            e.tight.modeled_driver_us / 1000.0,
            s.tight.modeled_driver_us / 1000.0,
        );
        let ratio = |a: f64, b: f64| {
            if e.tight.ok && s.tight.ok && b > 0.0 {
                format!("{:.2}", a / b)
            } else {
                "-".to_string()
            }
        };
        writeln!(
            md,
            "| {} (d{}) | {:.1} ({:.1} + {:.1}) | {:.1} ({:.1} + {:.1}){} | {} | {} | {} | {} |",
            t.name,
            t.device,
            et,
            ec,
            et - ec,
            st,
            sc,
            st - sc,
            if s.tight.ok { "" } else { " out of memory" },
            ratio(et, st),
            ratio(et - ec, st - sc),
            match (
                e.tight.modeled_driver_us_second,
                s.tight.modeled_driver_us_second
            ) {
                (Some(a), Some(b)) => ratio(a, b),
                _ => "-".to_string(),
            },
            match (&e.tight.steady, &s.tight.steady) {
                (Some(a), Some(b)) => format!(
                    "{:.1} / {:.1}",
                    a.modeled_driver_us / 1000.0,
                    b.modeled_driver_us / 1000.0
                ),
                _ => "-".to_string(),
            }
        )?;
    }
    writeln!(md)?;
    Ok(())
}

/// Policies measured under several option sets (e.g. `expandable`,
/// `expandable:max_chunk=2MiB`, ...): one table per policy, min capacity
/// against cold and steady driver time at the tight capacity, per trace.
/// Empty when no policy appears more than once.
pub fn ablation(rows: &[TraceRow]) -> String {
    let second = rows.first().map_or("h200", |t| t.second_cost);
    let mut md = String::new();
    let mut seen: Vec<Policy> = Vec::new();
    for t in rows {
        for p in &t.policies {
            let n = t.policies.iter().filter(|q| q.policy == p.policy).count();
            if n > 1 && !seen.contains(&p.policy) {
                seen.push(p.policy);
            }
        }
    }
    for policy in seen {
        let _ = writeln!(md, "## Ablation: {policy} options\n");
        let _ = writeln!(
            md,
            "Each row is one option set (`--policies NAME:key=value,...`). min cap and overhead from the capacity \
             search; cold / steady = modeled driver time and memory calls of the first / second replay at the \
             tight capacity (1.05 × peak live).\n"
        );
        let _ = writeln!(md, "| trace | {policy} options | min cap GiB | overhead | cold ms | cold ms {second} | cold calls | steady ms | steady calls | tight ok |");
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for t in rows {
            for p in t.policies.iter().filter(|p| p.policy == policy) {
                let [steady_calls, steady_ms, _] = p.steady_cells();
                let opts = p
                    .label()
                    .split_once(':')
                    .map_or("default".to_string(), |(_, o)| o.to_string());
                let _ = writeln!(
                    md,
                    "| {} (d{}) | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
                    t.name,
                    t.device,
                    opts,
                    p.min_capacity_cell(),
                    p.overhead_cell(t.peak_live),
                    p.tight.modeled_driver_us / 1000.0,
                    p.cold_second_cell(),
                    p.tight.memory_calls(),
                    steady_ms,
                    steady_calls,
                    p.tight_ok_cell()
                );
            }
        }
        let _ = writeln!(md);
    }
    md
}

/// The cost model in one line: each kind's fixed, per-MiB and per-handle µs.
pub fn cost_summary(cost: &CostModel) -> String {
    CostModel::KEYS
        .iter()
        .filter_map(|k| {
            let c = cost.kind(k)?;
            let mut parts = Vec::new();
            if c.fixed_us != 0.0 {
                parts.push(format!("{}", c.fixed_us));
            }
            if c.per_mib_us != 0.0 {
                parts.push(format!("{}/MiB", c.per_mib_us));
            }
            if c.per_handle_us != 0.0 {
                parts.push(format!("{}/handle", c.per_handle_us));
            }
            (!parts.is_empty()).then(|| format!("{} {}", k.replace('_', " "), parts.join(" + ")))
        })
        .collect::<Vec<_>>()
        .join(", ")
        + " µs"
}

/// Each policy's first out-of-memory error at the tight capacity (cold, then
/// steady), as the allocator explained it; nothing when every policy fit.
fn oom_explanations(md: &mut String, t: &TraceRow) -> Result<()> {
    let mut any = false;
    for p in &t.policies {
        let steady = p.tight.steady.as_ref();
        let found = match (&p.tight.oom_message, p.tight.first_oom) {
            (Some(m), Some(op)) => Some(("", op, m)),
            _ => {
                steady.and_then(|s| Some(("steady pass, ", s.first_oom?, s.oom_message.as_ref()?)))
            }
        };
        let Some((pass, op, msg)) = found else {
            continue;
        };
        if !any {
            writeln!(
                md,
                "Why each policy ran out of memory at {} GiB (its first out-of-memory error):\n",
                gib(t.tight_capacity)
            )?;
            any = true;
        }
        writeln!(md, "- **{}** ({pass}op {op}):\n\n  ```text", p.label())?;
        for line in msg.lines() {
            writeln!(md, "  {line}")?;
        }
        writeln!(md, "  ```\n")?;
    }
    if any {
        writeln!(md)?;
    }
    Ok(())
}

/// Writes `DIR/report.md`, the same as a self-contained `DIR/report.html`,
/// `DIR/overhead.svg` and one `DIR/memory-<trace>.svg` per trace.
/// `sleep_section` (from `sleep_table::section`, empty when no trace is
/// `rl-colocate`) is shown under "Sleep and wake".
pub fn write(
    dir: &Path,
    rows: &[TraceRow],
    base: &ReplayConfig,
    sleep_section: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let second = crate::compare::second_preset(&base.cost_label);
    crate::output_path::write_via_temp(&dir.join("overhead.svg"), |tmp| plot_overhead(tmp, rows))?;
    let mut md = String::new();
    writeln!(md, "# vmmalloc: allocator comparison\n")?;
    writeln!(
        md,
        "Generated by `vmmalloc compare` (do not edit by hand). Each trace is replayed on a simulated device \
         (granularity {} MiB, cost model `{}`{}: {}).\n",
        base.granularity >> 20,
        base.cost_label,
        CostModel::preset_source(&base.cost_label).map_or(String::new(), |s| format!(", {s}")),
        cost_summary(&base.cost)
    )?;
    writeln!(
        md,
        "- **peak live**: maximum of the requested bytes of live allocations (pre-trace allocations included).\n\
         - **min cap**: smallest device (bisection to the granularity) that replays the trace without out-of-memory.\n\
         - **overhead** = min cap / peak live (1.00 is perfect).\n\
         - **cold calls / cold ms / cold syncs**: memory calls (reserve, create, map, set access, unmap, release, alloc, free), \
         modeled driver time and synchronizations when replaying at the tight capacity (1.05 × peak live unless \
         `--tight-factor` or `--capacity` set it; each trace says which); {}; \
         **cold ms {second}**: the same calls priced by the `{second}` preset. \
         **steady**: the same figures for a second replay of the trace, after freeing what the first left live \
         (pre-trace allocations stay): what every later iteration of a training or serving loop pays. \
         The allocator's teardown when it is dropped at the end is not included (a process pays it once at exit; \
         PyTorch's allocators leave it to the driver).\n",
        crate::compare::SYNCS_LEGEND
    )?;
    writeln!(md, "```\n{}```\n", table(rows))?;
    md.push_str(&findings(rows));
    head_to_head(&mut md, rows)?;
    md.push_str(&ablation(rows));
    if !sleep_section.trim().is_empty() {
        writeln!(md, "## Sleep and wake\n")?;
        writeln!(md, "```\n{}\n```\n", sleep_section.trim_matches('\n'))?;
    }
    writeln!(md, "![overhead per policy](overhead.svg)\n")?;
    writeln!(md, "## Traces\n")?;
    for t in rows {
        let file = format!("memory-{}-d{}.svg", slug(&t.name), t.device);
        crate::output_path::write_via_temp(&dir.join(&file), |tmp| plot_memory(tmp, t))?;
        writeln!(md, "### {} (device {})\n", t.name, t.device)?;
        writeln!(
            md,
            "{} events, {} allocations, {} GiB live before the trace began, peak live {} GiB ({} bytes), tight capacity {} GiB ({}).\n",
            t.events,
            t.allocs,
            gib(t.pre_trace_live),
            gib(t.peak_live),
            t.peak_live,
            gib(t.tight_capacity),
            t.tight_rule
        )?;
        writeln!(md, "| policy | min cap GiB | overhead | tight ok | peak reserved (unlimited) GiB | cold calls | cold ms | cold ms {} | cold syncs | steady calls | steady ms | steady syncs | steady calls unlimited | CPU ms |", t.second_cost)?;
        writeln!(
            md,
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )?;
        for p in &t.policies {
            let [steady_calls, steady_ms, steady_syncs] = p.steady_cells();
            writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {:.1} |",
                p.label(),
                p.min_capacity_cell(),
                p.overhead_cell(t.peak_live),
                p.tight_ok_cell(),
                gib(p.unlimited.peak_reserved),
                p.tight.memory_calls(),
                p.tight.modeled_driver_us / 1000.0,
                p.cold_second_cell(),
                crate::compare::syncs_cell(&p.tight.driver_calls),
                steady_calls,
                steady_ms,
                steady_syncs,
                p.unlimited
                    .steady
                    .as_ref()
                    .map_or("-".into(), |st| st.memory_calls().to_string()),
                p.tight.cpu_time.as_secs_f64() * 1000.0,
            )?;
        }
        writeln!(md, "\n![memory over time]({file})\n")?;
        oom_explanations(&mut md, t)?;
    }
    crate::output_path::write_file(&dir.join("report.md"), md.as_bytes())?;
    crate::output_path::write_file(
        &dir.join("report.html"),
        crate::html::render("vmmalloc: allocator comparison", &md, dir).as_bytes(),
    )?;
    Ok(())
}
