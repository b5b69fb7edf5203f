//! The C ABI as a C caller (and PyTorch) sees it: `libvmmalloc.so` loaded
//! with libloading, driven over `device:host` (real CPU memory behind the
//! pointers) and `device:sim`.
//!
//! The library's state is per process, so tests that share this process take
//! [`serial`] and start from `vmmalloc_reset_for_tests` + `vmmalloc_configure`;
//! tests of how `VMMALLOC_CONF` itself is read run in a child process (this
//! binary re-executed on one test, see [`in_child`]).
//!
//! Every behaviour test runs over the four backends. A backend whose policy
//! still answers "not implemented" is skipped with a `SKIP` line (set
//! `VMMALLOC_TEST_REQUIRE_ALL_BACKENDS=1` to make that a failure).

#![deny(clippy::undocumented_unsafe_blocks)]

use libloading::Library;
use serde_pickle::{HashableValue, Value};
use std::collections::{BTreeMap, HashSet};
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

const MIB: usize = 1 << 20;
const BACKENDS: [&str; 4] = ["expandable", "caching", "torch-es", "native"];

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void, *mut *mut c_void) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);

/// Function pointers into the loaded library (which is never unloaded).
struct Api {
    malloc: MallocFn,
    free: FreeFn,
    init: unsafe extern "C" fn(c_int),
    empty_cache: unsafe extern "C" fn(),
    set_memory_fraction: unsafe extern "C" fn(c_double, c_int),
    record_stream: unsafe extern "C" fn(*mut c_void, *mut c_void),
    stats_json: unsafe extern "C" fn(c_int) -> *mut c_char,
    summary: unsafe extern "C" fn(c_int) -> *mut c_char,
    dump_snapshot: unsafe extern "C" fn(*const c_char) -> c_int,
    reset_peak_stats: unsafe extern "C" fn(c_int) -> c_int,
    validate: unsafe extern "C" fn(c_int) -> c_int,
    configure: unsafe extern "C" fn(*const c_char) -> c_int,
    check_config: unsafe extern "C" fn() -> c_int,
    config_json: unsafe extern "C" fn(*const c_char) -> *mut c_char,
    last_error: unsafe extern "C" fn() -> *const c_char,
    version: unsafe extern "C" fn() -> *const c_char,
    free_string: unsafe extern "C" fn(*mut c_char),
    reset: unsafe extern "C" fn(),
    record_history: unsafe extern "C" fn(c_int, usize, c_int) -> c_int,
    history_enabled: unsafe extern "C" fn() -> c_int,
    set_trace_sink: unsafe extern "C" fn(Option<unsafe extern "C" fn(*const TraceEvent)>),
    cache_info: unsafe extern "C" fn(c_int, *mut u64) -> c_int,
}

/// `VmmallocTraceEntry` (crates/capi/src/history.rs), as the trace sink gets it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TraceEvent {
    device: c_int,
    action: c_int,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: i64,
    pool_hi: u64,
    pool_lo: u64,
}

/// The cdylib cargo built for this test run.
fn library_path() -> PathBuf {
    vmmalloc_test_support::built_cdylib("libvmmalloc.so")
}

fn api() -> &'static Api {
    static API: OnceLock<Api> = OnceLock::new();
    API.get_or_init(|| {
        let path = library_path();
        assert!(
            path.is_file(),
            "{} is missing: cargo builds the cdylib before this test",
            path.display()
        );
        // SAFETY: loading our own library runs no initialisers with preconditions.
        let lib = unsafe { Library::new(&path) }
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        let lib: &'static Library = Box::leak(Box::new(lib));
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is declared with this exact C signature in
                // crates/capi/src/lib.rs; the library stays loaded (leaked).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .unwrap_or_else(|e| panic!("symbol {}: {e}", $name))
            };
        }
        Api {
            // Not vmmalloc_malloc: it throws C++ exceptions (tests/shim.rs covers it).
            malloc: sym!("vmmalloc_try_malloc"),
            free: sym!("vmmalloc_free"),
            init: sym!("vmmalloc_init"),
            empty_cache: sym!("vmmalloc_empty_cache"),
            set_memory_fraction: sym!("vmmalloc_set_memory_fraction"),
            record_stream: sym!("vmmalloc_record_stream"),
            stats_json: sym!("vmmalloc_memory_stats_json"),
            summary: sym!("vmmalloc_memory_summary"),
            dump_snapshot: sym!("vmmalloc_dump_snapshot"),
            reset_peak_stats: sym!("vmmalloc_reset_peak_stats"),
            validate: sym!("vmmalloc_validate"),
            configure: sym!("vmmalloc_configure"),
            check_config: sym!("vmmalloc_check_config"),
            config_json: sym!("vmmalloc_config_json"),
            last_error: sym!("vmmalloc_last_error"),
            version: sym!("vmmalloc_version"),
            free_string: sym!("vmmalloc_free_string"),
            reset: sym!("vmmalloc_reset_for_tests"),
            record_history: sym!("vmmalloc_record_history"),
            history_enabled: sym!("vmmalloc_history_enabled"),
            set_trace_sink: sym!("vmmalloc_set_trace_sink"),
            cache_info: sym!("vmmalloc_cache_info"),
        }
    })
}

// Safe wrappers. Each exported function is sound for any argument values
// except the documented pointer contracts, which these wrappers uphold.

fn malloc(size: usize, device: i32) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write; the stream is opaque.
    let rc = unsafe { (api().malloc)(size, device, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc == 0, !out.is_null() || size == 0, "rc {rc}, out {out:p}");
    out
}

/// `vmmalloc_try_malloc`'s code and pointer.
fn malloc_rc(size: usize, device: i32) -> (c_int, *mut c_void) {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write; the stream is opaque.
    let rc = unsafe { (api().malloc)(size, device, std::ptr::null_mut(), &mut out) };
    (rc, out)
}

fn free(ptr: *mut c_void, size: usize, device: i32) {
    // SAFETY: vmmalloc_free accepts any pointer value (unknown ones are reported).
    unsafe { (api().free)(ptr, size, device, std::ptr::null_mut()) }
}

fn last_error() -> Option<String> {
    // SAFETY: no preconditions; the result is NULL or a NUL-terminated string
    // valid until the next call on this thread, copied at once.
    let p = unsafe { (api().last_error)() };
    // SAFETY: see above.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn take_string(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: a non-null result of stats_json/summary is an owned C string,
    // read once and freed once.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { (api().free_string)(p) };
    Some(s)
}

fn stats(device: i32) -> BTreeMap<String, i64> {
    // SAFETY: no preconditions.
    let json = take_string(unsafe { (api().stats_json)(device) })
        .unwrap_or_else(|| panic!("stats_json({device}): {:?}", last_error()));
    serde_json::from_str(&json).expect("stats are a JSON object of integers")
}

fn summary(device: i32) -> Option<String> {
    // SAFETY: no preconditions.
    take_string(unsafe { (api().summary)(device) })
}

fn configure(conf: &str) -> Result<(), String> {
    let c = CString::new(conf).unwrap();
    // SAFETY: `c` is a NUL-terminated string.
    match unsafe { (api().configure)(c.as_ptr()) } {
        0 => Ok(()),
        _ => Err(last_error().expect("a failed configure sets the last error")),
    }
}

fn dump_snapshot(path: &Path) -> Result<(), String> {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated string.
    match unsafe { (api().dump_snapshot)(c.as_ptr()) } {
        0 => Ok(()),
        _ => Err(last_error().expect("a failed dump sets the last error")),
    }
}

fn validate(device: i32) {
    // SAFETY: no preconditions.
    let rc = unsafe { (api().validate)(device) };
    assert_eq!(rc, 0, "validate({device}): {:?}", last_error());
}

fn reset() {
    // SAFETY: no preconditions; callers hold `serial` and drop all pointers first.
    unsafe { (api().reset)() }
}

/// Serialises the tests that share this process's library state.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts from a fresh state configured with `conf`.
fn fresh(conf: &str) {
    reset();
    configure(conf).unwrap_or_else(|e| panic!("configure({conf}): {e}"));
}

