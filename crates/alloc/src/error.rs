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
    /// Device capacity: the driver's total (`cuMemGetInfo`), as in PyTorch's
    /// message, never the memory-fraction limit (that is `allowed`).
    pub capacity: u64,
    /// The memory-fraction limit (`set_per_process_memory_fraction`) when it
    /// is below the capacity: PyTorch's "<allowed> allowed;".
    pub allowed: Option<u64>,
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
    /// `caching` / `torch-es`: the cause in the caching allocator's own terms
    /// (segments, free blocks, rounding, what pins them); the message then
    /// uses PyTorch's wording.
    pub caching: Option<Box<CachingCause>>,
}

/// A live allocation that keeps free memory of its segment from being
/// released (PyTorch releases only whole free segments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    /// The allocation's address.
    pub ptr: u64,
    /// Its block size.
    pub size: u64,
    /// Start of its segment (or, for an expandable segment, its page).
    pub segment: u64,
    /// The size of that segment (or page).
    pub segment_size: u64,
    /// Free (cached) bytes in that segment (or page).
    pub segment_free: u64,
    /// Live blocks in the segment (this one, the largest, included).
    pub live_blocks: usize,
    /// Where it was allocated (`file:line name`, innermost first), where the
    /// caller knows (the replay fills it in from the trace's frames).
    pub frames: Option<String>,
}

/// Why PyTorch's caching allocator could not serve a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachingCause {
    /// The request after `round_size` (512 bytes, or the power-of-two divisions).
    pub round_size: u64,
    /// Segments held (each one `cudaMalloc`, or one expandable segment).
    pub segments: usize,
    /// What is released whole: `segment`, or `page` for expandable segments.
    pub unit: &'static str,
    /// Units (segments, or pages) with both live and free bytes.
    pub fragmented: usize,
    /// Free bytes inside the fragmented units.
    pub fragmented_free: u64,
    /// The live allocations that pin the most free memory (largest first).
    pub pins: Vec<Pin>,
}

impl CachingCause {
    /// How many pinning allocations the report lists.
    pub const MAX_PINS: usize = 5;
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

impl OomReport {
    /// Writes `<allowed> allowed; ` when a memory fraction caps the allocator
    /// (PyTorch: "... of which <free> is free. <allowed> allowed; Of the
    /// allocated memory ...", `DeviceCachingAllocator::malloc`).
    fn write_allowed(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.allowed {
            Some(a) => write!(f, "{} allowed; ", format_bytes(a)),
            None => Ok(()),
        }
    }

    /// Writes ` [STREAM: live X, cached Y]` for every stream.
    fn write_streams(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.per_stream {
            write!(
                f,
                " [{}: live {}, cached {}]",
                s.stream,
                format_bytes(s.live),
                format_bytes(s.cached)
            )?;
        }
        Ok(())
    }

