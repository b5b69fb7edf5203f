//! The C ABI of growable regions and of the memory-pressure callback
//! (docs/expandable.md, "Growable regions" and "Spill and pressure").
//!
//! ```c
//! void* vmmalloc_growable_create(int device, size_t max_bytes); // NULL on failure
//! int   vmmalloc_growable_resize(void* ptr, size_t bytes);      // 0 ok, else a VMMALLOC_E_* code
//! int   vmmalloc_growable_destroy(void* ptr);                    // 0 ok, -1 failure
//! int   vmmalloc_growable_info(void* ptr, size_t* size, size_t* max_bytes, size_t* mapped);
//! // size_t fn(size_t size, int device): bytes the callback freed. NULL clears it.
//! int   vmmalloc_set_pressure_callback(size_t (*fn)(size_t, int));
//! ```
//!
//! A region's work is on the default stream (a shrink waits for it). Only
//! `backend:expandable` offers regions; the others answer with an error
//! that says so. Failures set [`crate::vmmalloc_last_error`] and log one line.

use crate::config::LogLevel::Error as LError;
use crate::error::Error;
use crate::runtime::{self, DeviceState};
use crate::{addr, entry, entry_with, fail, VMMALLOC_E_INVALID, VMMALLOC_OK};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use vmmalloc_alloc::growable::Growable;
use vmmalloc_alloc::pressure::Pressure;
use vmmalloc_alloc::Stream;

/// The process's pressure callback.
pub(crate) static PRESSURE: Pressure = Pressure::new();

/// Whether a capture is underway on `d` for `stream` (an unanswerable
/// question counts as yes: the callback is then skipped, the safe side).
pub(crate) fn capturing(d: &DeviceState, stream: Stream) -> bool {
    d.capturing() || d.device.is_capturing(stream).unwrap_or(true)
}

/// The device whose allocator holds region `ptr`, with its growable view.
fn owner(rt: &runtime::Runtime, ptr: u64) -> Option<(&Arc<DeviceState>, &dyn Growable)> {
    rt.active_devices().find_map(|d| {
        if d.check().is_err() {
            return None;
        }
        let g = d.allocator.as_growable()?;
        g.growable_info(ptr).ok().map(|_| (d, g))
    })
}

/// Why `ptr` has no owner: a failed device (whose regions are not looked
/// at) or not a region at all.
fn not_a_region(rt: &runtime::Runtime, ptr: u64) -> String {
    match rt.active_devices().find_map(|d| d.check().err()) {
        Some(e) => format!("{ptr:#x} is not a region of a working device: {e}"),
        None => format!(
            "{ptr:#x} is not a growable region of this process (never created, or destroyed)"
        ),
    }
}

/// Reserves a growable region of up to `max_bytes` on `device` and returns
/// its address (which never changes), mapping nothing; NULL on failure
/// (reason in `vmmalloc_last_error`).
#[no_mangle]
pub extern "C" fn vmmalloc_growable_create(device: c_int, max_bytes: usize) -> *mut c_void {
    entry("vmmalloc_growable_create", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        let call = format!("vmmalloc_growable_create(device={device}, max_bytes={max_bytes})");
        let r = rt.device(device).and_then(|d| {
            let g = d.allocator.as_growable().ok_or_else(|| {
                Error::unsupported(format!(
                    "the {} backend has no growable regions (backend:expandable has)",
                    d.allocator.name()
                ))
            })?;
            g.growable_create(max_bytes as u64, Stream::DEFAULT)
                .map_err(Error::from)
        });
        match r {
            Ok(p) => std::ptr::with_exposed_provenance_mut(p as usize),
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                std::ptr::null_mut()
            }
        }
    })
}

/// Makes region `ptr` `bytes` long: maps or unmaps whole chunks at its end
/// (a shrink first waits for the default stream; a grow is immediate).
/// Returns 0, 1 (out of memory, after the pressure callback if one is set)
/// or the code of another kind (2 not a region or beyond `max_bytes`,
/// 3 driver error, ...: see [`crate::error`]).
/// On failure the region keeps its old size.
#[no_mangle]
pub extern "C" fn vmmalloc_growable_resize(ptr: *mut c_void, bytes: usize) -> c_int {
    entry_with(
        "vmmalloc_growable_resize",
        |k| k.code(),
        || {
            let rt = runtime::runtime();
            let p = addr(ptr);
            let call = format!("vmmalloc_growable_resize(ptr={ptr:p}, bytes={bytes})");
            let Some((d, g)) = owner(&rt, p) else {
                fail(&rt, LError, format!("{call}: {}", not_a_region(&rt, p)));
                return VMMALLOC_E_INVALID;
            };
            let r = PRESSURE.retry(
                bytes as u64,
                d.ordinal as i32,
                || capturing(d, Stream::DEFAULT),
                || g.growable_resize(p, bytes as u64),
            );
            match r {
                Ok(()) => VMMALLOC_OK,
                Err(e) => {
                    fail(&rt, LError, format!("{call}: {e}"));
                    Error::from(e).code()
                }
            }
        },
    )
}

