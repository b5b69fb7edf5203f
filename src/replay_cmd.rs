//! `vmmalloc replay`: replay one input against one policy and print its stats.

use crate::compare::print_reader_warnings;
use crate::input::load_inputs;
use anyhow::{bail, Result};
use vmmalloc_alloc::PolicySpec;
use vmmalloc_device::{Call, CallCounts};
use vmmalloc_trace::replay::{check_config, replay, ReplayConfig, ReplayResult, SteadyResult};
use vmmalloc_trace::DeviceTrace;

/// Arguments of `vmmalloc replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// A snapshot (.pickle), a text trace, or a workload name.
    pub input: String,
    /// The policy, optionally with options: `NAME[:key=value,...]`, e.g.
    /// `expandable:max_chunk=20MiB`.
    #[arg(long, default_value = "expandable")]
    pub policy: String,
    /// Simulated device capacity: bytes or a number with a unit, binary
    /// (`80GiB`, `14.5Gi`, `512MiB`) or decimal (`12GB` = 12 x 10^9),
    /// rounded up to a multiple of the granularity.
    #[arg(long, default_value = "80GiB", allow_hyphen_values = true)]
    pub capacity: String,
    /// Only this device of the trace (default: all).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::whole_number::<u32>)]
    pub device: Option<u32>,
    /// The simulated device: cost model and granularity.
    #[command(flatten)]
    pub sim: crate::compare::SimArgs,
    /// Exit with an error if any allocation ran out of memory (for scripts
    /// and CI); without it only a replay that cannot finish fails.
    #[arg(long)]
    pub fail_on_oom: bool,
}

/// Arguments of `vmmalloc replay` itself: the shared ones and `--steady`
/// (`summary` and `snapshot` look at one point of the first pass, so they
/// have no such option).
#[derive(clap::Args, Debug)]
pub struct ReplayCmdArgs {
    /// The input, policy and simulated device.
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// Replay the trace a second time (steady state) after freeing what the
    /// first pass left live, and print the second pass's figures too.
    #[arg(long)]
    pub steady: bool,
}

impl ReplayArgs {
    /// The replay configuration these options describe (policy, capacity
    /// rounded up to the granularity, cost model).
    ///
    /// The capacity is checked as every device size is
    /// ([`crate::device_size`]), and the policy is created once with its
    /// options on that device, so that a bad option is one error before
    /// anything runs.
    pub fn config(&self) -> Result<ReplayConfig> {
        let spec: PolicySpec = self.policy.parse()?;
        let mut cfg = self.sim.base_config()?;
        cfg.policy = spec.policy;
        cfg.options = spec.options;
        cfg.capacity =
            crate::device_size::parse_capacity("--capacity", &self.capacity, cfg.granularity)?;
        check_config(&cfg).map_err(|e| anyhow::anyhow!("--policy {}: {e}", spec.label))?;
        Ok(cfg)
    }

    /// A note saying how `--capacity` was rounded to the granularity, if it was.
    pub fn capacity_note(&self, cfg: &ReplayConfig) -> Option<String> {
        let asked = parse_size(&self.capacity).ok()?;
        (asked != cfg.capacity).then(|| {
            format!(
                "--capacity {} ({asked} bytes) rounded up to {} ({} bytes), a multiple of the {} granularity",
                self.capacity.trim(),
                format_bytes(cfg.capacity),
                cfg.capacity,
                format_bytes(cfg.granularity)
            )
        })
    }

    /// Refuses a `--device` that none of `traces` has, listing the devices
    /// they have.
    pub fn check_device(&self, traces: &[vmmalloc_trace::Trace]) -> Result<()> {
        let Some(d) = self.device else {
            return Ok(());
        };
        let mut have: Vec<u32> = traces
            .iter()
            .flat_map(|t| t.devices.iter().map(|dt| dt.device()))
            .collect();
        have.sort_unstable();
        have.dedup();
        if !have.contains(&d) {
            let list: Vec<String> = have.iter().map(|x| x.to_string()).collect();
            bail!(
                "--device {d}: the input has no device {d}; its devices: {}",
                list.join(", ")
            );
        }
        Ok(())
    }

