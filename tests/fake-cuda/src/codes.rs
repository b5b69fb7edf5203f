//! Names and descriptions of the result codes the fake returns, as static C
//! strings (what `cuGetErrorName` / `cuGetErrorString` hand out).

use std::ffi::CStr;
use vmm_sys::CUresult;

/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`, not among vmm-sys's constants.
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;

/// `(code, name, description)` for every code the fake knows, with the real
/// driver's wording.
#[rustfmt::skip]
const TABLE: &[(CUresult, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (100, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (217, c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", c"peer access is not supported between these two devices"),
    (400, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (401, c"CUDA_ERROR_ILLEGAL_STATE", c"the operation cannot be performed in the present state"),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (700, c"CUDA_ERROR_ILLEGAL_ADDRESS", c"an illegal memory access was encountered"),
    (709, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", c"operation not permitted when stream is capturing"),
    (901, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", c"operation failed due to a previous error during capture"),
    (903, c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", c"capture was not initiated in this stream"),
    (906, c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", c"operation would make the legacy stream depend on a capturing blocking stream"),
    (907, c"CUDA_ERROR_CAPTURED_EVENT", c"operation not permitted on an event last recorded in a capturing stream"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// `cuGetErrorName`'s answer for `code`, if the fake knows it.
pub fn name(code: CUresult) -> Option<&'static CStr> {
    TABLE.iter().find(|t| t.0 == code).map(|t| t.1)
}

/// `cuGetErrorString`'s answer for `code`, if the fake knows it.
pub fn description(code: CUresult) -> Option<&'static CStr> {
    TABLE.iter().find(|t| t.0 == code).map(|t| t.2)
}

/// The name as a Rust string, or the number (for trace lines).
pub fn name_or_number(code: CUresult) -> String {
    name(code).map_or_else(
        || format!("CUresult {code}"),
        |n| n.to_string_lossy().into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_agree_with_vmm_sys() {
        for &(code, n, _) in TABLE {
            if let Some(theirs) = vmm_sys::result_name(code) {
                assert_eq!(n.to_str().unwrap(), theirs);
            }
        }
        assert!(name(12345).is_none() && description(12345).is_none());
        assert_eq!(description(2).unwrap().to_str().unwrap(), "out of memory");
    }
}
