//! `libvmmalloc.so`: vmmalloc as a C ABI shared library, for PyTorch's
//! `torch.cuda.memory.CUDAPluggableAllocator` and any other C caller.
//!
//! # The C API
//!
//! ```c
//! // PyTorch's alloc/free pair (CUDAPluggableAllocator(path, "vmmalloc_malloc", "vmmalloc_free")).
//! // vmmalloc_malloc is C++ (src/shim.cpp): it throws on failure unless on_oom:null.
//! void* vmmalloc_malloc(size_t size, int device, void* stream);
//! void  vmmalloc_free(void* ptr, size_t size, int device, void* stream);
//! // The same without exceptions: 0 ok, else a VMMALLOC_E_* code: 1 out of memory,
//! // 2 invalid argument, 3 driver error, 4 allocator failed, 5 unsupported (error.rs).
//! int   vmmalloc_try_malloc(size_t size, int device, void* stream, void** out);
//! // vmmalloc_free saying whether it freed: 0, or -1 (not a live allocation; last error).
//! int   vmmalloc_try_free(void* ptr, size_t size, int device, void* stream);
//! // Region mode (region.rs): a torch.cuda.MemPool's allocator; NULL on failure, never throws.
//! void* vmmalloc_region_malloc(size_t size, int device, void* stream);
//! // CUDA graph pools (PyTorch's hooks are the shim's C++ vmmalloc_begin_allocate_to_pool,
//! // vmmalloc_end_allocate_to_pool, vmmalloc_release_pool, which call these).
//! int   vmmalloc_pool_begin(int device, uint64_t pool_hi, uint64_t pool_lo);
//! int   vmmalloc_pool_try_malloc(size_t size, int device, void* stream,
//!                                uint64_t pool_hi, uint64_t pool_lo, void** out);
//! int   vmmalloc_pool_end(int device, uint64_t pool_hi, uint64_t pool_lo);
//! int   vmmalloc_pool_release(int device, uint64_t pool_hi, uint64_t pool_lo);
//! // PyTorch's hooks: set_init_fn, set_reset_fn, set_memory_fraction_fn, set_record_stream_fn.
//! void  vmmalloc_init(int device_count);
//! void  vmmalloc_empty_cache(void);
//! void  vmmalloc_set_memory_fraction(double fraction, int device);
//! void  vmmalloc_record_stream(void* ptr, void* stream);
//! // Introspection (strings are owned by the caller: free them with vmmalloc_free_string).
//! char* vmmalloc_memory_stats_json(int device);   // PyTorch's memory_stats() keys, plus vmmalloc.*
//! char* vmmalloc_memory_summary(int device);      // PyTorch's memory_summary() table, plus ours
//! int   vmmalloc_dump_snapshot(const char* path); // PyTorch's snapshot pickle; 0 = ok
//! int   vmmalloc_reset_peak_stats(int device);
//! int   vmmalloc_reset_accumulated_stats(int device); // PyTorch's resetAccumulatedStats (accumulated.rs)
//! int   vmmalloc_validate(int device);            // checks the allocator's invariants; 0 = ok
//! // Sleep and wake (src/sleep.rs): tags, pause, resume.
//! int     vmmalloc_set_tag(const char* tag);            // this thread's tag; "" = default
//! char*   vmmalloc_get_tag(void);
//! int64_t vmmalloc_pause(const char* tags, int backup); // bytes given back, or -1
//! int64_t vmmalloc_resume(const char* tags);            // bytes mapped, or -1
//! char*   vmmalloc_tag_stats_json(int device);
//! // Configuration and errors.
//! int   vmmalloc_configure(const char* conf);     // instead of VMMALLOC_CONF; before the first allocation
//! int   vmmalloc_check_config(void);              // 0 if the configuration parses
//! const char* vmmalloc_last_error(void);          // this thread's last error, or NULL; owned by the library
//! const char* vmmalloc_version(void);
//! void  vmmalloc_free_string(char* s);
//! // Growable regions and the memory-pressure callback (growable.rs).
//! void* vmmalloc_growable_create(int device, size_t max_bytes);
//! int   vmmalloc_growable_resize(void* ptr, size_t bytes);      // 0 ok, else a VMMALLOC_E_* code
//! int   vmmalloc_growable_destroy(void* ptr);
//! int   vmmalloc_growable_info(void* ptr, size_t* size, size_t* max_bytes, size_t* mapped);
//! int   vmmalloc_set_pressure_callback(size_t (*fn)(size_t size, int device));
//! // The torch companion's entry points (torch_abi.rs): pool use counts and
//! // checkpoints, live-allocation checks, per-pool stats, DeviceStats, segments.
//! // IPC (ipc/mod.rs): share an allocation with another process, vmmalloc or stock PyTorch.
//! int   vmmalloc_ipc_export(void* ptr, void* buf, size_t cap, size_t* len);
//! int   vmmalloc_ipc_export_torch(void* ptr, int major, int minor, void* buf, size_t cap,
//!                                 size_t* len, size_t* offset);
//! int   vmmalloc_ipc_import(const void* handle, size_t len, void** out);
//! int   vmmalloc_ipc_import_device(const void* handle, size_t len, int device, void** out);
//! int   vmmalloc_ipc_close_on(void* ptr, void* stream);
//! int   vmmalloc_ipc_close(void* ptr);
//! ```
//!
//! `int` results are 0 on success and -1 on failure.
//!
//! # Errors
//!
//! No Rust frame is unwound: every entry point catches panics, and only the
//! C++ shim's `vmmalloc_malloc` throws, after `vmmalloc_try_malloc` returned.
//! A panic fails the device the call was working on for good: every later
//! call on it fails with [`VMMALLOC_E_FAILED`], naming the panic (its state
//! may be half-updated, so nothing is handed out from it again). Every
//! failure is an [`Error`] whose [`ErrorKind`] is its `VMMALLOC_E_*` code
//! and its exception ([`error`]).
//! In a child forked from a process that used the library every call fails
//! at once, taking no lock (`fork.rs`). A
//! failure returns NULL or -1 (or nothing, for the `void` hooks), sets the
//! calling thread's last error (see [`vmmalloc_last_error`]) and logs one line
//! `vmmalloc: error: <call>(<arguments>): <reason>` to stderr (`log:off`
//! silences it). Freeing an unknown or already freed pointer is reported and
//! changes nothing. `vmmalloc_free(NULL, ...)` does nothing, as C's `free`.
//! `vmmalloc_malloc(0, ...)` returns NULL (an empty tensor needs no memory;
//! PyTorch asks for it) and is logged at `info` level only.
//!
//! # State
//!
//! One allocator per device ordinal, created on first use, thread-safe. The
//! configuration ([`config`]) is read once per process, on the first call that
//! needs it; a bad configuration makes every allocation (and `vmmalloc_init`)
//! fail with a message naming the key.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod accumulated;
mod checkpoints;
pub mod config;
mod devices;
mod diag;
mod dump;
pub mod error;
mod fork;
mod growable;
mod history;
pub mod history_abi;
pub mod ipc;
mod region;
mod runtime;
pub mod segments;
pub mod share;
pub mod sleep;
pub mod torch_abi;

