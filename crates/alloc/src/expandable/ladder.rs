//! The ladder of sources: where the physical memory for a request's
//! unmapped pages comes from, rung by rung, each tried only when the ones
//! above it cannot give enough.
//!
//! Rungs 1–3 and 6's host creates are the physical layer's: one call,
//! [`Physical::back`](super::physical::Physical::back) (`physical/back.rs`),
//! plans, takes, releases, creates, maps and gives access, or says what is
//! short. Rungs 4 and 5 and the decision to spill are this layer's: they
//! touch blocks, streams and cached free pages.
//!
//! 1. **Pool**: unmapped chunks that kept their handle. The plan takes, per
//!    run, the largest pooled chunk that fits the rest of it: no driver
//!    call but the map.
//! 2. **Create within the limit**: one new handle (`cuMemCreate`, ~193 µs)
//!    per planned chunk the pool cannot give, while mapped + pooled pages
//!    stay within the limit (the memory fraction).
//! 3. **Release spare pooled chunks**: pooled chunks the plan does not use
//!    go back to the driver, largest first, to make room under the limit
//!    for rung 2 (so it runs just before the creates it makes room for). A
//!    release and a create, but no stream wait, and nothing in use is
//!    touched.
//! 4. **Reclaim** ([`Inner::reclaim`], `reclaim.rs`): whole free chunks
//!    elsewhere, least recently freed first, are unmapped into the pool;
//!    it may wait for the streams that last used them. The request's own
//!    pages (`exclude`) are never taken.
//! 5. **Unpin** ([`Inner::unpin`], `unpin.rs`): the free pages of chunks that
//!    live blocks hold only in part come back; the live pages move to exact
//!    chunks. A device synchronize and copies: the dearest source on the
//!    device, so it is asked only for what reclaim cannot give.
//! 6. **Spill** ([`Inner::back_spilling`], `spill.rs`, only with
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
//! The driver ([`Inner::back_device`]) asks the physical layer once per
//! attempt, each with a fresh plan: after reclaim or unpinning (whose chunks
//! went to the pool and change the plan) and after the driver said out of
//! memory (then nothing more can be created than is released), at most
//! [`MAX_ATTEMPTS`] attempts. [`Inner::back_runs`] adds rung 6 when the
//! device part comes up short.
//!
//! The mode ([`Need`]) says how far down the ladder a request may go: pages
//! a block needs now may use every rung; pages mapped ahead of a growing
//! segment's tail ([`Need::Ahead`]) stop after rung 2 and never spill
//! (before the ladder was written out they could: 12 MiB went to host
//! memory for a 4 MiB request that fit the device, `tests/spill.rs`,
//! `pages_mapped_ahead_of_need_never_spill`).

use super::physical::{Ask, Backed, Pages, Shortfall, Target};
use super::reclaim::Exclude;
use super::Inner;
use crate::AllocError;
use vmmalloc_device::Device;

/// Plans tried for one request before it counts as out of memory (each after
/// a reclaim, an unpin or a driver out-of-memory).
const MAX_ATTEMPTS: u32 = 8;

/// What pages are backed for: the mode [`Inner::back_pages`] passes down
/// to [`Inner::back_device`], which decides which rungs may give them.
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

/// Why pages could not be provided.
#[derive(Debug)]
pub(crate) enum Backing {
    /// Not enough physical memory: this many pages are still lacking.
    Short(u64),
    /// A device call failed (not out-of-memory); the operation was rolled back.
    Fail(AllocError),
}

/// How [`Inner::back_device`] ended short.
pub(super) enum Short {
    /// The pages exceed the whole limit by this many: no rung can help.
    OverLimit(u64),
    /// The device lacks this many pages.
    Device(u64),
    /// The host could not give a spill's runs.
    Host,
    /// A device call failed; everything was rolled back.
    Fail(vmmalloc_device::DeviceError),
}

impl Short {
    /// The block layer's error: a spill's host runs that could not be
    /// backed lack `host_lacking` pages.
    pub(super) fn into_backing(self, host_lacking: u64) -> Backing {
        match self {
            Short::OverLimit(n) | Short::Device(n) => Backing::Short(n),
            Short::Host => Backing::Short(host_lacking),
            Short::Fail(e) => Backing::Fail(e.into()),
        }
    }
}

