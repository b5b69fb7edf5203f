//! `vmmalloc workloads`: the built-in workload generators and their
//! parameters, each with its default and its bounds (a value outside them
//! is refused before anything runs, naming the bound).

use crate::compare::{wrap, TERMINAL_WIDTH};
use anyhow::Result;

/// The key column's width.
const KEY: usize = 14;

/// Prints each workload with its parameters, their defaults and bounds,
/// then the built-in snapshot; every line fits [`TERMINAL_WIDTH`].
pub fn run() -> Result<()> {
    use vmmalloc_trace::workloads::{
        workload_bounds, workload_defaults, workload_params, MAX_EVENTS,
    };
    for name in vmmalloc_trace::WORKLOADS {
        println!("{name}");
        let defaults = workload_defaults(name).unwrap_or_default();
        let bounds = workload_bounds(name).unwrap_or_default();
        for (key, doc) in workload_params(name).unwrap_or_default() {
            let mut text = doc.to_string();
            let default = defaults.iter().find(|(k, _)| k == key).map(|(_, d)| d);
            let bound = bounds
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, b)| b.as_ref());
            match (default, bound) {
                (Some(d), Some(b)) => text.push_str(&format!(" (default {d}; {b})")),
                (Some(d), None) => text.push_str(&format!(" (default {d})")),
                (None, Some(b)) => text.push_str(&format!(" ({b})")),
                (None, None) => {}
            }
            let body = wrap(&text, TERMINAL_WIDTH - KEY - 3);
            for (i, line) in body.lines().enumerate() {
                let k = if i == 0 { *key } else { "" };
                println!("  {k:<KEY$} {line}");
            }
        }
        println!();
    }
    println!(
        "{}\n  the bundled PyTorch snapshot (tests/fixtures/cs336_lm_step.pickle):\n  \
         `vmmalloc replay {}`\n",
        crate::input::BUILTIN_FIXTURE_NAME,
        crate::input::BUILTIN_FIXTURE_NAME
    );
    print!(
        "{}",
        wrap(
            &format!(
                "Override parameters on the command line: `vmmalloc compare \
                 train-varlen:seed=3,steps=20`. A value outside its bounds (lo..=hi above) is refused; \
                 a generated trace holds at most {MAX_EVENTS} events, and a generator that would pass \
                 them stops and says so."
            ),
            TERMINAL_WIDTH
        )
    );
    Ok(())
}