pub use config::{keys, Config, ConfigError, DeviceKind, LogLevel, OnOom};
#[doc(hidden)]
pub use devices::{wrap_devices_for_tests, DeviceWrapper};
pub use error::{Error, ErrorKind};
pub use growable::{
    vmmalloc_growable_create, vmmalloc_growable_destroy, vmmalloc_growable_info,
    vmmalloc_growable_resize, vmmalloc_set_pressure_callback, PressureCallback,
};
pub use region::vmmalloc_region_malloc;
pub use runtime::MAX_DEVICES;
pub use share::{vmmalloc_share_info_json, vmmalloc_share_set_cap, vmmalloc_share_set_total};

use config::LogLevel::{Error as LError, Info as LInfo};
use runtime::Runtime;
use std::any::Any;
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use vmmalloc_alloc::pools::PoolId;
use vmmalloc_alloc::{AllocError, Allocation, Stats};
use vmmalloc_device::cuda::stream_key;

// The C++ shim (src/shim.cpp, built by build.rs). Rust never calls these
// (they may throw); the reference keeps the shim's object in the link, and
// exports.map exports its entry points.
extern "C-unwind" {
    fn vmmalloc_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void;
}
#[used]
static KEEP_SHIM: unsafe extern "C-unwind" fn(usize, c_int, *mut c_void) -> *mut c_void =
    vmmalloc_malloc;

/// Requests above this (1 PiB) are refused before any policy sees them.
const MAX_REQUEST: u64 = 1 << 50;

/// Runs an entry point's body: clears the thread's last error, catches any
/// panic (reported as an internal error, returning `on_panic`). A panic marks
/// the device the call was working on failed for good (see `runtime.rs`,
/// `fail_current`): its state may be half-updated, so every later call on it
/// fails, naming this panic, and nothing is handed out from it again.
fn entry<T>(name: &str, on_panic: T, body: impl FnOnce() -> T) -> T {
    entry_with(name, |_| on_panic, body)
}

/// [`entry`] whose result on failure depends on the error's kind:
/// [`ErrorKind::Unsupported`] in a forked child, [`ErrorKind::Failed`] after
/// a panic.
fn entry_with<T>(name: &str, on_error: impl FnOnce(ErrorKind) -> T, body: impl FnOnce() -> T) -> T {
    diag::clear_error();
    runtime::clear_current();
    if fork::forked() {
        // No lock may be taken in a forked child (see fork.rs).
        let m = format!("{name}: {}", fork::MESSAGE);
        diag::set_error(&m);
        if runtime::log_level_unlocked() != LogLevel::Off {
            diag::log_unlocked(&m);
        }
        return on_error(ErrorKind::Unsupported);
    }
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(p) => {
            let text = panic_text(&*p);
            let m = match runtime::fail_current(&format!("a panic in {name}: {text}")) {
                Some(d) => format!(
                    "{name}: internal error (panic: {text}); device {d} is marked failed \
                     and serves nothing any more; please report it"
                ),
                None => format!("{name}: internal error (panic: {text}); please report it"),
            };
            diag::fail(LError, LError, &m);
            on_error(ErrorKind::Failed)
        }
    }
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown payload".into()
    }
}

fn fail(rt: &Runtime, level: LogLevel, message: String) {
    diag::fail(rt.log_level(), level, &message);
}

/// A JSON serialisation failure (of figures we built: a bug).
fn json_error(e: serde_json::Error) -> Error {
    Error::failed(format!("internal error: cannot write JSON: {e}"))
}

fn owned_c_string(s: &str) -> *mut c_char {
    diag::c_string_lossy(s).into_raw()
}

fn addr(p: *const c_void) -> u64 {
    p.addr() as u64
}

