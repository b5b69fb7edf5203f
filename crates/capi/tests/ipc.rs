//! IPC through the C ABI, across real processes: `vmmalloc_ipc_export` in
//! one process, `vmmalloc_ipc_import` in another, over `device:host` (memfds)
//! and `device:cuda` over the fake libcuda (memfds behind
//! `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`).
//!
//! Each test re-runs this binary on itself in child processes (the
//! library's state is per process): a *producer* child allocates, fills,
//! exports and starts *consumer* children with the handle in the
//! environment; a consumer imports, checks the bytes, writes new ones and
//! closes, or expects an error naming why.

use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::{Command, Output};

const ROLE: &str = "VMMALLOC_IPC_TEST_ROLE";
const HANDLE: &str = "VMMALLOC_IPC_TEST_HANDLE";
const SIZE: &str = "VMMALLOC_IPC_TEST_SIZE";
const EXPECT: &str = "VMMALLOC_IPC_TEST_EXPECT";
const OFFSET: &str = "VMMALLOC_IPC_TEST_OFFSET";
const MIB: usize = 1 << 20;

struct Api {
    _lib: Library,
    configure: unsafe extern "C" fn(*const c_char) -> c_int,
    malloc: unsafe extern "C" fn(usize, c_int, *mut c_void, *mut *mut c_void) -> c_int,
    free: unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void),
    last_error: unsafe extern "C" fn() -> *const c_char,
    export: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut usize) -> c_int,
    export_torch: unsafe extern "C" fn(
        *mut c_void,
        c_int,
        c_int,
        *mut c_void,
        usize,
        *mut usize,
        *mut usize,
    ) -> c_int,
    pool_begin: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    pool_malloc:
        unsafe extern "C" fn(usize, c_int, *mut c_void, u64, u64, *mut *mut c_void) -> c_int,
    pool_end: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    pool_release: unsafe extern "C" fn(c_int, u64, u64) -> c_int,
    import: unsafe extern "C" fn(*const c_void, usize, *mut *mut c_void) -> c_int,
    close: unsafe extern "C" fn(*mut c_void) -> c_int,
    pause: unsafe extern "C" fn(*const c_char, c_int) -> i64,
    set_tag: unsafe extern "C" fn(*const c_char) -> c_int,
}

/// The cdylib cargo built for this test run.
fn library_path() -> PathBuf {
    vmmalloc_test_support::built_cdylib("libvmmalloc.so")
}

fn api() -> Api {
    // SAFETY: loading our own library runs no unusual initializers.
    let lib = unsafe { Library::new(library_path()) }.expect("load libvmmalloc.so");
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is the C ABI's declaration.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.expect($name)
        };
    }
    Api {
        configure: sym!("vmmalloc_configure"),
        malloc: sym!("vmmalloc_try_malloc"),
        free: sym!("vmmalloc_free"),
        last_error: sym!("vmmalloc_last_error"),
        export: sym!("vmmalloc_ipc_export"),
        export_torch: sym!("vmmalloc_ipc_export_torch"),
        pool_begin: sym!("vmmalloc_pool_begin"),
        pool_malloc: sym!("vmmalloc_pool_try_malloc"),
        pool_end: sym!("vmmalloc_pool_end"),
        pool_release: sym!("vmmalloc_pool_release"),
        import: sym!("vmmalloc_ipc_import"),
        close: sym!("vmmalloc_ipc_close"),
        pause: sym!("vmmalloc_pause"),
        set_tag: sym!("vmmalloc_set_tag"),
        _lib: lib,
    }
}

impl Api {
    fn err(&self) -> String {
        // SAFETY: NULL or a NUL-terminated string owned by the library.
        let p = unsafe { (self.last_error)() };
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    fn configure(&self, conf: &str) {
        let c = CString::new(conf).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { (self.configure)(c.as_ptr()) }, 0, "{}", self.err());
    }

    fn malloc(&self, size: usize) -> *mut u8 {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is writable.
        let rc = unsafe { (self.malloc)(size, 0, std::ptr::null_mut(), &mut p) };
        assert_eq!(rc, 0, "malloc({size}): {}", self.err());
        p.cast()
    }

    fn free(&self, p: *mut u8) {
        // SAFETY: a live allocation of this library.
        unsafe { (self.free)(p.cast(), 0, 0, std::ptr::null_mut()) };
        assert_eq!(self.err(), "");
    }

    fn export(&self, p: *mut u8) -> Result<Vec<u8>, String> {
        let mut len = 0usize;
        // SAFETY: NULL buffer asks for the length; `len` is writable.
        if unsafe { (self.export)(p.cast(), std::ptr::null_mut(), 0, &mut len) } != 0 {
            return Err(self.err());
        }
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is writable for `len` bytes.
        let rc = unsafe { (self.export)(p.cast(), buf.as_mut_ptr().cast(), len, &mut len) };
        assert_eq!(rc, 0, "{}", self.err());
        assert_eq!(len, buf.len());
        Ok(buf)
    }

