//! What some policies can do beyond the [`Allocator`] core, each reached
//! through a capability accessor on [`Allocator`] (`as_sleep`,
//! `as_export`, `as_mapping_log`, like `as_growable` and `pools`) instead
//! of default method bodies that refuse: a policy offers a capability by
//! returning `Some(self)`, and a caller learns from one `None` that it has
//! none. Today only `expandable` offers these, because they need its
//! physical layer (addresses kept while the memory under them changes).
//!
//! [`sleep_of`] and [`export_of`] give the caller's error when a policy
//! lacks the capability, worded once here.

use crate::{ipc, AllocError, AllocResult, Allocator, MappingChange, Stream, TagStats};

/// Sleep and wake (docs/expandable.md, "Sleep and wake"): give the physical
/// memory of tagged blocks back to the driver keeping their addresses, and
/// map it again later.
pub trait Sleep: Send + Sync {
    /// Gives the physical memory of the blocks tagged `tags` (none: every
    /// non-default tag) back to the driver, keeping their addresses; with
    /// `backup` their bytes are copied to host memory first. Returns the
    /// bytes released.
    fn pause(&self, tags: &[String], backup: bool) -> AllocResult<u64>;

    /// Maps physical memory again under the paused blocks of `tags` (none:
    /// every paused tag) at the same addresses and restores their backups;
    /// on failure the tags stay paused. Returns the bytes mapped.
    fn resume(&self, tags: &[String]) -> AllocResult<u64>;

    /// Memory per tag.
    fn tag_stats(&self) -> Vec<TagStats>;
}

/// IPC export (see [`ipc`]): the physical chunks under a live allocation
/// handed to other processes.
pub trait Export: Send + Sync {
    /// The physical chunks under live allocation `ptr` (its exact pointer),
    /// marked exported so that they are never unmapped, remapped, unpinned,
    /// spilled or paused until [`Export::unexport`] or `free`.
    fn export(&self, ptr: u64) -> AllocResult<ipc::ExportedRange>;

    /// As [`Export::export`], in PyTorch's expandable-segments format: every
    /// chunk under `ptr` has one size (PyTorch's consumer maps handle *i* at
    /// `base + i * segment_size`). Where they do not, the chunks are
    /// re-backed once with equal handles at the same addresses, the bytes
    /// copied.
    fn export_equal(&self, ptr: u64) -> AllocResult<ipc::ExportedRange>;

    /// Ends the export of live allocation `ptr` (freeing it does too).
    fn unexport(&self, ptr: u64) -> AllocResult<()>;
}

/// The log of device memory mapped and unmapped under the policy's
/// addresses, kept by a policy whose physical layer sees every map and
/// unmap (what PyTorch's memory history records as `segment_map` /
/// `segment_unmap`). A policy without it is observed by comparing
/// snapshots instead.
pub trait MappingLog: Send + Sync {
    /// Starts (`true`) or stops keeping the [`MappingChange`]s for
    /// [`MappingLog::take_mappings`].
    fn log_mappings(&self, on: bool);

    /// Appends to `out` the mappings made and undone since the last call,
    /// oldest first, while the log is on. A chunk that moved (unpinning,
    /// spill) appears as an unmap and a map of the same range.
    fn take_mappings(&self, out: &mut Vec<MappingChange>);
}

/// `a`'s sleep capability, or the error to return for a policy without one
/// ([`AllocError::Sleep`], naming the policy).
pub fn sleep_of<A: Allocator + ?Sized>(a: &A) -> AllocResult<&dyn Sleep> {
    a.as_sleep().ok_or_else(|| {
        AllocError::Sleep(format!(
            "the {} policy cannot pause or resume memory (it has no sleep capability; \
             expandable has)",
            a.name()
        ))
    })
}

/// `a`'s export capability, or the error to return for a policy without one
/// ([`AllocError::Ipc`], naming the policy and the pointer).
pub fn export_of<A: Allocator + ?Sized>(a: &A, ptr: u64) -> AllocResult<&dyn Export> {
    a.as_export().ok_or_else(|| {
        AllocError::Ipc(format!(
            "cannot export {ptr:#x}: the {} policy cannot share memory with other processes \
             (it has no export capability; expandable has)",
            a.name()
        ))
    })
}

/// Memory per tag of `a` (empty for a policy without tags).
pub fn tag_stats_of<A: Allocator + ?Sized>(a: &A) -> Vec<TagStats> {
    a.as_sleep().map(Sleep::tag_stats).unwrap_or_default()
}

/// A range of device memory that became registrable (`registered`) or must
/// stop being registered (`!registered`) with a communication library (NCCL
/// user-buffer registration, `ncclCommRegister` / `ncclCommDeregister`):
/// what PyTorch's caching allocator reports as a `SEGMENT_ALLOC` /
/// `SEGMENT_FREE` trace entry, which ProcessGroupNCCL's register hook
/// registers and deregisters (`cacheAllocatorRegisterHook` /
/// `cacheAllocatorDeregisterHook`, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp).
///
/// The range is one segment as [`crate::Snapshot`]'s readers report it
/// (`pickle_snapshot`, the companion's `snapshot()`): a contiguous run of
/// mapped, accessible pages of one segment or growable region. A removal
/// names exactly a range that an earlier addition (or the snapshot taken
/// before following began) named, and comes before any byte of it is
/// unmapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentChange {
    /// Added (true: after it was mapped and made accessible) or removed
    /// (false: before any of it is unmapped).
    pub registered: bool,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub bytes: u64,
    /// The stream of the segment (or region) the range lies in.
    pub stream: Stream,
    /// The private pool the segment belongs to (`(0, 0)`: the default pool).
    pub pool: (u64, u64),
}

/// Who receives [`SegmentChange`]s: called under the allocator's lock, on
/// the thread whose call mapped or unmapped the memory. It must not call
/// back into the allocator.
pub trait SegmentSink: Send + Sync {
    /// One change.
    fn change(&self, c: &SegmentChange);
}

/// Following the registrable segments (NCCL user-buffer registration,
/// issue 43): a policy whose physical layer sees every map and unmap tells
/// a [`SegmentSink`] each run of mapped memory that appears, and each that
/// is about to change or go, so that registrations are never left over
/// memory that is unmapped or remapped (unpinning, spill, pause, IPC
/// re-backing all deregister first and register again after).
pub trait SegmentFollow: Send + Sync {
    /// Starts following (`Some`: changes go to the sink from now on; the
    /// runs mapped now are taken as already known, as a snapshot taken now
    /// reports them) or stops (`None`).
    fn follow_segments(&self, sink: Option<std::sync::Arc<dyn SegmentSink>>) -> AllocResult<()>;

    /// The runs known as registered now (empty when not following), by
    /// address.
    fn followed_segments(&self) -> Vec<SegmentChange>;

    /// Changes sent since following began: (added, removed).
    fn segment_changes(&self) -> (u64, u64);
}
