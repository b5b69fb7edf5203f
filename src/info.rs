//! `vmmalloc info` (placeholder until the foundation lands).

use anyhow::Result;

/// Arguments of `vmmalloc info`.
#[derive(clap::Args)]
pub struct InfoArgs {}

/// Runs `vmmalloc info`.
pub fn run(_args: InfoArgs) -> Result<()> {
    println!("vmmalloc info: not yet implemented");
    Ok(())
}
