//! The `cuda` backend: a real GPU through [`vmm_sys`].
//!
//! # Contexts
//!
//! A [`CudaDevice`] works in the device's *primary* context (the one the CUDA
//! runtime, and so PyTorch, uses). It retains that context lazily, on the
//! first call that needs a context, and releases it when dropped: opening a
//! device (and queries such as [`CudaDevice::primary_context_active`]) create
//! no context, so a device PyTorch has not used stays without one
//! (`cuDevicePrimaryCtxRetain` creates the primary context if it is not
//! active; `cuDevicePrimaryCtxGetState` only asks — CUDA Driver API, "Primary
//! Context Management").
//!
//! Driver calls act on the calling thread's *current* context: the top of a
//! per-thread context stack (CUDA Driver API, "Context Management":
//! `cuCtxPushCurrent` pushes, `cuCtxPopCurrent` pops and makes the context
//! below current again, `cuCtxSetCurrent` replaces the top). Every method
//! wraps its driver calls in a [`ContextScope`]: when the primary context is
//! already current (the usual case, one `cuCtxGetCurrent`) nothing changes;
//! otherwise it is pushed for the call and popped afterwards, so the caller's
//! current context — PyTorch's current device, or a context another library
//! pushed — is exactly as it was.
//!
//! # Peers and handle types
//!
//! [`CudaOptions::peers`] chooses the devices granted read-write access to
//! every mapping, in the same `cuMemSetAccess` call as this device (one
//! `CUmemAccessDesc` each): PyTorch's expandable segments do the same for each
//! peer (`ExpandableSegment::addPeer` / `setAccess` in
//! `c10/cuda/CUDACachingAllocator.cpp`), because `cudaDeviceEnablePeerAccess`
//! does not cover `cuMemCreate` memory. [`CudaOptions::ipc`] requests
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` (and [`CudaOptions::ipc_auto`]
//! requests it where the device supports it); otherwise no handle type is
//! requested (`CU_MEM_HANDLE_TYPE_NONE`) and exporting fails with a clear
//! error. Importing a descriptor needs only the device's support.
//!
//! [`CudaOptions::nccl_ready`] creates memory as NCCL's `ncclMemAlloc` does
//! (NCCL's allocator.cc), so that NCCL's user-buffer registration can
//! export and map it: `CU_MEM_HANDLE_TYPE_FABRIC` is requested too where the
//! device reports `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`, and if
//! `cuMemCreate` refuses it (`CUDA_ERROR_NOT_PERMITTED` without an IMEX
//! channel, or `CUDA_ERROR_NOT_SUPPORTED`) the call is made again without it
//! and fabric is not asked for again on this device; `gpuDirectRDMACapable`
//! is set where `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`
//! is 1; and the page is `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` for those
//! properties where it is a multiple of the minimum (else the minimum).
//! Host-located chunks (spill) keep the handle types but not the RDMA flag,
//! as NCCL's own host allocations (`ncclCuMemHostAlloc`, NCCL's
//! include/alloc.h).
//!
//! # Special streams
//!
//! `CU_STREAM_LEGACY` (0x1) is the legacy default stream, the same stream as
//! null; `CU_STREAM_PER_THREAD` (0x2) names a *different* stream on every
//! thread (cuda.h; CUDA Driver API, "Stream synchronization behavior").
//! [`stream_key`] turns the raw value a caller passes into a [`Stream`] that
//! an allocator can key on: 0x1 becomes [`Stream::DEFAULT`], 0x2 a value
//! unique to the calling thread. Used from its own thread, such a key is
//! `CU_STREAM_PER_THREAD`; from another thread the driver cannot name that
//! stream, so an event is recorded on the legacy default stream instead (it
//! completes only after all earlier work of every blocking stream, the
//! per-thread ones included) and a synchronize synchronizes the context:
//! conservative, never too early.
//!
//! # Errors
//!
//! - `CUDA_ERROR_OUT_OF_MEMORY` (2) becomes [`DeviceError::OutOfMemory`] with
//!   the requested size and `cuMemGetInfo`'s free/total (0 free when that call
//!   fails too), so allocators can treat it as recoverable.
//! - Every other code becomes [`DeviceError::Driver`] with the raw code, the
//!   driver's name for it (`cuGetErrorName`) and a detail naming the entry point,
//!   its arguments and `cuGetErrorString`'s description.
//! - Opening fails with [`DeviceError::Unavailable`] and a one-line reason: no
//!   library, no device, no such ordinal, no VMM support.
//!
//! # Soundness of a safe API over raw handles
//!
//! [`Device`] is a safe trait, but the driver cannot validate every raw value
//! (a stale event or allocation handle may be dereferenced). So this backend
//! keeps a registry of what it handed out: physical handles, events and
//! streams are checked before each use (an unknown one is a
//! [`DeviceError::Rule`], as on the models) and are not destroyed while another
//! thread is inside a driver call with them; host↔device copies must fall
//! inside a reservation or plain allocation made by this device, so they can
//! only ever touch device memory, never host memory that Rust code owns. The
//! driver validates everything else (address ranges, sizes, alignment) and
//! answers with an error code.
//!
//! Streams are created with `CU_STREAM_NON_BLOCKING` (independent of the legacy
//! default stream, as PyTorch's are) and events with `CU_EVENT_DISABLE_TIMING`
//! (the cheap kind PyTorch's allocator records). [`Stream::DEFAULT`] is the
//! legacy default stream; other [`Stream`] and [`Event`] values are the raw
//! `CUstream` / `CUevent` pointers, or [`stream_key`]'s per-thread keys.

use crate::{
    Call, Device, DeviceCaps, DeviceError, DeviceResult, Event, HostBuffer, IpcMemHandle, MemInfo,
    PhysHandle, Rule, Stream,
};
use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use vmm_sys::{
    result_name, CUcontext, CUdevice, CUevent, CUevent_st, CUmemAccessDesc, CUmemAllocationProp,
    CUstream, CUstream_st, CuError, Driver, LoadError, CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
    CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED, CU_EVENT_DISABLE_TIMING,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    CU_MEM_HANDLE_TYPE_FABRIC, CU_MEM_HANDLE_TYPE_NONE, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_LEGACY, CU_STREAM_NON_BLOCKING, CU_STREAM_PER_THREAD,
};
// Spill (host-located chunks, `create_on_host`).
use vmm_sys::{
    CUmemLocation, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
    CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
};

mod context;
mod driver;
mod ipc;
mod peers;
mod registry;
mod streams;

pub use context::ContextScope;
use context::*;
use driver::*;
pub use driver::{device_count, driver_version};
use peers::*;
pub use peers::{CudaOptions, Peers};
use registry::*;
use streams::*;
pub use streams::{is_per_thread_key, stream_key};

// ---------------------------------------------------------------------------
// The device
// ---------------------------------------------------------------------------

/// One CUDA GPU, by ordinal, through its primary context.
pub struct CudaDevice {
    driver: Arc<Driver>,
    dev: CUdevice,
    /// The primary context, retained on first use (never for a device that
    /// only answered queries).
    ctx: OnceLock<PrimaryContext>,
    /// Serializes the first retain.
    ctx_init: Mutex<()>,
    caps: DeviceCaps,
    /// Shareable handle kinds requested for every `cuMemCreate`: fixed at
    /// open, except that `CU_MEM_HANDLE_TYPE_FABRIC` is dropped once the
    /// driver refused it (see "Peers and handle types").
    handle_types: AtomicU32,
    /// `allocFlags.gpuDirectRDMACapable` for device memory
    /// ([`CudaOptions::nccl_ready`] on a device that supports it).
    rdma: bool,
    /// Whether handles are created exportable (`CudaOptions::ipc`, or
    /// `ipc_auto` on a device that supports it).
    ipc: bool,
    /// Whether the device supports POSIX file descriptor handles, so that
    /// descriptors another process exported can be imported (importing does
    /// not need this process's own handles to be exportable).
    can_import: bool,
    /// Ordinals of the peers granted access (see [`Peers`]).
    peers: Vec<u32>,
    /// One read-write descriptor for this device, then one per peer.
    access: Vec<CUmemAccessDesc>,
    /// Copies are checked against these; a copy holds the read lock.
    ranges: RwLock<Ranges>,
    handles: Mutex<Registry>,
    events: Mutex<Registry>,
    /// Pointers `cuIpcOpenMemHandle` returned, one reference per open
    /// (`ipc.rs`).
    ipc_opened: Mutex<Registry>,
    /// Streams never die (the trait has no destroy), so membership suffices.
    streams: Mutex<HashSet<u64>>,
    /// Accept stream handles created outside this device (PyTorch's side streams).
    external_streams: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("driver", &self.driver.path())
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` with the process-wide driver ([`Driver::global`]:
    /// `libcuda.so.1`, or `VMMALLOC_CUDA_LIBRARY`) and default options.
    pub fn open(ordinal: u32) -> DeviceResult<CudaDevice> {
        Self::open_with_options(global_driver()?, ordinal, &CudaOptions::default())
    }

    /// Opens device `ordinal` with the process-wide driver and `options`.
    pub fn open_configured(ordinal: u32, options: &CudaOptions) -> DeviceResult<CudaDevice> {
        Self::open_with_options(global_driver()?, ordinal, options)
    }

    /// Opens device `ordinal` with the driver library at `path`.
    pub fn open_library(path: &str, ordinal: u32) -> DeviceResult<CudaDevice> {
        let driver = Driver::load_from(path).map_err(|e| unavailable_load(&e))?;
        Self::open_with(driver, ordinal)
    }

    /// Opens device `ordinal` with a loaded driver and default options.
    pub fn open_with(driver: Arc<Driver>, ordinal: u32) -> DeviceResult<CudaDevice> {
        Self::open_with_options(driver, ordinal, &CudaOptions::default())
    }

    /// Opens device `ordinal` with a loaded driver: `cuInit`, `cuDeviceGet`,
    /// checks VMM support, resolves the peers and queries the allocation
    /// granularity (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`, with the handle types
    /// the options ask for; also the recommended one with
    /// [`CudaOptions::nccl_ready`]). None of these needs a context, so none is
    /// created, with one exception: a driver that refuses the granularity
    /// query without a current context (`CUDA_ERROR_INVALID_CONTEXT`) gets the
    /// primary context retained for it, as the first real use would.
    pub fn open_with_options(
        driver: Arc<Driver>,
        ordinal: u32,
        options: &CudaOptions,
    ) -> DeviceResult<CudaDevice> {
        Self::open_inner(driver, ordinal, options, true)
    }

    /// What [`CudaDevice::open_with`] would report for device `ordinal`,
    /// guaranteed to create and retain no context (for `vmmalloc info`): a
    /// driver that needs a context for the granularity query gives
    /// `Unavailable` saying so.
    pub fn probe(driver: Arc<Driver>, ordinal: u32) -> DeviceResult<DeviceCaps> {
        let options = CudaOptions {
            peers: Peers::None,
            ipc: false,
            ipc_auto: false,
            nccl_ready: false,
        };
        Self::open_inner(driver, ordinal, &options, false).map(|d| d.caps)
    }

    fn open_inner(
        driver: Arc<Driver>,
        ordinal: u32,
        options: &CudaOptions,
        may_retain: bool,
    ) -> DeviceResult<CudaDevice> {
        let unavailable = |e: CuError| DeviceError::Unavailable(describe(&driver, e));
        match driver.init(0) {
            Ok(()) => {}
            Err(e) if e.code == CUDA_ERROR_NO_DEVICE => {
                return Err(DeviceError::Unavailable(format!(
                    "no CUDA device found ({})",
                    describe(&driver, e)
                )))
            }
            Err(e) => return Err(unavailable(e)),
        }
        let index = i32::try_from(ordinal).map_err(|_| {
            DeviceError::Unavailable(format!("invalid CUDA device ordinal {ordinal}"))
        })?;
        let dev = match driver.device_get(index) {
            Ok(dev) => dev,
            Err(e) if e.code == CUDA_ERROR_INVALID_DEVICE => {
                let count = driver.device_get_count().unwrap_or(0);
                return Err(DeviceError::Unavailable(format!(
                    "no CUDA device with ordinal {ordinal} ({count} device(s) present)"
                )));
            }
            Err(e) => return Err(unavailable(e)),
        };
        let name = driver.device_get_name(dev).map_err(unavailable)?;
        let vmm = driver
            .device_get_attribute(
                CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                dev,
            )
            .map_err(unavailable)?;
        if vmm == 0 {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} ({name}) does not support the virtual memory management API \
                 (CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED = 0)"
            )));
        }
        // Older drivers may not know the attribute: treat an error as "no".
        let posix_fd = driver
            .device_get_attribute(
                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                dev,
            )
            .unwrap_or(0)
            != 0;
        if options.ipc && !posix_fd {
            return Err(DeviceError::Unavailable(format!(
                "ipc:true, but CUDA device {ordinal} ({name}) cannot export POSIX file descriptor \
                 handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0)"
            )));
        }
        let peers = resolve_peers(&driver, dev, ordinal, &options.peers)?;
        let total_memory = driver.device_total_mem(dev).map_err(unavailable)? as u64;
        // ipc:auto requests exportable handles where the device has them.
        let ipc = options.ipc || (options.ipc_auto && posix_fd);
        let mut handle_types = if ipc {
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            CU_MEM_HANDLE_TYPE_NONE
        };
        // NCCL's ncclMemAlloc (allocator.cc): FABRIC where the device
        // reports it, gpuDirectRDMACapable where it reports VMM RDMA. Older
        // drivers may not know the attributes: an error is "no".
        let attribute = |a| driver.device_get_attribute(a, dev).unwrap_or(0) != 0;
        if options.nccl_ready && attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) {
            handle_types |= CU_MEM_HANDLE_TYPE_FABRIC;
        }
        let rdma = options.nccl_ready
            && attribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED);
        let mut access = vec![CUmemAccessDesc::read_write(dev)];
        access.extend(
            peers
                .iter()
                .map(|&p| CUmemAccessDesc::read_write(p as CUdevice)),
        );
        let mut device = CudaDevice {
            caps: DeviceCaps {
                name,
                ordinal,
                granularity: 0,
                total_memory,
                vmm_supported: true,
                posix_fd_handles: ipc,
                has_memory: true,
            },
            driver: Arc::clone(&driver),
            dev,
            ctx: OnceLock::new(),
            ctx_init: Mutex::new(()),
            handle_types: AtomicU32::new(handle_types),
            rdma,
            ipc,
            can_import: posix_fd,
            peers,
            access,
            ranges: RwLock::new(Ranges::default()),
            handles: Mutex::new(Registry::default()),
            events: Mutex::new(Registry::default()),
            ipc_opened: Mutex::new(Registry::default()),
            streams: Mutex::new(HashSet::new()),
            external_streams: std::sync::atomic::AtomicBool::new(false),
        };
        let minimum = device.query_granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM, may_retain)?;
        if minimum == 0 {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} ({}) reported an allocation granularity of 0",
                device.caps.name
            )));
        }
        // NCCL's ncclMemAlloc pads to the recommended granularity; every VMM
        // size and address must stay a multiple of the minimum (cuda.h,
        // cuMemCreate / cuMemMap), so a recommended value that is not one is
        // ignored, as is a failed query.
        let mut granularity = minimum;
        if options.nccl_ready {
            if let Ok(recommended) =
                device.query_granularity(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, may_retain)
            {
                if recommended > minimum && recommended % minimum == 0 {
                    granularity = recommended;
                }
            }
        }
        device.caps.granularity = granularity;
        Ok(device)
    }

    /// The driver this device calls.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// The driver's `CUdevice` for this ordinal.
    pub fn cu_device(&self) -> CUdevice {
        self.dev
    }

    /// The primary context, retained now if this device has not retained it
    /// yet (which creates it if no one else has).
    pub fn context(&self) -> DeviceResult<CUcontext> {
        self.primary(Call::DeviceSync)
    }

    /// Whether this device holds a retain of its primary context (false
    /// until the first call that needs a context).
    pub fn has_retained_context(&self) -> bool {
        self.ctx.get().is_some()
    }

    /// Whether the device's primary context exists, whoever created it
    /// (`cuDevicePrimaryCtxGetState`; creates nothing). PyTorch has used a
    /// device exactly when this is true.
    pub fn primary_context_active(&self) -> DeviceResult<bool> {
        self.driver
            .device_primary_ctx_get_state(self.dev)
            .map(|(_, active)| active)
            .map_err(|e| DeviceError::Unavailable(describe(&self.driver, e)))
    }

    /// The ordinals granted read-write access to this device's memory on
    /// every `set_access` (see [`Peers`]).
    pub fn peers(&self) -> &[u32] {
        &self.peers
    }

    /// Makes the primary context current on the calling thread until the
    /// returned scope is dropped, then restores the caller's context (see
    /// the module docs). For code that calls the driver directly.
    pub fn enter(&self, call: Call) -> DeviceResult<ContextScope<'_>> {
        let ctx = self.primary(call)?;
        let current = self
            .driver
            .ctx_get_current()
            .map_err(|e| self.fail(call, e, 0, String::new))?;
        if current == ctx {
            return Ok(ContextScope {
                driver: &self.driver,
                pushed: false,
                _not_send: PhantomData,
            });
        }
        // SAFETY: `ctx` is retained by `self.ctx`, so live; the scope pops it
        // on this thread.
        unsafe { self.driver.ctx_push_current(ctx) }
            .map_err(|e| self.fail(call, e, 0, || format!("{ctx:p}")))?;
        Ok(ContextScope {
            driver: &self.driver,
            pushed: true,
            _not_send: PhantomData,
        })
    }

    /// Whether the primary context certainly does not exist: this device
    /// holds no retain and `cuDevicePrimaryCtxGetState` says inactive. Then
    /// nothing can be queued or capturing on the device, and calls that only
    /// wait or ask need not create a context (issue 11: none for a device
    /// PyTorch has not used).
    fn no_context_anywhere(&self) -> bool {
        self.ctx.get().is_none()
            && matches!(
                self.driver.device_primary_ctx_get_state(self.dev),
                Ok((_, false))
            )
    }

    /// The retained primary context, retaining it on first use.
    fn primary(&self, call: Call) -> DeviceResult<CUcontext> {
        if let Some(c) = self.ctx.get() {
            return Ok(c.ctx);
        }
        let _g = self.ctx_init.lock();
        if let Some(c) = self.ctx.get() {
            return Ok(c.ctx);
        }
        let ctx = self
            .driver
            .device_primary_ctx_retain(self.dev)
            .map_err(|e| self.fail(call, e, 0, || format!("device {}", self.dev)))?;
        let held = PrimaryContext {
            driver: Arc::clone(&self.driver),
            dev: self.dev,
            ctx,
        };
        Ok(self.ctx.get_or_init(|| held).ctx)
    }

    /// Maps a failed call to a [`DeviceError`]; `args` describes the arguments.
    fn fail(
        &self,
        call: Call,
        e: CuError,
        requested: u64,
        args: impl FnOnce() -> String,
    ) -> DeviceError {
        if e.code == CUDA_ERROR_OUT_OF_MEMORY {
            let (free, total) = match self.driver.mem_get_info() {
                Ok((free, total)) => (free as u64, total as u64),
                Err(_) => (0, self.caps.total_memory),
            };
            return DeviceError::OutOfMemory {
                call,
                requested,
                free,
                total,
            };
        }
        driver_error(
            call,
            e,
            code_name(&self.driver, e.code),
            self.driver.error_string(e.code),
            &args(),
        )
    }

    /// The properties every `cuMemCreate` of device memory passes now.
    pub fn allocation_prop(&self) -> CUmemAllocationProp {
        let mut prop = CUmemAllocationProp::pinned_on_device(
            self.dev,
            self.handle_types.load(Ordering::Relaxed),
        );
        prop.allocFlags.gpuDirectRDMACapable = u8::from(self.rdma);
        prop
    }

    /// After a call with `prop` failed with `code`: whether the failure was
    /// the driver refusing `CU_MEM_HANDLE_TYPE_FABRIC`
    /// (`CUDA_ERROR_NOT_PERMITTED` where the process has no IMEX channel, or
    /// `CUDA_ERROR_NOT_SUPPORTED`), in which case this device stops asking
    /// for it and the caller tries again, as NCCL's `ncclMemAlloc` does
    /// (NCCL's allocator.cc).
    fn refused_fabric(&self, prop: &CUmemAllocationProp, code: vmm_sys::CUresult) -> bool {
        let asked = prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC != 0;
        if asked && (code == CUDA_ERROR_NOT_PERMITTED || code == CUDA_ERROR_NOT_SUPPORTED) {
            self.handle_types
                .fetch_and(!CU_MEM_HANDLE_TYPE_FABRIC, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// `cuMemGetAllocationGranularity(option)` for [`Self::allocation_prop`]
    /// (retaining the primary context for a driver that wants one, when
    /// `may_retain`; without fabric if the driver refuses it).
    fn query_granularity(
        &self,
        option: vmm_sys::CUmemAllocationGranularity_flags,
        may_retain: bool,
    ) -> DeviceResult<u64> {
        loop {
            let prop = self.allocation_prop();
            let got = match self.driver.mem_get_allocation_granularity(&prop, option) {
                Err(e) if e.code == CUDA_ERROR_INVALID_CONTEXT && may_retain => {
                    let _ctx = self.enter(Call::Reserve)?;
                    self.driver.mem_get_allocation_granularity(&prop, option)
                }
                other => other,
            };
            match got {
                Ok(g) => return Ok(g as u64),
                Err(e) if self.refused_fabric(&prop, e.code) => continue,
                Err(e) => return Err(DeviceError::Unavailable(describe(&self.driver, e))),
            }
        }
    }

    /// `cuMemCreate(size)` with `prop` made from [`Self::allocation_prop`]
    /// by `adjust`, once more without fabric if the driver refused it.
    fn mem_create(
        &self,
        size: u64,
        adjust: impl Fn(CUmemAllocationProp) -> CUmemAllocationProp,
    ) -> Result<vmm_sys::CUmemGenericAllocationHandle, CuError> {
        loop {
            let prop = adjust(self.allocation_prop());
            match self.driver.mem_create(size as usize, &prop, 0) {
                Err(e) if self.refused_fabric(&prop, e.code) => continue,
                other => return other,
            }
        }
    }

    /// The host NUMA node that host-located chunks (spill) are created on:
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` (134, CUDA 12.2+; -1 when the system
    /// has no NUMA). Refused, saying why, when the device reports
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`
    /// (141) = 0; a driver too old to know 141 is tried anyway (its
    /// `cuMemCreate` refuses an unknown location type).
    fn host_numa_node(&self) -> DeviceResult<std::ffi::c_int> {
        let unsupported = |what: String| DeviceError::Unsupported {
            call: Call::Create,
            what,
        };
        let node = self
            .driver
            .device_get_attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, self.dev)
            .map_err(|e| {
                unsupported(format!(
                    "host-located memory needs CUDA 12.2+ (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: {e})"
                ))
            })?;
        if node < 0 {
            return Err(unsupported(
                "host-located memory: the system reports no host NUMA node \
                 (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID = -1)"
                    .into(),
            ));
        }
        if let Ok(0) = self.driver.device_get_attribute(
            CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            self.dev,
        ) {
            return Err(unsupported(format!(
                "CUDA device {} ({}) cannot map host NUMA memory with the VMM API \
                 (CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)",
                self.caps.ordinal, self.caps.name
            )));
        }
        Ok(node)
    }

    fn acquire_handle(&self, call: Call, handle: PhysHandle) -> DeviceResult<Arc<()>> {
        self.handles.lock().acquire(handle.0).ok_or_else(|| {
            DeviceError::rule(call, Rule::UnknownHandle, format!("handle {:#x}", handle.0))
        })
    }

    fn acquire_event(&self, call: Call, event: Event) -> DeviceResult<Arc<()>> {
        self.events.lock().acquire(event.0).ok_or_else(|| {
            DeviceError::rule(call, Rule::UnknownEvent, format!("event {:#x}", event.0))
        })
    }

    /// Accepts (or not) stream handles that this device did not create, such as
    /// the `CUstream`s PyTorch passes to a pluggable allocator. The caller then
    /// vouches that every such stream belongs to this device's primary context
    /// and outlives its use here, as PyTorch's streams do.
    pub fn accept_external_streams(&self, accept: bool) {
        self.external_streams
            .store(accept, std::sync::atomic::Ordering::Relaxed);
    }

    fn check_stream(&self, call: Call, stream: Stream) -> DeviceResult<()> {
        if stream == Stream::DEFAULT
            || is_per_thread_key(stream)
            || matches!(stream.0 as usize, CU_STREAM_LEGACY | CU_STREAM_PER_THREAD)
            || self
                .external_streams
                .load(std::sync::atomic::Ordering::Relaxed)
            || self.streams.lock().contains(&stream.0)
        {
            Ok(())
        } else {
            Err(DeviceError::rule(
                call,
                Rule::UnknownStream,
                format!("{stream}"),
            ))
        }
    }

    fn outside(call: Call, addr: u64, len: usize) -> DeviceError {
        DeviceError::rule(
            call,
            Rule::NotAccessible,
            format!(
                "[{addr:#x}, +{len:#x}) is not inside a reservation or allocation of this device"
            ),
        )
    }
}

impl Device for CudaDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        let _ctx = self.enter(Call::Reserve)?;
        let addr = self
            .driver
            .mem_address_reserve(size as usize, align as usize, 0, 0)
            .map_err(|e| {
                self.fail(Call::Reserve, e, size, || {
                    format!("size {size:#x}, alignment {align:#x}")
                })
            })?;
        self.ranges.write().reservations.insert(addr, size);
        Ok(addr)
    }

    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::AddressFree)?;
        {
            // Claim the range first, so no other call frees it or copies into it.
            let mut ranges = self.ranges.write();
            match ranges.reservations.get(&addr) {
                Some(&len) if len == size => {
                    ranges.reservations.remove(&addr);
                }
                _ => {
                    return Err(DeviceError::rule(
                        Call::AddressFree,
                        Rule::NotAReservation,
                        format!("[{addr:#x}, +{size:#x}) was not returned by reserve"),
                    ))
                }
            }
        }
        // SAFETY: the range is exactly one this device reserved and has just
        // claimed; freeing it affects only device addresses, never host memory.
        // The driver rejects a range that still has mappings or is invalid.
        unsafe { self.driver.mem_address_free(addr, size as usize) }.map_err(|e| {
            self.ranges.write().reservations.insert(addr, size);
            self.fail(Call::AddressFree, e, 0, || {
                format!("ptr {addr:#x}, size {size:#x}")
            })
        })
    }

    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        let _ctx = self.enter(Call::Create)?;
        let handle = self
            .mem_create(size, |prop| prop)
            .map_err(|e| self.fail(Call::Create, e, size, || format!("size {size:#x}")))?;
        self.handles.lock().insert(handle);
        Ok(PhysHandle(handle))
    }

    /// `cuMemCreate` with `CUmemLocation{CU_MEM_LOCATION_TYPE_HOST_NUMA,
    /// node}` (cuda.h, CUDA 12.2+): pinned host memory that maps and is
    /// accessed like device memory.
    fn create_on_host(&self, size: u64) -> DeviceResult<PhysHandle> {
        let _ctx = self.enter(Call::Create)?;
        let node = self.host_numa_node()?;
        // As NCCL's ncclCuMemHostAlloc: the handle types, no RDMA flag.
        let on_host = |mut prop: CUmemAllocationProp| {
            prop.location = CUmemLocation::host_numa(node);
            prop.allocFlags.gpuDirectRDMACapable = 0;
            prop
        };
        let handle = self.mem_create(size, on_host).map_err(|e| {
            if e.code == CUDA_ERROR_INVALID_VALUE || e.code == CUDA_ERROR_NOT_SUPPORTED {
                DeviceError::Unsupported {
                    call: Call::Create,
                    what: format!(
                        "host-located memory on NUMA node {node} (cuMemCreate refused the host \
                         location: {e}; it needs CUDA 12.2+)"
                    ),
                }
            } else {
                self.fail(Call::Create, e, size, || {
                    format!("size {size:#x} on host NUMA node {node}")
                })
            }
        })?;
        self.handles.lock().insert(handle);
        Ok(PhysHandle(handle))
    }

    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        let _ctx = self.enter(Call::Release)?;
        let taken = self.handles.lock().take(handle.0).ok_or_else(|| {
            DeviceError::rule(
                Call::Release,
                Rule::UnknownHandle,
                format!("handle {:#x}", handle.0),
            )
        })?;
        taken.wait_unused();
        // SAFETY: the handle was made by this device and one of its references
        // has just been taken out of the registry (so it is released once), and
        // no other call is using it (`wait_unused`).
        match unsafe { self.driver.mem_release(handle.0) } {
            Ok(()) => Ok(()),
            Err(e) => {
                self.handles.lock().restore(handle.0, taken);
                Err(self.fail(Call::Release, e, 0, || format!("handle {:#x}", handle.0)))
            }
        }
    }

    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        let _ctx = self.enter(Call::Map)?;
        let _in_use = self.acquire_handle(Call::Map, handle)?;
        // SAFETY: the handle is live (registered, and `_in_use` keeps it from
        // being released during the call). Mapping touches only device memory;
        // the driver rejects a range that is not reserved or already mapped.
        unsafe { self.driver.mem_map(addr, size as usize, 0, handle.0, 0) }.map_err(|e| {
            self.fail(Call::Map, e, size, || {
                format!(
                    "ptr {addr:#x}, size {size:#x}, offset 0, handle {:#x}",
                    handle.0
                )
            })
        })
    }

    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::Unmap)?;
        // SAFETY: unmapping affects only device memory: copies through this
        // device are confined to its own ranges, and the driver rejects a range
        // that is not mapped. Waiting for queued work is the caller's contract
        // (see `Device::unmap`); a violation faults on the device, not the host.
        unsafe { self.driver.mem_unmap(addr, size as usize) }.map_err(|e| {
            self.fail(Call::Unmap, e, 0, || {
                format!("ptr {addr:#x}, size {size:#x}")
            })
        })
    }

    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::SetAccess)?;
        // This device and every peer in one call (PyTorch's expandable
        // segments grant each peer with its own cuMemSetAccess:
        // `ExpandableSegment::setAccess`, c10/cuda/CUDACachingAllocator.cpp).
        // SAFETY: granting access touches no host memory; the driver rejects
        // a range that is not fully mapped.
        unsafe {
            self.driver
                .mem_set_access(addr, size as usize, &self.access)
        }
        .map_err(|e| {
            self.fail(Call::SetAccess, e, 0, || {
                format!(
                    "ptr {addr:#x}, size {size:#x}, read-write for device {}{}",
                    self.dev,
                    if self.peers.is_empty() {
                        String::new()
                    } else {
                        format!(" and peers {:?}", self.peers)
                    }
                )
            })
        })
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        let _ctx = self.enter(Call::MemInfo)?;
        let (free, total) = self
            .driver
            .mem_get_info()
            .map_err(|e| self.fail(Call::MemInfo, e, 0, String::new))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        let _ctx = self.enter(Call::Alloc)?;
        let ptr = self
            .driver
            .mem_alloc(size as usize)
            .map_err(|e| self.fail(Call::Alloc, e, size, || format!("size {size:#x}")))?;
        self.ranges.write().allocs.insert(ptr, size);
        Ok(ptr)
    }

    fn free(&self, ptr: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::Free)?;
        let size = self.ranges.write().allocs.remove(&ptr).ok_or_else(|| {
            DeviceError::rule(Call::Free, Rule::UnknownPointer, format!("{ptr:#x}"))
        })?;
        // SAFETY: `ptr` came from `cuMemAlloc` on this device and has just been
        // claimed (so it is freed once); it is device memory, never host memory.
        unsafe { self.driver.mem_free(ptr) }.map_err(|e| {
            self.ranges.write().allocs.insert(ptr, size);
            self.fail(Call::Free, e, 0, || format!("ptr {ptr:#x}"))
        })
    }

    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        if !self.ipc {
            return Err(DeviceError::Unsupported {
                call: Call::Export,
                what: format!(
                    "{}: exporting needs ipc:true (VMMALLOC_CONF), which requests \
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR for every allocation",
                    self.caps.name
                ),
            });
        }
        if !self.caps.posix_fd_handles {
            return Err(DeviceError::Unsupported {
                call: Call::Export,
                what: format!(
                    "{} cannot export POSIX file descriptor handles",
                    self.caps.name
                ),
            });
        }
        let _ctx = self.enter(Call::Export)?;
        let _in_use = self.acquire_handle(Call::Export, handle)?;
        // SAFETY: the handle is live (registered and held by `_in_use`) and was
        // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested
        // (`posix_fd_handles` is true).
        unsafe { self.driver.mem_export_to_fd(handle.0) }.map_err(|e| {
            self.fail(Call::Export, e, 0, || {
                format!("handle {:#x}, POSIX fd", handle.0)
            })
        })
    }

    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        // Importing needs the device's support, not exportable handles of
        // our own (`ipc`): the producer's cuMemCreate requested the type.
        if !self.can_import {
            return Err(DeviceError::Unsupported {
                call: Call::Import,
                what: format!(
                    "{} cannot import POSIX file descriptor handles \
                     (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0)",
                    self.caps.name
                ),
            });
        }
        let _ctx = self.enter(Call::Import)?;
        // SAFETY: the driver only inspects the descriptor (it neither closes nor
        // writes it) and returns an error for one that is not an exported
        // allocation; the new handle is registered below and released once.
        let handle = unsafe { self.driver.mem_import_from_fd(fd) }
            .map_err(|e| self.fail(Call::Import, e, 0, || format!("fd {fd}, POSIX fd")))?;
        self.handles.lock().insert(handle);
        Ok(PhysHandle(handle))
    }

    fn ipc_open(&self, handle: &IpcMemHandle) -> DeviceResult<u64> {
        self.open_ipc(handle)
    }

    fn ipc_close(&self, ptr: u64) -> DeviceResult<()> {
        self.close_ipc(ptr)
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> DeviceResult<()> {
        let _ctx = self.enter(Call::CopyHtoD)?;
        let ranges = self.ranges.read();
        if !ranges.contains(dst, src.len() as u64) {
            return Err(Self::outside(Call::CopyHtoD, dst, src.len()));
        }
        // SAFETY: the destination lies in a reservation or allocation of this
        // device, which stays claimed while `ranges` is held: it is device
        // memory, never host memory. The driver rejects unmapped or
        // inaccessible addresses. `src` is readable for its length.
        unsafe { self.driver.memcpy_htod(dst, src) }.map_err(|e| {
            self.fail(Call::CopyHtoD, e, 0, || {
                format!("dst {dst:#x}, {} bytes", src.len())
            })
        })
    }

    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()> {
        let _ctx = self.enter(Call::CopyDtoH)?;
        let ranges = self.ranges.read();
        if !ranges.contains(src, dst.len() as u64) {
            return Err(Self::outside(Call::CopyDtoH, src, dst.len()));
        }
        let len = dst.len();
        // SAFETY: the source lies in a reservation or allocation of this
        // device, held while `ranges` is; the driver rejects unmapped or
        // inaccessible addresses. `dst` is writable for its length and the copy
        // has finished when the call returns.
        unsafe { self.driver.memcpy_dtoh(dst, src) }.map_err(|e| {
            self.fail(Call::CopyDtoH, e, 0, || {
                format!("src {src:#x}, {len} bytes")
            })
        })
    }

    /// `cuMemcpyDtoD_v2`, then `cuCtxSynchronize`: a device-to-device copy
    /// does not synchronize with the host (CUDA Driver API, "API
    /// synchronization behavior"), and the caller may unmap the source next.
    fn copy_device(&self, dst: u64, src: u64, len: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::CopyDtoD)?;
        let ranges = self.ranges.read();
        for at in [dst, src] {
            if !ranges.contains(at, len) {
                return Err(Self::outside(Call::CopyDtoD, at, len as usize));
            }
        }
        // SAFETY: both ranges lie in reservations or allocations of this
        // device, held while `ranges` is: device memory, never host memory;
        // the driver rejects unmapped or inaccessible addresses.
        unsafe { self.driver.memcpy_dtod(dst, src, len as usize) }
            .and_then(|()| self.driver.ctx_synchronize())
            .map_err(|e| {
                self.fail(Call::CopyDtoD, e, 0, || {
                    format!("dst {dst:#x}, src {src:#x}, {len} bytes")
                })
            })
    }

    /// `cuMemHostAlloc(&p, len, 0)` in the primary context: page-locked
    /// memory the driver copies by DMA (CUDA C Programming Guide,
    /// "Page-Locked Host Memory"), freed with `cuMemFreeHost` on drop. The
    /// buffer holds its own retain of the primary context, which owns the
    /// allocation (cuda.h, `cuMemHostAlloc`: the memory is accessible to the
    /// context it was allocated in), so it stays valid after this device is
    /// dropped. If pinning fails (out of pinned memory, locked-memory limit,
    /// any driver error) the buffer is ordinary pageable memory instead
    /// ([`HostBuffer::is_pinned`] says which): slower copies, nothing lost.
    fn alloc_host_buffer(&self, len: u64) -> DeviceResult<HostBuffer> {
        let heap = || {
            HostBuffer::heap(len).ok_or(DeviceError::OutOfMemory {
                call: Call::HostAlloc,
                requested: len,
                free: 0,
                total: 0,
            })
        };
        let Ok(n) = usize::try_from(len) else {
            return heap();
        };
        if n == 0 {
            return heap();
        }
        let Ok(_ctx) = self.enter(Call::HostAlloc) else {
            return heap();
        };
        // A retain of our own for the buffer (released after cuMemFreeHost).
        let Ok(ctx) = self.driver.device_primary_ctx_retain(self.dev) else {
            return heap();
        };
        let held = PrimaryContext {
            driver: Arc::clone(&self.driver),
            dev: self.dev,
            ctx,
        };
        match self.driver.mem_host_alloc(n, 0) {
            Ok(p) => match std::ptr::NonNull::new(p.cast::<u8>()) {
                // SAFETY: the driver returned `n` bytes of host memory, now
                // owned by this buffer alone (nothing else has the pointer);
                // `cuMemHostAlloc` memory is not guaranteed zeroed, so it is
                // zeroed here before Rust reads it; `free_pinned` releases it.
                Some(ptr) => unsafe {
                    std::ptr::write_bytes(ptr.as_ptr(), 0, n);
                    Ok(HostBuffer::pinned(
                        ptr,
                        n,
                        Box::new(move |p| free_pinned(held, p)),
                    ))
                },
                None => heap(),
            },
            Err(_) => heap(),
        }
    }

    fn create_stream(&self) -> DeviceResult<Stream> {
        let _ctx = self.enter(Call::StreamCreate)?;
        let s = self
            .driver
            .stream_create(CU_STREAM_NON_BLOCKING)
            .map_err(|e| self.fail(Call::StreamCreate, e, 0, || "CU_STREAM_NON_BLOCKING".into()))?;
        let raw = s.expose_provenance() as u64;
        self.streams.lock().insert(raw);
        Ok(Stream(raw))
    }

    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()> {
        self.check_stream(Call::StreamSync, stream)?;
        if self.no_context_anywhere() {
            return Ok(());
        }
        let _ctx = self.enter(Call::StreamSync)?;
        match stream_ref(stream) {
            // SAFETY: the stream is null, a special stream value, or one this
            // device created (or the caller vouched for, see
            // `accept_external_streams`) in its primary context; streams are
            // never destroyed.
            StreamRef::Raw(s) => unsafe { self.driver.stream_synchronize(s) }
                .map_err(|e| self.fail(Call::StreamSync, e, 0, || format!("{stream}"))),
            // Another thread's per-thread stream: synchronize the context
            // (waits for it and more; never too early).
            StreamRef::OtherThread => self.driver.ctx_synchronize().map_err(|e| {
                self.fail(Call::StreamSync, e, 0, || {
                    format!("{stream} (cuCtxSynchronize)")
                })
            }),
        }
    }

    fn synchronize(&self) -> DeviceResult<()> {
        if self.no_context_anywhere() {
            return Ok(());
        }
        let _ctx = self.enter(Call::DeviceSync)?;
        self.driver
            .ctx_synchronize()
            .map_err(|e| self.fail(Call::DeviceSync, e, 0, String::new))
    }

    fn create_event(&self) -> DeviceResult<Event> {
        let _ctx = self.enter(Call::EventCreate)?;
        let e = self
            .driver
            .event_create(CU_EVENT_DISABLE_TIMING)
            .map_err(|e| self.fail(Call::EventCreate, e, 0, || "CU_EVENT_DISABLE_TIMING".into()))?;
        let raw = e.expose_provenance() as u64;
        self.events.lock().insert(raw);
        Ok(Event(raw))
    }

    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        self.check_stream(Call::EventRecord, stream)?;
        let _ctx = self.enter(Call::EventRecord)?;
        let _in_use = self.acquire_event(Call::EventRecord, event)?;
        // Another thread's per-thread stream cannot be named here: the legacy
        // default stream waits for every blocking stream's earlier work (the
        // per-thread ones are blocking), so an event recorded on it completes
        // no earlier (CUDA Driver API, "Stream synchronization behavior").
        let s = match stream_ref(stream) {
            StreamRef::Raw(s) => s,
            StreamRef::OtherThread => raw_stream(CU_STREAM_LEGACY),
        };
        // SAFETY: the event is live (registered, held by `_in_use`) and the
        // stream is null, a special stream value or one of ours (or vouched
        // for), in this device's primary context.
        unsafe { self.driver.event_record(event_ptr(event), s) }.map_err(|e| {
            self.fail(Call::EventRecord, e, 0, || {
                format!("event {:#x}, {stream}", event.0)
            })
        })
    }

    fn query_event(&self, event: Event) -> DeviceResult<bool> {
        let _ctx = self.enter(Call::EventQuery)?;
        let _in_use = self.acquire_event(Call::EventQuery, event)?;
        // SAFETY: the event is live (registered, held by `_in_use`).
        unsafe { self.driver.event_query(event_ptr(event)) }
            .map_err(|e| self.fail(Call::EventQuery, e, 0, || format!("event {:#x}", event.0)))
    }

    fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        let _ctx = self.enter(Call::EventSync)?;
        let _in_use = self.acquire_event(Call::EventSync, event)?;
        // SAFETY: the event is live (registered, held by `_in_use`).
        unsafe { self.driver.event_synchronize(event_ptr(event)) }
            .map_err(|e| self.fail(Call::EventSync, e, 0, || format!("event {:#x}", event.0)))
    }

    fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        let _ctx = self.enter(Call::EventDestroy)?;
        let taken = self.events.lock().take(event.0).ok_or_else(|| {
            DeviceError::rule(
                Call::EventDestroy,
                Rule::UnknownEvent,
                format!("event {:#x}", event.0),
            )
        })?;
        taken.wait_unused();
        // SAFETY: the event was created by this device, has just been taken out
        // of the registry (destroyed once) and no other call is using it.
        match unsafe { self.driver.event_destroy(event_ptr(event)) } {
            Ok(()) => Ok(()),
            Err(e) => {
                self.events.lock().restore(event.0, taken);
                Err(self.fail(Call::EventDestroy, e, 0, || format!("event {:#x}", event.0)))
            }
        }
    }

    fn is_capturing(&self, stream: Stream) -> DeviceResult<bool> {
        self.check_stream(Call::StreamSync, stream)?;
        if self.no_context_anywhere() {
            return Ok(false);
        }
        let _ctx = self.enter(Call::StreamSync)?;
        let s = match stream_ref(stream) {
            StreamRef::Raw(s) => s,
            // Another thread's per-thread stream: ask about the legacy stream,
            // which answers 906 while any blocking stream captures.
            StreamRef::OtherThread => raw_stream(CU_STREAM_LEGACY),
        };
        // SAFETY: the stream is null, a special stream value or one of ours
        // (or vouched for), in this device's primary context.
        match unsafe { self.driver.stream_is_capturing(s) } {
            Ok(status) => Ok(status != CU_STREAM_CAPTURE_STATUS_NONE),
            // cuStreamIsCapturing on the legacy stream while a blocking stream
            // of the context captures (CUDA Driver API): using the legacy
            // stream now would join that capture, so treat it as capturing.
            Err(e) if e.code == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            Err(e) => Err(self.fail(Call::StreamSync, e, 0, || {
                format!("cuStreamIsCapturing, {stream}")
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_unavailable_naming_it() {
        let err = CudaDevice::open_library("/nonexistent/libcuda.so.1", 0).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, DeviceError::Unavailable(_)), "{err:?}");
        assert!(text.contains("CUDA driver not found"), "{text}");
        assert!(text.contains("/nonexistent/libcuda.so.1"), "{text}");
    }

    #[test]
    fn library_without_symbols_is_unavailable_naming_the_symbol() {
        let err = CudaDevice::open_library("libc.so.6", 0).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("unusable") && text.contains("cuInit"),
            "{text}"
        );
    }

    #[test]
    fn driver_errors_carry_code_name_and_detail() {
        let e = CuError {
            call: "cuMemMap",
            code: 1,
        };
        let err = driver_error(
            Call::Map,
            e,
            "CUDA_ERROR_INVALID_VALUE".into(),
            Some("invalid argument".into()),
            "ptr 0x200000, size 0x200000, offset 0, handle 0x1",
        );
        assert_eq!(err.cuda_code(), 1);
        assert_eq!(err.call(), Some(Call::Map));
        assert!(!err.is_out_of_memory());
        assert_eq!(
            err.to_string(),
            "map: CUDA_ERROR_INVALID_VALUE (1): cuMemMap(ptr 0x200000, size 0x200000, offset 0, \
             handle 0x1): invalid argument"
        );
    }

    #[test]
    fn special_stream_values_get_their_own_keys() {
        assert_eq!(stream_key(CU_STREAM_LEGACY as u64), Stream::DEFAULT);
        assert_eq!(stream_key(0), Stream::DEFAULT);
        assert_eq!(stream_key(0x7f00_1234_5670), Stream(0x7f00_1234_5670));
        let mine = stream_key(CU_STREAM_PER_THREAD as u64);
        assert!(is_per_thread_key(mine) && !is_per_thread_key(Stream(0x7f00_1234_5672)));
        assert_eq!(
            stream_ref(mine),
            StreamRef::Raw(raw_stream(CU_STREAM_PER_THREAD))
        );
        let theirs = std::thread::spawn(|| stream_key(CU_STREAM_PER_THREAD as u64).0)
            .join()
            .unwrap();
        assert_ne!(Stream(theirs), mine);
        assert_eq!(stream_ref(Stream(theirs)), StreamRef::OtherThread);
        assert_eq!(
            stream_ref(Stream(0x7f00_1234_5670)),
            StreamRef::Raw(raw_stream(0x7f00_1234_5670))
        );
    }

    #[test]
    fn registry_counts_references_and_restores() {
        let mut r = Registry::default();
        assert!(r.acquire(7).is_none());
        r.insert(7);
        r.insert(7); // imported twice: two releases needed
        let t = r.take(7).unwrap();
        assert!(!t.last);
        assert!(r.acquire(7).is_some());
        let t2 = r.take(7).unwrap();
        assert!(t2.last);
        assert!(r.acquire(7).is_none() && r.take(7).is_none());
        r.restore(7, t2); // the driver refused: the handle is live again
        assert!(r.acquire(7).is_some());
        drop(t);
    }

    #[test]
    fn destruction_waits_for_calls_in_flight() {
        let mut r = Registry::default();
        r.insert(1);
        let in_flight = r.acquire(1).unwrap();
        let taken = r.take(1).unwrap();
        let waiter = std::thread::spawn(move || {
            taken.wait_unused();
            true
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished());
        drop(in_flight);
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn ranges_contain_only_whole_ranges() {
        let mut r = Ranges::default();
        r.reservations.insert(0x1000_0000, 0x40_0000);
        r.allocs.insert(0x2000_0000, 100);
        assert!(r.contains(0x1000_0000, 0x40_0000));
        assert!(r.contains(0x1020_0000, 16));
        assert!(!r.contains(0x1020_0000, 0x40_0000));
        assert!(!r.contains(0x0fff_ffff, 2));
        assert!(r.contains(0x2000_0000, 100));
        assert!(!r.contains(0x2000_0000, 101));
        assert!(!r.contains(0x2000_0064, 0));
        assert!(!r.contains(u64::MAX, 2));
    }
}
