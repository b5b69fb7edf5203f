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
            a.close(base);
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
    let mut v2 = h.clone();
    v2[8] = 2;
    spawn_consumer(
        test,
        backend,
        &v2,
        4096,
        "vmmalloc IPC handle v2|vmmalloc IPC handle v1",
        &[],
    );
    let mut torch_es = vec![2, b'e'];
    torch_es.extend_from_slice(&[0; 24]);
    spawn_consumer(
        test,
        backend,
        &torch_es,
        4096,
        "expandable-segments|vmmalloc IPC handle v1",
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

/// PyTorch's own expandable-segments handle (`[2]['e'][ShareHeader][fds]`,
/// as PyTorch 2.11 writes it), built here from the descriptors of a vmmalloc
/// export (the producer keeps them open): a vmmalloc consumer maps it with
/// `pidfd_getfd`; another version byte, or a forced socket, fails by name.
fn producer_torch_format(a: &Api, test: &str, backend: &str, _extra: &[(&str, String)]) {
    a.configure(conf(backend));
    let n = 3 * MIB + 100;
    let p = a.malloc(n);
    fill(p, n, 1);
    let h = a.export(p).unwrap();
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
    let (pid, offset, chunks) = (u32_at(16), u64_at(56), u32_at(68) as usize);
    let m = u16::from_le_bytes(h[72..74].try_into().unwrap()) as usize;
    let list: Vec<(u64, u32)> = (0..chunks)
        .map(|i| (u64_at(74 + m + 16 * i), u32_at(74 + m + 16 * i + 8)))
        .collect();
    assert!(
        list.iter().all(|c| c.0 == list[0].0),
        "chunks of one size: {list:?}"
    );
    let mut torch = vec![2u8, b'e'];
    torch.extend_from_slice(&pid.to_le_bytes());
    torch.extend_from_slice(&[0; 4]);
    torch.extend_from_slice(&list[0].0.to_le_bytes());
    torch.extend_from_slice(&(chunks as u64).to_le_bytes());
    for c in &list {
        torch.extend_from_slice(&c.1.to_le_bytes());
    }
    let at = [(OFFSET, offset.to_string())];
    spawn_consumer(test, backend, &torch, n, "ok", &at);
    holds(p, n, 2).expect("the consumer's write, seen by the producer");
    let mut v9 = torch.clone();
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
    spawn_consumer(test, backend, &torch, n, "offers no socket", &at_socket);
    a.free(p);
}

#[test]
fn host_reads_pytorch_expandable_handles() {
    scenario(
        "host_reads_pytorch_expandable_handles",
        "host",
        &[],
        producer_torch_format,
    );
}

#[test]
fn fake_cuda_reads_pytorch_expandable_handles() {
    scenario(
        "fake_cuda_reads_pytorch_expandable_handles",
        "fake",
        &[],
        producer_torch_format,
    );
}
