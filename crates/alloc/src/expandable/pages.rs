//! Physical chunks under blocks: which pages of a block must be backed
//! (edge pages, splits), asking the ladder of sources (`ladder.rs`: pool,
//! driver, targeted reclaim, unpinning, spill) to back them (the physical
//! layer maps them and rolls back a half-done mapping, `physical/back.rs`),
//! unmapping runs, and the block layer's counters for both.
//!
//! # Why chunks
//!
//! The driver charges per handle, not per byte: `cuMemCreate` costs ~193 µs
//! per call plus ~0.7 µs per MiB on an A100 (kvcached `bench_vmm`), and
//! PyTorch's Note [Expandable Segments] (`CUDACachingAllocator.cpp`) says
//! mapping ten 2 MiB handles takes ten times as long as one 20 MiB handle. So
//! the pages a block lacks are backed by as few handles as the work allows:
//! one chunk per missing run (split at `max_chunk`), preferring chunks already
//! in the pool.
//!
//! # Wholly used or wholly free
//!
//! A chunk is one mapping, and `cuMemUnmap` takes whole mappings only, so
//! reclaim can give back a chunk only when it lies wholly inside free space.
//! A chunk sized to the block that first needed it is wholly used by it, and
//! wholly free once it is freed. The danger is a later, smaller block carved
//! out of such a free chunk: it *pins* the whole chunk, and the rest of it is
//! free memory nothing else can have. By default that is allowed, and the
//! pinned pages come back by unpinning when an allocation needs them
//! (`unpin.rs`, the last device rung of the ladder, `ladder.rs`). With
//! `split_threshold` below 1, when memory is tight (live bytes above that
//! fraction of the limit) such a chunk is **split** ahead of need instead:
//! unmapped (after waiting for its stream) and the block gets exact chunks of
//! its own, from the pool or new ones, unless the block would leave at most
//! `split_slack` (default 4 MiB) of it uncovered: a split costs a stream
//! wait, an unmap and a new handle, more than a few pinned pages are worth.
//! With room to spare, pinning is harmless and costs no call, so the chunk is
//! reused as it is. Mapping pages *ahead*
//! of a growing segment (fewer, larger handles, as PyTorch's 20 MiB pages do)
//! was measured and rejected: the chunks it makes straddle blocks and can be
//! neither reclaimed nor split (docs/expandable.md, "Chunks: the trade-off").
//!
//! # Edge pages
//!
//! Blocks are packed at 512-byte granularity, so a block usually ends inside
//! a page whose other bytes the next block takes. If that page were part of
//! the block's big chunk, the neighbour would pin the whole chunk after the
//! block is freed: a 1 GiB chunk held by a few bytes of a small tensor. While
//! splitting (`split_threshold` below 1; by default unpinning frees such
//! pages instead) and memory is tight, the shared first or last page of a
//! request therefore gets
//! a one-page chunk of its own (one more `cuMemCreate` for the block) —
//! unless the rest of its run is at most `split_slack`, which a neighbour may
//! pin as a split may leave it pinned — and
//! a large block whose size is a whole number of pages starts on a page
//! boundary (it then shares no page at all; see `alloc.rs`). Measured in
//! docs/results.md; the diagnosis (a replay of `serve-kv:seed=5` at its
//! minimum capacity had 372 MiB of free pages inside chunks held only by a
//! neighbour's edge page) is in docs/expandable.md, "Edge pages".
//!
//! Invariants (checked by `validate`): every handle is in exactly one place —
//! mapped as one chunk of one segment, or in the pool; `stats.pages_mapped`,
//! `stats.pages_pooled` and the handle counts equal recounts; mapped chunks are
//! accessible unless listed in `unready`.

use super::ladder::{Backing, Need};
use super::physical::{Chunk, Pages, Physical, Target};
use super::reclaim::Exclude;
use super::Inner;
use vmmalloc_device::{Device, DeviceError};