/// `vmmalloc_try_malloc`'s result: success (`*out` is the pointer; NULL for size 0).
pub const VMMALLOC_OK: c_int = 0;
/// `vmmalloc_try_malloc`'s result: out of memory (the report in [`vmmalloc_last_error`]).
/// [`ErrorKind::OutOfMemory`]; the codes below are the other kinds (see [`error`]).
pub const VMMALLOC_E_OOM: c_int = 1;
/// A bad argument or a call at the wrong time (ordinal, size, pointer, pool,
/// configuration): [`ErrorKind::InvalidArgument`].
pub const VMMALLOC_E_INVALID: c_int = 2;
/// The driver failed a call, or the device could not be opened: [`ErrorKind::Driver`].
pub const VMMALLOC_E_DRIVER: c_int = 3;
/// The device's allocator failed (a panic inside it) and serves nothing any
/// more: [`ErrorKind::Failed`].
pub const VMMALLOC_E_FAILED: c_int = 4;
/// The backend or this process cannot do it (a forked child; a policy without
/// the feature): [`ErrorKind::Unsupported`].
pub const VMMALLOC_E_UNSUPPORTED: c_int = 5;
/// The old name of "any failure but out of memory", now
/// [`VMMALLOC_E_INVALID`]; failures return 2 to 5 by kind, so test `rc >= 2`
/// for "failed, not out of memory".
pub const VMMALLOC_E_FAIL: c_int = VMMALLOC_E_INVALID;

/// Allocates for [`vmmalloc_try_malloc`] and [`vmmalloc_pool_try_malloc`]:
/// `pool` routes the request to a CUDA graph pool of the device.
///
/// The hot path (no pool, a size the policy may see, an allocator that
/// exists and works, no queued frees, no spill to report) goes straight to
/// the allocator and builds no text; everything else, and any failure,
/// takes the general path ([`try_malloc_general`], [`malloc_failed`]).
fn try_malloc(
    name: &str,
    size: usize,
    device: c_int,
    stream: *mut c_void,
    pool: Option<PoolId>,
    out: *mut *mut c_void,
) -> c_int {
    if out.is_null() {
        diag::fail(LError, LError, &format!("{name}: out is NULL"));
        return VMMALLOC_E_INVALID;
    }
    let on_error = |kind: ErrorKind| (kind.code(), std::ptr::null_mut());
    let (rc, ptr) = entry_with(name, on_error, || {
        let rt = runtime::runtime();
        let hot = pool.is_none() && size != 0 && size as u64 <= MAX_REQUEST && !rt.spill();
        if let Some(d) = rt.ready(device).filter(|_| hot) {
            let key = stream_key(addr(stream));
            return match d.malloc(size as u64, key) {
                Ok(a) => (
                    VMMALLOC_OK,
                    std::ptr::with_exposed_provenance_mut(a.ptr as usize),
                ),
                Err(e) => malloc_failed(rt, d, name, (size, device, stream), e),
            };
        }
        try_malloc_general(rt, name, size, device, stream, pool)
    });
    // SAFETY: `out` is non-null and, per the callers' contract, valid for a write.
    unsafe { out.write(ptr) };
    rc
}

/// The text naming an allocation call in its errors and log lines.
fn malloc_call(
    name: &str,
    size: usize,
    device: c_int,
    stream: *mut c_void,
    pool: Option<PoolId>,
) -> String {
    match pool {
        None => format!("{name}(size={size}, device={device}, stream={stream:p})"),
        Some((a, b)) => {
            format!("{name}(size={size}, device={device}, stream={stream:p}, pool=({a}, {b}))")
        }
    }
}

/// The hot path's first attempt failed with `first`: the rest of what the
/// general path does after its first attempt (the pressure callback and one
/// retry on out-of-memory, then the report).
#[cold]
fn malloc_failed(
    rt: runtime::RuntimeRef,
    d: &runtime::DeviceState,
    name: &str,
    (size, device, stream): (usize, c_int, *mut c_void),
    first: AllocError,
) -> (c_int, *mut c_void) {
    let key = stream_key(addr(stream));
    let result = growable::PRESSURE
        .retry_after(
            Err(first),
            size as u64,
            device,
            || growable::capturing(d, key),
            || d.malloc(size as u64, key),
        )
        .map_err(|e| d.error(e));
    malloc_result(
        rt,
        d,
        None,
        || malloc_call(name, size, device, stream, None),
        result,
    )
}

/// Every allocation but the hot path's: creates the allocator on first use,
/// routes to private pools, refuses
/// sizes beyond any device, reports a spill.
fn try_malloc_general(
    rt: runtime::RuntimeRef,
    name: &str,
    size: usize,
    device: c_int,
    stream: *mut c_void,
    pool: Option<PoolId>,
) -> (c_int, *mut c_void) {
    let call = || malloc_call(name, size, device, stream, pool);
    let d = match rt.device(device) {
        Ok(d) => d,
        Err(e) => {
            fail(&rt, LError, format!("{}: {e}", call()));
            return (e.code(), std::ptr::null_mut());
        }
    };
    if size == 0 {
        fail(
            &rt,
            LInfo,
            format!(
                "{}: size 0: nothing to allocate, returning NULL (an empty tensor needs no memory)",
                call()
            ),
        );
        return (VMMALLOC_OK, std::ptr::null_mut());
    }
    // Sizes beyond any device never reach a policy (whose rounding could
    // overflow); larger-than-this-device ones get the policy's full report.
    // spill:true: say so when this request spilled (growable.rs).
    let spills = growable::spills_before(&rt, d);
    let result = if size as u64 > MAX_REQUEST {
        d.record_oom(size as u64, stream_key(addr(stream)));
        Err(Error::out_of_memory(format!(
            "out of memory: tried to allocate {} on device {device}, beyond any device ({} of memory here)",
            vmmalloc_alloc::summary::format_bytes(size as u64),
            vmmalloc_alloc::summary::format_bytes(d.device.caps().total_memory)
        )))
    } else if let Some(id) = pool {
        d.pool_malloc(id, size as u64, stream_key(addr(stream)))
    } else {
        // On out-of-memory: the pressure callback (growable.rs), retried once.
        let key = stream_key(addr(stream));
        growable::PRESSURE
            .retry(
                size as u64,
                device,
                || growable::capturing(d, key),
                || d.malloc(size as u64, key),
            )
            .map_err(|e| d.error(e))
    };
    malloc_result(rt, d, spills, call, result)
}

