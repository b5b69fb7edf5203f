//! `vmmalloc workloads`: the built-in workload generators and their parameters.

use anyhow::Result;

/// Prints each workload with its parameters and their defaults, then the
/// built-in snapshot.
pub fn run() -> Result<()> {
    for name in vmmalloc_trace::WORKLOADS {
        println!("{name}");
        let defaults = vmmalloc_trace::workloads::workload_defaults(name).unwrap_or_default();
        for (key, doc) in vmmalloc_trace::workloads::workload_params(name).unwrap_or_default() {
            match defaults.iter().find(|(k, _)| k == key) {
                Some((_, d)) => println!("  {key:<22} {doc} (default {d})"),
                None => println!("  {key:<22} {doc}"),
            }
        }
        println!();
    }
    println!(
        "{}\n  the bundled PyTorch snapshot (tests/fixtures/cs336_lm_step.pickle): `vmmalloc replay {}`\n",
        crate::input::BUILTIN_FIXTURE_NAME,
        crate::input::BUILTIN_FIXTURE_NAME
    );
    println!(
        "Override parameters on the command line: `vmmalloc compare train-varlen:seed=3,steps=20`."
    );
    Ok(())
}
