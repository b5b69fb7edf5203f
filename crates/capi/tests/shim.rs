//! The C++ shim as PyTorch calls it: `tests/shim_harness.cpp`, compiled here
//! with the `cc` crate's compiler, dlopens `libvmmalloc.so`, catches the
//! exception `vmmalloc_malloc` throws on out-of-memory (and checks its text),
//! checks `on_oom:null` returns NULL, and drives the CUDA graph pool hooks with
//! PyTorch's C++ signatures (a `std::function` stream filter).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cdylib cargo built for this test run.
fn library_path() -> PathBuf {
    vmmalloc_test_support::built_cdylib("libvmmalloc.so")
}

/// Compiles the harness once into the test's temporary directory.
fn harness() -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shim_harness");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/shim_harness.cpp");
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let compiler = cc::Build::new()
        .cpp(true)
        .target(&target)
        .host(&target)
        .opt_level(0)
        .cargo_metadata(false)
        .get_compiler();
    let status = compiler
        .to_command()
        .args(["-std=c++17", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-ldl")
        .status()
        .expect("run the C++ compiler");
    assert!(status.success(), "compiling {} failed", src.display());
    out
}

#[test]
fn cpp_caller_catches_oom_and_drives_graph_pools() {
    let lib = library_path();
    assert!(lib.is_file(), "{} is missing", lib.display());
    let exe = harness();
    for backend in ["expandable", "caching", "torch-es", "native"] {
        let out = Command::new(&exe)
            .arg(&lib)
            .arg(backend)
            .env_remove("VMMALLOC_CONF")
            .output()
            .expect("run the harness");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{backend}:\n{text}");
        assert!(text.contains("ok "), "{backend}:\n{text}");
    }
}