/// Configures `backend` over a host device with `extra` options, or returns
/// false (after printing SKIP) if that policy is not implemented yet.
fn setup(backend: &str, extra: &str) -> bool {
    let conf = format!("device:host,capacity_gb:1,log:off,backend:{backend}{extra}");
    fresh(&conf);
    let p = malloc(4096, 0);
    if p.is_null() {
        let e = last_error().unwrap_or_default();
        if e.contains("not implemented")
            && std::env::var_os("VMMALLOC_TEST_REQUIRE_ALL_BACKENDS").is_none()
        {
            eprintln!("SKIP: backend {backend} is not implemented yet ({e})");
            return false;
        }
        panic!("{conf}: first malloc failed: {e}");
    }
    free(p, 4096, 0);
    assert_eq!(last_error(), None);
    fresh(&conf);
    true
}

fn fill(p: *mut c_void, len: usize, seed: u8) {
    // SAFETY: `p` is a live host-device allocation of at least `len` bytes
    // (device:host backs pointers with real, writable memory).
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), seed, len) }
}

fn check(p: *mut c_void, len: usize, seed: u8) {
    // SAFETY: as in `fill`; reading initialised bytes we wrote.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    if let Some(i) = bytes.iter().position(|b| *b != seed) {
        panic!("byte {i} of {p:p} is {:#x}, wrote {seed:#x}", bytes[i]);
    }
}

/// Runs the calling test in a child process with `env` (this binary,
/// filtered to `test`), and returns true in the child, where the body should
/// run; in the parent it checks the child passed and returns false.
fn in_child(test: &str, env: &[(&str, &str)]) -> bool {
    if std::env::var("VMMALLOC_CAPI_CHILD").as_deref() == Ok(test) {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("VMMALLOC_CAPI_CHILD", test)
        .env_remove("VMMALLOC_CONF")
        .envs(env.iter().copied())
        .output()
        .expect("re-exec the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {test} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child did not run {test}:\n{text}"
    );
    false
}

// ---------------------------------------------------------------------------
// Allocation, writing, freeing
// ---------------------------------------------------------------------------

#[test]
fn allocations_are_writable_disjoint_and_freed() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        let sizes = [
            1usize,
            511,
            512,
            4096,
            MIB,
            MIB + 1,
            3 * MIB,
            20 * MIB + 7,
            64 * MIB,
        ];
        let mut live = Vec::new();
        for (i, &s) in sizes.iter().enumerate() {
            let p = malloc(s, 0);
            assert!(!p.is_null(), "{backend}: malloc({s}): {:?}", last_error());
            assert_eq!(last_error(), None);
            fill(p, s, i as u8 + 1);
            live.push((p, s, i as u8 + 1));
            validate(0);
        }
        let mut ranges: Vec<(usize, usize)> = live.iter().map(|(p, s, _)| (p.addr(), *s)).collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{backend}: {w:x?} overlap");
        }
        for &(p, s, seed) in &live {
            check(p, s, seed);
        }
        let st = stats(0);
        assert_eq!(
            st["allocation.all.current"],
            sizes.len() as i64,
            "{backend}"
        );
        assert_eq!(
            st["requested_bytes.all.current"],
            sizes.iter().sum::<usize>() as i64,
            "{backend}"
        );
        assert!(
            st["allocated_bytes.all.current"] >= st["requested_bytes.all.current"],
            "{backend}"
        );
        assert!(
            st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"],
            "{backend}"
        );
        // Free every other one, allocate again, and check the survivors' bytes.
        for &(p, s, _) in live.iter().step_by(2) {
            free(p, s, 0);
            assert_eq!(last_error(), None, "{backend}");
        }
        let again = malloc(5 * MIB, 0);
        assert!(!again.is_null(), "{backend}: {:?}", last_error());
        fill(again, 5 * MIB, 0xee);
        for &(p, s, seed) in live.iter().skip(1).step_by(2) {
            check(p, s, seed);
            free(p, s, 0);
        }
        free(again, 5 * MIB, 0);
        validate(0);
        let st = stats(0);
        assert_eq!(st["allocation.all.current"], 0, "{backend}");
        assert_eq!(st["requested_bytes.all.current"], 0, "{backend}");
        assert_eq!(
            st["requested_bytes.all.peak"] as usize,
            sizes.iter().sum::<usize>(),
            "{backend}"
        );
        // empty_cache leaves no reserved memory that holds no allocation.
        // SAFETY: no preconditions.
        unsafe { (api().empty_cache)() };
        assert_eq!(last_error(), None, "{backend}");
        validate(0);
    }
    reset();
}

#[test]
fn concurrent_threads_allocate_write_and_free() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        std::thread::scope(|s| {
            for t in 0..8u8 {
                s.spawn(move || {
                    let mut held: Vec<(usize, usize)> = Vec::new();
                    let mut x = 0x9e37_79b9u32.wrapping_mul(t as u32 + 1);
                    for i in 0..300 {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        if held.len() > 6 || (x.is_multiple_of(3) && !held.is_empty()) {
                            let (p, sz) = held.swap_remove(x as usize % held.len());
                            let p = std::ptr::with_exposed_provenance_mut::<c_void>(p);
                            check(p, sz.min(4096), t);
                            free(p, sz, 0);
                            assert_eq!(last_error(), None, "{backend} thread {t} step {i}");
                        } else {
                            let sz = 1 + (x as usize % (3 * MIB));
                            let p = malloc(sz, 0);
                            assert!(
                                !p.is_null(),
                                "{backend} thread {t}: malloc({sz}): {:?}",
                                last_error()
                            );
                            fill(p, sz.min(4096), t);
                            held.push((p.expose_provenance(), sz));
                        }
                    }
                    for (p, sz) in held {
                        let p = std::ptr::with_exposed_provenance_mut::<c_void>(p);
                        check(p, sz.min(4096), t);
                        free(p, sz, 0);
                    }
                });
            }
        });
        validate(0);
        let st = stats(0);
        assert_eq!(st["allocation.all.current"], 0, "{backend}");
        assert_eq!(st["requested_bytes.all.current"], 0, "{backend}");
        assert!(
            st["allocation.all.allocated"] > 800,
            "{backend}: {}",
            st["allocation.all.allocated"]
        );
    }
    reset();
}

// ---------------------------------------------------------------------------
// Statistics, summary
// ---------------------------------------------------------------------------

#[test]
fn stats_json_has_pytorch_keys_and_right_values() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        let st = stats(0);
        for metric in [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
        ] {
            for pool in ["all", "small_pool", "large_pool"] {
                for field in ["current", "peak", "allocated", "freed"] {
                    let k = format!("{metric}.{pool}.{field}");
                    assert!(st.contains_key(&k), "{backend}: missing {k}");
                }
            }
        }
        for k in [
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "max_split_size",
            "oversize_allocations.current",
            "oversize_segments.peak",
            "vmmalloc.pages_mapped",
            "vmmalloc.pages_pooled",
        ] {
            assert!(st.contains_key(k), "{backend}: missing {k}");
        }
        let a = malloc(100, 0);
        let b = malloc(3 * MIB, 0);
        assert!(
            !a.is_null() && !b.is_null(),
            "{backend}: {:?}",
            last_error()
        );
        let st = stats(0);
        assert_eq!(
            st["requested_bytes.all.current"],
            100 + 3 * MIB as i64,
            "{backend}"
        );
        assert_eq!(st["requested_bytes.small_pool.current"], 100, "{backend}");
        assert_eq!(
            st["requested_bytes.large_pool.current"],
            3 * MIB as i64,
            "{backend}"
        );
        assert_eq!(st["allocation.all.current"], 2, "{backend}");
        assert!(st["num_device_alloc"] >= 1, "{backend}");
        free(b, 3 * MIB, 0);
        let st = stats(0);
        assert_eq!(st["requested_bytes.all.current"], 100, "{backend}");
        assert_eq!(
            st["requested_bytes.all.peak"],
            100 + 3 * MIB as i64,
            "{backend}"
        );
        assert_eq!(st["requested_bytes.all.freed"], 3 * MIB as i64, "{backend}");
        // SAFETY: no preconditions.
        assert_eq!(unsafe { (api().reset_peak_stats)(0) }, 0);
        assert_eq!(stats(0)["requested_bytes.all.peak"], 100, "{backend}");
        free(a, 100, 0);
        // A device not used yet reports zeros; an invalid one is an error.
        fresh(&format!(
            "device:host,capacity_gb:1,log:off,backend:{backend},device_count:2"
        ));
        assert_eq!(stats(1)["allocation.all.current"], 0);
        // SAFETY: no preconditions.
        assert!(unsafe { (api().stats_json)(2) }.is_null());
        assert!(
            last_error().unwrap().contains("invalid device ordinal 2"),
            "{:?}",
            last_error()
        );
    }
    reset();
}

