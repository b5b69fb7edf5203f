//! `vmmalloc`: the command-line front end (device info, trace replay and comparison, benchmarks).

mod info;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// vmmalloc — a GPU memory allocator on the CUDA virtual-memory API, and the tools to compare it.
#[derive(Parser)]
#[command(name = "vmmalloc", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show NVIDIA devices (NVML), the CUDA driver's VMM support, and the backends that work here.
    Info(info::InfoArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Info(args) => info::run(args),
    }
}
