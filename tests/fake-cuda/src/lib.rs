//! A fake `libcuda.so` for machines without a GPU: the CUDA driver entry points
//! vmm-sys loads, implemented on the CPU. **Test-only, never shipped.**
//!
//! Each fake device is a [`vmmalloc_device::host::HostDevice`]: the same
//! checked address-space model ([`vmmalloc_device::model::AddressSpace`]) and
//! the same memfd + mmap mechanics as the `host` backend, so a reservation is
//! a real `PROT_NONE` range of this process, a physical allocation a memfd, a
//! mapping a `MAP_SHARED` view of it, and bytes copied in survive unmap and a
//! map elsewhere. A call the model rejects returns the code the model names
//! ([`vmmalloc_device::DeviceError::cuda_code`]); a call the real driver would
//! reject before reaching memory (null out-pointer, bad flags, bad device,
//! missing `cuInit` or context) returns the real driver's code for it.
//!
//! Load it with `VMMALLOC_CUDA_LIBRARY=target/<profile>/libcuda.so` (or
//! `vmm_sys::Driver::load_from`). Configuration comes from environment
//! variables ([`mod@config`]); a few extra exports whose names start with
//! `fakeCuda` let tests look inside ([`hooks`]). docs/fake-cuda.md says what
//! the fake proves and what only a real GPU can.
//!
//! The exports are declared with vmm-sys's `#[repr(C)]` copies of the
//! `cuda.h` types (checked against the real header by vmm-sys's layout test),
//! so the fake checks the values we pass, not the structures' layout.
//!
//! Every export catches panics and returns `CUDA_ERROR_UNKNOWN` (999) instead
//! of unwinding into C.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

pub mod codes;
pub mod config;
pub mod exports;
pub mod hooks;
pub mod state;

use config::{Config, Trace};
use std::cell::RefCell;
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use vmm_sys::{CUresult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS};
use vmmalloc_device::DeviceError;

/// Every CUDA entry point the fake exports, in vmm-sys's order (a unit test
/// checks that this is exactly `vmm_sys::SYMBOLS`). `FAKE_CUDA_FAIL` names them.
pub const ENTRY_POINTS: [&str; 52] = [
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

/// Calls made to each entry point since the library was loaded (index as in
/// [`ENTRY_POINTS`]), failed and injected ones included.
static CALLS: [AtomicU64; ENTRY_POINTS.len()] = [const { AtomicU64::new(0) }; ENTRY_POINTS.len()];

/// The configuration, read from the environment on the first call.
static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();

/// The configuration, or why the environment is malformed.
pub fn config() -> Result<&'static Config, &'static str> {
    CONFIG
        .get_or_init(Config::from_env)
        .as_ref()
        .map_err(String::as_str)
}

/// Number of calls made so far to `entry` (one of [`ENTRY_POINTS`]).
pub fn call_count(entry: &str) -> Option<u64> {
    let i = ENTRY_POINTS.iter().position(|e| *e == entry)?;
    Some(CALLS[i].load(Ordering::Relaxed))
}

/// Why a call failed: the code returned and a sentence for traces and
/// `fakeCudaLastError`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fail {
    /// The `CUresult` returned (never 0).
    pub code: CUresult,
    /// What was wrong.
    pub why: String,
}

impl Fail {
    /// A failure with `code`.
    pub fn new(code: CUresult, why: impl Into<String>) -> Fail {
        Fail {
            code,
            why: why.into(),
        }
    }

    /// `CUDA_ERROR_INVALID_VALUE` (1).
    pub fn invalid(why: impl Into<String>) -> Fail {
        Fail::new(CUDA_ERROR_INVALID_VALUE, why)
    }
}

impl From<DeviceError> for Fail {
    /// The code the model names for the error ([`DeviceError::cuda_code`]).
    fn from(e: DeviceError) -> Fail {
        Fail::new(e.cuda_code(), e.to_string())
    }
}

/// The result of an entry point's body.
pub type Res<T> = Result<T, Fail>;