/// The hot path (issue 27) frees through the device the caller names; a
/// pointer of another device, or of none, falls back to the general path,
/// which asks every device: the result is the same as before the hot path.
#[test]
fn a_free_naming_the_wrong_device_still_frees_and_a_bad_pointer_is_still_reported() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, ",device_count:2") {
            continue;
        }
        let on0 = malloc(3 * MIB, 0);
        let on1 = malloc(5 * MIB, 1);
        assert!(!on0.is_null() && !on1.is_null(), "{backend}");
        fill(on0, 3 * MIB, 1);
        fill(on1, 5 * MIB, 2);
        // Device 1's pointer freed as if on device 0, and the other way.
        free(on1, 5 * MIB, 0);
        assert_eq!(last_error(), None, "{backend}");
        assert_eq!(stats(1)["allocation.all.current"], 0, "{backend}");
        check(on0, 3 * MIB, 1);
        free(on0, 3 * MIB, 1);
        assert_eq!(last_error(), None, "{backend}");
        assert_eq!(stats(0)["allocation.all.current"], 0, "{backend}");
        // Freed already: no device owns it any more, whichever is named.
        for device in [0, 1] {
            free(on0, 3 * MIB, device);
            let e = last_error().unwrap_or_else(|| panic!("{backend}: double free set no error"));
            assert!(
                e.contains("not a live allocation of any device"),
                "{backend}: {e}"
            );
        }
        // An invalid ordinal still frees (every device is asked).
        let p = malloc(MIB, 1);
        free(p, MIB, 7);
        assert_eq!(last_error(), None, "{backend}");
        assert_eq!(stats(1)["allocation.all.current"], 0, "{backend}");
        validate(0);
        validate(1);
    }
    reset();
}

#[test]
fn summary_is_pytorch_table_plus_vmmalloc_rows() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        let p = malloc(3 * MIB, 0);
        assert!(!p.is_null());
        let text = summary(0).unwrap_or_else(|| panic!("summary: {:?}", last_error()));
        for l in text.lines() {
            assert_eq!(l.chars().count(), 77, "{backend}: {l:?}");
            assert!(l.starts_with('|') && l.ends_with('|'), "{backend}: {l:?}");
        }
        for needle in [
            "vmmalloc CUDA memory summary, device ID 0",
            "CUDA OOMs: 0",
            "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
            " Requested memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   ",
            " Allocations           |       1    |       1    |       1    |       0    ",
            "      from large pool",
            "Oversize GPU segments",
            &format!("vmmalloc: backend {backend} on host device"),
            "Mapped pages",
            "Pooled pages",
            "Driver calls",
        ] {
            assert!(text.contains(needle), "{backend}: no {needle:?} in\n{text}");
        }
        free(p, 3 * MIB, 0);
    }
    reset();
}

// ---------------------------------------------------------------------------
// Snapshots
// ---------------------------------------------------------------------------

fn get<'a>(v: &'a Value, k: &str) -> &'a Value {
    match v {
        Value::Dict(d) => d
            .get(&HashableValue::String(k.into()))
            .unwrap_or_else(|| panic!("no key {k:?} in {v:?}")),
        _ => panic!("{v:?} is not a dict"),
    }
}

fn int(v: &Value) -> i64 {
    match v {
        Value::I64(i) => *i,
        _ => panic!("{v:?} is not an int"),
    }
}

fn list(v: &Value) -> &Vec<Value> {
    match v {
        Value::List(l) => l,
        _ => panic!("{v:?} is not a list"),
    }
}

fn string(v: &Value) -> &str {
    match v {
        Value::String(s) => s,
        _ => panic!("{v:?} is not a str"),
    }
}

fn read_pickle(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap();
    serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).expect("valid pickle")
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vmmalloc-capi-{}-{name}", std::process::id()))
}

#[test]
fn snapshot_has_pytorch_schema_and_history() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, ",record_history:True") {
            continue;
        }
        let sizes = [1000usize, 2 * MIB, 30 * MIB];
        let ptrs: Vec<_> = sizes.iter().map(|&s| malloc(s, 0)).collect();
        assert!(
            ptrs.iter().all(|p| !p.is_null()),
            "{backend}: {:?}",
            last_error()
        );
        free(ptrs[1], sizes[1], 0);
        let path = tmp(&format!("{backend}.pickle"));
        dump_snapshot(&path).unwrap();
        let snap = read_pickle(&path);

        let mut live: HashSet<(i64, i64)> = HashSet::new();
        for seg in list(get(&snap, "segments")) {
            assert_eq!(int(get(seg, "device")), 0);
            let (addr, total) = (int(get(seg, "address")), int(get(seg, "total_size")));
            assert!(
                ["small", "large"].contains(&string(get(seg, "segment_type"))),
                "{backend}"
            );
            int(get(seg, "stream"));
            for k in ["allocated_size", "active_size", "requested_size"] {
                assert!((0..=total).contains(&int(get(seg, k))), "{backend}: {k}");
            }
            assert!(matches!(get(seg, "is_expandable"), Value::Bool(_)));
            assert!(list(get(seg, "frames")).is_empty());
            // Blocks tile the segment (what _memory_viz.segsum asserts).
            let mut at = addr;
            for b in list(get(seg, "blocks")) {
                assert_eq!(int(get(b, "address")), at, "{backend}: blocks leave a gap");
                let size = int(get(b, "size"));
                let state = string(get(b, "state"));
                assert!(
                    [
                        "active_allocated",
                        "active_pending_free",
                        "inactive",
                        "unmapped"
                    ]
                    .contains(&state),
                    "{backend}: state {state}"
                );
                assert!(int(get(b, "requested_size")) <= size);
                assert!(list(get(b, "frames")).is_empty());
                if state == "active_allocated" {
                    live.insert((at, int(get(b, "requested_size"))));
                }
                at += size;
            }
            assert_eq!(
                at,
                addr + total,
                "{backend}: blocks do not cover the segment"
            );
        }
        let expected: HashSet<(i64, i64)> = [0, 2]
            .iter()
            .map(|&i| (ptrs[i].addr() as i64, sizes[i] as i64))
            .collect();
        assert_eq!(
            live, expected,
            "{backend}: active blocks are the live allocations"
        );

        let traces = list(get(&snap, "device_traces"));
        assert_eq!(traces.len(), 1);
        let events: Vec<(String, i64, i64)> = list(&traces[0])
            .iter()
            .map(|e| {
                for k in ["stream", "time_us"] {
                    int(get(e, k));
                }
                assert!(list(get(e, "frames")).is_empty());
                (
                    string(get(e, "action")).to_string(),
                    int(get(e, "addr")),
                    int(get(e, "size")),
                )
            })
            .collect();
        let user: Vec<_> = events
            .iter()
            .filter(|e| !e.0.starts_with("segment_"))
            .cloned()
            .collect();
        let a = |i: usize| ptrs[i].addr() as i64;
        assert_eq!(
            user,
            vec![
                ("alloc".into(), a(0), sizes[0] as i64),
                ("alloc".into(), a(1), sizes[1] as i64),
                ("alloc".into(), a(2), sizes[2] as i64),
                ("free_requested".into(), a(1), sizes[1] as i64),
                ("free_completed".into(), a(1), sizes[1] as i64),
            ],
            "{backend}"
        );
        // Every allocation lies in memory a segment event made available first.
        // Every allocation lies in memory that segment events made available
        // before it (one event, or adjacent ones that grew a segment).
        for (i, e) in events.iter().enumerate().filter(|(_, e)| e.0 == "alloc") {
            let mut added: Vec<(i64, i64)> = events[..i]
                .iter()
                .filter(|s| s.0 == "segment_alloc" || s.0 == "segment_map")
                .map(|s| (s.1, s.1 + s.2))
                .collect();
            added.sort_unstable();
            let mut reach = e.1;
            for (start, end) in added {
                if start <= reach && end > reach {
                    reach = end;
                }
            }
            assert!(
                reach >= e.1 + e.2,
                "{backend}: alloc at {:#x} has no segment event before it: {events:?}",
                e.1
            );
        }
        let settings = get(&snap, "allocator_settings");
        assert!(string(get(settings, "VMMALLOC_CONF")).contains(&format!("backend:{backend}")));
        assert_eq!(string(get(settings, "backend")), backend);

        // Our own reader takes it back: the live allocations, as written.
        let trace = vmmalloc_trace::pytorch::read_snapshot(&path)
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
        let dev = trace.device(0).expect("device 0");
        assert_eq!(dev.allocs(), 3, "{backend}");
        assert_eq!(
            dev.final_live_bytes(),
            (sizes[0] + sizes[2]) as u64,
            "{backend}"
        );
        assert!(
            dev.pre_trace().is_empty(),
            "{backend}: {:?}",
            dev.pre_trace()
        );

        free(ptrs[0], sizes[0], 0);
        free(ptrs[2], sizes[2], 0);
        std::fs::remove_file(&path).ok();
    }
    reset();
}

