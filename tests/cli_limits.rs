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

#[test]
fn no_command_writes_over_one_of_its_inputs() {
    let dir = tmpdir("over-input");
    let snap = dir.join("victim.pickle");
    let s = snap.to_str().unwrap();
    ok_bt(&["snapshot", "train-varlen:steps=1", "--out", s]);
    let before = std::fs::read(&snap).unwrap();
    std::os::unix::fs::symlink(&snap, dir.join("link.pickle")).unwrap();
    std::fs::hard_link(&snap, dir.join("hard.pickle")).unwrap();
    let cost = dir.join("cost.json");
    std::fs::write(&cost, "{\"costs_us\": {}}").unwrap();
    let c = cost.to_str().unwrap();
    let (link, hard) = (dir.join("link.pickle"), dir.join("hard.pickle"));
    let (l, h) = (link.to_str().unwrap(), hard.to_str().unwrap());
    // Every command that writes a file, each way of naming an input.
    let cases: Vec<Vec<&str>> = vec![
        vec!["snapshot", s, "--out", s],
        vec!["snapshot", s, "--out", l],
        vec!["snapshot", s, "--out", h],
        vec![
            "snapshot",
            "train-varlen:steps=1",
            "--cost-file",
            c,
            "--out",
            c,
        ],
        vec!["compare", s, "--policies", "native", "--json", s],
        vec!["compare", s, "--policies", "native", "--json", h],
        vec![
            "compare",
            "train-varlen:steps=1",
            "--cost-file",
            c,
            "--json",
            c,
        ],
    ];
    for args in &cases {
        let e = user_error(args);
        assert!(e.contains("one of this command's inputs"), "{args:?}: {e}");
        assert_eq!(std::fs::read(&snap).unwrap(), before, "{args:?}");
    }
    assert_eq!(std::fs::read(&cost).unwrap(), b"{\"costs_us\": {}}");
    // compare --out DIR: the report's files are checked too.
    let report = dir.join("report.md");
    std::fs::write(&report, "alloc 0 1 0x0 4096\n").unwrap();
    let args = [
        "compare",
        report.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ];
    let e = user_error(&args);
    assert!(
        e.contains("report.md") && e.contains("another folder"),
        "{e}"
    );
    assert_eq!(std::fs::read(&report).unwrap(), b"alloc 0 1 0x0 4096\n");
    // An output that replaces a file is renamed into place: the file's other
    // name (a hard link that is no input) keeps its bytes.
    let out = dir.join("out.pickle");
    std::fs::write(&out, "old").unwrap();
    std::fs::hard_link(&out, dir.join("out-too.pickle")).unwrap();
    ok_bt(&[
        "snapshot",
        "train-varlen:steps=1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(std::fs::read(dir.join("out-too.pickle")).unwrap(), b"old");
    assert_ne!(std::fs::read(&out).unwrap(), b"old");
    let json = dir.join("out.json");
    ok_bt(&[
        "compare",
        "train-varlen:steps=1",
        "--policies",
        "native",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(std::fs::read_to_string(&json).unwrap().starts_with('{'));
    let left: Vec<_> = std::fs::read_dir(&*dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("vmmalloc-tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_tests_temporary_folder_goes_when_the_test_ends() {
    let d = tmpdir("guard");
    std::fs::write(d.join("f"), "x").unwrap();
    let path = d.to_path_buf();
    drop(d);
    assert!(!path.exists());
}

/// A command line clap refuses: exit status 2 and one line on standard
/// error, `Error: ...`, with no usage block and no tip to write `-- -1`.
fn usage_error(args: &[&str]) -> String {
    let o = run_bt(args);
    let err = common::stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: not one line:\n{err}");
    assert!(
        err.starts_with("Error: ") && !err.contains("Usage:"),
        "{args:?}: {err}"
    );
    assert!(!err.contains("'-- "), "{args:?}: {err}");
    err
}

#[test]
fn command_line_errors_are_one_line_and_name_the_real_cause() {
    let e = usage_error(&["replay"]);
    assert!(
        e.contains("required arguments were not provided: <INPUT>"),
        "{e}"
    );
    let e = usage_error(&["replay", "cs336_lm_step", "--bogus"]);
    assert!(e.contains("'--bogus'"), "{e}");
    // Negative counts and ordinals: said to be negative, not "use -- -1".
    for args in [
        &["replay", "cs336_lm_step", "--device", "-1"][..],
        &["compare", "cs336_lm_step", "--granularity-mb", "-1"],
        &["vmm-check", "--device", "-1"],
        &["bench", "--iters", "-5"],
    ] {
        let e = usage_error(args);
        assert!(
            e.contains("is negative: it must be 0 or more"),
            "{args:?}: {e}"
        );
    }
    // Sizes past TiB are too large, not an unknown unit.
    let e = user_error(&["replay", "cs336_lm_step", "--capacity", "10PiB"]);
    assert!(
        e.contains("larger than the simulated device can model"),
        "{e}"
    );
    // A huge factor is written as given, not as 309 digits.
    let e = user_error(&["compare", "cs336_lm_step", "--tight-factor", "1e308"]);
    assert!(e.contains("1e308 x peak live") && e.len() < 300, "{e}");
    // A device the input lacks: the devices it has are listed.
    let e = user_error(&["replay", "cs336_lm_step", "--device", "5"]);
    assert!(
        e.contains("the input has no device 5; its devices: 0"),
        "{e}"
    );
}

#[test]
fn bench_takes_policy_specs_as_compare_does() {
    let out = ok_bt(&[
        "bench",
        "--rounds",
        "1",
        "--iters",
        "10000",
        "--policies",
        "expandable:max_chunk=20MiB,native",
    ]);
    // The spec labels its row (on a line of its own where it is too long
    // for the first column of a 100-column table).
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().next() == Some("expandable:max_chunk=20MiB")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("native ")), "{out}");
    let e = user_error(&[
        "bench",
        "--iters",
        "10000",
        "--policies",
        "expandable:bogus=1",
    ]);
    assert!(
        e.contains("`expandable:bogus=1`") && e.contains("unknown option `bogus`"),
        "{e}"
    );
}
