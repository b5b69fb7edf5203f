//! IPC: sharing a vmmalloc allocation with another process, with or
//! without PyTorch, and importing PyTorch's own handles.
//!
//! ```c
//! // Producer: the handle of live allocation `ptr` (its exact pointer, as
//! // vmmalloc_malloc returned it), in vmmalloc's format. With buf == NULL (or
//! // cap too small) only *len is set to the bytes needed; returns 0 then, -1
//! // on failure.
//! int vmmalloc_ipc_export(void* ptr, void* buf, size_t cap, size_t* len);
//! // Producer inside PyTorch `major.minor` (the companion's shareIpcHandle):
//! // PyTorch's own expandable-segments handle of that PyTorch (2.11-2.15; the
//! // chunks re-backed once with equal handles where they differ), vmmalloc's
//! // for other versions (VMMALLOC_IPC_FORMAT chooses);
//! // *offset = the pointer's offset in the shared range (0 for vmmalloc's).
//! int vmmalloc_ipc_export_torch(void* ptr, int major, int minor, void* buf,
//!                               size_t cap, size_t* len, size_t* offset);
//! // Consumer: maps the memory a handle names into this process; *out = the
//! // pointer (same offset as the producer's). 0 ok, -1 failure.
//! int vmmalloc_ipc_import(const void* handle, size_t len, void** out);
//! // The same on device `device` (-1: the handle's); also reads PyTorch's own
//! // handles, expandable-segments and cudaIpc ones (pointer = start of the
//! // shared range).
//! int vmmalloc_ipc_import_device(const void* handle, size_t len, int device, void** out);
//! // Consumer: unmaps what vmmalloc_ipc_import mapped, once the work queued
//! // on `stream` (a CUstream; NULL: the legacy default stream) is done.
//! int vmmalloc_ipc_close_on(void* ptr, void* stream);
//! // vmmalloc_ipc_close_on(ptr, NULL).
//! int vmmalloc_ipc_close(void* ptr);
//! ```
//!
//! The reason for a failure is in `vmmalloc_last_error()`.
//!
//! # How
//!
//! Export asks the allocator for the physical chunks under the allocation
//! ([`vmmalloc_alloc::ipc`]) and exports each chunk's handle as a POSIX file
//! descriptor (`cuMemExportToShareableHandle` on `cuda`, a memfd on `host`).
//! **One descriptor per chunk**, shared by every export that covers the
//! chunk and closed when the last of them ends (issue 35: 10,000 live
//! exports of tensors inside 64 chunks hold 64 chunk descriptors, plus the
//! liveness table and the socket). The handle ([`format`]) carries the
//! producer pid, chunk sizes and descriptor numbers, the allocation's size
//! and offset in its first chunk, a random token and its slot in the
//! producer's liveness table ([`transport::LiveTable`], one memfd for all
//! exports), and the producer's socket name. Import takes the descriptors
//! ([`transport`]: `pidfd_getfd`, else `SCM_RIGHTS` over the producer's
//! socket), imports them (`cuMemImportFromShareableHandle`) into a fresh
//! reservation, maps them in order and grants this device read-write access
//! ([`vmmalloc_device::ipc::MappedImport`]: the device layer makes the
//! memory calls, and rolls back a half-done import).
//! Exporting the same pointer again returns the same handle.
//!
//! # PyTorch's formats, both ways
//!
//! - A vmmalloc producer inside PyTorch writes PyTorch's own `'e'` handle of
//!   the PyTorch it runs in ([`format::torch_handle_version`]: version 3 for
//!   2.13–2.15, 2 for 2.11–2.12), so that a stock PyTorch consumer, with no
//!   vmmalloc, imports it (`ExpandableSegment::fromShared`). PyTorch's
//!   `ShareHeader` has one `segment_size`, so the allocation's chunks are
//!   re-backed once with equal handles where they differ
//!   ([`vmmalloc_alloc::Export::export_equal`]); where that cannot be done
//!   the export fails naming why, never silently writing a format the stock
//!   consumer refuses. For other PyTorch versions it writes vmmalloc's format
//!   (`VMMALLOC_IPC_FORMAT`: `auto`, the default, as described; `torch`
//!   fails for unknown versions too; `vmmalloc` always writes vmmalloc's,
//!   e.g. when both sides run vmmalloc and `pidfd_getfd` is denied, since
//!   only vmmalloc's has the socket).
//! - A vmmalloc consumer reads PyTorch's `'e'` handles of versions 2 and 3
//!   (descriptors taken with `pidfd_getfd`, as PyTorch's consumer does) and
//!   its legacy `'c'` / bare 64-byte `cudaIpcMemHandle_t` handles (through
//!   `cuIpcOpenMemHandle`, [`Device::ipc_open`]; `device:cuda` only).
//!
//! # What vmmalloc guarantees
//!
//! - While exported, the producer's allocator never unmaps, remaps, unpins,
//!   spills or pauses the chunks under the allocation (pause fails naming it).
//!   Memory of a CUDA-graph / `MemPool` private pool exports like any other.
//! - Freeing the allocation ends the export: later imports of a vmmalloc
//!   handle fail ("freed"), never map other memory; a producer that exited
//!   makes imports fail too. (PyTorch's `'e'` format carries no token: as in
//!   PyTorch, its ref-counted `CudaIPCSentData` keeps the allocation, and so
//!   the descriptors, alive while the handle is in flight.)
//! - A consumer's mapping keeps the physical memory alive (the driver counts
//!   imported handles) even after the producer frees it or exits, but the
//!   producer may then reuse that memory for other allocations: as with
//!   PyTorch's own IPC, the producer must keep the allocation alive while
//!   consumers use it.
//! - A consumer's close waits for an event recorded on the stream it names
//!   (PyTorch's IPC deleter has just synchronized its current stream, which
//!   the companion passes), not for the whole device.

