//! The CUDA driver entry points, with `cuda.h`'s exact names and signatures.
//!
//! This module: initialization, devices, contexts and error strings. The
//! virtual-memory calls are in [`vmm`], plain allocations and copies in
//! [`memory`], streams and events in [`streams`], legacy IPC in [`ipc`].
//!
//! Every function is `unsafe extern "C"`: the caller promises what `cuda.h`
//! asks of it (out-pointers null or writable, in-pointers null or readable).
//! Null where the driver needs a pointer is `CUDA_ERROR_INVALID_VALUE`; every
//! call but `cuDriverGetVersion`, `cuGetErrorName` and `cuGetErrorString`
//! fails with `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
#![allow(non_snake_case)]

pub mod ipc;
pub mod memory;
pub mod streams;
pub mod vmm;

use crate::config::{Config, Fabric};
use crate::state::{self, fake, set_current_context};
use crate::{codes, config, put, run, Fail};
use std::ffi::{c_char, c_int, c_uint};
use vmm_sys::{
    CUcontext, CUdevice, CUdevice_attribute, CUresult, CUuuid, CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
};

/// What `cuDriverGetVersion` reports: CUDA 12.8.
pub const DRIVER_VERSION: c_int = 12080;

/// `CU_DEVICE_ATTRIBUTE_MAX`: attributes at or above it are invalid.
const CU_DEVICE_ATTRIBUTE_MAX: CUdevice_attribute = 144;

/// `CUresult cuInit(unsigned int Flags)`: reads the configuration (once) and
/// creates the devices. Fails with `CUDA_ERROR_INVALID_VALUE` for non-zero
/// flags or a malformed configuration (said on stderr), and with
/// `CUDA_ERROR_NO_DEVICE` when `FAKE_CUDA_DEVICES=0`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    run("cuInit", || {
        if Flags != 0 {
            return Err(Fail::invalid(format!("flags {Flags:#x} must be 0")));
        }
        let config = config().map_err(|e| {
            eprintln!("fake-cuda: bad configuration: {e}");
            Fail::invalid(format!("bad configuration: {e}"))
        })?;
        if config.devices == 0 {
            return Err(Fail::new(
                CUDA_ERROR_NO_DEVICE,
                "FAKE_CUDA_DEVICES=0: no device",
            ));
        }
        state::init(config).map(|_| ())
    })
}

/// `CUresult cuDriverGetVersion(int *driverVersion)`: 12080 (CUDA 12.8).
/// Works before `cuInit`, as in the driver.
///
/// # Safety
/// As `cuda.h` requires: `driverVersion` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(driverVersion: *mut c_int) -> CUresult {
    run("cuDriverGetVersion", || {
        // SAFETY: the caller passes null or a writable int (cuda.h).
        unsafe { put(driverVersion, DRIVER_VERSION, "driverVersion") }
    })
}

/// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`: the device handle is
/// the ordinal; `CUDA_ERROR_INVALID_DEVICE` for an ordinal out of range.
///
/// # Safety
/// As `cuda.h` requires: `device` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    run("cuDeviceGet", || {
        let f = fake()?;
        f.device(ordinal)?;
        // SAFETY: the caller passes null or a writable CUdevice (cuda.h).
        unsafe { put(device, ordinal, "device") }
    })
}

/// `CUresult cuDeviceGetCount(int *count)`.
///
/// # Safety
/// As `cuda.h` requires: `count` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    run("cuDeviceGetCount", || {
        let n = fake()?.device_count() as c_int;
        // SAFETY: the caller passes null or a writable int (cuda.h).
        unsafe { put(count, n, "count") }
    })
}

/// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`: writes at
/// most `len` bytes, NUL included (truncating the name).
///
/// # Safety
/// As `cuda.h` requires: `name` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    run("cuDeviceGetName", || {
        let f = fake()?;
        let d = f.device(dev)?;
        if name.is_null() {
            return Err(Fail::invalid("name is NULL"));
        }
        let cap = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(|| Fail::invalid(format!("len {len} must be positive")))?;
        let bytes = d.name.as_bytes();
        let n = bytes.len().min(cap - 1);
        // SAFETY: `name` is writable for `len` = `cap` bytes (cuda.h); we
        // write `n` + 1 <= `cap` bytes, from our own string, which cannot
        // overlap the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// The value of a device attribute: plausible figures of an H100-class GPU,
