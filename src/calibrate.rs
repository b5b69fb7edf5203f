//! `vmmalloc calibrate`: measures the shape of each driver call's cost on a
//! real GPU, fits the cost model (`fixed + per_mib × MiB + per_handle ×
//! handles`, see `vmmalloc_device::cost`) and writes it as a cost file that
//! `--cost-file` accepts.
//!
//! What is measured (each point the median of `--iterations` timed calls
//! after a warm-up, every call through [`CudaDevice`], exactly as an allocator
//! pays for it):
//! - `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`
//!   of one handle of 2, 20, 64, 256 and 1024 MiB;
//! - `cuMemSetAccess` and `cuMemUnmap` over runs of 1, 16 and 256 2 MiB handles;
//! - `cuMemAlloc` / `cuMemFree` of 2, 20, 64, 256 and 1024 MiB;
//! - `cuMemAddressReserve` / `cuMemAddressFree`, an idle stream synchronize
//!   (`sync`) and an event query (`other`);
//! - `cuMemcpyDtoH` / `cuMemcpyHtoD` of 2, 20, 64 and 256 MiB to and from
//!   pageable host memory (`copy`, what unpinning without room and spill
//!   migration pay), and `cuMemcpyDtoD` + its wait between two handles
//!   (`copy_device`, what unpinning with room pays).
//!
//! Each kind is then fitted by least squares on relative error (so that the
//! fixed part of a small call weighs as much as the slope of a large one),
//! with every coefficient kept non-negative. The file also says which preset
//! (`a100` or `linear`) predicts the measured points better.
//! Sizes that do not fit in the device's free memory are skipped with a note.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;
use vmm_sys::version_string;
use vmmalloc_device::cost::{CallCost, CostModel};
use vmmalloc_device::cuda::{self, CudaDevice};
use vmmalloc_device::{round_up, Device, Stream, MIB};

/// Untimed rounds before measuring each point (first calls pay for lazy driver setup).
const WARMUP: usize = 3;

/// Handle sizes measured, MiB (rounded up to the granularity).
pub const HANDLE_MIB: [u64; 5] = [2, 20, 64, 256, 1024];

/// Handle counts of the multi-handle set-access / unmap runs (2 MiB handles).
pub const RUN_HANDLES: [u64; 3] = [1, 16, 256];

/// Sizes of the timed host-device copies, MiB.
pub const COPY_MIB: [u64; 4] = [2, 20, 64, 256];

/// Arguments of `vmmalloc calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Write the cost file to FILE (it is always printed too); `--cost-file FILE` reads it.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Timed calls per measured point; each point is their median (200 on a
    /// GPU; fewer only to test the pipeline).
    #[arg(
        long,
        default_value_t = 200,
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(u32).range(3..)
    )]
    pub iterations: u32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::whole_number::<u32>)]
    pub device: u32,
    /// Where output folders may be created.
    #[command(flatten)]
    pub mkdir: crate::output_path::MkdirArg,
}