/// Turns an allocation's result into the C ABI's: reports a spill on
/// success (`spills`: the device's spill count before), the error otherwise
/// (aborting under `on_oom:abort`).
fn malloc_result(
    rt: runtime::RuntimeRef,
    d: &runtime::DeviceState,
    spills: Option<u64>,
    call: impl Fn() -> String,
    result: Result<Allocation, Error>,
) -> (c_int, *mut c_void) {
    if result.is_ok() {
        growable::report_spill(&rt, d, spills, &call);
    }
    match result {
        Ok(a) => (
            VMMALLOC_OK,
            std::ptr::with_exposed_provenance_mut(a.ptr as usize),
        ),
        Err(e) => {
            fail(&rt, LError, format!("{}: {e}", call()));
            if e.is_out_of_memory() && runtime::on_oom() == OnOom::Abort {
                diag::log(LError, LError, "aborting (on_oom:abort)");
                std::process::abort();
            }
            (e.code(), std::ptr::null_mut())
        }
    }
}

/// Allocates `size` bytes on device `device` for use on `stream` (a
/// `cudaStream_t`; NULL is the default stream), never throwing: returns
/// [`VMMALLOC_OK`] with the pointer in `*out` (NULL for size 0), or
/// an error code (out of memory [`VMMALLOC_E_OOM`], or another kind: see
/// [`error`]) with `*out` NULL and the reason in [`vmmalloc_last_error`]. With `on_oom:abort`, out-of-memory aborts the
/// process after logging the report.
///
/// `vmmalloc_malloc` (PyTorch's `alloc_fn`, in the C++ shim `shim.cpp`) calls
/// this and throws a C++ exception on failure (`on_oom:raise`, the default) or
/// returns NULL (`on_oom:null`).
///
/// # Safety
///
/// `out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_try_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> c_int {
    try_malloc("vmmalloc_malloc", size, device, stream, None, out)
}

/// As [`vmmalloc_try_malloc`], into CUDA graph pool `(pool_hi, pool_lo)`
/// (PyTorch's `MempoolId_t`) of `device`, which [`vmmalloc_pool_begin`]
/// created. The shim routes an allocation here when a capture's filter
/// accepts its stream.
///
/// # Safety
///
/// `out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_pool_try_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
    pool_hi: u64,
    pool_lo: u64,
    out: *mut *mut c_void,
) -> c_int {
    try_malloc(
        "vmmalloc_malloc",
        size,
        device,
        stream,
        Some((pool_hi, pool_lo)),
        out,
    )
}

/// 1 if a failed [`vmmalloc_try_malloc`] must become an exception in
/// `vmmalloc_malloc` (`on_oom:raise`, the default), 0 if it returns NULL.
/// Takes no lock and leaves the last error alone (the shim reads it next).
#[no_mangle]
pub extern "C" fn vmmalloc_raises() -> c_int {
    c_int::from(runtime::on_oom() == OnOom::Raise)
}

/// 1 in a child forked from a process that used vmmalloc (where every call
/// fails, see `fork.rs`), else 0. Takes no lock.
#[no_mangle]
pub extern "C" fn vmmalloc_forked() -> c_int {
    c_int::from(fork::forked())
}

