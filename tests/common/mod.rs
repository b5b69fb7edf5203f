//! What the CLI tests share: running the `vmmalloc` binary cargo built for
//! them, reading its output, and a fresh temporary directory per test.
//! Each test file includes it (`mod common;`) and uses a part of it.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The CLI under test, without `RUST_BACKTRACE` (a test that wants it sets it).
pub fn cli() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vmmalloc"));
    c.env_remove("RUST_BACKTRACE");
    c
}

/// Runs the CLI with `args`.
pub fn run(args: &[&str]) -> Output {
    cli().args(args).output().unwrap()
}

/// Standard output as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Standard error as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts that the run of the CLI with `args` that gave `o` succeeded
/// (showing both outputs if not); returns `o`.
pub fn succeeded(args: &[&str], o: Output) -> Output {
    assert!(
        o.status.success(),
        "vmmalloc {args:?} failed:\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    o
}

/// Runs the CLI and asserts success (showing both outputs if not).
pub fn run_ok(args: &[&str]) -> Output {
    succeeded(args, run(args))
}

/// Runs the CLI, asserts success, returns standard output.
pub fn ok(args: &[&str]) -> String {
    stdout(&run_ok(args))
}

/// An empty directory of this test binary and `name`, in the system's
/// temporary directory (emptied first).
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "vmmalloc-{}-{name}-{}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
