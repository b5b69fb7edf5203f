//! Pause and resume: the one mechanism for every owner of memory that
//! pauses — sleep tags (`sleep.rs`), private pools (`private_pools/pause.rs`)
//! and whatever comes next (e.g. NCCL deregistration hooks belong here).
//! Pausing gives the physical memory of some segments back to the driver
//! while their virtual addresses stay reserved, optionally after copying
//! their live blocks to host memory; resuming maps physical memory at the
//! same addresses and copies the backups back.
//!
//! # The steps (`cuMemUnmap` / `cuMemRelease` rules: cuda.h, DESIGN.md "Driver rules")
//!
//! An owner chooses its segments ([`Inner::owned_segments`]) and composes:
//!
//! 1. [`Inner::quiesce`]: refuse exported blocks and capturing streams
//!    (synchronize, unmap and release are illegal during capture: CUDA
//!    Programming Guide, "Prohibited and Unhandled Operations" of stream
//!    capture), then wait — for the streams the segments' owners and live
//!    blocks use ([`Wait::Streams`]), or for the whole device
//!    ([`Wait::Device`]: a graph replay may run on any stream).
//! 2. [`Inner::back_up`]: with a backup, copy each live block to host
//!    memory ([`Device::copy_from_device`]). A failure so far changes
//!    nothing.
//! 3. The owner marks itself paused (it keeps a [`Paused`]).
//! 4. [`Inner::give_back`]: unmap every mapped run (handles go to the chunk
//!    pool) and release the whole pool, since the caller asked for memory
//!    back. A failed unmap or release leaves that chunk mapped or pooled
//!    (accounted, not leaked); the owner stays paused and
//!    [`Owner::paused_but`] says so.
//!
//! Resuming: [`Inner::check_no_capture`], then [`Inner::map_back`] for each
//! segment's runs (pooled chunks, new handles or a targeted reclaim, and
//! access for every device the allocator grants), then
//! [`Paused::copy_back`]. Any failure, out of memory included, rolls back
//! with [`Inner::undo_map_back`]: the owner stays paused and keeps its
//! backups.
//!
//! # What the owners choose
//!
//! - Which pages come back: a tag maps the pages under its live blocks; a
//!   pool maps every page it mapped at the pause (kept in [`Paused::runs`]:
//!   a graph replays at the addresses it captured, free blocks included).
//! - How to wait: a tag waits for streams, a pool for the device.
//! - Host buffers ([`Owner::recycles`]): a tag's backups go to the spare
//!   buffers ([`Spares`]) when it resumes; a pool's are dropped.
//! - Spilled (host-located) chunks: a tag's pause releases them at once
//!   (`sleep.rs`); a pool's pause leaves them for the next trim.

use super::blocks::BlockState;
use super::ladder::{Backing, Need};
use super::physical::{Pages, Physical};
use super::segment::StreamEntry;
use super::tags;
use super::Inner;
use crate::{AllocError, AllocResult};
use rustc_hash::FxHashMap;
use vmmalloc_device::{Device, DeviceError, DeviceResult, HostBuffer, Stream};

/// Page runs `(first, count)` per segment.
pub(super) type SegRuns = Vec<(u32, Vec<(u64, u64)>)>;

/// What a paused owner keeps to be resumed.
#[derive(Debug, Default)]
pub(crate) struct Paused {
    /// Per segment, the page runs mapped at the pause (kept by owners that
    /// map them all back; empty for tags).
    pub runs: SegRuns,
    /// Host copies of live blocks, by block address (empty without backup).
    backups: FxHashMap<u64, HostBuffer>,
    /// Sum of the backups' lengths.
    backup_bytes: u64,
}

impl Paused {
    /// Bytes held in host backups.
    #[inline]
    pub fn backup_bytes(&self) -> u64 {
        self.backup_bytes
    }