mod ffi;
pub mod format;
mod import;
pub mod transport;

pub use ffi::*;
use import::{close, live_imports};

use crate::config::DeviceKind;
use crate::runtime::{self, DeviceState};
use format::{Backend, ChunkRef, Handle, TorchHandle};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use transport::LiveTable;
use vmmalloc_alloc::AllocError;
use vmmalloc_device::{Device, PhysHandle, Stream};

/// Environment variable choosing what `vmmalloc_ipc_export_torch` writes:
/// `auto` (default), `torch`, `vmmalloc`.
pub const FORMAT_ENV: &str = "VMMALLOC_IPC_FORMAT";

/// What a producer inside PyTorch writes ([`FORMAT_ENV`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// PyTorch's `'e'` handle where it can carry the allocation, else vmmalloc's.
    Auto,
    /// PyTorch's `'e'` handle, or an error saying why it cannot.
    Torch,
    /// vmmalloc's own handle.
    Vmmalloc,
}

impl Format {
    /// From [`FORMAT_ENV`]; an unknown value is an error naming the valid ones.
    pub fn from_env() -> Result<Format, String> {
        match std::env::var(FORMAT_ENV).as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Format::Auto),
            Ok("torch") => Ok(Format::Torch),
            Ok("vmmalloc") => Ok(Format::Vmmalloc),
            Ok(v) => Err(format!(
                "{FORMAT_ENV}={v:?} is not one of auto, torch, vmmalloc"
            )),
        }
    }
}

/// One chunk descriptor, shared by every live export that covers the chunk.
#[derive(Debug)]
struct SharedFd {
    fd: OwnedFd,
    /// Live exports covering the chunk (the descriptor closes at 0).
    refs: usize,
}

/// One chunk of an export.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    size: u64,
    handle: PhysHandle,
    /// The shared descriptor's number (owned by [`Exports::fds`]).
    fd: RawFd,
}

/// One live export (producer side).
#[derive(Debug)]
struct Export {
    ptr: u64,
    ordinal: u32,
    backend: Backend,
    token: [u8; 16],
    slot: u32,
    size: u64,
    offset: u64,
    socket: String,
    chunks: Vec<Chunk>,
}

/// The producer's registry. Invariant: `fds[(o, h)].refs` is the number of
/// exports in `by_id` of device `o` with a chunk of handle `h`; every export
/// holds a live slot of `live`; `by_ptr` and `by_id` name the same exports.
#[derive(Debug)]
struct Exports {
    by_id: HashMap<u64, Export>,
    by_ptr: HashMap<u64, u64>,
    fds: HashMap<(u32, PhysHandle), SharedFd>,
    live: LiveTable,
}

