//! Typed device errors, mapped to the CUDA driver's result codes.

use crate::Call;
use std::fmt;

/// A driver rule that a call broke (see DESIGN.md, "Driver rules the models enforce").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// A size, address or alignment is not a multiple of the granularity.
    Misaligned,
    /// A size of zero where the driver requires a positive size.
    ZeroSize,
    /// `cuMemMap` must map a whole handle: offset 0, size = the handle's size.
    PartialHandleMap,
    /// The range is not inside one reservation.
    OutsideReservation,
    /// `cuMemMap` over addresses that are already mapped.
    AlreadyMapped,
    /// The range (or part of it) is not mapped.
    NotMapped,
    /// `cuMemUnmap` must cover whole mappings, never part of one.
    PartialUnmap,
    /// The handle is unknown or already released.
    UnknownHandle,
    /// `cuMemAddressFree` takes exactly a range `cuMemAddressReserve` returned.
    NotAReservation,
    /// `cuMemAddressFree` of a range that still has mappings.
    ReservationInUse,
    /// The memory is not accessible (never mapped, or mapped without `cuMemSetAccess`).
    NotAccessible,
    /// Pages still used by queued work on a stream may not be unmapped.
    InUseByStream,
    /// A plain-allocation pointer that `cuMemAlloc` did not return (or was freed).
    UnknownPointer,
    /// The stream is unknown.
    UnknownStream,
    /// The event is unknown or destroyed.
    UnknownEvent,
    /// A file descriptor that does not name an exported handle.
    UnknownShareableHandle,
    /// The call is not permitted while the stream (or, for a device-wide
    /// call, some stream in a global-mode capture) is being captured into a
    /// CUDA graph; the capture is invalidated.
    CaptureUnsupported,
    /// The capture was invalidated by an earlier forbidden call.
    CaptureInvalidated,
    /// Ending a capture that was not begun on this stream.
    NotCapturing,
    /// Querying or waiting on an event last recorded in a capturing stream.
    CapturedEvent,
}

impl Rule {
    /// The CUDA result code the real driver returns for this violation.
    pub fn cuda_code(self) -> u32 {
        match self {
            // CUDA_ERROR_ILLEGAL_ADDRESS: the kernel (or copy) faults.
            Rule::NotAccessible | Rule::InUseByStream => 700,
            // CUDA_ERROR_INVALID_HANDLE.
            Rule::UnknownStream | Rule::UnknownEvent => 400,
            // cuda.h: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, _INVALIDATED,
            // _UNMATCHED and CUDA_ERROR_CAPTURED_EVENT.
            Rule::CaptureUnsupported => 900,
            Rule::CaptureInvalidated => 901,
            Rule::NotCapturing => 903,
            Rule::CapturedEvent => 907,
            // CUDA_ERROR_INVALID_VALUE for everything else.
            _ => 1,
        }
    }

    /// Short description of the rule.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::Misaligned => "not a multiple of the allocation granularity",
            Rule::ZeroSize => "size must be positive",
            Rule::PartialHandleMap => {
                "a mapping must cover a whole handle (offset 0, its full size)"
            }
            Rule::OutsideReservation => "range is not inside one reservation",
            Rule::AlreadyMapped => "range is already mapped",
            Rule::NotMapped => "range is not fully mapped",
            Rule::PartialUnmap => "unmap must cover whole mappings",
            Rule::UnknownHandle => "unknown or released physical handle",
            Rule::NotAReservation => "not a range returned by reserve",
            Rule::ReservationInUse => "reservation still has mappings",
            Rule::NotAccessible => "memory is not mapped and accessible",
            Rule::InUseByStream => "pages are still used by queued work on a stream",
            Rule::UnknownPointer => "pointer was not returned by alloc (or was freed)",
            Rule::UnknownStream => "unknown stream",
            Rule::UnknownEvent => "unknown or destroyed event",
            Rule::UnknownShareableHandle => "file descriptor does not name an exported handle",
            Rule::CaptureUnsupported => "operation not permitted when stream is capturing",
            Rule::CaptureInvalidated => {
                "the capture sequence has been invalidated due to a previous error"
            }
            Rule::NotCapturing => "capture was not initiated in this stream",
            Rule::CapturedEvent => {
                "operation not permitted on an event last recorded in a capturing stream"
            }
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// An error from a device call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceError {
    /// Physical memory (or address space) ran out. Recoverable: free something and retry.
    #[error("{call}: out of memory: requested {requested} bytes, {free} of {total} bytes free")]
    OutOfMemory {
        /// The call that failed.
        call: Call,
        /// Bytes requested.
        requested: u64,
        /// Bytes free at the time.
        free: u64,
        /// Device capacity.
        total: u64,
    },
    /// The call broke a driver rule (misuse); the models return this where the
    /// driver returns an error code.
    #[error("{call}: {rule}: {detail}")]
    Rule {
        /// The call that failed.
        call: Call,
        /// The rule broken.
        rule: Rule,
        /// What exactly was wrong.
        detail: String,
    },
    /// The real driver (or an injected fault) returned an error code.
    #[error("{call}: {name} ({code}){}", if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Driver {
        /// The call that failed.
        call: Call,
        /// The raw `CUresult`.
        code: u32,
        /// `cuGetErrorName` of the code, where known.
        name: String,
        /// Extra context.
        detail: String,
    },
    /// The backend cannot do this at all (e.g. reading bytes on `sim`).
    #[error("{call}: not supported: {what}")]
    Unsupported {
        /// The call that failed.
        call: Call,
        /// What is missing.
        what: String,
    },
    /// The device could not be opened or used (library missing, no VMM support, ...).
    #[error("{0}")]
    Unavailable(String),
}

impl DeviceError {
    /// Builds a rule violation.
    pub fn rule(call: Call, rule: Rule, detail: impl Into<String>) -> Self {
        DeviceError::Rule {
            call,
            rule,
            detail: detail.into(),
        }
    }

    /// Whether this is an out-of-memory error (a recoverable condition).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            DeviceError::OutOfMemory { .. } => true,
            DeviceError::Driver { code, .. } => *code == 2,
            _ => false,
        }
    }

    /// The rule broken, if this is a rule violation.
    pub fn broken_rule(&self) -> Option<Rule> {
        match self {
            DeviceError::Rule { rule, .. } => Some(*rule),
            _ => None,
        }
    }

    /// The call that failed, if known.
    pub fn call(&self) -> Option<Call> {
        match self {
            DeviceError::OutOfMemory { call, .. }
            | DeviceError::Rule { call, .. }
            | DeviceError::Driver { call, .. }
            | DeviceError::Unsupported { call, .. } => Some(*call),
            DeviceError::Unavailable(_) => None,
        }
    }

    /// The `CUresult` the real driver returns for this error
    /// (2 = `CUDA_ERROR_OUT_OF_MEMORY`, 1 = `CUDA_ERROR_INVALID_VALUE`, ...).
    pub fn cuda_code(&self) -> u32 {
        match self {
            DeviceError::OutOfMemory { .. } => 2,
            DeviceError::Rule { rule, .. } => rule.cuda_code(),
            DeviceError::Driver { code, .. } => *code,
            DeviceError::Unsupported { .. } => 801,
            DeviceError::Unavailable(_) => 100,
        }
    }
}