    /// Drops the backup of a block freed at `ptr` (freeing a paused block
    /// is allowed); whether there was one.
    pub fn forget(&mut self, ptr: u64) -> bool {
        match self.backups.remove(&ptr) {
            Some(b) => {
                self.backup_bytes -= b.len() as u64;
                true
            }
            None => false,
        }
    }

    /// Copies the backups back to their blocks (`cuMemcpyHtoD` each).
    pub fn copy_back<D: Device + ?Sized>(&self, phys: &mut Physical, dev: &D) -> DeviceResult<()> {
        for (&addr, buf) in &self.backups {
            phys.copy_to_device(dev, addr, &buf[..])?;
        }
        Ok(())
    }
}

/// Host buffers of backups already restored, by length, kept for the next
/// pause: faulting fresh host memory in costs far more than the copy (1–2 s
/// per GiB on the test machine against 0.11 s for the copy;
/// docs/expandable.md, "Sleep and wake"). A pause by an owner that
/// [recycles](Owner::recycles) drops those it did not reuse when it
/// commits, so this holds at most the backups of the last resume.
#[derive(Debug, Default)]
pub(crate) struct Spares(FxHashMap<u64, Vec<HostBuffer>>);

impl Spares {
    /// A host buffer of `len` bytes for a backup: a spare one of that
    /// length, else one from the device ([`Device::alloc_host_buffer`]:
    /// page-locked on `cuda`, so the copies run by DMA), else ordinary heap
    /// memory (if the device call fails, e.g. an injected fault). `None`
    /// when the host has no memory.
    fn take<D: Device + ?Sized>(&mut self, dev: &D, len: u64) -> Option<HostBuffer> {
        if let Some(v) = self.0.get_mut(&len).and_then(Vec::pop) {
            return Some(v);
        }
        dev.alloc_host_buffer(len)
            .ok()
            .or_else(|| HostBuffer::heap(len))
    }

    /// Keeps `buf` for a later backup of its length.
    fn put(&mut self, buf: HostBuffer) {
        self.0.entry(buf.len() as u64).or_default().push(buf);
    }

    /// Keeps the backup buffers of a resumed owner.
    pub fn recycle(&mut self, p: Paused) {
        for (_, buf) in p.backups {
            self.put(buf);
        }
    }

    /// Drops every spare buffer.
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// Who pauses: how errors name it and what it does with host buffers.
#[derive(Debug, Clone, Copy)]
pub(super) enum Owner<'a> {
    /// Sleep tags (errors are [`AllocError::Sleep`]).
    Tags,
    /// The private pool of this name (errors are [`AllocError::Pool`]).
    Pool(&'a str),
}

impl Owner<'_> {
    /// The error of kind this owner's, saying `text`.
    fn error(self, text: String) -> AllocError {
        match self {
            Owner::Tags => AllocError::Sleep(text),
            Owner::Pool(_) => AllocError::Pool(text),
        }
    }

    /// How a pause's errors begin.
    fn pausing(self) -> String {
        match self {
            Owner::Tags => "pause".to_string(),
            Owner::Pool(name) => format!("pause of pool {name}"),
        }
    }

    /// Whether its backup buffers are kept for the next pause ([`Spares`]):
    /// a failed copy's buffer goes back to the spares, a pause drops the
    /// spares it did not reuse, a resume keeps the backups' buffers (tags).
    /// A pool takes spares but keeps none.
    pub fn recycles(self) -> bool {
        matches!(self, Owner::Tags)
    }

    /// The error of a pause that committed but gave back only `released`
    /// bytes: `but` says what went wrong.
    pub fn paused_but(self, released: u64, but: &str) -> AllocError {
        let who = match self {
            Owner::Tags => "the tag(s) are",
            Owner::Pool(_) => "the pool is",
        };
        self.error(format!(
            "{}: {who} paused and {released} bytes were released, but {but}",
            self.pausing()
        ))
    }
}