impl Exports {
    fn new() -> Result<Exports, String> {
        Ok(Exports {
            by_id: HashMap::new(),
            by_ptr: HashMap::new(),
            fds: HashMap::new(),
            live: LiveTable::new().map_err(|e| format!("IPC liveness table: {e}"))?,
        })
    }

    /// One reference to the descriptor of `handle` on device `ordinal`,
    /// exporting it (`export`) the first time.
    fn acquire(
        &mut self,
        ordinal: u32,
        handle: PhysHandle,
        export: impl FnOnce() -> Result<OwnedFd, String>,
    ) -> Result<RawFd, String> {
        if let Some(s) = self.fds.get_mut(&(ordinal, handle)) {
            s.refs += 1;
            return Ok(s.fd.as_raw_fd());
        }
        let fd = export()?;
        let raw = fd.as_raw_fd();
        self.fds.insert((ordinal, handle), SharedFd { fd, refs: 1 });
        Ok(raw)
    }

    /// Drops one reference to the descriptor of `handle`; the last closes it.
    fn release(&mut self, ordinal: u32, handle: PhysHandle) {
        if let Some(s) = self.fds.get_mut(&(ordinal, handle)) {
            s.refs -= 1;
            if s.refs == 0 {
                self.fds.remove(&(ordinal, handle));
            }
        }
    }

    /// Ends export `id`: revokes its slot (before any descriptor closes:
    /// transport.rs says why), then drops its descriptor references.
    fn end(&mut self, id: u64) {
        let Some(e) = self.by_id.remove(&id) else {
            return;
        };
        self.by_ptr.remove(&e.ptr);
        let _ = self.live.revoke(e.slot);
        for c in &e.chunks {
            self.release(e.ordinal, c.handle);
        }
        EXPORTED.fetch_sub(1, Ordering::AcqRel);
    }

    fn vmmalloc_bytes(&self, id: u64, e: &Export) -> Vec<u8> {
        Handle {
            backend: e.backend,
            pid: std::process::id(),
            device: e.ordinal,
            export_id: id,
            token: e.token,
            size: e.size,
            offset: e.offset,
            token_fd: self.live.fd(),
            slot: e.slot,
            socket: e.socket.clone(),
            chunks: e
                .chunks
                .iter()
                .map(|c| ChunkRef {
                    size: c.size,
                    fd: c.fd,
                })
                .collect(),
        }
        .encode()
    }
}

/// PyTorch's `'e'` handle (`version`) of export `e`, or why it cannot carry it.
fn torch_bytes(e: &Export, version: u8) -> Result<Vec<u8>, String> {
    let first = e.chunks[0].size;
    if e.chunks.iter().any(|c| c.size != first) {
        let sizes: Vec<u64> = e.chunks.iter().map(|c| c.size >> 20).collect();
        return Err(format!(
            "PyTorch's expandable-segments handle has one segment size for all its handles \
             (ShareHeader::segment_size), but {:#x} lies on chunks of {sizes:?} MiB",
            e.ptr
        ));
    }
    let fds: Vec<i32> = e.chunks.iter().map(|c| c.fd).collect();
    Ok(TorchHandle::encode_expandable(
        version,
        std::process::id(),
        first,
        &fds,
    ))
}

static EXPORTS: Mutex<Option<Exports>> = Mutex::new(None);
/// Live exports, read without the lock by every free.
static EXPORTED: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn dup(fd: RawFd) -> std::io::Result<OwnedFd> {
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
    if let Some(id) = ex.by_ptr.get(&ptr).copied() {
        ex.end(id);
    }
}

/// The socket server's view of the registry: the liveness table, then the
/// chunk descriptors, duplicated.
pub(super) fn lookup(id: u64, token: &[u8; 16]) -> Result<Vec<OwnedFd>, String> {
    let g = lock(&EXPORTS);
    let ex = g.as_ref();
    let e = ex
        .and_then(|x| x.by_id.get(&id))
        .filter(|e| &e.token == token)
        .ok_or_else(|| {
            "the handle names memory this process has freed (no such export)".to_string()
        })?;
    let live = ex
        .map(|x| x.live.fd())
        .expect("an export implies a registry");
    std::iter::once(live)
        .chain(e.chunks.iter().map(|c| c.fd))
        .map(|f| dup(f).map_err(|err| format!("dup: {err}")))
        .collect()
}

