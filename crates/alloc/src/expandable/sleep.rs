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
//! # Pause and resume (the one mechanism: `pause.rs`)
//!
//! Pause: refuse while a known stream or one a live block was recorded on is
//! capturing; wait for pending free events, the streams owning the tags'
//! mapped segments and every stream recorded on a live block (stream syncs,
//! never a device sync: [`Wait::Streams`]); with `backup`, copy the live
//! blocks to host memory; mark the tags paused, unmap their segments and
//! release the pool. Spilled (host-located) chunks under the tags are
//! released too, and emptied segments retired.
//!
//! Resume maps physical memory (pooled chunks, new handles, or a targeted
//! reclaim of other tags' free chunks) under the pages of the tag's live
//! blocks only, grants access, and copies the backups back. Any failure,
//! out of memory included, unmaps and releases what this resume mapped: the
//! tag is paused as before and its backups are kept; on success their host
//! buffers are kept for the next pause ([`super::pause::Spares`]).

use super::blocks::BlockState;
use super::pause::{mapped_runs, MappedBack, Owner, Paused, Wait};
use super::tags;
use super::Inner;
use crate::{AllocError, AllocResult};
use rustc_hash::FxHashMap;
use vmmalloc_device::Device;

/// The paused tags of one allocator.
#[derive(Debug, Default)]
pub(crate) struct SleepState {
    /// Paused tag id -> its backups.
    paused: FxHashMap<u32, Paused>,
}

impl SleepState {
    /// Whether tag `id` is paused.
    #[inline]
    pub fn is_paused(&self, id: u32) -> bool {
        !self.paused.is_empty() && self.paused.contains_key(&id)
    }

    /// Drops the backup of a block freed at `ptr` (freeing a paused block is allowed).
    #[inline]
    pub fn forget(&mut self, ptr: u64) {
        if self.paused.is_empty() {
            return;
        }
        for p in self.paused.values_mut() {
            if p.forget(ptr) {
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

    /// Live segments whose owner has one of the tags `ids`.
    fn tag_segments(&self, ids: &[u32]) -> Vec<u32> {
        self.owned_segments(|e| e.pool == 0 && ids.contains(&e.tag))
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
        self.quiesce(dev, &segs, Wait::Streams)?;
        // Backups (nothing changed yet if one fails).
        let mut saved: FxHashMap<u32, Paused> =
            ids.iter().map(|&i| (i, Paused::default())).collect();
        if backup {
            for &s in &segs {
                let tag = self.streams[self.seg(s).owner as usize].tag;
                if let Some(p) = saved.get_mut(&tag) {
                    self.back_up(dev, s, p, Owner::Tags)?;
                }
            }
        }
        // Commit: from here on the tags are paused. Spare buffers this pause
        // did not reuse are dropped.
        self.spares.clear();
        self.sleep.paused.extend(saved);
        let runs = mapped_runs(&self.phys, &segs);
        let given = self.give_back(dev, &runs);
        let mut released = given.bytes;
        // Host-located (spilled) chunks under the tags go back too (spill.rs).
        let mut host_kept = false;
        if given.host_pages > 0 {
            // A chunk whose release fails stays listed for the next trim.
            self.phys.release_host_free(dev);
            host_kept = self.phys.has_host_free();
            if !host_kept {
                released += given.host_pages * self.layout.page;
            }
        }
        for s in segs {
            self.retire_segment_if_empty(s);
        }
        match given.err {
            None if host_kept => Err(Owner::Tags.paused_but(
                released,
                "a host-located (spilled) chunk could not be released; the next empty_cache() retries",
            )),
            None => Ok(released),
            Some(e) => Err(Owner::Tags.paused_but(
                released,
                &format!("some memory stayed mapped or pooled: {e}"),
            )),
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
        let mut mapped = MappedBack::default();
        for seg in self.tag_segments(&ids) {
            // Page spans of the live blocks, merged.
            let mut spans: Vec<(u64, u64)> = Vec::new();
            for blk in self.blocks_in(self.seg(seg)) {
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
                fail = self
                    .map_back(dev, &mut mapped, seg, runs, Owner::Tags)
                    .err();
            }
            if let Some(e) = fail {
                self.undo_map_back(dev, &mapped);
                return Err(e);
            }
        }
        // Copy the backups back.
        for id in &ids {
            let Some(p) = self.sleep.paused.get(id) else {
                continue;
            };
            if let Err(e) = p.copy_back(&mut self.phys, dev) {
                self.undo_map_back(dev, &mapped);
                return Err(e.into());
            }
        }
        for id in ids {
            if let Some(p) = self.sleep.paused.remove(&id) {
                self.spares.recycle(p);
            }
        }
        Ok(mapped.bytes)
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
            for blk in self.blocks_in(s) {
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
                    t.backup_bytes = p.backup_bytes();
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
