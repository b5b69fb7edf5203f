//! The `Device` trait: what an allocator needs from a GPU, and its backends.
//!
//! # Contract
//!
//! Every address, size and alignment passed to the virtual-memory calls is a
//! multiple of [`DeviceCaps::granularity`] (queried, never assumed to be 2 MiB).
//! The calls mirror the CUDA driver's VMM API one to one:
//!
//! | trait method        | driver call               |
//! |---------------------|---------------------------|
//! | [`Device::reserve`] | `cuMemAddressReserve`     |
//! | [`Device::free_reservation`] | `cuMemAddressFree` |
//! | [`Device::create`]  | `cuMemCreate`             |
//! | [`Device::release`] | `cuMemRelease`            |
//! | [`Device::map`]     | `cuMemMap` (whole handle, offset 0) |
//! | [`Device::unmap`]   | `cuMemUnmap`              |
//! | [`Device::set_access`] | `cuMemSetAccess` (read-write, this device) |
//!
//! and the backends `sim` and `host` enforce the driver's rules through one
//! shared [`model::AddressSpace`], returning the error the real driver would
//! (see [`DeviceError::cuda_code`]).
//!
//! Backends:
//! - [`cuda::CudaDevice`]: a real GPU through `vmm-sys`;
//! - [`host::HostDevice`]: the same semantics on CPU memory (memfd + mmap);
//! - [`sim::SimDevice`]: bookkeeping and a cost model only.
//!
//! Adaptors in [`adaptors`] wrap any device (fault injection, call counting,
//! capacity limit). [`ipc`] composes the calls an IPC consumer makes
//! (import and map shared handles, open legacy `cudaIpc` handles, and close
//! either after the work on a stream), rolling back a half-done import.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod adaptors;
pub mod conformance;
pub mod cost;
pub mod cuda;
mod error;
pub mod host;
mod hostbuf;
pub mod ipc;
pub mod model;
pub mod sim;
mod streams;

pub use error::{DeviceError, Rule};
pub use hostbuf::{HostBuffer, PinnedFree};
pub use streams::{CaptureMode, StreamModel};

use serde::{Deserialize, Serialize};
use std::fmt;

/// Result of a device call.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// A stream: an ordered queue of device work. `Stream(0)` is the default
/// (legacy) stream; on the `cuda` backend the value is the raw `CUstream`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub struct Stream(pub u64);

impl Stream {
    /// The default stream.
    pub const DEFAULT: Stream = Stream(0);
}

impl fmt::Display for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {:#x}", self.0)
    }
}

/// An event: a marker recorded on a stream, complete once all work queued on
/// that stream before it has finished. On `cuda` the value is the raw `CUevent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Event(pub u64);

/// A physical memory handle (`CUmemGenericAllocationHandle` on `cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PhysHandle(pub u64);

/// Bytes of a legacy IPC handle (`CU_IPC_HANDLE_SIZE`, cuda.h).
pub const IPC_HANDLE_SIZE: usize = 64;

/// A legacy IPC handle (`CUipcMemHandle` / `cudaIpcMemHandle_t`, cuda.h):
/// 64 opaque bytes naming another process's `cuMemAlloc` allocation, opened
/// with [`Device::ipc_open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; IPC_HANDLE_SIZE]);

/// What a device can do, queried once when it is opened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceCaps {
    /// Human-readable device name.
    pub name: String,
    /// Device ordinal.
    pub ordinal: u32,
    /// Allocation granularity in bytes (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`);
    /// every VMM size, address and alignment is a multiple of it.
    pub granularity: u64,
    /// Physical memory in bytes.
    pub total_memory: u64,
    /// Whether the device supports the virtual-memory API
    /// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`).
    pub vmm_supported: bool,
    /// Whether handles can be exported as POSIX file descriptors.
    pub posix_fd_handles: bool,
    /// Whether the bytes behind mapped addresses can be read and written
    /// through [`Device::copy_to_device`] / [`Device::copy_from_device`]
    /// (false on `sim`, which touches no memory).
    pub has_memory: bool,
}

/// Free and total physical memory (`cuMemGetInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemInfo {
    /// Bytes that can still be allocated.
    pub free: u64,
    /// Device memory in bytes.
    pub total: u64,
}

