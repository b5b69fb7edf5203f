//! What a new user tripped over (issue 26): the same inputs everywhere,
//! one-line errors, refused absurd capacities, the out-of-memory "Why",
//! one option syntax, and a terminal-width `compare`.

mod common;
use common::{bin, stderr, tmpdir, user_error};

fn ok(args: &[&str]) -> String {
    common::ok_bt(args)
}

#[test]
fn every_command_takes_the_bundled_snapshot_by_name() {
    let dir = tmpdir("bundled");
    let snap = dir.join("s.pickle");
    for args in [
        vec!["replay", "cs336_lm_step", "--capacity", "16GiB"],
        vec!["summary", "cs336_lm_step", "--capacity", "16GiB"],
        vec![
            "snapshot",
            "cs336_lm_step",
            "--capacity",
            "16GiB",
            "--out",
            snap.to_str().unwrap(),
        ],
        vec!["compare", "cs336_lm_step", "--policies", "expandable"],
        vec!["advise", "cs336_lm_step", "--gpu", "16GiB"],
    ] {
        let out = ok(&args);
        assert!(out.contains("cs336_lm_step"), "{args:?}:\n{out}");
    }
    assert!(snap.is_file());
    // And an input that is nothing is the same error for every command.
    for cmd in ["replay", "summary", "advise", "compare"] {
        let e = user_error(&[cmd, "cs336_lm_stop"]);
        assert!(
            e.contains("neither a file nor a workload") && e.contains("cs336_lm_step"),
            "{cmd}: {e}"
        );
    }
}

#[test]
fn user_errors_are_one_line_even_with_rust_backtrace_set() {
    let dir = tmpdir("errors");
    let empty = dir.join("empty.trace");
    std::fs::write(&empty, "").unwrap();
    let missing = dir.join("missing.pickle");
    for args in [
        vec!["replay", "no-such-workload"],
        vec!["replay", missing.to_str().unwrap()],
        vec!["replay", empty.to_str().unwrap()],
        vec!["replay", "train-varlen", "--policy", "bogus"],
        vec!["replay", "train-varlen", "--capacity", "-5GiB"],
        vec!["compare", "train-varlen", "--capacity", "0"],
        vec!["advise", "train-varlen", "--gpu", "-5GiB"],
        vec!["summary", "train-varlen", "--capacity", "lots"],
    ] {
        user_error(&args);
    }
    // The cause is said once, not repeated by the error chain.
    let e = user_error(&["replay", missing.to_str().unwrap()]);
    assert_eq!(e.matches("No such file").count(), 1, "{e}");
    // --gpu takes a negative size to refuse it, as --capacity does.
    let e = user_error(&["advise", "train-varlen", "--gpu", "-5GiB"]);
    assert!(e.contains("--gpu") && e.contains("negative"), "{e}");
    let e = user_error(&["compare", "train-varlen", "--capacity", "0"]);
    assert!(e.contains("--capacity") && e.contains("`0`"), "{e}");
}

#[test]
fn capacities_beyond_the_simulated_device_are_refused_up_front() {
    for args in [
        vec![
            "replay",
            "cs336_lm_step",
            "--policy",
            "expandable",
            "--capacity",
            "4TiB",
        ],
        vec![
            "replay",
            "cs336_lm_step",
            "--policy",
            "torch-es",
            "--capacity",
            "64TiB",
        ],
        vec!["summary", "train-varlen", "--capacity", "2TiB"],
        vec!["compare", "train-varlen", "--capacity", "1025GiB"],
        vec!["advise", "train-varlen", "--gpu", "1.5TiB"],
    ] {
        let e = user_error(&args);
        assert!(
            e.contains("larger than the simulated device can model")
                && e.contains("at most 1.00 TiB"),
            "{args:?}: {e}"
        );
    }
    // The limit itself is modelled, by every policy.
    for policy in ["expandable", "caching", "torch-es", "native"] {
        let out = ok(&[
            "replay",
            "train-varlen",
            "--policy",
            policy,
            "--capacity",
            "1TiB",
        ]);
        assert!(
            out.contains("result                 ok"),
            "{policy}:\n{out}"
        );
    }
}