#[test]
fn history_is_a_bounded_ring_and_off_by_default() {
    let _g = serial();
    fresh("device:host,capacity_gb:1,log:off,backend:native,record_history:True,max_entries:4");
    let ptrs: Vec<_> = (0..10).map(|i| malloc(4096 + i, 0)).collect();
    let path = tmp("ring.pickle");
    dump_snapshot(&path).unwrap();
    let snap = read_pickle(&path);
    let ev = list(&list(get(&snap, "device_traces"))[0]).clone();
    assert_eq!(ev.len(), 4, "{ev:?}");
    // The newest survive, in order: the last allocation is the last event.
    let last = ev.last().unwrap();
    assert_eq!(string(get(last, "action")), "alloc");
    assert_eq!(int(get(last, "addr")), ptrs[9].addr() as i64);
    for p in ptrs {
        free(p, 0, 0);
    }
    let text = summary(0).unwrap();
    assert!(text.contains("History dropped"), "{text}");

    fresh("device:host,capacity_gb:1,log:off,backend:native");
    let p = malloc(4096, 0);
    dump_snapshot(&path).unwrap();
    let snap = read_pickle(&path);
    assert!(list(&list(get(&snap, "device_traces"))[0]).is_empty());
    assert_eq!(list(get(&snap, "segments")).len(), 1);
    free(p, 4096, 0);
    std::fs::remove_file(&path).ok();
    reset();
}

/// What the trace sink received (tests hold `serial`).
static SUNK: Mutex<Vec<TraceEvent>> = Mutex::new(Vec::new());

unsafe extern "C" fn sink(e: *const TraceEvent) {
    // SAFETY: the library passes a pointer valid for the call.
    let e = unsafe { *e };
    SUNK.lock().unwrap_or_else(|p| p.into_inner()).push(e);
}

fn take_sunk() -> Vec<TraceEvent> {
    std::mem::take(&mut *SUNK.lock().unwrap_or_else(|p| p.into_inner()))
}

fn record_history(enabled: bool, max_entries: usize, flags: c_int) -> c_int {
    // SAFETY: no pointer arguments.
    unsafe { (api().record_history)(c_int::from(enabled), max_entries, flags) }
}

fn history_enabled() -> bool {
    // SAFETY: no arguments.
    unsafe { (api().history_enabled)() == 1 }
}

fn set_sink(on: bool) {
    // SAFETY: `sink` takes a valid pointer, does not unwind and calls no vmmalloc function.
    unsafe { (api().set_trace_sink)(on.then_some(sink as unsafe extern "C" fn(*const TraceEvent))) }
}

/// PyTorch's TraceEntry::Action order, as the snapshot reader lists it: the
/// sink's action codes index it (the same list as crates/capi/src/history.rs ACTIONS).
use vmmalloc_trace::pytorch::ACTIONS;

fn trace_of(snap: &Value) -> Vec<(String, i64, i64)> {
    list(&list(get(snap, "device_traces"))[0])
        .iter()
        .map(|e| {
            (
                string(get(e, "action")).to_string(),
                int(get(e, "addr")),
                int(get(e, "size")),
            )
        })
        .collect()
}

#[test]
fn history_turned_on_at_run_time_feeds_the_sink_from_a_baseline() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        set_sink(true);
        take_sunk();
        assert!(!history_enabled(), "{backend}: off by default");
        // Allocated before recording starts.
        let before = malloc(3 * MIB, 0);
        assert!(!before.is_null(), "{backend}: {:?}", last_error());
        assert!(
            take_sunk().is_empty(),
            "{backend}: nothing recorded while off"
        );
        assert_eq!(record_history(true, usize::MAX, 0), 0, "{:?}", last_error());
        assert!(history_enabled());
        let during = malloc(5 * MIB, 0);
        free(before, 3 * MIB, 0);
        free(during, 5 * MIB, 0);
        let ev = take_sunk();
        let named: Vec<_> = ev
            .iter()
            .map(|e| (ACTIONS[e.action as usize], e.addr, e.size))
            .collect();
        let (b, d) = (before as u64, during as u64);
        let alloc_at = named
            .iter()
            .position(|e| *e == ("alloc", d, 5 * MIB as u64));
        assert!(alloc_at.is_some(), "{backend}: {named:?}");
        // The free of a block allocated before recording carries its size.
        for action in ["free_requested", "free_completed"] {
            assert!(
                named.contains(&(action, b, 3 * MIB as u64)),
                "{backend}: {named:?}"
            );
            assert!(
                named.contains(&(action, d, 5 * MIB as u64)),
                "{backend}: {named:?}"
            );
        }
        // What was mapped before recording is no event: no segment event
        // covers `before` ahead of its free.
        let freed_at = named
            .iter()
            .position(|e| e.0 == "free_requested" && e.1 == b)
            .unwrap();
        for e in &named[..freed_at] {
            if e.0.starts_with("segment_") {
                assert!(
                    !(e.1 <= b && b < e.1 + e.2),
                    "{backend}: {e:?} covers the old block"
                );
            }
        }
        // Device 0, time ordered, valid actions.
        assert!(ev
            .iter()
            .all(|e| e.device == 0 && (0..9).contains(&e.action)));
        assert!(ev.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        // The ring holds the same events as the sink got.
        let path = tmp(&format!("runtime-{backend}.pickle"));
        dump_snapshot(&path).unwrap();
        let trace = trace_of(&read_pickle(&path));
        let expected: Vec<_> = named
            .iter()
            .map(|(a, addr, size)| (a.to_string(), *addr as i64, *size as i64))
            .collect();
        assert_eq!(trace, expected, "{backend}");
        // Off: recording stops and the ring is dropped (PyTorch's recordHistory(false)).
        assert_eq!(record_history(false, usize::MAX, 0), 0);
        assert!(!history_enabled());
        let p = malloc(MIB, 0);
        free(p, MIB, 0);
        assert!(take_sunk().is_empty(), "{backend}");
        dump_snapshot(&path).unwrap();
        assert!(trace_of(&read_pickle(&path)).is_empty(), "{backend}");
        // Sink only: the ring keeps nothing, the sink gets everything; the
        // bound applies to the ring, not the sink.
        assert_eq!(record_history(true, 2, 2), 0);
        let ptrs: Vec<_> = (0..4).map(|i| malloc(MIB + i, 0)).collect();
        for (i, p) in ptrs.into_iter().enumerate() {
            free(p, MIB + i, 0);
        }
        let ev = take_sunk();
        assert!(
            ev.iter().filter(|e| e.action == 0).count() == 4,
            "{backend}: {ev:?}"
        );
        dump_snapshot(&path).unwrap();
        assert!(trace_of(&read_pickle(&path)).is_empty(), "{backend}");
        // A bounded ring keeps the newest.
        assert_eq!(record_history(true, 3, 1), 0);
        let ptrs: Vec<_> = (0..5).map(|i| malloc(4096 + i, 0)).collect();
        dump_snapshot(&path).unwrap();
        let trace = trace_of(&read_pickle(&path));
        assert_eq!(trace.len(), 3, "{backend}: {trace:?}");
        assert_eq!(trace.last().unwrap().1, ptrs[4] as i64);
        for (i, p) in ptrs.into_iter().enumerate() {
            free(p, 4096 + i, 0);
        }
        // Unknown flags are refused and change nothing.
        assert_eq!(record_history(false, 1, 8), -1);
        assert!(
            last_error().unwrap().contains("unknown flags"),
            "{:?}",
            last_error()
        );
        assert!(history_enabled());
        validate(0);
        set_sink(false);
        std::fs::remove_file(&path).ok();
        reset();
        assert!(!history_enabled(), "reset forgets the recording");
    }
}