    /// `vmmalloc_ipc_export_torch` for PyTorch `major.minor`: the bytes and offset.
    fn export_torch(&self, p: *mut u8, major: i32, minor: i32) -> Result<(Vec<u8>, usize), String> {
        let (mut len, mut off) = (0usize, 0usize);
        // SAFETY: NULL buffer asks for the length; `len`, `off` are writable.
        let rc = unsafe {
            (self.export_torch)(
                p.cast(),
                major,
                minor,
                std::ptr::null_mut(),
                0,
                &mut len,
                &mut off,
            )
        };
        if rc != 0 {
            return Err(self.err());
        }
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is writable for `len` bytes.
        let rc = unsafe {
            (self.export_torch)(
                p.cast(),
                major,
                minor,
                buf.as_mut_ptr().cast(),
                len,
                &mut len,
                &mut off,
            )
        };
        assert_eq!(rc, 0, "{}", self.err());
        Ok((buf, off))
    }

    fn import(&self, h: &[u8]) -> Result<*mut u8, String> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `h` is readable; `p` writable.
        match unsafe { (self.import)(h.as_ptr().cast(), h.len(), &mut p) } {
            0 => Ok(p.cast()),
            _ => Err(self.err()),
        }
    }

    fn close(&self, p: *mut u8) {
        // SAFETY: a pointer vmmalloc_ipc_import returned.
        assert_eq!(unsafe { (self.close)(p.cast()) }, 0, "{}", self.err());
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Byte `i` of the producer's pattern (`gen` 1) or the consumer's (2).
fn pattern(gen: u8, i: usize) -> u8 {
    (i as u8)
        .wrapping_mul(31)
        .wrapping_add(gen.wrapping_mul(101))
}

fn fill(p: *mut u8, len: usize, gen: u8) {
    for i in 0..len {
        // SAFETY: `p` is mapped read-write for `len` bytes (host memory or
        // the fake's memfd mappings: both are CPU memory of this process).
        unsafe { p.add(i).write_volatile(pattern(gen, i)) };
    }
}

fn holds(p: *const u8, len: usize, gen: u8) -> Result<(), String> {
    for i in 0..len {
        // SAFETY: as in `fill`.
        let v = unsafe { p.add(i).read_volatile() };
        if v != pattern(gen, i) {
            return Err(format!("byte {i}: {v} != {}", pattern(gen, i)));
        }
    }
    Ok(())
}

/// Runs this binary on `test` with `env` added.
fn run_self(test: &str, env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]);
    cmd.env_remove("VMMALLOC_CONF")
        .env_remove("VMMALLOC_IPC_TRANSPORT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the test binary")
}

fn check_ok(what: &str, out: &Output) {
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("1 passed"),
        "{what} failed ({})\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
}

/// The environment of a process on `backend` (`host`, or `cuda` over the fake).
fn backend_env(backend: &str) -> Vec<(&'static str, String)> {
    match backend {
        "host" => vec![],
        "fake" => {
            let lib = vmmalloc_test_support::fake_cuda_library();
            let lib = lib.to_string_lossy().into_owned();
            vec![
                ("VMMALLOC_CUDA_LIBRARY", lib.clone()),
                (vmmalloc_test_support::FAKE_LIBRARY_ENV, lib),
            ]
        }
        _ => unreachable!(),
    }
}

fn conf(backend: &str) -> &'static str {
    match backend {
        "host" => "device:host,capacity_gb:1",
        _ => "device:cuda",
    }
}

/// The consumer: imports `HANDLE`; with `EXPECT=ok` checks the producer's
/// bytes, writes its own and closes; otherwise requires an error containing
/// every `|`-separated part of `EXPECT`.
fn consumer(a: &Api, backend: &str) {
    a.configure(conf(backend));
    let h = unhex(&std::env::var(HANDLE).unwrap());
    let size: usize = std::env::var(SIZE).unwrap().parse().unwrap();
    let expect = std::env::var(EXPECT).unwrap();
    let offset: usize = std::env::var(OFFSET).map_or(0, |v| v.parse().unwrap());
    match a.import(&h) {
        Ok(base) => {
            assert_eq!(expect, "ok", "import succeeded but {expect:?} was expected");
            // SAFETY: a PyTorch handle maps the whole range; the data is `offset` in.
            let p = unsafe { base.add(offset) };
            holds(p, size, 1).expect("the producer's bytes");
            fill(p, size, 2);
            if std::env::var("VMMALLOC_IPC_TEST_TWICE").is_ok() {
                // A second import of the same handle: the same memory.
                let b2 = a.import(&h).expect("a second import");
                // SAFETY: as `base`.
                holds(unsafe { b2.add(offset) }, size, 2).expect("the same bytes");
                a.close(b2);
            }
            a.close(base);
            // SAFETY: a pointer vmmalloc_ipc_import returned, closed above.
            assert_ne!(unsafe { (a.close)(base.cast()) }, 0, "closed twice");
        }
        Err(e) => {
            assert_ne!(expect, "ok", "import failed: {e}");
            for part in expect.split('|') {
                assert!(e.contains(part), "error {e:?} lacks {part:?}");
            }
        }
    }
}

/// Starts a consumer child of `test` for handle `h` of `size` bytes.
fn spawn_consumer(
    test: &str,
    backend: &str,
    h: &[u8],
    size: usize,
    expect: &str,
    extra: &[(&str, String)],
) {
    let mut env = backend_env(backend);
    env.push((ROLE, "consumer".into()));
    env.push((HANDLE, hex(h)));
    env.push((SIZE, size.to_string()));
    env.push((EXPECT, expect.into()));
    env.extend(extra.iter().cloned());
    check_ok(
        &format!("consumer expecting {expect:?}"),
        &run_self(test, &env),
    );
}

