//! Our `#[repr(C)]` copies of cuda.h against cudarc's bindgen output of the
//! real header, and loading errors. No GPU or driver needed.

use cudarc::driver::sys as cu;
use std::mem::{align_of, offset_of, size_of};
use vmm_sys::*;

/// Asserts equal size and alignment of two types.
macro_rules! same_layout {
    ($ours:ty, $theirs:ty) => {
        assert_eq!(
            size_of::<$ours>(),
            size_of::<$theirs>(),
            "size of {}",
            stringify!($ours)
        );
        assert_eq!(
            align_of::<$ours>(),
            align_of::<$theirs>(),
            "align of {}",
            stringify!($ours)
        );
    };
}

/// Asserts equal offset (and size) of a field path in two types.
macro_rules! same_field {
    ($ours:ty, $theirs:ty, $($field:tt).+) => {
        assert_eq!(
            offset_of!($ours, $($field).+),
            offset_of!($theirs, $($field).+),
            "offset of {}.{}",
            stringify!($ours),
            stringify!($($field).+)
        );
    };
}

#[test]
fn scalar_types_match_cuda_h() {
    same_layout!(CUdevice, cu::CUdevice);
    same_layout!(CUdeviceptr, cu::CUdeviceptr);
    same_layout!(
        CUmemGenericAllocationHandle,
        cu::CUmemGenericAllocationHandle
    );
    same_layout!(CUcontext, cu::CUcontext);
    same_layout!(CUstream, cu::CUstream);
    same_layout!(CUevent, cu::CUevent);
    // C enums are `int`-sized; our aliases are u32.
    same_layout!(CUresult, cu::CUresult);
    same_layout!(CUdevice_attribute, cu::CUdevice_attribute);
    same_layout!(CUmemAllocationType, cu::CUmemAllocationType);
    same_layout!(CUmemAllocationHandleType, cu::CUmemAllocationHandleType);
    same_layout!(CUmemLocationType, cu::CUmemLocationType);
    same_layout!(CUmemAccess_flags, cu::CUmemAccess_flags);
    same_layout!(
        CUmemAllocationGranularity_flags,
        cu::CUmemAllocationGranularity_flags
    );
}

#[test]
fn mem_location_layout() {
    same_layout!(CUmemLocation, cu::CUmemLocation);
    assert_eq!(size_of::<CUmemLocation>(), 8);
    same_field!(CUmemLocation, cu::CUmemLocation, type_);
    same_field!(CUmemLocation, cu::CUmemLocation, id);
}

#[test]
fn mem_allocation_prop_layout() {
    same_layout!(CUmemAllocationProp, cu::CUmemAllocationProp);
    assert_eq!(size_of::<CUmemAllocationProp>(), 32);
    assert_eq!(align_of::<CUmemAllocationProp>(), 8);
    same_field!(CUmemAllocationProp, cu::CUmemAllocationProp, type_);
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        requestedHandleTypes
    );
    same_field!(CUmemAllocationProp, cu::CUmemAllocationProp, location);
    same_field!(CUmemAllocationProp, cu::CUmemAllocationProp, location.type_);
    same_field!(CUmemAllocationProp, cu::CUmemAllocationProp, location.id);
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        win32HandleMetaData
    );
    same_field!(CUmemAllocationProp, cu::CUmemAllocationProp, allocFlags);
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        allocFlags.compressionType
    );
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        allocFlags.gpuDirectRDMACapable
    );
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        allocFlags.usage
    );
    same_field!(
        CUmemAllocationProp,
        cu::CUmemAllocationProp,
        allocFlags.reserved
    );
}

#[test]
fn alloc_flags_layout() {
    same_layout!(
        CUmemAllocationPropAllocFlags,
        cu::CUmemAllocationProp_st__bindgen_ty_1
    );
    assert_eq!(size_of::<CUmemAllocationPropAllocFlags>(), 8);
    same_field!(
        CUmemAllocationPropAllocFlags,
        cu::CUmemAllocationProp_st__bindgen_ty_1,
        compressionType
    );
    same_field!(
        CUmemAllocationPropAllocFlags,
        cu::CUmemAllocationProp_st__bindgen_ty_1,
        gpuDirectRDMACapable
    );
    same_field!(
        CUmemAllocationPropAllocFlags,
        cu::CUmemAllocationProp_st__bindgen_ty_1,
        usage
    );
    same_field!(
        CUmemAllocationPropAllocFlags,
        cu::CUmemAllocationProp_st__bindgen_ty_1,
        reserved
    );
}