#[test]
fn history_set_before_the_first_allocation_applies_to_new_devices() {
    let _g = serial();
    fresh("device:host,capacity_gb:1,log:off,backend:expandable,device_count:2");
    set_sink(true);
    take_sunk();
    assert_eq!(record_history(true, 100, 0), 0);
    let p = malloc(MIB, 1);
    assert!(!p.is_null(), "{:?}", last_error());
    free(p, MIB, 1);
    let ev = take_sunk();
    assert!(ev.iter().any(|e| e.action == 0 && e.device == 1), "{ev:?}");
    // Segment events come before the allocation they serve.
    let first_map = ev.iter().position(|e| e.action == 5 || e.action == 3);
    let alloc = ev.iter().position(|e| e.action == 0);
    assert!(first_map.is_some() && first_map < alloc, "{ev:?}");
    set_sink(false);
    reset();
}

fn cache_info(device: c_int, mut largest: u64) -> Result<u64, String> {
    // SAFETY: `largest` is valid for a read and a write.
    match unsafe { (api().cache_info)(device, &mut largest) } {
        0 => Ok(largest),
        _ => Err(last_error().unwrap_or_default()),
    }
}

#[test]
fn cache_info_answers_free_memory_then_what_the_cache_can_serve() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        // A zero guess becomes the device's free bytes (PyTorch's initial guess).
        let guess = cache_info(0, 0).unwrap();
        assert!(
            guess > 512 * MIB as u64 && guess <= 1 << 30,
            "{backend}: {guess}"
        );
        // A 64 MiB block freed stays cached by the caching policies: a
        // request that size is served without creating memory.
        let p = malloc(64 * MIB, 0);
        free(p, 64 * MIB, 0);
        let servable = cache_info(0, 1).unwrap();
        if backend == "native" {
            assert_eq!(servable, 1, "native caches nothing");
        } else {
            assert!(servable >= 64 * MIB as u64, "{backend}: {servable}");
        }
        // A larger guess stays.
        assert_eq!(cache_info(0, 1 << 40).unwrap(), 1 << 40);
        // Bad input.
        assert!(cache_info(99, 0).unwrap_err().contains("99"), "{backend}");
        // SAFETY: NULL is the documented error case.
        assert_eq!(unsafe { (api().cache_info)(0, std::ptr::null_mut()) }, -1);
    }
    reset();
}

// ---------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------

#[test]
fn bad_inputs_are_reported_and_change_nothing() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, ",device_count:2") {
            continue;
        }
        let keep = malloc(MIB, 0);
        assert!(!keep.is_null());
        fill(keep, MIB, 0x5a);
        let before = stats(0);
        let expect_err = |what: &str, needle: &str| {
            let e = last_error().unwrap_or_else(|| panic!("{backend}: {what} set no error"));
            assert!(
                e.contains(needle),
                "{backend}: {what}: {e:?} lacks {needle:?}"
            );
        };

        // NULL free: nothing, like C's free.
        free(std::ptr::null_mut(), 0, 0);
        assert_eq!(last_error(), None, "{backend}");
        // Unknown pointers, inside and outside our memory.
        let bogus = keep.wrapping_byte_add(8);
        free(bogus, 8, 0);
        expect_err("free of an interior pointer", "not a live allocation");
        free(std::ptr::with_exposed_provenance_mut(0xdead_0000), 8, 0);
        expect_err("free of an unknown pointer", "not a live allocation");
        // Double free.
        let p = malloc(4096, 0);
        free(p, 4096, 0);
        assert_eq!(last_error(), None);
        free(p, 4096, 0);
        expect_err("double free", "not a live allocation");
        // Size 0 and absurd sizes.
        assert!(malloc(0, 0).is_null());
        expect_err("size 0", "size 0");
        for size in [
            usize::MAX,
            usize::MAX / 2,
            1 << 50,
            (1 << 50) + 1,
            (1 << 30) + 1,
            1 << 40,
        ] {
            assert!(malloc(size, 0).is_null(), "{backend}: {size}");
            // An out-of-memory report, or the policy's "larger than the device".
            let e = last_error().unwrap_or_default();
            assert!(
                e.contains("out of memory") || e.contains("larger than the device"),
                "{backend}: malloc({size}): {e:?}"
            );
            assert!(e.contains(&format!("size={size}")), "{backend}: {e:?}");
        }
        // Bad ordinals.
        for d in [-1, 2, 64, i32::MAX, i32::MIN] {
            let (rc, p) = malloc_rc(16, d);
            assert!(p.is_null());
            assert_eq!(rc, 2, "{backend}: VMMALLOC_E_INVALID for ordinal {d}");
            expect_err("bad ordinal", &format!("invalid device ordinal {d}"));
        }
        // Beyond any device: out of memory (VMMALLOC_E_OOM).
        assert_eq!(malloc_rc((1 << 50) + 1, 0).0, 1, "{backend}");
        // Wrong device hint on free: found anyway.
        let q = malloc(4096, 1);
        assert!(!q.is_null(), "{backend}: {:?}", last_error());
        free(q, 4096, 0);
        assert_eq!(last_error(), None, "{backend}");
        assert_eq!(stats(1)["allocation.all.current"], 0);
        free(q, 4096, 7);
        expect_err("double free with a bad hint", "not a live allocation");
        // Hooks with bad arguments.
        // SAFETY: the hooks take any values; pointers are opaque to them.
        unsafe {
            (api().record_stream)(bogus, std::ptr::null_mut());
            expect_err(
                "record_stream of an unknown pointer",
                "not a live allocation",
            );
            (api().set_memory_fraction)(2.0, 0);
            expect_err("fraction 2.0", "fraction");
            (api().set_memory_fraction)(0.5, 9);
            expect_err("fraction on a bad ordinal", "invalid device ordinal 9");
            assert_eq!((api().dump_snapshot)(std::ptr::null()), -1);
            expect_err("dump to NULL", "NULL");
            assert_eq!((api().configure)(std::ptr::null()), -1);
            expect_err("configure(NULL)", "NULL");
            assert!((api().summary)(-3).is_null());
            expect_err("summary of a bad ordinal", "invalid device ordinal -3");
            assert_eq!((api().reset_peak_stats)(99), -1);
            (api().free_string)(std::ptr::null_mut());
        }
        assert!(dump_snapshot(Path::new("/nonexistent-dir/x.pickle"))
            .unwrap_err()
            .contains("/nonexistent-dir"));

        // Nothing changed: same stats (but the OOM counter), the kept bytes intact.
        let after = stats(0);
        for k in [
            "allocation.all.current",
            "requested_bytes.all.current",
            "allocated_bytes.all.current",
        ] {
            assert_eq!(before[k], after[k], "{backend}: {k}");
        }
        check(keep, MIB, 0x5a);
        validate(0);
        validate(1);
        free(keep, MIB, 0);
        assert_eq!(last_error(), None);
    }
    reset();
}

