//! `vmmalloc workloads`: the built-in workload generators and their parameters.

use anyhow::Result;

/// Prints each workload with its parameters.
pub fn run() -> Result<()> {
    for name in vmmalloc_trace::WORKLOADS {
        println!("{name}");
        for (key, doc) in vmmalloc_trace::workloads::workload_params(name).unwrap_or_default() {
            println!("  {key:<22} {doc}");
        }
        println!();
    }
    println!(
        "Override parameters on the command line: `vmmalloc compare train-varlen:seed=3,steps=20`."
    );
    Ok(())
}
