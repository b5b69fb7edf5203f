//! The driver's function table and thin wrappers that turn out-parameters into
//! `Result`s.
//!
//! [`Driver`] resolves every entry point in [`SYMBOLS`] when it is loaded, so a
//! call never finds a symbol missing later. The raw pointers are public in
//! [`DriverFns`] (`driver.raw()`); the methods on [`Driver`] wrap them one to
//! one: out-parameters become return values, result codes become [`CuError`].
//! A method is `unsafe` when the driver may dereference or act on a caller's
//! handle without being able to validate it (a stale stream, event or
//! allocation handle, a range someone else still uses, host memory).

use crate::error::{check, CuError, LoadError};
use crate::types::*;
use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, OsStr};
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::{Arc, OnceLock};

/// The library opened when [`LIBRARY_ENV`] is not set.
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// Environment variable naming the driver library to load instead of
/// [`DEFAULT_LIBRARY`] (a path or a name the dynamic loader can find; the test
/// suite points it at a CPU fake).
pub const LIBRARY_ENV: &str = "VMMALLOC_CUDA_LIBRARY";

/// Declares [`DriverFns`] (one typed pointer per entry point), [`SYMBOLS`] and
/// the resolver, from one list so the three cannot disagree.
macro_rules! entry_points {
    ($( $(#[doc = $doc:literal])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        /// The raw driver entry points, exactly as declared in `cuda.h`
        /// (the `_v2` names are the ones `cuda.h` maps the plain names to).
        ///
        /// Calling any of them is `unsafe`: see `cuda.h` for each one's
        /// requirements. The pointers stay valid for the life of the process:
        /// [`Driver`] never unloads its library.
        #[allow(non_snake_case)]
        #[derive(Debug, Clone, Copy)]
        pub struct DriverFns {
            $(
                $(#[doc = $doc])*
                pub $name: unsafe extern "C" fn($($arg: $ty),*) -> CUresult,
            )*
        }

        /// Every entry point [`Driver`] resolves, in the order it resolves them.
        pub const SYMBOLS: &[&str] = &[$(stringify!($name)),*];

        impl DriverFns {
            /// Resolves every entry point from `lib`; the first one missing is the error.
            fn resolve(lib: &Library, path: &str) -> Result<Self, LoadError> {
                Ok(DriverFns {
                    $(
                        $name: {
                            // SAFETY: the pointer type is the entry point's
                            // signature copied from cuda.h (and checked against
                            // cudarc's bindgen output); the name is
                            // NUL-terminated.
                            let sym = unsafe {
                                lib.get::<unsafe extern "C" fn($($ty),*) -> CUresult>(
                                    concat!(stringify!($name), "\0").as_bytes(),
                                )
                            };
                            *sym.map_err(|_| LoadError::Symbol {
                                name: stringify!($name),
                                path: path.to_owned(),
                            })?
                        },
                    )*
                })
            }
        }
    };
}

entry_points! {
    /// `CUresult cuInit(unsigned int Flags)`.
    fn cuInit(flags: c_uint);
    /// `CUresult cuDriverGetVersion(int *driverVersion)`.
    fn cuDriverGetVersion(version: *mut c_int);
    /// `CUresult cuDeviceGet(CUdevice *device, int ordinal)`.
    fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int);
    /// `CUresult cuDeviceGetCount(int *count)`.
    fn cuDeviceGetCount(count: *mut c_int);
    /// `CUresult cuDeviceGetName(char *name, int len, CUdevice dev)`.
    fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice);
    /// `CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)`.
    fn cuDeviceGetAttribute(pi: *mut c_int, attrib: CUdevice_attribute, dev: CUdevice);
    /// `CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)`.
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice);
    /// `CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice);
    /// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`.
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice);
    /// `CUresult cuCtxGetCurrent(CUcontext *pctx)`.
    fn cuCtxGetCurrent(pctx: *mut CUcontext);
    /// `CUresult cuCtxSetCurrent(CUcontext ctx)`.
    fn cuCtxSetCurrent(ctx: CUcontext);
    /// `CUresult cuCtxSynchronize(void)`.
    fn cuCtxSynchronize();
    /// `CUresult cuMemGetInfo_v2(size_t *free, size_t *total)`.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    /// `CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
    /// CUdeviceptr addr, unsigned long long flags)`.
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64);
    /// `CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)`.
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize);
    /// `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
    /// const CUmemAllocationProp *prop, unsigned long long flags)`.
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64);
    /// `CUresult cuMemRelease(CUmemGenericAllocationHandle handle)`.
    fn cuMemRelease(handle: CUmemGenericAllocationHandle);
    /// `CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
    /// CUmemGenericAllocationHandle handle, unsigned long long flags)`.
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64);
    /// `CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)`.
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize);
    /// `CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
    /// size_t count)`.
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize);
    /// `CUresult cuMemGetAllocationGranularity(size_t *granularity,
    /// const CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option)`.
    fn cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const CUmemAllocationProp, option: CUmemAllocationGranularity_flags);
    /// `CUresult cuMemExportToShareableHandle(void *shareableHandle,
    /// CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType,
    /// unsigned long long flags)`.
    fn cuMemExportToShareableHandle(shareable_handle: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: CUmemAllocationHandleType, flags: u64);
    /// `CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
    /// void *osHandle, CUmemAllocationHandleType shHandleType)`.
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, handle_type: CUmemAllocationHandleType);
    /// `CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`.
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize);
    /// `CUresult cuMemFree_v2(CUdeviceptr dptr)`.
    fn cuMemFree_v2(dptr: CUdeviceptr);
    /// `CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)`.
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize);
    /// `CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)`.
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize);
    /// `CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)`.
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize);
    /// `CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)`.
    fn cuStreamCreate(stream: *mut CUstream, flags: c_uint);
    /// `CUresult cuStreamSynchronize(CUstream hStream)`.
    fn cuStreamSynchronize(stream: CUstream);
    /// `CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)`.
    fn cuEventCreate(event: *mut CUevent, flags: c_uint);
    /// `CUresult cuEventRecord(CUevent hEvent, CUstream hStream)`.
    fn cuEventRecord(event: CUevent, stream: CUstream);
    /// `CUresult cuEventQuery(CUevent hEvent)`.
    fn cuEventQuery(event: CUevent);
    /// `CUresult cuEventSynchronize(CUevent hEvent)`.
    fn cuEventSynchronize(event: CUevent);
    /// `CUresult cuEventDestroy_v2(CUevent hEvent)`.
    fn cuEventDestroy_v2(event: CUevent);
    /// `CUresult cuCtxPushCurrent_v2(CUcontext ctx)`.
    fn cuCtxPushCurrent_v2(ctx: CUcontext);
    /// `CUresult cuCtxPopCurrent_v2(CUcontext *pctx)`.
    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext);
    /// `CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)`.
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int);
    /// `CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)`.
    fn cuDeviceCanAccessPeer(can_access: *mut c_int, dev: CUdevice, peer: CUdevice);
    /// `CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location,
    /// CUdeviceptr ptr)`.
    fn cuMemGetAccess(flags: *mut u64, location: *const CUmemLocation, ptr: CUdeviceptr);
    /// `CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)`.
    fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: CUdevice);
    /// `CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)` (cuda.h maps
    /// `cuDeviceGetUuid` to it since CUDA 11.4).
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
    /// `CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)`.
    fn cuStreamBeginCapture_v2(stream: CUstream, mode: CUstreamCaptureMode);
    /// `CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)`.
    fn cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph);
    /// `CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)`.
    fn cuStreamIsCapturing(stream: CUstream, status: *mut CUstreamCaptureStatus);
    /// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
    fn cuGetErrorName(error: CUresult, text: *mut *const c_char);
    /// `CUresult cuGetErrorString(CUresult error, const char **pStr)`.
    fn cuGetErrorString(error: CUresult, text: *mut *const c_char);
    /// `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`
    /// (cuda.h; no `_v2` name): page-locked host memory in the current context.
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytesize: usize, flags: c_uint);
    /// `CUresult cuMemFreeHost(void *p)` (cuda.h; no `_v2` name).
    fn cuMemFreeHost(p: *mut c_void);
    /// `CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)`:
    /// the legacy IPC handle of a `cuMemAlloc` allocation (what
    /// `cudaIpcGetMemHandle`, and so PyTorch's default allocator, shares).
    fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr);
    /// `CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
    /// unsigned int Flags)` (cuda.h maps `cuIpcOpenMemHandle` to it; the
    /// handle is passed by value).
    fn cuIpcOpenMemHandle_v2(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint);
    /// `CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)`.
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr);
}