pub(super) fn backend_of(kind: DeviceKind) -> Result<Backend, String> {
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

/// Exports `ptr` (or finds its live export) and answers `f` of it. With
/// `equal`, a new export's chunks all have one size
/// ([`vmmalloc_alloc::Export::export_equal`]: re-backed once where they
/// did not), as PyTorch's `'e'` format needs.
fn with_export<T>(
    ptr: u64,
    equal: bool,
    f: impl FnOnce(&Exports, u64, &Export) -> T,
) -> Result<T, String> {
    let rt = runtime::runtime();
    let config = rt.config().map_err(|e| e.to_string())?;
    let backend = backend_of(config.device)?;
    {
        let g = lock(&EXPORTS);
        if let Some(ex) = g.as_ref() {
            if let Some((id, e)) = ex
                .by_ptr
                .get(&ptr)
                .and_then(|id| ex.by_id.get(id).map(|e| (*id, e)))
            {
                return Ok(f(ex, id, e));
            }
        }
    }
    let mut found: Option<(&Arc<DeviceState>, vmmalloc_alloc::ipc::ExportedRange)> = None;
    for d in rt.active_devices() {
        let got = if equal {
            let t = std::time::Instant::now();
            let r = vmmalloc_alloc::export_of(&*d.allocator, ptr).and_then(|x| x.export_equal(ptr));
            if let Ok(r) = &r {
                if r.rebacked_bytes > 0 {
                    crate::diag::log(
                        rt.log_level(),
                        crate::config::LogLevel::Info,
                        &format!(
                            "IPC: {ptr:#x}: re-backed {} MiB with {} equal handles of {} MiB \
                             for PyTorch's format in {:.1} ms",
                            r.rebacked_bytes >> 20,
                            r.chunks.len(),
                            r.chunks[0].size >> 20,
                            t.elapsed().as_secs_f64() * 1e3
                        ),
                    );
                }
            }
            r
        } else {
            vmmalloc_alloc::export_of(&*d.allocator, ptr).and_then(|x| x.export(ptr))
        };
        match got {
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
             exact pointer vmmalloc_malloc returned)"
        ));
    };
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
    let mut g = lock(&EXPORTS);
    if g.is_none() {
        match Exports::new() {
            Ok(x) => *g = Some(x),
            Err(m) => {
                if let Some(x) = d.allocator.as_export() {
                    let _ = x.unexport(ptr);
                }
                return Err(m);
            }
        }
    }
    let ex = g.as_mut().expect("created above");
    if let Some(id) = ex.by_ptr.get(&ptr).copied() {
        // Another thread exported it meanwhile: answer that export (the
        // allocator's mark is the same one).
        let e = &ex.by_id[&id];
        return Ok(f(ex, id, e));
    }
    // From here every failure rolls back: the descriptor references taken,
    // the slot, the allocator's mark.
    let mut chunks = Vec::with_capacity(range.chunks.len());
    let undo = |ex: &mut Exports, chunks: &[Chunk], why: String| {
        for c in chunks {
            ex.release(d.ordinal, c.handle);
        }
        if let Some(x) = d.allocator.as_export() {
            let _ = x.unexport(ptr);
        }
        why
    };
    for c in &range.chunks {
        let dev = &d.device;
        let got = ex.acquire(d.ordinal, c.handle, || match dev.export_fd(c.handle) {
            // SAFETY: export_fd hands the caller a new descriptor it owns.
            Ok(fd) => Ok(unsafe { OwnedFd::from_raw_fd(fd) }),
            Err(e) => Err(format!(
                "exporting chunk {:#x} (+{:#x}) of {ptr:#x}: {e}",
                c.addr, c.size
            )),
        });
        match got {
            Ok(fd) => chunks.push(Chunk {
                size: c.size,
                handle: c.handle,
                fd,
            }),
            Err(m) => return Err(undo(ex, &chunks, m)),
        }
    }
    let token: [u8; 16] = transport::random_bytes();
    let slot = match ex.live.open(&token) {
        Ok(s) => s,
        Err(e) => return Err(undo(ex, &chunks, format!("IPC liveness table: {e}"))),
    };
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let offset = range.offset();
    ex.by_ptr.insert(ptr, id);
    ex.by_id.insert(
        id,
        Export {
            ptr,
            ordinal: d.ordinal,
            backend,
            token,
            slot,
            size: range.size,
            offset,
            socket,
            chunks,
        },
    );
    EXPORTED.fetch_add(1, Ordering::AcqRel);
    let e = &ex.by_id[&id];
    Ok(f(ex, id, e))
}

