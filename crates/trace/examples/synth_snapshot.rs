//! Writes a synthetic PyTorch memory snapshot (see `vmmalloc_trace_testkit::synth`).
//!
//! `cargo run --release -p vmmalloc-trace --example synth_snapshot -- OUT.pickle [MEGABYTES] [PROTOCOL] [DEVICES]`

use std::error::Error;

use vmmalloc_trace_testkit::synth::{write_snapshot, SynthConfig};

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first() else {
        return Err("usage: synth_snapshot OUT.pickle [MEGABYTES] [PROTOCOL] [DEVICES]".into());
    };
    let mb: f64 = args.get(1).map_or(Ok(10.0), |s| s.parse())?;
    let cfg = SynthConfig {
        target_bytes: (mb * 1e6) as u64,
        protocol: args.get(2).map_or(Ok(4), |s| s.parse())?,
        devices: args.get(3).map_or(Ok(1), |s| s.parse())?,
        ..SynthConfig::default()
    };
    let f = std::fs::File::create(out)?;
    let s = write_snapshot(f, &cfg)?;
    println!("{out}: {s:?}");
    Ok(())
}
