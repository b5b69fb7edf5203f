//! `vmmalloc share NAME`: a budget shared by the processes on one GPU
//! (docs/share.md), read and changed from outside its members: lists the
//! members (pid, used, cap, state, cached, want), sets a member's cap
//! (`--cap PID=SIZE`) or the group's total (`--total SIZE`), refusing
//! stale changes with `--revision N`.

use anyhow::{anyhow, bail, Context, Result};
use vmmalloc_alloc::share::{Group, NO_CAP};

/// Arguments of `vmmalloc share`.
#[derive(clap::Args, Debug)]
pub struct ShareArgs {
    /// The group's name (as in `VMMALLOC_CONF=share:NAME`).
    pub name: String,
    /// The device the group is on: `gpuN` (CUDA ordinal N, as the members
    /// see it), or `hostN` / `simN` for the test backends.
    #[arg(long, default_value = "gpu0")]
    pub device: String,
    /// Sets the cap of member PID to SIZE (`4GiB`, `512MiB`, bytes, or
    /// `none`); a member above its new cap gives back its cached memory
    /// and reads "deferred" until it is under. May be repeated.
    #[arg(long, value_name = "PID=SIZE")]
    pub cap: Vec<String>,
    /// Sets the group's total (refused below what the members hold).
    #[arg(long, value_name = "SIZE")]
    pub total: Option<String>,
    /// Refuses the change unless the group is still at revision N (as the
    /// listing shows it): a change made against a stale listing fails.
    #[arg(long, value_name = "N")]
    pub revision: Option<u64>,
    /// Prints the group as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A size, or `none` (no cap) where `none_ok`.
fn size(s: &str, none_ok: bool) -> Result<u64> {
    if none_ok && s.trim().eq_ignore_ascii_case("none") {
        return Ok(NO_CAP);
    }
    vmmalloc_alloc::parse_size(s).map_err(|e| anyhow!(e))
}

/// Runs `vmmalloc share`.
pub fn run(args: ShareArgs) -> Result<()> {
    let caps = args
        .cap
        .iter()
        .map(|c| {
            let (pid, sz) = c
                .split_once('=')
                .ok_or_else(|| anyhow!("--cap {c}: write PID=SIZE (e.g. --cap 4242=8GiB)"))?;
            let pid: u32 = pid
                .trim()
                .parse()
                .map_err(|_| anyhow!("--cap {c}: `{pid}` is not a process id"))?;
            let bytes = size(sz, true).with_context(|| format!("--cap {c}"))?;
            Ok((pid, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    let total = args
        .total
        .as_deref()
        .map(|t| size(t, false).with_context(|| format!("--total {t}")))
        .transpose()?;
    if args.revision.is_some() && caps.is_empty() && total.is_none() {
        bail!("--revision applies to a change: give --cap PID=SIZE or --total SIZE with it");
    }
    let g = Group::open(&args.name, &args.device)?;
    // Each change names the revision the one before left (the first the
    // one asked for), so a change by someone else in between is refused.
    let mut expect = args.revision;
    for (pid, bytes) in caps {
        let rev = g.set_cap(pid, bytes, expect)?;
        expect = expect.map(|_| rev);
    }
    if let Some(t) = total {
        g.set_total(t, expect)?;
    }
    let info = g.info()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{info}");
    }
    Ok(())
}