/// Under a memory fraction the message reads as PyTorch's: the device's total
/// and free memory, then "<limit> allowed;" (`DeviceCachingAllocator::malloc`
/// in c10/cuda/CUDACachingAllocator.cpp), never the limit as the capacity
/// beside the device's free memory (issue 25: "a total capacity of 8.00 GiB
/// of which 131.20 GiB is free").
#[test]
fn out_of_memory_under_a_memory_fraction_names_the_limit_as_allowed() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        fresh(&format!(
            "device:host,capacity_gb:0.0625,log:off,backend:{backend}"
        ));
        // SAFETY: the library's exported hook, called as PyTorch calls it.
        unsafe { (api().set_memory_fraction)(0.5, 0) };
        let a = malloc(24 * MIB, 0);
        assert!(!a.is_null(), "{backend}: {:?}", last_error());
        assert!(
            malloc(24 * MIB, 0).is_null(),
            "{backend}: 48 MiB fit in 32 allowed"
        );
        let e = last_error().unwrap();
        for needle in [
            "GPU 0 has a total capacity of 64.00 MiB of which ",
            " is free. 32.00 MiB allowed; ",
        ] {
            assert!(e.contains(needle), "{backend}: {e}");
        }
        assert!(!e.contains("total capacity of 32.00 MiB"), "{backend}: {e}");
        free(a, 24 * MIB, 0);
        validate(0);
    }
    reset();
}

#[test]
fn out_of_memory_is_explained_in_pytorch_shape() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, ",record_history:True") {
            continue;
        }
        fresh(&format!(
            "device:host,capacity_gb:0.0625,log:off,backend:{backend},record_history:True"
        ));
        let a = malloc(40 * MIB, 0);
        assert!(!a.is_null(), "{backend}: {:?}", last_error());
        assert!(malloc(40 * MIB, 0).is_null(), "{backend}: 80 MiB fit in 64");
        let e = last_error().unwrap();
        for needle in [
            "Tried to allocate 40.00 MiB",
            "GPU 0 has a total capacity of 64.00 MiB",
            "of which",
        ] {
            assert!(e.contains(needle), "{backend}: {e}");
        }
        assert_eq!(stats(0)["num_ooms"], 1, "{backend}");
        let text = summary(0).unwrap();
        assert!(text.contains("CUDA OOMs: 1 "), "{backend}: {text}");
        let path = tmp(&format!("oom-{backend}.pickle"));
        dump_snapshot(&path).unwrap();
        let snap = read_pickle(&path);
        let ev = list(&list(get(&snap, "device_traces"))[0]);
        let oom = ev
            .iter()
            .find(|e| string(get(e, "action")) == "oom")
            .expect("an oom event");
        assert_eq!(int(get(oom, "size")), 40 * MIB as i64);
        assert_eq!(int(get(oom, "addr")), int(get(oom, "device_free")));
        std::fs::remove_file(&path).ok();
        free(a, 40 * MIB, 0);
        validate(0);
        // After the free, the same request succeeds.
        let b = malloc(40 * MIB, 0);
        assert!(!b.is_null(), "{backend}: {:?}", last_error());
        free(b, 40 * MIB, 0);
    }
    reset();
}

#[test]
fn memory_fraction_limits_the_allocator() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, "") {
            continue;
        }
        // Before any allocation, as torch.cuda.set_per_process_memory_fraction is used.
        // SAFETY: no preconditions.
        unsafe { (api().set_memory_fraction)(0.25, 0) };
        assert_eq!(last_error(), None, "{backend}");
        assert!(
            malloc(300 * MIB, 0).is_null(),
            "{backend}: 300 MiB fit in a quarter of 1 GiB"
        );
        assert!(last_error()
            .unwrap()
            .contains("Tried to allocate 300.00 MiB"));
        let p = malloc(200 * MIB, 0);
        assert!(!p.is_null(), "{backend}: {:?}", last_error());
        free(p, 200 * MIB, 0);
        validate(0);
    }
    reset();
}

#[test]
fn record_stream_and_init_hooks() {
    let _g = serial();
    for backend in BACKENDS {
        if !setup(backend, ",device_count:4") {
            continue;
        }
        let p = malloc(MIB, 0);
        // SAFETY: the hooks take any values.
        unsafe {
            (api().record_stream)(p, std::ptr::null_mut());
            assert_eq!(last_error(), None, "{backend}");
            // PyTorch reports 2 GPUs: ordinals 2 and 3 become invalid.
            (api().init)(2);
            assert_eq!(last_error(), None, "{backend}");
        }
        assert!(!malloc(16, 1).is_null(), "{backend}: {:?}", last_error());
        assert!(malloc(16, 2).is_null());
        assert!(last_error()
            .unwrap()
            .contains("vmmalloc_init reported 2 device(s)"));
        free(p, MIB, 0);
    }
    reset();
}

#[test]
fn sim_devices_are_separate_per_ordinal() {
    let _g = serial();
    fresh("device:sim,device_count:3,log:off,backend:native,record_history:True");
    assert!(
        malloc((80 << 30) + 1, 0).is_null(),
        "more than the 80 GiB device"
    );
    let a = malloc(60 << 30, 0);
    let b = malloc(60 << 30, 2);
    assert!(!a.is_null() && !b.is_null(), "{:?}", last_error());
    assert_eq!(stats(0)["allocation.all.current"], 1);
    assert_eq!(stats(1)["allocation.all.current"], 0);
    assert_eq!(stats(2)["allocation.all.current"], 1);
    let path = tmp("sim.pickle");
    dump_snapshot(&path).unwrap();
    let snap = read_pickle(&path);
    let devices: Vec<i64> = list(get(&snap, "segments"))
        .iter()
        .map(|s| int(get(s, "device")))
        .collect();
    assert_eq!(devices, vec![0, 2]);
    assert_eq!(list(get(&snap, "device_traces")).len(), 3);
    assert!(summary(2).unwrap().contains("on sim device"));
    free(b, 0, 0);
    assert_eq!(last_error(), None, "found on device 2 despite the hint");
    free(a, 0, 0);
    std::fs::remove_file(&path).ok();
    reset();
}

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

/// `vmmalloc_config_json(conf)` as a map (`Err`: the library's error).
fn config_json(conf: Option<&str>) -> Result<BTreeMap<String, String>, String> {
    let c = conf.map(|t| CString::new(t).unwrap());
    let p = c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: NULL or a NUL-terminated string.
    match take_string(unsafe { (api().config_json)(p) }) {
        Some(j) => Ok(serde_json::from_str(&j).expect("a JSON object of strings")),
        None => Err(last_error().expect("a failed config_json sets the last error")),
    }
}

#[test]
fn the_parsed_configuration_is_one_library_call_for_python() {
    let _g = serial();
    reset();
    // `=` and `:` alike, and the last value of a key wins: what Python's
    // no-GPU warning reads (python/vmmalloc/__init__.py asks this call).
    let c = config_json(Some("device=host")).unwrap();
    assert_eq!(c["device"], "host");
    let c = config_json(Some("device:cuda,device:host,max_chunk=20MiB")).unwrap();
    assert_eq!(
        (c["device"].as_str(), c["max_chunk_mb"].as_str()),
        ("host", "20")
    );
    assert_eq!(config_json(Some("")).unwrap()["device"], "cuda");
    let e = config_json(Some("device:host,colour:blue")).unwrap_err();
    assert!(e.contains("unknown key `colour`"), "{e}");
    // NULL: the configuration in effect.
    configure("device=sim,log:off").unwrap();
    assert_eq!(config_json(None).unwrap()["device"], "sim");
    reset();
}

