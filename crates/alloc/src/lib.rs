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
pub mod expandable;
pub mod growable;
pub mod ipc;
pub mod native;
pub mod pools;
pub mod pressure;
pub mod share;
#[doc(hidden)]
pub mod torch_es;

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
/// expandable segments (see [`Allocator::take_mappings`]).
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

    /// Sleep: gives the physical memory of the blocks tagged `tags` (none:
    /// every non-default tag) back to the driver, keeping their addresses;
    /// with `backup` their bytes are copied to host memory first. Returns the
    /// bytes released. Only `expandable` can sleep; the others return
    /// [`AllocError::Sleep`]. See docs/expandable.md, "Sleep and wake".
    fn pause(&self, tags: &[String], backup: bool) -> AllocResult<u64> {
        let _ = (tags, backup);
        Err(AllocError::Sleep(format!(
            "the {} policy cannot pause memory (only expandable can)",
            self.name()
        )))
    }

    /// Wake: maps physical memory again under the paused blocks of `tags`
    /// (none: every paused tag) at the same addresses and restores their
    /// backups; on failure the tags stay paused. Returns the bytes mapped.
    fn resume(&self, tags: &[String]) -> AllocResult<u64> {
        let _ = tags;
        Err(AllocError::Sleep(format!(
            "the {} policy cannot resume memory (only expandable can)",
            self.name()
        )))
    }

    /// Memory per tag (empty for policies without tags).
    fn tag_stats(&self) -> Vec<TagStats> {
        Vec::new()
    }

    /// Growable regions ([`growable::Growable`]), if the policy offers them
    /// (only `expandable` does); `None` by default.
    fn as_growable(&self) -> Option<&dyn growable::Growable> {
        None
    }

    /// IPC: the physical chunks under live allocation `ptr` (its exact
    /// pointer), marked exported so that they are never unmapped, remapped,
    /// unpinned, spilled or paused until [`Allocator::unexport`] or `free`
    /// (see [`ipc`]). Only `expandable` can export; the others return
    /// [`AllocError::Ipc`].
    fn export(&self, ptr: u64) -> AllocResult<ipc::ExportedRange> {
        Err(AllocError::Ipc(format!(
            "cannot export {ptr:#x}: the {} policy cannot share memory with other processes \
             (only expandable can)",
            self.name()
        )))
    }

    /// IPC in PyTorch's expandable-segments format: as
    /// [`Allocator::export`], but every chunk under `ptr` has one size
    /// (PyTorch's consumer maps handle *i* at `base + i * segment_size`).
    /// Where they do not, the chunks are re-backed once with equal handles
    /// at the same addresses, the bytes copied (see [`ipc`]).
    fn export_equal(&self, ptr: u64) -> AllocResult<ipc::ExportedRange> {
        self.export(ptr)
    }

    /// Ends the export of live allocation `ptr` (freeing it does too).
    fn unexport(&self, ptr: u64) -> AllocResult<()> {
        Err(AllocError::Ipc(format!(
            "{ptr:#x} is not exported (the {} policy cannot export)",
            self.name()
        )))
    }

    /// Starts (`true`) or stops keeping the [`MappingChange`]s of this
    /// allocator's physical layer, for [`Allocator::take_mappings`]. Returns
    /// whether the policy reports them (only `expandable`, whose physical
    /// layer sees every map and unmap; the others return false and a
    /// caller compares snapshots instead).
    fn log_mappings(&self, on: bool) -> bool {
        let _ = on;
        false
    }

    /// Appends to `out` the mappings made and undone since the last call,
    /// oldest first, while [`Allocator::log_mappings`] is on. A chunk that
    /// moved (unpinning, spill) appears as an unmap and a map of the same
    /// range.
    fn take_mappings(&self, out: &mut Vec<MappingChange>) {
        let _ = out;
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
    fn pause(&self, tags: &[String], backup: bool) -> AllocResult<u64> {
        (**self).pause(tags, backup)
    }
    fn resume(&self, tags: &[String]) -> AllocResult<u64> {
        (**self).resume(tags)
    }
    fn tag_stats(&self) -> Vec<TagStats> {
        (**self).tag_stats()
    }
    fn as_growable(&self) -> Option<&dyn growable::Growable> {
        (**self).as_growable()
    }
    fn export(&self, ptr: u64) -> AllocResult<ipc::ExportedRange> {
        (**self).export(ptr)
    }
    fn export_equal(&self, ptr: u64) -> AllocResult<ipc::ExportedRange> {
        (**self).export_equal(ptr)
    }
    fn unexport(&self, ptr: u64) -> AllocResult<()> {
        (**self).unexport(ptr)
    }
    fn pools(&self) -> Option<&dyn pools::PrivatePools> {
        (**self).pools()
    }
    fn log_mappings(&self, on: bool) -> bool {
        (**self).log_mappings(on)
    }
    fn take_mappings(&self, out: &mut Vec<MappingChange>) {
        (**self).take_mappings(out)
    }
}