/// The producer of the round-trip scenarios: blocks that start inside a
/// chunk and blocks spanning several, each exported, imported by a
/// consumer (with `extra` env), written there and read back here; then
/// freed, after which an import of the old handle fails.
fn producer_round_trip(a: &Api, test: &str, backend: &str, extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let _first = a.malloc(1000);
    let small = a.malloc(3000); // not at the start of its chunk
    let large = a.malloc(45 * MIB + 4096);
    for (p, size) in [(small, 3000), (large, 45 * MIB + 4096)] {
        fill(p, size, 1);
        let h = a.export(p).unwrap();
        assert_eq!(
            a.export(p).unwrap(),
            h,
            "a second export returns the same handle"
        );
        spawn_consumer(test, backend, &h, size, "ok", extra);
        holds(p, size, 2).expect("the consumer's write, seen by the producer");
        a.free(p);
        spawn_consumer(test, backend, &h, size, "freed", extra);
    }
}

fn scenario(
    test: &str,
    backend: &str,
    extra: &[(&str, String)],
    producer: fn(&Api, &str, &str, &[(&str, String)]),
) {
    match std::env::var(ROLE).as_deref() {
        Ok("consumer") => consumer(&api(), backend),
        Ok("stock") => stock_consumer(backend),
        Ok("producer") => producer(&api(), test, backend, extra),
        _ => {
            let mut env = backend_env(backend);
            env.push((ROLE, "producer".into()));
            env.extend(extra.iter().cloned());
            check_ok("producer", &run_self(test, &env));
        }
    }
}

fn socket() -> Vec<(&'static str, String)> {
    vec![("VMMALLOC_IPC_TRANSPORT", "socket".into())]
}

/// `auto` where `pidfd_getfd` answers `EPERM` (as in many containers): the
/// consumer must fall back on the socket.
fn denied() -> Vec<(&'static str, String)> {
    vec![("VMMALLOC_IPC_TRANSPORT", "auto-denied-for-tests".into())]
}

#[test]
fn host_round_trip_pidfd_or_fallback() {
    scenario(
        "host_round_trip_pidfd_or_fallback",
        "host",
        &[],
        producer_round_trip,
    );
}

#[test]
fn host_round_trip_socket() {
    scenario(
        "host_round_trip_socket",
        "host",
        &socket(),
        producer_round_trip,
    );
}

#[test]
fn host_round_trip_falls_back_when_pidfd_is_denied() {
    scenario(
        "host_round_trip_falls_back_when_pidfd_is_denied",
        "host",
        &denied(),
        producer_round_trip,
    );
}

#[test]
fn fake_cuda_round_trip_pidfd_or_fallback() {
    scenario(
        "fake_cuda_round_trip_pidfd_or_fallback",
        "fake",
        &[],
        producer_round_trip,
    );
}

#[test]
fn fake_cuda_round_trip_socket() {
    scenario(
        "fake_cuda_round_trip_socket",
        "fake",
        &socket(),
        producer_round_trip,
    );
}

/// Bad handles: another version, PyTorch's formats, a different backend.
fn producer_bad_handles(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let p = a.malloc(4096);
    fill(p, 4096, 1);
    let h = a.export(p).unwrap();
    let mut v1 = h.clone();
    v1[8] = 1;
    spawn_consumer(
        test,
        backend,
        &v1,
        4096,
        "vmmalloc IPC handle v1|vmmalloc IPC handle v2",
        &[],
    );
    let mut torch_es = vec![2, b'e'];
    torch_es.extend_from_slice(&[0; 24]);
    spawn_consumer(
        test,
        backend,
        &torch_es,
        4096,
        "expandable-segments|vmmalloc IPC handle v2",
        &[],
    );
    let mut other = h.clone();
    other[12] = if backend == "host" { 1 } else { 2 };
    spawn_consumer(test, backend, &other, 4096, "same backend", &[]);
    a.free(p);
}

#[test]
fn host_bad_handles_name_both_formats() {
    scenario(
        "host_bad_handles_name_both_formats",
        "host",
        &[],
        producer_bad_handles,
    );
}

/// A handle whose producer exited: the consumer's import fails.
fn producer_that_exits(a: &Api, _test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let p = a.malloc(4096);
    let h = a.export(p).unwrap();
    println!("HANDLE={}", hex(&h));
}

#[test]
fn producer_exited() {
    let test = "producer_exited";
    if std::env::var(ROLE).is_ok() {
        return scenario(test, "host", &[], producer_that_exits);
    }
    let out = run_self(test, &[(ROLE, "producer".into())]);
    check_ok("exiting producer", &out);
    let so = String::from_utf8_lossy(&out.stdout);
    let h = so
        .lines()
        .find_map(|l| l.split("HANDLE=").nth(1))
        .map(str::trim)
        .expect("the producer printed its handle");
    for extra in [vec![], socket()] {
        spawn_consumer(test, "host", &unhex(h), 4096, "exited", &extra);
    }
}

