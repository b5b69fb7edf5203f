//! Backing page runs: the one question the block layer asks on a miss
//! ([`Physical::back`]: "back these page runs; tell me what is short").
//!
//! The block layer asks with the runs, or (when memory is not tight: no
//! free chunk to split, no edge page to cut) with the request's page span:
//! the layer then gives access to unready chunks there, finds the unmapped
//! runs and checks them against the budget's whole limit itself.
//!
//! One call plans chunks for the runs, takes the pooled ones, releases spare
//! pooled chunks to make room under the budget, creates the rest, creates
//! the host-located tail of a spill, maps everything into the segment (or at
//! the end of a growable region), gives access one contiguous run at a time,
//! and on any failure rolls back: handles go back to the pool, chunks this
//! call mapped are unmapped again. What it cannot give it answers as a
//! [`Shortfall`]; the block layer then makes room (reclaim, unpinning: its
//! own cached free pages), decides to spill, or gives up, and asks again
//! (`ladder.rs`, which has the order of the sources and why).
//!
//! The plan per run takes the largest pooled chunk that fits the rest of
//! it, else one new chunk for the rest (split at `max_chunk`): the driver
//! charges per handle, not per byte (`pages.rs`, "Why chunks").

use super::Physical;
use vmmalloc_device::{Device, DeviceError, PhysHandle};

/// One chunk of a plan ([`Physical::back`] makes plans and maps them):
/// pages `[first, first + pages)` of the segment, backed by a pooled handle
/// of that size or by a new one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    /// First page of the chunk (in the caller's page numbering).
    pub first: u64,
    /// Pages of the chunk.
    pub pages: u64,
    /// Whether a pooled handle backs it (else a new one).
    pub pooled: bool,
}

/// Where [`Physical::back`] maps the chunks.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    /// Pages of segment `seg` (its chunk table).
    Segment(u32),
    /// The end of growable region `ptr` (`regions.rs`).
    Region(u64),
}

/// Which pages a request backs with device memory.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pages<'a> {
    /// These unmapped runs `(first, count)`.
    Runs(&'a [(u64, u64)]),
    /// The unmapped pages of `[first, last]` of the target segment (a
    /// region has none): unready chunks there are given access first,
    /// and pages beyond the budget's whole limit are refused
    /// ([`Shortfall::OverLimit`]) before anything is planned. The runs
    /// found come back in [`Backed::runs`].
    Span(u64, u64),
}

/// One request to [`Physical::back`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    /// The pages to back with device memory.
    pub pages: Pages<'a>,
    /// Unmapped runs to back with new host-located chunks (spill), after
    /// the device runs; empty unless the block layer decided to spill.
    pub host: &'a [(u64, u64)],
    /// Only from memory to spare (pages mapped ahead of need): no spare
    /// pooled chunk is released, and a plan the budget's room cannot hold
    /// is short at once.
    pub ahead: bool,
    /// The driver said out of memory on an earlier try: only released
    /// memory can be created again, so the budget's room counts as none.
    pub driver_full: bool,
}

/// What [`Physical::back`] did to the target, whether it succeeded or not.
#[derive(Debug, Clone, Default)]
pub(crate) struct Backed {
    /// Pages the segment had mapped when this call began to map (0 for a
    /// region).
    pub from: u64,
    /// Most pages this call had mapped at once (before any rollback).
    pub peak: u64,
    /// Pages this call mapped that are still mapped at its end: `peak` on
    /// success; after a failure, chunks whose rollback unmap failed.
    pub kept: u64,
    /// Host-located chunks were created for [`Ask::host`].
    pub spilled: bool,
    /// For [`Pages::Span`]: the unmapped runs `(first, count)` found there
    /// (empty for [`Pages::Runs`]).
    pub runs: Vec<(u64, u64)>,
}

/// Why [`Physical::back`] did not back the runs. Nothing it obtained is
/// left with the caller: handles are pooled, host handles released.
#[derive(Debug)]
pub(crate) enum Shortfall {
    /// [`Pages::Span`]: its unmapped pages exceed the budget's whole limit
    /// by this many pages; nothing was tried.
    OverLimit(u64),
    /// The pool, new handles within the budget and releasing spare pooled
    /// chunks cannot give this many pages: make room and ask again.
    Lack(u64),
    /// [`Ask::ahead`]: memory to spare lacks this many pages (at least 1).
    NoSpare(u64),
    /// The driver said out of memory on a create; what was created is
    /// pooled. Ask again with [`Ask::driver_full`].
    DriverFull,
    /// The host could not give the spill runs (out of memory, or the
    /// backend has no host memory).
    HostFull,
    /// A device call failed (not out-of-memory); everything was rolled back.
    Fail(DeviceError),
}