#[test]
fn mem_access_desc_layout() {
    same_layout!(CUmemAccessDesc, cu::CUmemAccessDesc);
    assert_eq!(size_of::<CUmemAccessDesc>(), 12);
    same_field!(CUmemAccessDesc, cu::CUmemAccessDesc, location);
    same_field!(CUmemAccessDesc, cu::CUmemAccessDesc, location.type_);
    same_field!(CUmemAccessDesc, cu::CUmemAccessDesc, location.id);
    same_field!(CUmemAccessDesc, cu::CUmemAccessDesc, flags);
}

#[test]
fn constructors_fill_what_cuda_h_expects() {
    let p = CUmemAllocationProp::pinned_on_device(3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    assert_eq!(p.type_, CU_MEM_ALLOCATION_TYPE_PINNED);
    assert_eq!(
        p.location,
        CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: 3
        }
    );
    assert_eq!(
        p.requestedHandleTypes,
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    );
    assert!(p.win32HandleMetaData.is_null());
    assert_eq!(p.allocFlags, CUmemAllocationPropAllocFlags::default());
    let d = CUmemAccessDesc::read_write(3);
    assert_eq!(d.location.id, 3);
    assert_eq!(d.flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
}

#[test]
fn result_codes_match_cuda_h() {
    use cu::cudaError_enum as E;
    let pairs = [
        (CUDA_SUCCESS, E::CUDA_SUCCESS),
        (CUDA_ERROR_INVALID_VALUE, E::CUDA_ERROR_INVALID_VALUE),
        (CUDA_ERROR_OUT_OF_MEMORY, E::CUDA_ERROR_OUT_OF_MEMORY),
        (CUDA_ERROR_NOT_INITIALIZED, E::CUDA_ERROR_NOT_INITIALIZED),
        (CUDA_ERROR_DEINITIALIZED, E::CUDA_ERROR_DEINITIALIZED),
        (CUDA_ERROR_NO_DEVICE, E::CUDA_ERROR_NO_DEVICE),
        (CUDA_ERROR_INVALID_DEVICE, E::CUDA_ERROR_INVALID_DEVICE),
        (CUDA_ERROR_INVALID_CONTEXT, E::CUDA_ERROR_INVALID_CONTEXT),
        (CUDA_ERROR_INVALID_HANDLE, E::CUDA_ERROR_INVALID_HANDLE),
        (CUDA_ERROR_NOT_FOUND, E::CUDA_ERROR_NOT_FOUND),
        (CUDA_ERROR_NOT_READY, E::CUDA_ERROR_NOT_READY),
        (CUDA_ERROR_ILLEGAL_ADDRESS, E::CUDA_ERROR_ILLEGAL_ADDRESS),
        (CUDA_ERROR_NOT_PERMITTED, E::CUDA_ERROR_NOT_PERMITTED),
        (CUDA_ERROR_NOT_SUPPORTED, E::CUDA_ERROR_NOT_SUPPORTED),
        (CUDA_ERROR_UNKNOWN, E::CUDA_ERROR_UNKNOWN),
    ];
    for (ours, theirs) in pairs {
        assert_eq!(ours, theirs as u32, "{theirs:?}");
        // Our static names are cuda.h's names.
        assert_eq!(result_name(ours), Some(format!("{theirs:?}").as_str()));
    }
    assert_eq!(result_name(12345), None);
}

#[test]
fn enum_constants_match_cuda_h() {
    use cu::CUdevice_attribute_enum as A;
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED as u32
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        102
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED as u32
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as u32
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as u32
    );
    assert_eq!(
        CU_MEM_ALLOCATION_TYPE_PINNED,
        cu::CUmemAllocationType_enum::CU_MEM_ALLOCATION_TYPE_PINNED as u32
    );
    assert_eq!(
        CU_MEM_HANDLE_TYPE_NONE,
        cu::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_NONE.0
    );
    assert_eq!(
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        cu::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0
    );
    assert_eq!(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1);
    assert_eq!(
        CU_MEM_HANDLE_TYPE_FABRIC,
        cu::CUmemAllocationHandleType_enum::CU_MEM_HANDLE_TYPE_FABRIC.0
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED as u32
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
        A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED as u32
    );
    assert_eq!(
        CU_MEM_LOCATION_TYPE_DEVICE,
        cu::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE as u32
    );
    assert_eq!(
        CU_MEM_LOCATION_TYPE_HOST_NUMA,
        cu::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_HOST_NUMA as u32
    );
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
        cu::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID as u32
    );
    // Newer than the cuda-12080 bindings: cuda.h of CUDA 12.9 / 13 (Driver
    // API reference, CUdevice_attribute) gives 141.
    assert_eq!(
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        141
    );
    use cu::CUmemAccess_flags_enum as F;
    assert_eq!(
        CU_MEM_ACCESS_FLAGS_PROT_NONE,
        F::CU_MEM_ACCESS_FLAGS_PROT_NONE as u32
    );
    assert_eq!(
        CU_MEM_ACCESS_FLAGS_PROT_READ,
        F::CU_MEM_ACCESS_FLAGS_PROT_READ as u32
    );
    assert_eq!(
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u32
    );
    assert_eq!(CU_MEM_ACCESS_FLAGS_PROT_READWRITE, 3);
    use cu::CUmemAllocationGranularity_flags_enum as G;
    assert_eq!(
        CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        G::CU_MEM_ALLOC_GRANULARITY_MINIMUM as u32
    );
    assert_eq!(CU_MEM_ALLOC_GRANULARITY_MINIMUM, 0);
    assert_eq!(
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        G::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED as u32
    );
    assert_eq!(
        CU_STREAM_DEFAULT,
        cu::CUstream_flags_enum::CU_STREAM_DEFAULT as u32
    );
    assert_eq!(
        CU_STREAM_NON_BLOCKING,
        cu::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32
    );
    assert_eq!(
        CU_EVENT_DEFAULT,
        cu::CUevent_flags_enum::CU_EVENT_DEFAULT as u32
    );
    assert_eq!(
        CU_EVENT_DISABLE_TIMING,
        cu::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32
    );
}

