//! `vmmalloc share NAME`: a budget shared by the processes on one GPU
//! (docs/share.md), read and changed from outside its members: lists the
//! members (pid, used, cap, state, cached, want), sets a member's cap
//! (`--cap PID=SIZE`) or the group's total (`--total SIZE`), refusing
//! stale changes with `--revision N`; all changes of one command apply
//! together or not at all. `--recover` removes a corrupt file once no
//! member holds it.

use anyhow::{anyhow, bail, Context, Result};
use vmmalloc_alloc::share::{check_device, check_name, Change, Group, NO_CAP};

/// Arguments of `vmmalloc share`.
#[derive(clap::Args, Debug)]
pub struct ShareArgs {
    /// The group's name (as in `VMMALLOC_CONF=share:NAME`).
    pub name: String,
    /// The device the group is on: `gpuN` (CUDA ordinal N, as the members
    /// see it), or `hostN` / `simN` for the test backends.
    #[arg(long, default_value = "gpu0")]
    pub device: String,
    /// Sets the cap of member PID to SIZE (`4GiB`, `512MiB`, bytes, `0` for
    /// nothing, or `none`); a member above its new cap gives back its cached
    /// memory and reads "deferred" until it is under. May be repeated: all
    /// apply, or none.
    #[arg(long, value_name = "PID=SIZE")]
    pub cap: Vec<String>,
    /// Sets the group's total (0 for nothing, else at least 2 MiB; refused
    /// below what the members hold and above the device's memory).
    #[arg(long, value_name = "SIZE")]
    pub total: Option<String>,
    /// Refuses the change unless the group is still at revision N (as the
    /// listing shows it): a change made against a stale listing fails.
    #[arg(long, value_name = "N")]
    pub revision: Option<u64>,
    /// Prints the group as JSON.
    #[arg(long)]
    pub json: bool,
    /// Removes the group's file when it is corrupt, of another version or
    /// not vmmalloc's, so that the next member makes it again; refused
    /// while a live member holds it.
    #[arg(long, conflicts_with_all = ["cap", "total", "revision", "json"])]
    pub recover: bool,
}

/// A size, or `none` (no cap) where `none_ok`.
fn size(s: &str, none_ok: bool) -> Result<u64> {
    if none_ok && s.trim().eq_ignore_ascii_case("none") {
        return Ok(NO_CAP);
    }
    // 0 is a size here (a cap or total that holds nothing), as in Python's
    // `share_set_cap(0)` and the C ABI; parse_size refuses it elsewhere.
    let digits = s.trim().trim_end_matches(|c: char| c.is_ascii_alphabetic());
    if !digits.is_empty() && digits.parse::<f64>() == Ok(0.0) {
        return Ok(0);
    }
    let b = vmmalloc_alloc::parse_size(s).map_err(|e| anyhow!(e))?;
    if b == NO_CAP {
        bail!("`{s}` is 2^64 - 1 bytes, the value that means no cap: write `none` for that");
    }
    Ok(b)
}

/// Runs `vmmalloc share`.
pub fn run(args: ShareArgs) -> Result<()> {
    check_name(&args.name)?;
    check_device(&args.device)?;
    if args.recover {
        println!("{}", Group::recover(&args.name, &args.device)?);
        return Ok(());
    }
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
            Ok(Change::Cap { pid, cap: bytes })
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
    let mut changes = caps;
    changes.extend(total.map(Change::Total));
    if !changes.is_empty() {
        g.apply(&changes, args.revision)?;
    }
    let info = g.info()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{info}");
    }
    Ok(())
}
