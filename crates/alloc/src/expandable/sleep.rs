//! Sleep and wake: pause a tag (its physical memory goes back to the driver,
//! its virtual addresses stay reserved, optionally its live bytes are copied
//! to host memory) and resume it (new physical memory mapped at the same
//! addresses, backups copied back).
//!
//! # Why this is sound
//!
//! Every stream entry ([`super::segment::StreamEntry`]) belongs to one tag:
//! blocks of tag `T` on stream `S` live in the segments of the entry
//! `(S, T)`, and a segment's chunks back only its own blocks. So a tag's
//! blocks never share a physical handle with another tag's: unmapping every
//! chunk of a tag's segments touches no other tag. Pooled (unmapped) chunks
//! carry no tag; pause releases the whole pool, since the caller asked for
//! memory back.
//!
//! # Pause (`cuMemUnmap` / `cuMemRelease` rules: cuda.h, DESIGN.md "Driver rules")
//!
//! 1. Refuse if any stream the allocator knows is capturing a CUDA graph
//!    (synchronize, unmap and release are illegal then: CUDA Programming
//!    Guide, "Prohibited and Unhandled Operations" of stream capture).
//! 2. Wait for pending free events, then for each stream owning a segment of
//!    the tags and each stream recorded on a live block (stream syncs, never
//!    a device sync).
//! 3. With `backup`, copy every live block to host memory
//!    ([`Device::copy_from_device`]). Any failure so far changes nothing.
//! 4. Mark the tags paused; unmap every mapped run of their segments (their
//!    handles go to the pool) and release the whole pool. A failed unmap or
//!    release leaves that chunk mapped or pooled (accounted, not leaked); the
//!    tag stays paused and the error says so.
//!
//! # Resume
//!
//! Maps physical memory (pooled chunks, new handles, or a targeted reclaim of
//! other tags' free chunks) under the pages of the tag's live blocks only,
//! grants access, and copies the backups back. Any failure, out of memory
//! included, unmaps and releases what this resume mapped: the tag is paused
//! as before and its backups are kept.

use super::blocks::BlockState;
use super::ladder::Need;
use super::pages::Backing;
use super::tags;
use super::Inner;
use crate::{AllocError, AllocResult};
use rustc_hash::FxHashMap;
use vmmalloc_device::{Device, HostBuffer, Stream};

/// What a paused tag keeps.
#[derive(Debug, Default)]
struct Paused {
    /// Host copies of live blocks, by block address (empty without backup).
    backups: FxHashMap<u64, HostBuffer>,
    /// Sum of the backups' lengths.
    backup_bytes: u64,
}

/// The paused tags of one allocator.
#[derive(Debug, Default)]
pub(crate) struct SleepState {
    /// Paused tag id -> its backups.
    paused: FxHashMap<u32, Paused>,
    /// Host buffers of backups already restored, by length, kept for the
    /// next pause: faulting fresh host memory in costs far more than the
    /// copy (1–2 s per GiB on the test machine against 0.11 s for the copy;
    /// docs/expandable.md, "Sleep and wake"). Whatever the next pause does
    /// not reuse is dropped when it ends, so this holds at most the backups
    /// of the last resume.
    spare: FxHashMap<u64, Vec<HostBuffer>>,
}

/// A host buffer of `len` bytes for a backup: a spare one of that length,
/// else one from the device ([`Device::alloc_host_buffer`]: page-locked on
/// `cuda`, so the copies run by DMA), else ordinary heap memory (if the device
/// call fails, e.g. an injected fault). `None` when the host has no memory.
fn host_buffer<D: Device + ?Sized>(
    dev: &D,
    spare: &mut FxHashMap<u64, Vec<HostBuffer>>,
    len: u64,
) -> Option<HostBuffer> {
    if let Some(v) = spare.get_mut(&len).and_then(Vec::pop) {
        return Some(v);
    }
    dev.alloc_host_buffer(len)
        .ok()
        .or_else(|| HostBuffer::heap(len))
}

impl SleepState {
    /// Whether tag `id` is paused.
    #[inline]
    pub fn is_paused(&self, id: u32) -> bool {
        !self.paused.is_empty() && self.paused.contains_key(&id)
    }

    /// A host buffer of `len` bytes for a backup ([`host_buffer`]).
    pub fn host_buffer<D: Device + ?Sized>(&mut self, dev: &D, len: u64) -> Option<HostBuffer> {
        host_buffer(dev, &mut self.spare, len)
    }