/// Runs a graph-pool hook of `device` (`what` names it in errors).
fn pool_hook(
    name: &str,
    device: c_int,
    id: PoolId,
    hook: impl FnOnce(&runtime::DeviceState) -> Result<(), Error>,
) -> c_int {
    entry(name, -1, || {
        let rt = runtime::runtime();
        let call = format!("{name}(device={device}, pool=({}, {}))", id.0, id.1);
        match rt.device(device).and_then(|d| {
            d.check()?;
            hook(d)
        }) {
            Ok(()) => {
                diag::log(rt.log_level(), LInfo, &call);
                0
            }
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// PyTorch's `beginAllocateToPool` without the stream filter (the shim's
/// `vmmalloc_begin_allocate_to_pool` keeps the filter and calls this): a
/// capture into pool `(pool_hi, pool_lo)` of `device` starts; the pool is
/// created on first use, or gains one graph. Returns 0, or -1 (pool already
/// being captured into) with the reason in [`vmmalloc_last_error`].
#[no_mangle]
pub extern "C" fn vmmalloc_pool_begin(device: c_int, pool_hi: u64, pool_lo: u64) -> c_int {
    pool_hook(
        "vmmalloc_begin_allocate_to_pool",
        device,
        (pool_hi, pool_lo),
        |d| {
            d.pools()?
                .begin_allocate_to_pool((pool_hi, pool_lo))
                .map_err(|e| d.error(e))
        },
    )
}

/// PyTorch's `endAllocateToPool`: the capture into the pool ends. Returns 0,
/// or -1 (unknown pool, no capture into it underway).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_end(device: c_int, pool_hi: u64, pool_lo: u64) -> c_int {
    pool_hook(
        "vmmalloc_end_allocate_to_pool",
        device,
        (pool_hi, pool_lo),
        |d| {
            d.pools()?
                .end_allocate_to_pool((pool_hi, pool_lo))
                .map_err(|e| d.error(e))
        },
    )
}

/// PyTorch's `releasePool`: a graph using the pool is gone; when none is
/// left the pool's memory goes back to the device (the rest once its last
/// live allocation is freed). Returns 0, or -1 (unknown pool, released twice,
/// still capturing).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_release(device: c_int, pool_hi: u64, pool_lo: u64) -> c_int {
    pool_hook("vmmalloc_release_pool", device, (pool_hi, pool_lo), |d| {
        d.pools()?
            .release_pool((pool_hi, pool_lo))
            .map_err(|e| d.error(e))
    })
}

/// Frees `ptr`, returned by `vmmalloc_malloc` or [`vmmalloc_try_malloc`]. PyTorch's `free_fn`: `size`,
/// `device` and `stream` are what the allocation was made with; `device` says
/// which allocator to ask first (all are searched if it is wrong), `size` and
/// `stream` are not needed (the allocator knows them).
///
/// NULL does nothing. An unknown or already freed pointer is reported
/// (last error, one log line) and changes nothing.
#[no_mangle]
pub extern "C" fn vmmalloc_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    entry("vmmalloc_free", (), || {
        free_ptr(ptr, size, device, stream);
    })
}

/// [`vmmalloc_free`] that says whether it freed: 0 (freed, or NULL), -1 for
/// a pointer that is not a live allocation (never allocated here, already
/// freed) or a failed device, with the reason in `vmmalloc_last_error()`.
/// The torch companion's `raw_delete` raises on -1, as PyTorch's
/// (CUDACachingAllocator.cpp `free`: "invalid device pointer"); issue 40.
#[no_mangle]
pub extern "C" fn vmmalloc_try_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> c_int {
    entry("vmmalloc_try_free", -1, || {
        if free_ptr(ptr, size, device, stream) {
            0
        } else {
            -1
        }
    })
}

/// The body of [`vmmalloc_free`]: true when freed (or NULL), false with the
/// failure reported (last error, one log line) and nothing changed.
fn free_ptr(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) -> bool {
    {
        if ptr.is_null() {
            return true;
        }
        let rt = runtime::runtime();
        let p = addr(ptr);
        let call = || {
            format!("vmmalloc_free(ptr={ptr:p}, size={size}, device={device}, stream={stream:p})")
        };
        // The hot path: the device named owns the pointer; builds no text.
        if let Some(d) = rt.ready(device) {
            match d.free(p) {
                Ok(()) => return true,
                // Another device may own it: the general path asks them all.
                Err(AllocError::InvalidPointer { .. }) => {}
                Err(e) => {
                    fail(&rt, LError, format!("{}: {}", call(), d.error(e)));
                    return false;
                }
            }
        }
        if let Err(m) = rt.config() {
            fail(&rt, LError, format!("{}: {m}", call()));
            return false;
        }
        let hint = rt.check_ordinal(device).ok().and_then(|o| rt.existing(o));
        let candidates = hint.into_iter().chain(
            rt.active_devices()
                .filter(|d| Some(d.ordinal) != hint.map(|h| h.ordinal)),
        );
        // A failed device is never asked (its state cannot be trusted); its
        // failure is the answer if no other device owns the pointer.
        let mut failed = None;
        for d in candidates {
            if let Some(why) = d.failure() {
                failed.get_or_insert(why);
                continue;
            }
            match d.free(p) {
                Ok(()) => {
                    if Some(d.ordinal) != hint.map(|h| h.ordinal) {
                        diag::log(
                            rt.log_level(),
                            LInfo,
                            &format!("{}: pointer belongs to device {}", call(), d.ordinal),
                        );
                    }
                    return true;
                }
                Err(AllocError::InvalidPointer { .. }) => continue,
                Err(e) => {
                    fail(&rt, LError, format!("{}: {}", call(), d.error(e)));
                    return false;
                }
            }
        }
        if let Some(e) = failed {
            fail(&rt, LError, format!("{}: {e}", call()));
            return false;
        }
        fail(
            &rt,
            LError,
            format!(
                "{}: not a live allocation of any device (never allocated here, or already freed)",
                call()
            ),
        );
        false
    }
}

/// PyTorch's init hook: called when CUDA is initialised with the number of
/// devices. Checks the configuration (logging its error) and bounds the valid
/// ordinals by `device_count`. Allocators are still created on first use.
#[no_mangle]
pub extern "C" fn vmmalloc_init(device_count: c_int) {
    entry("vmmalloc_init", (), || {
        let rt = runtime::runtime();
        let config = match rt.config() {
            Ok(c) => c,
            Err(m) => return diag::set_error(&format!("vmmalloc_init({device_count}): {m}")),
        };
        if device_count < 0 {
            return fail(
                &rt,
                LError,
                format!("vmmalloc_init({device_count}): negative device count"),
            );
        }
        if device_count > 0 {
            rt.set_device_count(device_count as u32);
        }
        diag::log(
            config.log,
            LInfo,
            &format!(
                "vmmalloc_init({device_count}): backend {} on device {}",
                config.effective_policy(),
                config.device
            ),
        );
    })
}

/// PyTorch's reset hook (`torch.cuda.empty_cache()`): every allocator returns
/// the cached memory it can to its device. Errors are reported per device.
#[no_mangle]
pub extern "C" fn vmmalloc_empty_cache() {
    entry("vmmalloc_empty_cache", (), || {
        let rt = runtime::runtime();
        for d in rt.active_devices() {
            if let Err(e) = d.check() {
                fail(&rt, LError, format!("vmmalloc_empty_cache(): {e}"));
                continue;
            }
            if d.capturing() {
                // A capture is underway: releasing memory would unmap and
                // release pages (illegal during capture); nothing is freed.
                diag::log(
                    rt.log_level(),
                    LInfo,
                    &format!("vmmalloc_empty_cache(): device {}: skipped, a CUDA graph capture is underway", d.ordinal),
                );
                continue;
            }
            if let Err(e) = d.empty_cache() {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_empty_cache(): device {}: {e}", d.ordinal),
                );
            }
        }
        diag::log(rt.log_level(), LInfo, "vmmalloc_empty_cache()");
    })
}