#[test]
fn configure_rejects_bad_text_and_late_calls() {
    let _g = serial();
    reset();
    let e = configure("device:host,colour:blue").unwrap_err();
    assert!(
        e.contains("unknown key `colour`") && e.contains("valid keys: backend, device"),
        "{e}"
    );
    let e = configure("device:host,backend:fast").unwrap_err();
    assert!(
        e.contains("`backend`") && e.contains("expandable | caching | torch-es | native"),
        "{e}"
    );
    fresh("device:host,capacity_gb:1,log:off,backend:native");
    let p = malloc(16, 0);
    assert!(!p.is_null());
    let e = configure("device:sim").unwrap_err();
    assert!(e.contains("before the first allocation"), "{e}");
    assert!(
        summary(0)
            .unwrap()
            .contains("backend native on host device"),
        "still host"
    );
    free(p, 16, 0);
    // SAFETY: no preconditions; the result is a static string.
    let v = unsafe { CStr::from_ptr((api().version)()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    reset();
}

#[test]
fn bad_env_config_fails_the_first_malloc_naming_the_key() {
    if !in_child(
        "bad_env_config_fails_the_first_malloc_naming_the_key",
        &[("VMMALLOC_CONF", "device:host,colour:blue")],
    ) {
        return;
    }
    // SAFETY: no preconditions.
    unsafe { (api().init)(1) };
    let e = last_error().expect("init reports the bad configuration");
    assert!(e.contains("VMMALLOC_CONF: unknown key `colour`"), "{e}");
    assert!(malloc(4096, 0).is_null());
    let e = last_error().unwrap();
    assert!(
        e.contains("unknown key `colour`") && e.contains("valid keys:"),
        "{e}"
    );
    assert!(
        e.contains("record_history") && e.contains("capacity_gb"),
        "lists every key: {e}"
    );
    // SAFETY: no preconditions.
    assert_eq!(unsafe { (api().check_config)() }, -1);
    assert!(malloc(4096, 0).is_null(), "and every later one");
    free(std::ptr::with_exposed_provenance_mut(0x1000), 1, 0);
    assert!(last_error().unwrap().contains("colour"));
}

#[test]
fn bad_env_value_names_the_key_and_valid_values() {
    if !in_child(
        "bad_env_value_names_the_key_and_valid_values",
        &[("VMMALLOC_CONF", "device:host,log:loud")],
    ) {
        return;
    }
    assert!(malloc(4096, 0).is_null());
    let e = last_error().unwrap();
    assert!(
        e.contains("bad value `loud` for key `log`; valid: off | error | info"),
        "{e}"
    );
}

#[test]
fn env_config_is_read_once_at_first_use() {
    if !in_child(
        "env_config_is_read_once_at_first_use",
        &[(
            "VMMALLOC_CONF",
            "device:host, capacity_gb:0.5 ,backend:native,log:off",
        )],
    ) {
        return;
    }
    // SAFETY: no preconditions.
    assert_eq!(unsafe { (api().check_config)() }, 0);
    let p = malloc(MIB, 0);
    assert!(!p.is_null(), "{:?}", last_error());
    fill(p, MIB, 7);
    let text = summary(0).unwrap();
    assert!(text.contains("backend native on host device"), "{text}");
    assert!(text.contains("512.00 MiB"), "capacity_gb:0.5: {text}");
    // Changing the variable later has no effect: the configuration was read once.
    std::env::set_var("VMMALLOC_CONF", "device:sim");
    let q = malloc(MIB, 0);
    fill(q, MIB, 8);
    check(p, MIB, 7);
    free(p, MIB, 0);
    free(q, MIB, 0);
    assert_eq!(last_error(), None);
}

#[test]
fn options_reach_the_policies() {
    let _g = serial();
    // Expandable: page_size_mb sets the page, so a 1 MiB request maps one
    // 4 MiB page (grow_mb:0: no mapping ahead).
    fresh("device:host,capacity_gb:1,log:off,backend:expandable,page_size_mb:4,grow_mb:0");
    let p = malloc(MIB, 0);
    assert!(!p.is_null(), "{:?}", last_error());
    let st = stats(0);
    assert_eq!(st["reserved_bytes.all.current"], 4 * MIB as i64);
    assert_eq!(st["vmmalloc.pages_mapped"], 1);
    assert!(summary(0).unwrap().contains("1 pages (4.00 MiB)"));
    free(p, MIB, 0);
    // By default a growing tail maps ahead to 20 MiB: five 4 MiB pages.
    fresh("device:host,capacity_gb:1,log:off,backend:expandable,page_size_mb:4");
    let p = malloc(MIB, 0);
    assert!(!p.is_null(), "{:?}", last_error());
    assert_eq!(stats(0)["vmmalloc.pages_mapped"], 5);
    free(p, MIB, 0);
    // A page size the device cannot map fails the first allocation, naming it.
    fresh("device:host,capacity_gb:1,log:off,backend:expandable,page_size_mb:3");
    assert!(malloc(MIB, 0).is_null());
    assert!(
        last_error().unwrap().contains("page_size"),
        "{:?}",
        last_error()
    );
    // PyTorch's options reach the caching replica.
    fresh("device:host,capacity_gb:1,log:off,backend:caching,max_split_size_mb:40");
    let p = malloc(MIB, 0);
    assert!(!p.is_null(), "{:?}", last_error());
    assert_eq!(stats(0)["max_split_size"], 40 * MIB as i64);
    free(p, MIB, 0);
    reset();
}

/// `nccl_register` (default True) makes the cuda device's page NCCL's
/// recommended granularity (NCCL's `ncclMemAlloc` pads to it); False keeps
/// the minimum. Over the fake driver with a recommended granularity of 8 MiB
/// and a minimum of 2 MiB, in a child process per setting.
#[test]
fn nccl_register_pages_are_the_recommended_granularity() {
    for (conf, page) in [
        ("log:off", 8 * MIB),
        ("log:off,nccl_register:True", 8 * MIB),
        ("log:off,nccl_register:False", 2 * MIB),
    ] {
        vmmalloc_test_support::in_child(
            "nccl_register_pages_are_the_recommended_granularity",
            &[
                ("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "8192"),
                ("VMMALLOC_CONF", conf),
            ],
            || {
                let _fake = vmmalloc_test_support::FakeCuda::attach();
                // SAFETY: no preconditions.
                unsafe { (api().init)(1) };
                let p = malloc(MIB, 0);
                assert!(!p.is_null(), "{conf}: {:?}", last_error());
                let st = stats(0);
                // Every mapped page has the granularity's size.
                let pages = st["vmmalloc.pages_mapped"];
                assert!(pages >= 1, "{conf}");
                assert_eq!(
                    st["reserved_bytes.all.current"],
                    pages * page as i64,
                    "{conf}"
                );
                fill(p, MIB, 0x5a);
                check(p, MIB, 0x5a);
                free(p, MIB, 0);
                validate(0);
                reset();
            },
        );
    }
}

/// `device:cuda` (the default) over the fake CUDA driver (`tests/fake-cuda`, a
/// CPU implementation of the driver entry points, built on demand by
/// `vmmalloc_test_support::fake_cuda_library`) with two fake devices, as
/// PyTorch would drive it on a two-GPU machine. One child process per backend
/// (`vmmalloc_test_support::in_child`: the fake and this library both keep
/// process-wide state), with `VMMALLOC_CUDA_LIBRARY` pointing at the fake.
#[test]
fn cuda_device_over_the_fake_driver() {
    for backend in BACKENDS {
        let conf = format!("backend:{backend},log:off,record_history:True");
        vmmalloc_test_support::in_child(
            "cuda_device_over_the_fake_driver",
            &[
                ("FAKE_CUDA_DEVICES", "2"),
                ("FAKE_CUDA_CAPACITY_MB", "512,256"),
                ("VMMALLOC_CONF", &conf),
            ],
            || cuda_child(backend),
        );
    }
}

/// Runs in the child of [`cuda_device_over_the_fake_driver`]: allocations on
/// both fake devices, distinct and holding their bytes (the fake backs device
/// memory with real mappings of this process), statistics per device, frees,
/// `validate` of both, a snapshot listing both, and, after a reset, nothing
/// left in the fake on either device.
fn cuda_child(backend: &str) {
    let fake = vmmalloc_test_support::FakeCuda::attach();
    // SAFETY: no preconditions.
    unsafe { (api().init)(2) };
    assert_eq!(last_error(), None);
    // (device, size, fill byte) of each allocation.
    let plan = [
        (0, 3 * MIB, 0x11u8),
        (0, 100, 0x22),
        (1, 5 * MIB + 4096, 0x33),
        (1, 200, 0x44),
    ];
    let ptrs: Vec<*mut c_void> = plan
        .iter()
        .map(|&(dev, size, seed)| {
            let p = malloc(size, dev);
            assert!(
                !p.is_null(),
                "{backend}: malloc({size}, {dev}): {:?}",
                last_error()
            );
            fill(p, size, seed);
            p
        })
        .collect();
    assert!(malloc(16, 2).is_null(), "PyTorch reported two devices");
    assert!(last_error().is_some());
    let mut spans: Vec<(usize, usize)> = ptrs
        .iter()
        .zip(&plan)
        .map(|(p, &(_, size, _))| (p.addr(), p.addr() + size))
        .collect();
    spans.sort_unstable();
    assert!(
        spans.windows(2).all(|w| w[0].1 <= w[1].0),
        "{backend}: distinct, disjoint allocations: {spans:x?}"
    );
    for (p, &(_, size, seed)) in ptrs.iter().zip(&plan) {
        check(*p, size, seed);
    }
    for dev in [0, 1] {
        let st = stats(dev);
        let want: usize = plan.iter().filter(|a| a.0 == dev).map(|a| a.1).sum();
        assert_eq!(
            st["requested_bytes.all.current"], want as i64,
            "{backend}: device {dev}: {st:?}"
        );
        assert_eq!(st["allocation.all.current"], 2, "{backend}: device {dev}");
        assert!(
            st.keys().any(|k| k.starts_with("vmmalloc.driver_calls.")),
            "{backend}: device {dev}: {st:?}"
        );
        let text = summary(dev).unwrap();
        assert!(text.contains("on cuda device"), "{backend}: {text}");
        validate(dev);
    }
    let path = tmp(&format!("cuda-{backend}.pickle"));
    dump_snapshot(&path).unwrap();
    let devices: HashSet<i64> = list(get(&read_pickle(&path), "segments"))
        .iter()
        .map(|seg| int(get(seg, "device")))
        .collect();
    assert_eq!(
        devices,
        HashSet::from([0, 1]),
        "{backend}: snapshot segments"
    );
    let trace = vmmalloc_trace::pytorch::read_snapshot(&path).unwrap();
    for dev in [0, 1] {
        let t = trace
            .device(dev)
            .unwrap_or_else(|| panic!("{backend}: no device {dev} in the snapshot"));
        assert_eq!(t.allocs(), 2, "{backend}: device {dev}");
    }
    std::fs::remove_file(&path).ok();
    for (p, &(dev, size, seed)) in ptrs.iter().zip(&plan) {
        check(*p, size, seed);
        free(*p, size, dev);
        assert_eq!(last_error(), None, "{backend}: free on device {dev}");
    }
    for dev in [0, 1] {
        assert_eq!(stats(dev)["allocated_bytes.all.current"], 0, "{backend}");
        validate(dev);
    }
    // SAFETY: no preconditions.
    unsafe { (api().empty_cache)() };
    assert_eq!(last_error(), None);
    validate(0);
    validate(1);
    // Dropping the allocators and devices gives everything back to the driver.
    reset();
    for dev in [0, 1] {
        fake.check(dev);
        let l = fake.live(dev);
        assert!(
            l.is_all_gone(),
            "{backend}: fake device {dev} still holds {l:?}"
        );
    }
}

// ---------------------------------------------------------------------------
// Fork
// ---------------------------------------------------------------------------

/// Waits for `pid` at most `limit`; kills it and returns None if it hangs.
fn wait_with_timeout(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    let start = std::time::Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: `status` is valid for a write; `pid` is our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(status);
        }
        if start.elapsed() > limit {
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// The body of a forked child: every call fails with the fork error, none
/// hangs (a lock held by a parent thread at fork time is never released).
fn child_checks() -> bool {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write.
    let rc = unsafe { (api().malloc)(4096, 0, std::ptr::null_mut(), &mut out) };
    let forked = |e: Option<String>| e.is_some_and(|e| e.contains("forked"));
    // VMMALLOC_E_UNSUPPORTED: a forked child cannot use the allocator.
    let mut ok = rc == 5 && out.is_null() && forked(last_error());
    free(0x1000 as *mut c_void, 0, 0);
    ok &= forked(last_error());
    // SAFETY: no preconditions.
    ok &= unsafe { (api().stats_json)(0) }.is_null() && forked(last_error());
    // SAFETY: no preconditions.
    unsafe { (api().empty_cache)() };
    ok &= forked(last_error());
    ok
}

#[test]
fn forked_child_gets_an_error_not_a_hang() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let _g = serial();
    for backend in ["expandable", "caching"] {
        if !setup(backend, "") {
            continue;
        }
        fresh(&format!(
            "device:host,capacity_gb:1,log:off,backend:{backend}"
        ));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for t in 0..3usize {
                let stop = &stop;
                s.spawn(move || {
                    let mut i = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let n = (i * 7919 + t * 104729) % (3 * MIB) + 1;
                        let p = malloc(n, 0);
                        if !p.is_null() {
                            free(p, n, 0);
                        }
                        i += 1;
                    }
                });
            }
            for _ in 0..30 {
                std::thread::sleep(std::time::Duration::from_millis(3));
                // SAFETY: the child only calls into the library and _exits.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    let code = if child_checks() { 0 } else { 1 };
                    // SAFETY: leaving the child without running the parent's destructors.
                    unsafe { libc::_exit(code) };
                }
                assert!(pid > 0, "fork failed");
                let status = wait_with_timeout(pid, std::time::Duration::from_secs(20));
                let Some(status) = status else {
                    stop.store(true, Ordering::Relaxed);
                    panic!("{backend}: the forked child hung (killed after 20 s)");
                };
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "{backend}: the child's calls did not all fail with the fork error (status {status})"
                );
            }
            stop.store(true, Ordering::Relaxed);
        });
        // The parent is unaffected.
        let p = malloc(MIB, 0);
        assert!(!p.is_null(), "{:?}", last_error());
        free(p, MIB, 0);
        validate(0);
    }
    reset();
}

