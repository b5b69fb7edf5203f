//! Output fits 100 columns (issue 36): `compare`'s default output,
//! `advise`, every `--help`, and `bench` (its header columns apart, "round"
//! in the singular for one round). Run with `RUST_BACKTRACE=1`.

mod common;
use common::ok_bt;

const WIDTH: usize = 100;

fn fits(what: &str, out: &str) {
    for l in out.lines() {
        assert!(
            l.chars().count() <= WIDTH,
            "{what}: {} columns:\n{l}",
            l.chars().count()
        );
    }
}

#[test]
fn every_help_fits_100_columns() {
    let mut commands = vec![vec!["--help"]];
    for c in [
        "info",
        "compare",
        "replay",
        "summary",
        "snapshot",
        "advise",
        "bench",
        "workloads",
        "calibrate",
        "vmm-check",
        "share",
    ] {
        commands.push(vec![c, "--help"]);
    }
    for args in commands {
        fits(&format!("{args:?}"), &ok_bt(&args));
    }
}

#[test]
fn compare_and_advise_fit_100_columns() {
    // The rl-colocate sleep table's footnote and advise's explanation are
    // wrapped; a setting too long for advise's first column gets a line of
    // its own.
    fits(
        "compare",
        &ok_bt(&[
            "compare",
            "rl-colocate:iterations=1",
            "frag-adversary:rounds=1",
        ]),
    );
    let out = ok_bt(&["advise", "cs336_lm_step", "--gpu", "16GiB"]);
    fits("advise", &out);
    assert!(
        out.lines()
            .any(|l| l == "caching:garbage_collection_threshold=0.8,memory_fraction=1.0"),
        "{out}"
    );
    // Every candidate's figures are still printed, one row each: a line
    // ending in `yes|no` and four figures (or `-`).
    let rows = out
        .lines()
        .filter(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            t.len() >= 5 && {
                let tail = &t[t.len() - 5..];
                matches!(tail[0], "yes" | "no")
                    && tail[1..]
                        .iter()
                        .all(|c| *c == "-" || c.parse::<f64>().is_ok())
            }
        })
        .count();
    assert_eq!(rows, 10, "{out}");
}

#[test]
fn bench_separates_its_columns_and_counts_rounds_in_the_singular() {
    let out = ok_bt(&[
        "bench",
        "--rounds",
        "1",
        "--iters",
        "10000",
        "--policies",
        "expandable,native",
    ]);
    fits("bench", &out);
    let header = out.lines().next().unwrap();
    for h in [
        "pair ns median",
        "pair ns p99",
        "1 thread pairs/s",
        "2 threads pairs/s",
        "2t / 1t",
    ] {
        assert!(header.contains(&format!("  {h}")), "{h}: {header}");
    }
    let text = out.replace('\n', " ");
    assert!(text.contains("median of 1 round;"), "{out}");
    let two = ok_bt(&[
        "bench",
        "--rounds",
        "2",
        "--iters",
        "10000",
        "--policies",
        "native",
    ]);
    assert!(
        two.replace('\n', " ").contains("median of 2 rounds;"),
        "{two}"
    );
}

#[test]
fn every_commands_default_output_fits_100_columns() {
    let dir = common::tmpdir("width");
    let snap = dir.join("s.pickle");
    let long = "expandable:max_chunk=20MiB,unpin=0,grow_granule=0,\
                caching:garbage_collection_threshold=0.8,memory_fraction=1.0";
    let runs: Vec<Vec<&str>> = vec![
        vec!["workloads"],
        vec!["summary", "cs336_lm_step"],
        vec![
            "summary",
            "cs336_lm_step",
            "--capacity",
            "8GiB",
            "--at",
            "oom",
        ],
        vec!["advise", "cs336_lm_step"],
        vec!["snapshot", "cs336_lm_step", "--out", snap.to_str().unwrap()],
        vec!["replay", "cs336_lm_step", "--capacity", "8GiB", "--steady"],
        vec!["compare", "train-varlen:steps=2", "--policies", long],
        vec![
            "bench",
            "--rounds",
            "1",
            "--iters",
            "10000",
            "--policies",
            long,
        ],
        vec!["info"],
    ];
    for args in &runs {
        let o = common::run_bt(args);
        assert!(o.status.success(), "{args:?}: {}", common::stderr(&o));
        fits(&format!("{args:?}"), &common::stdout(&o));
    }
    // vmm-check where there is no driver (or a GPU): every line but its
    // verdict, the last, which scripts/gpu-check.sh quotes whole.
    let o = common::run_bt(&["vmm-check"]);
    let out = common::stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    fits(
        "vmm-check",
        &lines[..lines.len().saturating_sub(1)].join("\n"),
    );
}