/// The first out-of-memory message of a replay (its text runs to the next
/// line that is not part of it), its lines as the message has them: the
/// replay wraps them to 100 columns under a 4-space indent, so a line of
/// the message is a line with at most 2 spaces of its own indent left, the
/// deeper ones its continuations (joined to it here).
fn first_oom(out: &str) -> String {
    let at = out
        .find("first out-of-memory")
        .unwrap_or_else(|| panic!("no out-of-memory:\n{out}"));
    let mut lines: Vec<String> = Vec::new();
    for l in out[at..]
        .lines()
        .take_while(|l| !l.starts_with("  error") && !l.starts_with("  steady"))
    {
        let l = l.strip_prefix("    ").unwrap_or(l);
        let own = l.len() - l.trim_start().len();
        match lines.last_mut() {
            Some(last) if own > 2 || (own == 0 && !starts_a_line(l)) => {
                last.push(' ');
                last.push_str(l.trim_start());
            }
            _ => lines.push(l.to_string()),
        }
    }
    lines.join("\n")
}

/// Whether a wrapped line of an out-of-memory message starts one of its own
/// lines (PyTorch's wording wraps into lines of no such start).
fn starts_a_line(l: &str) -> bool {
    ["Why: ", "Pinning ", "first out-of-memory"]
        .iter()
        .any(|s| l.starts_with(s))
}

#[test]
fn caching_oom_says_first_that_live_plus_request_exceed_the_device() {
    // 12.36 GiB live + a 312.50 MiB request > 12.5 GiB: not fragmentation.
    for policy in ["caching", "torch-es"] {
        let out = ok(&[
            "replay",
            "cs336_lm_step",
            "--policy",
            policy,
            "--capacity",
            "12.5GiB",
        ]);
        let oom = first_oom(&out);
        let why = oom.split("\nWhy: ").nth(1).expect("a Why line");
        assert!(
            why.starts_with("live tensors hold 12.36 GiB and the request needs 312.50 MiB more")
                && why.contains("more than the 12.50 GiB device"),
            "{policy}:\n{oom}"
        );
        // The rounded size PyTorch's wording names is said to be the same request.
        assert!(
            oom.contains("Tried to allocate 314.00 MiB")
                && why.contains(
                    "the 314.00 MiB above is the segment asked of the driver for it, rounded up"
                ),
            "{policy}:\n{oom}"
        );
        assert!(
            !why.contains("largest is") && !oom.contains("Pinning"),
            "{policy}: fragmentation blamed:\n{oom}"
        );
    }
    // At 13 GiB the request fits beside the live tensors: fragmentation is
    // the cause, and every pinning allocation is named, not a bare address.
    let out = ok(&[
        "replay",
        "cs336_lm_step",
        "--policy",
        "caching",
        "--capacity",
        "13GiB",
    ]);
    let oom = first_oom(&out);
    assert!(
        oom.contains("Why: live tensors plus the request fit in the 13.00 GiB, but")
            && oom.contains("too small for the 312.50 MiB request"),
        "{oom}"
    );
    let pins: Vec<&str> = oom
        .lines()
        .skip_while(|l| !l.starts_with("Pinning"))
        .skip(1)
        .collect();
    assert!(!pins.is_empty(), "{oom}");
    for p in pins {
        let after_addr = p.split_once(" at 0x").unwrap().1;
        assert!(after_addr.contains(" ("), "a bare address: {p}");
    }
}