/// How a pause waits for the work on its segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// The pending free events, the streams owning mapped segments and every
    /// stream recorded on a live block (stream syncs, never a device sync).
    Streams,
    /// The whole device (a graph replay may be running on any stream).
    Device,
}

/// What [`Inner::give_back`] did.
#[derive(Debug)]
pub(super) struct GivenBack {
    /// Bytes of device memory released to the driver.
    pub bytes: u64,
    /// Host-located (spilled) pages unmapped, not yet released.
    pub host_pages: u64,
    /// The first unmap or release that failed.
    pub err: Option<DeviceError>,
}

/// A resume underway: the runs [`Inner::map_back`] mapped, for
/// [`Inner::undo_map_back`].
#[derive(Debug, Default)]
pub(super) struct MappedBack {
    /// Per segment, the runs mapped.
    done: SegRuns,
    /// Bytes mapped.
    pub bytes: u64,
}

/// The mapped runs of each segment of `segs` (what [`Inner::give_back`]
/// unmaps).
pub(super) fn mapped_runs(phys: &Physical, segs: &[u32]) -> SegRuns {
    segs.iter()
        .map(|&s| {
            let len = phys.table(s).len();
            (s, phys.table(s).mapped_runs(0, len))
        })
        .collect()
}

impl Inner {
    /// Live segments whose stream entry satisfies `owns`, in index order.
    pub(super) fn owned_segments(&self, owns: impl Fn(&StreamEntry) -> bool) -> Vec<u32> {
        (0..self.segments.len() as u32)
            .filter(|&i| {
                self.segments[i as usize]
                    .as_ref()
                    .is_some_and(|s| owns(&self.streams[s.owner as usize]))
            })
            .collect()
    }

    /// Refuses while any known stream (or one of `extra`) is capturing a CUDA graph.
    pub(super) fn check_no_capture<D: Device + ?Sized>(
        &self,
        dev: &D,
        what: &str,
        extra: &[Stream],
    ) -> AllocResult<()> {
        for s in self
            .streams
            .iter()
            .map(|e| e.stream)
            .chain(extra.iter().copied())
        {
            if dev.is_capturing(s)? {
                return Err(AllocError::Sleep(format!(
                    "{what}: stream {s} is capturing a CUDA graph; synchronize, unmap and release are illegal during capture (nothing changed)"
                )));
            }
        }
        Ok(())
    }

