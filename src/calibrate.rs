//! `vmmalloc calibrate`: measures the latency of each driver call on a real GPU
//! and writes it as cost-model JSON (keys of [`CostModel::KEYS`]).
//!
//! Every call goes through [`CudaDevice`], exactly as an allocator pays for it
//! (context binding and handle bookkeeping included). Each cost is the median
//! of `--iterations` timed calls after a short warm-up; the JSON also carries
//! p10/p90/min/max per call and a few extra measurements (a 20 MiB create, one
//! `cuMemSetAccess` over 16 pages) that check the cost model's shape.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::path::PathBuf;
use std::time::Instant;
use vmm_sys::version_string;
use vmmalloc_device::cost::CostModel;
use vmmalloc_device::cuda::{self, CudaDevice};
use vmmalloc_device::{round_up, Device, Stream, MIB};

/// Untimed rounds before measuring (first calls pay for lazy driver setup).
const WARMUP: usize = 10;

/// Arguments of `vmmalloc calibrate`.
#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Write the calibration JSON to FILE (it is always printed too).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Timed calls per kind; each cost is their median (at least 100).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(100..))]
    pub iterations: u32,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: u32,
}

/// Summary of one call's samples, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stats {
    median: f64,
    p10: f64,
    p90: f64,
    min: f64,
    max: f64,
}