impl Inner {
    /// Backs the unmapped `pages` in `target` from the ladder (module
    /// docs): rungs 1–5 from device memory, then, unless `target` is a
    /// pinned segment, with `spill:true` rung 6. Returns what the physical
    /// layer did to the target's mapped pages (the caller updates its
    /// counters) and the outcome; on failure every handle obtained is
    /// pooled and nothing this call mapped stays mapped (but chunks whose
    /// rollback failed, in [`Backed::kept`]).
    pub(super) fn back_runs<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        pages: Pages<'_>,
        need: Need,
        exclude: Exclude,
    ) -> (Backed, Result<(), Backing>) {
        // A pinned segment (a graph pool's) never spills: its pages stay
        // device memory for as long as a graph may replay them.
        let pinned = matches!(target, Target::Segment(seg) if self.table(seg).pinned());
        let (backed, r) = self.back_device(dev, target, pages, &[], need, exclude);
        match r {
            Ok(()) => (backed, Ok(())),
            // Device memory is exhausted after reclaim: spill (spill.rs).
            // Not for pages mapped ahead of need: they are a bet on the next
            // allocation, made only from memory to spare; host memory is
            // slow and spilling may migrate live chunks.
            Err(Short::Device(lacking))
                if !pinned && self.phys.spill_enabled() && need == Need::Now =>
            {
                let found = backed.runs;
                let runs = match pages {
                    Pages::Runs(runs) => runs,
                    Pages::Span(..) => &found,
                };
                self.back_spilling(dev, target, runs, need, exclude, lacking)
            }
            // No host runs were asked for: never `Short::Host`.
            Err(e) => (backed, Err(e.into_backing(0))),
        }
    }

    /// Rungs 1–5 for `pages` (and, after them, new host chunks for `host`):
    /// asks the physical layer, and when it lacks pages makes room (rungs 4
    /// and 5) and asks again; after the driver said out of memory, asks
    /// again with what was created pooled. The runs a [`Pages::Span`] had
    /// are asked for again as runs, and come back in [`Backed::runs`].
    pub(super) fn back_device<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        target: Target,
        pages: Pages<'_>,
        host: &[(u64, u64)],
        need: Need,
        exclude: Exclude,
    ) -> (Backed, Result<(), Short>) {
        // The runs of a span, once the first ask found them.
        let is_span = matches!(pages, Pages::Span(..));
        let mut found: Option<Vec<(u64, u64)>> = None;
        // The driver said out of memory: only released memory can be created again.
        let mut driver_full = false;
        for attempt in 0..MAX_ATTEMPTS {
            let last = attempt + 1 == MAX_ATTEMPTS;
            let ask = Ask {
                pages: found.as_deref().map_or(pages, Pages::Runs),
                host,
                ahead: need == Need::Ahead,
                driver_full,
            };
            let (mut backed, r) = self.phys.back(dev, target, ask);
            if let Some(runs) = found.take() {
                backed.runs = runs;
            }
            if backed.spilled {
                self.stats.num_spills += 1;
            }
            let short = match r {
                Ok(()) => return (backed, Ok(())),
                Err(Shortfall::OverLimit(n)) => Short::OverLimit(n),
                // Pages mapped ahead of need come only from memory to spare.
                Err(Shortfall::NoSpare(n)) => Short::Device(n),
                Err(Shortfall::Lack(lack)) => match self.make_room(dev, lack, last, exclude) {
                    // Rungs 4 and 5 gave memory: plan again with it.
                    Ok(()) => {
                        if is_span {
                            found = Some(backed.runs);
                        }
                        continue;
                    }
                    Err(n) => Short::Device(n),
                },
                // Keep what was created (pooled), and plan again with it.
                Err(Shortfall::DriverFull) => {
                    driver_full = true;
                    if is_span {
                        found = Some(backed.runs);
                    }
                    continue;
                }
                Err(Shortfall::HostFull) => Short::Host,
                Err(Shortfall::Fail(e)) => Short::Fail(e),
            };
            return (backed, Err(short));
        }
        // Every attempt ended in an out-of-memory from the driver.
        self.phys.trim(dev);
        let found = found.unwrap_or_default();
        let asked = match pages {
            Pages::Runs(runs) => runs,
            Pages::Span(..) => &found,
        };
        let short = asked.iter().map(|r| r.1).sum::<u64>();
        let backed = Backed {
            runs: found,
            ..Backed::default()
        };
        (
            backed,
            Err(Short::Device(
                short.saturating_sub(self.phys.pool().pages()).max(1),
            )),
        )
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
    ) -> Result<(), u64> {
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
                return Err(lack);
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
        Err(lack - reclaimable)
    }
}
