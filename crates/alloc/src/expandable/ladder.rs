//! The ladder of sources: where the physical memory for a request's
//! unmapped pages comes from, rung by rung, each tried only when the ones
//! above it cannot give enough.
//!
//! 1. **Pool** ([`Inner::take_pooled`]): unmapped chunks that kept their
//!    handle. The plan ([`Inner::plan`]) takes, per run, the largest pooled
//!    chunk that fits the rest of it: no driver call but the map.
//! 2. **Create within the limit** ([`Inner::create_planned`]): one new
//!    handle (`cuMemCreate`, ~193 µs) per planned chunk the pool cannot
//!    give, while mapped + pooled pages stay within the limit (the memory
//!    fraction).
//! 3. **Release spare pooled chunks** ([`Inner::release_spare`]): pooled
//!    chunks the plan does not use go back to the driver, largest first, to
//!    make room under the limit for rung 2 (so it runs just before the
//!    creates it makes room for). A release and a create, but no stream
//!    wait, and nothing in use is touched.
//! 4. **Reclaim** ([`Inner::reclaim`], `reclaim.rs`): whole free chunks
//!    elsewhere, least recently freed first, are unmapped into the pool;
//!    it may wait for the streams that last used them. The request's own
//!    pages (`exclude`) are never taken.
//! 5. **Unpin** ([`Inner::unpin`], `unpin.rs`): the free pages of chunks that
//!    live blocks hold only in part come back; the live pages move to exact
//!    chunks. A device synchronize and copies: the dearest source on the
//!    device, so it is asked only for what reclaim cannot give.
//! 6. **Spill** ([`Inner::acquire_spilling`], `spill.rs`, only with
//!    `spill:true`): the pages the device still lacks are backed by
//!    host-located chunks. The program goes on, slower.
//!
//! Why this order: each rung costs more than the one above and disturbs
//! more. The pool costs nothing; a create costs a driver call; a release
//! loses a handle a later request could have mapped again; reclaim may wait
//! for a stream and unmaps memory that was cached; unpinning synchronizes
//! the device and copies live bytes; spilled memory is slow for as long as
//! it lives.
//!
//! The driver ([`Inner::acquire_device`]) walks rungs 1–5 with a fresh plan
//! each time: after reclaim or unpinning (whose chunks went to the pool and
//! change the plan) and after the driver said out of memory (then nothing
//! more can be created than is released), at most [`MAX_ATTEMPTS`] plans.
//! [`Inner::acquire`] adds rung 6 when the device part comes up short.
//!
//! The mode ([`Need`]) says how far down the ladder a request may go: pages
//! a block needs now may use every rung; pages mapped ahead of a growing
//! segment's tail ([`Need::Ahead`]) stop after rung 2 and never spill
//! (before the ladder was written out they could: 12 MiB went to host
//! memory for a 4 MiB request that fit the device, `tests/spill.rs`,
//! `pages_mapped_ahead_of_need_never_spill`).

use super::pages::Backing;
use super::physical::Planned;
use super::reclaim::Exclude;
use super::Inner;
use vmmalloc_device::{Device, DeviceError, PhysHandle};

/// Plans tried for one request before it counts as out of memory (each after
/// a reclaim, an unpin or a driver out-of-memory).
const MAX_ATTEMPTS: u32 = 8;

/// What pages are backed for: the mode [`Inner::back_pages`] passes down
/// to [`Inner::acquire_device`], which decides which rungs may give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// Pages a request needs now: every rung (pool, new handles, releasing
    /// spare pooled handles, reclaim, unpinning, spill) may give them.
    Now,
    /// Pages mapped ahead of need (`alloc.rs`, `grow_to`): taken only from
    /// the pool and new handles within the limit, never by reclaim,
    /// unpinning or releasing pooled handles — nobody asked for them yet.
    Ahead,
}

/// What a plan asks of rungs 2 and 3, in pages.
#[derive(Debug, Clone, Copy)]
struct Room {
    /// Pages of the planned chunks the pool cannot give (rung 2).
    create: u64,
    /// Pages the limit has room for (0 once the driver said out of memory).
    free: u64,
    /// Pooled pages the plan does not use (rung 3 may release them).
    spare: u64,
}

impl Room {
    /// Pages rungs 1–3 cannot give: reclaim or unpinning must find them.
    fn lacking(&self) -> u64 {
        self.create.saturating_sub(self.free + self.spare)
    }
}