/// Exported memory is never paused; exporting needs `ipc:true` on cuda
/// (the fake refuses handles created without the POSIX fd type).
fn producer_limits(a: &Api, _test: &str, backend: &str, _extra: &[(&str, String)]) {
    if backend == "fake" {
        a.configure("device:cuda,ipc:false");
        let p = a.malloc(4096);
        let e = a.export(p).unwrap_err();
        assert!(e.contains("ipc"), "{e}");
        a.free(p);
        return;
    }
    a.configure(conf(backend));
    let tag = CString::new("weights").unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { (a.set_tag)(tag.as_ptr()) }, 0, "{}", a.err());
    let p = a.malloc(4 * MIB);
    let empty = CString::new("").unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { (a.set_tag)(empty.as_ptr()) }, 0);
    let _h = a.export(p).unwrap();
    // SAFETY: a valid C string.
    let r = unsafe { (a.pause)(tag.as_ptr(), 0) };
    assert_eq!(r, -1, "pausing exported memory must fail");
    assert!(a.err().contains("exported"), "{}", a.err());
    a.free(p);
    // SAFETY: a valid C string.
    let r = unsafe { (a.pause)(tag.as_ptr(), 0) };
    assert!(r >= 0, "after the free the tag pauses: {}", a.err());
}

#[test]
fn host_exported_memory_is_not_paused() {
    scenario(
        "host_exported_memory_is_not_paused",
        "host",
        &[],
        producer_limits,
    );
}

#[test]
fn fake_cuda_export_needs_ipc() {
    scenario("fake_cuda_export_needs_ipc", "fake", &[], producer_limits);
}

/// PyTorch's `ExpandableSegment::fromShared`, written here independently of
/// the library (c10/cuda/CUDACachingAllocator.cpp; the 2.15 layout read from
/// its `libc10_cuda.so`): `[version]['e']`, then a `ShareHeader` of 24 bytes
/// (version 2: `pid_t pid; size_t segment_size; size_t num_handles`, with
/// padding after `pid`) or 32 bytes (version 3: the same and an `int
/// handle_type`, padded), then an `int` descriptor per handle. Returns
/// (version, pid, segment_size, descriptors).
fn read_like_pytorch(h: &[u8]) -> (u8, u32, u64, Vec<i32>) {
    assert_eq!(h[1], b'e', "an expandable-segments handle");
    let version = h[0];
    let header = match version {
        2 => 24,
        3 => 32,
        v => panic!("version {v}"),
    };
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
    let pid = u32_at(2);
    let segment_size = u64_at(2 + 8);
    let n = u64_at(2 + 16) as usize;
    if version == 3 {
        assert_eq!(u32_at(2 + 24), 1, "handle_type POSIX_FD");
    }
    assert_eq!(h.len(), 2 + header + 4 * n, "header + one int per handle");
    let fds = (0..n).map(|i| u32_at(2 + header + 4 * i) as i32).collect();
    (version, pid, segment_size, fds)
}

/// What stock PyTorch of handle version `version` writes for `pid`'s
/// descriptors, built by hand, with its uninitialized padding as `junk`.
fn stock_handle(version: u8, pid: u32, segment_size: u64, fds: &[i32], junk: u8) -> Vec<u8> {
    let mut v = vec![version, b'e'];
    v.extend_from_slice(&pid.to_le_bytes());
    v.extend_from_slice(&[junk; 4]);
    v.extend_from_slice(&segment_size.to_le_bytes());
    v.extend_from_slice(&(fds.len() as u64).to_le_bytes());
    if version == 3 {
        v.extend_from_slice(&1u32.to_le_bytes());
        v.extend_from_slice(&[junk; 4]);
    }
    for fd in fds {
        v.extend_from_slice(&fd.to_le_bytes());
    }
    v
}

/// Both directions with PyTorch's own expandable-segments format:
/// - what vmmalloc writes for PyTorch 2.15 (version 3) and 2.11 (version 2)
///   reads as PyTorch's `fromShared` reads it, and a consumer maps it;
/// - handles built here the way stock PyTorch 2.11 and 2.15 write them
///   (padding left as junk) are imported by a vmmalloc consumer;
/// - an unknown version and a forced socket fail by name;
/// - a PyTorch whose layout vmmalloc does not know gets vmmalloc's format.
fn producer_torch_format(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let _first = a.malloc(1000);
    let n = 3 * MIB + 100;
    let p = a.malloc(n);
    fill(p, n, 1);
    let mut stock = Vec::new();
    for (minor, version) in [(15, 3u8), (11, 2u8)] {
        let (h, off) = a.export_torch(p, 2, minor).unwrap();
        let (v, pid, seg, fds) = read_like_pytorch(&h);
        assert_eq!(v, version);
        assert_eq!(pid, std::process::id());
        assert!(off as u64 + n as u64 <= seg * fds.len() as u64);
        assert_eq!(&h[6..10], &[0; 4], "padding written as zeros");
        assert_eq!(a.export_torch(p, 2, minor).unwrap(), (h.clone(), off));
        let at = [(OFFSET, off.to_string())];
        spawn_consumer(test, backend, &h, n, "ok", &at);
        holds(p, n, 2).expect("the consumer's write, seen by the producer");
        fill(p, n, 1);
        stock.push((version, pid, seg, fds, off));
    }
    for (version, pid, seg, fds, off) in &stock {
        let h = stock_handle(*version, *pid, *seg, fds, 0xAB);
        let at = [(OFFSET, off.to_string())];
        spawn_consumer(test, backend, &h, n, "ok", &at);
        holds(p, n, 2).expect("the consumer's write, seen by the producer");
        fill(p, n, 1);
    }
    let (version, pid, seg, fds, off) = &stock[0];
    let v3 = stock_handle(*version, *pid, *seg, fds, 0xCD);
    let at = [(OFFSET, off.to_string())];
    let mut v9 = v3.clone();
    v9[0] = 9;
    spawn_consumer(
        test,
        backend,
        &v9,
        n,
        "expandable-segments IPC handle version 9|unknown version",
        &at,
    );
    let mut at_socket = socket();
    at_socket.extend(at.iter().cloned());
    spawn_consumer(test, backend, &v3, n, "offers no socket", &at_socket);
    // PyTorch 2.10: layout not verified, so vmmalloc's own format.
    let (old, off) = a.export_torch(p, 2, 10).unwrap();
    assert!(old.starts_with(b"VMMIPC"), "{:?}", &old[..8]);
    assert_eq!(off, 0);
    // No import after the free: PyTorch's format has no token, so once the
    // producer closed the descriptors their numbers may name anything (as
    // with stock PyTorch, the sender keeps the tensor alive while in flight).
    a.free(p);
}

