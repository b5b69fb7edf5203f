//! Sizes and options cannot slip past their limits (issue 36): every device
//! size goes through the one check `--capacity` has, bad input is one line
//! and a non-zero exit (never a panic, never output first), and output
//! folders are created only where the rule allows.

mod common;
use common::{bin, ok_bt, run_bt, stdout, tmpdir, user_error};

const LIMIT: &str = "larger than the simulated device can model (at most 1.00 TiB";

#[test]
fn every_device_size_goes_through_the_capacity_check() {
    let e = user_error(&["compare", "cs336_lm_step", "--tight-factor", "1000"]);
    assert!(e.contains(LIMIT) && e.contains("1000 x peak live"), "{e}");
    let e = user_error(&[
        "replay",
        "cs336_lm_step",
        "--capacity",
        "18446744073709551616",
    ]);
    assert!(e.contains(LIMIT), "{e}");
    let e = user_error(&["advise", "cs336_lm_step", "--gpu", "2TiB"]);
    assert!(e.contains(LIMIT), "{e}");
    // A text trace whose peak is above the limit: its tight device is refused.
    let dir = tmpdir("huge");
    let huge = dir.join("huge.trace");
    std::fs::write(&huge, "vmmalloc-trace 1\nalloc 1 2199023255552 0\nfree 1\n").unwrap();
    let huge = huge.to_str().unwrap();
    for cmd in ["compare", "advise"] {
        let e = user_error(&[cmd, huge]);
        assert!(
            e.contains(LIMIT) && e.contains("peak live (2.00 TiB)"),
            "{cmd}: {e}"
        );
    }
}

#[test]
fn the_granularity_is_bounded_and_never_divides_by_zero() {
    for g in ["17592186044416", "1048576", "0", "3"] {
        let e = user_error(&["replay", "cs336_lm_step", "--granularity-mb", g]);
        assert!(e.contains("power of two from 1 to 1024"), "{g}: {e}");
    }
}

#[test]
fn sizes_without_a_unit_are_whole_bytes_and_too_large_says_so() {
    let e = user_error(&["replay", "cs336_lm_step", "--capacity", "1.5"]);
    assert!(
        e.contains("whole number of bytes") && e.contains("`1.5GiB`"),
        "{e}"
    );
    let neg = user_error(&["compare", "cs336_lm_step", "--tight-factor", "-1"]);
    let size = user_error(&["compare", "cs336_lm_step", "--capacity", "-5GiB"]);
    assert!(
        neg.starts_with("Error: --tight-factor: `-1` is negative: "),
        "{neg}"
    );
    assert!(
        size.starts_with("Error: --capacity: `-5GiB` is negative: "),
        "{size}"
    );
    let e = user_error(&["compare", "cs336_lm_step", "--tight-factor", "0.5"]);
    assert!(e.contains("below 1"), "{e}");
}

#[test]
fn an_empty_trace_is_one_message_for_every_command() {
    let dir = tmpdir("empty");
    let empty = dir.join("empty.trace");
    std::fs::write(&empty, "vmmalloc-trace 1\n").unwrap();
    let empty = empty.to_str().unwrap();
    let out = dir.join("x.pickle");
    let mut seen = Vec::new();
    for args in [
        vec!["compare", empty],
        vec!["compare", empty, "--fail-on-oom"],
        vec!["replay", empty],
        vec!["summary", empty],
        vec!["advise", empty],
        vec!["snapshot", empty, "--out", out.to_str().unwrap()],
    ] {
        let e = user_error(&args);
        assert!(e.contains("no allocations to replay"), "{args:?}: {e}");
        seen.push(e);
    }
    seen.dedup();
    assert_eq!(seen.len(), 1, "{seen:?}");
}

#[test]
fn options_are_checked_before_anything_runs() {
    let args = [
        "replay",
        "cs336_lm_step",
        "--policy",
        "expandable:max_chunk=3MiB",
    ];
    let e = user_error(&args);
    assert!(
        e.contains("max_chunk") && e.matches("invalid option").count() == 1,
        "{e}"
    );
    assert_eq!(stdout(&run_bt(&args)), "", "output before the error");
    let e = user_error(&[
        "compare",
        "cs336_lm_step",
        "--policies",
        "expandable:max_chunk=3MiB",
    ]);
    assert!(e.contains("max_chunk"), "{e}");
    let e = user_error(&["replay", "cs336_lm_step", "--policy", "caching:bogus=1"]);
    assert_eq!(e.matches("invalid option").count(), 1, "{e}");
}

#[test]
fn output_folders_are_created_only_under_the_current_directory_or_with_mkdir() {
    let dir = tmpdir("outputs");
    // Outside the current directory: refused, nothing created.
    let far = dir.join("missing/x.json");
    let far_s = far.to_str().unwrap();
    let args = [
        "compare",
        "train-varlen:steps=1",
        "--policies",
        "native",
        "--json",
        far_s,
    ];
    let e = user_error(&args);
    assert!(e.contains("does not exist") && e.contains("--mkdir"), "{e}");
    assert!(!dir.join("missing").exists());
    let e = user_error(&[
        "compare",
        "cs336_lm_step",
        "--json",
        "/nonexistent-vmmalloc-36/x.json",
    ]);
    assert!(e.contains("/nonexistent-vmmalloc-36 does not exist"), "{e}");
    assert!(!std::path::Path::new("/nonexistent-vmmalloc-36").exists());
    // With --mkdir: created.
    let mut mk = args.to_vec();
    mk.push("--mkdir");
    ok_bt(&mk);
    assert!(far.is_file());
    // Under the current directory: created without asking.
    let o = bin()
        .current_dir(&dir)
        .args([
            "snapshot",
            "train-varlen:steps=1",
            "--out",
            "snaps/a/x.pickle",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::stderr(&o));
    assert!(dir.join("snaps/a/x.pickle").is_file());
    let e = user_error(&[
        "snapshot",
        "train-varlen:steps=1",
        "--out",
        "/nonexistent-vmmalloc-36/x.pickle",
    ]);
    assert!(e.contains("--mkdir"), "{e}");
}
