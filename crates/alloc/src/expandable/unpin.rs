//! Unpinning: giving back the free pages of chunks that live blocks hold
//! only in part.
//!
//! A chunk is one handle and one mapping, and the driver can neither unmap
//! nor release part of one (`cuMemUnmap` takes whole mappings; `cuMemMap`'s
//! `offset` "must be zero", cuda.h). So a chunk partly under live blocks
//! keeps its other pages (*pinned*) for as long as those blocks live. When
//! an allocation still lacks pages after the pool, new handles and a
//! targeted reclaim of whole free chunks, the allocator **unpins**: for each
//! such chunk (those whose live pages fit the room first, see
//! [`Inner::unpin`]), the live pages get exact chunks of
//! their own at the same addresses and the old chunk goes to the pool, so
//! its free pages are memory again and the caller's pointers stay valid.
//!
//! How one chunk moves (beside it on the device when the limit has room,
//! else through host memory in its place) is the physical layer's
//! (`physical/moves.rs`); this file decides when, and which chunks.
//!
//! Safety of the swap: nothing may touch those bytes while they move.
//! Blocks with another stream noted (`record_stream`) or a pending free are
//! never moved, no unpinning happens while any of the allocator's streams is
//! capturing a CUDA graph, and the device is synchronized once
//! (`cuCtxSynchronize`) before the first move of a round, which waits for
//! every stream, including streams the allocator never saw (collectives that
//! use a tensor without `record_stream`). No other host thread may launch
//! work on a live block's memory during the allocating call: by default
//! (`unpin:auto`) unpinning runs only while the allocator has no evidence
//! of another thread running alongside the caller (`threads.rs`);
//! `unpin:always` trusts the program, `unpin:false` turns unpinning off.
//! See docs/expandable.md, "Unpinning" and "Unpinning and threads".

use super::blocks::BlockState;
use super::physical::Move;
use super::reclaim::Exclude;
use super::threads::Refusal;
use super::{Inner, UnpinMode};
use vmmalloc_device::{Device, DeviceError, Stream};

/// Groups the page spans `(first, last)` of blocks (ascending by first
/// page, overlapping at most on shared pages) that meet pages `[f, end)`
/// into runs `(first, pages)`.
fn live_runs(spans: &[(u64, u64)], f: u64, end: u64) -> Vec<(u64, u64)> {
    let mut live: Vec<(u64, u64)> = Vec::new();
    for &(a, z) in spans {
        if z < f || a >= end {
            continue;
        }
        let (a, z) = (a.max(f), z.min(end - 1));
        match live.last_mut() {
            Some(r) if r.0 + r.1 >= a => r.1 = r.1.max(z + 1 - r.0),
            _ => live.push((a, z + 1 - a)),
        }
    }
    live
}