#[test]
fn host_pytorch_expandable_handles_both_ways() {
    scenario(
        "host_pytorch_expandable_handles_both_ways",
        "host",
        &[],
        producer_torch_format,
    );
}

#[test]
fn fake_cuda_pytorch_expandable_handles_both_ways() {
    scenario(
        "fake_cuda_pytorch_expandable_handles_both_ways",
        "fake",
        &[],
        producer_torch_format,
    );
}

/// `VMMALLOC_IPC_FORMAT`: `torch` refuses what PyTorch's format cannot
/// carry, `vmmalloc` always writes vmmalloc's, a bad value is named.
fn producer_format_choice(a: &Api, _test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let p = a.malloc(4096);
    match std::env::var("VMMALLOC_IPC_FORMAT").as_deref() {
        Ok("torch") => {
            assert_eq!(a.export_torch(p, 2, 15).unwrap().0[..2], [3, b'e']);
            let e = a.export_torch(p, 2, 9).unwrap_err();
            assert!(
                e.contains("VMMALLOC_IPC_FORMAT=torch") && e.contains("2.9"),
                "{e}"
            );
        }
        Ok("vmmalloc") => {
            let (h, off) = a.export_torch(p, 2, 15).unwrap();
            assert!(h.starts_with(b"VMMIPC") && off == 0);
        }
        _ => {
            let e = a.export_torch(p, 2, 15).unwrap_err();
            assert!(e.contains("auto, torch, vmmalloc"), "{e}");
        }
    }
    a.free(p);
}

#[test]
fn host_format_choice() {
    for value in ["torch", "vmmalloc", "bogus"] {
        let test = "host_format_choice";
        if std::env::var(ROLE).is_ok() {
            return scenario(test, "host", &[], producer_format_choice);
        }
        let out = run_self(
            test,
            &[
                (ROLE, "producer".into()),
                ("VMMALLOC_IPC_FORMAT", value.into()),
            ],
        );
        check_ok(value, &out);
    }
}

/// Memory of a CUDA-graph private pool exports like any other.
fn producer_graph_pool(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let (hi, lo) = (1u64, 9u64);
    // SAFETY: plain integers.
    assert_eq!(unsafe { (a.pool_begin)(0, hi, lo) }, 0, "{}", a.err());
    let n = 3 * MIB + 100;
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is writable.
    let rc = unsafe { (a.pool_malloc)(n, 0, std::ptr::null_mut(), hi, lo, &mut p) };
    assert_eq!(rc, 0, "{}", a.err());
    // SAFETY: plain integers.
    assert_eq!(unsafe { (a.pool_end)(0, hi, lo) }, 0, "{}", a.err());
    let p: *mut u8 = p.cast();
    fill(p, n, 1);
    let h = a.export(p).unwrap();
    spawn_consumer(test, backend, &h, n, "ok", &[]);
    holds(p, n, 2).expect("the consumer's write, seen by the producer");
    fill(p, n, 1);
    let (th, off) = a.export_torch(p, 2, 15).unwrap();
    spawn_consumer(test, backend, &th, n, "ok", &[(OFFSET, off.to_string())]);
    a.free(p);
    spawn_consumer(test, backend, &h, n, "freed", &[]);
    // SAFETY: plain integers.
    assert_eq!(unsafe { (a.pool_release)(0, hi, lo) }, 0, "{}", a.err());
}

#[test]
fn host_graph_pool_memory_is_exportable() {
    scenario(
        "host_graph_pool_memory_is_exportable",
        "host",
        &[],
        producer_graph_pool,
    );
}

/// Open descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Distinct chunk descriptors named by a vmmalloc handle (version 2 layout:
/// 78 fixed bytes, the socket name, then 16 bytes per chunk).
fn chunk_fds(h: &[u8]) -> Vec<u32> {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    assert_eq!(u32_at(8), 2, "vmmalloc handle v2");
    let n = u32_at(72) as usize;
    let m = u16::from_le_bytes(h[76..78].try_into().unwrap()) as usize;
    (0..n).map(|i| u32_at(78 + m + 16 * i + 8)).collect()
}

const EXPORTS_N: usize = 10_000;
const EXPORT_SIZE: usize = 128 << 10;

