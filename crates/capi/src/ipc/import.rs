//! The consumer side of IPC: taking a handle's descriptors, mapping them
//! (or opening a legacy handle), and closing the mapping after the work
//! queued on a stream (see the parent module's docs). The memory calls are
//! the device layer's ([`vmmalloc_device::ipc`]): this file only finds the
//! device and the descriptors, and keeps what was imported by pointer.
//!
//! Legacy handles (`'c'` + `cudaIpcMemHandle_t`) name memory of PyTorch's
//! default caching allocator (`cudaMalloc` segments), which
//! `DeviceCachingAllocator::shareIpcHandle` exports with
//! `cudaIpcGetMemHandle` on the segment's base block and
//! `NativeCachingAllocator::getIpcDevPtr` opens with `cudaIpcOpenMemHandle`
//! (c10/cuda/CUDACachingAllocator.cpp). vmmalloc opens them the same way,
//! through the driver ([`Device::ipc_open`]: `cuIpcOpenMemHandle` in the
//! device's primary context, the one the CUDA runtime and so PyTorch uses).
//! The driver counts references: opening the same handle again returns the
//! same pointer (cuda.h, `cuIpcOpenMemHandle`), so two imports of one handle
//! are two closes. Only `device:cuda` can do this: the memory is a
//! `cuMemAlloc` allocation that only the driver can map.

use super::format::{Backend, Handle, TorchHandle};
use super::transport::{self, TakeError, Transport};
use super::{backend_of, lock, lookup, FORMAT_ENV};
use crate::config::DeviceKind;
use crate::runtime;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use vmmalloc_device::ipc::{MappedImport, OpenedIpcMem};
use vmmalloc_device::{Device, IpcMemHandle, Stream};

/// One mapping made by an import (consumer side).
enum Import {
    /// Descriptors mapped into a reservation of ours.
    Mapped(MappedImport<Arc<dyn Device>>),
    /// A legacy handle opened by the driver (`cuIpcOpenMemHandle`).
    Legacy(OpenedIpcMem<Arc<dyn Device>>),
}

/// Imports by the pointer handed out; a legacy handle opened twice maps at
/// one pointer (the driver counts), so each pointer holds a list.
static IMPORTS: Mutex<Option<HashMap<u64, Vec<Import>>>> = Mutex::new(None);

/// The liveness table and chunk descriptors of `h`, checked live.
fn take(h: &Handle) -> Result<Vec<OwnedFd>, String> {
    let n = h.chunks.len();
    let check = |fd: &OwnedFd| transport::check_token(fd.as_raw_fd(), h.slot, &h.token, h.pid);
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
pub(super) fn import(bytes: &[u8], device: i32) -> Result<u64, String> {
    match TorchHandle::parse(bytes)? {
        Some(t @ TorchHandle::Expandable { .. }) => return import_torch(t, device),
        Some(TorchHandle::CudaMalloc { version, handle }) => {
            return import_legacy(version, &handle, device)
        }
        None => {}
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
/// consumer takes them (`ExpandableSegment::fromShared`; PyTorch runs no
/// socket to fall back on), and are mapped one after the other; the pointer
/// is the segment range's start (PyTorch adds the storage's offset itself).
/// PyTorch's handle has no token: as in PyTorch, its ref-counted sent-data
/// keeps the producer's descriptors open while the handle is in flight.
fn import_torch(t: TorchHandle, device: i32) -> Result<u64, String> {
    let TorchHandle::Expandable {
        version,
        pid,
        segment_size,
        fds,
    } = t
    else {
        return Err("not an expandable-segments handle".into());
    };
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
                 (pytorch#130890); a vmmalloc producer falls back on its socket \
                 ({FORMAT_ENV}=vmmalloc makes it write vmmalloc's format)"
            ),
            e => format!("{what}: {}", e.message()),
        })?
    };
    let sizes = vec![segment_size; fds.len()];
    map_fds(d.device.clone(), &sizes, &taken, 0)
}

/// Opens a legacy `cudaIpcMemHandle_t` handle (PyTorch's default allocator)
/// on device `device` (-1: 0) through `cuIpcOpenMemHandle` (see the module
/// docs).
fn import_legacy(version: Option<u8>, handle: &[u8; 64], device: i32) -> Result<u64, String> {
    let what = match version {
        Some(v) => format!("PyTorch's cudaMalloc IPC handle (version {v}, 'c')"),
        None => "a bare cudaIpcMemHandle_t (PyTorch's cudaMalloc IPC handle)".to_string(),
    };
    let rt = runtime::runtime();
    let config = rt.config().map_err(|e| e.to_string())?;
    if config.device != DeviceKind::Cuda {
        return Err(format!(
            "{what}: its memory is a cuMemAlloc allocation that only the CUDA driver maps \
             (cuIpcOpenMemHandle), so importing it needs device:cuda, not device:{}",
            backend_of(config.device).map_or("sim", Backend::name)
        ));
    }
    let ordinal = device.max(0);
    let d = rt
        .device(ordinal)
        .map_err(|m| format!("device {ordinal} is not usable here: {m}"))?;
    let opened = OpenedIpcMem::open(d.device.clone(), &IpcMemHandle(*handle))
        .map_err(|e| format!("{what}: {e}"))?;
    let ptr = opened.ptr();
    record(ptr, Import::Legacy(opened));
    Ok(ptr)
}

/// Keeps `imp` under the pointer handed out.
fn record(ptr: u64, imp: Import) {
    lock(&IMPORTS)
        .get_or_insert_with(HashMap::new)
        .entry(ptr)
        .or_default()
        .push(imp);
}

/// Imports descriptors `fds` (chunks of `sizes` bytes) into a fresh
/// reservation, mapped in order and accessible ([`MappedImport::map`], which
/// rolls everything back on failure), and records the import; returns
/// `base + offset`.
fn map_fds(
    dev: Arc<dyn Device>,
    sizes: &[u64],
    fds: &[OwnedFd],
    offset: u64,
) -> Result<u64, String> {
    let chunks: Vec<_> = fds
        .iter()
        .map(AsRawFd::as_raw_fd)
        .zip(sizes.iter().copied())
        .collect();
    let imported = MappedImport::map(dev, &chunks).map_err(|e| e.to_string())?;
    let ptr = imported.base() + offset;
    record(ptr, Import::Mapped(imported));
    Ok(ptr)
}

/// Unmaps an import once the work queued on `stream` is done.
pub(super) fn close(ptr: u64, stream: Stream) -> Result<(), String> {
    let imp = {
        let mut g = lock(&IMPORTS);
        let m = g.as_mut();
        let list = m.and_then(|m| {
            let l = m.get_mut(&ptr)?;
            let imp = l.pop();
            if l.is_empty() {
                m.remove(&ptr);
            }
            imp
        });
        list.ok_or_else(|| {
            format!("{ptr:#x} is not a pointer vmmalloc_ipc_import returned (or it was closed)")
        })?
    };
    // Work queued on the mapping must finish before it goes (cuMemUnmap of
    // memory in use is undefined behaviour, CUDA Driver API): `close` waits
    // for `stream` first.
    match imp {
        Import::Mapped(m) => m.close(stream),
        Import::Legacy(l) => l.close(stream),
    }
    .map_err(|e| e.to_string())
}

/// The pointers of live imports and how many imports each holds.
pub(super) fn live_imports() -> Vec<(u64, usize)> {
    lock(&IMPORTS)
        .as_ref()
        .map_or_else(Vec::new, |m| m.iter().map(|(p, l)| (*p, l.len())).collect())
}