impl Inner {
    /// Updates the block layer's counters after pages of `seg` were mapped
    /// or unmapped by the physical layer: `before` is the segment's
    /// inactive split from before, `pages` the change in mapped pages. One
    /// update per run gives the same counters, peaks included, as one per
    /// page: every page moves them the same way.
    pub(super) fn note_pages(&mut self, seg: u32, pages: i64, before: (i64, i64)) {
        self.split_changed(seg, before);
        let k = self.seg(seg).kind as usize;
        let bytes = pages * self.layout.page as i64;
        self.counters.reserved_bytes.add(k, bytes);
        self.note_pool_reserved(seg, bytes);
    }

    /// Runs `op` of the physical layer, which may map or unmap pages of
    /// `seg` only, and updates the block layer's counters by the change in
    /// its mapped pages (one update for the whole operation).
    pub(super) fn with_seg_pages<T>(&mut self, seg: u32, op: impl FnOnce(&mut Physical) -> T) -> T {
        let before = (self.inactive_split(seg), self.table(seg).mapped_pages());
        let r = op(&mut self.phys);
        let after = self.table(seg).mapped_pages();
        if after != before.1 {
            self.note_pages(seg, after as i64 - before.1 as i64, before.0);
        }
        r
    }

    /// Unmaps pages `[first, first + count)` of `seg`, which are whole
    /// chunks, in one call; their handles go to the pool. On failure nothing
    /// changes.
    pub(super) fn unmap_run<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
    ) -> Result<(), DeviceError> {
        self.with_seg_pages(seg, |phys| phys.unmap_run(dev, seg, first, count))
    }

    /// Unmaps the whole chunks in pages `[first, first + count)` of `seg`, in
    /// one call or, when that fails, chunk by chunk
    /// ([`Physical::unmap_chunks`]); returns the first error.
    pub(super) fn unmap_chunks<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        first: u64,
        count: u64,
        mark_unready: bool,
    ) -> Result<(), DeviceError> {
        self.with_seg_pages(seg, |phys| {
            phys.unmap_chunks(dev, seg, first, count, mark_unready)
        })
    }

    /// Makes pages `[p0, p1]` (`span`) of `seg` mapped and accessible, taking
    /// chunks from the pool, the driver, or (for [`Need::Now`]) a targeted
    /// reclaim. `room` is the whole
    /// pages of the free block the request is carved from (freed at tick
    /// `freed_at`): chunks inside it are wholly free and may be split. On
    /// failure every chunk this call mapped is unmapped again (handles go to
    /// the pool).
    ///
    /// `shared` says whether the first and the last page are shared with
    /// the bytes of other blocks (the request starts or ends inside them).
    /// When memory is tight such a page, if it must be mapped, gets a chunk
    /// of its own, so that the block's other chunks hold no byte of any
    /// other block: once the block is freed they are wholly free, however
    /// long its neighbours live (see the module docs, "Edge pages"). Not
    /// when the rest of its run is at most `split_slack`: a neighbour could
    /// pin no more than a split would leave pinned.
    ///
    /// When memory is not tight (nothing to split, no edge to cut) the
    /// physical layer finds the unmapped pages itself ([`Pages::Span`]): a
    /// miss is then one call into it per attempt of the ladder.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn back_pages<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        span: (u64, u64),
        need: Need,
        shared: (bool, bool),
        room: (u64, u64),
        freed_at: u64,
    ) -> Result<(), Backing> {
        let (p0, p1) = span;
        let exclude = Some((seg, p0, p1));
        if !self.tight() {
            // Nothing to split, no edge to cut: the physical layer finds
            // the unmapped runs itself (the common miss: one call).
            return self.acquire_and_map(dev, seg, Pages::Span(p0, p1), need, exclude);
        }
        self.phys
            .fix_unready(dev, seg, p0, p1)
            .map_err(|e| Backing::Fail(e.into()))?;
        self.split_free_chunks(dev, seg, p0, p1, room, freed_at)
            .map_err(|e| Backing::Fail(e.into()))?;
        let mut runs = self.table(seg).unmapped_runs(p0, p1 + 1);
        // Tight again: waiting for a stream in the split may have freed blocks.
        if (shared.0 || shared.1) && self.tight() {
            runs = cut_edge_pages(
                &runs,
                shared.0.then_some(p0),
                shared.1.then_some(p1),
                self.layout.slack_pages,
            );
        }
        if runs.is_empty() {
            return Ok(());
        }
        let pages: u64 = runs.iter().map(|r| r.1).sum();
        // One read: a shared budget's limit may change between two
        // (another member's cap), and the difference must not underflow.
        let limit = self.phys.limit_pages();
        if pages > limit {
            return Err(Backing::Short(pages - limit));
        }
        self.acquire_and_map(dev, seg, Pages::Runs(&runs), need, exclude)
    }

    /// Whether memory is tight: live bytes exceed `split_threshold` of the
    /// limit (default 2/5). Live bytes, not mapped ones: the live curve is the
    /// same in every iteration of a loop, so every iteration makes the same
    /// decisions and the chunks one iteration leaves fit the next.
    pub(super) fn tight(&self) -> bool {
        self.counters.active_bytes.current().max(0) as u64 > self.split_above
    }

    /// When memory is tight, unmaps the wholly free chunks (inside the free
    /// block's whole pages `room`) that the request `[p0, p1]` would cover
    /// only in part: a chunk kept wholly used or wholly free can be reclaimed
    /// whole later, one pinned by a small block cannot. The pages are mapped
    /// again by exact chunks (pooled ones first). The free block was freed at
    /// tick `freed_at`: its stream is waited for first unless it was since.
    fn split_free_chunks<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        p0: u64,
        p1: u64,
        room: (u64, u64),
        freed_at: u64,
    ) -> Result<(), DeviceError> {
        if !self.tight() || self.table(seg).pinned() {
            return Ok(());
        }
        // Only the chunks holding the first and the last page can reach past
        // the request; those strictly inside are covered whole.
        let t = self.table(seg);
        let mut partial: Vec<(u64, Chunk)> = Vec::new();
        for c in [t.chunk_at(p0), t.chunk_at(p1)].into_iter().flatten() {
            let (f, ch) = c;
            let covered = (f + ch.pages).min(p1 + 1) - f.max(p0);
            // A chunk that would leave at most `split_slack` uncovered is
            // pinned: a split costs far more than those pages.
            let reaches_out = ch.pages - covered > self.layout.slack_pages;
            let wholly_free = f >= room.0 && f + ch.pages <= room.1;
            if reaches_out && wholly_free && !partial.iter().any(|&(g, _)| g == f) {
                partial.push(c);
            }
        }
        if partial.is_empty() {
            return Ok(());
        }
        let owner = self.seg(seg).owner;
        if freed_at > self.streams[owner as usize].synced_at {
            if !self.may_wait(dev, owner) {
                return Ok(()); // a capturing stream: the split waits
            }
            self.wait_stream(dev, owner)?;
        }
        for (f, c) in partial {
            self.unmap_run(dev, seg, f, c.pages)?;
            self.stats.chunk_splits += 1;
        }
        Ok(())
    }

    /// Backs `runs` of `seg` with chunks and maps them (the ladder,
    /// `ladder.rs`): memory comes from the pool first, then from new handles
    /// within the limit; when that is not enough, pooled chunks the plan
    /// cannot use are released, then whole free chunks elsewhere are
    /// reclaimed (never those overlapping `exclude`) and the plan is made
    /// again with them (only for [`Need::Now`]). On failure every chunk
    /// this call mapped is unmapped again (handles go to the pool).
    pub(super) fn acquire_and_map<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        pages: Pages<'_>,
        need: Need,
        exclude: Exclude,
    ) -> Result<(), Backing> {
        let (backed, r) = self.back_runs(dev, Target::Segment(seg), pages, need, exclude);
        // The physical layer mapped up to `peak` pages, then (after a
        // failure) unmapped all but `kept`: the counters move up, then down,
        // as they would have page by page, peaks included.
        let (from, peak) = (backed.from, backed.from + backed.peak);
        self.note_mapped(seg, from, peak);
        self.note_mapped(seg, peak, from + backed.kept);
        r
    }

    /// Updates the block layer's counters after the physical layer took
    /// segment `seg` from `from` to `to` mapped pages: its inactive split
    /// ([`super::segment::Segment::inactive_split`], a function of the
    /// mapped pages) and `reserved_bytes` (its pool's too). One update gives the same
    /// counters, peaks included, as one per page while they move one way.
    fn note_mapped(&mut self, seg: u32, from: u64, to: u64) {
        if from == to {
            return;
        }
        let page = self.layout.page;
        let s = self.seg(seg);
        let (before, after) = (s.inactive_split(from, page), s.inactive_split(to, page));
        let k = s.kind as usize;
        let c = &mut self.counters;
        if after.0 != before.0 {
            c.inactive_split_bytes.add(k, after.0 - before.0);
        }
        if after.1 != before.1 {
            c.inactive_split.add(k, after.1 - before.1);
        }
        let bytes = (to as i64 - from as i64) * page as i64;
        c.reserved_bytes.add(k, bytes);
        self.note_pool_reserved(seg, bytes);
    }
}