/// Issue 35: 10,000 live exports of tensors that lie inside at most 64
/// physical handles, under `RLIMIT_NOFILE=1024` (set in this child): one
/// descriptor per handle, shared, closed when the exports end.
fn producer_descriptors(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    let lim = libc::rlimit {
        rlim_cur: 1024,
        rlim_max: 1024,
    };
    // SAFETY: `lim` is a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    assert_eq!(backend, "host");
    // 10,000 × 128 KiB = 1.25 GiB of tensors (pages untouched but every
    // 997th), on chunks of up to 20 MiB: about 64 handles.
    a.configure("device:host,capacity_gb:2");
    let ptrs: Vec<*mut u8> = (0..EXPORTS_N).map(|_| a.malloc(EXPORT_SIZE)).collect();
    for (i, &p) in ptrs.iter().enumerate().step_by(997) {
        fill(p, EXPORT_SIZE, 1);
        let _ = i;
    }
    let before = open_fds();
    let mut handles = Vec::with_capacity(EXPORTS_N);
    let mut chunks = std::collections::BTreeSet::new();
    for (i, &p) in ptrs.iter().enumerate() {
        let h = a
            .export(p)
            .unwrap_or_else(|e| panic!("export #{i}: {e} ({} descriptors open)", open_fds()));
        chunks.extend(chunk_fds(&h));
        handles.push(h);
    }
    let during = open_fds();
    let used = during - before;
    println!(
        "MEASURED: {EXPORTS_N} live exports of {EXPORT_SIZE}-byte tensors inside {} physical \
         handles hold {used} new descriptors ({} chunk descriptors + the liveness table + the \
         socket)",
        chunks.len(),
        chunks.len()
    );
    assert!(
        (32..=64).contains(&chunks.len()),
        "{} handles (the test wants about 64)",
        chunks.len()
    );
    assert!(
        used <= chunks.len() + 2,
        "{used} descriptors for {} handles",
        chunks.len()
    );
    for i in (0..EXPORTS_N).step_by(997) {
        spawn_consumer(test, backend, &handles[i], EXPORT_SIZE, "ok", &[]);
        holds(ptrs[i], EXPORT_SIZE, 2).expect("the consumer's write");
    }
    for &p in &ptrs {
        a.free(p);
    }
    let after = open_fds();
    assert!(
        after <= before + 2,
        "{after} open after the frees, {before} before"
    );
    println!("MEASURED: after freeing them {after} descriptors open ({before} before exporting)");
}

#[test]
fn host_ten_thousand_exports_under_rlimit_nofile_1024() {
    scenario(
        "host_ten_thousand_exports_under_rlimit_nofile_1024",
        "host",
        &[],
        producer_descriptors,
    );
}

type CuFn0 = unsafe extern "C" fn(u32) -> c_int;

/// PyTorch's default allocator shares `cudaMalloc` memory as `[version]['c']`
/// followed by a `cudaIpcMemHandle_t` (`cudaIpcGetMemHandle`). The producer
/// here does exactly that through the fake libcuda (`cuMemAlloc`, then
/// `cuIpcGetMemHandle`); a vmmalloc consumer on `device:cuda` opens it with
/// `cuIpcOpenMemHandle` (versions 2 and 3, and a bare 64-byte handle), twice
/// at one pointer; this process cannot open its own handle; a `host`
/// consumer is refused by name; after `cuMemFree` imports fail.
fn producer_legacy(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let path = vmmalloc_test_support::fake_cuda_library();
    // SAFETY: the fake libcuda (already loaded by vmmalloc: the same state).
    let lib = unsafe { Library::new(&path) }.expect("load the fake libcuda");
    macro_rules! sym {
        ($t:ty, $name:literal) => {
            // SAFETY: the signature is cuda.h's.
            *unsafe { lib.get::<$t>(concat!($name, "\0").as_bytes()) }.expect($name)
        };
    }
    let cu_init: CuFn0 = sym!(CuFn0, "cuInit");
    let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int = sym!(
        unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
        "cuDeviceGet"
    );
    let retain: unsafe extern "C" fn(*mut usize, c_int) -> c_int = sym!(
        unsafe extern "C" fn(*mut usize, c_int) -> c_int,
        "cuDevicePrimaryCtxRetain"
    );
    let set_current: unsafe extern "C" fn(usize) -> c_int =
        sym!(unsafe extern "C" fn(usize) -> c_int, "cuCtxSetCurrent");
    let mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int = sym!(
        unsafe extern "C" fn(*mut u64, usize) -> c_int,
        "cuMemAlloc_v2"
    );
    let mem_free: unsafe extern "C" fn(u64) -> c_int =
        sym!(unsafe extern "C" fn(u64) -> c_int, "cuMemFree_v2");
    let get_handle: unsafe extern "C" fn(*mut [u8; 64], u64) -> c_int = sym!(
        unsafe extern "C" fn(*mut [u8; 64], u64) -> c_int,
        "cuIpcGetMemHandle"
    );
    let (mut dev, mut ctx, mut dptr) = (0, 0usize, 0u64);
    let n = 5 * MIB + 300;
    let mut raw = [0u8; 64];
    // SAFETY: cuda.h's contracts: valid out-pointers, a retained context.
    unsafe {
        assert_eq!(cu_init(0), 0);
        assert_eq!(device_get(&mut dev, 0), 0);
        assert_eq!(retain(&mut ctx, dev), 0);
        assert_eq!(set_current(ctx), 0);
        assert_eq!(mem_alloc(&mut dptr, n), 0);
    }
    let p = dptr as *mut u8;
    fill(p, n, 1);
    // SAFETY: `raw` is a writable 64-byte handle.
    assert_eq!(unsafe { get_handle(&mut raw, dptr) }, 0);
    let mut again = [0u8; 64];
    // SAFETY: as above; an interior pointer is refused (cuda.h: "the base").
    assert_eq!(unsafe { get_handle(&mut again, dptr + 4096) }, 1);
    // SAFETY: as above.
    assert_eq!(unsafe { get_handle(&mut again, dptr) }, 0);
    assert_eq!(raw, again, "the same allocation, the same handle");
    fill(p, n, 1);
    // The driver's own rules for the calls PyTorch's cudaIpc path makes.
    /// `CUipcMemHandle` (cuda.h: `struct { char reserved[64]; }`), passed
    /// by value.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct CuIpcMemHandle([u8; 64]);
    let open: unsafe extern "C" fn(*mut u64, CuIpcMemHandle, u32) -> c_int = sym!(
        unsafe extern "C" fn(*mut u64, CuIpcMemHandle, u32) -> c_int,
        "cuIpcOpenMemHandle_v2"
    );
    let close: unsafe extern "C" fn(u64) -> c_int =
        sym!(unsafe extern "C" fn(u64) -> c_int, "cuIpcCloseMemHandle");
    let h = CuIpcMemHandle(raw);
    let mut q = 0u64;
    // SAFETY: valid out-pointer, a handle by value.
    unsafe {
        assert_eq!(
            open(&mut q, h, 0),
            1,
            "Flags must be LAZY_ENABLE_PEER_ACCESS"
        );
        assert_eq!(open(&mut q, h, 1), 201, "not in the exporting process");
        assert_eq!(close(dptr), 1, "not a pointer cuIpcOpenMemHandle returned");
    }
    let c3: Vec<u8> = [3, b'c'].into_iter().chain(raw).collect();
    let c2: Vec<u8> = [2, b'c'].into_iter().chain(raw).collect();
    for h in [&c3, &c2, &raw.to_vec()] {
        spawn_consumer(
            test,
            backend,
            h,
            n,
            "ok",
            &[("VMMALLOC_IPC_TEST_TWICE", "1".into())],
        );
        holds(p, n, 2).expect("the consumer's write, seen by the producer");
        fill(p, n, 1);
    }
    let e = a.import(&c3).unwrap_err();
    assert!(
        e.contains("cudaMalloc IPC handle") && e.contains("CUDA_ERROR_INVALID_CONTEXT"),
        "{e}"
    );
    let host = backend_env("host");
    let mut env = host.clone();
    env.push((ROLE, "consumer-host".into()));
    env.push((HANDLE, hex(&c3)));
    env.push((SIZE, n.to_string()));
    env.push((EXPECT, "needs device:cuda".into()));
    check_ok("host consumer", &run_self(test, &env));
    // SAFETY: a live cuMemAlloc allocation, freed once.
    assert_eq!(unsafe { mem_free(dptr) }, 0);
    spawn_consumer(test, backend, &c3, n, "CUDA_ERROR_INVALID_HANDLE", &[]);
}