/// How rung 2 ended.
enum Created {
    /// Every planned chunk has its handle.
    All,
    /// The driver said out of memory; the handles created so far are kept.
    DriverFull,
}

impl Inner {
    /// Obtains handles for the unmapped `runs` (`(first, count)`) from the
    /// ladder (module docs): rungs 1–5 from device memory, then, with
    /// `spill:true`, rung 6. Returns the plan and one handle per planned
    /// chunk; nothing is mapped. On failure every handle obtained is pooled.
    pub(super) fn acquire<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        runs: &[(u64, u64)],
        need: Need,
        exclude: Exclude,
    ) -> Result<(Vec<Planned>, Vec<PhysHandle>), Backing> {
        match self.acquire_device(dev, runs, need, exclude) {
            // Device memory is exhausted after reclaim: spill (spill.rs).
            // Not for pages mapped ahead of need: they are a bet on the next
            // allocation, made only from memory to spare; host memory is
            // slow and spilling may migrate live chunks.
            Err(Backing::Short(lacking)) if self.phys.spill_enabled() && need == Need::Now => {
                self.acquire_spilling(dev, runs, need, exclude, lacking)
            }
            r => r,
        }
    }

    /// [`Inner::acquire`] from device memory only: rungs 1–5, planning
    /// again after every rung that gave memory back.
    pub(super) fn acquire_device<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        runs: &[(u64, u64)],
        need: Need,
        exclude: Exclude,
    ) -> Result<(Vec<Planned>, Vec<PhysHandle>), Backing> {
        // The driver said out of memory: only released memory can be created again.
        let mut driver_full = false;
        for attempt in 0..MAX_ATTEMPTS {
            let last = attempt + 1 == MAX_ATTEMPTS;
            let plan = self.plan(runs);
            let room = self.room_for(&plan, driver_full);
            if need == Need::Ahead && (room.create > room.free || driver_full) {
                // Pages mapped ahead of need come only from memory to spare.
                return Err(Backing::Short(room.create.saturating_sub(room.free).max(1)));
            }
            let lack = room.lacking();
            if lack > 0 {
                // Rungs 4 and 5, then plan again with what they gave.
                self.make_room(dev, lack, last, exclude)?;
                continue;
            }
            match self.take_plan(dev, &plan, room)? {
                Some(handles) => return Ok((plan, handles)),
                // Keep what was created (pooled), and plan again with it.
                None => driver_full = true,
            }
        }
        // Every attempt ended in an out-of-memory from the driver.
        self.phys.trim(dev);
        let short = runs.iter().map(|r| r.1).sum::<u64>();
        Err(Backing::Short(
            short.saturating_sub(self.phys.pool().pages()).max(1),
        ))
    }

    /// Plans chunks for the unmapped `runs` (`(first, count)`): per run, the
    /// largest pooled chunk that fits the rest of the run, else one new chunk
    /// for the rest (split at `max_chunk`).
    fn plan(&self, runs: &[(u64, u64)]) -> Vec<Planned> {
        let mut view = super::physical::PoolView::of(self.phys.pool());
        let max = self.layout.max_chunk_pages;
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

    /// What `plan` asks of rungs 2 and 3 and what they have: the pages to
    /// create, the limit's room (none once `driver_full`), the spare pool.
    fn room_for(&self, plan: &[Planned], driver_full: bool) -> Room {
        let create: u64 = plan.iter().filter(|c| !c.pooled).map(|c| c.pages).sum();
        let used_pool: u64 = plan.iter().filter(|c| c.pooled).map(|c| c.pages).sum();
        let free = if driver_full {
            0
        } else {
            self.phys.room(self.mapped_pages())
        };
        Room {
            create,
            free,
            spare: self.phys.pool().pages() - used_pool,
        }
    }

    /// Rungs 4 and 5 for `lack` pages that rungs 1–3 cannot give: when whole
    /// free chunks hold them all, reclaims them; else (unless `unpin:false`
    /// or on the `last` attempt) reclaims what there is and unpins for the
    /// rest. `Ok` when memory came back (plan again); else the pool is
    /// trimmed (when reclaim was not enough) and the pages still lacking
    /// are the error.
    fn make_room<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        lack: u64,
        last: bool,
        exclude: Exclude,
    ) -> Result<(), Backing> {
        let mut reclaimable = if last {
            0
        } else {
            self.reclaimable(exclude, lack)
        };
        // Freeable graph pools (no users left) give their free pages back
        // after one device synchronize (`private_pools/lifecycle.rs`), as PyTorch
        // releases freeable pools when an allocation fails.
        if reclaimable < lack && !last && self.unpin_freeable_pools(dev) {
            reclaimable = self.reclaimable(exclude, lack);
        }
        if reclaimable >= lack {
            self.stats.num_alloc_retries += 1;
            if self.reclaim(dev, lack, exclude) == 0 {
                return Err(Backing::Short(lack));
            }
            return Ok(());
        }
        // Whole free chunks are not enough: take them, and give back the
        // free pages of partly live chunks (unpin.rs).
        if !last && self.unpin != super::UnpinMode::Never {
            let r = if reclaimable > 0 {
                self.reclaim(dev, reclaimable, exclude)
            } else {
                0
            };
            let u = self.unpin(dev, lack.saturating_sub(r), exclude);
            if r + u > 0 {
                self.stats.num_alloc_retries += 1;
                return Ok(());
            }
        }
        self.phys.trim(dev);
        Err(Backing::Short(lack - reclaimable))
    }

    /// Rungs 1–3 for a plan that fits (`room` lacks nothing): the planned
    /// pooled chunks out of the pool, spare pooled chunks released while
    /// the creates exceed the limit's room, then new handles. Returns one
    /// handle per planned chunk, or `None` when the driver said out of
    /// memory (the handles obtained are pooled again).
    fn take_plan<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        plan: &[Planned],
        room: Room,
    ) -> Result<Option<Vec<PhysHandle>>, Backing> {
        // Take the planned pooled chunks out first, so that releasing
        // spare pool memory cannot take them.
        let mut handles = self.take_pooled(plan);
        if let Err(e) = self.release_spare(dev, room.create.saturating_sub(room.free)) {
            self.pool_back(plan, handles);
            return Err(Backing::Fail(e.into()));
        }
        match self.create_planned(dev, plan, &mut handles) {
            Ok(Created::All) => Ok(Some(handles.into_iter().flatten().collect())),
            Ok(Created::DriverFull) => {
                self.pool_back(plan, handles);
                Ok(None)
            }
            Err(e) => {
                // Handles created so far stay pooled: they are valid memory.
                self.pool_back(plan, handles);
                self.phys.trim(dev);
                Err(Backing::Fail(e.into()))
            }
        }
    }

    /// Rung 1: takes the plan's pooled chunks out of the pool. Returns one
    /// entry per planned chunk: its handle, or `None` for a chunk to create.
    fn take_pooled(&mut self, plan: &[Planned]) -> Vec<Option<PhysHandle>> {
        let handles = plan
            .iter()
            .map(|c| {
                if c.pooled {
                    self.phys.take_pooled(c.pages)
                } else {
                    None
                }
            })
            .collect();
        handles
    }

    /// Rung 3: releases pooled chunks, largest first, until at least `want`
    /// pages went back to the driver or the pool is empty. Returns the pages
    /// released; a failed release stops it (that chunk stays pooled).
    fn release_spare<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        want: u64,
    ) -> Result<u64, DeviceError> {
        let mut freed = 0;
        while freed < want {
            match self.phys.release_largest(dev)? {
                0 => break,
                p => freed += p,
            }
        }
        Ok(freed)
    }

    /// Rung 2: a new handle for every planned chunk that has none in
    /// `handles`, in plan order, stopping at the driver's first
    /// out-of-memory. Another driver error is returned (the handles created
    /// so far stay in `handles`).
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
            match self.phys.create(dev, c.pages) {
                Ok(new) => *h = Some(new),
                Err(e) if e.is_out_of_memory() => return Ok(Created::DriverFull),
                Err(e) => return Err(e),
            }
        }
        Ok(Created::All)
    }

    /// Puts the handles of a plan that were obtained back into the pool.
    pub(super) fn pool_back(&mut self, plan: &[Planned], handles: Vec<Option<PhysHandle>>) {
        for (c, h) in plan.iter().zip(handles) {
            if let Some(h) = h {
                self.phys.give_back(h, c.pages);
            }
        }
    }
}