    /// Step 1 of a pause of `segs`: refuses exported blocks and capturing
    /// streams, then waits as `wait` says. Changes no block.
    pub(super) fn quiesce<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        segs: &[u32],
        wait: Wait,
    ) -> AllocResult<()> {
        self.check_not_exported(segs)?;
        if wait == Wait::Device {
            self.check_no_capture(dev, "pause", &[])?;
            self.synchronize_device(dev)?;
            return Ok(());
        }
        let mut extra: Vec<Stream> = Vec::new();
        for &s in segs {
            for b in self.blocks_in(self.seg(s)) {
                if let Some(v) = &b.streams {
                    extra.extend(v.iter().copied());
                }
            }
        }
        extra.sort_unstable();
        extra.dedup();
        self.check_no_capture(dev, "pause", &extra)?;
        if !self.events.pending.is_empty() {
            self.sync_pending(dev)?;
        }
        let mut owners: Vec<u32> = segs
            .iter()
            .filter(|&&s| self.table(s).mapped_pages() > 0)
            .map(|&s| self.seg(s).owner)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        for o in owners {
            self.wait_stream(dev, o)?;
        }
        for s in extra {
            self.phys.sync_stream(dev, s)?;
            self.stats.num_stream_syncs += 1;
        }
        Ok(())
    }

    /// Step 2: copies the live blocks of segment `seg` to host memory, into
    /// `into`. On failure `into` may hold some of them; nothing else changed.
    pub(super) fn back_up<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        into: &mut Paused,
        owner: Owner,
    ) -> AllocResult<()> {
        let blocks: Vec<(u64, u64)> = self
            .blocks_in(self.seg(seg))
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| (b.addr, b.size))
            .collect();
        for (addr, size) in blocks {
            let Some(mut buf) = self.spares.take(dev, size) else {
                return Err(owner.error(format!(
                    "{}: no host memory for a {size}-byte backup of block {addr:#x} (nothing changed)",
                    owner.pausing()
                )));
            };
            if let Err(e) = self.phys.copy_from_device(dev, addr, &mut buf[..]) {
                if owner.recycles() {
                    self.spares.put(buf);
                }
                return Err(e.into());
            }
            into.backup_bytes += size;
            into.backups.insert(addr, buf);
        }
        Ok(())
    }

    /// Step 4, once the owner is paused: unmaps `runs` (chunk by chunk where
    /// a run fails: as much as possible goes back) and releases the whole
    /// chunk pool.
    pub(super) fn give_back<D: Device + ?Sized>(&mut self, dev: &D, runs: &SegRuns) -> GivenBack {
        let mut err = None;
        let host_before = self.phys.spilled_pages();
        for (s, rs) in runs {
            for &(f, n) in rs {
                if let Err(e) = self.unmap_chunks(dev, *s, f, n, false) {
                    err.get_or_insert(e);
                }
            }
        }
        let before = self.phys.pool().pages();
        if let Err(e) = self.phys.release_pool(dev) {
            err.get_or_insert(e);
        }
        GivenBack {
            bytes: (before - self.phys.pool().pages()) * self.layout.page,
            host_pages: host_before - self.phys.spilled_pages(),
            err,
        }
    }

    /// Maps pages `runs` of segment `seg` again for a resume, taking chunks
    /// from the pool, the driver or a targeted reclaim ([`Need::Now`]);
    /// records them in `into`. Out of memory says which owner stays paused
    /// (a tag's name is its segment's).
    pub(super) fn map_back<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        into: &mut MappedBack,
        seg: u32,
        runs: Vec<(u64, u64)>,
        owner: Owner,
    ) -> AllocResult<()> {
        let page = self.layout.page;
        let need: u64 = runs.iter().map(|r| r.1).sum();
        match self.acquire_and_map(dev, seg, Pages::Runs(&runs), Need::Now, None) {
            Ok(()) => {
                into.bytes += need * page;
                into.done.push((seg, runs));
                Ok(())
            }
            Err(Backing::Fail(e)) => Err(e),
            Err(Backing::Short(lacking)) => {
                let entry = &self.streams[self.seg(seg).owner as usize];
                let (stream, tag) = (entry.stream, entry.tag);
                let mut e = self.oom(dev, need * page, need * page, stream, lacking);
                if let AllocError::OutOfMemory(r) = &mut e {
                    let (who, kind) = match owner {
                        Owner::Tags => (format!("tag '{}'", tags::tag_name(tag)), "tag"),
                        Owner::Pool(name) => (format!("pool {name}"), "pool"),
                    };
                    r.hint = format!(
                        "Resuming {who} needs {} more bytes of physical memory; the {kind} stays paused. {}",
                        lacking * page,
                        r.hint
                    );
                }
                Err(e)
            }
        }
    }

    /// Rolls back a failed resume: unmaps the runs it mapped (chunk by chunk
    /// when a run fails; a chunk that cannot be unmapped stays mapped, which
    /// a paused owner allows) and releases the pool (a chunk whose release
    /// fails stays pooled: accounted, not leaked).
    pub(super) fn undo_map_back<D: Device + ?Sized>(&mut self, dev: &D, mapped: &MappedBack) {
        for (seg, runs) in &mapped.done {
            for &(f, n) in runs {
                let _ = self.unmap_chunks(dev, *seg, f, n, false);
            }
        }
        let _ = self.phys.release_pool(dev);
    }
}