#[test]
fn fake_cuda_imports_legacy_cuda_ipc_handles() {
    let test = "fake_cuda_imports_legacy_cuda_ipc_handles";
    if std::env::var(ROLE).as_deref() == Ok("consumer-host") {
        return consumer(&api(), "host");
    }
    scenario(test, "fake", &[], producer_legacy);
}

/// A consumer without vmmalloc that reads a `'e'` handle exactly as stock
/// PyTorch 2.15 does (`ExpandableSegment::fromShared`, reached from
/// `getIpcDevPtr`, c10/cuda/CUDACachingAllocator.cpp): the header
/// ([`read_like_pytorch`]), one descriptor per handle taken with
/// `pidfd_open` + `pidfd_getfd`, a fresh reservation of `segment_size *
/// num_handles`, handle *i* mapped at `base + i * segment_size`, the tensor
/// at `base + OFFSET`. On the fake libcuda through its `cuMem*` calls
/// (`cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`), on
/// `host` with `mmap` of the memfds. Checks the producer's bytes, then
/// writes its own.
fn stock_consumer(backend: &str) {
    let h = unhex(&std::env::var(HANDLE).unwrap());
    let size: usize = std::env::var(SIZE).unwrap().parse().unwrap();
    let offset: usize = std::env::var(OFFSET).unwrap().parse().unwrap();
    let (version, pid, seg, fds) = read_like_pytorch(&h);
    assert_eq!(version, 3);
    let seg = seg as usize;
    let n = fds.len();
    // SAFETY: plain syscalls on integers.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open: {}",
        std::io::Error::last_os_error()
    );
    let mine: Vec<i32> = fds
        .iter()
        .map(|&fd| {
            // SAFETY: as above.
            let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd as libc::c_long, 0) };
            assert!(r >= 0, "pidfd_getfd: {}", std::io::Error::last_os_error());
            r as i32
        })
        .collect();
    let base: *mut u8 = if backend == "host" {
        // SAFETY: a fresh anonymous reservation.
        let b = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                seg * n,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(b, libc::MAP_FAILED);
        for (i, &fd) in mine.iter().enumerate() {
            // SAFETY: MAP_FIXED inside the reservation; `fd` is one handle's memfd.
            let p = unsafe {
                libc::mmap(
                    b.cast::<u8>().add(i * seg).cast(),
                    seg,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        }
        b.cast()
    } else {
        type Cu = libc::c_int;
        let path = std::env::var(vmmalloc_test_support::FAKE_LIBRARY_ENV).unwrap();
        // SAFETY: the fake libcuda; its initializers are plain.
        let lib = Box::leak(Box::new(unsafe { Library::new(path) }.unwrap()));
        macro_rules! f {
            ($name:literal, $t:ty) => {
                // SAFETY: the signature is cuda.h's.
                *unsafe { lib.get::<$t>($name) }.unwrap()
            };
        }
        let init = f!(b"cuInit", unsafe extern "C" fn(u32) -> Cu);
        let retain = f!(
            b"cuDevicePrimaryCtxRetain",
            unsafe extern "C" fn(*mut *mut c_void, Cu) -> Cu
        );
        let set = f!(b"cuCtxSetCurrent", unsafe extern "C" fn(*mut c_void) -> Cu);
        let reserve = f!(
            b"cuMemAddressReserve",
            unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> Cu
        );
        let import = f!(
            b"cuMemImportFromShareableHandle",
            unsafe extern "C" fn(*mut u64, *mut c_void, Cu) -> Cu
        );
        let map = f!(
            b"cuMemMap",
            unsafe extern "C" fn(u64, usize, usize, u64, u64) -> Cu
        );
        let access = f!(
            b"cuMemSetAccess",
            unsafe extern "C" fn(u64, usize, *const [i32; 3], usize) -> Cu
        );
        let mut ctx = std::ptr::null_mut();
        let mut b = 0u64;
        // SAFETY: cuda.h's calls with valid out-pointers; CU_MEM_HANDLE_TYPE_
        // POSIX_FILE_DESCRIPTOR (1) takes the descriptor as the pointer's value;
        // CUmemAccessDesc {location {DEVICE (1), 0}, PROT_READWRITE (3)}.
        unsafe {
            assert_eq!(init(0), 0);
            assert_eq!(retain(&mut ctx, 0), 0);
            assert_eq!(set(ctx), 0);
            assert_eq!(reserve(&mut b, seg * n, 0, 0, 0), 0);
            for (i, &fd) in mine.iter().enumerate() {
                let mut hd = 0u64;
                assert_eq!(import(&mut hd, fd as usize as *mut c_void, 1), 0);
                libc::close(fd);
                assert_eq!(map(b + (i * seg) as u64, seg, 0, hd, 0), 0);
            }
            assert_eq!(access(b, seg * n, &[1, 0, 3], 1), 0);
        }
        b as *mut u8
    };
    // SAFETY: the tensor lies inside the mapping made above.
    let p = unsafe { base.add(offset) };
    holds(p, size, 1).expect("the producer's bytes, read as stock PyTorch reads them");
    fill(p, size, 2);
}

/// Sizes from 1 B to 300 MiB, fresh and (on `host`) after fragmentation
/// (freed blocks between live ones, new ones carved from the holes), on a
/// 1 GiB device
/// whose largest chunk is 128 MiB: every one exported for PyTorch 2.15
/// (re-backed where its chunks differ) is read by [`stock_consumer`] with the
/// producer's bytes, and the consumer's writes are seen here.
fn producer_stock_sizes(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let _first = a.malloc(1000);
    let mut keep = Vec::new();
    let sizes = [
        1,
        4096,
        3 * MIB + 100,
        46 * MIB,
        130 * MIB,
        300 * MIB + 4096,
    ];
    // The fake libcuda's copies are slow (about 5 minutes for both rounds):
    // the fresh round there, both on `host`.
    let rounds = if backend == "host" { 2 } else { 1 };
    for round in 0..rounds {
        for &n in &sizes {
            let p = a.malloc(n);
            fill(p, n, 1);
            let (h, off) = a.export_torch(p, 2, 15).unwrap();
            let mut env = backend_env(backend);
            env.push((ROLE, "stock".into()));
            env.push((HANDLE, hex(&h)));
            env.push((SIZE, n.to_string()));
            env.push((OFFSET, off.to_string()));
            check_ok(
                &format!("stock consumer of {n} bytes"),
                &run_self(test, &env),
            );
            holds(p, n, 2).expect("the consumer's write, seen by the producer");
            if round == 0 && n > 4096 {
                keep.push(a.malloc(5 * MIB + n / 7));
            }
            a.free(p);
        }
    }
    for p in keep {
        a.free(p);
    }
    // Some of them needed re-backing (the 300 MiB block lies on chunks of
    // 128, 128 and 44 MiB in a fresh allocator).
    type Stats = unsafe extern "C" fn(c_int) -> *mut c_char;
    // SAFETY: the library's own symbol, `char* vmmalloc_memory_stats_json(int)`.
    let stats = unsafe { a._lib.get::<Stats>(b"vmmalloc_memory_stats_json") }.unwrap();
    // SAFETY: a NUL-terminated string the library returned (leaked here).
    let json = unsafe { CStr::from_ptr(stats(0)) }
        .to_string_lossy()
        .into_owned();
    let key = "\"vmmalloc.ipc_rebacks\"";
    let at = json.find(key).expect("the stat") + key.len();
    let n: u64 = json[at..]
        .trim_start_matches([':', ' '])
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n >= 1, "re-backings: {n} ({json})");
}

#[test]
fn host_stock_pytorch_consumer_reads_every_size() {
    scenario(
        "host_stock_pytorch_consumer_reads_every_size",
        "host",
        &[],
        producer_stock_sizes,
    );
}

#[test]
fn fake_cuda_stock_pytorch_consumer_reads_every_size() {
    scenario(
        "fake_cuda_stock_pytorch_consumer_reads_every_size",
        "fake",
        &[],
        producer_stock_sizes,
    );
}
