//! `vmmalloc replay`: replay one input against one policy and print its stats.

use crate::compare::{base_config, gib, load_inputs};
use anyhow::{bail, Result};
use vmmalloc_alloc::PolicySpec;
use vmmalloc_device::Call;
use vmmalloc_trace::replay::{replay, ReplayConfig};

/// Arguments of `vmmalloc replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// A snapshot (.pickle), a text trace, or a workload name.
    pub input: String,
    /// The policy, optionally with options: `NAME[:key=value,...]`, e.g.
    /// `expandable:max_chunk=20MiB`.
    #[arg(long, default_value = "expandable")]
    pub policy: String,
    /// Simulated device capacity, e.g. `80GiB`, `14.5G`, `512MiB` or bytes.
    #[arg(long, default_value = "80GiB")]
    pub capacity: String,
    /// Only this device of the trace (default: all).
    #[arg(long)]
    pub device: Option<u32>,
    /// Cost model: a preset (`a100`, the default, or `linear`) and/or
    /// overrides, e.g. `linear`, `create=40,unmap.per_handle=20` (µs).
    #[arg(long, value_name = "[PRESET][,KEY=US,...]")]
    pub cost: Option<String>,
    /// Cost model from a JSON file (as `vmmalloc calibrate` writes); `--cost`
    /// overrides apply on top.
    #[arg(long, value_name = "FILE")]
    pub cost_file: Option<std::path::PathBuf>,
    /// Device granularity in MiB.
    #[arg(long, default_value_t = 2)]
    pub granularity_mb: u64,
    /// Replay the trace a second time (steady state) after freeing what the
    /// first pass left live, and print the second pass's figures too
    /// (`replay` only).
    #[arg(long)]
    pub steady: bool,
}

impl ReplayArgs {
    /// The replay configuration these options describe (policy, capacity
    /// rounded up to the granularity, cost model).
    pub fn config(&self) -> Result<ReplayConfig> {
        let spec: PolicySpec = self.policy.parse()?;
        let mut cfg = base_config(
            self.cost.as_deref(),
            self.cost_file.as_deref(),
            self.granularity_mb,
        )?;
        cfg.policy = spec.policy;
        cfg.options = spec.options;
        cfg.capacity = vmmalloc_device::round_up(parse_size(&self.capacity)?, cfg.granularity);
        Ok(cfg)
    }

    /// Whether `--device` selects trace device `device`.
    pub fn selects(&self, device: u32) -> bool {
        self.device.is_none_or(|x| x == device)
    }
}

/// Parses a size with an optional unit (B, K/KiB, M/MiB, G/GiB, T/TiB; decimal allowed).
pub fn parse_size(s: &str) -> Result<u64> {
    vmmalloc_alloc::parse_size(s).map_err(anyhow::Error::msg)
}

/// Runs `vmmalloc replay`.
pub fn run(args: ReplayArgs) -> Result<()> {
    let cfg = args.config()?;
    let policy = cfg.policy;
    let traces = load_inputs(std::slice::from_ref(&args.input))?;
    let mut any = false;
    for t in &traces {
        for dt in t.devices.iter().filter(|d| args.selects(d.device())) {
            any = true;
            let mut cfg = cfg.clone();
            cfg.steady = args.steady;
            cfg.pre_trace_ops = dt.pre_trace().len();
            let r = replay(dt.replay_ops(), &crate::point::with_frames(&cfg, dt));
            println!(
                "{} device {} — policy {} on a {} GiB simulated device",
                t.name,
                dt.device(),
                policy,
                gib(cfg.capacity)
            );
            let rows: Vec<(&str, String)> = vec![
                (
                    "result",
                    if r.ok {
                        "ok".into()
                    } else {
                        format!("{} out-of-memory errors", r.ooms)
                    },
                ),
                ("events", dt.events().len().to_string()),
                ("ops replayed", r.ops.to_string()),
                (
                    "peak live (trace)",
                    format!(
                        "{} GiB ({} bytes)",
                        gib(dt.peak_live_bytes()),
                        dt.peak_live_bytes()
                    ),
                ),
                ("peak live (replayed)", format!("{} GiB", gib(r.peak_live))),
                ("peak reserved", format!("{} GiB", gib(r.peak_reserved))),
                ("retries", r.retries.to_string()),
                ("syncs", r.syncs.to_string()),
                (
                    "modeled driver time",
                    format!("{:.3} ms", r.modeled_driver_us / 1000.0),
                ),
                (
                    "teardown (excluded)",
                    format!(
                        "{} calls, {:.3} ms when the allocator is dropped",
                        r.teardown_calls.total(),
                        r.teardown_driver_us / 1000.0
                    ),
                ),
                (
                    "replay CPU time",
                    format!("{:.3} ms", r.cpu_time.as_secs_f64() * 1000.0),
                ),
                (
                    "replay rate",
                    format!(
                        "{:.2} M ops/s",
                        r.ops as f64 / r.cpu_time.as_secs_f64().max(1e-9) / 1e6
                    ),
                ),
            ];
            for (k, v) in rows {
                println!("  {k:<22} {v}");
            }
            println!("  driver calls:");
            for c in Call::ALL {
                let n = r.driver_calls.get(c);
                if n > 0 {
                    println!("    {:<20} {n}", c.driver_symbol());
                }
            }
            if let Some(st) = &r.steady {
                println!(
                    "  steady state (2nd pass): {}, {} trace allocations freed before it, {} memory calls, {:.3} ms modeled, {} syncs",
                    if st.ok {
                        "ok".to_string()
                    } else {
                        format!("{} out-of-memory errors", st.ooms)
                    },
                    st.freed_between,
                    st.memory_calls(),
                    st.modeled_driver_us / 1000.0,
                    st.syncs
                );
                for c in Call::ALL {
                    let n = st.driver_calls.get(c);
                    if n > 0 {
                        println!("    {:<20} {n}", c.driver_symbol());
                    }
                }
                if let Some(e) = &st.error {
                    println!("  steady error: {e}");
                }
            }
            if let Some(m) = &r.oom_message {
                println!(
                    "  first out-of-memory (event {}): {m}",
                    r.first_oom.unwrap_or(0)
                );
            }
            if let Some(e) = &r.error {
                println!("  error: {e}");
            }
        }
    }
    if !any {
        bail!("no device of the input matched");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_device::{GIB, MIB};

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_size("1.5G").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_size("512MiB").unwrap(), 512 * MIB);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("0").is_err());
    }
}
