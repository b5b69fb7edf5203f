//! Streams and events, on each device's [`vmmalloc_device::StreamModel`].
//!
//! Nothing runs on a fake GPU, so a stream only holds work that a test queued
//! with `fakeCudaSubmitWork`; an event recorded after such work is
//! `CUDA_ERROR_NOT_READY` until a synchronize completes it. Unknown stream and
//! event values are `CUDA_ERROR_INVALID_HANDLE`; null (and `CU_STREAM_LEGACY`,
//! `CU_STREAM_PER_THREAD`) is the current context's default stream.
#![allow(non_snake_case)]

use crate::state::{fake, invalid_handle};
use crate::{put, run, Fail};
use std::ffi::c_uint;
use vmm_sys::{CUevent, CUresult, CUstream, CUDA_ERROR_NOT_READY, CU_STREAM_NON_BLOCKING};
use vmmalloc_device::Device;

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
/// must belong to the same device.
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
