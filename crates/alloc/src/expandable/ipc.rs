//! IPC export of live blocks (see [`crate::ipc`]): which chunks lie under a
//! block, and re-backing a block with equal handles. The marks that keep
//! exported chunks in place are the physical layer's (`physical/exports.rs`).
//!
//! Invariants (checked by `validate_ipc`): every exported block is
//! allocated and in the live map; `chunks` counts, for each chunk
//! `(segment, first page)`, the exported blocks lying on it, and every such
//! chunk is mapped.

use super::blocks::BlockState;
use super::physical::{equal_handle_pages, padded_handle_pages};
use super::Inner;
use crate::ipc::ExportedRange;
use crate::{AllocError, AllocResult};
use std::collections::HashMap;
use vmmalloc_device::{Device, Stream};

impl Inner {
    /// Refuses to pause segments `segs` while a block in them is exported.
    pub(super) fn check_not_exported(&self, segs: &[u32]) -> AllocResult<()> {
        if self.phys.exports().blocks().is_empty() {
            return Ok(());
        }
        let held: Vec<String> = self
            .phys
            .exports()
            .blocks()
            .iter()
            .filter(|(_, keys)| keys.iter().any(|(s, _)| segs.contains(s)))
            .map(|(a, _)| format!("{a:#x}"))
            .collect();
        if held.is_empty() {
            return Ok(());
        }
        Err(AllocError::Sleep(format!(
            "pause: allocation(s) {} are exported to other processes (IPC); their memory \
             cannot be given back while shared (nothing changed)",
            held.join(", ")
        )))
    }

    /// The chunks under live block `ptr`, marked exported (a second export
    /// of the same block answers the same chunks and marks nothing twice).
    pub(super) fn export_block(&mut self, ptr: u64) -> AllocResult<ExportedRange> {
        let refuse = |why: String| AllocError::Ipc(format!("cannot export {ptr:#x}: {why}"));
        let Some(&idx) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let b = &self.slab[idx];
        if b.state != BlockState::Allocated {
            return Err(AllocError::InvalidPointer { ptr });
        }
        let (seg_i, size) = (b.seg, b.size);
        let s = self.seg(seg_i);
        if self.owner_paused(s.owner) {
            return Err(refuse("its tag is paused (resume it first)".into()));
        }
        let span = s.page_span(&self.layout, ptr, size);
        let chunks = self.phys.export_range(seg_i, span, ptr).map_err(refuse)?;
        Ok(ExportedRange {
            ptr,
            size,
            chunks,
            rebacked_bytes: 0,
        })
    }