/// VMM, POSIX-fd handles and GPUDirect RDMA on VMM memory supported, fabric
/// handles as `FAKE_CUDA_FABRIC` says, 0 for what the fake does not do.
fn attribute(attrib: CUdevice_attribute, ordinal: i32, config: &Config) -> Option<c_int> {
    let fabric = c_int::from(config.fabric != Fabric::None);
    Some(match attrib {
        1 => 1024,              // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,          // MAX_BLOCK_DIM_X/Y
        4 => 64,                // MAX_BLOCK_DIM_Z
        5 => i32::MAX,          // MAX_GRID_DIM_X
        6 | 7 => 65535,         // MAX_GRID_DIM_Y/Z
        8 => 48 * 1024,         // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 64 * 1024,         // TOTAL_CONSTANT_MEMORY
        10 => 32,               // WARP_SIZE
        12 => 65536,            // MAX_REGISTERS_PER_BLOCK
        13 => 1_755_000,        // CLOCK_RATE (kHz)
        16 => 132,              // MULTIPROCESSOR_COUNT
        19 | 31 | 41 => 1,      // CAN_MAP_HOST_MEMORY, CONCURRENT_KERNELS, UNIFIED_ADDRESSING
        33 => 0x10 + ordinal,   // PCI_BUS_ID
        36 => 2_619_000,        // MEMORY_CLOCK_RATE (kHz)
        37 => 5120,             // GLOBAL_MEMORY_BUS_WIDTH
        38 => 50 * 1024 * 1024, // L2_CACHE_SIZE
        39 => 2048,             // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 3,                // ASYNC_ENGINE_COUNT
        75 => 9,                // COMPUTE_CAPABILITY_MAJOR
        76 => 0,                // COMPUTE_CAPABILITY_MINOR
        78 | 83 | 89 => 1,      // STREAM_PRIORITIES, MANAGED_MEMORY, CONCURRENT_MANAGED_ACCESS
        102 => 1,               // VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        134 => 0,               // HOST_NUMA_ID (CUDA 12.2+): vmm::HOST_NUMA_NODE
        141 => 1,               // HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1,               // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        110 => 1,               // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
        128 => fabric,          // HANDLE_TYPE_FABRIC_SUPPORTED (CUDA 12.3+)
        115 => 1,               // MEMORY_POOLS_SUPPORTED
        a if a == 0 || a >= CU_DEVICE_ATTRIBUTE_MAX => return None,
        _ => 0,
    })
}

/// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED` (102) and
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED` (103) are 1;
/// an attribute outside the enumeration is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// As `cuda.h` requires: `pi` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    run("cuDeviceGetAttribute", || {
        let f = fake()?;
        f.device(dev)?;
        let v = attribute(attrib, dev, &f.config)
            .ok_or_else(|| Fail::invalid(format!("attribute {attrib} does not exist")))?;
        // SAFETY: the caller passes null or a writable int (cuda.h).
        unsafe { put(pi, v, "pi") }
    })
}

/// `CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)`: the configured capacity.
///
/// # Safety
/// As `cuda.h` requires: `bytes` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    run("cuDeviceTotalMem_v2", || {
        let total = fake()?.device(dev)?.capacity as usize;
        // SAFETY: the caller passes null or a writable size_t (cuda.h).
        unsafe { put(bytes, total, "bytes") }
    })
}

/// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`: one
/// more reference on the device's primary context (the same value every time).
///
/// # Safety
/// As `cuda.h` requires: `pctx` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    run("cuDevicePrimaryCtxRetain", || {
        let f = fake()?;
        f.device(dev)?;
        if pctx.is_null() {
            return Err(Fail::invalid("pctx is NULL"));
        }
        let ctx = f.retain(dev)?;
        let ptr = std::ptr::with_exposed_provenance_mut(ctx);
        // SAFETY: `pctx` is non-null and writable (cuda.h).
        unsafe { put(pctx, ptr, "pctx") }
    })
}

/// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`: the last release
/// destroys the context and frees everything still allocated in it (said on
/// stderr when something was). Releasing an unretained context is
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    run("cuDevicePrimaryCtxRelease_v2", || {
        fake()?.release_primary(dev)
    })
}

/// `CUresult cuCtxGetCurrent(CUcontext *pctx)`: the calling thread's current
/// context, null if none.
///
/// # Safety
/// As `cuda.h` requires: `pctx` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    run("cuCtxGetCurrent", || {
        fake()?;
        let ptr = std::ptr::with_exposed_provenance_mut(state::current_context());
        // SAFETY: the caller passes null or a writable CUcontext (cuda.h).
        unsafe { put(pctx, ptr, "pctx") }
    })
}

/// `CUresult cuCtxSetCurrent(CUcontext ctx)`: replaces the top of the
/// calling thread's context stack with `ctx` (pushes it on an empty stack);
/// null pops the top (cuda.h). Anything but a device's primary context is
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    run("cuCtxSetCurrent", || {
        let f = fake()?;
        let value = ctx.expose_provenance();
        if value != 0 && f.device_of_context(value).is_none() {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                format!("{value:#x} is not a context"),
            ));
        }
        set_current_context(value);
        Ok(())
    })
}

/// `CUresult cuCtxPushCurrent_v2(CUcontext ctx)`: pushes `ctx` on the calling
/// thread's context stack; it is current until popped (cuda.h). Null or
/// anything but a primary context is `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    run("cuCtxPushCurrent_v2", || {
        let f = fake()?;
        let value = ctx.expose_provenance();
        if f.device_of_context(value).is_none() {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                format!("{value:#x} is not a context"),
            ));
        }
        state::push_context(value);
        Ok(())
    })
}

/// `CUresult cuCtxPopCurrent_v2(CUcontext *pctx)`: pops the calling thread's
/// current context and returns it through `pctx` (which may be null); the
/// context below becomes current again. An empty stack is
/// `CUDA_ERROR_INVALID_CONTEXT`.
///
/// # Safety
/// As `cuda.h` requires: `pctx` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    run("cuCtxPopCurrent_v2", || {
        fake()?;
        let popped = state::pop_context().ok_or_else(|| {
            Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                "the context stack of this thread is empty",
            )
        })?;
        if !pctx.is_null() {
            // SAFETY: non-null, so writable (cuda.h).
            unsafe { put(pctx, std::ptr::with_exposed_provenance_mut(popped), "pctx") }?;
        }
        Ok(())
    })
}

/// `CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags,
/// int *active)`: flags 0; active while the primary context is retained.
/// Creates nothing.
///
/// # Safety
/// As `cuda.h` requires: `flags`, `active` are each null or valid for what this call writes through them.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    run("cuDevicePrimaryCtxGetState", || {
        let f = fake()?;
        let refs = f.live(dev)?.primary_refs;
        if flags.is_null() || active.is_null() {
            return Err(Fail::invalid("flags or active is NULL"));
        }
        // SAFETY: both non-null and writable (cuda.h).
        unsafe {
            put(flags, 0, "flags")?;
            put(active, c_int::from(refs > 0), "active")
        }
    })
}

/// `CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice
/// peerDev)`: as `FAKE_CUDA_PEERS` says (default: every pair of distinct
/// devices); 0 for a device and itself. Needs no context.
///
/// # Safety
/// As `cuda.h` requires: `canAccessPeer` is null or valid for what this call writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    canAccessPeer: *mut c_int,
    dev: CUdevice,
    peerDev: CUdevice,
) -> CUresult {
    run("cuDeviceCanAccessPeer", || {
        let f = fake()?;
        f.device(dev)?;
        f.device(peerDev)?;
        let can = f.config.can_access_peer(dev as u32, peerDev as u32);
        // SAFETY: the caller passes null or a writable int (cuda.h).
        unsafe { put(canAccessPeer, c_int::from(can), "canAccessPeer") }
    })
}

