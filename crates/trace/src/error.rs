//! Errors of every trace source: files (snapshots, text traces), generators and inputs.
//!
//! A [`TraceError`] says *where* (file, line, device, event index) and *what*
//! ([`ErrorKind`]). Readers never panic on bad input; they return one of these.

use std::fmt;
use std::path::{Path, PathBuf};

/// Result of a trace operation.
pub type Result<T, E = TraceError> = std::result::Result<T, E>;

/// A trace could not be read, generated or checked.
///
/// Displays as `FILE:LINE: device D, event I: PROBLEM`, leaving out the parts
/// that are unknown (a workload has no file, a pickle has no lines).
#[derive(Debug)]
pub struct TraceError {
    /// The file being read, if any.
    pub path: Option<PathBuf>,
    /// 1-based line in a text trace.
    pub line: Option<usize>,
    /// Device index (position in the snapshot's `device_traces`, or the text
    /// trace's `device` section).
    pub device: Option<u32>,
    /// 0-based index of the offending event in that device's event list (for a
    /// snapshot: its position in `device_traces[device]`).
    pub index: Option<usize>,
    /// What went wrong (boxed to keep `Result<T, TraceError>` small).
    pub kind: Box<ErrorKind>,
}

/// What went wrong, without the location.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The file could not be read. The I/O error is the message, not a
    /// source, so a one-line error chain says it once.
    #[error("cannot read: {0}")]
    Io(std::io::Error),
    /// The file is empty (or only blank lines).
    #[error("empty file: neither a PyTorch snapshot nor a text trace")]
    Empty,
    /// The pickle stream is malformed (truncated, corrupt).
    #[error("corrupt or truncated pickle: {0}")]
    Pickle(String),
    /// The pickle asks the snapshot reader for more than its own budget allows
    /// (memory or work per input byte, or the size of a value kept whole; see
    /// docs/trace-format.md, "Limits"). Only a crafted or corrupt file does.
    #[error(
        "snapshot reader's {limit} limit hit at byte {at}: {bound} \
         (docs/trace-format.md, \"Limits\")"
    )]
    Limit {
        /// Which limit: `memory`, `work`, `whole-value size` or `whole-value depth`.
        limit: &'static str,
        /// The bound as it stood, in words.
        bound: String,
        /// Input bytes read when it was hit.
        at: u64,
    },
    /// The pickle library panicked on this input (reported, not propagated).
    #[error("corrupt pickle (the pickle reader panicked: {0})")]
    ReaderPanic(String),
    /// A well-formed pickle that is not a PyTorch memory snapshot.
    #[error("not a PyTorch memory snapshot: {0}")]
    Foreign(String),
    /// A snapshot field is missing or has the wrong type.
    #[error("unexpected snapshot layout: {0}")]
    Schema(String),
    /// An event's `action` (or a text line's keyword) is not one this reader knows.
    #[error("unknown action `{action}` (known: {known})")]
    UnknownAction {
        /// The action found.
        action: String,
        /// The actions this reader knows, comma-separated.
        known: String,
    },
    /// A free of an address that is not live (never allocated, or already freed).
    #[error("free of unknown address {addr:#x} (not live at this point)")]
    FreeOfUnknown {
        /// The address (or id) freed.
        addr: u64,
    },
    /// An allocation at an address that is still live.
    #[error("alloc at address {addr:#x}, which is still live")]
    DoubleAlloc {
        /// The address (or id) allocated twice.
        addr: u64,
    },
    /// Two pre-trace allocations at one address.
    #[error("two pre-trace allocations at address {addr:#x}")]
    DuplicatePre {
        /// The repeated address.
        addr: u64,
    },
    /// A size, address or stream below zero.
    #[error("negative {field}: {value}")]
    Negative {
        /// Which field.
        field: &'static str,
        /// The value found.
        value: i128,
    },
    /// A size beyond any device ([`crate::model::MAX_SIZE`]).
    #[error("absurd {field}: {value} bytes (more than 2^50)")]
    Absurd {
        /// Which field.
        field: &'static str,
        /// The value found.
        value: u128,
    },
    /// A resize of a growable region past the size it reserved, or of an
    /// allocation that is no region.
    #[error("resize of {addr:#x} to {size} bytes: {}", match max {
        Some(m) => format!("more than the {m} bytes its `reserve` set aside"),
        None => "it is no region (`reserve` makes one; `alloc` does not)".to_string(),
    })]
    BadResize {
        /// The address (or id) resized.
        addr: u64,
        /// The size asked for.
        size: u64,
        /// The region's reserved size, `None` if it is no region.
        max: Option<u64>,
    },
    /// An allocation of zero bytes (frameworks never record one).
    #[error("allocation of size 0")]
    ZeroSize,
    /// More allocations than fit a 32-bit id.
    #[error("more than 2^32 - 1 allocations on one device")]
    TooManyAllocs,
    /// A line of a text trace that does not parse.
    #[error("{0}")]
    Syntax(String),
    /// A text file without the `vmmalloc-trace 1` header.
    #[error("not a vmmalloc text trace: {0}")]
    BadHeader(String),
    /// A device section that appears twice.
    #[error("device {0} appears twice")]
    DuplicateDevice(u32),
    /// A file that is neither a pickle (protocol 2–5) nor a text trace.
    #[error("unknown format: neither a pickle (protocol 2-5, first byte 0x80) nor a text trace (first line `vmmalloc-trace 1`)")]
    UnknownFormat,
    /// A workload name that no generator has.
    #[error("unknown workload `{name}` (valid: {valid})")]
    UnknownWorkload {
        /// The name given.
        name: String,
        /// The valid names, comma-separated.
        valid: String,
    },
    /// A workload parameter that the generator does not have.
    #[error("{workload}: unknown parameter `{key}` (valid: {valid})")]
    UnknownParam {
        /// The workload.
        workload: String,
        /// The key given.
        key: String,
        /// The valid keys, comma-separated.
        valid: String,
    },
    /// A workload parameter with a value that does not parse or is out of range.
    #[error("{workload}: bad value `{value}` for `{key}`: {reason}")]
    BadParam {
        /// The workload.
        workload: String,
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// An input that is neither an existing file nor a workload name.
    #[error("`{input}` is neither a file nor a workload (workloads: {valid})")]
    UnknownInput {
        /// The input given.
        input: String,
        /// The valid workload names, comma-separated.
        valid: String,
    },
}