/// Exports `ptr` in vmmalloc's format; returns the handle's bytes.
pub(super) fn export(ptr: u64) -> Result<Vec<u8>, String> {
    with_export(ptr, false, |ex, id, e| ex.vmmalloc_bytes(id, e))
}

/// Exports `ptr` for a producer inside PyTorch `major.minor` (see the module
/// docs, "PyTorch's formats"); returns the bytes and the pointer's offset
/// in the shared range.
pub(super) fn export_for_torch(ptr: u64, major: u32, minor: u32) -> Result<(Vec<u8>, u64), String> {
    let format = Format::from_env()?;
    let version = format::torch_handle_version(major, minor);
    match (format, version) {
        (Format::Vmmalloc, _) | (Format::Auto, None) => {
            with_export(ptr, false, |ex, id, e| (ex.vmmalloc_bytes(id, e), 0))
        }
        (Format::Torch, None) => Err(format!(
            "{FORMAT_ENV}=torch: vmmalloc does not know the expandable-segments handle of \
             PyTorch {major}.{minor} (it writes versions 2 for 2.11-2.12 and 3 for \
             2.13-2.15)"
        )),
        // A stock consumer of this PyTorch may read the handle: PyTorch's
        // format or an error, never vmmalloc's (which it refuses as "from a
        // future version of torch").
        (format, Some(v)) => with_export(ptr, true, |_, _, e| {
            torch_bytes(e, v).map(|b| (b, e.offset))
        })
        .and_then(|r| r)
        .map_err(|m| match format {
            Format::Torch => {
                format!("{FORMAT_ENV}=torch: {m}; unset it to fall back on vmmalloc's format")
            }
            _ => format!(
                "{m}. PyTorch {major}.{minor}'s own format cannot carry it, and a stock \
                         PyTorch consumer cannot read vmmalloc's; where both sides run vmmalloc, \
                         set {FORMAT_ENV}=vmmalloc"
            ),
        }),
    }
}

/// Ends every export and closes every import (`vmmalloc_reset_for_tests`).
pub(crate) fn reset() {
    for (p, n) in live_imports() {
        for _ in 0..n {
            let _ = close(p, Stream::DEFAULT);
        }
    }
    if let Some(mut ex) = lock(&EXPORTS).take() {
        let ids: Vec<u64> = ex.by_id.keys().copied().collect();
        for id in ids {
            ex.end(id);
        }
    }
    EXPORTED.store(0, Ordering::Release);
}

/// Number of live exports and imports of this process, for tests and stats.
pub fn live_counts() -> (usize, usize) {
    let e = lock(&EXPORTS).as_ref().map_or(0, |x| x.by_id.len());
    let i = live_imports().iter().map(|(_, n)| n).sum();
    (e, i)
}

/// Chunk descriptors the producer holds open for its live exports (one per
/// exported physical handle, however many exports cover it).
pub fn exported_descriptors() -> usize {
    lock(&EXPORTS).as_ref().map_or(0, |x| x.fds.len())
}

/// The device ordinal an export of `ptr` came from (None if not exported).
pub fn exported_device(ptr: u64) -> Option<u32> {
    let g = lock(&EXPORTS);
    let ex = g.as_ref()?;
    let e = ex.by_id.get(ex.by_ptr.get(&ptr)?)?;
    debug_assert_eq!(e.ptr, ptr);
    Some(e.ordinal)
}
