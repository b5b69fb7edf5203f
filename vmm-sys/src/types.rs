//! `#[repr(C)]` types and constants copied from `cuda.h` (CUDA 12.x).
//!
//! Names follow the header exactly so that a reader can grep one against the
//! other. Enumerations are plain `u32` constants, never Rust enums: the driver
//! may return a value this crate has never heard of, and a Rust enum holding an
//! unknown discriminant is undefined behaviour.
//!
//! `tests/layout.rs` checks every size, alignment, field offset and constant
//! here against `cudarc::driver::sys` (bindgen output of the real header).
#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_void};

// ---------------------------------------------------------------------------
// Scalar and handle types
// ---------------------------------------------------------------------------

/// `CUresult`: a raw driver result code. `0` is success; see the
/// `CUDA_ERROR_*` constants. Kept as an integer on purpose (see module docs).
pub type CUresult = u32;

/// `CUdevice`: a device ordinal as the driver sees it (from `cuDeviceGet`).
pub type CUdevice = c_int;

/// `CUdeviceptr`: a device virtual address.
pub type CUdeviceptr = u64;

/// `CUmemGenericAllocationHandle`: a physical allocation made by `cuMemCreate`.
pub type CUmemGenericAllocationHandle = u64;

/// `CUdevice_attribute`: which attribute `cuDeviceGetAttribute` reads.
pub type CUdevice_attribute = u32;

/// `CUmemAllocationType`.
pub type CUmemAllocationType = u32;

/// `CUmemAllocationHandleType` (a bit set of shareable handle kinds).
pub type CUmemAllocationHandleType = u32;

/// `CUmemLocationType`.
pub type CUmemLocationType = u32;

/// `CUmemAccess_flags`.
pub type CUmemAccess_flags = u32;

/// `CUmemAllocationGranularity_flags`.
pub type CUmemAllocationGranularity_flags = u32;

/// Opaque driver context (`struct CUctx_st`).
#[repr(C)]
pub struct CUctx_st {
    _private: [u8; 0],
}

/// Opaque stream (`struct CUstream_st`).
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// Opaque event (`struct CUevent_st`).
#[repr(C)]
pub struct CUevent_st {
    _private: [u8; 0],
}

/// `CUcontext`: a driver context. The primary context of a device is shared by
/// every user of the device in the process (the CUDA runtime included).
pub type CUcontext = *mut CUctx_st;

/// `CUstream`: a stream; null is the legacy default stream.
pub type CUstream = *mut CUstream_st;

/// `CUevent`: an event.
pub type CUevent = *mut CUevent_st;

// ---------------------------------------------------------------------------
// Structures
// ---------------------------------------------------------------------------

/// `CUmemLocation`: where an allocation lives (8 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemLocation {
    /// `CU_MEM_LOCATION_TYPE_*`.
    pub type_: CUmemLocationType,
    /// The device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub id: c_int,
}

impl CUmemLocation {
    /// The location "device `ordinal`".
    pub fn device(ordinal: CUdevice) -> Self {
        CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        }
    }

    /// The location "host NUMA node `node`".
    pub fn host_numa(node: c_int) -> Self {
        CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_HOST_NUMA,
            id: node,
        }
    }
}

/// The anonymous `allocFlags` structure inside `CUmemAllocationProp` (8 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemAllocationPropAllocFlags {
    /// `CU_MEM_ALLOCATION_COMP_*` (0 = no compression).
    pub compressionType: u8,
    /// Whether the allocation may be used with GPUDirect RDMA.
    pub gpuDirectRDMACapable: u8,
    /// Usage flags (`CU_MEM_CREATE_USAGE_*`); 0 for plain memory.
    pub usage: u16,
    /// Reserved; must be zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`: properties of a physical allocation, passed to
/// `cuMemCreate` and `cuMemGetAllocationGranularity` (32 bytes, align 8).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUmemAllocationProp {
    /// `CU_MEM_ALLOCATION_TYPE_*`.
    pub type_: CUmemAllocationType,
    /// Shareable handle kinds the allocation must support (bit set).
    pub requestedHandleTypes: CUmemAllocationHandleType,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows only (`LPSECURITYATTRIBUTES`); null elsewhere.
    pub win32HandleMetaData: *mut c_void,
    /// Extra flags; all zero for plain device memory.
    pub allocFlags: CUmemAllocationPropAllocFlags,
}

impl CUmemAllocationProp {
    /// Pinned memory on device `ordinal`, exportable as the handle kinds in
    /// `requested_handle_types` (0 for none, or
    /// [`CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`]).
    pub fn pinned_on_device(
        ordinal: CUdevice,
        requested_handle_types: CUmemAllocationHandleType,
    ) -> Self {
        CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: requested_handle_types,
            location: CUmemLocation::device(ordinal),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocationPropAllocFlags::default(),
        }
    }
}

impl Default for CUmemAllocationProp {
    /// All zero (an invalid type), as `memset(&prop, 0, sizeof prop)` in C.
    fn default() -> Self {
        CUmemAllocationProp {
            type_: 0,
            requestedHandleTypes: 0,
            location: CUmemLocation::default(),
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: CUmemAllocationPropAllocFlags::default(),
        }
    }
}

