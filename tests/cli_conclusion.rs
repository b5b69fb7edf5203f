//! `compare`'s conclusion follows from its own table (issue 36): every
//! claim is recomputed from the printed rows (tests/common/conclusion.rs)
//! on the built-in set and on inputs where different policies run out of
//! memory; src/conclusion.rs's own tests do the same on generated tables
//! where each policy, expandable included, fails in turn.

mod common;
use common::conclusion::{check, parse_output};
use common::{ok_bt, run_bt, stderr};

/// Runs `compare ARGS`, checks every line's width and every claim of the
/// conclusion against the table; returns the output.
fn checked(args: &[&str], traces: usize) -> String {
    let out = ok_bt(args);
    for l in out.lines() {
        assert!(l.chars().count() <= 100, "{args:?}: {l}");
    }
    let (blocks, conclusion) = parse_output(&out);
    assert_eq!(blocks.len(), traces, "{args:?}:\n{out}");
    let conclusion = conclusion.unwrap_or_else(|| panic!("{args:?}: no conclusion:\n{out}"));
    check(&blocks, &conclusion);
    conclusion
}

#[test]
fn the_built_in_set_concludes_only_what_its_table_shows() {
    let c = checked(&["compare"], 5);
    // The replays that ran out of memory are named, never summed.
    assert!(
        c.contains("Out of memory at the tight device, so not compared: "),
        "{c}"
    );
    assert!(c.contains("where both fit the tight device"), "{c}");
}

#[test]
fn nothing_fits_says_so_names_the_device_and_fails_with_fail_on_oom() {
    let args = [
        "compare",
        "cs336_lm_step",
        "--capacity",
        "1MiB",
        "--policies",
        "expandable,caching",
    ];
    let c = checked(&args, 1);
    assert!(
        c.starts_with("Conclusion: Nothing fits: ")
            && c.contains("needs 12.97 GiB with expandable"),
        "{c}"
    );
    assert!(!c.contains("So expandable") && !c.contains("keep"), "{c}");
    let mut strict = args.to_vec();
    strict.push("--fail-on-oom");
    let o = run_bt(&strict);
    assert!(
        !o.status.success(),
        "nothing fits, yet --fail-on-oom succeeded"
    );
    assert!(stderr(&o).contains("--fail-on-oom"), "{}", stderr(&o));
}

#[test]
fn pytorch_allocators_failing_on_some_traces_are_left_out_of_the_sums() {
    // At 13 GiB caching misses cs336_lm_step (13.07 GiB) while the others
    // fit it; on frag-adversary both PyTorch allocators run out.
    let c = checked(
        &[
            "compare",
            "cs336_lm_step",
            "frag-adversary:rounds=1",
            "--capacity",
            "13GiB",
        ],
        2,
    );
    assert!(
        c.contains("against caching, no trace where both fit"),
        "{c}"
    );
    // Each trace in a block of its own: the tight device, 1.05 x peak live.
    checked(
        &["compare", "frag-adversary:rounds=1", "train-varlen:steps=2"],
        2,
    );
}

#[test]
fn a_tight_steady_cost_is_explained_next_to_its_row() {
    let out = ok_bt(&[
        "compare",
        "frag-adversary:rounds=2",
        "--policies",
        "expandable",
    ]);
    let note = out
        .lines()
        .find(|l| l.starts_with("  expandable: steady "))
        .unwrap_or_else(|| panic!("no note under the row:\n{out}"));
    assert!(
        note.contains("(unlimited): it unmaps to make room each pass"),
        "{note}"
    );
}