/// The CUDA driver library, loaded at run time, with every entry point vmmalloc uses.
///
/// Cheap to share (`Arc`) and to call from any thread: the driver API is
/// thread-safe. The library is never unloaded (the driver does not support
/// being unloaded while contexts exist, and pointers copied out of
/// [`Driver::raw`] must stay valid).
pub struct Driver {
    path: String,
    fns: DriverFns,
    /// Invariant: never dropped, so every pointer in `fns` stays valid.
    _lib: ManuallyDrop<Library>,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

static GLOBAL: OnceLock<Result<Arc<Driver>, LoadError>> = OnceLock::new();

impl Driver {
    /// Loads the library named by [`LIBRARY_ENV`] if it is set and not empty,
    /// else [`DEFAULT_LIBRARY`].
    pub fn load() -> Result<Arc<Driver>, LoadError> {
        match std::env::var_os(LIBRARY_ENV) {
            Some(path) if !path.is_empty() => Self::load_from(path),
            _ => Self::load_from(DEFAULT_LIBRARY),
        }
    }

    /// Loads the driver from `path` (a file path, or a bare name the dynamic
    /// loader searches for) and resolves every entry point in [`SYMBOLS`].
    ///
    /// Fails with [`LoadError::Library`] if the library cannot be opened and
    /// [`LoadError::Symbol`] naming the first entry point it lacks.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Arc<Driver>, LoadError> {
        let path = path.as_ref();
        let shown = path.to_string_lossy().into_owned();
        // SAFETY: opening a library runs its initializers. The path is the CUDA
        // driver (or a stand-in named on purpose by the user through
        // VMMALLOC_CUDA_LIBRARY), whose initializers are safe to run in any
        // process and at any time.
        let lib = unsafe { Library::new(path) }.map_err(|e| LoadError::Library {
            path: shown.clone(),
            reason: loader_reason(&e, &shown),
        })?;
        let fns = DriverFns::resolve(&lib, &shown)?;
        Ok(Arc::new(Driver {
            path: shown,
            fns,
            _lib: ManuallyDrop::new(lib),
        }))
    }