#[test]
fn memory_fraction_zero_is_valid_and_allows_nothing() {
    let _g = serial();
    // torch.cuda.set_per_process_memory_fraction accepts 0..=1 inclusive
    // (torch/cuda/memory.py).
    for backend in ["expandable", "caching", "torch-es", "native"] {
        if !setup(backend, "") {
            continue;
        }
        // SAFETY: no preconditions.
        unsafe { (api().set_memory_fraction)(0.0, 0) };
        assert_eq!(last_error(), None, "{backend}: fraction 0 refused");
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` is valid for a write.
        let rc = unsafe { (api().malloc)(MIB, 0, std::ptr::null_mut(), &mut out) };
        assert_eq!(
            rc,
            1,
            "{backend}: 1 MiB under fraction 0: {:?}",
            last_error()
        );
        // PyTorch's allocators name the segment size they asked for
        // (`format_size(alloc_size)` in `DeviceCachingAllocator::malloc`): a
        // 1 MiB request gets a 2 MiB small-pool segment.
        let want = match backend {
            "caching" | "torch-es" => "Tried to allocate 2.00 MiB",
            _ => "Tried to allocate 1.00 MiB",
        };
        let e = last_error().unwrap();
        assert!(e.contains(want), "{backend}: {e}");
        // Back to the whole device.
        // SAFETY: no preconditions.
        unsafe { (api().set_memory_fraction)(1.0, 0) };
        let p = malloc(MIB, 0);
        assert!(!p.is_null(), "{backend}: {:?}", last_error());
        free(p, MIB, 0);
        for bad in [-0.1, 1.5, f64::NAN] {
            // SAFETY: no preconditions.
            unsafe { (api().set_memory_fraction)(bad, 0) };
            assert!(last_error().is_some(), "{backend}: fraction {bad} accepted");
        }
    }
    reset();
}