/// What a plan asks of the pool, the budget's room and the spare pool, in
/// pages.
#[derive(Debug, Clone, Copy)]
struct Room {
    /// Pages of the planned chunks the pool cannot give (to create).
    create: u64,
    /// Pages the budget has room for (0 once the driver said out of memory).
    free: u64,
    /// Pooled pages the plan does not use (may be released).
    spare: u64,
}

/// How the creates of a plan ended.
enum Created {
    /// Every planned chunk has its handle.
    All,
    /// The driver said out of memory; the handles created so far are kept.
    DriverFull,
}

impl Physical {
    /// Backs `ask`'s runs in `target` (module docs): device runs from the
    /// pool, spare pooled chunks released, new handles within the budget;
    /// then [`Ask::host`]'s runs from new host chunks; then maps them all,
    /// in ascending order, one `set_access` per contiguous run. Returns what
    /// it did to the target's mapped pages, and whether it succeeded.
    pub fn back<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        ask: Ask<'_>,
    ) -> (Backed, Result<(), Shortfall>) {
        let mut backed = Backed::default();
        let r = match ask.pages {
            Pages::Runs(runs) => self.back_runs(dev, target, runs, ask, &mut backed),
            Pages::Span(p0, p1) => match self.span_runs(dev, target, p0, p1) {
                Ok(runs) if runs.is_empty() => Ok(()),
                Ok(runs) => {
                    let r = self.back_runs(dev, target, &runs, ask, &mut backed);
                    backed.runs = runs;
                    r
                }
                Err(e) => Err(e),
            },
        };
        (backed, r)
    }

    /// The unmapped runs of pages `[p0, p1]` of `target` (a segment; a
    /// region has none), after giving access to the unready chunks there.
    /// Refused when they exceed the budget's whole limit.
    fn span_runs<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        p0: u64,
        p1: u64,
    ) -> Result<Vec<(u64, u64)>, Shortfall> {
        let Target::Segment(seg) = target else {
            return Ok(Vec::new());
        };
        self.fix_unready(dev, seg, p0, p1)
            .map_err(Shortfall::Fail)?;
        let runs = self.table(seg).unmapped_runs(p0, p1 + 1);
        let pages: u64 = runs.iter().map(|r| r.1).sum();
        // One read: a shared budget's limit may change between two
        // (another member's cap), and the difference must not underflow.
        let limit = self.limit_pages();
        if pages > limit {
            return Err(Shortfall::OverLimit(pages - limit));
        }
        Ok(runs)
    }

    /// [`Physical::back`] for the device runs `runs`, noting what it did in
    /// `backed`.
    fn back_runs<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        runs: &[(u64, u64)],
        ask: Ask<'_>,
        backed: &mut Backed,
    ) -> Result<(), Shortfall> {
        let mut plan = self.plan(runs);
        let room = self.room_for(&plan, ask.driver_full);
        if ask.ahead && (room.create > room.free || ask.driver_full) {
            return Err(Shortfall::NoSpare(
                room.create.saturating_sub(room.free).max(1),
            ));
        }
        let lack = room.create.saturating_sub(room.free + room.spare);
        if lack > 0 {
            return Err(Shortfall::Lack(lack));
        }
        let mut handles = self.take_plan(dev, &plan, room)?;
        if !ask.host.is_empty() {
            match self.create_host_plan(dev, ask.host) {
                Ok((p, h)) => {
                    backed.spilled = true;
                    plan.extend(p);
                    handles.extend(h);
                }
                Err(e) => {
                    for (c, h) in plan.iter().zip(handles) {
                        self.give_back(h, c.pages);
                    }
                    return Err(e);
                }
            }
        }
        match target {
            Target::Segment(seg) => {
                backed.from = self.table(seg).mapped_pages();
                let r = self.map_plan(dev, seg, &plan, handles, &mut backed.peak);
                backed.kept = self.table(seg).mapped_pages() - backed.from;
                r.map_err(Shortfall::Fail)
            }
            Target::Region(ptr) => match self.region_map(dev, ptr, &plan, handles) {
                Ok(pages) => {
                    (backed.peak, backed.kept) = (pages, pages);
                    Ok(())
                }
                Err((e, kept)) => {
                    (backed.peak, backed.kept) = (kept, kept);
                    Err(Shortfall::Fail(e))
                }
            },
        }
    }

    /// Plans chunks for the unmapped `runs` (`(first, count)`): per run, the
    /// largest pooled chunk that fits the rest of the run, else one new chunk
    /// for the rest (split at `max_chunk`).
    fn plan(&self, runs: &[(u64, u64)]) -> Vec<Planned> {
        let mut view = super::PoolView::of(&self.pool);
        let max = self.max_chunk_pages;
        let mut plan = Vec::new();
        for &(a, n) in runs {
            let (mut p, end) = (a, a + n);
            while p < end {
                let rest = (end - p).min(max);
                let (pages, pooled) = match view.take_largest_at_most(rest) {
                    Some(k) => (k, true),
                    None => (rest, false),
                };
                plan.push(Planned {
                    first: p,
                    pages,
                    pooled,
                });
                p += pages;
            }
        }
        plan
    }

    /// What `plan` asks and what there is: the pages to create, the
    /// budget's room for the device pages mapped (none once `driver_full`),
    /// the spare pool.
    fn room_for(&self, plan: &[Planned], driver_full: bool) -> Room {
        let create: u64 = plan.iter().filter(|c| !c.pooled).map(|c| c.pages).sum();
        let used_pool: u64 = plan.iter().filter(|c| c.pooled).map(|c| c.pages).sum();
        let free = if driver_full {
            0
        } else {
            self.room(self.device_pages())
        };
        Room {
            create,
            free,
            spare: self.pool.pages() - used_pool,
        }
    }

    /// The handles for a plan that fits (`room` lacks nothing): the planned
    /// pooled chunks out of the pool, spare pooled chunks released while
    /// the creates exceed the budget's room, then new handles. Returns one
    /// handle per planned chunk. On failure the handles obtained are pooled
    /// again (and, after a device error, the pool trimmed).
    fn take_plan<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        plan: &[Planned],
        room: Room,
    ) -> Result<Vec<PhysHandle>, Shortfall> {
        // Take the planned pooled chunks out first, so that releasing
        // spare pool memory cannot take them.
        let mut handles: Vec<Option<PhysHandle>> = plan
            .iter()
            .map(|c| c.pooled.then(|| self.pool.take(c.pages)).flatten())
            .collect();
        if let Err(e) = self.release_spare(dev, room.create.saturating_sub(room.free)) {
            self.pool_back(plan, handles);
            return Err(Shortfall::Fail(e));
        }
        match self.create_planned(dev, plan, &mut handles) {
            Ok(Created::All) => Ok(handles.into_iter().flatten().collect()),
            Ok(Created::DriverFull) => {
                self.pool_back(plan, handles);
                Err(Shortfall::DriverFull)
            }
            Err(e) => {
                // Handles created so far stay pooled: they are valid memory.
                self.pool_back(plan, handles);
                self.trim(dev);
                Err(Shortfall::Fail(e))
            }
        }
    }

    /// Releases pooled chunks, largest first, until at least `want` pages
    /// went back to the driver or the pool is empty. Returns the pages
    /// released; a failed release stops it (that chunk stays pooled).
    fn release_spare<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        want: u64,
    ) -> Result<u64, DeviceError> {
        let mut freed = 0;
        while freed < want {
            match self.release_largest(dev)? {
                0 => break,
                p => freed += p,
            }
        }
        Ok(freed)
    }

    /// A new handle for every planned chunk that has none in `handles`, in
    /// plan order, stopping at the driver's first out-of-memory. Another
    /// driver error is returned (the handles created so far stay in
    /// `handles`).
    fn create_planned<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        plan: &[Planned],
        handles: &mut [Option<PhysHandle>],
    ) -> Result<Created, DeviceError> {
        for (c, h) in plan.iter().zip(handles.iter_mut()) {
            if h.is_some() {
                continue;
            }
            match self.create(dev, c.pages) {
                Ok(new) => *h = Some(new),
                Err(e) if e.is_out_of_memory() => return Ok(Created::DriverFull),
                Err(e) => return Err(e),
            }
        }
        Ok(Created::All)
    }

    /// Puts the handles of a plan that were obtained back into the pool.
    fn pool_back(&mut self, plan: &[Planned], handles: Vec<Option<PhysHandle>>) {
        for (c, h) in plan.iter().zip(handles) {
            if let Some(h) = h {
                self.give_back(h, c.pages);
            }
        }
    }

    /// New host-located chunks (split at `max_chunk`) for the unmapped
    /// `runs`: the plan and its handles. When one create fails the handles
    /// created are released: [`Shortfall::HostFull`] when the host is full
    /// or has no host memory (`cudaErrorNotSupported`, 801), else the error.
    fn create_host_plan<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        runs: &[(u64, u64)],
    ) -> Result<(Vec<Planned>, Vec<PhysHandle>), Shortfall> {
        let max = self.max_chunk_pages;
        let mut plan = Vec::new();
        for &(a, n) in runs {
            let mut p = a;
            while p < a + n {
                let pages = (a + n - p).min(max);
                plan.push(Planned {
                    first: p,
                    pages,
                    pooled: false,
                });
                p += pages;
            }
        }
        let mut handles = Vec::with_capacity(plan.len());
        for c in &plan {
            match self.create_on_host(dev, c.pages) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    for h in handles {
                        self.drop_host(h);
                    }
                    self.release_host_free(dev);
                    return Err(if e.is_out_of_memory() || e.cuda_code() == 801 {
                        Shortfall::HostFull
                    } else {
                        Shortfall::Fail(e)
                    });
                }
            }
        }
        Ok((plan, handles))
    }

    /// Maps `handles` as the chunks of `plan` (ascending) in segment `seg`,
    /// one `set_access` per contiguous run; `peak` counts the pages mapped.
    /// On failure, unmaps what it mapped ([`Physical::undo_plan`]) and gives
    /// the handles not mapped back.
    fn map_plan<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        plan: &[Planned],
        handles: Vec<PhysHandle>,
        peak: &mut u64,
    ) -> Result<(), DeviceError> {
        // Chunks are mapped in order, so the ones this call mapped are always
        // `plan[..done]`.
        let mut done = 0;
        let mut i = 0;
        while i < plan.len() {
            let mut j = i;
            while j + 1 < plan.len() && plan[j + 1].first == plan[j].first + plan[j].pages {
                j += 1;
            }
            let mut run_pages = 0;
            for k in i..=j {
                let c = plan[k];
                if let Err(e) = self.map_chunk(dev, seg, c.first, handles[k], c.pages) {
                    for (c, &h) in plan[k..].iter().zip(&handles[k..]) {
                        self.give_back(h, c.pages);
                    }
                    return Err(self.undo_plan(dev, seg, &plan[..done], e));
                }
                run_pages += c.pages;
                *peak += c.pages;
                done += 1;
            }
            if let Err(e) = self.set_access(dev, seg, plan[i].first, run_pages) {
                for (c, &h) in plan[j + 1..].iter().zip(&handles[j + 1..]) {
                    self.give_back(h, c.pages);
                }
                return Err(self.undo_plan(dev, seg, &plan[..done], e));
            }
            i = j + 1;
        }
        Ok(())
    }

    /// Rolls back chunks mapped by a failed [`Physical::map_plan`]: unmaps
    /// them (run by run, then chunk by chunk) and pools their handles. A
    /// chunk that cannot be unmapped stays mapped and is listed as unready
    /// (mapped, maybe inaccessible). Returns `err`.
    fn undo_plan<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        seg: u32,
        done: &[Planned],
        err: DeviceError,
    ) -> DeviceError {
        let mut i = 0;
        while i < done.len() {
            let mut j = i;
            while j + 1 < done.len() && done[j + 1].first == done[j].first + done[j].pages {
                j += 1;
            }
            let first = done[i].first;
            let count = done[j].first + done[j].pages - first;
            let _ = self.unmap_chunks(dev, seg, first, count, true);
            i = j + 1;
        }
        self.trim(dev);
        err
    }
}
