//! `vmmalloc calibrate` end to end against the fake libcuda (`tests/fake-cuda`):
//! every measurement loop runs, the fit and the cost file are written, and
//! `--cost-file` reads the file back. (The fake's latencies are CPU
//! bookkeeping, so the fitted figures themselves mean nothing here; the fit
//! is checked against known shapes by the unit tests in `src/calibrate.rs`.)

mod common;

use serde_json::Value;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vmmalloc"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("FAKE_CUDA_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn calibrate_fits_and_writes_a_cost_file_that_compare_reads() {
    let lib = vmmalloc_test_support::fake_cuda_library();
    let dir = common::tmpdir("calibrate");
    let file = dir.join("sub").join("gpu-calibration.json");
    let out = bin()
        .args(["calibrate", "--iterations", "3", "--json"])
        .arg(&file)
        // The folder is outside the current directory: created on request.
        .arg("--mkdir")
        .env("VMMALLOC_CUDA_LIBRARY", &lib)
        .env("FAKE_CUDA_CAPACITY_MB", "4096")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("closest preset: "), "{stderr}");
    // Its table and notes fit 100 columns (issue 45), as every command's
    // output; the JSON document's lines too.
    for l in stderr
        .lines()
        .chain(String::from_utf8_lossy(&out.stdout).lines())
    {
        assert!(
            l.chars().count() <= 100,
            "{} columns: {l}",
            l.chars().count()
        );
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    // The printed document is the file.
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed, doc);
    assert_eq!(doc["format"], "vmmalloc-cost-model/2");
    assert!(["h200", "a100", "linear"].contains(&doc["closer_preset"].as_str().unwrap()));
    assert_eq!(doc["not_measured"], serde_json::json!([]));
    let points = doc["points_us"].as_object().unwrap();
    let sizes = |kind: &str| -> Vec<(f64, u64)> {
        points[kind]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["mib"].as_f64().unwrap(), p["handles"].as_u64().unwrap()))
            .collect()
    };
    let one_handle: Vec<(f64, u64)> = [2.0, 20.0, 64.0, 256.0, 1024.0]
        .iter()
        .map(|&m| (m, 1))
        .collect();
    for kind in ["create", "map", "release", "alloc", "free"] {
        assert_eq!(sizes(kind), one_handle, "{kind}");
    }
    for kind in ["set_access", "unmap"] {
        let mut want = one_handle.clone();
        want.extend([(32.0, 16), (512.0, 256)]);
        let mut got = sizes(kind);
        got.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        want.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        // The 1-handle run of 2 MiB is the same point as the 2 MiB handle.
        assert_eq!(got, want, "{kind}");
    }
    for kind in ["reserve", "address_free", "sync", "other"] {
        assert!(points.contains_key(kind), "{kind}");
    }
    // Every part of every kind is a non-negative number.
    for (kind, c) in doc["costs_us"].as_object().unwrap() {
        for part in ["fixed_us", "per_mib_us", "per_handle_us"] {
            let v = c[part].as_f64().unwrap_or(-1.0);
            assert!(v >= 0.0 && v.is_finite(), "{kind}.{part} = {}", c[part]);
        }
    }

    // compare reads the file back.
    let out = bin()
        .args([
            "compare",
            "frag-adversary",
            "--policies",
            "native,expandable",
        ])
        .arg("--cost-file")
        .arg(&file)
        .args(["--json", "-"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cost_model"], file.to_str().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn calibrate_without_a_driver_says_so() {
    let out = bin()
        .args(["calibrate", "--iterations", "3"])
        .env("VMMALLOC_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("calibrate needs an NVIDIA GPU with the CUDA driver")
            && !err.contains("panicked"),
        "{err}"
    );
}
