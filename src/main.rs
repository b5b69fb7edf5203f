//! `vmmalloc`: the command-line front end (device info, trace replay and comparison,
//! the allocator's summary table and snapshot at a point of a replay, benchmarks).

mod advise;
mod bench_cmd;
mod calibrate;
mod compare;
mod conclusion;
mod device_size;
mod html;
mod info;
mod input;
mod output_path;
mod point;
mod replay_cmd;
mod report;
mod share_cmd;
mod sleep_table;
mod snapshot_cmd;
mod summary_cmd;
mod vmm_check;
mod workloads_cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// vmmalloc — a GPU memory allocator on the CUDA virtual-memory API, and the tools to compare it.
#[derive(Parser)]
#[command(name = "vmmalloc", version, about, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show NVIDIA devices (NVML), the CUDA driver's VMM support, and the backends that work here.
    Info(info::InfoArgs),
    /// Replay traces against every policy: smallest device each needs, driver cost (the main job).
    Compare(compare::CompareArgs),
    /// Replay one trace against one policy on a simulated device and print its stats.
    Replay(replay_cmd::ReplayArgs),
    /// Replay one trace against one policy and print PyTorch's memory_summary() table at the end, peak or first OOM.
    Summary(summary_cmd::SummaryArgs),
    /// Replay one trace against one policy and write the allocator's state at the end, peak or first OOM as a PyTorch snapshot pickle.
    Snapshot(snapshot_cmd::SnapshotArgs),
    /// Which policy and which settings (PyTorch's knobs included) fit a GPU, judged by replay; ends with the line to set.
    Advise(advise::AdviseArgs),
    /// Benchmark every policy side by side: the cache-hit malloc+free pair and 1-vs-2-thread throughput.
    Bench(bench_cmd::BenchArgs),
    /// List the built-in workload generators and their parameters.
    Workloads,
    /// Measure each CUDA driver call's latency on a real GPU and write cost-model JSON.
    Calibrate(calibrate::CalibrateArgs),
    /// Reserve, create, map, set access, write/read, unmap, release on one GPU: does this environment support the VMM API?
    VmmCheck(vmm_check::VmmCheckArgs),
    /// A budget shared by the processes on one GPU (VMMALLOC_CONF=share:NAME): list its members, change their caps or its total.
    Share(share_cmd::ShareArgs),
}

/// Runs the command; a user error (bad input, a size out of range, a replay
/// that cannot finish) prints `Error: ` and its whole cause chain on one line
/// and exits with status 1, whatever `RUST_BACKTRACE` says: anyhow captures a
/// backtrace when that is set, and `main` returning `Result` would print it
/// with `{:?}`. Bugs still panic, with the standard hook's message (and a
/// backtrace when asked).
fn main() -> ExitCode {
    // Output piped into `head` ends quietly, as other command-line tools do:
    // Rust ignores SIGPIPE, which turns the closed pipe into a panic at the
    // next `println!`.
    // SAFETY: signal(2) with SIG_DFL installs no handler; it runs before any
    // thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Info(args) => info::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Replay(args) => replay_cmd::run(args),
        Command::Summary(args) => summary_cmd::run(args),
        Command::Snapshot(args) => snapshot_cmd::run(args),
        Command::Advise(args) => advise::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Workloads => workloads_cmd::run(),
        Command::Calibrate(args) => calibrate::run(args),
        Command::VmmCheck(args) => vmm_check::run(args),
        Command::Share(args) => share_cmd::run(args),
    }
}