impl Stats {
    fn of(samples: &[f64]) -> Stats {
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

    fn to_json(self) -> Value {
        json!({
            "median": round3(self.median),
            "p10": round3(self.p10),
            "p90": round3(self.p90),
            "min": round3(self.min),
            "max": round3(self.max),
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Samples per measured call, in the order they are reported.
#[derive(Default)]
struct Samples {
    order: Vec<&'static str>,
    us: Vec<Vec<f64>>,
}

impl Samples {
    fn push(&mut self, name: &'static str, us: f64) {
        match self.order.iter().position(|n| *n == name) {
            Some(i) => self.us[i].push(us),
            None => {
                self.order.push(name);
                self.us.push(vec![us]);
            }
        }
    }

    fn stats(&self, name: &str) -> Option<Stats> {
        let i = self.order.iter().position(|n| *n == name)?;
        Some(Stats::of(&self.us[i]))
    }
}

/// Times one call; records it unless warming up.
macro_rules! timed {
    ($samples:expr, $record:expr, $name:expr, $call:expr) => {{
        let t0 = Instant::now();
        let out = $call;
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let out = out.with_context(|| format!("calibrating {}", $name))?;
        if $record {
            $samples.push($name, us);
        }
        out
    }};
}

/// Runs `vmmalloc calibrate`.
pub fn run(args: CalibrateArgs) -> Result<()> {
    let dev = CudaDevice::open(args.device)
        .map_err(|e| anyhow::anyhow!("calibrate needs an NVIDIA GPU with the CUDA driver: {e}"))?;
    let driver_version = cuda::driver_version().ok();
    let caps = dev.caps().clone();
    eprintln!(
        "calibrating {} (device {}, granularity {} KiB): {} timed calls per kind",
        caps.name,
        caps.ordinal,
        caps.granularity / 1024,
        args.iterations
    );
    let samples = measure(&dev, args.iterations as usize)?;

    let page = round_up(2 * MIB, caps.granularity);
    // The model charges `create` per 2 MiB; normalize if the page differs.
    let per_2mib = (2 * MIB) as f64 / page as f64;
    let mut model = CostModel::default();
    let mut costs = Map::new();
    let mut stats = Map::new();
    for key in CostModel::KEYS {
        let Some(s) = samples.stats(key) else {
            eprintln!("note: no measurement for cost key `{key}`; keeping its default");
            continue;
        };
        let median = if key == "create" {
            s.median * per_2mib
        } else {
            s.median
        };
        model
            .set(key, median)
            .map_err(|e| anyhow::anyhow!("measured cost for `{key}`: {e}"))?;
        costs.insert(key.to_owned(), json!(round3(median)));
        stats.insert(key.to_owned(), s.to_json());
    }
    let mut extra = Map::new();
    for name in samples
        .order
        .iter()
        .filter(|n| !CostModel::KEYS.contains(n))
    {
        if let Some(s) = samples.stats(name) {
            extra.insert((*name).to_owned(), s.to_json());
        }
    }
    let overrides = costs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let out = json!({
        "device": caps.name,
        "ordinal": caps.ordinal,
        "driver_version": driver_version,
        "driver_version_string": driver_version.map(version_string),
        "granularity": caps.granularity,
        "total_memory": caps.total_memory,
        "iterations": args.iterations,
        "costs_us": costs,
        "stats_us": stats,
        "extra_us": extra,
        "cost_overrides": overrides,
    });

    print_table(&samples);
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(path) = &args.json {
        std::fs::write(path, format!("{text}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The measurement loop: one full VMM cycle per round, each call timed.
fn measure(dev: &CudaDevice, iterations: usize) -> Result<Samples> {
    let g = dev.caps().granularity;
    let page = round_up(2 * MIB, g);
    let big = round_up(20 * MIB, g);
    let run_pages = 16u64;
    if dev.mem_info()?.free < (run_pages + 12) * page + big {
        bail!("not enough free device memory to calibrate");
    }
    let stream = dev.create_stream()?;
    let event = dev.create_event()?;
    dev.record_event(event, stream)?;
    dev.synchronize_stream(stream)?;
    // A standing reservation for the multi-page measurements.
    let arena = dev.reserve(run_pages * page, 0)?;
    let mut s = Samples::default();

    for round in 0..WARMUP + iterations {
        let rec = round >= WARMUP;
        // The core cycle, in the order an allocator makes the calls.
        let addr = timed!(s, rec, "reserve", dev.reserve(page, 0));
        let h = timed!(s, rec, "create", dev.create(page));
        timed!(s, rec, "map", dev.map(addr, page, h));
        timed!(s, rec, "set_access", dev.set_access(addr, page));
        timed!(s, rec, "unmap", dev.unmap(addr, page));
        timed!(s, rec, "release", dev.release(h));
        timed!(s, rec, "address_free", dev.free_reservation(addr, page));
        // Plain allocation (the native baseline).
        let p = timed!(s, rec, "alloc", dev.alloc(page));
        timed!(s, rec, "free", dev.free(p));
        // Synchronizing an idle stream: the floor of any sync.
        timed!(s, rec, "sync", dev.synchronize_stream(stream));
        // Cheap bookkeeping calls (`other`): an event query.
        timed!(s, rec, "other", dev.query_event(event));
        timed!(s, rec, "event_record", dev.record_event(event, stream));
        timed!(s, rec, "device_sync", dev.synchronize());
        timed!(s, rec, "mem_info", dev.mem_info());
        // A 20 MiB handle (PyTorch's large-pool page): is create linear in size?
        let hb = timed!(s, rec, "create_20mib", dev.create(big));
        timed!(s, rec, "release_20mib", dev.release(hb));
        // One set_access / unmap over a run of 16 pages vs one page each.
        let hs = (0..run_pages)
            .map(|_| dev.create(page))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, h) in hs.iter().enumerate() {
            dev.map(arena + i as u64 * page, page, *h)?;
        }
        timed!(
            s,
            rec,
            "set_access_16_pages",
            dev.set_access(arena, run_pages * page)
        );
        timed!(s, rec, "unmap_16_pages", dev.unmap(arena, run_pages * page));
        for h in hs {
            dev.release(h)?;
        }
    }
    dev.free_reservation(arena, run_pages * page)?;
    dev.destroy_event(event)?;
    dev.synchronize_stream(Stream::DEFAULT)?;
    Ok(s)
}

fn print_table(s: &Samples) {
    eprintln!(
        "{:<22} {:>10} {:>10} {:>10} {:>10}",
        "call (µs)", "median", "p10", "p90", "min"
    );
    for name in &s.order {
        if let Some(st) = s.stats(name) {
            eprintln!(
                "{:<22} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                name, st.median, st.p10, st.p90, st.min
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn samples_keep_order() {
        let mut s = Samples::default();
        s.push("b", 1.0);
        s.push("a", 2.0);
        s.push("b", 3.0);
        assert_eq!(s.order, ["b", "a"]);
        assert_eq!(s.stats("b").unwrap().median, 2.0);
        assert!(s.stats("c").is_none());
    }

    #[test]
    fn every_cost_key_is_measured() {
        // The loop in `measure` records these names; keep them in step with the model.
        let measured = [
            "reserve",
            "address_free",
            "create",
            "map",
            "set_access",
            "unmap",
            "release",
            "alloc",
            "free",
            "sync",
            "other",
        ];
        for key in CostModel::KEYS {
            assert!(measured.contains(&key), "cost key `{key}` is not measured");
        }
    }
}