#[test]
fn symbol_table_is_the_issue_list() {
    let expected = [
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceTotalMem_v2",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxGetCurrent",
        "cuCtxSetCurrent",
        "cuCtxSynchronize",
        "cuMemGetInfo_v2",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuMemGetAllocationGranularity",
        "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuMemcpyHtoD_v2",
        "cuMemcpyDtoH_v2",
        "cuMemcpyDtoD_v2",
        "cuStreamCreate",
        "cuStreamSynchronize",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuEventDestroy_v2",
        "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent_v2",
        "cuDevicePrimaryCtxGetState",
        "cuDeviceCanAccessPeer",
        "cuMemGetAccess",
        "cuDeviceGetPCIBusId",
        "cuDeviceGetUuid_v2",
        "cuStreamBeginCapture_v2",
        "cuStreamEndCapture",
        "cuStreamIsCapturing",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuMemHostAlloc",
        "cuMemFreeHost",
        "cuIpcGetMemHandle",
        "cuIpcOpenMemHandle_v2",
        "cuIpcCloseMemHandle",
    ];
    assert_eq!(SYMBOLS, expected.as_slice());
    // No VMM entry point has a _v2 name (DESIGN.md, layer 1).
    for s in SYMBOLS
        .iter()
        .filter(|s| s.starts_with("cuMem") && s.ends_with("_v2"))
    {
        assert!(
            [
                "cuMemGetInfo_v2",
                "cuMemAlloc_v2",
                "cuMemFree_v2",
                "cuMemcpyHtoD_v2",
                "cuMemcpyDtoH_v2",
                "cuMemcpyDtoD_v2"
            ]
            .contains(s),
            "{s}"
        );
    }
}

#[test]
fn missing_library_is_an_error_naming_the_path() {
    let err = Driver::load_from("/nonexistent/libcuda.so").unwrap_err();
    match &err {
        LoadError::Library { path, reason } => {
            assert_eq!(path, "/nonexistent/libcuda.so");
            assert!(!reason.is_empty());
        }
        other => panic!("expected LoadError::Library, got {other:?}"),
    }
    assert_eq!(err.path(), "/nonexistent/libcuda.so");
    assert!(err.to_string().contains("/nonexistent/libcuda.so"), "{err}");
}