    /// Drops the backup of a block freed at `ptr` (freeing a paused block is allowed).
    #[inline]
    pub fn forget(&mut self, ptr: u64) {
        if self.paused.is_empty() {
            return;
        }
        for p in self.paused.values_mut() {
            if let Some(b) = p.backups.remove(&ptr) {
                p.backup_bytes -= b.len() as u64;
                return;
            }
        }
    }
}

/// One tag's memory, for stats, `memory_summary` and "why is memory low".
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TagStats {
    /// The tag (`""` = the default tag).
    pub tag: String,
    /// Whether it is paused.
    pub paused: bool,
    /// Live (allocated) blocks.
    pub blocks: u64,
    /// Bytes of live blocks (paused or not).
    pub live_bytes: u64,
    /// Bytes of physical memory mapped in the tag's segments.
    pub mapped_bytes: u64,
    /// Bytes of live blocks whose memory is given back (0 unless paused).
    pub paused_bytes: u64,
    /// Bytes held in host backups (0 unless paused with backup).
    pub backup_bytes: u64,
}

/// Names for an error message: `'a', 'b'`.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Inner {
    /// The error for an allocation with paused tag `id`.
    pub(super) fn paused_error(&self, id: u32) -> AllocError {
        AllocError::Sleep(format!(
            "cannot allocate with tag '{}': it is paused (resume it first; allocating resumes nothing)",
            tags::tag_name(id)
        ))
    }

    /// Tag ids of `names`, for pausing (`pausing`: each must be awake) or
    /// resuming (each must be paused). No names: every non-default tag this
    /// allocator has memory for that is awake (pausing), or every paused tag
    /// (resuming). Errors name every offending tag.
    fn resolve_tags(&self, names: &[String], pausing: bool) -> AllocResult<Vec<u32>> {
        if names.is_empty() {
            let mut ids: Vec<u32> = if pausing {
                self.streams
                    .iter()
                    .filter(|e| e.pool == 0)
                    .map(|e| e.tag)
                    .filter(|&t| t != 0 && !self.sleep.is_paused(t))
                    .collect()
            } else {
                self.sleep.paused.keys().copied().collect()
            };
            ids.sort_unstable();
            ids.dedup();
            return Ok(ids);
        }
        let (mut unknown, mut wrong, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for n in names {
            tags::check_tag(n)?;
            match tags::tag_id(n) {
                None => unknown.push(n.clone()),
                Some(id) if self.sleep.is_paused(id) == pausing => wrong.push(n.clone()),
                Some(id) if !ids.contains(&id) => ids.push(id),
                Some(_) => {}
            }
        }
        let what = if pausing { "pause" } else { "resume" };
        if !unknown.is_empty() {
            return Err(AllocError::Sleep(format!(
                "{what}: unknown tag(s) {} (no allocation was ever tagged so; nothing changed)",
                quoted(&unknown)
            )));
        }
        if !wrong.is_empty() {
            let state = if pausing {
                "already paused"
            } else {
                "not paused"
            };
            return Err(AllocError::Sleep(format!(
                "{what}: tag(s) {} {state} (nothing changed)",
                quoted(&wrong)
            )));
        }
        Ok(ids)
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

    /// Live segments whose owner has one of the tags `ids`.
    fn tag_segments(&self, ids: &[u32]) -> Vec<u32> {
        (0..self.segments.len() as u32)
            .filter(|&i| match &self.segments[i as usize] {
                Some(s) => {
                    let e = &self.streams[s.owner as usize];
                    e.pool == 0 && ids.contains(&e.tag)
                }
                None => false,
            })
            .collect()
    }

    /// Blocks of segment `seg` in address order.
    fn seg_blocks(&self, seg: u32) -> Vec<u32> {
        let s = self.seg(seg);
        self.block_indices(s).collect()
    }

    /// Pauses the tags `names` (none: every awake non-default tag); returns
    /// the bytes released to the driver. See the module docs.
    pub(super) fn pause<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        names: &[String],
        backup: bool,
    ) -> AllocResult<u64> {
        let ids = self.resolve_tags(names, true)?;
        if ids.is_empty() {
            return Ok(0); // no tag to pause (no names, and no tagged memory)
        }
        let segs = self.tag_segments(&ids);
        self.check_not_exported(&segs)?;
        let mut extra: Vec<Stream> = Vec::new();
        for &s in &segs {
            for b in self.seg_blocks(s) {
                if let Some(v) = &self.slab[b].streams {
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
        // Stream safety: the owners of the segments, and every stream a live
        // block was recorded on.
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
        // Backups (nothing changed yet if one fails).
        let mut saved: FxHashMap<u32, Paused> =
            ids.iter().map(|&i| (i, Paused::default())).collect();
        if backup {
            for &s in &segs {
                let tag = self.streams[self.seg(s).owner as usize].tag;
                for b in self.seg_blocks(s) {
                    let blk = &self.slab[b];
                    if blk.state != BlockState::Allocated {
                        continue;
                    }
                    let (addr, size) = (blk.addr, blk.size);
                    let Some(mut buf) = host_buffer(dev, &mut self.sleep.spare, size) else {
                        return Err(AllocError::Sleep(format!(
                            "pause: no host memory for a {size}-byte backup of block {addr:#x} (nothing changed)"
                        )));
                    };
                    if let Err(e) = self.phys.copy_from_device(dev, addr, &mut buf[..]) {
                        self.sleep.spare.entry(size).or_default().push(buf);
                        return Err(e.into());
                    }
                    if let Some(p) = saved.get_mut(&tag) {
                        p.backup_bytes += size;
                        p.backups.insert(addr, buf);
                    }
                }
            }
        }
        // Commit: from here on the tags are paused. Spare buffers this pause
        // did not reuse are dropped.
        self.sleep.spare.clear();
        self.sleep.paused.extend(saved);
        let mut first_err = None;
        // Host-located (spilled) chunks under the tags go back too (spill.rs).
        let host_pages_before = self.phys.spilled_pages();
        for &s in &segs {
            let len = self.table(s).len();
            for (f, n) in self.table(s).mapped_runs(0, len) {
                // Chunk by chunk if the run fails: as much as possible goes back.
                if let Err(e) = self.unmap_chunks(dev, s, f, n, false) {
                    first_err.get_or_insert(e);
                }
            }
        }
        let before = self.phys.pool().pages();
        if let Err(e) = self.phys.release_pool(dev) {
            first_err.get_or_insert(e);
        }
        let mut released = (before - self.phys.pool().pages()) * self.layout.page;
        let host_pages = host_pages_before - self.phys.spilled_pages();
        let mut host_kept = false;
        if host_pages > 0 {
            // A chunk whose release fails stays listed for the next trim.
            self.phys.release_host_free(dev);
            host_kept = self.phys.has_host_free();
            if !host_kept {
                released += host_pages * self.layout.page;
            }
        }
        for s in segs {
            self.retire_segment_if_empty(s);
        }
        match first_err {
            None if host_kept => Err(AllocError::Sleep(format!(
                "pause: the tag(s) are paused and {released} bytes were released, but a host-located (spilled) chunk could not be released; the next empty_cache() retries"
            ))),
            None => Ok(released),
            Some(e) => Err(AllocError::Sleep(format!(
                "pause: the tag(s) are paused and {released} bytes were released, but some memory stayed mapped or pooled: {e}"
            ))),
        }
    }

    /// Resumes the paused tags `names` (none: every paused tag); returns the
    /// bytes mapped. See the module docs.
    pub(super) fn resume<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        names: &[String],
    ) -> AllocResult<u64> {
        let ids = self.resolve_tags(names, false)?;
        self.check_no_capture(dev, "resume", &[])?;
        let page = self.layout.page;
        let mut done: Vec<(u32, Vec<(u64, u64)>)> = Vec::new();
        let mut mapped = 0;
        for seg in self.tag_segments(&ids) {
            // Page spans of the live blocks, merged.
            let mut spans: Vec<(u64, u64)> = Vec::new();
            for b in self.seg_blocks(seg) {
                let blk = &self.slab[b];
                if blk.state == BlockState::Free {
                    continue;
                }
                let (p0, p1) = self.seg(seg).page_span(&self.layout, blk.addr, blk.size);
                match spans.last_mut() {
                    Some(l) if p0 <= l.1 + 1 => l.1 = l.1.max(p1),
                    _ => spans.push((p0, p1)),
                }
            }
            let mut runs = Vec::new();
            let mut fail = None;
            for &(p0, p1) in &spans {
                // Chunks left mapped by a failed pause or rollback may lack access.
                if let Err(e) = self.phys.fix_unready(dev, seg, p0, p1) {
                    fail = Some(AllocError::from(e));
                    break;
                }
                runs.extend(self.table(seg).unmapped_runs(p0, p1 + 1));
            }
            if fail.is_none() && !runs.is_empty() {
                let need: u64 = runs.iter().map(|r| r.1).sum();
                match self.acquire_and_map(dev, seg, &runs, Need::Now, None) {
                    Ok(()) => {
                        mapped += need * page;
                        done.push((seg, runs));
                    }
                    Err(Backing::Fail(e)) => fail = Some(e),
                    Err(Backing::Short(lacking)) => {
                        let stream = self.streams[self.seg(seg).owner as usize].stream;
                        let mut e = self.oom(dev, need * page, need * page, stream, lacking);
                        if let AllocError::OutOfMemory(r) = &mut e {
                            r.hint = format!(
                                "Resuming tag '{}' needs {} more bytes of physical memory; the tag stays paused. {}",
                                tags::tag_name(self.streams[self.seg(seg).owner as usize].tag),
                                lacking * page,
                                r.hint
                            );
                        }
                        fail = Some(e);
                    }
                }
            }
            if let Some(e) = fail {
                self.undo_resume(dev, &done);
                return Err(e);
            }
        }
        // Copy the backups back.
        for id in &ids {
            let Some(p) = self.sleep.paused.get(id) else {
                continue;
            };
            let mut err = None;
            for (&addr, buf) in &p.backups {
                if let Err(e) = self.phys.copy_to_device(dev, addr, &buf[..]) {
                    err = Some(e);
                    break;
                }
            }
            if let Some(e) = err {
                self.undo_resume(dev, &done);
                return Err(e.into());
            }
        }
        for id in ids {
            if let Some(p) = self.sleep.paused.remove(&id) {
                for (_, buf) in p.backups {
                    self.sleep
                        .spare
                        .entry(buf.len() as u64)
                        .or_default()
                        .push(buf);
                }
            }
        }
        Ok(mapped)
    }

    /// Rolls back a failed resume: unmaps the runs it mapped (chunk by chunk
    /// when a run fails; a chunk that cannot be unmapped stays mapped, which
    /// a paused tag allows) and releases the pool.
    fn undo_resume<D: Device + ?Sized>(&mut self, dev: &D, done: &[(u32, Vec<(u64, u64)>)]) {
        for (seg, runs) in done {
            for &(f, n) in runs {
                let _ = self.unmap_chunks(dev, *seg, f, n, false);
            }
        }
        // A chunk whose release fails stays pooled (accounted, not leaked).
        let _ = self.phys.release_pool(dev);
    }

    /// Per-tag figures, sorted by tag name.
    pub(super) fn tag_stats(&self) -> Vec<TagStats> {
        let page = self.layout.page;
        let mut by: FxHashMap<u32, TagStats> = FxHashMap::default();
        for id in self.sleep.paused.keys() {
            by.entry(*id).or_default();
        }
        for (i, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            if self.streams[s.owner as usize].pool != 0 {
                continue; // a private pool's memory (pool_stats) carries no tag
            }
            let id = self.streams[s.owner as usize].tag;
            let paused = self.sleep.is_paused(id);
            let t = by.entry(id).or_default();
            t.mapped_bytes += self.table(i as u32).mapped_pages() * page;
            for b in self.seg_blocks(i as u32) {
                let blk = &self.slab[b];
                if blk.state == BlockState::Allocated {
                    t.blocks += 1;
                    t.live_bytes += blk.size;
                    if paused {
                        t.paused_bytes += blk.size;
                    }
                }
            }
        }
        let mut out: Vec<TagStats> = by
            .into_iter()
            .map(|(id, mut t)| {
                t.tag = tags::tag_name(id);
                if let Some(p) = self.sleep.paused.get(&id) {
                    t.paused = true;
                    t.backup_bytes = p.backup_bytes;
                }
                t
            })
            .collect();
        out.sort_by(|a, b| a.tag.cmp(&b.tag));
        out
    }
}

/// A table of `stats` for `memory_summary` and "why is memory low?": per
/// tag, its state and bytes live, mapped, paused and backed up.
pub fn tag_summary(stats: &[TagStats]) -> String {
    use crate::summary::format_bytes as fb;
    let mut out = String::from(
        "Tags (sleep and wake: docs/expandable.md)\n  tag                  state    live          mapped        paused        host backup\n",
    );
    for t in stats {
        let name = if t.tag.is_empty() {
            "(default)"
        } else {
            &t.tag
        };
        out.push_str(&format!(
            "  {:<20} {:<8} {:<13} {:<13} {:<13} {}\n",
            name,
            if t.paused { "paused" } else { "awake" },
            fb(t.live_bytes),
            fb(t.mapped_bytes),
            fb(t.paused_bytes),
            fb(t.backup_bytes)
        ));
    }
    let paused: u64 = stats.iter().map(|t| t.paused_bytes).sum();
    if paused > 0 {
        out.push_str(&format!(
            "  {} of live blocks are paused: their physical memory is back with the driver and their addresses stay reserved; device access to them is an error until vmmalloc_resume.\n",
            fb(paused)
        ));
    }
    out
}