/// PyTorch's memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`):
/// limits device `device`'s allocator to `fraction` of the device memory
/// (creating the allocator if needed).
#[no_mangle]
pub extern "C" fn vmmalloc_set_memory_fraction(fraction: c_double, device: c_int) {
    entry("vmmalloc_set_memory_fraction", (), || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_set_memory_fraction({fraction}, {device})");
        match rt.device(device).and_then(|d| {
            d.allocator
                .set_memory_fraction(fraction)
                .map_err(Error::from)
        }) {
            Ok(()) => diag::log(rt.log_level(), LInfo, &call),
            Err(m) => fail(&rt, LError, format!("{call}: {m}")),
        }
    })
}

/// PyTorch's record-stream hook (`Tensor.record_stream`): `ptr`'s memory is
/// also used by `stream` and is reused only after that work completes.
#[no_mangle]
pub extern "C" fn vmmalloc_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    entry("vmmalloc_record_stream", (), || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_record_stream(ptr={ptr:p}, stream={stream:p})");
        if let Err(m) = rt.config() {
            return fail(&rt, LError, format!("{call}: {m}"));
        }
        let mut failed = None;
        for d in rt.active_devices() {
            if let Err(e) = d.check() {
                failed.get_or_insert(e);
                continue;
            }
            match d
                .allocator
                .record_stream(addr(ptr), stream_key(addr(stream)))
            {
                Ok(()) => return,
                Err(AllocError::InvalidPointer { .. }) => continue,
                Err(e) => return fail(&rt, LError, format!("{call}: {e}")),
            }
        }
        if let Some(e) = failed {
            return fail(&rt, LError, format!("{call}: {e}"));
        }
        fail(
            &rt,
            LError,
            format!("{call}: not a live allocation of any device"),
        );
    })
}

/// The stats of `device` (zeros for a device not used yet), or why not.
fn stats_of(rt: &Runtime, device: c_int) -> Result<(u32, Stats), Error> {
    let ordinal = rt.check_ordinal(device)?;
    if let Some(d) = rt.existing(ordinal) {
        d.check()?;
    }
    let stats = rt
        .existing(ordinal)
        .map(|d| {
            let mut s = d.allocator.stats();
            accumulated::apply(d, &mut s);
            s
        })
        .unwrap_or_default();
    Ok((ordinal, stats))
}

