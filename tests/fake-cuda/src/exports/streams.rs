//! Streams and events, on each device's [`vmmalloc_device::StreamModel`].
//!
//! Nothing runs on a fake GPU, so a stream only holds work that a test queued
//! with `fakeCudaSubmitWork`; an event recorded after such work is
//! `CUDA_ERROR_NOT_READY` until a synchronize completes it. Unknown stream and
//! event values are `CUDA_ERROR_INVALID_HANDLE`; null and `CU_STREAM_LEGACY`
//! are the current context's legacy default stream, `CU_STREAM_PER_THREAD`
//! the calling thread's own default stream in it (a different stream on every
//! thread).
//!
//! Stream capture (`cuStreamBeginCapture_v2`, `cuStreamEndCapture`,
//! `cuStreamIsCapturing`) is the device's [`vmmalloc_device::StreamModel`]
//! capture state: what it refuses during a capture fails here with the same
//! code (cuda.h 900, 901, 903, 907). Graphs themselves are not modelled:
//! `cuStreamEndCapture` hands out an opaque value nothing else accepts.
#![allow(non_snake_case)]

use crate::state::{fake, invalid_handle};
use crate::{put, run, Fail};
use std::ffi::c_uint;
use vmm_sys::{
    CUevent, CUgraph, CUresult, CUstream, CUstreamCaptureMode, CUstreamCaptureStatus,
    CUDA_ERROR_NOT_READY, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, CU_STREAM_CAPTURE_MODE_GLOBAL,
    CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    CU_STREAM_CAPTURE_STATUS_ACTIVE, CU_STREAM_CAPTURE_STATUS_INVALIDATED,
    CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_LEGACY, CU_STREAM_NON_BLOCKING,
};
use vmmalloc_device::{CaptureMode, Device, Introspect};

/// `CU_EVENT_BLOCKING_SYNC`.
const CU_EVENT_BLOCKING_SYNC: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`.
const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CU_EVENT_INTERPROCESS` (requires `CU_EVENT_DISABLE_TIMING`).
const CU_EVENT_INTERPROCESS: c_uint = 0x4;

/// `CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)` in the
/// current context; flags `CU_STREAM_DEFAULT` or `CU_STREAM_NON_BLOCKING`.
///
/// # Safety
/// As `cuda.h` requires: `phStream` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) -> CUresult {
    run("cuStreamCreate", || {
        let f = fake()?;
        if phStream.is_null() {
            return Err(Fail::invalid("phStream is NULL"));
        }
        if Flags & !CU_STREAM_NON_BLOCKING != 0 {
            return Err(Fail::invalid(format!(
                "flags {Flags:#x} are not CU_STREAM_* flags"
            )));
        }
        let dev = f.current()?;
        let host = f.host(dev);
        let inner = host.create_stream()?;
        let value = f.add_stream(dev, host, inner) as usize;
        if Flags & CU_STREAM_NON_BLOCKING == 0 {
            f.set_blocking(value as u64);
        }
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe {
            put(
                phStream,
                std::ptr::with_exposed_provenance_mut(value),
                "phStream",
            )
        }
    })
}

/// `CUresult cuStreamSynchronize(CUstream hStream)`: completes the work queued on it.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    run("cuStreamSynchronize", || {
        let s = fake()?.stream(hStream.expose_provenance())?;
        Ok(s.host.synchronize_stream(s.inner)?)
    })
}

/// `CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)` in the
/// current context; flags from `CU_EVENT_*` (`INTERPROCESS` needs `DISABLE_TIMING`).
///
/// # Safety
/// As `cuda.h` requires: `phEvent` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    run("cuEventCreate", || {
        let f = fake()?;
        if phEvent.is_null() {
            return Err(Fail::invalid("phEvent is NULL"));
        }
        let known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
        if Flags & !known != 0
            || (Flags & CU_EVENT_INTERPROCESS != 0 && Flags & CU_EVENT_DISABLE_TIMING == 0)
        {
            return Err(Fail::invalid(format!(
                "flags {Flags:#x} are not valid CU_EVENT_* flags"
            )));
        }
        let dev = f.current()?;
        let host = f.host(dev);
        let inner = host.create_event()?;
        let value = f.add_event(dev, host, inner) as usize;
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe {
            put(
                phEvent,
                std::ptr::with_exposed_provenance_mut(value),
                "phEvent",
            )
        }
    })
}

