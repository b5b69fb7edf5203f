//! The budget: how much device memory the physical layer may hold. It is
//! charged before every `cuMemCreate` of device memory and credited when
//! such a handle is released (host-located handles, spill's, are not device
//! memory and never charged), so that its `charged` total is always the
//! device pages the allocator holds: mapped, pooled, or in the hands of an
//! operation between its create and its map.
//!
//! The shape follows RMM's `limiting_resource_adaptor` (STYLE.md, "Small
//! interfaces, behaviour by composition"): reserve before allocating from
//! upstream, roll the reservation back when upstream fails
//! ([`super::Physical::create`] credits a charge back when the create
//! fails).
//!
//! [`LocalBudget`] is today's limit: the memory fraction of the device
//! (PyTorch's `set_per_process_memory_fraction`, `allowed_memory_maximum`
//! in `CUDACachingAllocator.cpp`), as pages. A budget shared by the
//! processes on one GPU (issue 33, part 2) implements the same trait: its
//! `room`/`fits` answer for the group, its `charge` may refuse when another
//! member holds the memory.
//!
//! Two questions, two kinds of answer:
//!
//! - **Planning** ([`Budget::room`], [`Budget::fits`]): given the device
//!   pages held now (mapped + pooled, as the ladder counts them,
//!   `ladder.rs`), how many more may be created? The ladder decides from
//!   these which rungs to take.
//! - **Charging** ([`Budget::charge`], [`Budget::credit`]): the bookkeeping
//!   of each create and release, refused only when a create of
//!   [`Charge::Grow`] would take the charged total above the limit. The
//!   planning above makes the local budget never refuse a create the
//!   allocator made before budgets existed (replay JSON byte-identical,
//!   issue 33), so a refusal there is treated as the driver's
//!   out-of-memory.

use std::fmt;
use vmmalloc_device::{Call, DeviceError};

/// What a charge is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Charge {
    /// New memory: refused when it would take the charged total above the
    /// limit.
    Grow,
    /// Memory that takes the place of memory the same operation released
    /// just before (unpinning in place, restoring a chunk after a failed
    /// unpin, `moves.rs`): the operation's net charge is not positive, so
    /// it is never refused, even above a lowered limit.
    Replace,
}

/// How much device memory the physical layer may hold (module docs).
pub(crate) trait Budget: Send + Sync + fmt::Debug {
    /// Most device pages that may be held (the local limit).
    fn limit_pages(&self) -> u64;

    /// The memory fraction in force (the share of device memory the limit
    /// is).
    fn fraction(&self) -> f64;

    /// Sets the fraction and the limit in pages it gives (pages already
    /// held above it are the caller's to release).
    fn set_fraction(&mut self, fraction: f64, limit_pages: u64);

    /// Pages that may still be created while `held` device pages are held.
    fn room(&self, held: u64) -> u64;

    /// Whether holding `held` device pages is within the budget.
    fn fits(&self, held: u64) -> bool;

    /// Charges `pages` before a create. `Err` (as the driver's
    /// out-of-memory for `Call::Create`) when refused; nothing is charged
    /// then.
    fn charge(&mut self, pages: u64, page: u64, kind: Charge) -> Result<(), DeviceError>;

    /// Credits `pages` after a release (or after a charged create failed).
    fn credit(&mut self, pages: u64);

    /// Device pages charged and not credited.
    fn charged(&self) -> u64;

    /// What an out-of-memory report should add about this budget (a shared
    /// one names its group and members); `None` for the local budget.
    fn explain(&self) -> Option<String> {
        None
    }

    /// Starts keeping credits for an operation that swaps physical memory
    /// (unpinning in place, `moves.rs`): until [`Budget::end_keep`], a
    /// credit is kept for the operation's replacements instead of given
    /// back, and a [`Charge::Replace`] takes from what is kept first. The
    /// bytes released to be replaced are then never free for anyone else in
    /// between, so a budget shared by processes holds "charges ≤ total" at
    /// every instant (issue 41, part 3). The local budget has nobody to
    /// keep them from: no-op.
    fn begin_keep(&mut self) {}

