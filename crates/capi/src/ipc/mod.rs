//! IPC: sharing a vmmalloc allocation with another process, without PyTorch.
//!
//! ```c
//! // Producer: the handle of live allocation `ptr` (its exact pointer, as
//! // vmmalloc_malloc returned it). With buf == NULL (or cap too small) only
//! // *len is set to the bytes needed; returns 0 then, -1 on failure.
//! int vmmalloc_ipc_export(void* ptr, void* buf, size_t cap, size_t* len);
//! // Consumer: maps the memory a handle names into this process; *out = the
//! // pointer (same offset as the producer's). 0 ok, -1 failure.
//! int vmmalloc_ipc_import(const void* handle, size_t len, void** out);
//! // The same on device `device` (-1: the handle's); also reads PyTorch's own
//! // expandable-segments handles (pointer = start of the shared range).
//! int vmmalloc_ipc_import_device(const void* handle, size_t len, int device, void** out);
//! // Consumer: unmaps what vmmalloc_ipc_import mapped. 0 ok, -1 failure.
//! int vmmalloc_ipc_close(void* ptr);
//! ```
//!
//! The reason for a failure is in `vmmalloc_last_error()`.
//!
//! # How
//!
//! Export asks the allocator for the physical chunks under the allocation
//! ([`vmmalloc_alloc::ipc`]), exports each chunk's handle as a POSIX file
//! descriptor (`cuMemExportToShareableHandle` on `cuda`, a memfd on
//! `host`), keeps the descriptors open, and writes a versioned handle
//! ([`format`]): producer pid, chunk sizes and descriptor numbers, the
//! allocation's size and offset in its first chunk, a random token and the
//! producer's socket name. Import takes the descriptors ([`transport`]:
//! `pidfd_getfd`, else `SCM_RIGHTS` over the producer's socket), imports
//! them (`cuMemImportFromShareableHandle`) into a fresh reservation, maps
//! them in order and grants this device read-write access. Exporting the
//! same pointer again returns the same handle.
//!
//! # What vmmalloc guarantees
//!
//! - While exported, the producer's allocator never unmaps, remaps, unpins,
//!   spills or pauses the chunks under the allocation (pause fails naming it).
//! - Freeing the allocation in the producer ends the export: later imports
//!   fail ("freed"), never map other memory; a producer that exited makes
//!   imports fail too.
//! - A consumer's mapping keeps the physical memory alive (the driver counts
//!   imported handles) even after the producer frees it or exits, but the
//!   producer may then reuse that memory for other allocations: as with
//!   PyTorch's own IPC, the producer must keep the allocation alive while
//!   consumers use it (PyTorch's ref-counted `CudaIPCSentData` does so for
//!   tensors sent through `torch.multiprocessing`).

pub mod format;
pub mod transport;

use crate::config::{DeviceKind, LogLevel::Error as LError};
use crate::runtime::{self, DeviceState};
use crate::{addr, entry, fail};
use format::{Backend, ChunkRef, Handle, TorchHandle};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use transport::{TakeError, Transport};
use vmmalloc_alloc::AllocError;
use vmmalloc_device::{Device, PhysHandle};

/// One live export (producer side).
struct Export {
    ptr: u64,
    ordinal: u32,
    token: [u8; 16],
    token_fd: OwnedFd,
    chunk_fds: Vec<OwnedFd>,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Exports {
    by_id: HashMap<u64, Export>,
    by_ptr: HashMap<u64, u64>,
}

/// One mapping made by an import (consumer side).
struct Import {
    device: Arc<dyn Device>,
    base: u64,
    total: u64,
    handles: Vec<PhysHandle>,
}

static EXPORTS: Mutex<Option<Exports>> = Mutex::new(None);
/// Live exports, read without the lock by every free.
static EXPORTED: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static IMPORTS: Mutex<Option<HashMap<u64, Import>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn dup(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only reads `fd`.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r) })
}