/// Summary of one point's samples, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Median.
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Stats {
    /// Quantiles of `samples` (linear interpolation).
    pub fn of(samples: &[f64]) -> Stats {
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| -> f64 {
            if v.is_empty() {
                return f64::NAN;
            }
            let idx = p * (v.len() - 1) as f64;
            let (lo, hi) = (idx.floor() as usize, idx.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (idx - lo as f64)
        };
        Stats {
            median: q(0.5),
            p10: q(0.1),
            p90: q(0.9),
            min: v.first().copied().unwrap_or(f64::NAN),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// One measured point: a call kind (a key of [`CostModel::KEYS`]) at a size
/// and handle count.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// The cost kind.
    pub kind: &'static str,
    /// MiB of the call.
    pub mib: f64,
    /// Handles the call covers.
    pub handles: u64,
    /// Its samples' summary.
    pub stats: Stats,
}

impl Point {
    fn to_json(&self) -> Value {
        json!({
            "mib": self.mib,
            "handles": self.handles,
            "median": round3(self.stats.median),
            "p10": round3(self.stats.p10),
            "p90": round3(self.stats.p90),
            "min": round3(self.stats.min),
            "max": round3(self.stats.max),
        })
    }
}

/// Samples per point, in the order they were first taken.
#[derive(Default)]
struct Samples {
    keys: Vec<(&'static str, u64, u64)>,
    us: Vec<Vec<f64>>,
}

impl Samples {
    fn push(&mut self, kind: &'static str, bytes: u64, handles: u64, us: f64) {
        let key = (kind, bytes, handles);
        match self.keys.iter().position(|k| *k == key) {
            Some(i) => self.us[i].push(us),
            None => {
                self.keys.push(key);
                self.us.push(vec![us]);
            }
        }
    }

    fn points(&self) -> Vec<Point> {
        self.keys
            .iter()
            .zip(&self.us)
            .map(|(&(kind, bytes, handles), us)| Point {
                kind,
                mib: bytes as f64 / MIB as f64,
                handles,
                stats: Stats::of(us),
            })
            .collect()
    }
}

/// Times one call; records it unless warming up.
macro_rules! timed {
    ($samples:expr, $record:expr, $kind:expr, $bytes:expr, $handles:expr, $call:expr) => {{
        let t0 = Instant::now();
        let out = $call;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let out = out.with_context(|| format!("calibrating {}", $kind))?;
        if $record {
            $samples.push($kind, $bytes, $handles, us);
        }
        out
    }};
}

/// Fits `y ≈ fixed + per_mib·mib + per_handle·handles` over `points` by least
/// squares on relative error, every coefficient ≥ 0 (a coefficient that comes
/// out negative is dropped and the rest refitted). A part whose input does not
/// vary over the points is not fitted (kept 0; a constant handle count of one
/// folds into the fixed cost).
pub fn fit(points: &[&Point]) -> CallCost {
    let ys: Vec<f64> = points.iter().map(|p| p.stats.median.max(0.0)).collect();
    if points.is_empty() {
        return CallCost::default();
    }
    let varies = |f: &dyn Fn(&Point) -> f64| {
        let first = f(points[0]);
        points.iter().any(|p| (f(p) - first).abs() > 1e-9)
    };
    // Columns: 0 fixed, 1 per MiB, 2 per handle.
    let mut active = [true, varies(&|p| p.mib), varies(&|p| p.handles as f64)];
    let column = |c: usize, p: &Point| match c {
        0 => 1.0,
        1 => p.mib,
        _ => p.handles as f64,
    };
    loop {
        let cols: Vec<usize> = (0..3).filter(|&c| active[c]).collect();
        let n = cols.len();
        // Normal equations of the weighted problem, weight 1 / y².
        let mut a = vec![vec![0.0; n]; n];
        let mut b = vec![0.0; n];
        for (p, &y) in points.iter().zip(&ys) {
            let w = 1.0 / y.max(1e-3).powi(2);
            for (i, &ci) in cols.iter().enumerate() {
                let xi = column(ci, p);
                b[i] += w * xi * y;
                for (j, &cj) in cols.iter().enumerate() {
                    a[i][j] += w * xi * column(cj, p);
                }
            }
        }
        let Some(coef) = solve(a, b) else {
            // Singular (too few distinct points): drop the last varying column.
            match cols.iter().rev().find(|&&c| c != 0) {
                Some(&c) => {
                    active[c] = false;
                    continue;
                }
                None => return CallCost::flat(mean(&ys)),
            }
        };
        if let Some(k) = (0..n).find(|&k| coef[k] < 0.0) {
            if n == 1 {
                return CallCost::default();
            }
            active[cols[k]] = false;
            continue;
        }
        let mut out = CallCost::default();
        for (k, &c) in cols.iter().enumerate() {
            match c {
                0 => out.fixed_us = coef[k],
                1 => out.per_mib_us = coef[k],
                _ => out.per_handle_us = coef[k],
            }
        }
        return out;
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Solves a small linear system by Gaussian elimination with partial pivoting;
/// `None` if it is (nearly) singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for col in 0..n {
        let piv = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        let scale = a.iter().map(|r| r[col].abs()).fold(0.0, f64::max);
        if a[piv][col].abs() <= 1e-12 * scale.max(1e-300) {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        let (top, rest) = a.split_at_mut(col + 1);
        let pivot_row = &top[col];
        for (k, row) in rest.iter_mut().enumerate() {
            let f = row[col] / pivot_row[col];
            for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[col + 1 + k] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for r in (0..n).rev() {
        let s: f64 = (r + 1..n).map(|c| a[r][c] * x[c]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    Some(x)
}

/// How far a model's predictions are from the measured points: the mean of
/// |ln(predicted / measured)| (0 = exact; 0.69 = off by 2× on average).
pub fn distance(model: &CostModel, points: &[Point]) -> f64 {
    let floor = 0.01; // µs: below timer resolution
    let logs: Vec<f64> = points
        .iter()
        .map(|p| {
            let kind = model.kind(p.kind).expect("a key of KEYS");
            let predicted = kind.of((p.mib * MIB as f64) as u64, p.handles).max(floor);
            (predicted / p.stats.median.max(floor)).ln().abs()
        })
        .collect();
    mean(&logs)
}

/// Fits every kind of [`CostModel::KEYS`] from the points (kinds without
/// points keep the `a100` preset's cost and are listed in the second value).
pub fn fit_model(points: &[Point]) -> (CostModel, Vec<&'static str>) {
    let mut model = CostModel::a100();
    let mut missing = Vec::new();
    for kind in CostModel::KEYS {
        let ps: Vec<&Point> = points.iter().filter(|p| p.kind == kind).collect();
        if ps.is_empty() {
            missing.push(kind);
            continue;
        }
        let c = fit(&ps);
        for (part, v) in c.parts() {
            model
                .set(&format!("{kind}.{part}"), v)
                .expect("a fitted cost is finite and non-negative");
        }
    }
    (model, missing)
}

/// The cost file: the fitted model (`costs_us`, what `--cost-file` reads),
/// the measured points, and how close each preset comes.
pub fn cost_file(points: &[Point], meta: Map<String, Value>) -> (Value, String) {
    let (model, missing) = fit_model(points);
    let mut by_kind = Map::new();
    for kind in CostModel::KEYS {
        let v: Vec<Value> = points
            .iter()
            .filter(|p| p.kind == kind)
            .map(Point::to_json)
            .collect();
        if !v.is_empty() {
            by_kind.insert(kind.to_string(), Value::Array(v));
        }
    }
    let mut presets = Map::new();
    let mut closest = ("", f64::INFINITY);
    for name in CostModel::PRESETS {
        let d = distance(&CostModel::preset(name).expect("a preset"), points);
        presets.insert(name.to_string(), json!(round3(d)));
        if d < closest.1 {
            closest = (name, d);
        }
    }
    let mut doc = meta;
    doc.insert("format".into(), json!("vmmalloc-cost-model/2"));
    doc.insert("costs_us".into(), model.to_json());
    doc.insert(
        "fit_distance".into(),
        json!(round3(distance(&model, points))),
    );
    doc.insert("preset_distance".into(), Value::Object(presets));
    doc.insert("closer_preset".into(), json!(closest.0));
    doc.insert("not_measured".into(), json!(missing));
    doc.insert("points_us".into(), Value::Object(by_kind));
    (Value::Object(doc), closest.0.to_string())
}

/// Runs `vmmalloc calibrate`.
pub fn run(args: CalibrateArgs) -> Result<()> {
    if let Some(path) = &args.json {
        crate::output_path::prepare_file("--json", path, args.mkdir.mkdir)?;
    }
    let dev = CudaDevice::open(args.device)
        .map_err(|e| anyhow::anyhow!("calibrate needs an NVIDIA GPU with the CUDA driver: {e}"))?;
    let driver_version = cuda::driver_version().ok();
    let caps = dev.caps().clone();
    eprintln!(
        "calibrating {} (device {}, granularity {} KiB): {} timed calls per point",
        caps.name,
        caps.ordinal,
        caps.granularity / 1024,
        args.iterations
    );
    let points = measure(&dev, args.iterations as usize)?;
    print_table(&points);
    let mut meta = Map::new();
    meta.insert("device".into(), json!(caps.name));
    meta.insert("ordinal".into(), json!(caps.ordinal));
    meta.insert("driver_version".into(), json!(driver_version));
    meta.insert(
        "driver_version_string".into(),
        json!(driver_version.map(version_string)),
    );
    meta.insert("granularity".into(), json!(caps.granularity));
    meta.insert("total_memory".into(), json!(caps.total_memory));
    meta.insert("iterations".into(), json!(args.iterations));
    let (doc, closer) = cost_file(&points, meta);
    let text = serde_json::to_string_pretty(&doc)?;
    println!("{text}");
    eprint!(
        "{}",
        crate::compare::wrap_hanging(
            &format!(
                "closest preset: {closer} (mean |ln(predicted / measured)| per preset: {}; the \
                 fit: {})",
                doc["preset_distance"], doc["fit_distance"]
            ),
            0,
            2
        )
    );
    if let Some(path) = &args.json {
        crate::output_path::write_file(path, format!("{text}\n").as_bytes())?;
        eprint!(
            "{}",
            crate::compare::wrap_hanging(
                &format!(
                    "wrote {} (use it with --cost-file {})",
                    path.display(),
                    path.display()
                ),
                0,
                2
            )
        );
    }
    Ok(())
}

/// The measurement loops.
fn measure(dev: &CudaDevice, iterations: usize) -> Result<Vec<Point>> {
    let g = dev.caps().granularity;
    let page = round_up(2 * MIB, g);
    let mut s = Samples::default();
    let stream = dev.create_stream()?;
    let event = dev.create_event()?;
    dev.record_event(event, stream)?;
    dev.synchronize_stream(stream)?;
    let rounds = WARMUP + iterations;

    // Fixed-cost calls: reserve / address free, syncs, an event query.
    for round in 0..rounds {
        let rec = round >= WARMUP;
        let addr = timed!(s, rec, "reserve", page, 0, dev.reserve(page, 0));
        timed!(
            s,
            rec,
            "address_free",
            page,
            0,
            dev.free_reservation(addr, page)
        );
        timed!(s, rec, "sync", 0, 0, dev.synchronize_stream(stream));
        timed!(s, rec, "other", 0, 0, dev.query_event(event));
    }

    // One handle of each size: create, map, set access, unmap, release; then
    // cuMemAlloc / cuMemFree of the same size.
    for mib in HANDLE_MIB {
        let size = round_up(mib * MIB, g);
        if dev.mem_info()?.free < size + page {
            eprintln!("note: skipping {mib} MiB handles: not enough free device memory");
            continue;
        }
        let va = dev.reserve(size, 0)?;
        for round in 0..rounds {
            let rec = round >= WARMUP;
            let h = timed!(s, rec, "create", size, 1, dev.create(size));
            timed!(s, rec, "map", size, 1, dev.map(va, size, h));
            timed!(s, rec, "set_access", size, 1, dev.set_access(va, size));
            timed!(s, rec, "unmap", size, 1, dev.unmap(va, size));
            timed!(s, rec, "release", size, 1, dev.release(h));
            let p = timed!(s, rec, "alloc", size, 1, dev.alloc(size));
            timed!(s, rec, "free", size, 1, dev.free(p));
        }
        dev.free_reservation(va, size)?;
    }

    // Runs of 2 MiB handles: one set access / unmap over 1, 16, 256 of them.
    for n in RUN_HANDLES {
        let len = n * page;
        if dev.mem_info()?.free < len + page {
            eprintln!("note: skipping the run of {n} handles: not enough free device memory");
            continue;
        }
        let va = dev.reserve(len, 0)?;
        let hs = (0..n)
            .map(|_| dev.create(page))
            .collect::<Result<Vec<_>, _>>()?;
        // Fewer rounds for long runs: each maps n handles untimed.
        let rounds = WARMUP + (iterations / (n as usize / 16).max(1)).max(3);
        for round in 0..rounds {
            let rec = round >= WARMUP;
            for (i, h) in hs.iter().enumerate() {
                dev.map(va + i as u64 * page, page, *h)?;
            }
            timed!(s, rec, "set_access", len, n, dev.set_access(va, len));
            timed!(s, rec, "unmap", len, n, dev.unmap(va, len));
        }
        for h in hs {
            dev.release(h)?;
        }
        dev.free_reservation(va, len)?;
    }
    // Copies between device memory and pageable host memory, each way, and
    // between two handles on the device (what unpinning and spill migration
    // use).
    for mib in COPY_MIB {
        let size = round_up(mib * MIB, g);
        if dev.mem_info()?.free < 2 * size + page {
            eprintln!("note: skipping {mib} MiB copies: not enough free device memory");
            continue;
        }
        let mut buf = vec![0u8; size as usize];
        let va = dev.reserve(2 * size, 0)?;
        let h = dev.create(size)?;
        dev.map(va, size, h)?;
        let h2 = dev.create(size)?;
        dev.map(va + size, size, h2)?;
        dev.set_access(va, 2 * size)?;
        // Fewer rounds for large copies (each 256 MiB one takes ~10 ms).
        let rounds = WARMUP + (iterations / (mib as usize / 16).max(1)).max(3);
        for round in 0..rounds {
            let rec = round >= WARMUP;
            timed!(s, rec, "copy", size, 0, dev.copy_from_device(va, &mut buf));
            timed!(s, rec, "copy", size, 0, dev.copy_to_device(va, &buf));
            timed!(
                s,
                rec,
                "copy_device",
                size,
                0,
                dev.copy_device(va + size, va, size)
            );
        }
        dev.unmap(va, 2 * size)?;
        dev.release(h)?;
        dev.release(h2)?;
        dev.free_reservation(va, 2 * size)?;
    }
    dev.destroy_event(event)?;
    dev.synchronize_stream(Stream::DEFAULT)?;
    let points = s.points();
    if points.is_empty() {
        bail!("nothing was measured");
    }
    Ok(points)
}

fn print_table(points: &[Point]) {
    eprintln!(
        "{:<14} {:>8} {:>8} {:>10} {:>10} {:>10}",
        "call (µs)", "MiB", "handles", "median", "p10", "p90"
    );
    for p in points {
        eprintln!(
            "{:<14} {:>8} {:>8} {:>10.2} {:>10.2} {:>10.2}",
            p.kind, p.mib, p.handles, p.stats.median, p.stats.p10, p.stats.p90
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(kind: &'static str, mib: f64, handles: u64, us: f64) -> Point {
        Point {
            kind,
            mib,
            handles,
            stats: Stats::of(&[us]),
        }
    }

    #[test]
    fn stats_are_quantiles() {
        let v: Vec<f64> = (1..=101).map(f64::from).collect();
        let s = Stats::of(&v);
        assert_eq!(s.median, 51.0);
        assert_eq!(s.p10, 11.0);
        assert_eq!(s.p90, 91.0);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 101.0);
        assert_eq!(Stats::of(&[4.0, 1.0, 3.0, 2.0]).median, 2.5);
    }

    #[test]
    fn fit_recovers_fixed_per_mib_and_per_handle() {
        // Unmap: 3 + 0.5/MiB + 20/handle, single handles of each size and runs.
        let truth = |mib: f64, h: u64| 3.0 + 0.5 * mib + 20.0 * h as f64;
        let mut ps: Vec<Point> = HANDLE_MIB
            .iter()
            .map(|&m| point("unmap", m as f64, 1, truth(m as f64, 1)))
            .collect();
        ps.extend(
            RUN_HANDLES
                .iter()
                .map(|&n| point("unmap", 2.0 * n as f64, n, truth(2.0 * n as f64, n))),
        );
        let refs: Vec<&Point> = ps.iter().collect();
        let c = fit(&refs);
        assert!((c.fixed_us - 3.0).abs() < 1e-6, "{c:?}");
        assert!((c.per_mib_us - 0.5).abs() < 1e-6, "{c:?}");
        assert!((c.per_handle_us - 20.0).abs() < 1e-6, "{c:?}");
    }

    #[test]
    fn fit_folds_one_handle_into_the_fixed_cost_and_keeps_parts_non_negative() {
        // create: one handle each, 193 + 0.7/MiB.
        let ps: Vec<Point> = HANDLE_MIB
            .iter()
            .map(|&m| point("create", m as f64, 1, 193.0 + 0.7 * m as f64))
            .collect();
        let c = fit(&ps.iter().collect::<Vec<_>>());
        assert!((c.fixed_us - 193.0).abs() < 1e-6 && (c.per_mib_us - 0.7).abs() < 1e-9);
        assert_eq!(c.per_handle_us, 0.0);
        // Cost falling with size: the slope would be negative, so it is dropped.
        let ps: Vec<Point> = [(2.0, 10.0), (20.0, 9.0), (64.0, 8.0)]
            .iter()
            .map(|&(m, us)| point("map", m, 1, us))
            .collect();
        let c = fit(&ps.iter().collect::<Vec<_>>());
        assert_eq!(c.per_mib_us, 0.0);
        assert!(c.fixed_us > 8.0 && c.fixed_us < 10.0, "{c:?}");
        // A single point: its value as the fixed cost.
        let one = [point("sync", 0.0, 0, 50.0)];
        assert!((fit(&[&one[0]]).fixed_us - 50.0).abs() < 1e-9);
    }

    /// The H200 calibration of 2026-12-04 (tests/fixtures): its measured
    /// points are closest to the `h200` preset, which was taken from them.
    #[test]
    fn the_h200_calibration_is_closest_to_the_h200_preset() {
        let text = include_str!("../tests/fixtures/h200-calibration-2026-12-04.json");
        let doc: Value = serde_json::from_str(text).unwrap();
        let mut ps = Vec::new();
        for kind in CostModel::KEYS {
            for p in doc["points_us"][kind].as_array().into_iter().flatten() {
                ps.push(point(
                    kind,
                    p["mib"].as_f64().unwrap(),
                    p["handles"].as_u64().unwrap(),
                    p["median"].as_f64().unwrap(),
                ));
            }
        }
        assert!(ps.len() > 40, "{} points", ps.len());
        let (out, closest) = cost_file(&ps, Map::new());
        assert_eq!(closest, "h200", "{}", out["preset_distance"]);
        let d = &out["preset_distance"];
        assert!(d["h200"].as_f64().unwrap() < 0.15, "{d}");
        assert!(d["a100"].as_f64().unwrap() > 1.0, "{d}");
    }

    #[test]
    fn the_cost_file_reads_back_and_names_the_closer_preset() {
        // Points generated by the a100 preset itself: a100 is closer, and the
        // fit reproduces it.
        let a100 = CostModel::a100();
        let mut ps = Vec::new();
        for kind in CostModel::KEYS {
            let c = *a100.kind(kind).unwrap();
            for &m in &HANDLE_MIB {
                ps.push(point(kind, m as f64, 1, c.of(m * MIB, 1)));
            }
            if kind == "unmap" || kind == "set_access" {
                for &n in &RUN_HANDLES[1..] {
                    ps.push(point(kind, 2.0 * n as f64, n, c.of(2 * n * MIB, n)));
                }
            }
        }
        let (doc, closer) = cost_file(&ps, Map::new());
        assert_eq!(closer, "a100");
        assert_eq!(doc["closer_preset"], "a100");
        let back = CostModel::from_json(&doc.to_string(), "calibration.json").unwrap();
        for kind in CostModel::KEYS {
            let (got, want) = (back.kind(kind).unwrap(), a100.kind(kind).unwrap());
            for &m in &HANDLE_MIB {
                let (g, w) = (got.of(m * MIB, 1), want.of(m * MIB, 1));
                assert!(
                    (g - w).abs() <= 1e-6 * w.max(1.0),
                    "{kind} {m} MiB: {g} vs {w}"
                );
            }
        }
        assert!(doc["fit_distance"].as_f64().unwrap() < 1e-3);
        assert!(doc["preset_distance"]["linear"].as_f64().unwrap() > 0.1);
        // Linear-shaped points: linear is closer.
        let linear = CostModel::linear();
        let ps: Vec<Point> = HANDLE_MIB
            .iter()
            .map(|&m| point("create", m as f64, 1, linear.create.of(m * MIB, 1)))
            .collect();
        assert_eq!(cost_file(&ps, Map::new()).1, "linear");
    }
}