/// Device `device`'s statistics as a JSON object with PyTorch's
/// `torch.cuda.memory_stats()` keys (`"allocated_bytes.all.current"`, ...)
/// plus ours under `vmmalloc.` (`vmmalloc.pages_mapped`,
/// `vmmalloc.driver_calls.create`, ...). All zeros for a device not used yet.
/// The caller frees the string with [`vmmalloc_free_string`]; NULL on failure.
#[no_mangle]
pub extern "C" fn vmmalloc_memory_stats_json(device: c_int) -> *mut c_char {
    entry("vmmalloc_memory_stats_json", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        match stats_of(&rt, device).and_then(|(ordinal, s)| {
            let mut map = serde_json::to_value(s.to_map()).map_err(json_error)?;
            if let Some(m) = map.as_object_mut() {
                // Private pools (CUDA graphs, MemPools): their bytes are in
                // the figures above, as PyTorch counts them; these break
                // them out.
                for (k, v) in torch_abi::pool_totals(rt.existing(ordinal).map(|d| &**d)) {
                    m.insert(k.into(), v.into());
                }
                sleep::add_stats(m, rt.existing(ordinal));
            }
            serde_json::to_string(&map).map_err(json_error)
        }) {
            Ok(json) => owned_c_string(&json),
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_memory_stats_json({device}): {m}"),
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// Device `device`'s summary: PyTorch's `torch.cuda.memory_summary()` table
/// followed by vmmalloc's rows (pages mapped and pooled, reclaims, syncs,
/// driver calls per kind). The caller frees it with [`vmmalloc_free_string`];
/// NULL on failure.
#[no_mangle]
pub extern "C" fn vmmalloc_memory_summary(device: c_int) -> *mut c_char {
    entry("vmmalloc_memory_summary", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        let made = rt.config().and_then(|c| {
            let (ordinal, stats) = stats_of(&rt, device)?;
            let d = rt.existing(ordinal);
            let policy = c.effective_policy();
            let text = vmmalloc_alloc::summary::summary(
                &stats,
                &vmmalloc_alloc::summary::Context {
                    device: ordinal,
                    page_size: c
                        .expandable
                        .page_size
                        .filter(|_| policy == vmmalloc_alloc::Policy::Expandable),
                    backend: policy.name(),
                    device_kind: c.device.name(),
                    caps: d.map(|d| d.device.caps()),
                    dropped_events: d.map_or(0, |d| d.history.dropped()),
                },
            );
            Ok(text + &sleep::summary_rows(d))
        });
        match made {
            Ok(text) => owned_c_string(&text),
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_memory_summary({device}): {m}"),
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// Writes every device's segments and blocks (and, with `record_history:True`,
/// the event history) to `path` as a pickle in PyTorch's snapshot schema, the
/// format of `torch.cuda.memory._dump_snapshot`. Returns 0, or -1 on failure.
///
/// # Safety
///
/// `path` is NULL (an error) or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_dump_snapshot(path: *const c_char) -> c_int {
    entry("vmmalloc_dump_snapshot", -1, || {
        let rt = runtime::runtime();
        if path.is_null() {
            fail(
                &rt,
                LError,
                "vmmalloc_dump_snapshot(NULL): path is NULL".into(),
            );
            return -1;
        }
        // SAFETY: `path` is non-null and, per this function's contract, a
        // NUL-terminated string valid for reads.
        let bytes = unsafe { CStr::from_ptr(path) }.to_bytes();
        let p = Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
        match dump::dump(&rt, p) {
            Ok(()) => {
                diag::log(
                    rt.log_level(),
                    LInfo,
                    &format!("snapshot written to {}", p.display()),
                );
                0
            }
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_dump_snapshot({}): {m}", p.display()),
                );
                -1
            }
        }
    })
}

/// The effective configuration as `key:value` pairs joined by `,` (every
/// key, defaults included), as `VMMALLOC_CONF` would spell it. The torch
/// companion reports it as snapshot()'s allocator settings. Free it with
/// [`vmmalloc_free_string`]; NULL (reason in [`vmmalloc_last_error`]) when
/// the configuration is invalid.
#[no_mangle]
pub extern "C" fn vmmalloc_settings() -> *mut c_char {
    entry("vmmalloc_settings", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        match rt.config() {
            Ok(c) => owned_c_string(
                &c.settings()
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            Err(m) => {
                fail(&rt, LError, format!("vmmalloc_settings(): {m}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// Device `device`'s free and total memory as its backend sees them
/// (`cuMemGetInfo` on `device:cuda`; the modeled capacity and what is not
/// mapped on `host`/`sim`), written to `free` and `total`. The torch
/// companion passes them to PyTorch's out-of-memory observers. Returns 0,
/// or -1 (bad ordinal, NULL pointer, driver error).
///
/// # Safety
///
/// `free` and `total` are valid for writing one value each.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_mem_get_info(
    device: c_int,
    free: *mut u64,
    total: *mut u64,
) -> c_int {
    if free.is_null() || total.is_null() {
        diag::fail(
            LError,
            LError,
            "vmmalloc_mem_get_info: free or total is NULL",
        );
        return -1;
    }
    entry("vmmalloc_mem_get_info", -1, || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_mem_get_info(device={device})");
        match rt.device(device).and_then(|d| {
            d.device
                .mem_info()
                .map_err(|e| Error::from(AllocError::Device(e)))
        }) {
            Ok(m) => {
                // SAFETY: both non-null and, per the contract, valid for a write.
                unsafe {
                    free.write(m.free);
                    total.write(m.total);
                }
                0
            }
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// Resets device `device`'s peak statistics to their current values
/// (`torch.cuda.reset_peak_memory_stats`). Returns 0, or -1 on failure.
#[no_mangle]
pub extern "C" fn vmmalloc_reset_peak_stats(device: c_int) -> c_int {
    entry("vmmalloc_reset_peak_stats", -1, || {
        let rt = runtime::runtime();
        let r = rt.check_ordinal(device).and_then(|o| match rt.existing(o) {
            Some(d) => d.check().map(|()| d.allocator.reset_peak_stats()),
            None => Ok(()),
        });
        match r {
            Ok(()) => 0,
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_reset_peak_stats({device}): {m}"),
                );
                -1
            }
        }
    })
}

/// Checks device `device`'s allocator invariants (and, on host/sim, the
/// device model's). Returns 0 if they hold (or no allocator exists yet), -1
/// with the first broken one in [`vmmalloc_last_error`].
#[no_mangle]
pub extern "C" fn vmmalloc_validate(device: c_int) -> c_int {
    entry("vmmalloc_validate", -1, || {
        let rt = runtime::runtime();
        let r = rt.check_ordinal(device).and_then(|o| match rt.existing(o) {
            None => Ok(()),
            Some(d) => {
                d.check()?;
                d.allocator.validate().map_err(Error::failed)?;
                d.device
                    .introspect()
                    .map_or(Ok(()), |i| i.check())
                    .map_err(Error::failed)
            }
        });
        match r {
            Ok(()) => 0,
            Err(m) => {
                fail(&rt, LError, format!("vmmalloc_validate({device}): {m}"));
                -1
            }
        }
    })
}

/// Sets the configuration (same syntax as `VMMALLOC_CONF`, which it replaces)
/// before the first allocation. Returns 0, or -1 if it does not parse (the
/// previous configuration stays) or allocators exist already; the error,
/// labelled `vmmalloc_configure:`, is in [`vmmalloc_last_error`] and is not
/// logged (the caller prints it, once).
///
/// # Safety
///
/// `conf` is NULL (an error) or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_configure(conf: *const c_char) -> c_int {
    entry("vmmalloc_configure", -1, || {
        if conf.is_null() {
            diag::fail(LError, LError, "vmmalloc_configure(NULL): conf is NULL");
            return -1;
        }
        // SAFETY: non-null and, per the contract, a NUL-terminated string.
        let text = match unsafe { CStr::from_ptr(conf) }.to_str() {
            Ok(t) => t.to_string(),
            Err(_) => {
                diag::fail(
                    LError,
                    LError,
                    "vmmalloc_configure: conf is not valid UTF-8",
                );
                return -1;
            }
        };
        match runtime::configure(&text) {
            Ok(()) => 0,
            Err(e) => {
                // Returned, not logged: the caller has the code and
                // vmmalloc_last_error(), and prints it once (issue 15).
                diag::set_error(e.message());
                -1
            }
        }
    })
}

/// The configuration as the library parsed it, one JSON object of every
/// setting (`{"backend": "expandable", "device": "host", ...}`, the values
/// `allocator_settings` shows): of `conf` (`VMMALLOC_CONF` syntax) when it
/// is not NULL, else the configuration in effect ([`vmmalloc_configure`] or
/// `VMMALLOC_CONF`). The Python package asks this instead of parsing the
/// text itself, so both read one configuration the one way (issue 36). The
/// caller frees the string with [`vmmalloc_free_string`]; NULL if the text
/// does not parse, the error in [`vmmalloc_last_error`] (not logged).
///
/// # Safety
///
/// `conf` is NULL or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_config_json(conf: *const c_char) -> *mut c_char {
    entry("vmmalloc_config_json", std::ptr::null_mut(), || {
        let parsed = if conf.is_null() {
            runtime::runtime().config_unlogged().cloned()
        } else {
            // SAFETY: non-null and, per the contract, a NUL-terminated string.
            match unsafe { CStr::from_ptr(conf) }.to_str() {
                Ok(t) => config::Config::parse(t).map_err(Error::from),
                Err(_) => {
                    diag::set_error("vmmalloc_config_json: conf is not valid UTF-8");
                    return std::ptr::null_mut();
                }
            }
        };
        let json = parsed.and_then(|c| {
            let map: serde_json::Map<String, serde_json::Value> = c
                .settings()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.into()))
                .collect();
            serde_json::to_string(&map).map_err(json_error)
        });
        match json {
            Ok(j) => owned_c_string(&j),
            Err(e) => {
                diag::set_error(e.message());
                std::ptr::null_mut()
            }
        }
    })
}

/// The `VMMALLOC_CONF` items that ask for what the `PYTORCH_CUDA_ALLOC_CONF`
/// text `conf` asks PyTorch for ([`config::from_pytorch_alloc_conf`]),
/// comma-joined, empty when nothing carries over. The Python package quotes
/// it in its warning that the variable is ignored. The caller frees the
/// string with [`vmmalloc_free_string`]; NULL if `conf` is NULL or not
/// UTF-8.
///
/// # Safety
///
/// `conf` is NULL or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_pytorch_conf_line(conf: *const c_char) -> *mut c_char {
    entry("vmmalloc_pytorch_conf_line", std::ptr::null_mut(), || {
        if conf.is_null() {
            diag::set_error("vmmalloc_pytorch_conf_line(NULL): conf is NULL");
            return std::ptr::null_mut();
        }
        // SAFETY: non-null and, per the contract, a NUL-terminated string.
        match unsafe { CStr::from_ptr(conf) }.to_str() {
            Ok(t) => owned_c_string(&config::from_pytorch_alloc_conf(t)),
            Err(_) => {
                diag::set_error("vmmalloc_pytorch_conf_line: conf is not valid UTF-8");
                std::ptr::null_mut()
            }
        }
    })
}

/// Returns 0 if the configuration (from [`vmmalloc_configure`] or
/// `VMMALLOC_CONF`) is valid, -1 with the error in [`vmmalloc_last_error`].
#[no_mangle]
pub extern "C" fn vmmalloc_check_config() -> c_int {
    entry("vmmalloc_check_config", -1, || {
        // Not logged: the caller asked, and reports the error itself.
        match runtime::runtime().config_unlogged() {
            Ok(_) => 0,
            Err(e) => {
                diag::set_error(e.message());
                -1
            }
        }
    })
}

/// The error of the most recent `vmmalloc_*` call on this thread, or NULL if
/// it succeeded. The string is owned by the library and valid until the next
/// `vmmalloc_*` call on this thread; do not free it.
#[no_mangle]
pub extern "C" fn vmmalloc_last_error() -> *const c_char {
    catch_unwind(diag::last_error_ptr).unwrap_or(std::ptr::null())
}

/// The library version (a static string).
#[no_mangle]
pub extern "C" fn vmmalloc_version() -> *const c_char {
    const V: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => c"unknown",
        };
    V.as_ptr()
}

/// Frees a string returned by [`vmmalloc_memory_stats_json`] or
/// [`vmmalloc_memory_summary`]. NULL does nothing.
///
/// # Safety
///
/// `s` is NULL or a string returned by one of those functions, not freed yet.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_free_string(s: *mut c_char) {
    if s.is_null() {
        return;
    }
    // SAFETY: per the contract, `s` came from `CString::into_raw` in this
    // library and is freed once.
    let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { CString::from_raw(s) })));
}

/// Tests only: drops every allocator, the configuration given to
/// [`vmmalloc_configure`] and the parsed `VMMALLOC_CONF`, so the next call
/// starts afresh. Pointers allocated before are invalid afterwards.
#[doc(hidden)]
#[no_mangle]
pub extern "C" fn vmmalloc_reset_for_tests() {
    entry("vmmalloc_reset_for_tests", (), || {
        ipc::reset();
        runtime::reset()
    })
}
