//! Counters with PyTorch's `memory_stats()` keys and meanings, plus ours.

use serde::Serialize;
use std::collections::BTreeMap;
use vmmalloc_device::CallCounts;

/// One statistic: current value, peak, and the totals added and removed
/// (PyTorch's `Stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Stat {
    /// Current value.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Total ever added.
    pub allocated: i64,
    /// Total ever removed.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (negative: removes).
    pub fn update(&mut self, amount: i64) {
        self.current += amount;
        if amount > 0 {
            self.allocated += amount;
        } else {
            self.freed -= amount;
        }
        self.peak = self.peak.max(self.current);
    }
    /// Resets the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// PyTorch's stat types: the aggregate, and the small and large pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatType {
    /// `all`.
    All = 0,
    /// `small_pool` (requests <= 1 MiB).
    Small = 1,
    /// `large_pool`.
    Large = 2,
}

impl StatType {
    /// The pool a request of `size` bytes belongs to in PyTorch (<= 1 MiB: small).
    pub fn for_size(size: u64) -> StatType {
        if size <= (1 << 20) {
            StatType::Small
        } else {
            StatType::Large
        }
    }
    const NAMES: [&'static str; 3] = ["all", "small_pool", "large_pool"];
}

/// A stat per [`StatType`]; updating a pool updates `all` too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    /// Adds `amount` to `pool` and to `all`.
    pub fn update(&mut self, pool: StatType, amount: i64) {
        debug_assert!(pool != StatType::All, "update a pool, not the aggregate");
        self.0[pool as usize].update(amount);
        self.0[StatType::All as usize].update(amount);
    }
    /// The aggregate stat.
    pub fn all(&self) -> &Stat {
        &self.0[0]
    }
    /// The stat of one type.
    pub fn get(&self, t: StatType) -> &Stat {
        &self.0[t as usize]
    }
    /// Resets every peak to its current value.
    pub fn reset_peak(&mut self) {
        self.0.iter_mut().for_each(Stat::reset_peak);
    }
}