impl TraceError {
    /// An error with no location yet.
    pub fn new(kind: ErrorKind) -> Self {
        TraceError {
            path: None,
            line: None,
            device: None,
            index: None,
            kind: Box::new(kind),
        }
    }

    /// Sets the file (keeps a file already set).
    pub fn in_file(mut self, path: &Path) -> Self {
        if self.path.is_none() {
            self.path = Some(path.to_path_buf());
        }
        self
    }

    /// Sets the device (keeps a device already set).
    pub fn on_device(mut self, device: u32) -> Self {
        self.device.get_or_insert(device);
        self
    }

    /// Sets the event index (keeps an index already set).
    pub fn at_event(mut self, index: usize) -> Self {
        self.index.get_or_insert(index);
        self
    }

    /// Sets the text line (keeps a line already set).
    pub fn at_line(mut self, line: usize) -> Self {
        self.line.get_or_insert(line);
        self
    }
}

impl From<ErrorKind> for TraceError {
    fn from(kind: ErrorKind) -> Self {
        TraceError::new(kind)
    }
}

impl From<std::io::Error> for TraceError {
    fn from(e: std::io::Error) -> Self {
        TraceError::new(ErrorKind::Io(e))
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(p) = &self.path {
            write!(f, "{}", p.display())?;
            if let Some(l) = self.line {
                write!(f, ":{l}")?;
            }
            f.write_str(": ")?;
        } else if let Some(l) = self.line {
            write!(f, "line {l}: ")?;
        }
        match (self.device, self.index) {
            (Some(d), Some(i)) => write!(f, "device {d}, event {i}: ")?,
            (Some(d), None) => write!(f, "device {d}: ")?,
            (None, Some(i)) => write!(f, "event {i}: ")?,
            (None, None) => {}
        }
        write!(f, "{}", self.kind)
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.kind)
    }
}