#[test]
fn library_without_the_symbols_names_the_first_missing_one() {
    let err = Driver::load_from("libc.so.6").unwrap_err();
    assert_eq!(
        err,
        LoadError::Symbol {
            name: "cuInit",
            path: "libc.so.6".into()
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("cuInit") && text.contains("libc.so.6"),
        "{text}"
    );
}

#[test]
fn error_display_names_call_and_code() {
    let e = CuError {
        call: "cuMemCreate",
        code: CUDA_ERROR_OUT_OF_MEMORY,
    };
    assert!(e.is_out_of_memory());
    assert_eq!(
        e.to_string(),
        "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)"
    );
    let e = CuError {
        call: "cuMemMap",
        code: 4242,
    };
    assert_eq!(e.to_string(), "cuMemMap failed: CUresult 4242");
    assert_eq!(check("cuInit", 0), Ok(()));
    assert_eq!(
        check("cuInit", 100),
        Err(CuError {
            call: "cuInit",
            code: 100
        })
    );
}

#[test]
fn version_strings() {
    assert_eq!(version_string(12080), "12.8");
    assert_eq!(version_string(12040), "12.4");
    assert_eq!(version_string(11020), "11.2");
    assert_eq!(version_string(13000), "13.0");
}

#[test]
fn issue_11_types_match_cuda_h() {
    same_layout!(CUuuid, cu::CUuuid);
    assert_eq!(size_of::<CUuuid>(), 16);
    same_field!(CUuuid, cu::CUuuid, bytes);
    same_layout!(CUgraph, cu::CUgraph);
    same_layout!(CUstreamCaptureStatus, cu::CUstreamCaptureStatus);
    same_layout!(CUstreamCaptureMode, cu::CUstreamCaptureMode);
    use cu::CUstreamCaptureMode_enum as M;
    use cu::CUstreamCaptureStatus_enum as S;
    assert_eq!(
        CU_STREAM_CAPTURE_STATUS_NONE,
        S::CU_STREAM_CAPTURE_STATUS_NONE as u32
    );
    assert_eq!(
        CU_STREAM_CAPTURE_STATUS_ACTIVE,
        S::CU_STREAM_CAPTURE_STATUS_ACTIVE as u32
    );
    assert_eq!(
        CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        S::CU_STREAM_CAPTURE_STATUS_INVALIDATED as u32
    );
    assert_eq!(
        CU_STREAM_CAPTURE_MODE_GLOBAL,
        M::CU_STREAM_CAPTURE_MODE_GLOBAL as u32
    );
    assert_eq!(
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as u32
    );
    assert_eq!(
        CU_STREAM_CAPTURE_MODE_RELAXED,
        M::CU_STREAM_CAPTURE_MODE_RELAXED as u32
    );
    use cu::cudaError_enum as E;
    for (ours, theirs) in [
        (
            CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
            E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        ),
        (CUDA_ERROR_ILLEGAL_STATE, E::CUDA_ERROR_ILLEGAL_STATE),
        (
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        ),
        (
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        ),
        (
            CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
            E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        ),
        (
            CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
            E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        ),
        (CUDA_ERROR_CAPTURED_EVENT, E::CUDA_ERROR_CAPTURED_EVENT),
    ] {
        assert_eq!(ours, theirs as u32, "{theirs:?}");
    }
}

#[test]
fn issue_35_ipc_types_match_cuda_h() {
    same_layout!(CUmemFabricHandle, cu::CUmemFabricHandle);
    same_field!(CUmemFabricHandle, cu::CUmemFabricHandle, data);
    assert_eq!(size_of::<CUmemFabricHandle>(), CU_IPC_HANDLE_SIZE);
    same_layout!(CUipcMemHandle, cu::CUipcMemHandle);
    assert_eq!(size_of::<CUipcMemHandle>(), CU_IPC_HANDLE_SIZE);
    same_field!(CUipcMemHandle, cu::CUipcMemHandle, reserved);
    assert_eq!(
        CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
        cu::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32
    );
}