/// The kinds of device call, for counting, cost and fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Call {
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    AddressFree,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuMemAlloc`.
    Alloc,
    /// `cuMemFree`.
    Free,
    /// `cuMemExportToShareableHandle`.
    Export,
    /// `cuMemImportFromShareableHandle`.
    Import,
    /// `cuMemcpyHtoD`.
    CopyHtoD,
    /// `cuMemcpyDtoH`.
    CopyDtoH,
    /// `cuStreamCreate`.
    StreamCreate,
    /// `cuStreamSynchronize`.
    StreamSync,
    /// `cuCtxSynchronize` (device-wide).
    DeviceSync,
    /// `cuEventCreate`.
    EventCreate,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventSynchronize`.
    EventSync,
    /// `cuEventDestroy`.
    EventDestroy,
    /// `cuMemHostAlloc` (page-locked host memory for copies:
    /// [`Device::alloc_host_buffer`]).
    HostAlloc,
    /// `cuMemcpyDtoD` (device to device, [`Device::copy_device`]).
    CopyDtoD,
    /// `cuIpcOpenMemHandle` (a legacy IPC handle of another process's
    /// `cuMemAlloc` memory, [`Device::ipc_open`]).
    IpcOpen,
    /// `cuIpcCloseMemHandle` ([`Device::ipc_close`]).
    IpcClose,
}

impl Call {
    /// Every kind, in declaration order.
    pub const ALL: [Call; 26] = [
        Call::Reserve,
        Call::AddressFree,
        Call::Create,
        Call::Release,
        Call::Map,
        Call::Unmap,
        Call::SetAccess,
        Call::MemInfo,
        Call::Alloc,
        Call::Free,
        Call::Export,
        Call::Import,
        Call::CopyHtoD,
        Call::CopyDtoH,
        Call::StreamCreate,
        Call::StreamSync,
        Call::DeviceSync,
        Call::EventCreate,
        Call::EventRecord,
        Call::EventQuery,
        Call::EventSync,
        Call::EventDestroy,
        Call::HostAlloc,
        Call::CopyDtoD,
        Call::IpcOpen,
        Call::IpcClose,
    ];

    /// Number of kinds.
    pub const COUNT: usize = Self::ALL.len();

