//! Allocation errors and the out-of-memory report.

use std::fmt;
use vmmalloc_device::{DeviceError, Stream};

/// Result of an allocator call.
pub type AllocResult<T> = Result<T, AllocError>;

/// Memory held on one stream, for the out-of-memory report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamUsage {
    /// The stream.
    pub stream: Stream,
    /// Bytes allocated to live blocks.
    pub live: u64,
    /// Bytes mapped or reserved but free.
    pub cached: u64,
}

/// Everything a user needs to understand an out-of-memory error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomReport {
    /// The policy that failed.
    pub policy: &'static str,
    /// Device ordinal.
    pub device: u32,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes the request needed after rounding.
    pub rounded: u64,
    /// Device capacity (or the memory-fraction limit, if lower).
    pub capacity: u64,
    /// Free device memory as the driver reports it.
    pub device_free: u64,
    /// Bytes in live allocations.
    pub live: u64,
    /// Bytes mapped (reserved) but not allocated.
    pub cached: u64,
    /// Bytes of physical pages held in a pool, unmapped.
    pub pooled: u64,
    /// Largest contiguous free range in mapped memory.
    pub largest_free: u64,
    /// Per stream usage.
    pub per_stream: Vec<StreamUsage>,
    /// What would help.
    pub hint: String,
}

/// Formats a byte count the way PyTorch does ("1.50 GiB", "20.00 MiB").
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} bytes")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of memory ({}). Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. \
             Of the allocated memory {} is allocated by live tensors, {} is cached (mapped but free), {} is pooled \
             (unmapped physical pages), and the largest free range is {}.",
            self.policy,
            format_bytes(self.requested),
            self.device,
            format_bytes(self.capacity),
            format_bytes(self.device_free),
            format_bytes(self.live),
            format_bytes(self.cached),
            format_bytes(self.pooled),
            format_bytes(self.largest_free),
        )?;
        for s in &self.per_stream {
            write!(
                f,
                " [{}: live {}, cached {}]",
                s.stream,
                format_bytes(s.live),
                format_bytes(s.cached)
            )?;
        }
        if !self.hint.is_empty() {
            write!(f, " {}", self.hint)?;
        }
        Ok(())
    }
}

/// An allocator error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// Not enough memory, with the full picture.
    #[error("{0}")]
    OutOfMemory(Box<OomReport>),
    /// `free` or `record_stream` of a pointer that is not a live allocation.
    #[error("invalid pointer {ptr:#x}: not a live allocation of this allocator")]
    InvalidPointer {
        /// The pointer.
        ptr: u64,
    },
    /// A size the allocator cannot serve (zero, or beyond any device).
    #[error("invalid size {size}: {reason}")]
    InvalidSize {
        /// The size.
        size: u64,
        /// Why.
        reason: String,
    },
    /// A bad option.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A device call failed in a way that is not out-of-memory.
    #[error("device error: {0}")]
    Device(#[from] DeviceError),
    /// Sleep and wake (tags, pause, resume): a bad tag, a tag in the wrong
    /// state, a policy that cannot sleep, or a pause/resume that failed.
    #[error("{0}")]
    Sleep(String),
}

impl AllocError {
    /// Whether this is an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_))
    }
}