/// Allocator statistics. Field names follow PyTorch's `DeviceStats`.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Stats {
    /// Number of live allocations.
    pub allocation: StatArray,
    /// Number of segments (device allocations / expandable segments).
    pub segment: StatArray,
    /// Number of active blocks (allocated or pending free).
    pub active: StatArray,
    /// Number of inactive blocks that are split (not whole segments).
    pub inactive_split: StatArray,
    /// Bytes in live allocations (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes reserved from the device (mapped pages or segments).
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes requested by callers of live allocations.
    pub requested_bytes: StatArray,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Times an allocation freed cache and retried.
    pub num_alloc_retries: u64,
    /// Out-of-memory errors returned.
    pub num_ooms: u64,
    /// Device-wide synchronizations forced (PyTorch: `synchronize_and_free_events`).
    pub num_sync_all_streams: u64,
    /// Device allocations (segments created / pages created).
    pub num_device_alloc: u64,
    /// Device frees (segments released / pages released).
    pub num_device_free: u64,
    /// `max_split_size` in bytes (-1 / i64::MAX semantics as PyTorch: MAX when unlimited).
    pub max_split_size: i64,
    /// Ours: physical pages currently mapped.
    pub pages_mapped: u64,
    /// Ours: physical pages currently pooled (unmapped, handle kept).
    pub pages_pooled: u64,
    /// Ours: physical handles (chunks of one or more pages) currently mapped.
    pub handles_mapped: u64,
    /// Ours: physical handles currently pooled.
    pub handles_pooled: u64,
    /// Ours: targeted reclaims performed.
    pub reclaims: u64,
    /// Ours: free chunks split (unmapped to be re-backed by exact chunks)
    /// because a block would have covered them only in part while memory
    /// was tight.
    pub chunk_splits: u64,
    /// Ours: bytes unmapped by targeted reclaims.
    pub reclaimed_bytes: u64,
    /// Ours: chunks unpinned: partly live chunks whose live pages were
    /// re-backed by exact chunks so that their free pages could be given
    /// back (docs/expandable.md, "Unpinning").
    pub chunk_unpins: u64,
    /// Ours: free bytes given back by unpinning.
    pub unpinned_bytes: u64,
    /// Ours: live bytes copied (through host memory) by unpinning.
    pub unpin_copied_bytes: u64,
    /// Ours: device-wide synchronizations (`cuCtxSynchronize`) made before
    /// unpinning (graph pools count theirs in `num_sync_all_streams`, IPC
    /// re-backing in `ipc_rebacks`).
    pub unpin_device_syncs: u64,
    /// Ours: allocations that needed unpinning where `unpin:auto` declined
    /// it because another host thread may have been running alongside
    /// (docs/expandable.md, "Unpinning and threads").
    pub unpin_refusals: u64,
    /// Ours: re-backings of chunks with equal handles begun for IPC exports
    /// in PyTorch's format, each after one device-wide synchronize (counted
    /// whether or not it then succeeded; `crate::ipc`,
    /// `Export::export_equal` (`Allocator::as_export`)).
    pub ipc_rebacks: u64,
    /// Ours: bytes the re-backings that succeeded moved.
    pub ipc_rebacked_bytes: u64,
    /// Ours: bytes of host-located chunks mapped now (spill, `spill:true`;
    /// docs/expandable.md, "Spill and pressure").
    pub spilled_bytes: u64,
    /// Ours: the most `spilled_bytes` seen.
    pub spilled_bytes_peak: u64,
    /// Ours: requests backed by host memory because device memory ran out.
    pub num_spills: u64,
    /// Ours: spilled chunks moved back to device memory at a quiet point.
    pub spill_migrations: u64,
    /// Ours: stream (not device) synchronizations and event waits forced.
    pub num_stream_syncs: u64,
    /// Ours: device calls made by this allocator, per kind.
    pub driver_calls: CallCounts,
    /// Bytes reserved (mapped) in each private pool (graph pools and
    /// `torch.cuda.MemPool`s), by pool id: PyTorch 2.13+'s
    /// `DeviceStats::reserved_bytes_by_private_pools`
    /// (c10/core/CachingDeviceAllocator.h: "current drops to 0 when a pool
    /// is deleted, while peak/allocated/freed are preserved until reset").
    /// A pool appears once memory was mapped for it. Not serialized (its
    /// keys are tuples); [`Stats::to_map`] writes it flattened as
    /// `torch.cuda.memory_stats()` does (`(0, 1)` becomes `"0_1"`).
    #[serde(skip)]
    pub reserved_bytes_by_private_pools: BTreeMap<crate::pools::PoolId, StatArray>,
}

