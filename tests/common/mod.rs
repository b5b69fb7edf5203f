//! What the CLI tests share: running the `vmmalloc` binary cargo built for
//! them, reading its output, and a fresh temporary directory per test.
//! Each test file includes it (`mod common;`) and uses a part of it.

#![allow(dead_code)]

pub mod conclusion;

use std::path::{Path, PathBuf};
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
/// temporary directory (emptied first), removed with everything in it when
/// the returned guard is dropped, at the end of the test (so `cargo test`
/// leaves no folder behind; a failed test's folder goes too, its paths are
/// in the failure message).
pub fn tmpdir(name: &str) -> TmpDir {
    let d = std::env::temp_dir().join(format!(
        "vmmalloc-{}-{name}-{}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TmpDir(d)
}

/// A temporary directory that is removed when dropped ([`tmpdir`]); it
/// derefs to its path.
#[derive(Debug)]
pub struct TmpDir(PathBuf);

impl std::ops::Deref for TmpDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TmpDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TmpDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The CLI with `RUST_BACKTRACE=1`, as many Rust users (and some machines)
/// have it set: user errors must stay one line anyway.
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vmmalloc"));
    c.env("RUST_BACKTRACE", "1");
    c
}

/// Runs the CLI with `RUST_BACKTRACE=1` ([`bin`]).
pub fn run_bt(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

/// Runs the CLI with `RUST_BACKTRACE=1`, asserts success, returns standard output.
pub fn ok_bt(args: &[&str]) -> String {
    stdout(&succeeded(args, run_bt(args)))
}

/// Runs a command that must fail with a user error, with `RUST_BACKTRACE=1`:
/// exit status 1 and exactly one line on standard error (`note:` lines
/// aside), `Error: ...`, no backtrace, no panic. Returns that line.
pub fn user_error(args: &[&str]) -> String {
    let o = run_bt(args);
    let err = stderr(&o);
    assert!(
        !o.status.success(),
        "vmmalloc {args:?} succeeded:\n{}",
        stdout(&o)
    );
    assert_eq!(o.status.code(), Some(1), "vmmalloc {args:?}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("note: ")).collect();
    assert_eq!(lines.len(), 1, "vmmalloc {args:?}: not one line:\n{err}");
    assert!(lines[0].starts_with("Error: "), "vmmalloc {args:?}: {err}");
    assert!(
        !err.contains("backtrace") && !err.contains("panicked"),
        "vmmalloc {args:?}: {err}"
    );
    lines[0].to_string()
}