/// Called before the allocator frees `ptr` (any device): ends its export.
/// Costs one atomic load when nothing is exported.
#[inline]
pub(crate) fn on_free(ptr: u64) {
    if EXPORTED.load(Ordering::Acquire) != 0 {
        end_export(ptr);
    }
}

/// [`on_free`] while something is exported: ends `ptr`'s export if it has one.
#[cold]
fn end_export(ptr: u64) {
    let mut g = lock(&EXPORTS);
    let Some(ex) = g.as_mut() else { return };
    let Some(id) = ex.by_ptr.remove(&ptr) else {
        return;
    };
    if let Some(e) = ex.by_id.remove(&id) {
        // Revoke before the descriptors close (transport.rs explains why).
        let _ = transport::revoke(e.token_fd.as_raw_fd());
        EXPORTED.fetch_sub(1, Ordering::AcqRel);
        drop(e);
    }
}

/// The socket server's view of the registry.
fn lookup(id: u64, token: &[u8; 16]) -> Result<Vec<OwnedFd>, String> {
    let g = lock(&EXPORTS);
    let e = g
        .as_ref()
        .and_then(|x| x.by_id.get(&id))
        .filter(|e| &e.token == token)
        .ok_or_else(|| {
            "the handle names memory this process has freed (no such export)".to_string()
        })?;
    std::iter::once(&e.token_fd)
        .chain(&e.chunk_fds)
        .map(|f| dup(f.as_raw_fd()).map_err(|err| format!("dup: {err}")))
        .collect()
}

fn backend_of(kind: DeviceKind) -> Result<Backend, String> {
    match kind {
        DeviceKind::Cuda => Ok(Backend::Cuda),
        DeviceKind::Host => Ok(Backend::Host),
        DeviceKind::Sim => Err(
            "device:sim holds no memory, so nothing can be shared with another process \
             (use device:host or device:cuda)"
                .into(),
        ),
    }
}

