//! Fast-path counters for PyTorch's stat families.
//!
//! A [`crate::stats::StatArray`] update touches two `Stat`s (the pool and
//! `all`), four fields each; a cache-hit malloc + free pair makes fourteen of
//! them. [`Family`] keeps only what cannot be derived: per pool the current
//! value, peak and total added, and the peak of the sum. `freed` = added −
//! current and `all` = small + large are computed when [`Counters::fill`]
//! builds the `Stats` that callers see.

use crate::stats::{Stat, StatArray};
use crate::Stats;

/// One stat family, e.g. `allocated_bytes`, indexed by pool (0 small, 1 large).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Family {
    cur: [i64; 2],
    peak: [i64; 2],
    added: [i64; 2],
    all_peak: i64,
}

impl Family {
    /// Adds `d` (negative: removes) to pool `pool`.
    #[inline]
    pub fn add(&mut self, pool: usize, d: i64) {
        self.cur[pool] += d;
        if d > 0 {
            self.added[pool] += d;
            self.peak[pool] = self.peak[pool].max(self.cur[pool]);
            self.all_peak = self.all_peak.max(self.cur[0] + self.cur[1]);
        }
    }

    /// The current value of the sum.
    pub fn current(&self) -> i64 {
        self.cur[0] + self.cur[1]
    }

    fn reset_peak(&mut self) {
        self.peak = self.cur;
        self.all_peak = self.current();
    }

    fn to_array(self) -> StatArray {
        let stat = |cur: i64, peak: i64, added: i64| Stat {
            current: cur,
            peak,
            allocated: added,
            freed: added - cur,
        };
        StatArray([
            stat(self.current(), self.all_peak, self.added[0] + self.added[1]),
            stat(self.cur[0], self.peak[0], self.added[0]),
            stat(self.cur[1], self.peak[1], self.added[1]),
        ])
    }
}

/// The nine PyTorch families the allocator updates.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    /// `allocation`.
    pub allocation: Family,
    /// `segment`.
    pub segment: Family,
    /// `active`.
    pub active: Family,
    /// `inactive_split`.
    pub inactive_split: Family,
    /// `allocated_bytes`.
    pub allocated_bytes: Family,
    /// `reserved_bytes`.
    pub reserved_bytes: Family,
    /// `active_bytes`.
    pub active_bytes: Family,
    /// `inactive_split_bytes`.
    pub inactive_split_bytes: Family,
    /// `requested_bytes`.
    pub requested_bytes: Family,
}

impl Counters {
    /// Writes the families into `stats`.
    pub fn fill(&self, stats: &mut Stats) {
        stats.allocation = self.allocation.to_array();
        stats.segment = self.segment.to_array();
        stats.active = self.active.to_array();
        stats.inactive_split = self.inactive_split.to_array();
        stats.allocated_bytes = self.allocated_bytes.to_array();
        stats.reserved_bytes = self.reserved_bytes.to_array();
        stats.active_bytes = self.active_bytes.to_array();
        stats.inactive_split_bytes = self.inactive_split_bytes.to_array();
        stats.requested_bytes = self.requested_bytes.to_array();
    }

    /// Resets every peak to the current value.
    pub fn reset_peak(&mut self) {
        for f in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            f.reset_peak();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StatType;

    /// The compact family gives exactly what `StatArray::update` gives.
    #[test]
    fn family_matches_stat_array() {
        let mut f = Family::default();
        let mut a = StatArray::default();
        let steps = [
            (0, 5),
            (1, 7),
            (0, -3),
            (1, 4),
            (1, -11),
            (0, 9),
            (0, -11),
            (1, 2),
        ];
        for (i, &(pool, d)) in steps.iter().enumerate() {
            f.add(pool, d);
            a.update(
                if pool == 0 {
                    StatType::Small
                } else {
                    StatType::Large
                },
                d,
            );
            assert_eq!(f.to_array(), a, "after step {i}");
            if i == 4 {
                f.reset_peak();
                a.0.iter_mut().for_each(Stat::reset_peak);
                assert_eq!(f.to_array(), a);
            }
        }
    }
}
