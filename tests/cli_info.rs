//! `vmmalloc info` without a usable CUDA driver: a clear one-line message, the
//! CPU backends listed, exit code 0.

use std::process::{Command, Output};

fn info(library: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .arg("info")
        .args(extra)
        .env("VMMALLOC_CUDA_LIBRARY", library)
        .output()
        .expect("run vmmalloc info")
}

#[test]
fn info_without_driver_says_so_and_exits_0() {
    let out = info("/nonexistent/libcuda.so.1", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let cuda: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("CUDA driver:"))
        .collect();
    assert_eq!(cuda.len(), 1, "{stdout}");
    assert!(
        cuda[0].starts_with("CUDA driver: not found (/nonexistent/libcuda.so.1: "),
        "{stdout}"
    );
    // NVML is reported in one line of its own, found or not.
    assert!(stdout.lines().any(|l| l.starts_with("NVML:")), "{stdout}");
    let backends = stdout
        .lines()
        .find(|l| l.starts_with("backends available:"))
        .unwrap_or_else(|| panic!("no backends line:\n{stdout}"));
    assert_eq!(backends, "backends available: host, sim");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn info_with_a_library_that_is_not_cuda_names_the_symbol() {
    let out = info("libc.so.6", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("CUDA driver: unusable (libc.so.6: missing symbol `cuInit`"),
        "{stdout}"
    );
}

#[test]
fn info_json_without_driver() {
    let out = info("/nonexistent/libcuda.so.1", &["--json"]);
    assert!(out.status.success());
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("info --json prints JSON");
    assert_eq!(v["cuda"]["available"], false);
    assert_eq!(v["cuda"]["library"], "/nonexistent/libcuda.so.1");
    assert!(v["cuda"]["error"]
        .as_str()
        .unwrap()
        .contains("/nonexistent/libcuda.so.1"));
    assert_eq!(v["backends"], serde_json::json!(["host", "sim"]));
    assert!(v["nvml"]["available"].is_boolean());
}

#[test]
fn calibrate_without_driver_fails_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .args(["calibrate", "--iterations", "100"])
        .env("VMMALLOC_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run vmmalloc calibrate");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("calibrate needs an NVIDIA GPU")
            && stderr.contains("/nonexistent/libcuda.so.1"),
        "{stderr}"
    );
}