    /// Whether `--device` selects trace device `device`.
    pub fn selects(&self, device: u32) -> bool {
        self.device.is_none_or(|x| x == device)
    }
}

/// Parses a size: bytes or a number with a binary (`KiB`..`TiB`, `Ki`..`Ti`)
/// or decimal (`kB`..`TB`) unit; see [`vmmalloc_alloc::parse_size`].
pub fn parse_size(s: &str) -> Result<u64> {
    vmmalloc_alloc::parse_size(s).map_err(anyhow::Error::msg)
}

/// The one size formatter of every message: the unit picked by size
/// (`1023 bytes`, `4.00 MiB`, `80.00 GiB`, `1.00 TiB`), as the allocator's
/// out-of-memory messages and PyTorch's own do
/// ([`vmmalloc_alloc::summary::format_bytes`]). Tables keep one unit per
/// column, named in its header.
pub use vmmalloc_alloc::summary::format_bytes;

/// Runs `vmmalloc replay`.
///
/// Exits with an error when a replay cannot finish (an error that is not
/// out-of-memory stopped it), and with `--fail-on-oom` when any allocation
/// ran out of memory; the figures are printed first either way.
pub fn run(cmd: ReplayCmdArgs) -> Result<()> {
    let (args, steady) = (cmd.replay, cmd.steady);
    let cfg = args.config()?;
    let traces = load_inputs(std::slice::from_ref(&args.input))?;
    args.check_device(&traces)?;
    let mut any = false;
    let mut failures: Vec<String> = Vec::new();
    for t in &traces {
        for dt in t.devices.iter().filter(|d| args.selects(d.device())) {
            any = true;
            print_reader_warnings(&t.name, dt);
            let mut cfg = cfg.clone();
            cfg.steady = steady;
            cfg.pre_trace_ops = dt.pre_trace().len();
            replay_device(&args, &cfg, &t.name, dt, &mut failures);
        }
    }
    if !any {
        bail!("no device of the input matched");
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// Replays device `dt` of trace `name` and prints its figures; what makes
/// the command fail goes to `failures`.
fn replay_device(
    args: &ReplayArgs,
    cfg: &ReplayConfig,
    name: &str,
    dt: &DeviceTrace,
    failures: &mut Vec<String>,
) {
    let policy = cfg.policy;
    let ops = dt.replay_ops();
    let r = replay(ops, &crate::point::with_frames(cfg, dt));
    let what = format!("{} device {}", name, dt.device());
    println!(
        "{what} — policy {} on a {} simulated device",
        policy,
        format_bytes(cfg.capacity)
    );
    if let Some(note) = args.capacity_note(cfg) {
        print!(
            "{}",
            crate::compare::wrap_hanging(&format!("note: {note}"), 2, 4)
        );
    }
    for (k, v) in figures(dt, &r, ops.len(), cfg) {
        println!("  {k:<22} {v}");
    }
    println!("  driver calls:");
    print_calls(&r.driver_calls);
    if let Some(st) = &r.steady {
        print_steady(st, &what, failures);
    }
    if let Some(m) = &r.oom_message {
        print!(
            "{}",
            crate::compare::wrap_hanging(
                &format!(
                    "first out-of-memory (event {}): {m}",
                    r.first_oom.unwrap_or(0)
                ),
                2,
                4
            )
        );
    }
    if let Some(e) = &r.error {
        print!(
            "{}",
            crate::compare::wrap_hanging(&format!("error: {e}"), 2, 4)
        );
        failures.push(format!(
            "{what}: the replay stopped after {} of {} ops: {e}",
            r.ops,
            ops.len()
        ));
    }
    let ooms = r.ooms + r.steady.as_ref().map_or(0, |st| st.ooms);
    if args.fail_on_oom && ooms > 0 {
        failures.push(format!(
            "{what}: {ooms} out-of-memory errors with policy {policy} on a {} device (--fail-on-oom)",
            format_bytes(cfg.capacity)
        ));
    }
}

/// The figures of replay `r` of `dt` (`n_ops` ops), one (name, value) a line.
fn figures(
    dt: &DeviceTrace,
    r: &ReplayResult,
    n_ops: usize,
    cfg: &ReplayConfig,
) -> Vec<(&'static str, String)> {
    let result = match (&r.error, r.ooms) {
        (Some(_), _) => format!(
            "STOPPED after {} of {} ops ({} out-of-memory errors before the stop)",
            r.ops, n_ops, r.ooms
        ),
        (None, 0) => "ok".into(),
        (None, n) => format!("{n} out-of-memory errors (failed allocations skipped)"),
    };
    vec![
        ("result", result),
        ("events", dt.events().len().to_string()),
        ("ops replayed", format!("{} of {}", r.ops, n_ops)),
        (
            "peak live (trace)",
            format!(
                "{} ({} bytes)",
                format_bytes(dt.peak_live_bytes()),
                dt.peak_live_bytes()
            ),
        ),
        ("peak live (replayed)", format_bytes(r.peak_live)),
        ("peak reserved", format_bytes(r.peak_reserved)),
        ("retries", r.retries.to_string()),
        ("syncs", r.driver_calls.syncs_cell()),
        (
            "modeled driver time",
            format!(
                "{:.3} ms (cost model {})",
                r.modeled_driver_us / 1000.0,
                cfg.cost_label
            ),
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
    ]
}

/// The driver calls made, one symbol a line (none for calls never made).
fn print_calls(calls: &CallCounts) {
    for c in Call::ALL {
        let n = calls.get(c);
        if n > 0 {
            println!("    {:<20} {n}", c.driver_symbol());
        }
    }
}

/// The steady pass's line and calls; its error goes to `failures`.
fn print_steady(st: &SteadyResult, what: &str, failures: &mut Vec<String>) {
    let line = format!(
        "steady state (2nd pass): {}, {} trace allocations freed before it, {} memory calls, {:.3} ms modeled, syncs {}",
        if st.ok {
            "ok".to_string()
        } else {
            format!("{} out-of-memory errors", st.ooms)
        },
        st.freed_between,
        st.memory_calls(),
        st.modeled_driver_us / 1000.0,
        st.driver_calls.syncs_cell()
    );
    print!("{}", crate::compare::wrap_hanging(&line, 2, 4));
    print_calls(&st.driver_calls);
    if let Some(e) = &st.error {
        print!(
            "{}",
            crate::compare::wrap_hanging(&format!("steady error: {e}"), 2, 4)
        );
        failures.push(format!("{what}: the steady pass stopped early: {e}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_device::{GIB, MIB};

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_size("1.5Gi").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_size("12GB").unwrap(), 12_000_000_000);
        assert!(parse_size("1.5G")
            .unwrap_err()
            .to_string()
            .contains("ambiguous"));
        assert_eq!(parse_size("512MiB").unwrap(), 512 * MIB);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn sizes_print_in_the_unit_their_size_picks() {
        assert_eq!(format_bytes(80 * GIB), "80.00 GiB");
        assert_eq!(format_bytes(2048 * GIB), "2.00 TiB");
        assert_eq!(format_bytes(4 * MIB), "4.00 MiB");
        assert_eq!(format_bytes(3 * GIB / 2), "1.50 GiB");
        assert_eq!(format_bytes(512 * MIB), "512.00 MiB");
        assert_eq!(format_bytes(2048 * GIB + 512 * MIB), "2.00 TiB");
        assert_eq!(format_bytes(1000), "1000 bytes");
    }
}