    /// The process-wide driver: [`Driver::load`] on first use, then the same
    /// result (success or error) every time.
    pub fn global() -> Result<Arc<Driver>, LoadError> {
        GLOBAL.get_or_init(Self::load).clone()
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The raw entry points.
    pub fn raw(&self) -> &DriverFns {
        &self.fns
    }

    // -- Errors --------------------------------------------------------------

    /// The driver's name for a result code (`cuGetErrorName`), e.g.
    /// `"CUDA_ERROR_OUT_OF_MEMORY"`; `None` if the driver does not know the code.
    pub fn error_name(&self, code: CUresult) -> Option<String> {
        self.error_text(code, self.fns.cuGetErrorName)
    }

    /// The driver's description of a result code (`cuGetErrorString`), e.g.
    /// `"out of memory"`; `None` if the driver does not know the code.
    pub fn error_string(&self, code: CUresult) -> Option<String> {
        self.error_text(code, self.fns.cuGetErrorString)
    }

    fn error_text(
        &self,
        code: CUresult,
        f: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    ) -> Option<String> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: `text` is a valid out-pointer; the driver accepts any code and
        // answers CUDA_ERROR_INVALID_VALUE (with a null string) for unknown ones.
        let rc = unsafe { f(code, &mut text) };
        if rc != CUDA_SUCCESS || text.is_null() {
            return None;
        }
        // SAFETY: on success the driver points `text` at a static NUL-terminated string.
        Some(
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    // -- Initialization and devices -------------------------------------------

    /// `cuInit(flags)` (flags must be 0). Safe to call more than once.
    pub fn init(&self, flags: u32) -> Result<(), CuError> {
        // SAFETY: no pointers; the driver validates `flags`.
        check("cuInit", unsafe { (self.fns.cuInit)(flags) })
    }

    /// `cuDriverGetVersion`: e.g. 12080 for CUDA 12.8 (see [`version_string`]).
    /// Needs no `cuInit`.
    pub fn driver_get_version(&self) -> Result<i32, CuError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        check("cuDriverGetVersion", unsafe {
            (self.fns.cuDriverGetVersion)(&mut v)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_get_count(&self) -> Result<i32, CuError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            (self.fns.cuDeviceGetCount)(&mut n)
        })?;
        Ok(n)
    }

    /// `cuDeviceGet`: the device handle for an ordinal.
    pub fn device_get(&self, ordinal: i32) -> Result<CUdevice, CuError> {
        let mut dev: CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; the driver validates the ordinal.
        check("cuDeviceGet", unsafe {
            (self.fns.cuDeviceGet)(&mut dev, ordinal)
        })?;
        Ok(dev)
    }

    /// `cuDeviceGetName`.
    pub fn device_get_name(&self, dev: CUdevice) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` is writable for the length passed; the driver writes a
        // NUL-terminated string of at most `len` bytes.
        check("cuDeviceGetName", unsafe {
            (self.fns.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        // Guarantee termination even if the driver filled the buffer.
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` holds a NUL-terminated string (forced just above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuDeviceGetAttribute`.
    pub fn device_get_attribute(
        &self,
        attrib: CUdevice_attribute,
        dev: CUdevice,
    ) -> Result<i32, CuError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer; the driver validates the attribute and device.
        check("cuDeviceGetAttribute", unsafe {
            (self.fns.cuDeviceGetAttribute)(&mut v, attrib, dev)
        })?;
        Ok(v)
    }

    /// `cuDeviceTotalMem_v2`: physical memory of the device in bytes.
    pub fn device_total_mem(&self, dev: CUdevice) -> Result<usize, CuError> {
        let mut bytes = 0usize;
        // SAFETY: `bytes` is a valid out-pointer.
        check("cuDeviceTotalMem_v2", unsafe {
            (self.fns.cuDeviceTotalMem_v2)(&mut bytes, dev)
        })?;
        Ok(bytes)
    }

    // -- Contexts -------------------------------------------------------------

    /// `cuDevicePrimaryCtxRetain`: retains (creating if needed) the device's
    /// primary context. Balance with [`Driver::device_primary_ctx_release`].
    pub fn device_primary_ctx_retain(&self, dev: CUdevice) -> Result<CUcontext, CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the driver validates the device.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (self.fns.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
        })?;
        Ok(ctx)
    }

    /// `cuDevicePrimaryCtxRelease_v2`.
    ///
    /// # Safety
    /// Must balance a retain made by the caller: releasing a reference someone
    /// else holds can destroy the context (and all its memory) under them.
    pub unsafe fn device_primary_ctx_release(&self, dev: CUdevice) -> Result<(), CuError> {
        // SAFETY: the caller owns one retained reference (function contract).
        check("cuDevicePrimaryCtxRelease_v2", unsafe {
            (self.fns.cuDevicePrimaryCtxRelease_v2)(dev)
        })
    }

    /// `cuCtxGetCurrent`: the calling thread's current context (null if none).
    pub fn ctx_get_current(&self) -> Result<CUcontext, CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe {
            (self.fns.cuCtxGetCurrent)(&mut ctx)
        })?;
        Ok(ctx)
    }

    /// `cuCtxSetCurrent`: makes `ctx` current on the calling thread.
    ///
    /// # Safety
    /// `ctx` is null or a live context (e.g. a retained primary context).
    pub unsafe fn ctx_set_current(&self, ctx: CUcontext) -> Result<(), CuError> {
        // SAFETY: `ctx` is null or live (function contract).
        check("cuCtxSetCurrent", unsafe {
            (self.fns.cuCtxSetCurrent)(ctx)
        })
    }

    /// `cuCtxSynchronize`: waits for all work in the current context.
    pub fn ctx_synchronize(&self) -> Result<(), CuError> {
        // SAFETY: no arguments; fails with CUDA_ERROR_INVALID_CONTEXT when no
        // context is current.
        check("cuCtxSynchronize", unsafe { (self.fns.cuCtxSynchronize)() })
    }

    // -- Memory information ---------------------------------------------------

    /// `cuMemGetInfo_v2`: `(free, total)` bytes of the current context's device.
    pub fn mem_get_info(&self) -> Result<(usize, usize), CuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers.
        check("cuMemGetInfo_v2", unsafe {
            (self.fns.cuMemGetInfo_v2)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// `cuMemGetAllocationGranularity`.
    pub fn mem_get_allocation_granularity(
        &self,
        prop: &CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    ) -> Result<usize, CuError> {
        let mut g = 0usize;
        // SAFETY: `g` is a valid out-pointer and `prop` a valid, initialized
        // CUmemAllocationProp that outlives the call.
        check("cuMemGetAllocationGranularity", unsafe {
            (self.fns.cuMemGetAllocationGranularity)(&mut g, prop, option)
        })?;
        Ok(g)
    }

    // -- Virtual memory management --------------------------------------------

    /// `cuMemAddressReserve`: reserves `size` bytes of virtual addresses aligned
    /// to `alignment` (0 = granularity), preferably at `addr` (0 = anywhere).
    pub fn mem_address_reserve(
        &self,
        size: usize,
        alignment: usize,
        addr: CUdeviceptr,
        flags: u64,
    ) -> Result<CUdeviceptr, CuError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; reserving addresses touches no
        // existing memory (an `addr` hint that is taken is simply not honoured).
        check("cuMemAddressReserve", unsafe {
            (self.fns.cuMemAddressReserve)(&mut ptr, size, alignment, addr, flags)
        })?;
        Ok(ptr)
    }

    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` is exactly a range returned by `cuMemAddressReserve`,
    /// owned by the caller, with nothing mapped in it and no one using it.
    pub unsafe fn mem_address_free(&self, ptr: CUdeviceptr, size: usize) -> Result<(), CuError> {
        // SAFETY: the caller owns the reservation (function contract).
        check("cuMemAddressFree", unsafe {
            (self.fns.cuMemAddressFree)(ptr, size)
        })
    }

    /// `cuMemCreate`: a physical allocation of `size` bytes (a multiple of the
    /// granularity). `CUDA_ERROR_OUT_OF_MEMORY` when memory runs out.
    pub fn mem_create(
        &self,
        size: usize,
        prop: &CUmemAllocationProp,
        flags: u64,
    ) -> Result<CUmemGenericAllocationHandle, CuError> {
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a valid,
        // initialized CUmemAllocationProp that outlives the call.
        check("cuMemCreate", unsafe {
            (self.fns.cuMemCreate)(&mut handle, size, prop, flags)
        })?;
        Ok(handle)
    }

    /// `cuMemRelease`: the memory is freed once its last mapping is gone.
    ///
    /// # Safety
    /// `handle` is a live handle owned by the caller (from `cuMemCreate` or
    /// `cuMemImportFromShareableHandle`), released once.
    pub unsafe fn mem_release(&self, handle: CUmemGenericAllocationHandle) -> Result<(), CuError> {
        // SAFETY: the caller owns the live handle (function contract).
        check("cuMemRelease", unsafe { (self.fns.cuMemRelease)(handle) })
    }

    /// `cuMemMap`: maps `size` bytes of `handle` from `offset` at `ptr`.
    ///
    /// # Safety
    /// `handle` is live; `[ptr, ptr+size)` lies in a reservation the caller
    /// owns and is not mapped.
    pub unsafe fn mem_map(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: u64,
    ) -> Result<(), CuError> {
        // SAFETY: handle and range are the caller's (function contract).
        check("cuMemMap", unsafe {
            (self.fns.cuMemMap)(ptr, size, offset, handle, flags)
        })
    }

    /// `cuMemUnmap`.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` covers whole mappings the caller owns, and no queued
    /// device work still uses them.
    pub unsafe fn mem_unmap(&self, ptr: CUdeviceptr, size: usize) -> Result<(), CuError> {
        // SAFETY: the caller owns the mappings and nothing uses them (function contract).
        check("cuMemUnmap", unsafe { (self.fns.cuMemUnmap)(ptr, size) })
    }

    /// `cuMemSetAccess` with the descriptors in `desc`.
    ///
    /// # Safety
    /// `[ptr, ptr+size)` is fully mapped by mappings the caller owns.
    pub unsafe fn mem_set_access(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        desc: &[CUmemAccessDesc],
    ) -> Result<(), CuError> {
        // SAFETY: `desc` is valid for `desc.len()` elements during the call; the
        // range is the caller's (function contract).
        check("cuMemSetAccess", unsafe {
            (self.fns.cuMemSetAccess)(ptr, size, desc.as_ptr(), desc.len())
        })
    }

    /// `cuMemExportToShareableHandle` as a POSIX file descriptor, which the
    /// caller then owns (and must close).
    ///
    /// # Safety
    /// `handle` is live and was created with
    /// [`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`] among its requested handle types.
    pub unsafe fn mem_export_to_fd(
        &self,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<c_int, CuError> {
        let mut fd: c_int = -1;
        // SAFETY: for the POSIX fd type the driver writes one `int` through the
        // pointer, and `fd` is a valid `int`; the handle is live (function contract).
        check("cuMemExportToShareableHandle", unsafe {
            (self.fns.cuMemExportToShareableHandle)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        Ok(fd)
    }

    /// `cuMemExportToShareableHandle` as a fabric handle
    /// ([`CU_MEM_HANDLE_TYPE_FABRIC`]), what NCCL exports for multi-node
    /// NVLink.
    ///
    /// # Safety
    /// `handle` is live.
    pub unsafe fn mem_export_to_fabric(
        &self,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<CUmemFabricHandle, CuError> {
        let mut out = CUmemFabricHandle {
            data: [0; CU_IPC_HANDLE_SIZE],
        };
        // SAFETY: for the fabric type the driver writes one CUmemFabricHandle
        // (64 bytes) through the pointer, and `out` is one; the handle is live
        // (function contract).
        check("cuMemExportToShareableHandle", unsafe {
            (self.fns.cuMemExportToShareableHandle)(
                (&mut out as *mut CUmemFabricHandle).cast::<c_void>(),
                handle,
                CU_MEM_HANDLE_TYPE_FABRIC,
                0,
            )
        })?;
        Ok(out)
    }

    /// `cuMemImportFromShareableHandle` from a fabric handle; the new handle
    /// must be released.
    pub fn mem_import_from_fabric(
        &self,
        fabric: &CUmemFabricHandle,
    ) -> Result<CUmemGenericAllocationHandle, CuError> {
        let mut handle: CUmemGenericAllocationHandle = 0;
        // cuda.h: for CU_MEM_HANDLE_TYPE_FABRIC, `osHandle` points to the
        // CUmemFabricHandle, which the driver only reads.
        let os_handle = (fabric as *const CUmemFabricHandle)
            .cast_mut()
            .cast::<c_void>();
        // SAFETY: `handle` is a valid out-pointer and `os_handle` points to a
        // readable 64-byte fabric handle for the call.
        check("cuMemImportFromShareableHandle", unsafe {
            (self.fns.cuMemImportFromShareableHandle)(
                &mut handle,
                os_handle,
                CU_MEM_HANDLE_TYPE_FABRIC,
            )
        })?;
        Ok(handle)
    }

    /// `cuMemImportFromShareableHandle` from a POSIX file descriptor. The
    /// descriptor stays owned by the caller; the new handle must be released.
    ///
    /// # Safety
    /// `fd` is an open descriptor made by `cuMemExportToShareableHandle`.
    pub unsafe fn mem_import_from_fd(
        &self,
        fd: c_int,
    ) -> Result<CUmemGenericAllocationHandle, CuError> {
        let mut handle: CUmemGenericAllocationHandle = 0;
        // cuda.h: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, `osHandle` is the
        // descriptor itself cast to a pointer, `(void *)(uintptr_t)fd`; the
        // driver never dereferences it.
        let os_handle = std::ptr::without_provenance_mut::<c_void>(fd as usize);
        // SAFETY: `handle` is a valid out-pointer; `fd` is an exported
        // allocation's descriptor (function contract).
        check("cuMemImportFromShareableHandle", unsafe {
            (self.fns.cuMemImportFromShareableHandle)(
                &mut handle,
                os_handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }

    // -- Plain allocation and copies ------------------------------------------

    /// `cuMemAlloc_v2`: `bytesize` bytes of device memory in the current context.
    pub fn mem_alloc(&self, bytesize: usize) -> Result<CUdeviceptr, CuError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer.
        check("cuMemAlloc_v2", unsafe {
            (self.fns.cuMemAlloc_v2)(&mut ptr, bytesize)
        })?;
        Ok(ptr)
    }

    /// `cuMemFree_v2`.
    ///
    /// # Safety
    /// `ptr` was returned by `cuMemAlloc` to the caller, is freed once, and no
    /// queued work still uses it.
    pub unsafe fn mem_free(&self, ptr: CUdeviceptr) -> Result<(), CuError> {
        // SAFETY: the caller owns the allocation (function contract).
        check("cuMemFree_v2", unsafe { (self.fns.cuMemFree_v2)(ptr) })
    }

    /// `cuMemcpyHtoD_v2`: copies `src` to device address `dst` (synchronous with
    /// respect to `src`: it may be reused once this returns).
    ///
    /// # Safety
    /// `[dst, dst+src.len())` is device memory the caller may write (mapped and
    /// accessible), not host memory Rust code owns.
    pub unsafe fn memcpy_htod(&self, dst: CUdeviceptr, src: &[u8]) -> Result<(), CuError> {
        // SAFETY: `src` is readable for its length for the whole call; the
        // destination is the caller's device memory (function contract).
        check("cuMemcpyHtoD_v2", unsafe {
            (self.fns.cuMemcpyHtoD_v2)(dst, src.as_ptr().cast::<c_void>(), src.len())
        })
    }

    /// `cuMemcpyDtoH_v2`: copies `dst.len()` bytes from device address `src`
    /// (synchronous: the bytes are in `dst` when this returns).
    ///
    /// # Safety
    /// `[src, src+dst.len())` is device memory the caller may read (mapped and
    /// accessible), and no device work writes it concurrently.
    pub unsafe fn memcpy_dtoh(&self, dst: &mut [u8], src: CUdeviceptr) -> Result<(), CuError> {
        // SAFETY: `dst` is writable for its length for the whole call and the
        // copy has finished when the call returns; the source is the caller's
        // (function contract).
        check("cuMemcpyDtoH_v2", unsafe {
            (self.fns.cuMemcpyDtoH_v2)(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
        })
    }

    /// `cuMemcpyDtoD_v2`: copies `bytes` bytes from device address `src` to
    /// device address `dst`, on the legacy default stream. Not synchronous
    /// with the host for device-to-device copies (CUDA Driver API, "API
    /// synchronization behavior": "no host-side synchronization is
    /// performed"): wait (e.g. [`Driver::ctx_synchronize`]) before the
    /// source is unmapped or the destination read.
    ///
    /// # Safety
    /// Both ranges are device memory the caller may read and write (mapped
    /// and accessible) and do not overlap.
    pub unsafe fn memcpy_dtod(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> Result<(), CuError> {
        // SAFETY: both ranges are the caller's device memory (function
        // contract); no host memory is touched.
        check("cuMemcpyDtoD_v2", unsafe {
            (self.fns.cuMemcpyDtoD_v2)(dst, src, bytes)
        })
    }

    // -- Page-locked host memory -----------------------------------------------

    /// `cuMemHostAlloc`: `bytesize` bytes of page-locked (pinned) host memory,
    /// registered with the current context (`CU_MEMHOSTALLOC_*` flags; 0 for
    /// plain pinned memory). The driver copies to and from it by DMA, without
    /// the staging buffer pageable memory needs (CUDA C Programming Guide,
    /// "Page-Locked Host Memory").
    pub fn mem_host_alloc(&self, bytesize: usize, flags: u32) -> Result<*mut c_void, CuError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            (self.fns.cuMemHostAlloc)(&mut p, bytesize, flags)
        })?;
        Ok(p)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `p` was returned by `cuMemHostAlloc` (or `cuMemAllocHost`), is freed
    /// once, and nothing (host code or queued copies) still uses it.
    pub unsafe fn mem_free_host(&self, p: *mut c_void) -> Result<(), CuError> {
        // SAFETY: the caller owns the allocation (function contract).
        check("cuMemFreeHost", unsafe { (self.fns.cuMemFreeHost)(p) })
    }

    // -- Streams and events ---------------------------------------------------

    /// `cuStreamCreate` in the current context (`CU_STREAM_*` flags).
    pub fn stream_create(&self, flags: u32) -> Result<CUstream, CuError> {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            (self.fns.cuStreamCreate)(&mut s, flags)
        })?;
        Ok(s)
    }

    /// `cuStreamSynchronize` (null = the legacy default stream).
    ///
    /// # Safety
    /// `stream` is null or a live stream of the current context.
    pub unsafe fn stream_synchronize(&self, stream: CUstream) -> Result<(), CuError> {
        // SAFETY: `stream` is null or live (function contract).
        check("cuStreamSynchronize", unsafe {
            (self.fns.cuStreamSynchronize)(stream)
        })
    }

    /// `cuEventCreate` in the current context (`CU_EVENT_*` flags).
    pub fn event_create(&self, flags: u32) -> Result<CUevent, CuError> {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer.
        check("cuEventCreate", unsafe {
            (self.fns.cuEventCreate)(&mut e, flags)
        })?;
        Ok(e)
    }

    /// `cuEventRecord` of `event` on `stream` (null = legacy default stream).
    ///
    /// # Safety
    /// `event` is live; `stream` is null or live, in the same context.
    pub unsafe fn event_record(&self, event: CUevent, stream: CUstream) -> Result<(), CuError> {
        // SAFETY: both are live (function contract).
        check("cuEventRecord", unsafe {
            (self.fns.cuEventRecord)(event, stream)
        })
    }

    /// `cuEventQuery`: `Ok(true)` when complete, `Ok(false)` on
    /// `CUDA_ERROR_NOT_READY`, an error otherwise.
    ///
    /// # Safety
    /// `event` is live.
    pub unsafe fn event_query(&self, event: CUevent) -> Result<bool, CuError> {
        // SAFETY: `event` is live (function contract).
        match unsafe { (self.fns.cuEventQuery)(event) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(CuError {
                call: "cuEventQuery",
                code,
            }),
        }
    }

    /// `cuEventSynchronize`.
    ///
    /// # Safety
    /// `event` is live.
    pub unsafe fn event_synchronize(&self, event: CUevent) -> Result<(), CuError> {
        // SAFETY: `event` is live (function contract).
        check("cuEventSynchronize", unsafe {
            (self.fns.cuEventSynchronize)(event)
        })
    }

    /// `cuEventDestroy_v2`.
    ///
    /// # Safety
    /// `event` is live, owned by the caller, and not used afterwards.
    pub unsafe fn event_destroy(&self, event: CUevent) -> Result<(), CuError> {
        // SAFETY: the caller owns the live event (function contract).
        check("cuEventDestroy_v2", unsafe {
            (self.fns.cuEventDestroy_v2)(event)
        })
    }

    // -- Context stack, peers, identity, capture (issue 11) --------------------

    /// `cuCtxPushCurrent_v2`: pushes `ctx` onto the calling thread's context
    /// stack; it becomes current until popped. Balance with
    /// [`Driver::ctx_pop_current`].
    ///
    /// # Safety
    /// `ctx` is a live context (e.g. a retained primary context).
    pub unsafe fn ctx_push_current(&self, ctx: CUcontext) -> Result<(), CuError> {
        // SAFETY: `ctx` is live (function contract).
        check("cuCtxPushCurrent_v2", unsafe {
            (self.fns.cuCtxPushCurrent_v2)(ctx)
        })
    }

    /// `cuCtxPopCurrent_v2`: pops the calling thread's current context and
    /// returns it; the one below (or none) becomes current again.
    ///
    /// # Safety
    /// Must balance a push made by the caller on this thread: popping a
    /// context someone else pushed changes their current context.
    pub unsafe fn ctx_pop_current(&self) -> Result<CUcontext, CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the push is the caller's (contract).
        check("cuCtxPopCurrent_v2", unsafe {
            (self.fns.cuCtxPopCurrent_v2)(&mut ctx)
        })?;
        Ok(ctx)
    }

    /// `cuDevicePrimaryCtxGetState`: `(flags, active)`. `active` tells whether
    /// the primary context exists (someone, e.g. the CUDA runtime, retained
    /// it); asking creates nothing.
    pub fn device_primary_ctx_get_state(&self, dev: CUdevice) -> Result<(u32, bool), CuError> {
        let mut flags: c_uint = 0;
        let mut active: c_int = 0;
        // SAFETY: both are valid out-pointers; the driver validates the device.
        check("cuDevicePrimaryCtxGetState", unsafe {
            (self.fns.cuDevicePrimaryCtxGetState)(dev, &mut flags, &mut active)
        })?;
        Ok((flags, active != 0))
    }

    /// `cuDeviceCanAccessPeer`: whether contexts on `dev` can access memory
    /// of `peer` directly. Needs no context.
    pub fn device_can_access_peer(&self, dev: CUdevice, peer: CUdevice) -> Result<bool, CuError> {
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer; the driver validates the devices.
        check("cuDeviceCanAccessPeer", unsafe {
            (self.fns.cuDeviceCanAccessPeer)(&mut can, dev, peer)
        })?;
        Ok(can != 0)
    }

    /// `cuMemGetAccess`: the access flags (`CU_MEM_ACCESS_FLAGS_PROT_*`) that
    /// `location` has to the mapping containing `ptr`.
    pub fn mem_get_access(
        &self,
        location: &CUmemLocation,
        ptr: CUdeviceptr,
    ) -> Result<u64, CuError> {
        let mut flags: u64 = 0;
        // SAFETY: `flags` is a valid out-pointer and `location` a readable
        // CUmemLocation; the call only reads the driver's mapping tables.
        check("cuMemGetAccess", unsafe {
            (self.fns.cuMemGetAccess)(&mut flags, location, ptr)
        })?;
        Ok(flags)
    }

    /// `cuDeviceGetPCIBusId`: `"domain:bus:device.function"` (e.g.
    /// `"0000:3B:00.0"`), as NVML reports it. Needs no context.
    pub fn device_get_pci_bus_id(&self, dev: CUdevice) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 64];
        // SAFETY: `buf` is writable for its length, which we pass; the driver
        // NUL-terminates within it.
        check("cuDeviceGetPCIBusId", unsafe {
            (self.fns.cuDeviceGetPCIBusId)(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        buf[buf.len() - 1] = 0;
        // SAFETY: NUL-terminated within `buf` (set above at the latest).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuDeviceGetUuid_v2`: the device's 16-byte UUID (NVML prints it as
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`). Needs no context.
    pub fn device_get_uuid(&self, dev: CUdevice) -> Result<[u8; 16], CuError> {
        let mut uuid = CUuuid { bytes: [0; 16] };
        // SAFETY: `uuid` is a valid out-pointer.
        check("cuDeviceGetUuid_v2", unsafe {
            (self.fns.cuDeviceGetUuid_v2)(&mut uuid, dev)
        })?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// `cuIpcGetMemHandle`: the legacy IPC handle of the `cuMemAlloc`
    /// allocation starting at `dptr` (in the current context).
    pub fn ipc_get_mem_handle(&self, dptr: CUdeviceptr) -> Result<CUipcMemHandle, CuError> {
        let mut h = CUipcMemHandle {
            reserved: [0; CU_IPC_HANDLE_SIZE],
        };
        // SAFETY: `h` is a valid out-pointer; the driver validates `dptr`.
        check("cuIpcGetMemHandle", unsafe {
            (self.fns.cuIpcGetMemHandle)(&mut h, dptr)
        })?;
        Ok(h)
    }

    /// `cuIpcOpenMemHandle_v2`: maps the memory another process exported
    /// with `cuIpcGetMemHandle` into the current context (flags must be
    /// [`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`]); returns the device pointer.
    /// Opening the same handle again in the same context returns the same
    /// pointer and counts one more reference (CUDA Driver API, "Memory
    /// Management", `cuIpcOpenMemHandle`).
    pub fn ipc_open_mem_handle(
        &self,
        handle: CUipcMemHandle,
        flags: u32,
    ) -> Result<CUdeviceptr, CuError> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: `p` is a valid out-pointer; the handle is passed by value
        // and validated by the driver.
        check("cuIpcOpenMemHandle_v2", unsafe {
            (self.fns.cuIpcOpenMemHandle_v2)(&mut p, handle, flags)
        })?;
        Ok(p)
    }

    /// `cuIpcCloseMemHandle`: drops one reference to memory
    /// [`Driver::ipc_open_mem_handle`] returned; the last one unmaps it.
    ///
    /// # Safety
    /// No work still queued may use the mapping after its last reference goes.
    pub unsafe fn ipc_close_mem_handle(&self, dptr: CUdeviceptr) -> Result<(), CuError> {
        // SAFETY: no pointer is dereferenced; the driver validates `dptr`,
        // and the caller guarantees no queued work uses the mapping.
        check("cuIpcCloseMemHandle", unsafe {
            (self.fns.cuIpcCloseMemHandle)(dptr)
        })
    }

    /// `cuStreamBeginCapture_v2`: starts capturing `stream` into a graph.
    ///
    /// # Safety
    /// `stream` is a live stream of the current context (not the legacy
    /// default stream, which the driver refuses).
    pub unsafe fn stream_begin_capture(
        &self,
        stream: CUstream,
        mode: CUstreamCaptureMode,
    ) -> Result<(), CuError> {
        // SAFETY: `stream` is live (function contract).
        check("cuStreamBeginCapture_v2", unsafe {
            (self.fns.cuStreamBeginCapture_v2)(stream, mode)
        })
    }

    /// `cuStreamEndCapture`: ends the capture and returns the graph.
    ///
    /// # Safety
    /// `stream` is a live stream of the current context; the caller owns the
    /// returned graph.
    pub unsafe fn stream_end_capture(&self, stream: CUstream) -> Result<CUgraph, CuError> {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is a valid out-pointer; `stream` is live (contract).
        check("cuStreamEndCapture", unsafe {
            (self.fns.cuStreamEndCapture)(stream, &mut graph)
        })?;
        Ok(graph)
    }

    /// `cuStreamIsCapturing`: the stream's `CU_STREAM_CAPTURE_STATUS_*`.
    ///
    /// # Safety
    /// `stream` is null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD` or a live
    /// stream of the current context.
    pub unsafe fn stream_is_capturing(
        &self,
        stream: CUstream,
    ) -> Result<CUstreamCaptureStatus, CuError> {
        let mut status: CUstreamCaptureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-pointer; `stream` is valid (contract).
        check("cuStreamIsCapturing", unsafe {
            (self.fns.cuStreamIsCapturing)(stream, &mut status)
        })?;
        Ok(status)
    }
}

/// Formats a `cuDriverGetVersion` value: 12080 → `"12.8"`.
pub fn version_string(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// The loader's message, without repeating the path when it starts with it.
fn loader_reason(e: &libloading::Error, path: &str) -> String {
    let text = e.to_string();
    // libloading: "<dlerror text>", where dlerror usually reads "<path>: <reason>".
    text.strip_prefix(path)
        .and_then(|rest| rest.strip_prefix(": "))
        .map(str::to_owned)
        .unwrap_or(text)
}