/// `CUmemAccessDesc`: who may access a mapped range and how (12 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemAccessDesc {
    /// The accessing device.
    pub location: CUmemLocation,
    /// `CU_MEM_ACCESS_FLAGS_PROT_*`.
    pub flags: CUmemAccess_flags,
}

impl CUmemAccessDesc {
    /// Read-write access for device `ordinal`.
    pub fn read_write(ordinal: CUdevice) -> Self {
        CUmemAccessDesc {
            location: CUmemLocation::device(ordinal),
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

// ---------------------------------------------------------------------------
// Result codes (`cudaError_enum`)
// ---------------------------------------------------------------------------

/// The call succeeded.
pub const CUDA_SUCCESS: CUresult = 0;
/// A parameter is out of range (also: most misuse of the VMM API).
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
/// Not enough memory (physical memory for `cuMemCreate`/`cuMemAlloc`,
/// address space for `cuMemAddressReserve`).
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// `cuInit` has not been called.
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
/// The driver is shutting down (seen in destructors at process exit).
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
/// No CUDA-capable device is present.
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
/// The device ordinal is not a valid device.
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
/// No valid context is current (or the context was destroyed).
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
/// A handle (stream, event, ...) is invalid.
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
/// A named symbol or resource was not found.
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// Asynchronous work has not completed yet (`cuEventQuery`, `cuStreamQuery`).
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
/// A kernel or copy touched an invalid address; the context is unusable.
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
/// The operation is not permitted.
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
/// The operation is not supported on this device or system.
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
/// An unknown internal error.
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// Peer access is not supported between these two devices.
pub const CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: CUresult = 217;
/// The operation cannot be performed in the present state (cuda.h: e.g. a
/// capture-related call on a stream in the wrong capture state).
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
/// The operation is not permitted while the stream is capturing (cuda.h);
/// a capture that hits it is invalidated.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
/// The capture sequence was invalidated by an earlier error (cuda.h).
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
/// The capture was not initiated in this stream (cuda.h).
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
/// A disallowed implicit dependency on a capture from the legacy stream (cuda.h).
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;
/// The operation is not permitted on an event last recorded in a capturing stream (cuda.h).
pub const CUDA_ERROR_CAPTURED_EVENT: CUresult = 907;

/// The name of a result code this crate knows (without asking the driver), e.g.
/// `"CUDA_ERROR_OUT_OF_MEMORY"` for 2.
pub fn result_name(code: CUresult) -> Option<&'static str> {
    Some(match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_ILLEGAL_ADDRESS => "CUDA_ERROR_ILLEGAL_ADDRESS",
        CUDA_ERROR_NOT_PERMITTED => "CUDA_ERROR_NOT_PERMITTED",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        CUDA_ERROR_ILLEGAL_STATE => "CUDA_ERROR_ILLEGAL_STATE",
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        CUDA_ERROR_CAPTURED_EVENT => "CUDA_ERROR_CAPTURED_EVENT",
        CUDA_ERROR_UNKNOWN => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

// ---------------------------------------------------------------------------
// Enumerations used by vmmalloc
// ---------------------------------------------------------------------------

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: CUdevice_attribute = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: CUdevice_attribute = 76;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED`: 1 if the device
/// supports `cuMemAddressReserve`/`cuMemCreate`/`cuMemMap`/...
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED: CUdevice_attribute = 102;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`: 1 if
/// `cuMemCreate` can make allocations exportable as POSIX file descriptors.
pub const CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: CUdevice_attribute = 103;
/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`: 1 if
/// `cuMemCreate` memory can be made GPUDirect RDMA capable
/// (`allocFlags.gpuDirectRDMACapable`).
pub const CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: CUdevice_attribute = 110;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` (CUDA 12.3+): 1 if
/// `cuMemCreate` can make allocations exportable as fabric handles
/// (multi-node NVLink).
pub const CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: CUdevice_attribute = 128;

/// `CU_MEM_ALLOCATION_TYPE_PINNED`: resident device memory.
pub const CU_MEM_ALLOCATION_TYPE_PINNED: CUmemAllocationType = 1;

/// `CU_MEM_HANDLE_TYPE_NONE`: the allocation cannot be exported.
pub const CU_MEM_HANDLE_TYPE_NONE: CUmemAllocationHandleType = 0;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: exportable as an `int` fd.
pub const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: CUmemAllocationHandleType = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC` (CUDA 12.3+): exportable as a
/// [`CUmemFabricHandle`], importable by other processes and nodes of the
/// same NVLink fabric. `cuMemCreate` fails with `CUDA_ERROR_NOT_PERMITTED`
/// (or `CUDA_ERROR_NOT_SUPPORTED`) where the process may not use the fabric
/// (no IMEX channel), which NCCL's `ncclMemAlloc` answers by creating the
/// memory again without it (NCCL's allocator.cc).
pub const CU_MEM_HANDLE_TYPE_FABRIC: CUmemAllocationHandleType = 8;

/// `CU_MEM_LOCATION_TYPE_DEVICE`: the location id is a device ordinal.
pub const CU_MEM_LOCATION_TYPE_DEVICE: CUmemLocationType = 1;
/// `CU_MEM_LOCATION_TYPE_HOST_NUMA` (CUDA 12.2+): the location id is a host
/// NUMA node; `cuMemCreate` then allocates pinned host memory that maps into
/// device reservations (used to spill).
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: CUmemLocationType = 3;
/// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` (CUDA 12.2+): the host NUMA node
/// closest to the device, -1 when the system does not support NUMA.
pub const CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: CUdevice_attribute = 134;
/// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`
/// (cuda.h of CUDA 12.9+): 1 if `cuMemCreate`/`cuMemMap` accept host NUMA locations.
pub const CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: CUdevice_attribute =
    141;

/// `CU_MEM_ACCESS_FLAGS_PROT_NONE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_NONE: CUmemAccess_flags = 0;
/// `CU_MEM_ACCESS_FLAGS_PROT_READ`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READ: CUmemAccess_flags = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: CUmemAccess_flags = 3;

/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`: the granularity every VMM size and
/// address must be a multiple of.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: CUmemAllocationGranularity_flags = 0;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`: the granularity for best performance.
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: CUmemAllocationGranularity_flags = 1;

/// `CU_STREAM_DEFAULT`: a stream that synchronizes with the legacy default stream.
pub const CU_STREAM_DEFAULT: u32 = 0;
/// `CU_STREAM_NON_BLOCKING`: a stream independent of the legacy default stream.
pub const CU_STREAM_NON_BLOCKING: u32 = 1;

/// `CU_EVENT_DEFAULT`.
pub const CU_EVENT_DEFAULT: u32 = 0;
/// `CU_EVENT_DISABLE_TIMING`: cheaper events that record no timestamp.
pub const CU_EVENT_DISABLE_TIMING: u32 = 2;

/// `CUstream` value `CU_STREAM_LEGACY` (cuda.h `((CUstream)0x1)`): the legacy
/// default stream, which synchronizes with every blocking stream of its context.
pub const CU_STREAM_LEGACY: usize = 0x1;
/// `CUstream` value `CU_STREAM_PER_THREAD` (cuda.h `((CUstream)0x2)`): the
/// calling thread's own default stream in the current context.
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// `CUuuid` (`struct CUuuid_st { char bytes[16]; }`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUuuid {
    /// The 16 bytes of the UUID.
    pub bytes: [c_char; 16],
}

/// `CUmemFabricHandle` (`struct CUmemFabricHandle_st { unsigned char
/// data[CU_IPC_HANDLE_SIZE]; }`, cuda.h of CUDA 12.3+): what
/// `cuMemExportToShareableHandle` writes for [`CU_MEM_HANDLE_TYPE_FABRIC`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUmemFabricHandle {
    /// Opaque bytes.
    pub data: [u8; CU_IPC_HANDLE_SIZE],
}

/// `CU_IPC_HANDLE_SIZE` (cuda.h): bytes of a legacy IPC handle.
pub const CU_IPC_HANDLE_SIZE: usize = 64;

/// `CUipcMemHandle` (`struct CUipcMemHandle_st { char reserved[CU_IPC_HANDLE_SIZE]; }`):
/// the opaque legacy IPC handle of a `cuMemAlloc` allocation.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CUipcMemHandle {
    /// The handle's bytes, opaque.
    pub reserved: [c_char; CU_IPC_HANDLE_SIZE],
}

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS` (`CUipcMem_flags`, cuda.h): the one
/// flag `cuIpcOpenMemHandle` takes.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 0x1;

/// Opaque `struct CUgraph_st`.
#[repr(C)]
pub struct CUgraph_st {
    _private: [u8; 0],
}

/// `CUgraph`: a CUDA graph (what a stream capture produces).
pub type CUgraph = *mut CUgraph_st;

/// `CUstreamCaptureStatus` (a C enum).
pub type CUstreamCaptureStatus = u32;
/// `CU_STREAM_CAPTURE_STATUS_NONE`: the stream is not capturing.
pub const CU_STREAM_CAPTURE_STATUS_NONE: CUstreamCaptureStatus = 0;
/// `CU_STREAM_CAPTURE_STATUS_ACTIVE`: the stream is capturing.
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: CUstreamCaptureStatus = 1;
/// `CU_STREAM_CAPTURE_STATUS_INVALIDATED`: capturing, but an error
/// invalidated the capture; it must still be ended.
pub const CU_STREAM_CAPTURE_STATUS_INVALIDATED: CUstreamCaptureStatus = 2;

/// `CUstreamCaptureMode` (a C enum).
pub type CUstreamCaptureMode = u32;
/// `CU_STREAM_CAPTURE_MODE_GLOBAL`: potentially unsafe calls are prohibited on every thread.
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: CUstreamCaptureMode = 0;
/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: prohibited on the capturing thread only.
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: CUstreamCaptureMode = 1;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`: not prohibited.
pub const CU_STREAM_CAPTURE_MODE_RELAXED: CUstreamCaptureMode = 2;
