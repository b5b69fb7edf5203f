//! `vmmalloc vmm-check` (step 0 of `scripts/gpu-check.sh`) against the fake
//! libcuda (`tests/fake-cuda`): the whole sequence works on each fake device,
//! and a refused call or a driver without devices gives one clear verdict line
//! and a non-zero exit status.

use std::process::{Command, Output};
use vmmalloc_test_support::fake_cuda_library;

fn vmm_check(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .arg("vmm-check")
        .args(args)
        .env("VMMALLOC_CUDA_LIBRARY", fake_cuda_library())
        .envs(env.iter().copied())
        .output()
        .expect("run vmmalloc vmm-check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

fn verdicts(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| l.starts_with("VMM API: "))
        .collect()
}

#[test]
fn the_sequence_works_on_both_fake_devices() {
    for device in ["0", "1"] {
        let (out, text) = vmm_check(&["--device", device], &[("FAKE_CUDA_DEVICES", "2")]);
        assert!(out.status.success(), "{text}");
        for call in [
            "reserve (cuMemAddressReserve): ok",
            "create (cuMemCreate): ok",
            "map (cuMemMap): ok",
            "set access (cuMemSetAccess): ok",
            "compare: ok",
            "unmap (cuMemUnmap): ok",
            "release (cuMemRelease): ok",
            "free reservation (cuMemAddressFree): ok",
        ] {
            assert!(text.contains(call), "missing {call:?}:\n{text}");
        }
        let v = verdicts(&text);
        assert_eq!(v.len(), 1, "{text}");
        assert!(
            v[0].starts_with(&format!("VMM API: supported on device {device} (")),
            "{text}"
        );
    }
}

#[test]
fn a_refused_map_names_the_call_and_says_not_supported() {
    // The first cuMemMap returns CUDA_ERROR_NOT_SUPPORTED (801), as a sandbox
    // without VMM support would.
    let (out, text) = vmm_check(&[], &[("FAKE_CUDA_FAIL", "cuMemMap:1:801")]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("map (cuMemMap): FAILED"), "{text}");
    let v = verdicts(&text);
    assert_eq!(v.len(), 1, "{text}");
    assert!(
        v[0].starts_with("VMM API: NOT supported on device 0")
            && v[0].contains("map (cuMemMap) failed: "),
        "{text}"
    );
    // Nothing after the failing call was attempted.
    assert!(!text.contains("set access"), "{text}");
}

#[test]
fn no_device_says_not_usable() {
    let (out, text) = vmm_check(&[], &[("FAKE_CUDA_DEVICES", "0")]);
    assert!(!out.status.success(), "{text}");
    let v = verdicts(&text);
    assert_eq!(v.len(), 1, "{text}");
    assert!(
        v[0].starts_with("VMM API: NOT usable here: open device"),
        "{text}"
    );
}

#[test]
fn a_missing_driver_says_not_usable() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .arg("vmm-check")
        .env("VMMALLOC_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")
        .output()
        .expect("run vmmalloc vmm-check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("VMM API: NOT usable here: open device")),
        "{text}"
    );
}