/// `CUresult cuEventRecord(CUevent hEvent, CUstream hStream)`: event and stream
/// must belong to the same device. On the legacy stream the event also waits
/// for the earlier work of every blocking stream (per-thread streams included).
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    run("cuEventRecord", || {
        let f = fake()?;
        let e = f.event(hEvent.expose_provenance())?;
        let s = f.stream(hStream.expose_provenance())?;
        if e.dev != s.dev {
            return Err(invalid_handle(format!(
                "event of device {} recorded on a stream of device {}",
                e.dev, s.dev
            )));
        }
        let value = hStream.expose_provenance();
        if value == 0 || value == CU_STREAM_LEGACY {
            // The legacy default stream waits for every blocking stream's
            // earlier work (CUDA Driver API, "Stream synchronization
            // behavior"), and so does an event recorded on it.
            let others = f.blocking_streams_of(&e.host);
            return Ok(e.host.streams().record_joined(e.inner, s.inner, &others)?);
        }
        Ok(e.host.record_event(e.inner, s.inner)?)
    })
}

/// `CUresult cuEventQuery(CUevent hEvent)`: `CUDA_SUCCESS` when the work
/// before its last record has completed, `CUDA_ERROR_NOT_READY` (600) while
/// some is still queued.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    run("cuEventQuery", || {
        let e = fake()?.event(hEvent.expose_provenance())?;
        if e.host.query_event(e.inner)? {
            Ok(())
        } else {
            Err(Fail::new(
                CUDA_ERROR_NOT_READY,
                "work recorded before the event is still queued",
            ))
        }
    })
}

/// `CUresult cuEventSynchronize(CUevent hEvent)`: completes the work the event waits for.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    run("cuEventSynchronize", || {
        let e = fake()?.event(hEvent.expose_provenance())?;
        Ok(e.host.synchronize_event(e.inner)?)
    })
}

/// `CUresult cuEventDestroy_v2(CUevent hEvent)`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    run("cuEventDestroy_v2", || {
        let f = fake()?;
        let value = hEvent.expose_provenance();
        let e = f.event(value)?;
        e.host.destroy_event(e.inner)?;
        f.remove_event(value);
        Ok(())
    })
}

/// `CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode
/// mode)`: starts a capture. The legacy default stream (null,
/// `CU_STREAM_LEGACY`) and a stream already capturing are
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900); an unknown mode is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(
    hStream: CUstream,
    mode: CUstreamCaptureMode,
) -> CUresult {
    run("cuStreamBeginCapture_v2", || {
        let mode = match mode {
            CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
            other => {
                return Err(Fail::invalid(format!(
                    "mode {other} is not a CUstreamCaptureMode"
                )))
            }
        };
        let s = fake()?.stream(hStream.expose_provenance())?;
        Ok(s.host.streams().begin_capture(s.inner, mode)?)
    })
}

/// `CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)`: ends
/// the capture; `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED` (903) when none was
/// begun, `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` (901, and a null graph) when
/// a forbidden call invalidated it.
///
/// # Safety
/// As `cuda.h` requires: `phGraph` is null or valid for what this call writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
    run("cuStreamEndCapture", || {
        let f = fake()?;
        if phGraph.is_null() {
            return Err(Fail::invalid("phGraph is NULL"));
        }
        let s = f.stream(hStream.expose_provenance())?;
        if let Err(e) = s.host.streams().end_capture(s.inner) {
            // SAFETY: non-null and writable (cuda.h).
            unsafe { put(phGraph, std::ptr::null_mut(), "phGraph") }?;
            return Err(e.into());
        }
        let graph = f.new_graph() as usize;
        // SAFETY: non-null and writable (cuda.h).
        unsafe {
            put(
                phGraph,
                std::ptr::with_exposed_provenance_mut(graph),
                "phGraph",
            )
        }
    })
}

/// `CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus
/// *captureStatus)`: `NONE`, `ACTIVE` or `INVALIDATED`. On the legacy stream
/// while a blocking stream of the context captures:
/// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` (906), as cuda.h documents.
///
/// # Safety
/// As `cuda.h` requires: `captureStatus` is null or valid for what this call writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(
    hStream: CUstream,
    captureStatus: *mut CUstreamCaptureStatus,
) -> CUresult {
    run("cuStreamIsCapturing", || {
        let f = fake()?;
        if captureStatus.is_null() {
            return Err(Fail::invalid("captureStatus is NULL"));
        }
        let value = hStream.expose_provenance();
        let s = f.stream(value)?;
        if (value == 0 || value == CU_STREAM_LEGACY) && f.blocking_stream_capturing(&s.host) {
            return Err(Fail::new(
                CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                "the legacy stream was queried while a blocking stream of its context is capturing",
            ));
        }
        let model = s.host.streams();
        let status = if !model.is_capturing(s.inner)? {
            CU_STREAM_CAPTURE_STATUS_NONE
        } else if model.capture_invalidated(s.inner) {
            CU_STREAM_CAPTURE_STATUS_INVALIDATED
        } else {
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        };
        // SAFETY: non-null and writable (cuda.h).
        unsafe { put(captureStatus, status, "captureStatus") }
    })
}