/// Cuts the unmapped `runs` (ascending `(first, count)`) so that page `first`
/// and page `last`, when given and at the edge of a run, are runs of their
/// own (each then gets a chunk of its own) — but only where the rest of
/// that run is more than `slack` pages: a smaller chunk pinned by the
/// neighbour on the shared page strands no more than the split rule
/// tolerates, and is cheaper than one more handle.
fn cut_edge_pages(
    runs: &[(u64, u64)],
    first: Option<u64>,
    last: Option<u64>,
    slack: u64,
) -> Vec<(u64, u64)> {
    let mut out = Vec::with_capacity(runs.len() + 2);
    for &(a, n) in runs {
        let (mut a, mut n) = (a, n);
        if let Some(p) = first.filter(|&p| p == a && n > slack + 1) {
            out.push((p, 1));
            a += 1;
            n -= 1;
        }
        match last.filter(|&p| p > a && p == a + n - 1 && n > slack + 1) {
            Some(p) => {
                out.push((a, n - 1));
                out.push((p, 1));
            }
            None => out.push((a, n)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::cut_edge_pages;

    #[test]
    fn edge_pages_become_runs_of_their_own() {
        // Both edges inside one run.
        assert_eq!(
            cut_edge_pages(&[(10, 5)], Some(10), Some(14), 0),
            vec![(10, 1), (11, 3), (14, 1)]
        );
        // Only the last page is shared.
        assert_eq!(
            cut_edge_pages(&[(10, 5)], None, Some(14), 0),
            vec![(10, 4), (14, 1)]
        );
        // The shared page is already mapped (not the run's edge): nothing to cut.
        assert_eq!(
            cut_edge_pages(&[(11, 3)], Some(10), Some(15), 0),
            vec![(11, 3)]
        );
        // One-page and two-page runs.
        assert_eq!(cut_edge_pages(&[(7, 1)], Some(7), Some(7), 0), vec![(7, 1)]);
        assert_eq!(
            cut_edge_pages(&[(7, 2)], Some(7), Some(8), 0),
            vec![(7, 1), (8, 1)]
        );
        // Several runs: only the first and the last can hold the edges.
        assert_eq!(
            cut_edge_pages(&[(0, 3), (5, 2), (9, 4)], Some(0), Some(12), 0),
            vec![(0, 1), (1, 2), (5, 2), (9, 3), (12, 1)]
        );
        assert_eq!(cut_edge_pages(&[], Some(0), Some(3), 0), vec![]);
    }

    #[test]
    fn an_edge_is_cut_only_where_the_rest_of_its_run_exceeds_the_slack() {
        // Slack 2 pages: a run must keep more than 2 pages besides the edge.
        assert_eq!(cut_edge_pages(&[(0, 3)], Some(0), Some(2), 2), vec![(0, 3)]);
        assert_eq!(
            cut_edge_pages(&[(0, 4)], Some(0), Some(3), 2),
            vec![(0, 1), (1, 3)]
        );
        assert_eq!(
            cut_edge_pages(&[(0, 5)], Some(0), Some(4), 2),
            vec![(0, 1), (1, 3), (4, 1)]
        );
        // Each run is judged by itself.
        assert_eq!(
            cut_edge_pages(&[(0, 2), (5, 6)], Some(0), Some(10), 2),
            vec![(0, 2), (5, 5), (10, 1)]
        );
    }
}
