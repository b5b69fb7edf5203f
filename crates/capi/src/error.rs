//! The C ABI's one error type: a kind and a message.
//!
//! Every failure inside the library is an [`Error`]. Its [`ErrorKind`] is
//! what a caller can act on, and maps one-to-one to a `VMMALLOC_E_*` code
//! (returned by `vmmalloc_try_malloc`, `vmmalloc_pool_try_malloc` and
//! `vmmalloc_growable_resize`) and to the exception the C++ shim's
//! `vmmalloc_malloc` throws, which PyTorch turns into a Python exception
//! (`torch/csrc/Exceptions.h`: `c10::OutOfMemoryError` becomes
//! `torch.cuda.OutOfMemoryError`, any other `std::exception` a
//! `RuntimeError` carrying `what()`):
//!
//! | kind | code | C++ (`vmmalloc_malloc`, `on_oom:raise`) | Python |
//! |---|---|---|---|
//! | out of memory | `VMMALLOC_E_OOM` (1) | `c10::OutOfMemoryError` (torch companion) or `std::runtime_error`, `what()` = `CUDA out of memory. vmmalloc: …` | `torch.cuda.OutOfMemoryError`, else `RuntimeError` |
//! | invalid argument | `VMMALLOC_E_INVALID` (2) | `std::runtime_error`, `vmmalloc: invalid argument: …` | `RuntimeError` |
//! | driver error | `VMMALLOC_E_DRIVER` (3) | `std::runtime_error`, `vmmalloc: driver error: …` | `RuntimeError` |
//! | allocator failed | `VMMALLOC_E_FAILED` (4) | `std::runtime_error`, `vmmalloc: allocator failed: …` | `RuntimeError` |
//! | unsupported | `VMMALLOC_E_UNSUPPORTED` (5) | `std::runtime_error`, `vmmalloc: unsupported: …` | `RuntimeError` |
//!
//! The message is what `vmmalloc_last_error()` returns and the log line says;
//! the shim puts the kind's name in front of it (`src/shim.cpp`, `raise`).

use crate::config::ConfigError;
use std::ffi::c_int;
use std::fmt;
use vmmalloc_alloc::AllocError;
use vmmalloc_device::DeviceError;

/// What went wrong, as a caller can act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Not enough device memory (recoverable: free something, retry).
    OutOfMemory,
    /// A bad argument or a call at the wrong time: an invalid device ordinal,
    /// size or pointer, an unknown or misused graph pool, a bad configuration.
    InvalidArgument,
    /// The driver (or the device model) failed a call, or the device could
    /// not be opened.
    Driver,
    /// The device's allocator failed (a panic inside it): every later call on
    /// that device fails with this kind, naming the original panic.
    Failed,
    /// The backend or the process cannot do this at all: a policy without
    /// the feature, a device call the backend lacks, a forked child.
    Unsupported,
}

impl ErrorKind {
    /// Every kind, in code order.
    pub const ALL: [ErrorKind; 5] = [
        ErrorKind::OutOfMemory,
        ErrorKind::InvalidArgument,
        ErrorKind::Driver,
        ErrorKind::Failed,
        ErrorKind::Unsupported,
    ];

    /// The `VMMALLOC_E_*` code of this kind.
    pub const fn code(self) -> c_int {
        match self {
            ErrorKind::OutOfMemory => crate::VMMALLOC_E_OOM,
            ErrorKind::InvalidArgument => crate::VMMALLOC_E_INVALID,
            ErrorKind::Driver => crate::VMMALLOC_E_DRIVER,
            ErrorKind::Failed => crate::VMMALLOC_E_FAILED,
            ErrorKind::Unsupported => crate::VMMALLOC_E_UNSUPPORTED,
        }
    }

    /// The kind of a `VMMALLOC_E_*` code (None for `VMMALLOC_OK` and unknown codes).
    pub fn from_code(code: c_int) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// The name the shim's exception puts before the message
    /// (`vmmalloc: <name>: <message>`; out of memory has its own prefix).
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::OutOfMemory => "out of memory",
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::Driver => "driver error",
            ErrorKind::Failed => "allocator failed",
            ErrorKind::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failure of a C ABI call: its kind and the message the caller reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }

    /// An [`ErrorKind::InvalidArgument`] error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// An [`ErrorKind::Unsupported`] error.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, message)
    }

    /// An [`ErrorKind::Driver`] error.
    pub fn driver(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Driver, message)
    }

    /// An [`ErrorKind::OutOfMemory`] error.
    pub fn out_of_memory(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::OutOfMemory, message)
    }

    /// An [`ErrorKind::Failed`] error.
    pub fn failed(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Failed, message)
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The `VMMALLOC_E_*` code of the kind.
    pub fn code(&self) -> c_int {
        self.kind.code()
    }

    /// Whether this is an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        self.kind == ErrorKind::OutOfMemory
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `prefix: ` before its message.
    pub fn context(self, prefix: impl fmt::Display) -> Self {
        Error {
            kind: self.kind,
            message: format!("{prefix}: {}", self.message),
        }
    }
}

/// The kind of a device error: out of memory (`CUDA_ERROR_OUT_OF_MEMORY`),
/// unsupported, or a driver error (a code, a broken rule, a device that
/// cannot be opened).
fn device_kind(e: &DeviceError) -> ErrorKind {
    match e {
        e if e.is_out_of_memory() => ErrorKind::OutOfMemory,
        DeviceError::Unsupported { .. } => ErrorKind::Unsupported,
        _ => ErrorKind::Driver,
    }
}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Self {
        let kind = match &e {
            AllocError::OutOfMemory(_) => ErrorKind::OutOfMemory,
            AllocError::InvalidPointer { .. }
            | AllocError::InvalidSize { .. }
            | AllocError::InvalidOption(_)
            | AllocError::Sleep(_)
            | AllocError::Ipc(_)
            | AllocError::Pool(_) => ErrorKind::InvalidArgument,
            AllocError::Device(d) => device_kind(d),
            AllocError::Failed(_) => ErrorKind::Failed,
        };
        Error::new(kind, e.to_string())
    }
}

impl From<DeviceError> for Error {
    fn from(e: DeviceError) -> Self {
        Error::new(device_kind(&e), e.to_string())
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::invalid(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_device::Call;

    #[test]
    fn kinds_and_codes_are_one_to_one() {
        let codes: Vec<c_int> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(codes, [1, 2, 3, 4, 5]);
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
        }
        assert_eq!(ErrorKind::from_code(crate::VMMALLOC_OK), None);
        assert_eq!(ErrorKind::from_code(6), None);
    }

    #[test]
    fn alloc_and_device_errors_get_their_kind() {
        let dev = |e: DeviceError| Error::from(AllocError::Device(e)).kind();
        assert_eq!(
            dev(DeviceError::OutOfMemory {
                call: Call::Create,
                requested: 1,
                free: 0,
                total: 0
            }),
            ErrorKind::OutOfMemory
        );
        assert_eq!(
            dev(DeviceError::Driver {
                call: Call::Map,
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
                detail: String::new()
            }),
            ErrorKind::Driver
        );
        assert_eq!(
            dev(DeviceError::Unsupported {
                call: Call::Unmap,
                what: "x".into()
            }),
            ErrorKind::Unsupported
        );
        assert_eq!(
            Error::from(AllocError::InvalidPointer { ptr: 8 }).kind(),
            ErrorKind::InvalidArgument
        );
        let e = Error::invalid("bad").context("call(1)");
        assert_eq!(
            (e.kind(), e.to_string()),
            (ErrorKind::InvalidArgument, "call(1): bad".into())
        );
    }
}