    /// Dense index of this kind in [`Call::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Short stable name (used in JSON and tables), e.g. `"create"`.
    pub fn name(self) -> &'static str {
        match self {
            Call::Reserve => "reserve",
            Call::AddressFree => "address_free",
            Call::Create => "create",
            Call::Release => "release",
            Call::Map => "map",
            Call::Unmap => "unmap",
            Call::SetAccess => "set_access",
            Call::MemInfo => "mem_info",
            Call::Alloc => "alloc",
            Call::Free => "free",
            Call::Export => "export",
            Call::Import => "import",
            Call::CopyHtoD => "copy_htod",
            Call::CopyDtoH => "copy_dtoh",
            Call::StreamCreate => "stream_create",
            Call::StreamSync => "stream_sync",
            Call::DeviceSync => "device_sync",
            Call::EventCreate => "event_create",
            Call::EventRecord => "event_record",
            Call::EventQuery => "event_query",
            Call::EventSync => "event_sync",
            Call::EventDestroy => "event_destroy",
            Call::HostAlloc => "host_alloc",
            Call::CopyDtoD => "copy_dtod",
            Call::IpcOpen => "ipc_open",
            Call::IpcClose => "ipc_close",
        }
    }

    /// The CUDA driver entry point this kind corresponds to.
    pub fn driver_symbol(self) -> &'static str {
        match self {
            Call::Reserve => "cuMemAddressReserve",
            Call::AddressFree => "cuMemAddressFree",
            Call::Create => "cuMemCreate",
            Call::Release => "cuMemRelease",
            Call::Map => "cuMemMap",
            Call::Unmap => "cuMemUnmap",
            Call::SetAccess => "cuMemSetAccess",
            Call::MemInfo => "cuMemGetInfo_v2",
            Call::Alloc => "cuMemAlloc_v2",
            Call::Free => "cuMemFree_v2",
            Call::Export => "cuMemExportToShareableHandle",
            Call::Import => "cuMemImportFromShareableHandle",
            Call::CopyHtoD => "cuMemcpyHtoD_v2",
            Call::CopyDtoH => "cuMemcpyDtoH_v2",
            Call::StreamCreate => "cuStreamCreate",
            Call::StreamSync => "cuStreamSynchronize",
            Call::DeviceSync => "cuCtxSynchronize",
            Call::EventCreate => "cuEventCreate",
            Call::EventRecord => "cuEventRecord",
            Call::EventQuery => "cuEventQuery",
            Call::EventSync => "cuEventSynchronize",
            Call::EventDestroy => "cuEventDestroy_v2",
            Call::HostAlloc => "cuMemHostAlloc",
            Call::CopyDtoD => "cuMemcpyDtoD_v2",
            Call::IpcOpen => "cuIpcOpenMemHandle_v2",
            Call::IpcClose => "cuIpcCloseMemHandle",
        }
    }

    /// Parses a name produced by [`Call::name`].
    pub fn from_name(name: &str) -> Option<Call> {
        Call::ALL.iter().copied().find(|c| c.name() == name)
    }

    /// Whether the call is a synchronization: a stream or event wait
    /// ([`Call::is_stream_sync`]) or a device-wide one
    /// ([`Call::is_device_sync`]). The one definition every report counts.
    pub fn is_sync(self) -> bool {
        self.is_stream_sync() || self.is_device_sync()
    }

    /// Whether the call waits for one stream or one event
    /// (`cuStreamSynchronize`, `cuEventSynchronize`).
    pub fn is_stream_sync(self) -> bool {
        matches!(self, Call::StreamSync | Call::EventSync)
    }

    /// Whether the call waits for the whole device: `cuCtxSynchronize`, and
    /// `cuMemFree`, which synchronizes the device implicitly (PyTorch's "CUDA
    /// semantics" note: the caching allocator exists so that frees need no
    /// device synchronization; the cost model prices it as unmap + release +
    /// a device sync, docs/driver.md).
    pub fn is_device_sync(self) -> bool {
        matches!(self, Call::DeviceSync | Call::Free)
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-kind call counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CallCounts(pub [u64; Call::COUNT]);

impl CallCounts {
    /// Count of one kind.
    pub fn get(&self, call: Call) -> u64 {
        self.0[call.index()]
    }
    /// Adds one call of a kind.
    pub fn add(&mut self, call: Call) {
        self.0[call.index()] += 1;
    }
    /// Sum over all kinds.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    /// Synchronizations of every kind ([`Call::is_sync`]): stream and event
    /// waits plus device-wide ones (`cuCtxSynchronize`, `cuMemFree`).
    pub fn syncs(&self) -> u64 {
        self.stream_syncs() + self.device_syncs()
    }
    /// Stream and event waits ([`Call::is_stream_sync`]).
    pub fn stream_syncs(&self) -> u64 {
        self.sum_of(Call::is_stream_sync)
    }
    /// Device-wide synchronizations ([`Call::is_device_sync`]), each
    /// `cuMemFree` included.
    pub fn device_syncs(&self) -> u64 {
        self.sum_of(Call::is_device_sync)
    }
    /// The syncs as a table cell: the total, split as `S stream/event + D
    /// device-wide` where both kinds occur.
    pub fn syncs_cell(&self) -> String {
        let (s, d) = (self.stream_syncs(), self.device_syncs());
        if s > 0 && d > 0 {
            format!("{} ({s} stream/event + {d} device-wide)", s + d)
        } else if d > 0 {
            format!("{d} device-wide")
        } else if s > 0 {
            format!("{s} stream/event")
        } else {
            "0".into()
        }
    }
    fn sum_of(&self, pick: fn(Call) -> bool) -> u64 {
        Call::ALL
            .iter()
            .filter(|c| pick(**c))
            .map(|c| self.get(*c))
            .sum()
    }
    /// Non-zero counts as `(name, count)`, in [`Call::ALL`] order.
    pub fn nonzero(&self) -> Vec<(&'static str, u64)> {
        Call::ALL
            .iter()
            .filter(|c| self.get(**c) > 0)
            .map(|c| (c.name(), self.get(*c)))
            .collect()
    }
    /// Difference `self - earlier`, per kind (saturating).
    pub fn since(&self, earlier: &CallCounts) -> CallCounts {
        let mut out = *self;
        for (o, e) in out.0.iter_mut().zip(earlier.0.iter()) {
            *o = o.saturating_sub(*e);
        }
        out
    }
}

/// What an allocator needs from a GPU.
///
/// Implementations are cheap to call from many threads. Every method returns a
/// typed error and never panics on a driver result. Preconditions are those of
/// the CUDA driver; the `sim` and `host` backends check them and fail with
/// [`DeviceError::Rule`] where the real driver would return an error.
pub trait Device: Send + Sync {
    /// Capabilities, queried once when the device was opened.
    fn caps(&self) -> &DeviceCaps;

    /// Reserves `size` bytes of virtual address space aligned to `align`
    /// (0 = granularity). Both are multiples of the granularity.
    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64>;
    /// Frees a range exactly as returned by [`Device::reserve`]; nothing may be
    /// mapped in it.
    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()>;
    /// Creates a physical allocation of `size` bytes (a multiple of the
    /// granularity). Fails with [`DeviceError::OutOfMemory`] when memory runs out.
    fn create(&self, size: u64) -> DeviceResult<PhysHandle>;
    /// Releases a handle. Memory returns to the device once its last mapping is gone.
    fn release(&self, handle: PhysHandle) -> DeviceResult<()>;
    /// Maps the whole of `handle` (`size` = its size, offset 0) at `addr`, inside a
    /// reservation, over unmapped addresses only. The mapping is inaccessible
    /// until [`Device::set_access`].
    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()>;
    /// Unmaps `[addr, addr+size)`, which must cover whole mappings.
    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()>;
    /// Makes `[addr, addr+size)` readable and writable by this device; the range
    /// must be fully mapped.
    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()>;
    /// Free and total physical memory.
    fn mem_info(&self) -> DeviceResult<MemInfo>;

    /// Plain allocation (`cuMemAlloc`), for baselines. `size` > 0, any value.
    fn alloc(&self, size: u64) -> DeviceResult<u64>;
    /// Frees a plain allocation made by [`Device::alloc`].
    fn free(&self, ptr: u64) -> DeviceResult<()>;

    /// Exports a handle as a POSIX file descriptor (the caller owns it).
    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32>;
    /// Imports a handle from a POSIX file descriptor made by [`Device::export_fd`]
    /// (the descriptor stays owned by the caller).
    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle>;

    /// Copies host bytes to mapped, accessible device memory.
    fn copy_to_device(&self, dst: u64, src: &[u8]) -> DeviceResult<()>;
    /// Copies mapped, accessible device memory to host bytes.
    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()>;
    /// Copies `len` bytes of mapped, accessible device memory from `src` to
    /// `dst` (same device, not overlapping) and returns once the copy has
    /// completed. A device that holds no bytes checks both ranges and
    /// answers [`DeviceError::Unsupported`].
    fn copy_device(&self, dst: u64, src: u64, len: u64) -> DeviceResult<()>;
    /// `len` bytes of host memory for [`Device::copy_to_device`] /
    /// [`Device::copy_from_device`]: page-locked where the device can provide
    /// it (`cuda`: `cuMemHostAlloc`, falling back to pageable memory when
    /// pinning fails), ordinary heap memory otherwise (this default).
    fn alloc_host_buffer(&self, len: u64) -> DeviceResult<HostBuffer> {
        HostBuffer::heap(len).ok_or(DeviceError::OutOfMemory {
            call: Call::HostAlloc,
            requested: len,
            free: 0,
            total: 0,
        })
    }

    /// Creates a stream.
    fn create_stream(&self) -> DeviceResult<Stream>;
    /// Waits until all work queued on `stream` has finished.
    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()>;
    /// Waits until all work on the device has finished (device-wide sync).
    fn synchronize(&self) -> DeviceResult<()>;
    /// Creates an event.
    fn create_event(&self) -> DeviceResult<Event>;
    /// Records `event` on `stream`.
    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()>;
    /// Whether the work before the event's last record has finished.
    fn query_event(&self, event: Event) -> DeviceResult<bool>;
    /// Waits until the event has completed.
    fn synchronize_event(&self, event: Event) -> DeviceResult<()>;
    /// Destroys an event.
    fn destroy_event(&self, event: Event) -> DeviceResult<()>;
    /// Whether `stream` is being captured into a CUDA graph
    /// (`cuStreamIsCapturing` != `CU_STREAM_CAPTURE_STATUS_NONE`). While it is,
    /// the driver rejects synchronizing it, querying events recorded in the
    /// capture, and (in global capture mode) other potentially unsafe calls, so
    /// allocators must not sync, unmap or release on its behalf. Backends
    /// without graph capture answer `false`.
    fn is_capturing(&self, stream: Stream) -> DeviceResult<bool> {
        let _ = stream;
        Ok(false)
    }

    /// Creates a physical chunk of `size` bytes (a multiple of the
    /// granularity) in **host** memory that maps into this device's
    /// reservations like a [`Device::create`] chunk (`cuMemCreate` with
    /// `CUmemLocation{type = CU_MEM_LOCATION_TYPE_HOST_NUMA, id = NUMA node}`,
    /// CUDA 12.2+; cuda.h). Used to spill when device memory runs out; it
    /// is charged to host memory, never to the device. Backends without it
    /// answer [`DeviceError::Unsupported`] (the default).
    fn create_on_host(&self, size: u64) -> DeviceResult<PhysHandle> {
        let _ = size;
        Err(DeviceError::Unsupported {
            call: Call::Create,
            what: "host-located physical memory (spill) on this backend".into(),
        })
    }

    /// Opens a legacy IPC handle (`cudaIpcMemHandle_t`, what PyTorch's
    /// default allocator shares) of another process's `cuMemAlloc` memory:
    /// `cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the
    /// only flag it takes, in this device's primary context (cuda.h). Returns
    /// the pointer, mapped and accessible. The driver counts references:
    /// opening a handle that is already open here returns the same pointer,
    /// and each open needs its own [`Device::ipc_close`]. Opening a handle in
    /// the process that exported it fails ("other process", cuda.h). Only
    /// the driver can map such memory: backends without it answer
    /// [`DeviceError::Unsupported`] (the default). Most callers want
    /// [`ipc::OpenedIpcMem`], which closes after the work on a stream.
    fn ipc_open(&self, handle: &IpcMemHandle) -> DeviceResult<u64> {
        let _ = handle;
        Err(DeviceError::Unsupported {
            call: Call::IpcOpen,
            what: "legacy CUDA IPC handles (cuIpcOpenMemHandle) on this backend".into(),
        })
    }
    /// Drops one reference to a pointer [`Device::ipc_open`] returned
    /// (`cuIpcCloseMemHandle`); the last one unmaps the memory (cuda.h). The
    /// caller has waited for the work queued on the memory. A pointer that
    /// is not open is refused ([`Rule::UnknownPointer`] on `cuda`).
    fn ipc_close(&self, ptr: u64) -> DeviceResult<()> {
        let _ = ptr;
        Err(DeviceError::Unsupported {
            call: Call::IpcClose,
            what: "legacy CUDA IPC handles (cuIpcCloseMemHandle) on this backend".into(),
        })
    }

    /// The checked model behind a CPU backend (`sim`, `host`), for tests and
    /// `validate()`; `None` on a real GPU.
    fn introspect(&self) -> Option<&dyn Introspect> {
        None
    }
}

/// A look inside a model device, so allocators' `validate()` and tests can
/// compare their bookkeeping with the device's.
pub trait Introspect {
    /// Whether every byte of `[addr, addr+len)` is mapped and accessible
    /// (or inside a plain allocation).
    fn is_accessible(&self, addr: u64, len: u64) -> bool;
    /// Live reservations, handles, mappings, plain allocations, physical bytes.
    fn live(&self) -> model::LiveCounts;
    /// Checks the model's own invariants.
    fn check(&self) -> Result<(), String>;
    /// The stream model (queue work that uses memory, complete it).
    fn streams(&self) -> &StreamModel;
}

/// Rounds `x` up to a multiple of `to` (a power of two or any non-zero value).
pub fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// Generates [`Device`] methods that forward to another device: `inner`
/// (a field of `self`) or `deref` (`**self`, for smart pointers), one method
/// per name listed. An adaptor lists the calls it passes through untouched
/// and writes only the ones it changes (RMM's resource adaptors do the same).
///
/// ```ignore
/// impl<D: Device> Device for Wrapper<D> {
///     forward_device_calls!(inner: reserve, free_reservation, caps);
///     fn create(&self, size: u64) -> DeviceResult<PhysHandle> { /* ... */ }
/// }
/// ```
#[macro_export]
macro_rules! forward_device_calls {
    ($to:tt: $($name:ident),+ $(,)?) => {
        $($crate::forward_device_calls!(@one $to $name);)+
    };
    (@one $to:tt caps) => {
        fn caps(&self) -> &$crate::DeviceCaps { $crate::forward_device_calls!(@call self $to caps()) }
    };
    (@one $to:tt reserve) => {
        fn reserve(&self, size: u64, align: u64) -> $crate::DeviceResult<u64> {
            $crate::forward_device_calls!(@call self $to reserve(size, align))
        }
    };
    (@one $to:tt free_reservation) => {
        fn free_reservation(&self, addr: u64, size: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to free_reservation(addr, size))
        }
    };
    (@one $to:tt create) => {
        fn create(&self, size: u64) -> $crate::DeviceResult<$crate::PhysHandle> {
            $crate::forward_device_calls!(@call self $to create(size))
        }
    };
    (@one $to:tt release) => {
        fn release(&self, handle: $crate::PhysHandle) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to release(handle))
        }
    };
    (@one $to:tt map) => {
        fn map(&self, addr: u64, size: u64, handle: $crate::PhysHandle) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to map(addr, size, handle))
        }
    };
    (@one $to:tt unmap) => {
        fn unmap(&self, addr: u64, size: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to unmap(addr, size))
        }
    };
    (@one $to:tt set_access) => {
        fn set_access(&self, addr: u64, size: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to set_access(addr, size))
        }
    };
    (@one $to:tt mem_info) => {
        fn mem_info(&self) -> $crate::DeviceResult<$crate::MemInfo> {
            $crate::forward_device_calls!(@call self $to mem_info())
        }
    };
    (@one $to:tt alloc) => {
        fn alloc(&self, size: u64) -> $crate::DeviceResult<u64> {
            $crate::forward_device_calls!(@call self $to alloc(size))
        }
    };
    (@one $to:tt free) => {
        fn free(&self, ptr: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to free(ptr))
        }
    };
    (@one $to:tt export_fd) => {
        fn export_fd(&self, handle: $crate::PhysHandle) -> $crate::DeviceResult<i32> {
            $crate::forward_device_calls!(@call self $to export_fd(handle))
        }
    };
    (@one $to:tt import_fd) => {
        fn import_fd(&self, fd: i32) -> $crate::DeviceResult<$crate::PhysHandle> {
            $crate::forward_device_calls!(@call self $to import_fd(fd))
        }
    };
    (@one $to:tt copy_to_device) => {
        fn copy_to_device(&self, dst: u64, src: &[u8]) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to copy_to_device(dst, src))
        }
    };
    (@one $to:tt copy_from_device) => {
        fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to copy_from_device(src, dst))
        }
    };
    (@one $to:tt copy_device) => {
        fn copy_device(&self, dst: u64, src: u64, len: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to copy_device(dst, src, len))
        }
    };
    (@one $to:tt alloc_host_buffer) => {
        fn alloc_host_buffer(&self, len: u64) -> $crate::DeviceResult<$crate::HostBuffer> {
            $crate::forward_device_calls!(@call self $to alloc_host_buffer(len))
        }
    };
    (@one $to:tt create_stream) => {
        fn create_stream(&self) -> $crate::DeviceResult<$crate::Stream> {
            $crate::forward_device_calls!(@call self $to create_stream())
        }
    };
    (@one $to:tt synchronize_stream) => {
        fn synchronize_stream(&self, stream: $crate::Stream) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to synchronize_stream(stream))
        }
    };
    (@one $to:tt synchronize) => {
        fn synchronize(&self) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to synchronize())
        }
    };
    (@one $to:tt create_event) => {
        fn create_event(&self) -> $crate::DeviceResult<$crate::Event> {
            $crate::forward_device_calls!(@call self $to create_event())
        }
    };
    (@one $to:tt record_event) => {
        fn record_event(&self, event: $crate::Event, stream: $crate::Stream) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to record_event(event, stream))
        }
    };
    (@one $to:tt query_event) => {
        fn query_event(&self, event: $crate::Event) -> $crate::DeviceResult<bool> {
            $crate::forward_device_calls!(@call self $to query_event(event))
        }
    };
    (@one $to:tt synchronize_event) => {
        fn synchronize_event(&self, event: $crate::Event) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to synchronize_event(event))
        }
    };
    (@one $to:tt destroy_event) => {
        fn destroy_event(&self, event: $crate::Event) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to destroy_event(event))
        }
    };
    (@one $to:tt is_capturing) => {
        fn is_capturing(&self, stream: $crate::Stream) -> $crate::DeviceResult<bool> {
            $crate::forward_device_calls!(@call self $to is_capturing(stream))
        }
    };
    (@one $to:tt create_on_host) => {
        fn create_on_host(&self, size: u64) -> $crate::DeviceResult<$crate::PhysHandle> {
            $crate::forward_device_calls!(@call self $to create_on_host(size))
        }
    };
    (@one $to:tt ipc_open) => {
        fn ipc_open(&self, handle: &$crate::IpcMemHandle) -> $crate::DeviceResult<u64> {
            $crate::forward_device_calls!(@call self $to ipc_open(handle))
        }
    };
    (@one $to:tt ipc_close) => {
        fn ipc_close(&self, ptr: u64) -> $crate::DeviceResult<()> {
            $crate::forward_device_calls!(@call self $to ipc_close(ptr))
        }
    };
    (@one $to:tt introspect) => {
        fn introspect(&self) -> Option<&dyn $crate::Introspect> {
            $crate::forward_device_calls!(@call self $to introspect())
        }
    };
    // `self` comes in as a token from the arm that wrote `&self` (macro
    // hygiene: a nested invocation cannot name it otherwise).
    (@call $s:tt inner $name:ident($($arg:ident),*)) => { $s.inner.$name($($arg),*) };
    (@call $s:tt deref $name:ident($($arg:ident),*)) => { (**$s).$name($($arg),*) };
}