/// Exports `ptr`; returns the handle's bytes.
fn export(ptr: u64) -> Result<Vec<u8>, String> {
    let rt = runtime::runtime();
    let config = rt.config().map_err(|e| e.to_string())?;
    let backend = backend_of(config.device)?;
    {
        let g = lock(&EXPORTS);
        if let Some(e) = g
            .as_ref()
            .and_then(|x| x.by_ptr.get(&ptr))
            .and_then(|id| g.as_ref().and_then(|x| x.by_id.get(id)))
        {
            return Ok(e.bytes.clone());
        }
    }
    let mut found: Option<(&Arc<DeviceState>, vmmalloc_alloc::ipc::ExportedRange)> = None;
    for d in rt.active_devices() {
        match d.allocator.export(ptr) {
            Ok(r) => {
                found = Some((d, r));
                break;
            }
            Err(AllocError::InvalidPointer { .. }) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    let Some((d, range)) = found else {
        return Err(format!(
            "{ptr:#x} is not a live allocation of vmmalloc's allocators (exporting takes the \
             exact pointer vmmalloc_malloc returned; graph-pool memory cannot be exported)"
        ));
    };
    let undo = |why: String| {
        let _ = d.allocator.unexport(ptr);
        why
    };
    let mut chunk_fds = Vec::with_capacity(range.chunks.len());
    for c in &range.chunks {
        match d.device.export_fd(c.handle) {
            // SAFETY: export_fd hands the caller a new descriptor it owns.
            Ok(fd) => chunk_fds.push(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(e) => {
                return Err(undo(format!(
                    "exporting chunk {:#x} (+{:#x}) of {ptr:#x}: {e}",
                    c.addr, c.size
                )))
            }
        }
    }
    let token: [u8; 16] = transport::random_bytes();
    let token_fd = transport::token_file(&token).map_err(|e| undo(format!("token file: {e}")))?;
    // The socket fallback; without it consumers can still use pidfd_getfd.
    let socket = match transport::server(lookup) {
        Ok(name) => name,
        Err(m) => {
            crate::diag::log(
                rt.log_level(),
                crate::config::LogLevel::Info,
                &format!("IPC: no socket fallback: {m}"),
            );
            String::new()
        }
    };
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let handle = Handle {
        backend,
        pid: std::process::id(),
        device: d.ordinal,
        export_id: id,
        token,
        size: range.size,
        offset: range.offset(),
        token_fd: token_fd.as_raw_fd(),
        socket,
        chunks: range
            .chunks
            .iter()
            .zip(&chunk_fds)
            .map(|(c, f)| ChunkRef {
                size: c.size,
                fd: f.as_raw_fd(),
            })
            .collect(),
    };
    let bytes = handle.encode();
    let mut g = lock(&EXPORTS);
    let ex = g.get_or_insert_with(Exports::default);
    if let Some(e) = ex.by_ptr.get(&ptr).and_then(|other| ex.by_id.get(other)) {
        // Another thread exported it meanwhile: keep that export (ours
        // closes its descriptors when dropped).
        return Ok(e.bytes.clone());
    }
    ex.by_ptr.insert(ptr, id);
    ex.by_id.insert(
        id,
        Export {
            ptr,
            ordinal: d.ordinal,
            token,
            token_fd,
            chunk_fds,
            bytes: bytes.clone(),
        },
    );
    EXPORTED.fetch_add(1, Ordering::AcqRel);
    Ok(bytes)
}

/// The token file and chunk descriptors of `h`, checked live.
fn take(h: &Handle) -> Result<Vec<OwnedFd>, String> {
    let n = h.chunks.len();
    let check = |fd: &OwnedFd| transport::check_token(fd.as_raw_fd(), &h.token, h.pid);
    if h.pid == std::process::id() {
        // Our own export: straight from the registry.
        return lookup(h.export_id, &h.token);
    }
    let by_socket =
        |why: Option<String>| -> Result<Vec<OwnedFd>, String> {
            if h.socket.is_empty() {
                return Err(format!(
                    "{}the producer (pid {}) runs no IPC socket to fall back on",
                    why.map(|w| format!("{w}; ")).unwrap_or_default(),
                    h.pid
                ));
            }
            let fds = transport::take_by_socket(&h.socket, h.pid, h.export_id, &h.token, n)
                .map_err(|e| match (&why, e) {
                    (Some(w), e) => format!("{w}; then over the socket: {}", e.message()),
                    (None, e) => e.message().to_string(),
                })?;
            check(&fds[0])?;
            Ok(fds)
        };
    let mode = Transport::from_env()?;
    if mode == Transport::Socket {
        return by_socket(None);
    }
    let denied = |m: String| {
        if mode != Transport::Pidfd {
            by_socket(Some(m))
        } else {
            Err(format!(
                "{m} (and {} forbids the socket fallback)",
                transport::TRANSPORT_ENV
            ))
        }
    };
    if mode == Transport::AutoDeniedForTests {
        return denied(format!(
            "pidfd_getfd(pid {}): Operation not permitted (simulated)",
            h.pid
        ));
    }
    let token_fd = match transport::take_by_pidfd(h.pid, &[h.token_fd]) {
        Ok(mut v) => v.remove(0),
        Err(TakeError::Denied(m)) => return denied(m),
        Err(e) => return Err(e.message().to_string()),
    };
    check(&token_fd)?;
    let fds: Vec<i32> = h.chunks.iter().map(|c| c.fd).collect();
    let chunks = match transport::take_by_pidfd(h.pid, &fds) {
        Ok(v) => v,
        Err(TakeError::Denied(m)) => return denied(m),
        Err(e) => return Err(e.message().to_string()),
    };
    // Still live after taking them: they are the export's descriptors.
    check(&token_fd)?;
    let mut all = vec![token_fd];
    all.extend(chunks);
    Ok(all)
}

/// Maps the memory handle `bytes` names on device `device` (-1: the
/// handle's own device; device 0 for PyTorch's handles, which name none);
/// returns the pointer.
fn import(bytes: &[u8], device: i32) -> Result<u64, String> {
    if let Some(t) = TorchHandle::parse(bytes)? {
        return import_torch(t, device);
    }
    let h = Handle::decode(bytes)?;
    let rt = runtime::runtime();
    let config = rt.config().map_err(|e| e.to_string())?;
    let mine = backend_of(config.device)?;
    if mine != h.backend {
        return Err(format!(
            "the handle was made by a device:{} producer (pid {}), but this process runs \
             device:{}: both sides must use the same backend",
            h.backend.name(),
            h.pid,
            mine.name()
        ));
    }
    let ordinal = if device < 0 { h.device as i32 } else { device };
    let d = rt
        .device(ordinal)
        .map_err(|m| format!("device {ordinal} is not usable here: {m}"))?;
    let fds = take(&h)?;
    let sizes: Vec<u64> = h.chunks.iter().map(|c| c.size).collect();
    map_fds(d.device.clone(), &sizes, &fds[1..], h.offset)
}

/// Imports a handle of PyTorch's own allocator (expandable segments): the
/// descriptors come from the producer with `pidfd_getfd`, as PyTorch's own
/// consumer takes them (PyTorch runs no socket to fall back on), and are
/// mapped one after the other; the pointer is the segment range's start
/// (PyTorch adds the storage's offset itself). PyTorch's handle has no
/// token: as in PyTorch, its ref-counted sent-data keeps the producer's
/// descriptors open while the handle is in flight.
fn import_torch(t: TorchHandle, device: i32) -> Result<u64, String> {
    let TorchHandle::Expandable {
        version,
        pid,
        segment_size,
        fds,
    } = t;
    let rt = runtime::runtime();
    rt.config().map_err(|e| e.to_string())?;
    let ordinal = device.max(0);
    let d = rt
        .device(ordinal)
        .map_err(|m| format!("device {ordinal} is not usable here: {m}"))?;
    let what = format!("PyTorch's expandable-segments handle (version {version}, pid {pid})");
    let taken = if Transport::from_env()? == Transport::Socket {
        return Err(format!(
            "{what}: {}=socket, but a PyTorch producer offers no socket (only pidfd_getfd)",
            transport::TRANSPORT_ENV
        ));
    } else {
        transport::take_by_pidfd(pid, &fds).map_err(|e| match e {
            TakeError::Denied(m) => format!(
                "{what}: {m}; a PyTorch producer offers no other way to pass its descriptors \
                 (pytorch#130890); a vmmalloc producer falls back on its socket"
            ),
            e => format!("{what}: {}", e.message()),
        })?
    };
    let sizes = vec![segment_size; fds.len()];
    map_fds(d.device.clone(), &sizes, &taken, 0)
}

/// Imports descriptors `fds` (chunks of `sizes` bytes) into a fresh
/// reservation, maps them in order, grants access and records the import;
/// returns `base + offset`. Rolls everything back on failure.
fn map_fds(
    dev: Arc<dyn Device>,
    sizes: &[u64],
    fds: &[OwnedFd],
    offset: u64,
) -> Result<u64, String> {
    let total: u64 = sizes.iter().sum();
    let base = dev
        .reserve(total, 0)
        .map_err(|e| format!("reserving {total:#x} bytes for the import: {e}"))?;
    let mut handles: Vec<PhysHandle> = Vec::with_capacity(sizes.len());
    let mut mapped = 0u64;
    let rollback = |handles: &[PhysHandle], mapped: u64| {
        if mapped > 0 {
            let _ = dev.unmap(base, mapped);
        }
        for &ph in handles {
            let _ = dev.release(ph);
        }
        let _ = dev.free_reservation(base, total);
    };
    for (&size, fd) in sizes.iter().zip(fds) {
        let ph = match dev.import_fd(fd.as_raw_fd()) {
            Ok(ph) => ph,
            Err(e) => {
                rollback(&handles, mapped);
                return Err(format!("importing a chunk of {size:#x} bytes: {e}"));
            }
        };
        handles.push(ph);
        if let Err(e) = dev.map(base + mapped, size, ph) {
            rollback(&handles, mapped);
            return Err(format!("mapping an imported chunk of {size:#x} bytes: {e}"));
        }
        mapped += size;
    }
    if let Err(e) = dev.set_access(base, total) {
        rollback(&handles, mapped);
        return Err(format!("granting access to the import: {e}"));
    }
    let ptr = base + offset;
    lock(&IMPORTS).get_or_insert_with(HashMap::new).insert(
        ptr,
        Import {
            device: dev,
            base,
            total,
            handles,
        },
    );
    Ok(ptr)
}

/// Unmaps an import.
fn close(ptr: u64) -> Result<(), String> {
    let imp = lock(&IMPORTS)
        .as_mut()
        .and_then(|m| m.remove(&ptr))
        .ok_or_else(|| {
            format!("{ptr:#x} is not a pointer vmmalloc_ipc_import returned (or it was closed)")
        })?;
    let dev = &imp.device;
    // Work queued on the mapping must finish before it goes (cuMemUnmap of
    // memory in use is undefined behaviour, CUDA Driver API).
    let mut errors = Vec::new();
    if let Err(e) = dev.synchronize() {
        errors.push(format!("synchronize: {e}"));
    }
    if let Err(e) = dev.unmap(imp.base, imp.total) {
        errors.push(format!("unmap: {e}"));
    }
    for &ph in &imp.handles {
        if let Err(e) = dev.release(ph) {
            errors.push(format!("release: {e}"));
        }
    }
    if let Err(e) = dev.free_reservation(imp.base, imp.total) {
        errors.push(format!("free reservation: {e}"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Ends every export and closes every import (`vmmalloc_reset_for_tests`).
pub(crate) fn reset() {
    let imports: Vec<u64> = lock(&IMPORTS)
        .as_ref()
        .map_or_else(Vec::new, |m| m.keys().copied().collect());
    for p in imports {
        let _ = close(p);
    }
    if let Some(ex) = lock(&EXPORTS).take() {
        for e in ex.by_id.values() {
            let _ = transport::revoke(e.token_fd.as_raw_fd());
        }
    }
    EXPORTED.store(0, Ordering::Release);
}

/// Number of live exports and imports of this process, for tests and stats.
pub fn live_counts() -> (usize, usize) {
    let e = lock(&EXPORTS).as_ref().map_or(0, |x| x.by_id.len());
    let i = lock(&IMPORTS).as_ref().map_or(0, |x| x.len());
    (e, i)
}

/// The device ordinal an export of `ptr` came from (None if not exported).
pub fn exported_device(ptr: u64) -> Option<u32> {
    let g = lock(&EXPORTS);
    let ex = g.as_ref()?;
    let e = ex.by_id.get(ex.by_ptr.get(&ptr)?)?;
    debug_assert_eq!(e.ptr, ptr);
    Some(e.ordinal)
}

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
                // SAFETY: `len` is non-null and writable (contract).
                unsafe { len.write(bytes.len()) };
                if !buf.is_null() && cap >= bytes.len() {
                    // SAFETY: `buf` is writable for `cap` ≥ bytes.len() bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len())
                    };
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
/// PyTorch's own expandable-segments handles (the bytes of
/// `ShareableHandle::handle`, versions 2 and 3), whose pointer is the start
/// of the shared range: add PyTorch's offset to it.
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

/// `int vmmalloc_ipc_close(void* ptr)`: waits for the device, then unmaps
/// and releases what [`vmmalloc_ipc_import`] mapped at `ptr`. Returns 0, or
/// -1 with the reason in `vmmalloc_last_error()`.
#[no_mangle]
pub extern "C" fn vmmalloc_ipc_close(ptr: *mut c_void) -> c_int {
    entry("vmmalloc_ipc_close", -1, || {
        let rt = runtime::runtime();
        match close(addr(ptr)) {
            Ok(()) => 0,
            Err(m) => {
                fail(&rt, LError, format!("vmmalloc_ipc_close(ptr={ptr:p}): {m}"));
                -1
            }
        }
    })
}