    /// [`Inner::export_block`] with chunks of one size: where the whole
    /// chunks under block `ptr` differ in size they are re-backed first with
    /// equal handles at the same addresses (`physical/reback.rs`), after a
    /// device synchronize. Refused, with the reason, while a graph is being
    /// captured, when a chunk of the run is already exported, or when a
    /// driver call fails (the chunks are then as they were).
    pub(super) fn export_block_equal<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        ptr: u64,
    ) -> AllocResult<ExportedRange> {
        let refuse = |why: String| {
            AllocError::Ipc(format!(
                "cannot export {ptr:#x} in PyTorch's expandable-segments format: {why}"
            ))
        };
        let Some(&idx) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let b = &self.slab[idx];
        if b.state != BlockState::Allocated {
            return Err(AllocError::InvalidPointer { ptr });
        }
        let (seg, size) = (b.seg, b.size);
        let s = self.seg(seg);
        if self.owner_paused(s.owner) {
            return Err(refuse("its tag is paused (resume it first)".into()));
        }
        let (p0, p1) = s.page_span(&self.layout, ptr, size);
        let t = self.phys.table(seg);
        let (Some((r0, _)), Some((l, lc))) = (t.chunk_at(p0), t.chunk_at(p1)) else {
            return Err(refuse("a page under it is not mapped".into()));
        };
        let r1 = l + lc.pages;
        if !t.all_mapped(r0, r1 - 1) {
            return Err(refuse("a page under it is not mapped".into()));
        }
        let first = t.chunk_at(r0).map_or(0, |(_, c)| c.pages);
        let host = t
            .chunks_within(r0, r1)
            .any(|(_, c)| self.phys.is_host(c.handle));
        // Equal chunks on the device export as they are; spilled ones are
        // re-backed too (onto the device) when there is room.
        if !host && self.phys.is_equal_run(seg, r0, r1, first) {
            return self.export_block(ptr);
        }
        let held: Vec<(u64, u64)> = t.chunks_within(r0, r1).map(|(f, c)| (f, c.pages)).collect();
        if let Some((f, _)) = held
            .iter()
            .find(|&&(f, _)| self.phys.exports().pins(seg, f))
        {
            return Err(refuse(format!(
                "its chunks differ in size ({:?} MiB) and the chunk at {:#x} is already exported \
                 (in vmmalloc's format, or under another exported allocation), so it cannot be \
                 re-backed with equal handles",
                held.iter()
                    .map(|&(_, n)| (n * self.layout.page) >> 20)
                    .collect::<Vec<_>>(),
                self.phys.page_addr(seg, *f)
            )));
        }
        if let Some(&(f, _)) = held.iter().find(|&&(f, _)| self.phys.is_unready(seg, f)) {
            return Err(refuse(format!(
                "the chunk at {:#x} under it is not accessible",
                self.phys.page_addr(seg, f)
            )));
        }
        // A synchronize during a graph capture would invalidate it (as in
        // unpinning, `unpin.rs`): every stream served, and the legacy
        // default stream, are asked.
        let mut streams: Vec<_> = self.streams.iter().map(|e| e.stream).collect();
        if !streams.contains(&Stream::DEFAULT) {
            streams.push(Stream::DEFAULT);
        }
        if streams
            .iter()
            .any(|&st| dev.is_capturing(st).unwrap_or(true))
        {
            return Err(refuse(
                "its chunks differ in size and re-backing them needs a device synchronize, \
                 which a CUDA graph being captured forbids (export it after the capture)"
                    .into(),
            ));
        }
        // The copies must see every write queued before the export, on
        // every stream.
        self.stats.ipc_rebacks += 1;
        self.phys
            .sync_device(dev)
            .map_err(|e| refuse(format!("synchronizing the device: {e}")))?;
        for e in &mut self.streams {
            e.synced_at = self.tick;
        }
        let pages = r1 - r0;
        let max = self.layout.max_chunk_pages;
        // The handle size: the largest divisor of the run's pages within the
        // largest chunk (no memory added); where that needs more than twice
        // the fewest handles (a run of a prime number of pages would take
        // one 2 MiB handle per page, one descriptor each), the fewest
        // handles, the run extended at its end by under one page per
        // handle, where those pages are unmapped.
        let exact = equal_handle_pages(pages, max);
        let (padded, pad) = padded_handle_pages(pages, max);
        let t = self.phys.table(seg);
        let pad_fits = pad > 0 && r1 + pad <= t.len() && t.mapped_count(r1, r1 + pad) == 0;
        let mut plan = if pages / exact > 2 * pages.div_ceil(max) && pad_fits {
            (padded, pad)
        } else {
            (exact, 0)
        };
        // Room beside the run for the new handles: whole free chunks
        // elsewhere go to the pool first (reclaim, as the ladder's rung 4).
        let want = pages + plan.1;
        let have = self.phys.room(self.phys.device_pages()) + self.phys.pool().pages();
        if have < want {
            self.reclaim(dev, want - have, Some((seg, r0, r1 + plan.1 - 1)));
        }
        let mut r = self.with_seg_pages(seg, |phys| {
            phys.reback_equal(dev, seg, (r0, r1), plan.0, plan.1)
        });
        if plan.1 > 0 && r.as_ref().is_err_and(|e| e.is_out_of_memory()) {
            plan = (exact, 0);
            r = self.with_seg_pages(seg, |phys| phys.reback_equal(dev, seg, (r0, r1), exact, 0));
        }
        r.map_err(|e| {
            refuse(format!(
                "re-backing its {} MiB of chunks with equal handles of {} MiB: {e} (the \
                 chunks are as they were)",
                (pages * self.layout.page) >> 20,
                (plan.0 * self.layout.page) >> 20
            ))
        })?;
        self.stats.ipc_rebacked_bytes += pages * self.layout.page;
        let mut r = self.export_block(ptr)?;
        r.rebacked_bytes = pages * self.layout.page;
        Ok(r)
    }

    /// Ends the export of live block `ptr`.
    pub(super) fn unexport_block(&mut self, ptr: u64) -> AllocResult<()> {
        if self.phys.exports_mut().forget(ptr) {
            Ok(())
        } else {
            Err(AllocError::Ipc(format!("{ptr:#x} is not exported")))
        }
    }

    /// Checks the export marks against the blocks and chunks.
    pub(super) fn validate_ipc(&self) -> Result<(), String> {
        let mut recount: HashMap<(u32, u64), u32> = HashMap::new();
        for (&addr, keys) in self.phys.exports().blocks() {
            let Some(&idx) = self.live.get(&addr) else {
                return Err(format!("exported block {addr:#x} is not live"));
            };
            if self.slab[idx].state != BlockState::Allocated {
                return Err(format!("exported block {addr:#x} is not allocated"));
            }
            for &(s, f) in keys {
                let live = self.segments.get(s as usize).is_some_and(|x| x.is_some());
                if !live || !self.table(s).has_chunk_at(f) {
                    return Err(format!(
                        "exported block {addr:#x}: chunk at page {f} of segment {s} is not mapped"
                    ));
                }
                *recount.entry((s, f)).or_default() += 1;
            }
        }
        if &recount != self.phys.exports().chunks() {
            return Err(format!(
                "exported chunk counts {:?} != recount {recount:?}",
                self.phys.exports().chunks()
            ));
        }
        Ok(())
    }
}
