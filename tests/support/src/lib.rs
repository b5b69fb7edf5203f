//! Test-only helpers shared by the workspace's integration tests (never
//! shipped, `publish = false`).
//!
//! - [`fake_cuda_library`]: the fake libcuda (`tests/fake-cuda`), built on
//!   first use with `cargo build -p fake-cuda` into the calling test binary's
//!   target directory and profile, or the library named by
//!   [`FAKE_LIBRARY_ENV`].
//! - [`in_child`]: runs a test's body in a child process of the test binary,
//!   with its own `FAKE_CUDA_*` environment and `VMMALLOC_CUDA_LIBRARY`
//!   pointing at the fake. The fake keeps its state (configuration, devices,
//!   contexts, call counts) for the life of a process, so every scenario that
//!   configures it differently, or counts its live objects, needs a process
//!   of its own.
//! - [`FakeCuda`]: the fake's test hooks (`fakeCudaLive`, `fakeCudaCheck`,
//!   ...), found in the already loaded library.
//! - [`median`]: the median the benches that time interleaved rounds quote.
//!
//! What the fake proves and what it cannot: `docs/fake-cuda.md`.

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

/// vmm-sys, for tests of crates that do not depend on it themselves
/// (`vmm_sys::Driver::load_from(fake_cuda_library())`).
pub use vmm_sys;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Names a prebuilt fake library: when set (and not empty) nothing is built.
/// [`in_child`] sets it in its children, so they never build.
pub const FAKE_LIBRARY_ENV: &str = "VMMALLOC_FAKE_CUDA";

/// Set by [`in_child`] in a child to the name of the test it runs.
pub const CHILD_ENV: &str = "VMMALLOC_FAKE_CUDA_CHILD";

/// Printed on stderr by a child once its body has run (stdout would split the
/// harness's `test NAME ... ok` line); the parent requires it,
/// so a child that ran nothing is a failure, not a silent pass.
const RAN_MARKER: &str = "vmmalloc-test-support: child body ran";

// ---------------------------------------------------------------------------
// Building and finding the fake

/// The median of `v` (sorted in place; the mean of the middle two for an
/// even count). Panics on an empty `v`.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `target/<profile>` (or `target/<triple>/<profile>`) of the running test
/// binary, which lives in its `deps/`. Binaries and cdylibs of the workspace
/// (`vmmalloc`, `libcuda.so`) are built here.
///
/// # Panics
/// When the running executable is not in a `deps/` directory of a profile.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .unwrap_or_else(|| panic!("{} is not in target/<profile>/deps", exe.display()))
        .to_path_buf()
}

/// The cdylib `file` (e.g. `libvmmalloc.so`) cargo built for this test run:
/// `target/<profile>/deps/<file>`, next to the running test binary (`cargo
/// test` does not always refresh the copy in `target/<profile>/`, so that one
/// is only the fallback).
pub fn built_cdylib(file: &str) -> PathBuf {
    let fresh = profile_dir().join("deps").join(file);
    if fresh.is_file() {
        return fresh;
    }
    profile_dir().join(file)
}

/// The workspace's `Cargo.toml` (this crate is `tests/support`, two levels down).
fn workspace_manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml")
}

/// Builds the fake with `cargo build -p fake-cuda` into the running test
/// binary's target directory and profile (and target triple when
/// cross-compiling), and returns the path of `libcuda.so`. A no-op build when
/// it is up to date.
fn build_fake() -> Result<PathBuf, String> {
    let dir = profile_dir();
    let profile = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("unnamed profile directory")?
        .to_owned();
    let parent = dir.parent().ok_or("no target directory")?;
    // target/<triple>/<profile> when cross-compiling: the target directory
    // holds CACHEDIR.TAG, a triple directory does not.
    let (target_dir, triple) = if parent.join("CACHEDIR.TAG").exists() {
        (parent.to_path_buf(), None)
    } else {
        let triple = parent
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned);
        (
            parent.parent().ok_or("no target directory")?.to_path_buf(),
            triple,
        )
    };
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", "fake-cuda", "--manifest-path"])
        .arg(workspace_manifest())
        .arg("--target-dir")
        .arg(&target_dir);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(t) = &triple {
        cmd.args(["--target", t]);
    }
    let out = cmd.output().map_err(|e| format!("running {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let lib = dir.join("libcuda.so");
    if !lib.exists() {
        return Err(format!(
            "{cmd:?} succeeded but {} does not exist",
            lib.display()
        ));
    }
    Ok(lib)
}

/// The fake libcuda (`tests/fake-cuda`): the library named by
/// [`FAKE_LIBRARY_ENV`] if set, else `target/<profile>/libcuda.so`, built
/// once per process with `cargo build -p fake-cuda` (same target directory
/// and profile as the running test binary).
///
/// # Panics
/// When the build fails (with cargo's output).
pub fn fake_cuda_library() -> PathBuf {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| match std::env::var_os(FAKE_LIBRARY_ENV) {
        Some(p) if !p.is_empty() => Ok(PathBuf::from(p)),
        _ => build_fake(),
    })
    .clone()
    .unwrap_or_else(|e| panic!("cannot build the fake libcuda: {e}"))
}

