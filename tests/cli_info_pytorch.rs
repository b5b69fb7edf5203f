//! `vmmalloc info --pytorch`: the Python package's self-check appended to the
//! report, or one line saying why there is none; exit code 0 either way.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn info(python: &str, extra: &[&str]) -> Output {
    // The package from this checkout (its library may or may not be built:
    // the check reports either, with a verdict).
    info_with(
        python,
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("python"),
        extra,
    )
}

/// `vmmalloc info --pytorch EXTRA` with `python` and `PYTHONPATH`.
fn info_with(python: &str, pythonpath: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .arg("info")
        .arg("--pytorch")
        .args(extra)
        .env("VMMALLOC_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
        .env("VMMALLOC_PYTHON", python)
        .env("PYTHONPATH", pythonpath)
        .env_remove("VMMALLOC_CONF")
        .output()
        .expect("run vmmalloc info --pytorch")
}

/// The `PyTorch check:` line of `out`.
fn check_line(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    stdout
        .lines()
        .find(|l| l.starts_with("PyTorch check:"))
        .unwrap_or_else(|| panic!("no PyTorch check line:\n{stdout}"))
        .to_string()
}

#[test]
fn info_pytorch_without_python_says_so() {
    let line = check_line(&info("/nonexistent/python3", &[]));
    assert!(
        line.starts_with("PyTorch check: cannot run /nonexistent/python3 (")
            && line.ends_with("); set VMMALLOC_PYTHON"),
        "{line}"
    );
}

#[test]
fn info_pytorch_appends_the_python_self_check() {
    let out = info("python3", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let at = stdout
        .find("PyTorch check (python3 -m vmmalloc --check):\n")
        .unwrap_or_else(|| panic!("no self-check:\n{stdout}\n{stderr}"));
    let report = &stdout[at..];
    assert!(report.contains("\nvmmalloc: Python package "), "{report}");
    assert!(report.contains("\nCUDA driver: not found"), "{report}");
    let verdict = report.lines().last().unwrap_or_default();
    assert!(
        verdict.starts_with("verdict: not usable: ") && verdict.contains("no CUDA driver"),
        "{verdict}"
    );

    let out = info("python3", &["--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["pytorch"]["python"], "python3");
    assert!(v["pytorch"]["verdict"]
        .as_str()
        .is_some_and(|s| s.starts_with("verdict: not usable")));
}

#[test]
fn info_pytorch_outside_the_packages_python_names_vmmalloc_python() {
    // A Python without the package: python3 with an empty PYTHONPATH (the
    // check is moot where python3 itself has vmmalloc installed).
    let empty = common::tmpdir("nopkg");
    let has_it = Command::new("python3")
        .args(["-c", "import vmmalloc"])
        .env("PYTHONPATH", &empty)
        .output()
        .map_or(true, |o| o.status.success());
    if has_it {
        eprintln!("python3 has the vmmalloc package installed: nothing to check");
        return;
    }
    let line = check_line(&info_with("python3", &empty, &[]));
    assert!(
        line.contains("No module named vmmalloc")
            && line.contains("pip install ./python")
            && line.contains("VMMALLOC_PYTHON=.venv/bin/python"),
        "{line}"
    );
}