    /// Ends [`Budget::begin_keep`]: what was kept and not taken is given
    /// back.
    fn end_keep(&mut self) {}

    /// Called once before an allocation is refused for lack of memory:
    /// whether the limit may have grown since it was planned with (a
    /// shared budget gives back the bytes of members that died), so that
    /// trying again is worth it. `false` for the local budget.
    fn recheck(&mut self) -> bool {
        false
    }
}

/// Today's limit: a fraction of the device's memory, in pages, for this
/// allocator alone.
#[derive(Debug, Clone)]
pub(crate) struct LocalBudget {
    /// The memory fraction in force.
    fraction: f64,
    /// Most device pages that may be held.
    limit_pages: u64,
    /// Pages charged and not credited.
    charged: u64,
}

impl LocalBudget {
    /// A budget of `limit_pages` pages, the `fraction` of the device.
    pub fn new(fraction: f64, limit_pages: u64) -> LocalBudget {
        LocalBudget {
            fraction,
            limit_pages,
            charged: 0,
        }
    }
}

impl Budget for LocalBudget {
    #[inline]
    fn limit_pages(&self) -> u64 {
        self.limit_pages
    }

    #[inline]
    fn fraction(&self) -> f64 {
        self.fraction
    }

    fn set_fraction(&mut self, fraction: f64, limit_pages: u64) {
        self.fraction = fraction;
        self.limit_pages = limit_pages;
    }

    #[inline]
    fn room(&self, held: u64) -> u64 {
        self.limit_pages.saturating_sub(held)
    }

    #[inline]
    fn fits(&self, held: u64) -> bool {
        held <= self.limit_pages
    }

    fn charge(&mut self, pages: u64, page: u64, kind: Charge) -> Result<(), DeviceError> {
        if kind == Charge::Grow && self.charged + pages > self.limit_pages {
            return Err(DeviceError::OutOfMemory {
                call: Call::Create,
                requested: pages * page,
                free: self.limit_pages.saturating_sub(self.charged) * page,
                total: self.limit_pages * page,
            });
        }
        self.charged += pages;
        Ok(())
    }

    #[inline]
    fn credit(&mut self, pages: u64) {
        debug_assert!(
            pages <= self.charged,
            "credit of {pages} pages, {} charged",
            self.charged
        );
        self.charged = self.charged.saturating_sub(pages);
    }

    #[inline]
    fn charged(&self) -> u64 {
        self.charged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 2 << 20;

    #[test]
    fn a_grow_within_the_limit_is_charged_and_one_above_is_refused() {
        let mut b = LocalBudget::new(0.5, 10);
        b.charge(6, PAGE, Charge::Grow).unwrap();
        let e = b.charge(5, PAGE, Charge::Grow).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert!(
            matches!(e, DeviceError::OutOfMemory { requested, free, total, .. }
                if requested == 5 * PAGE && free == 4 * PAGE && total == 10 * PAGE),
            "{e:?}"
        );
        assert_eq!(b.charged(), 6, "a refused charge charges nothing");
        b.charge(4, PAGE, Charge::Grow).unwrap();
        assert_eq!(b.charged(), 10);
        b.credit(3);
        assert_eq!(b.charged(), 7);
    }

    #[test]
    fn a_replacement_is_charged_even_above_a_lowered_limit() {
        let mut b = LocalBudget::new(1.0, 10);
        b.charge(10, PAGE, Charge::Grow).unwrap();
        b.set_fraction(0.5, 5);
        assert!(!b.fits(10));
        b.credit(4); // unpinning in place released a 4-page chunk ...
        b.charge(1, PAGE, Charge::Replace).unwrap(); // ... for its live page
        assert_eq!(b.charged(), 7);
        assert!(b.charge(1, PAGE, Charge::Grow).is_err());
    }

    #[test]
    fn room_and_fits_are_todays_limit_arithmetic() {
        let b = LocalBudget::new(0.25, 8);
        assert_eq!((b.room(3), b.room(8), b.room(12)), (5, 0, 0));
        assert!(b.fits(8) && !b.fits(9));
        assert_eq!((b.limit_pages(), b.fraction()), (8, 0.25));
    }
}
