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
    Replay(replay_cmd::ReplayCmdArgs),
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
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return command_line_error(e),
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A command line clap refuses: help and version as clap prints them, any
/// other error as one line (`Error: ` and clap's message with its tip, no
/// usage block), exit status 2 as clap's own.
fn command_line_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    eprintln!("Error: {}", one_line(&e.render().to_string()));
    ExitCode::from(2)
}

/// clap's rendered error as one line: its message and tips, without the
/// `error: ` prefix, the usage block and the pointer to `--help` (the line
/// ends saying `--help` lists the options).
fn one_line(rendered: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut usage = false;
    for l in rendered.lines().map(str::trim) {
        if l.is_empty() {
            usage = false;
            continue;
        }
        if l.starts_with("Usage:") {
            usage = true;
            continue;
        }
        // clap's tip to write `-- -1` or `-- --flag` is wrong here: no
        // command takes such a value.
        if usage || l.starts_with("For more information") || l.contains("use '-- ") {
            continue;
        }
        let l = l.strip_prefix("error: ").unwrap_or(l);
        match parts.last_mut() {
            Some(last) if last.ends_with(':') => {
                last.push(' ');
                last.push_str(l);
            }
            _ => parts.push(l.to_string()),
        }
    }
    format!("{} (--help lists the options)", parts.join("; "))
}

/// Parses a whole number option (a count or a device ordinal): negative
/// values are taken from the command line (not read as options) and
/// refused here, saying so, rather than with clap's tip to write `-- -1`.
pub fn whole_number<T>(s: &str) -> std::result::Result<T, String>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("`{t}` is negative: it must be 0 or more"));
    }
    t.replace('_', "")
        .parse::<T>()
        .map_err(|e| format!("`{t}` is not a whole number in range ({e})"))
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