impl Inner {
    /// Chunks of device memory holding pages under movable live blocks and
    /// pages under free space only, except those overlapping `exclude`.
    fn pinned_chunks(&self, exclude: Exclude) -> Vec<Move> {
        let page = self.layout.page;
        let mut out = Vec::new();
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let table = self.table(si as u32);
            if table.is_empty() {
                continue;
            }
            // Page spans (first, last) of the blocks in use, and whether
            // each may move.
            let spans: Vec<(u64, u64, bool)> = self
                .blocks_in(s)
                .filter(|b| b.state != BlockState::Free)
                .map(|b| {
                    (
                        (b.addr - s.base) / page,
                        (b.end() - 1 - s.base) / page,
                        b.state == BlockState::Allocated && b.streams.is_none(),
                    )
                })
                .collect();
            let x = exclude.and_then(|(xs, x0, x1)| (xs == si as u32).then_some((x0, x1)));
            let mut j = 0;
            for (f, c) in table.chunks() {
                let end = f + c.pages;
                while j < spans.len() && spans[j].1 < f {
                    j += 1;
                }
                let k = spans[j..].partition_point(|sp| sp.0 < end) + j;
                let near = &spans[j..k];
                if near.is_empty() || near.iter().any(|sp| !sp.2) {
                    continue;
                }
                // Not the request's own pages, not host memory (spill), not
                // a chunk whose access may be missing (unready), not a chunk
                // shared with another process (IPC export).
                if x.is_some_and(|(x0, x1)| f <= x1 && end > x0)
                    || !self.phys.may_move(si as u32, f, c.handle)
                {
                    continue;
                }
                let pairs: Vec<(u64, u64)> = near.iter().map(|sp| (sp.0, sp.1)).collect();
                let live = live_runs(&pairs, f, end);
                let live_pages: u64 = live.iter().map(|r| r.1).sum();
                if live_pages < c.pages {
                    out.push(Move {
                        seg: si as u32,
                        first: f,
                        chunk: c,
                        live,
                        live_pages,
                    });
                }
            }
        }
        out
    }

    /// Free pages that unpinning could give back now, whether or not it is
    /// on (for the out-of-memory report).
    pub(super) fn unpinnable_pages(&self) -> u64 {
        self.pinned_chunks(None).iter().map(Move::free_pages).sum()
    }

    /// Whether segments of `stream` hold allocated or pending-free blocks.
    fn stream_has_live(&self, stream: Stream) -> bool {
        self.streams
            .iter()
            .filter(|e| e.stream == stream)
            .flat_map(|e| e.pools.iter().flat_map(|p| p.segments.iter()))
            .any(|&s| self.seg(s).active_blocks > 0)
    }

    /// Why unpinning may not run in the current call under `unpin:auto`
    /// (`threads.rs`); `None` under `always`, or when nothing speaks
    /// against it.
    pub(super) fn unpin_refusal(&self) -> Option<Refusal> {
        if self.unpin != UnpinMode::Auto {
            return None;
        }
        self.threads.refusal(|s| self.stream_has_live(s))
    }

    /// Unpins chunks (in the order explained inside) until at least `want` pages
    /// are free again (in the pool or released). Returns the pages freed;
    /// 0 when nothing could be unpinned (nothing changed then, apart from
    /// the synchronize).
    pub(super) fn unpin<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        want: u64,
        exclude: Exclude,
    ) -> u64 {
        if self.unpin == UnpinMode::Never || want == 0 {
            return 0;
        }
        let mut cands = self.pinned_chunks(exclude);
        if cands.is_empty() {
            return 0;
        }
        if self.unpin_refusal().is_some() {
            self.stats.unpin_refusals += 1;
            return 0;
        }
        // A synchronize during a graph capture would invalidate it (and
        // the bytes may belong to the graph): never then. Every stream this
        // allocator serves is asked, and the legacy default stream, which
        // answers "capturing" while any blocking stream of the context
        // captures (cuStreamIsCapturing, CUDA Driver API). A stream whose
        // state cannot be read counts as capturing.
        let mut streams: Vec<_> = self.streams.iter().map(|e| e.stream).collect();
        if !streams.contains(&Stream::DEFAULT) {
            streams.push(Stream::DEFAULT);
        }
        if streams.iter().any(|&s| dev.is_capturing(s).unwrap_or(true)) {
            return 0;
        }
        self.stats.unpin_device_syncs += 1;
        if self.phys.sync_device(dev).is_err() {
            return 0;
        }
        for e in &mut self.streams {
            e.synced_at = self.tick;
        }
        // Which chunk next: one whose live pages fit in the room under the
        // limit moves on the device (a map and a device copy), one that does
        // not goes through pageable host memory twice (release first), about
        // 200 times dearer per byte (docs/driver.md: 0.58 against 2 × 126
        // µs per MiB on an H200). Every chunk unpinned makes room of its free
        // pages. So: among chunks that fit the room, most free pages first
        // (among equals, fewer bytes to copy). When none fits, a round trip
        // is unavoidable: the chunk with the fewest live pages among those
        // that alone give the pages still wanted, else the one with the most
        // free pages (fewer live pages among equals), after which the room
        // it made may let the rest move on the device.
        let mut got = 0;
        while got < want && !cands.is_empty() {
            let room = self.phys.limit_pages().saturating_sub(self.mapped_pages());
            let need = want - got;
            let most_free = |c: &Move| (std::cmp::Reverse(c.free_pages()), c.live_pages);
            let fits = |c: &Move| c.live_pages <= room;
            let enough = |c: &Move| c.free_pages() >= need;
            let pick = (0..cands.len())
                .filter(|&i| fits(&cands[i]))
                .min_by_key(|&i| most_free(&cands[i]))
                .or_else(|| {
                    (0..cands.len())
                        .filter(|&i| enough(&cands[i]))
                        .min_by_key(|&i| cands[i].live_pages)
                })
                .or_else(|| (0..cands.len()).min_by_key(|&i| most_free(&cands[i])))
                .expect("cands is not empty");
            let p = cands.swap_remove(pick);
            match self.unpin_chunk(dev, &p) {
                Ok(()) => {
                    got += p.free_pages();
                    self.stats.chunk_unpins += 1;
                    self.stats.unpinned_bytes += p.free_pages() * self.layout.page;
                    self.stats.unpin_copied_bytes += p.live_pages * self.layout.page;
                }
                Err(e) => {
                    eprintln!("vmmalloc: unpinning a chunk failed: {e}");
                    break;
                }
            }
        }
        got
    }

    /// Moves the live runs of `p` to exact chunks and frees the old one
    /// ([`super::physical::Physical::unpin_chunk`]); keeps the block
    /// layer's counters. On an error the chunk is as it was (or, when even
    /// restoring it failed, its pages are recorded lost).
    fn unpin_chunk<D: Device + ?Sized>(&mut self, dev: &D, p: &Move) -> Result<(), DeviceError> {
        self.with_seg_pages(p.seg, |phys| phys.unpin_chunk(dev, p))
    }
}

#[cfg(test)]
mod tests {
    use super::live_runs;

    #[test]
    fn live_runs_clip_to_the_chunk_and_merge_shared_pages() {
        // Blocks on pages 0-3, 3-5 (sharing page 3), 9-12; chunk pages 2..11.
        let spans = [(0, 3), (3, 5), (9, 12)];
        assert_eq!(live_runs(&spans, 2, 11), vec![(2, 4), (9, 2)]);
        // Adjacent blocks (5 ends, 6 starts) form one run.
        assert_eq!(live_runs(&[(4, 5), (6, 7)], 0, 10), vec![(4, 4)]);
        assert_eq!(live_runs(&[(20, 30)], 0, 10), vec![]);
    }
}
