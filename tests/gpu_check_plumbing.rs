//! The GPU check's plumbing cannot lie (issue 44): `scripts/gpu-check.sh`, run
//! from a bundle on the fake libcuda (`tests/fake-cuda`) with a stand-in
//! python that plays every PyTorch step script, reports each step as its
//! script ended.
//!
//! - a script that exits 3 (cannot run) or prints `CHECK x: SKIP` is a SKIP,
//!   never a PASS;
//! - a script that exits 1, or prints `CHECK x: FAIL` and exits 0, or exits 0
//!   without a single CHECK line, is a FAIL;
//! - a selected step the time budget left out makes the run exit 1, and the
//!   summary names it;
//! - `VMMALLOC_CLI` (the bundle's `bin/vmmalloc`) reaches every PyTorch step;
//! - a torch companion that cannot be built fails the python step, and the
//!   steps after it run with `VMMALLOC_COMPANION=0` (no rebuild in each);
//! - the scripts' RESULT lines reach `results.jsonl` and `results-gpu.md`.
//!
//! The bundle is a small stand-in (the CLI this package built, the real check
//! scripts, a stand-in Python package); no release build, a few seconds.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use vmmalloc_test_support::fake_cuda_library;

/// The PyTorch steps of the default check, in their order, and the script
/// each one runs.
const STEPS: &[(&str, &str)] = &[
    ("graph-pools", "torch_graph_pool_checks"),
    ("history", "torch_history_checks"),
    ("share", "torch_share_checks"),
    ("ipc", "torch_ipc_checks"),
    ("activation", "torch_activation_checks"),
    ("complete", "torch_complete_checks"),
    ("unpin-threads", "torch_unpin_threads"),
    ("hot-path", "torch_hot_path"),
    ("fragmentation", "torch_fragmentation"),
    ("serving", "torch_serving"),
    ("train", "torch_train_varlen"),
];

/// The stand-in python: answers the check's PyTorch probe, hands gpu_report.py
/// and inline programs on stdin to the real python3, and plays a step script
/// as `STANDIN_<script stem>` says (default `ok`), recording VMMALLOC_CLI.
const STANDIN_PYTHON: &str = r#"#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
if args[:2] == ["-m", "vmmalloc"]:
    args = args[2:]
if args and args[0] == "-c":
    code = args[1]
    if "torch.cuda.memory" in code:
        print("torch 2.11.0+standin 13.0 True")
    elif "platform" in code:
        print("3.12.0")
    elif "_companion" in code and os.environ.get("STANDIN_COMPANION") == "fail":
        print("RuntimeError: stand-in: no C++ compiler")
        sys.exit(1)
    else:
        print("stand-in python: -c ran")
    sys.exit(0)
script = os.path.basename(args[0]) if args else ""
if not script.startswith("torch_"):
    os.execvp("python3", ["python3"] + args)
stem = script[:-3]
cli = os.environ.get("VMMALLOC_CLI", "")
with open(os.environ["STANDIN_LOG"], "a") as f:
    ok = int(bool(cli) and os.access(cli, os.X_OK))
    f.write("%s %s %d %s\n" % (stem, cli or "-", ok, os.environ.get("VMMALLOC_COMPANION", "-")))
mode = os.environ.get("STANDIN_" + stem, "ok")
conf = os.environ.get("VMMALLOC_CONF")
label = ("vmmalloc:" + conf.split(",")[0].split(":")[1]) if conf else "pytorch"
if mode == "exit3":
    print("%s: cannot run: stand-in says no CUDA device" % stem)
    sys.exit(3)
if mode in ("fail", "failzero"):
    print("CHECK standin: FAIL the stand-in's check failed")
    sys.exit(1 if mode == "fail" else 0)
if mode == "silent":
    sys.exit(0)
if mode == "skipzero":
    print("CHECK standin: ok")
    print("CHECK standin-part: SKIP stand-in environment refused")
    sys.exit(0)
print("CHECK standin: ok VMMALLOC_CLI=%s" % cli)
row = {"script": stem, "allocator": label, "outcome": "ok", "standin": True}
print("RESULT " + json.dumps(row))
sys.exit(0)
"#;

struct Bundle {
    root: PathBuf,
}

