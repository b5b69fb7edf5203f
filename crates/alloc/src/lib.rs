//! Allocator policies over any [`Device`](vmmalloc_device::Device).
//!
//! Every policy implements [`Allocator`]:
//! - [`expandable`]: ours — one address arena per device, page pool, targeted reclaim;
//! - [`caching`]: a faithful replica of PyTorch's plain caching allocator;
//! - [`torch_es`]: a replica of PyTorch's `expandable_segments:True`;
//! - [`native`]: one device allocation per request.
//!
//! [`Policy`] names them and [`build`] creates one over a device.
//!
//! Reports over any policy: [`summary`] (PyTorch's `memory_summary()` table)
//! and [`pickle_snapshot`] (PyTorch's snapshot pickle).
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

mod error;
pub mod frames;
pub mod options;
pub mod pickle_snapshot;
mod policy;
mod size_classes;
pub mod snapshot;
mod sorted_chunks;
pub mod stats;
pub mod summary;

pub mod bench;
pub mod caching;
pub mod capabilities;
pub mod expandable;
pub mod growable;
pub mod ipc;
pub mod native;
pub mod pools;
pub mod pressure;
pub mod share;
#[doc(hidden)]
pub mod torch_es;

pub use capabilities::{
    export_of, sleep_of, tag_stats_of, Export, MappingLog, SegmentChange, SegmentFollow,
    SegmentSink, Sleep,
};
pub use error::{AllocError, AllocResult, CachingCause, OomReport, Pin, StreamUsage};
pub use expandable::tags::{is_known_tag, parse_tag_list, set_thread_tag, thread_tag, MAX_TAG_LEN};
pub use expandable::TagStats;
pub use frames::{Frame, Stack};
pub use policy::{
    build, parse_size, parse_size_unbounded, split_option, split_policy_specs, Policy,
    PolicyOptions, PolicySpec,
};
pub use snapshot::{BlockInfo, BlockState, SegmentInfo, Snapshot};
pub use stats::{Stat, StatType, Stats};
pub use vmmalloc_device::Stream;

/// A live allocation handed to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes requested by the caller.
    pub requested: u64,
    /// Bytes actually set aside (after the policy's rounding).
    pub size: u64,
    /// The stream the allocation was made on.
    pub stream: Stream,
}

/// Device memory mapped or unmapped under a policy's addresses: what
/// PyTorch's memory history records as `segment_map` / `segment_unmap` for
/// expandable segments (see [`MappingLog::take_mappings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingChange {
    /// Mapped (true) or unmapped (false).
    pub mapped: bool,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub bytes: u64,
    /// The stream of the segment (or growable region) the range lies in.
    pub stream: Stream,
}

/// What every allocation policy provides. Thread-safe: every method takes `&self`.
pub trait Allocator: Send + Sync {
    /// The policy's name (`expandable`, `caching`, `torch-es`, `native`).
    fn name(&self) -> &'static str;
    /// Allocates `size` bytes (> 0) for use on `stream`.
    fn malloc(&self, size: u64, stream: Stream) -> AllocResult<Allocation>;
    /// Frees an allocation made by [`Allocator::malloc`]. Unknown or already freed
    /// pointers are an error that changes no state.
    fn free(&self, ptr: u64) -> AllocResult<()>;
    /// Marks `ptr` as used by `stream` too: its memory is reused only after the
    /// work queued on `stream` at free time has completed.
    fn record_stream(&self, ptr: u64, stream: Stream) -> AllocResult<()>;
    /// Returns every cached byte it can to the device.
    fn empty_cache(&self) -> AllocResult<()>;
    /// Limits the memory this allocator may hold to `fraction` of the device's
    /// (`torch.cuda.set_per_process_memory_fraction`).
    fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()>;
    /// Counters in PyTorch's `memory_stats()` shape, plus ours.
    fn stats(&self) -> Stats;
    /// Resets peak values to the current ones.
    fn reset_peak_stats(&self);
    /// Segments and blocks with their state.
    fn snapshot(&self) -> Snapshot;
    /// Checks every invariant; returns a description of the first broken one.
    fn validate(&self) -> Result<(), String>;