// ---------------------------------------------------------------------------
// Running a test in a child process

/// Whether this process is the child [`in_child`] started for `test_name`.
pub fn is_child(test_name: &str) -> bool {
    std::env::var(CHILD_ENV).as_deref() == Ok(test_name)
}

/// Runs `body` in a child process of the running test binary, over the fake
/// libcuda.
///
/// `test_name` is the path of the calling `#[test]` inside its binary (its
/// function name for a test at the crate root): the child re-runs exactly that
/// test (`--exact --nocapture --test-threads=1`), whose call to `in_child`
/// then runs `body`.
///
/// The child's environment is the parent's without any `FAKE_CUDA_*` or
/// `VMMALLOC_CONF` variable, plus [`FAKE_LIBRARY_ENV`] and
/// `VMMALLOC_CUDA_LIBRARY` naming [`fake_cuda_library`], `FAKE_CUDA_TRACE=1`
/// (the fake says on stderr why each failed call failed), and `env` (which
/// may override any of these).
///
/// One test may call `in_child` several times with different `env` (a loop
/// over configurations): each starts its own child, and in a child only the
/// call whose `env` is the child's own runs `body`; the others do nothing.
///
/// # Panics
/// In the parent, when the child fails or did not run `body`, with the
/// child's stdout and stderr.
pub fn in_child(test_name: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    if is_child(test_name) {
        let mine = env
            .iter()
            .all(|(k, v)| std::env::var(k).as_deref() == Ok(*v));
        if mine {
            body();
            eprintln!("{RAN_MARKER}");
        }
        return;
    }
    let lib = fake_cuda_library();
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"]);
    for (k, _) in std::env::vars_os() {
        let k_str = k.to_string_lossy();
        if k_str.starts_with("FAKE_CUDA_") || k_str == "VMMALLOC_CONF" {
            cmd.env_remove(&k);
        }
    }
    cmd.env(CHILD_ENV, test_name)
        .env(FAKE_LIBRARY_ENV, &lib)
        .env(vmm_sys::LIBRARY_ENV, &lib)
        .env("FAKE_CUDA_TRACE", "1")
        .envs(env.iter().copied());
    let out = cmd.output().expect("run the test binary as a child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let ran = stdout.contains(&format!("test {test_name} ... ok"))
        && stdout.contains("1 passed")
        && stderr.contains(RAN_MARKER);
    assert!(
        out.status.success() && ran,
        "child running `{test_name}` with {env:?} failed ({})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
}

// ---------------------------------------------------------------------------
// The fake's test hooks

/// Live objects of one fake device: `FakeCudaLive` of
/// `tests/fake-cuda/src/hooks.rs` (nine `uint64_t`s, in this order).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Live {
    /// Reservations not yet freed.
    pub reservations: u64,
    /// Allocation handles not yet released.
    pub handles: u64,
    /// Mappings not yet unmapped.
    pub mappings: u64,
    /// `cuMemAlloc` allocations not yet freed.
    pub plain_allocs: u64,
    /// Physical memory in use, bytes.
    pub physical_bytes: u64,
    /// Events not yet destroyed.
    pub events: u64,
    /// Streams created (the entry points vmm-sys loads cannot destroy one).
    pub streams: u64,
    /// Outstanding `cuDevicePrimaryCtxRetain`s.
    pub primary_refs: u64,
    /// Objects still live when the primary context was destroyed by its last
    /// release: leaks the driver had to clean up.
    pub destroyed_live: u64,
}

impl Live {
    /// Nothing left but streams (which cannot be destroyed) and context
    /// retains (held by a still open device).
    pub fn is_clean(&self) -> bool {
        Live {
            streams: 0,
            primary_refs: 0,
            ..*self
        } == Live::default()
    }

    /// Clean, no context retained, and nothing was ever cleaned up by a
    /// context's destruction: what every scenario must leave once its
    /// allocators and devices are dropped.
    pub fn is_all_gone(&self) -> bool {
        self.is_clean() && self.primary_refs == 0 && self.destroyed_live == 0
    }
}

type LiveFn = unsafe extern "C" fn(c_int, *mut Live) -> u32;
type CheckFn = unsafe extern "C" fn(c_int) -> u32;
type SubmitFn = unsafe extern "C" fn(*mut c_void, u64, usize) -> u32;
type CallCountFn = unsafe extern "C" fn(*const c_char, *mut u64) -> u32;
type LastErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> u32;
type PinnedFn = unsafe extern "C" fn(*mut u64, *mut u64) -> u32;

/// The fake's test hooks (`fakeCuda*` exports, not in `cuda.h`), resolved in
/// the library at [`fake_cuda_library`]. The dynamic loader hands back the
/// instance already loaded by vmm-sys (same file), so the hooks see the state
/// of the driver the code under test uses; the library stays loaded for the
/// life of the process.
pub struct FakeCuda {
    live: LiveFn,
    check: CheckFn,
    submit: SubmitFn,
    call_count: CallCountFn,
    last_error: LastErrorFn,
    pinned: PinnedFn,
}

impl FakeCuda {
    /// Opens [`fake_cuda_library`] (or finds it loaded) and resolves the hooks.
    ///
    /// # Panics
    /// When the library cannot be loaded or lacks a hook.
    pub fn attach() -> FakeCuda {
        let path = fake_cuda_library();
        // SAFETY: the fake's initialisers have no preconditions; the library is
        // leaked, so the function pointers below stay valid.
        let lib = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the hook is declared with this exact C signature in
                // tests/fake-cuda/src/hooks.rs; the library stays loaded.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .unwrap_or_else(|e| panic!("the fake does not export {}: {e}", $name))
            };
        }
        FakeCuda {
            live: sym!("fakeCudaLive"),
            check: sym!("fakeCudaCheck"),
            submit: sym!("fakeCudaSubmitWork"),
            call_count: sym!("fakeCudaCallCount"),
            last_error: sym!("fakeCudaLastError"),
            pinned: sym!("fakeCudaPinned"),
        }
    }

    /// Live objects of device `ordinal`.
    ///
    /// # Panics
    /// When the hook fails (before `cuInit`, or an ordinal out of range).
    pub fn live(&self, ordinal: i32) -> Live {
        let mut l = Live::default();
        // SAFETY: `l` is a writable FakeCudaLive.
        let rc = unsafe { (self.live)(ordinal, &mut l) };
        assert_eq!(rc, 0, "fakeCudaLive({ordinal}): {}", self.last_error());
        l
    }

    /// Checks device `ordinal`'s model and memfd bookkeeping invariants.
    ///
    /// # Panics
    /// With the broken invariant.
    pub fn check(&self, ordinal: i32) {
        // SAFETY: no pointers.
        let rc = unsafe { (self.check)(ordinal) };
        assert_eq!(rc, 0, "fake device {ordinal}: {}", self.last_error());
    }

    /// Checks device `ordinal` ([`FakeCuda::check`]) and that it holds no
    /// memory object ([`Live::is_clean`]).
    ///
    /// # Panics
    /// Naming what is still live.
    #[track_caller]
    pub fn assert_clean(&self, ordinal: i32) {
        self.check(ordinal);
        let l = self.live(ordinal);
        assert!(l.is_clean(), "fake device {ordinal} still holds {l:?}");
    }

    /// Queues work on `stream` (a raw `CUstream` value, 0 for the null stream)
    /// that uses `[addr, addr + len)`, as a kernel launch would: it completes
    /// at the next synchronize.
    ///
    /// # Panics
    /// When the fake refuses (unknown stream, no current context).
    pub fn submit(&self, stream: u64, addr: u64, len: u64) {
        // SAFETY: the fake validates the stream value itself; nothing is dereferenced.
        let rc = unsafe {
            (self.submit)(
                std::ptr::with_exposed_provenance_mut(stream as usize),
                addr,
                len as usize,
            )
        };
        assert_eq!(rc, 0, "fakeCudaSubmitWork: {}", self.last_error());
    }

    /// Bytes and count of page-locked host allocations (`cuMemHostAlloc`)
    /// not yet freed, process-wide.
    ///
    /// # Panics
    /// When the hook fails.
    pub fn pinned(&self) -> (u64, u64) {
        let (mut b, mut n) = (0u64, 0u64);
        // SAFETY: two writable u64s.
        let rc = unsafe { (self.pinned)(&mut b, &mut n) };
        assert_eq!(rc, 0, "fakeCudaPinned");
        (b, n)
    }

    /// Calls made so far to the CUDA entry point `entry` (e.g. `cuMemCreate`).
    ///
    /// # Panics
    /// When `entry` is not an entry point of the fake.
    pub fn calls(&self, entry: &str) -> u64 {
        let c = CString::new(entry).expect("no NUL in an entry point name");
        let mut n = 0u64;
        // SAFETY: a NUL-terminated string and a writable u64.
        let rc = unsafe { (self.call_count)(c.as_ptr(), &mut n) };
        assert_eq!(rc, 0, "fakeCudaCallCount({entry})");
        n
    }

    /// Why the calling thread's last failed call failed, as the fake says
    /// (empty when none failed).
    pub fn last_error(&self) -> String {
        let mut buf = vec![0 as c_char; 1024];
        // SAFETY: `buf` is writable for its length.
        let rc = unsafe { (self.last_error)(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(rc, 0, "fakeCudaLastError");
        // SAFETY: the hook NUL-terminates within the buffer.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }
}