#[test]
fn advise_keeps_pytorch_on_a_tie_and_prints_specs_the_cli_accepts() {
    // The bundled snapshot on 16 GiB: expandable 3.03 GiB of headroom,
    // caching 2.93 GiB (within 1 %), both 0.0 ms per further pass: a tie.
    let text = ok(&["advise", "cs336_lm_step", "--gpu", "16GiB"]);
    assert!(
        text.contains("Best: caching —") && text.contains("expandable ties with it"),
        "{text}"
    );
    assert_eq!(
        text.trim_end().lines().last(),
        Some("unset PYTORCH_CUDA_ALLOC_CONF"),
        "{text}"
    );
    assert!(
        !text.contains("What the plug-in does not support"),
        "{text}"
    );
    // Every setting advise printed replays as written, and every plug-in
    // line it printed replays after `expandable:` too.
    let specs: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("setting"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        // A setting too long for the column has its figures on the next,
        // indented line.
        .filter(|l| !l.starts_with(' '))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert!(specs.len() >= 8, "{text}");
    for spec in &specs {
        ok(&["replay", "frag-adversary:rounds=1", "--policy", spec]);
    }
    let conf_text = ok(&["advise", "frag-adversary:rounds=1", "--gpu", "16GiB"]);
    let confs: Vec<String> = conf_text
        .lines()
        .filter_map(|l| l.split("VMMALLOC_CONF=").nth(1))
        .map(|c| c.split_whitespace().next().unwrap().to_string())
        .collect();
    assert!(!confs.is_empty(), "{conf_text}");
    for conf in confs {
        let opts = conf
            .trim_start_matches("backend:expandable")
            .trim_start_matches(',');
        let spec = format!("expandable:{opts}");
        ok(&[
            "replay",
            "frag-adversary:rounds=1",
            "--policy",
            spec.trim_end_matches(':'),
        ]);
    }
}

#[test]
fn policy_specs_take_both_separators_and_both_option_names() {
    // The two spellings the guide and VMMALLOC_CONF use, and mixtures.
    let figures = |spec: &str| {
        let out = ok(&[
            "replay",
            "train-varlen",
            "--policy",
            spec,
            "--capacity",
            "48GiB",
        ]);
        out.lines()
            .filter(|l| {
                l.contains("peak reserved")
                    || l.contains("modeled driver time")
                    || l.contains("cuMem")
            })
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let want = figures("expandable:split_threshold=0.4,unpin=0,grow_granule=0");
    for spec in [
        "expandable:split_threshold:0.4,unpin:false,grow_mb:0",
        "expandable:split_threshold=0.4,unpin=false,grow_mb=0",
        "expandable:split_threshold:0.4,unpin=0,grow_granule:0",
    ] {
        assert_eq!(figures(spec), want, "{spec}");
    }
    assert_ne!(
        figures("expandable"),
        want,
        "the options must change something"
    );
    assert_eq!(
        figures("expandable:max_chunk_mb:20"),
        figures("expandable:max_chunk=20MiB")
    );
    // compare's list splits between specs with either separator.
    let out = ok(&[
        "compare",
        "frag-adversary:rounds=1",
        "--policies",
        "expandable:unpin:false,grow_mb:0,caching:max_split_size_mb:128",
    ]);
    assert!(
        out.contains("expandable:unpin:false,grow_mb:0")
            && out.contains("caching:max_split_size_mb:128"),
        "{out}"
    );
    let e = user_error(&[
        "replay",
        "train-varlen",
        "--policy",
        "expandable:grow_mb=big",
    ]);
    assert!(e.contains("grow_mb"), "{e}");
}

#[test]
fn compare_fits_100_columns_and_ends_with_a_conclusion() {
    let args = ["compare", "cs336_lm_step", "frag-adversary:rounds=1"];
    let out = ok(&args);
    for l in out.lines() {
        assert!(
            l.chars().count() <= 100,
            "{} columns: {l}\n{out}",
            l.chars().count()
        );
    }
    // Every policy has its row under each trace's heading.
    for p in ["expandable", "caching", "torch-es", "native"] {
        assert_eq!(
            out.lines()
                .filter(|l| l.starts_with(&format!("{p} ")) && l.contains(" / "))
                .count(),
            2,
            "{p}:\n{out}"
        );
    }
    assert!(!out.contains("cold ms linear"), "{out}");
    // The last paragraph answers "which allocator, and why", each claim
    // from the table above it (issue 36: tests/common/conclusion.rs).
    let last = out
        .trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap()
        .replace('\n', " ");
    assert!(last.starts_with("Conclusion: Memory: expandable"), "{out}");
    let (blocks, conclusion) = common::conclusion::parse_output(&out);
    assert_eq!(blocks.len(), 2, "{out}");
    common::conclusion::check(&blocks, &conclusion.unwrap());
    // --wide prints every column, the second preset's among them.
    let mut wide = args.to_vec();
    wide.push("--wide");
    let out = ok(&wide);
    assert!(
        out.lines()
            .any(|l| l.contains("cold ms a100") && l.chars().count() > 100),
        "{out}"
    );
    assert!(
        out.contains("cold ms a100 = the cold calls priced by the a100 preset"),
        "{out}"
    );
    assert!(out.contains("Conclusion: "), "{out}");
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    // `vmmalloc replay ... | head -1`: the reader is gone before the output.
    let mut child = bin()
        .args(["replay", "train-varlen"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(
        !err.contains("panicked") && !err.contains("Broken pipe"),
        "{err}"
    );
}

/// README.md's text.
fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

#[test]
fn the_readme_command_line_lists_every_command() {
    let help = ok(&["--help"]);
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        // A command starts its line; its description may wrap, indented deeper.
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.len() >= 10, "{help}");
    let text = readme();
    let block = text
        .split("## Command line")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("a Command line block");
    for c in commands {
        assert!(
            block.contains(&format!("vmmalloc {c} ")),
            "README's Command line lacks {c}"
        );
    }
}

#[test]
fn the_readmes_test_examples_name_tests_that_exist() {
    // `cargo test -p PKG --test TARGET FILTER`: FILTER must select a test of
    // TARGET (a bare `cargo test -p PKG FILTER` is easy to get wrong: it ran 0).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = readme().split_whitespace().collect::<Vec<_>>().join(" ");
    let mut seen = 0;
    for cmd in text.split('`').filter(|s| s.starts_with("cargo test -p ")) {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let pkg = words[3];
        let target = words
            .iter()
            .position(|w| *w == "--test")
            .map(|i| words[i + 1]);
        let last = *words.last().unwrap();
        let filter =
            (words.len() > 4 && !last.starts_with('-') && Some(last) != target).then_some(last);
        let Some(filter) = filter else { continue };
        let target = target.unwrap_or_else(|| panic!("`{cmd}`: a filter needs --test TARGET"));
        let dir = match pkg {
            "vmmalloc" => root.to_path_buf(),
            p => root.join("crates").join(p.trim_start_matches("vmmalloc-")),
        };
        let file = std::fs::read_to_string(dir.join("tests").join(format!("{target}.rs")))
            .unwrap_or_else(|e| panic!("`{cmd}`: {e}"));
        assert!(
            file.lines()
                .any(|l| l.trim_start().starts_with("fn ") && l.contains(filter)),
            "`{cmd}`: no test of {target} has `{filter}` in its name"
        );
        seen += 1;
    }
    assert!(seen >= 1, "no filtered test example found");
}

#[test]
fn the_readmes_measured_figures_say_when_and_at_which_commit() {
    // A paragraph that quotes a results page's figures says the date and
    // the commit they were measured at.
    for para in readme().split("\n\n") {
        let flat = para.split_whitespace().collect::<Vec<_>>().join(" ");
        if flat.starts_with("On a real H200") || flat.starts_with("From docs/results.md") {
            assert!(flat.contains("2026-") && flat.contains("commit "), "{flat}");
        }
    }
    assert!(
        !readme().contains("about 13 s"),
        "the snapshot figures live in docs/trace-format.md"
    );
    assert!(
        !readme().contains("make fewer driver calls"),
        "advise's extra settings cost more"
    );
}

#[test]
fn the_workload_bounds_are_listed_and_the_guide_names_the_event_bound() {
    let out = ok(&["workloads"]);
    // Every parameter line but the seeds' and flags' shows its bounds.
    assert!(out.contains("(default 12; 1..=10000)"), "{out}");
    let max = vmmalloc_trace::workloads::MAX_EVENTS;
    assert!(out.contains(&format!("at most {max} events")), "{out}");
    let guide =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/guide.md")).unwrap();
    let with_commas = max
        .to_string()
        .as_bytes()
        .rchunks(3)
        .rev()
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect::<Vec<_>>()
        .join(",");
    assert!(
        guide.contains(&format!("at most {with_commas} events")),
        "{with_commas}"
    );
}