    /// PyTorch's message (`DeviceCachingAllocator::malloc` in
    /// `c10/cuda/CUDACachingAllocator.cpp`, PyTorch 2.4+): "CUDA out of memory.
    /// Tried to allocate <alloc_size>. GPU <n> has a total capacity of <total>
    /// of which <free> is free. [<allowed> allowed; ]Of the allocated memory
    /// <allocated> is allocated by PyTorch, and <reserved - allocated> is
    /// reserved by PyTorch but unallocated. If reserved but unallocated memory
    /// is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to
    /// avoid fragmentation." (`alloc_size` is the segment size it asked the
    /// driver for, e.g. 20 MiB for a 2 MiB request), then the cause.
    fn fmt_caching(&self, f: &mut fmt::Formatter<'_>, c: &CachingCause) -> fmt::Result {
        write!(
            f,
            "CUDA out of memory ({}). Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            self.policy,
            format_bytes(self.rounded),
            self.device,
            format_bytes(self.capacity),
            format_bytes(self.device_free),
        )?;
        self.write_allowed(f)?;
        write!(
            f,
            "Of the allocated memory {} is allocated by PyTorch, and {} is reserved by PyTorch but unallocated.",
            format_bytes(self.live),
            format_bytes(self.cached),
        )?;
        if !self.hint.is_empty() {
            write!(f, " {}", self.hint)?;
        }
        // PyTorch's "Tried to allocate" names the segment size it asked the
        // driver for; the request itself may be smaller: say which is which.
        let rounding = if self.rounded > c.round_size {
            format!(
                " (the {} above is the segment asked of the driver for it, rounded up)",
                format_bytes(self.rounded)
            )
        } else {
            String::new()
        };
        let request = format!("{} request{rounding}", format_bytes(c.round_size));
        // Nothing could fit: live tensors plus the request exceed the device
        // (or the memory-fraction limit). Fragmentation is then not the cause,
        // and the text says so first, as `expandable`'s does.
        // The limit is the memory fraction where one is set, else the device.
        let limit = self.allowed.map_or(self.capacity, |a| a.min(self.capacity));
        if self.live + c.round_size > limit {
            write!(
                f,
                "\nWhy: live tensors hold {} and the request needs {} more{rounding}: together {}, more than the {} {}, \
                 so no allocator could serve it, however the free memory were arranged. Free tensors, or reduce \
                 the batch size or sequence length.",
                format_bytes(self.live),
                format_bytes(c.round_size),
                format_bytes(self.live + c.round_size),
                format_bytes(limit),
                if self.allowed.is_some() {
                    "allowed (memory fraction)"
                } else {
                    "device"
                },
            )?;
            if self.per_stream.len() > 1 {
                self.write_streams(f)?;
            }
            return Ok(());
        }
        write!(
            f,
            "\nWhy: live tensors plus the request fit in the {}, but {} is reserved across {} segment{}; ",
            format_bytes(limit),
            format_bytes(self.live + self.cached),
            c.segments,
            if c.segments == 1 { "" } else { "s" }
        )?;
        if self.cached == 0 {
            write!(f, "nothing is cached: the live tensors fill them.")?;
        } else {
            write!(
                f,
                "the {} cached lies in free blocks of which the largest is {}, too small for the {request}",
                format_bytes(self.cached),
                format_bytes(self.largest_free),
            )?;
            if c.fragmented > 0 {
                write!(
                    f,
                    "; {} of it is in {} {}{} that also hold{} live tensors, so it cannot be released to the driver",
                    format_bytes(c.fragmented_free),
                    c.fragmented,
                    c.unit,
                    if c.fragmented == 1 { "" } else { "s" },
                    if c.fragmented == 1 { "s" } else { "" }
                )?;
            }
            write!(f, ".")?;
        }
        // The 20 MiB rounding (`get_allocation_size`: requests of 1-10 MiB get
        // a kLargeBuffer = 20 MiB segment) is the reason where the device had
        // room for the request itself but not for the segment.
        if self.rounded > c.round_size
            && self.device_free >= c.round_size
            && self.device_free < self.rounded
        {
            write!(
                f,
                " Rounding is the reason: the device has {} free, enough for the {} requested, but the caching \
                 allocator asks the driver for a {} segment (requests between 1 MiB and 10 MiB get a 20 MiB segment, \
                 get_allocation_size in CUDACachingAllocator.cpp).",
                format_bytes(self.device_free),
                format_bytes(c.round_size),
                format_bytes(self.rounded),
            )?;
        }
        if !c.pins.is_empty() {
            write!(
                f,
                "\nPinning the fragmented {}s (largest free first):",
                c.unit
            )?;
            for p in &c.pins {
                write!(
                    f,
                    "\n  {} at {:#x}{}{} keeps {} free in its {} {} at {:#x}",
                    format_bytes(p.size),
                    p.ptr,
                    p.frames
                        .as_deref()
                        .map_or(String::new(), |fr| format!(" ({fr})")),
                    match p.live_blocks {
                        0 | 1 => String::new(),
                        n => format!(
                            " with {} more live block{}",
                            n - 1,
                            if n == 2 { "" } else { "s" }
                        ),
                    },
                    format_bytes(p.segment_free),
                    format_bytes(p.segment_size),
                    c.unit,
                    p.segment,
                )?;
            }
        }
        if self.per_stream.len() > 1 {
            self.write_streams(f)?;
        }
        Ok(())
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(c) = &self.caching {
            return self.fmt_caching(f, c);
        }
        if self.policy == "native" {
            // Nothing is cached or pooled: only the figures that apply.
            write!(
                f,
                "out of memory (native). Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
                format_bytes(self.requested),
                self.device,
                format_bytes(self.capacity),
                format_bytes(self.device_free),
            )?;
            self.write_allowed(f)?;
            write!(f, "Live tensors hold {}.", format_bytes(self.live))?;
            if !self.hint.is_empty() {
                write!(f, " {}", self.hint)?;
            }
            return Ok(());
        }
        write!(
            f,
            "out of memory ({}). Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            self.policy,
            format_bytes(self.requested),
            self.device,
            format_bytes(self.capacity),
            format_bytes(self.device_free),
        )?;
        self.write_allowed(f)?;
        write!(
            f,
            "Of the allocated memory {} is allocated by live tensors, {} is cached (mapped but free), {} is pooled \
             (unmapped physical pages), and the largest free range is {}.",
            format_bytes(self.live),
            format_bytes(self.cached),
            format_bytes(self.pooled),
            format_bytes(self.largest_free),
        )?;
        self.write_streams(f)?;
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
    /// The allocator failed: a panic while its state was being changed may
    /// have left that state half-updated, so it serves nothing any more.
    /// Every call after the panic returns this, naming the panic.
    #[error("the allocator failed and serves nothing any more ({0}); please report it")]
    Failed(String),
    /// IPC: an allocation that cannot be exported (see [`crate::ipc`]).
    #[error("{0}")]
    Ipc(String),
    /// Private pools (CUDA graphs, MemPools; see [`crate::pools`]): an
    /// unknown pool, a pool in the wrong state for the call, or a policy
    /// without pools.
    #[error("{0}")]
    Pool(String),
}

impl AllocError {
    /// Whether this is an out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, AllocError::OutOfMemory(_))
    }
}