/// `CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`:
/// `"0000:XX:00.0"` with bus `0x10 + ordinal` (the `PCI_BUS_ID` attribute),
/// truncated to `len` bytes with the NUL. Needs no context.
///
/// # Safety
/// As `cuda.h` requires: `pciBusId` is null or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    pciBusId: *mut c_char,
    len: c_int,
    dev: CUdevice,
) -> CUresult {
    run("cuDeviceGetPCIBusId", || {
        fake()?.device(dev)?;
        if pciBusId.is_null() {
            return Err(Fail::invalid("pciBusId is NULL"));
        }
        let cap = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or_else(|| Fail::invalid(format!("len {len} must be positive")))?;
        let text = pci_bus_id(dev);
        let n = text.len().min(cap - 1);
        // SAFETY: writable for `len` = `cap` bytes (cuda.h); we write n + 1 <= cap
        // bytes from our own string.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), pciBusId, n);
            pciBusId.add(n).write(0);
        }
        Ok(())
    })
}

/// The fake's PCI bus id of device `dev`.
pub fn pci_bus_id(dev: CUdevice) -> String {
    format!("0000:{:02X}:00.0", 0x10 + dev)
}

/// The fake's UUID of device `dev`: `fa4ec0da-0000-4000-8000-0000000000NN`.
pub fn uuid(dev: CUdevice) -> [u8; 16] {
    let mut b = [
        0xfa, 0x4e, 0xc0, 0xda, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0,
    ];
    b[15] = dev as u8;
    b
}

/// `CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)`: see [`uuid`].
///
/// # Safety
/// As `cuda.h` requires: `uuid` is null or valid for what this call writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    run("cuDeviceGetUuid_v2", || {
        fake()?.device(dev)?;
        let bytes = self::uuid(dev).map(|b| b as c_char);
        // SAFETY: the caller passes null or a writable CUuuid (cuda.h).
        unsafe { put(uuid, CUuuid { bytes }, "uuid") }
    })
}

/// `CUresult cuCtxSynchronize(void)`: completes all queued work of the
/// current context's device; `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` (900)
/// during a capture that forbids it (which is then invalidated).
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    run("cuCtxSynchronize", || {
        let f = fake()?;
        let dev = f.current()?;
        Ok(vmmalloc_device::Device::synchronize(&*f.host(dev))?)
    })
}

/// Shared body of `cuGetErrorName` and `cuGetErrorString`.
///
/// # Safety
/// `pStr` is null or writable.
unsafe fn error_text(
    error: CUresult,
    pStr: *mut *const c_char,
    lookup: fn(CUresult) -> Option<&'static std::ffi::CStr>,
) -> Result<(), Fail> {
    if pStr.is_null() {
        return Err(Fail::invalid("pStr is NULL"));
    }
    match lookup(error) {
        // SAFETY: non-null and writable (function contract); the string is static.
        Some(text) => unsafe { put(pStr, text.as_ptr(), "pStr") },
        None => {
            // SAFETY: as above. The driver sets *pStr to NULL for unknown codes.
            unsafe { put(pStr, std::ptr::null(), "pStr") }?;
            Err(Fail::new(
                CUDA_ERROR_INVALID_VALUE,
                format!("unknown CUresult {error}"),
            ))
        }
    }
}

/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`: a static
/// string such as `"CUDA_ERROR_OUT_OF_MEMORY"`; for an unknown code, NULL and
/// `CUDA_ERROR_INVALID_VALUE`. Works before `cuInit`.
///
/// # Safety
/// As `cuda.h` requires: `pStr` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    // SAFETY: `pStr` is null or writable (cuda.h).
    run("cuGetErrorName", || unsafe {
        error_text(error, pStr, codes::name)
    })
}

/// `CUresult cuGetErrorString(CUresult error, const char **pStr)`: a static
/// description such as `"out of memory"`; for an unknown code, NULL and
/// `CUDA_ERROR_INVALID_VALUE`. Works before `cuInit`.
///
/// # Safety
/// As `cuda.h` requires: `pStr` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    // SAFETY: `pStr` is null or writable (cuda.h).
    run("cuGetErrorString", || unsafe {
        error_text(error, pStr, codes::description)
    })
}