/// Unmaps and unreserves region `ptr` (waiting for the default stream).
/// Returns 0, or -1 (not a region — destroyed twice, say — or a driver error).
#[no_mangle]
pub extern "C" fn vmmalloc_growable_destroy(ptr: *mut c_void) -> c_int {
    entry("vmmalloc_growable_destroy", -1, || {
        let rt = runtime::runtime();
        let p = addr(ptr);
        let call = format!("vmmalloc_growable_destroy(ptr={ptr:p})");
        let r = match owner(&rt, p) {
            Some((_, g)) => g.growable_destroy(p).map_err(|e| e.to_string()),
            None => Err(not_a_region(&rt, p)),
        };
        match r {
            Ok(()) => 0,
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// Writes region `ptr`'s current size, maximum and mapped bytes (each
/// pointer may be NULL). Returns 0, or -1 when `ptr` is not a region.
///
/// # Safety
///
/// Each non-NULL pointer is valid for writing one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_growable_info(
    ptr: *mut c_void,
    size: *mut usize,
    max_bytes: *mut usize,
    mapped: *mut usize,
) -> c_int {
    let info = entry("vmmalloc_growable_info", None, || {
        let rt = runtime::runtime();
        let p = addr(ptr);
        match owner(&rt, p) {
            Some((_, g)) => g.growable_info(p).ok(),
            None => {
                fail(
                    &rt,
                    LError,
                    format!(
                        "vmmalloc_growable_info(ptr={ptr:p}): {}",
                        not_a_region(&rt, p)
                    ),
                );
                None
            }
        }
    });
    let Some(info) = info else { return -1 };
    for (out, v) in [
        (size, info.size),
        (max_bytes, info.max_bytes),
        (mapped, info.mapped),
    ] {
        if !out.is_null() {
            // SAFETY: non-NULL, and valid for a write per the contract.
            unsafe { out.write(v as usize) };
        }
    }
    0
}

/// The C type of a pressure callback: `(bytes requested, device) -> bytes freed`.
pub type PressureCallback = Option<unsafe extern "C" fn(usize, c_int) -> usize>;

/// Sets the memory-pressure callback (NULL clears it). When an allocation
/// or a region's growth fails with out-of-memory after the allocator's own
/// reclaim, the callback is called on the allocating thread without the
/// allocator's lock; if it reports freed bytes the operation is retried
/// once. Never recursive, never during CUDA graph capture. Returns 0.
#[no_mangle]
pub extern "C" fn vmmalloc_set_pressure_callback(cb: PressureCallback) -> c_int {
    entry("vmmalloc_set_pressure_callback", -1, || {
        PRESSURE.set(cb.map(|f| {
            Arc::new(move |size: u64, device: i32| {
                // SAFETY: the caller registered a function of this C signature
                // and keeps it alive while it is set.
                unsafe { f(size as usize, device) as u64 }
            }) as Arc<vmmalloc_alloc::pressure::PressureFn>
        }));
        0
    })
}

/// With `spill:true`, the device's spill count before an allocation (to
/// report a spill after it); `None` otherwise (no cost).
pub(crate) fn spills_before(rt: &runtime::Runtime, d: &DeviceState) -> Option<u64> {
    let spill = rt.config().map(|c| c.expandable.spill).unwrap_or(false);
    spill.then(|| d.allocator.stats().num_spills)
}

/// Logs one line, in the style of the out-of-memory report, when the
/// allocation `call()` describes spilled to host memory.
pub(crate) fn report_spill(
    rt: &runtime::Runtime,
    d: &DeviceState,
    before: Option<u64>,
    call: impl FnOnce() -> String,
) {
    let Some(before) = before else { return };
    let st = d.allocator.stats();
    if st.num_spills > before {
        crate::diag::log(
            rt.log_level(),
            LError,
            &format!(
                "{}: device {} memory is exhausted: spilled to host memory; {} now live in host memory \
                 (vmmalloc.spilled_bytes; slower until empty_cache moves it back)",
                call(),
                d.ordinal,
                vmmalloc_alloc::summary::format_bytes(st.spilled_bytes)
            ),
        );
    }
}