impl Stats {
    /// Resets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for a in [
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
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
        self.reserved_bytes_by_private_pools
            .values_mut()
            .for_each(StatArray::reset_peak);
    }

    /// The stats as PyTorch's flat `memory_stats()` dictionary
    /// (`"allocated_bytes.all.current"`, `"num_alloc_retries"`, ...), plus ours
    /// under `vmmalloc.*` (`vmmalloc.pages_mapped`, `vmmalloc.driver_calls.create`, ...).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        let arrays: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        let put = |m: &mut BTreeMap<String, i64>, prefix: String, s: &Stat| {
            m.insert(format!("{prefix}.current"), s.current);
            m.insert(format!("{prefix}.peak"), s.peak);
            m.insert(format!("{prefix}.allocated"), s.allocated);
            m.insert(format!("{prefix}.freed"), s.freed);
        };
        for (name, arr) in arrays {
            for (i, t) in StatType::NAMES.iter().enumerate() {
                put(&mut m, format!("{name}.{t}"), &arr.0[i]);
            }
        }
        for ((hi, lo), arr) in &self.reserved_bytes_by_private_pools {
            for (i, t) in StatType::NAMES.iter().enumerate() {
                let prefix = format!("reserved_bytes_by_private_pools.{hi}_{lo}.{t}");
                put(&mut m, prefix, &arr.0[i]);
            }
        }
        put(
            &mut m,
            "oversize_allocations".into(),
            &self.oversize_allocations,
        );
        put(&mut m, "oversize_segments".into(), &self.oversize_segments);
        m.insert("num_alloc_retries".into(), self.num_alloc_retries as i64);
        m.insert("num_ooms".into(), self.num_ooms as i64);
        m.insert(
            "num_sync_all_streams".into(),
            self.num_sync_all_streams as i64,
        );
        m.insert("num_device_alloc".into(), self.num_device_alloc as i64);
        m.insert("num_device_free".into(), self.num_device_free as i64);
        m.insert("max_split_size".into(), self.max_split_size);
        m.insert("vmmalloc.pages_mapped".into(), self.pages_mapped as i64);
        m.insert("vmmalloc.pages_pooled".into(), self.pages_pooled as i64);
        m.insert("vmmalloc.handles_mapped".into(), self.handles_mapped as i64);
        m.insert("vmmalloc.handles_pooled".into(), self.handles_pooled as i64);
        m.insert("vmmalloc.reclaims".into(), self.reclaims as i64);
        m.insert("vmmalloc.chunk_splits".into(), self.chunk_splits as i64);
        m.insert("vmmalloc.chunk_unpins".into(), self.chunk_unpins as i64);
        m.insert("vmmalloc.unpinned_bytes".into(), self.unpinned_bytes as i64);
        m.insert(
            "vmmalloc.unpin_copied_bytes".into(),
            self.unpin_copied_bytes as i64,
        );
        m.insert(
            "vmmalloc.unpin_device_syncs".into(),
            self.unpin_device_syncs as i64,
        );
        m.insert("vmmalloc.unpin_refusals".into(), self.unpin_refusals as i64);
        m.insert("vmmalloc.ipc_rebacks".into(), self.ipc_rebacks as i64);
        m.insert(
            "vmmalloc.ipc_rebacked_bytes".into(),
            self.ipc_rebacked_bytes as i64,
        );
        m.insert("vmmalloc.spilled_bytes".into(), self.spilled_bytes as i64);
        m.insert(
            "vmmalloc.spilled_bytes_peak".into(),
            self.spilled_bytes_peak as i64,
        );
        m.insert("vmmalloc.num_spills".into(), self.num_spills as i64);
        m.insert(
            "vmmalloc.spill_migrations".into(),
            self.spill_migrations as i64,
        );
        m.insert(
            "vmmalloc.reclaimed_bytes".into(),
            self.reclaimed_bytes as i64,
        );
        m.insert(
            "vmmalloc.num_stream_syncs".into(),
            self.num_stream_syncs as i64,
        );
        for (name, n) in self.driver_calls.nonzero() {
            m.insert(format!("vmmalloc.driver_calls.{name}"), n as i64);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_current_peak_allocated_freed() {
        let mut s = Stat::default();
        s.update(10);
        s.update(-4);
        s.update(3);
        assert_eq!((s.current, s.peak, s.allocated, s.freed), (9, 10, 13, 4));
        s.reset_peak();
        assert_eq!(s.peak, 9);
    }

    #[test]
    fn map_has_pytorch_keys() {
        let mut st = Stats::default();
        st.allocated_bytes.update(StatType::Large, 100);
        let m = st.to_map();
        assert_eq!(m["allocated_bytes.all.current"], 100);
        assert_eq!(m["allocated_bytes.large_pool.peak"], 100);
        assert_eq!(m["allocated_bytes.small_pool.current"], 0);
        for k in [
            "reserved_bytes.all.freed",
            "num_alloc_retries",
            "num_ooms",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
            "inactive_split_bytes.all.peak",
            "requested_bytes.all.allocated",
            "segment.all.current",
            "allocation.all.current",
            "active_bytes.all.current",
        ] {
            assert!(m.contains_key(k), "{k}");
        }
    }
}