    /// Why the allocator failed for good (a panic while its state was being
    /// changed: every later call returns [`AllocError::Failed`]), or None
    /// while it works. Only `expandable` detects this itself; the C ABI
    /// marks a device failed after any panic (crates/capi).
    fn failure(&self) -> Option<&str> {
        None
    }

    /// The sleep capability ([`Sleep`]: pause and resume tagged memory,
    /// memory per tag), if the policy has it (only `expandable` does);
    /// `None` by default. [`capabilities::sleep_of`] gives the error for
    /// a policy without it.
    fn as_sleep(&self) -> Option<&dyn Sleep> {
        None
    }

    /// Growable regions ([`growable::Growable`]), if the policy offers them
    /// (only `expandable` does); `None` by default.
    fn as_growable(&self) -> Option<&dyn growable::Growable> {
        None
    }

    /// The IPC export capability ([`Export`], see [`ipc`]), if the policy
    /// has it (only `expandable` does); `None` by default.
    /// [`capabilities::export_of`] gives the error for a policy without it.
    fn as_export(&self) -> Option<&dyn Export> {
        None
    }

    /// The mapping log ([`MappingLog`]: every map and unmap under the
    /// policy's addresses), if the policy keeps one (only `expandable`,
    /// whose physical layer sees every map and unmap); `None` by default,
    /// and a caller compares snapshots instead.
    fn as_mapping_log(&self) -> Option<&dyn MappingLog> {
        None
    }

    /// Following the registrable segments ([`SegmentFollow`]: NCCL
    /// user-buffer registration), if the policy can (only `expandable`,
    /// whose physical layer sees every map and unmap); `None` by default.
    fn as_segment_follow(&self) -> Option<&dyn SegmentFollow> {
        None
    }

    /// The private pools of CUDA graphs and `torch.cuda.MemPool`s
    /// ([`pools`]), if the policy has them (only `expandable` does);
    /// `None` by default.
    fn pools(&self) -> Option<&dyn pools::PrivatePools> {
        None
    }
}

/// An allocator shared by reference counting is one: every call goes to
/// the allocator inside (a member of a shared budget keeps its allocator
/// in an `Arc`, its poller holds a `Weak`, `share.rs`).
impl<A: Allocator + ?Sized> Allocator for std::sync::Arc<A> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn malloc(&self, size: u64, stream: Stream) -> AllocResult<Allocation> {
        (**self).malloc(size, stream)
    }
    fn free(&self, ptr: u64) -> AllocResult<()> {
        (**self).free(ptr)
    }
    fn record_stream(&self, ptr: u64, stream: Stream) -> AllocResult<()> {
        (**self).record_stream(ptr, stream)
    }
    fn empty_cache(&self) -> AllocResult<()> {
        (**self).empty_cache()
    }
    fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()> {
        (**self).set_memory_fraction(fraction)
    }
    fn stats(&self) -> Stats {
        (**self).stats()
    }
    fn reset_peak_stats(&self) {
        (**self).reset_peak_stats()
    }
    fn snapshot(&self) -> Snapshot {
        (**self).snapshot()
    }
    fn validate(&self) -> Result<(), String> {
        (**self).validate()
    }
    fn failure(&self) -> Option<&str> {
        (**self).failure()
    }
    fn as_sleep(&self) -> Option<&dyn Sleep> {
        (**self).as_sleep()
    }
    fn as_growable(&self) -> Option<&dyn growable::Growable> {
        (**self).as_growable()
    }
    fn as_export(&self) -> Option<&dyn Export> {
        (**self).as_export()
    }
    fn pools(&self) -> Option<&dyn pools::PrivatePools> {
        (**self).pools()
    }
    fn as_mapping_log(&self) -> Option<&dyn MappingLog> {
        (**self).as_mapping_log()
    }
    fn as_segment_follow(&self) -> Option<&dyn SegmentFollow> {
        (**self).as_segment_follow()
    }
}