/// Every [`Device`] method, for a pointer to a device.
macro_rules! impl_device_for_pointer {
    ($ptr:ty) => {
        impl<D: Device + ?Sized> Device for $ptr {
            forward_device_calls!(deref: caps, reserve, free_reservation, create, release, map,
                unmap, set_access, mem_info, alloc, free, export_fd, import_fd, copy_to_device,
                copy_from_device, copy_device, alloc_host_buffer, create_stream,
                synchronize_stream, synchronize, create_event, record_event, query_event,
                synchronize_event, destroy_event, is_capturing, create_on_host, ipc_open,
                ipc_close, introspect);
        }
    };
}

impl_device_for_pointer!(std::sync::Arc<D>);
impl_device_for_pointer!(Box<D>);
impl_device_for_pointer!(&D);

#[cfg(test)]
mod sync_tests {
    use super::*;

    #[test]
    fn syncs_have_one_definition_split_in_two() {
        let mut c = CallCounts::default();
        assert_eq!((c.syncs(), c.syncs_cell().as_str()), (0, "0"));
        c.add(Call::Free);
        c.add(Call::Free);
        c.add(Call::DeviceSync);
        assert_eq!((c.stream_syncs(), c.device_syncs(), c.syncs()), (0, 3, 3));
        assert_eq!(c.syncs_cell(), "3 device-wide");
        c.add(Call::StreamSync);
        c.add(Call::EventSync);
        c.add(Call::EventQuery);
        assert_eq!((c.stream_syncs(), c.device_syncs(), c.syncs()), (2, 3, 5));
        assert_eq!(c.syncs_cell(), "5 (2 stream/event + 3 device-wide)");
        for call in Call::ALL {
            assert_eq!(
                call.is_sync(),
                call.is_stream_sync() || call.is_device_sync(),
                "{call}"
            );
            assert!(!(call.is_stream_sync() && call.is_device_sync()), "{call}");
        }
        assert!(Call::Free.is_sync(), "cuMemFree synchronizes the device");
    }
}