thread_local! {
    /// The reason for the last failed call on this thread.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// The reason for the last failed call on this thread (empty if none failed).
pub fn last_error() -> String {
    LAST_ERROR.with(|l| l.borrow().clone())
}

fn note_failure(entry: &str, fail: &Fail) {
    let line = format!(
        "{entry} -> {} ({}): {}",
        codes::name_or_number(fail.code),
        fail.code,
        fail.why
    );
    if config().is_ok_and(|c| c.trace >= Trace::Errors) {
        let _ = writeln!(std::io::stderr(), "fake-cuda: {line}");
    }
    LAST_ERROR.with(|l| *l.borrow_mut() = line);
}

/// Runs the body of CUDA entry point `entry`: counts the call, injects the
/// failure `FAKE_CUDA_FAIL` asks for, turns the body's result into a
/// `CUresult`, records why it failed, and turns a panic into
/// `CUDA_ERROR_UNKNOWN` (999) so that no unwinding crosses the C ABI.
pub fn run(entry: &'static str, body: impl FnOnce() -> Res<()>) -> CUresult {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let nth = match ENTRY_POINTS.iter().position(|e| *e == entry) {
            Some(i) => CALLS[i].fetch_add(1, Ordering::Relaxed) + 1,
            None => 0,
        };
        if let Some(code) = config().ok().and_then(|c| c.injected(entry, nth)) {
            return Err(Fail::new(
                code,
                format!("injected failure of call {nth} (FAKE_CUDA_FAIL)"),
            ));
        }
        body()
    }));
    let result = outcome.unwrap_or_else(|_| {
        Err(Fail::new(
            CUDA_ERROR_UNKNOWN,
            "the fake panicked (a bug in fake-cuda)",
        ))
    });
    match result {
        Ok(()) => {
            if config().is_ok_and(|c| c.trace >= Trace::All) {
                // Not eprintln!, which panics when stderr is gone.
                let _ = writeln!(std::io::stderr(), "fake-cuda: {entry} -> CUDA_SUCCESS");
            }
            CUDA_SUCCESS
        }
        Err(fail) => {
            // Reporting must not unwind either.
            let _ = catch_unwind(AssertUnwindSafe(|| note_failure(entry, &fail)));
            fail.code
        }
    }
}

/// Writes `value` through a caller's out-pointer; null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `ptr` is null or valid for writing one `T` (the C caller's contract).
pub unsafe fn put<T>(ptr: *mut T, value: T, what: &str) -> Res<()> {
    if ptr.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and valid for a write of `T` by the function contract.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Reads a `T` through a caller's pointer; null is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `ptr` is null or valid for reading one initialized `T` (the C caller's contract).
pub unsafe fn get<T: Copy>(ptr: *const T, what: &str) -> Res<T> {
    if ptr.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and valid for a read of `T` by the function contract.
    Ok(unsafe { ptr.read() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_exactly_what_vmm_sys_loads() {
        assert_eq!(ENTRY_POINTS.as_slice(), vmm_sys::SYMBOLS);
    }

    #[test]
    fn run_turns_panics_into_unknown_and_records_why() {
        let code = run("cuCtxSynchronize", || panic!("boom"));
        assert_eq!(code, CUDA_ERROR_UNKNOWN);
        assert!(last_error().contains("panicked"), "{}", last_error());
        assert_eq!(run("cuCtxSynchronize", || Err(Fail::invalid("x"))), 1);
        assert!(last_error().starts_with("cuCtxSynchronize -> CUDA_ERROR_INVALID_VALUE (1): x"));
        assert_eq!(run("cuCtxSynchronize", || Ok(())), 0);
        assert!(call_count("cuCtxSynchronize").unwrap() >= 3);
        assert_eq!(call_count("cuNothing"), None);
    }

    #[test]
    fn null_pointers_are_invalid_values() {
        // SAFETY: null is allowed by the contract.
        let e = unsafe { put::<u32>(std::ptr::null_mut(), 1, "count") }.unwrap_err();
        assert_eq!(e.code, 1);
        let mut x = 0u32;
        // SAFETY: `x` is a valid u32.
        unsafe { put(&mut x, 7, "x") }.unwrap();
        // SAFETY: `x` is a valid u32.
        assert_eq!(unsafe { get(&x, "x") }.unwrap(), 7);
    }
}
