//! The IPC entry points of the C ABI (documented in the parent module).

use super::import::{close, import};
#[allow(unused_imports)] // named by the docs below
use super::FORMAT_ENV;
use super::{export, export_for_torch};
use crate::config::LogLevel::Error as LError;
use crate::runtime;
use crate::{addr, entry, fail};
use std::ffi::{c_int, c_void};
use vmmalloc_device::cuda::stream_key;
use vmmalloc_device::Stream;

/// `int vmmalloc_ipc_export(void* ptr, void* buf, size_t cap, size_t* len)`:
/// writes the IPC handle of live allocation `ptr` into `buf` (`cap` bytes)
/// and its length into `*len`. With `buf` NULL or `cap` too small, only
/// `*len` is set (and 0 returned): call again with a larger buffer.
/// Returns 0, or -1 with the reason in `vmmalloc_last_error()`.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes; `len` is writable.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_ipc_export(
    ptr: *mut c_void,
    buf: *mut c_void,
    cap: usize,
    len: *mut usize,
) -> c_int {
    entry("vmmalloc_ipc_export", -1, || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_ipc_export(ptr={ptr:p})");
        if len.is_null() {
            fail(&rt, LError, format!("{call}: len is NULL"));
            return -1;
        }
        match export(addr(ptr)) {
            Ok(bytes) => {
                // SAFETY: the caller's contract, passed on.
                unsafe { hand_out(&bytes, buf, cap, len) };
                0
            }
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// The export buffer protocol: writes the handle's length to `*len`, and
/// the handle to `buf` when it is non-NULL and `cap` holds it.
///
/// # Safety
/// `len` is non-null and writable; `buf` is NULL or writable for `cap` bytes.
unsafe fn hand_out(bytes: &[u8], buf: *mut c_void, cap: usize, len: *mut usize) {
    // SAFETY: `len` is non-null and writable (contract).
    unsafe { len.write(bytes.len()) };
    if !buf.is_null() && cap >= bytes.len() {
        // SAFETY: `buf` is writable for `cap` ≥ bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len()) };
    }
}

/// `int vmmalloc_ipc_export_torch(void* ptr, int major, int minor, void* buf,
/// size_t cap, size_t* len, size_t* offset)`: the handle a producer inside
/// PyTorch `major.minor` shares for live allocation `ptr` (the companion's
/// `shareIpcHandle`): for PyTorch 2.11–2.15 its own expandable-segments
/// handle of that version (`'e'`, readable by a stock PyTorch consumer) at
/// every size, the chunks re-backed once with equal handles where they
/// differ (or -1 saying why that cannot be done); vmmalloc's for other
/// versions; [`FORMAT_ENV`] (`auto`, `torch`, `vmmalloc`) chooses (module
/// docs). `*offset` is the pointer's offset in the shared
/// range (0 for vmmalloc's format), PyTorch's `ShareableHandle::offset`.
/// Buffer protocol as [`vmmalloc_ipc_export`]. Returns 0, or -1 with the
/// reason in `vmmalloc_last_error()`.
///
/// # Safety
/// `buf` is NULL or writable for `cap` bytes; `len` and `offset` are writable.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_ipc_export_torch(
    ptr: *mut c_void,
    major: c_int,
    minor: c_int,
    buf: *mut c_void,
    cap: usize,
    len: *mut usize,
    offset: *mut usize,
) -> c_int {
    entry("vmmalloc_ipc_export_torch", -1, || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_ipc_export_torch(ptr={ptr:p}, torch {major}.{minor})");
        if len.is_null() || offset.is_null() {
            fail(&rt, LError, format!("{call}: len or offset is NULL"));
            return -1;
        }
        let (Ok(major), Ok(minor)) = (u32::try_from(major), u32::try_from(minor)) else {
            fail(&rt, LError, format!("{call}: a negative version"));
            return -1;
        };
        match export_for_torch(addr(ptr), major, minor) {
            Ok((bytes, off)) => {
                // SAFETY: the caller's contract, passed on; `offset` is
                // non-null (checked above) and writable (contract).
                unsafe {
                    hand_out(&bytes, buf, cap, len);
                    offset.write(off as usize);
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

/// `int vmmalloc_ipc_import(const void* handle, size_t len, void** out)`:
/// maps the memory an IPC handle (from `vmmalloc_ipc_export` in another
/// process) names and sets `*out` to the pointer. Release it with
/// [`vmmalloc_ipc_close`], never `vmmalloc_free`. Returns 0, or -1 with the
/// reason in `vmmalloc_last_error()` (unknown format or version, freed
/// memory, producer exited, different backend, ...). Same as
/// [`vmmalloc_ipc_import_device`] with device -1.
///
/// # Safety
/// `handle` is readable for `len` bytes; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_ipc_import(
    handle: *const c_void,
    len: usize,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: the same contract.
    unsafe { import_entry("vmmalloc_ipc_import", handle, len, -1, out) }
}

/// `int vmmalloc_ipc_import_device(const void* handle, size_t len, int device, void** out)`:
/// [`vmmalloc_ipc_import`] on device ordinal `device` (-1: the producer's
/// ordinal written in a vmmalloc handle, 0 for a PyTorch handle). Also reads
/// PyTorch's own handles (the bytes of `ShareableHandle::handle`):
/// expandable-segments ones (versions 2 and 3) and legacy `cudaIpc` ones
/// (`'c'` or a bare 64-byte handle, `device:cuda` only), whose pointer is the
/// start of the shared range: add PyTorch's offset to it.
///
/// # Safety
/// `handle` is readable for `len` bytes; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_ipc_import_device(
    handle: *const c_void,
    len: usize,
    device: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: the same contract.
    unsafe { import_entry("vmmalloc_ipc_import_device", handle, len, device, out) }
}

/// The body of both import entry points.
///
/// # Safety
/// `handle` is readable for `len` bytes; `out` is writable.
unsafe fn import_entry(
    name: &str,
    handle: *const c_void,
    len: usize,
    device: c_int,
    out: *mut *mut c_void,
) -> c_int {
    entry(name, -1, || {
        let rt = runtime::runtime();
        let call = format!("{name}(len={len}, device={device})");
        if out.is_null() || (handle.is_null() && len > 0) {
            fail(&rt, LError, format!("{call}: handle or out is NULL"));
            return -1;
        }
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: readable for `len` bytes (contract).
            unsafe { std::slice::from_raw_parts(handle.cast::<u8>(), len) }
        };
        match import(bytes, device) {
            Ok(p) => {
                // SAFETY: `out` is non-null and writable (contract).
                unsafe { out.write(std::ptr::with_exposed_provenance_mut(p as usize)) };
                0
            }
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// `int vmmalloc_ipc_close_on(void* ptr, void* stream)`: once the work
/// queued so far on `stream` (a `CUstream` of the import's device; NULL: the
/// legacy default stream) has finished — an event recorded there and waited
/// for, not a device-wide synchronize — unmaps and releases what
/// [`vmmalloc_ipc_import`] mapped at `ptr` (`cuIpcCloseMemHandle` for a
/// legacy handle). Returns 0, or -1 with the reason in
/// `vmmalloc_last_error()`. Work on other streams that still uses the
/// mapping must have finished (PyTorch's IPC deleter synchronizes the
/// current stream before releasing the memory, torch/csrc/StorageSharing.cpp).
#[no_mangle]
pub extern "C" fn vmmalloc_ipc_close_on(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    entry("vmmalloc_ipc_close_on", -1, || {
        let rt = runtime::runtime();
        match close(addr(ptr), stream_key(addr(stream))) {
            Ok(()) => 0,
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_ipc_close_on(ptr={ptr:p}, stream={stream:p}): {m}"),
                );
                -1
            }
        }
    })
}

/// `int vmmalloc_ipc_close(void* ptr)`: [`vmmalloc_ipc_close_on`] with the
/// legacy default stream (whose event completes after the earlier work of
/// every blocking stream; non-blocking streams' work must have finished).
#[no_mangle]
pub extern "C" fn vmmalloc_ipc_close(ptr: *mut c_void) -> c_int {
    entry("vmmalloc_ipc_close", -1, || {
        let rt = runtime::runtime();
        match close(addr(ptr), Stream::DEFAULT) {
            Ok(()) => 0,
            Err(m) => {
                fail(&rt, LError, format!("vmmalloc_ipc_close(ptr={ptr:p}): {m}"));
                -1
            }
        }
    })
}