impl Bundle {
    /// A bundle in a fresh folder: manifest, bin/vmmalloc, a stand-in
    /// lib/libvmmalloc.so and python package, the real check scripts.
    fn new(name: &str) -> Bundle {
        let root =
            std::env::temp_dir().join(format!("vmmalloc-plumbing-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let b = root.join("bundle");
        for d in ["bin", "lib", "python/vmmalloc", "scripts", "tests"] {
            fs::create_dir_all(b.join(d)).unwrap();
        }
        fs::write(
            b.join("manifest.txt"),
            "format: vmmalloc-gpu-bundle/1\nscripts_sha256: stand-in\n",
        )
        .unwrap();
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_vmmalloc"), b.join("bin/vmmalloc")).unwrap();
        fs::write(b.join("lib/libvmmalloc.so"), "stand-in").unwrap();
        fs::write(
            b.join("python/vmmalloc/__init__.py"),
            "def library_path():\n    return 'stand-in'\n",
        )
        .unwrap();
        let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
        for e in fs::read_dir(&scripts).unwrap() {
            let p = e.unwrap().path();
            let f = p.file_name().unwrap().to_str().unwrap().to_string();
            let wanted = matches!(
                f.as_str(),
                "gpu-check.sh" | "gpu-check-pytorch.sh" | "gpu_report.py"
            ) || (f.starts_with("torch_") && f.ends_with(".py"));
            if wanted {
                fs::copy(&p, b.join("scripts").join(&f)).unwrap();
            }
        }
        let py = root.join("python");
        fs::write(&py, STANDIN_PYTHON).unwrap();
        fs::set_permissions(&py, fs::Permissions::from_mode(0o755)).unwrap();
        Bundle { root }
    }

    /// Runs the bundle's gpu-check.sh (not a dry run: the stand-in python
    /// has PyTorch on a GPU) with ENV; returns (exit status, summary lines by
    /// step, the whole summary, the stand-in's log).
    fn check(&self, env: &[(&str, &str)]) -> Run {
        let out = self.root.join("out");
        let log = self.root.join("standin.log");
        let mut cmd = Command::new("bash");
        cmd.arg(self.root.join("bundle/scripts/gpu-check.sh"))
            .arg("--out")
            .arg(&out)
            .env("VMMALLOC_CUDA_LIBRARY", fake_cuda_library())
            .env("PYTHON", self.root.join("python"))
            .env("STANDIN_LOG", &log)
            .env_remove("VMMALLOC_CLI")
            .env_remove("FULL")
            .env_remove("SHORT")
            .env_remove("BUDGET_S");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let o = cmd.output().expect("bash runs gpu-check.sh");
        let summary = fs::read_to_string(out.join("gpu-check-summary.txt")).unwrap_or_default();
        let mut steps = BTreeMap::new();
        for line in summary.lines() {
            if let Some((name, rest)) = line.split_once(": ") {
                steps.insert(name.to_string(), rest.to_string());
            }
        }
        Run {
            code: o.status.code(),
            steps,
            summary,
            log: fs::read_to_string(&log).unwrap_or_default(),
            out,
            printed: String::from_utf8_lossy(&o.stdout).into_owned(),
        }
    }
}

impl Drop for Bundle {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

struct Run {
    code: Option<i32>,
    steps: BTreeMap<String, String>,
    summary: String,
    log: String,
    out: PathBuf,
    printed: String,
}

impl Run {
    fn verdict(&self, step: &str) -> &str {
        self.steps
            .get(step)
            .unwrap_or_else(|| panic!("no verdict for {step}:\n{}\n{}", self.summary, self.printed))
    }
    fn expect(&self, step: &str, start: &str) {
        let v = self.verdict(step);
        assert!(
            v.starts_with(start),
            "{step}: {v}, expected {start}...\n{}\n{}",
            self.summary,
            self.printed
        );
    }
}

fn only(names: &[&str]) -> String {
    names.join(" ")
}

#[test]
fn skips_and_failures_are_reported_as_such_and_the_cli_reaches_every_step() {
    let b = Bundle::new("truth");
    let mut names = vec!["vmm", "python"];
    names.extend(STEPS.iter().map(|s| s.0));
    let only = only(&names);
    let run = b.check(&[
        ("ONLY", &only),
        ("STANDIN_torch_history_checks", "exit3"),
        ("STANDIN_torch_share_checks", "fail"),
        ("STANDIN_torch_ipc_checks", "failzero"),
        ("STANDIN_torch_activation_checks", "skipzero"),
        ("STANDIN_torch_complete_checks", "silent"),
    ]);
    run.expect("vmm", "PASS");
    run.expect("python", "PASS");
    run.expect("history", "SKIP (");
    assert!(
        run.verdict("history")
            .contains("stand-in says no CUDA device"),
        "{}",
        run.summary
    );
    run.expect("share", "FAIL");
    run.expect("ipc", "FAIL");
    run.expect("activation", "SKIP (");
    assert!(
        run.verdict("activation")
            .contains("stand-in environment refused"),
        "{}",
        run.summary
    );
    run.expect("complete", "FAIL");
    assert!(
        run.verdict("complete").contains("no CHECK line"),
        "{}",
        run.summary
    );
    for step in [
        "graph-pools",
        "unpin-threads",
        "hot-path",
        "fragmentation",
        "serving",
        "train",
    ] {
        run.expect(step, "PASS");
    }
    assert_eq!(run.code, Some(1), "a failed step: exit 1\n{}", run.summary);
    // The measured-before steps are not in the default check; with ONLY they are "not selected".
    run.expect("graphs", "SKIP (not selected");
    // VMMALLOC_CLI: the bundle's CLI, executable, in every PyTorch step's scripts.
    let cli = b.root.join("bundle/bin/vmmalloc");
    for (step, script) in STEPS {
        let seen: Vec<&str> = run
            .log
            .lines()
            .filter(|l| l.starts_with(&format!("{script} ")))
            .collect();
        assert!(!seen.is_empty(), "{step}: {script} never ran:\n{}", run.log);
        for l in seen {
            let want = format!("{script} {} 1 ", cli.display());
            assert!(
                l.starts_with(&want),
                "{step}: VMMALLOC_CLI not the bundle's: {l}"
            );
        }
    }
    // The scripts' RESULT lines reach results.jsonl and results-gpu.md.
    let jsonl = fs::read_to_string(run.out.join("results.jsonl")).unwrap();
    for script in [
        "torch_graph_pool_checks",
        "torch_unpin_threads",
        "torch_fragmentation",
    ] {
        assert!(
            jsonl.contains(&format!("\"script\": \"{script}\"")),
            "{script} not in results.jsonl:\n{jsonl}"
        );
    }
    let md = fs::read_to_string(run.out.join("results-gpu.md")).unwrap();
    assert!(
        md.contains("torch_graph_pool_checks"),
        "RESULT lines missing from results-gpu.md:\n{md}"
    );
    assert!(
        md.contains("| share | standin | FAIL |"),
        "CHECK lines missing from results-gpu.md:\n{md}"
    );
}

#[test]
fn a_selected_step_cut_by_the_budget_fails_the_run() {
    // A step needs at least 5 s of budget to start: with 4 s, every selected
    // step is cut (deterministic, whatever the machine's load); nothing fails.
    let b = Bundle::new("budget");
    let run = b.check(&[("ONLY", "graph-pools history share"), ("BUDGET_S", "4")]);
    for step in ["graph-pools", "history", "share"] {
        run.expect(step, "SKIP (time budget of 4 s spent: NOT RUN)");
    }
    assert!(
        !run.summary.contains("FAIL"),
        "no step failed:\n{}",
        run.summary
    );
    assert!(
        run.summary.contains("3 selected step(s) NOT RUN")
            && run.summary.contains("ONLY=\"graph-pools history share\""),
        "{}",
        run.summary
    );
    assert!(
        run.log.is_empty(),
        "a cut step ran its script:\n{}",
        run.log
    );
    assert_eq!(
        run.code,
        Some(1),
        "budget-cut steps: exit 1\n{}",
        run.summary
    );
}

#[test]
fn a_run_where_every_selected_step_passed_exits_0_and_a_misspelt_step_fails() {
    let b = Bundle::new("clean");
    let run = b.check(&[("ONLY", "python graph-pools history")]);
    for step in ["python", "graph-pools", "history"] {
        run.expect(step, "PASS");
    }
    assert_eq!(run.code, Some(0), "{}\n{}", run.summary, run.printed);
    let run = b.check(&[("ONLY", "python histroy")]);
    run.expect("histroy", "FAIL (ONLY names no step");
    assert_eq!(run.code, Some(1), "{}", run.summary);
}

#[test]
fn a_companion_that_cannot_be_built_fails_python_and_is_not_retried_by_every_step() {
    let b = Bundle::new("companion");
    let run = b.check(&[
        ("ONLY", "python graph-pools"),
        ("STANDIN_COMPANION", "fail"),
    ]);
    run.expect("python", "FAIL");
    assert!(
        run.verdict("python").contains("could not be built"),
        "{}",
        run.summary
    );
    run.expect("graph-pools", "PASS");
    let line = run
        .log
        .lines()
        .find(|l| l.starts_with("torch_graph_pool_checks "))
        .unwrap();
    assert!(
        line.ends_with(" 0"),
        "VMMALLOC_COMPANION=0 did not reach the step: {line}"
    );
    assert_eq!(run.code, Some(1), "{}", run.summary);
}

/// A bundle built with `BUNDLE_PROFILE=dev` (the CI dry run's) is refused on
/// a GPU: its timings would be a debug build's. A release bundle's manifest
/// (or one without a profile line, older) is not refused for it.
#[test]
fn a_dev_profile_bundle_is_refused_outside_a_dry_run() {
    let b = Bundle::new("dev-profile");
    let manifest = b.root.join("bundle/manifest.txt");
    fs::write(
        &manifest,
        "format: vmmalloc-gpu-bundle/1\nprofile: release\nscripts_sha256: stand-in\n",
    )
    .unwrap();
    let run = b.check(&[("ONLY", "bundle")]);
    assert!(
        !run.verdict("bundle").contains("dev profile"),
        "{}",
        run.summary
    );
    fs::write(
        &manifest,
        "format: vmmalloc-gpu-bundle/1\nprofile: dev\nscripts_sha256: stand-in\n",
    )
    .unwrap();
    let run = b.check(&[("ONLY", "bundle")]);
    run.expect("bundle", "FAIL (exit 1");
    assert!(
        run.verdict("bundle")
            .contains("bundle: built with the dev profile"),
        "{}",
        run.summary
    );
    assert_eq!(run.code, Some(1), "{}", run.summary);
}
