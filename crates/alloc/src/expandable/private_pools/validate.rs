//! The private pools' invariants, checked by `validate()`.

use super::super::blocks::BlockState;
use super::super::Inner;
use crate::pools::{pool_name, PoolId};
use std::collections::BTreeMap;

impl Inner {
    /// The pools' invariants: ids and slots agree; `captures` counts the
    /// recording pools; every deferred block is pending with no event and
    /// streams to record on (`validate_blocks` checks the converse); each
    /// pool's segments are pinned as the pool is (paused pools excepted)
    /// and no main-pool segment is pinned.
    pub(in crate::expandable) fn validate_pools(&self) -> Result<(), String> {
        for (slot, x) in self.pools.slots.iter().enumerate() {
            let Some(x) = x else { continue };
            let listed = self.pools.oom_pools.contains(&(slot as u32 + 1));
            if listed != x.use_on_oom {
                return Err(format!(
                    "pool {}: use_on_oom is {} but the list of such pools {} it",
                    pool_name(x.id),
                    x.use_on_oom,
                    if listed { "holds" } else { "lacks" }
                ));
            }
        }
        if let Some(&p) = self
            .pools
            .oom_pools
            .iter()
            .find(|&&p| self.pools.get(p).is_none())
        {
            return Err(format!(
                "the use_on_oom list names pool number {p}, which is gone"
            ));
        }
        for (&id, &s) in &self.pools.by_id {
            match self.pools.get(s + 1) {
                Some(x) if x.id == id => {}
                _ => {
                    return Err(format!(
                        "pool {} maps to a slot of another pool",
                        pool_name(id)
                    ))
                }
            }
        }
        let live = self.pools.slots.iter().flatten().count();
        if live != self.pools.by_id.len() {
            return Err(format!(
                "{live} pool slots but {} ids",
                self.pools.by_id.len()
            ));
        }
        let recording = self
            .pools
            .slots
            .iter()
            .flatten()
            .filter(|x| x.recording)
            .count();
        if recording as u32 != self.pools.captures {
            return Err(format!(
                "{} captures underway but {recording} pools recording",
                self.pools.captures
            ));
        }
        for &idx in &self.pools.deferred {
            let b = &self.slab[idx];
            if b.state != BlockState::PendingFree || b.pending_events != 0 || b.streams.is_none() {
                return Err(format!(
                    "deferred block {:#x} is not pending without events",
                    b.addr
                ));
            }
        }
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let e = &self.streams[s.owner as usize];
            let want = if e.pool == 0 {
                false
            } else {
                match self.pools.get(e.pool) {
                    None => return Err(format!("segment {si} belongs to a pool that is gone")),
                    Some(x) if x.paused.is_some() => continue,
                    Some(x) => x.pinned,
                }
            };
            if self.table(si as u32).pinned() != want {
                return Err(format!(
                    "segment {si} is {}pinned, but its owner {}",
                    if want { "not " } else { "" },
                    if want { "is" } else { "is not" }
                ));
            }
        }
        self.validate_pool_reserved()
    }

    /// `reserved_bytes_by_private_pools`: each pool id's `current` is what
    /// its segments map now (small, large, and their sum); an id whose
    /// pools have gone has 0; every pool that maps memory has an entry.
    fn validate_pool_reserved(&self) -> Result<(), String> {
        let mut want: BTreeMap<PoolId, [i64; 2]> = BTreeMap::new();
        for s in self.owned_segments(|e| e.pool != 0) {
            let seg = self.seg(s);
            let p = self.streams[seg.owner as usize].pool;
            let bytes = self.table(s).mapped_pages() * self.layout.page;
            want.entry(self.pools.ids[p as usize - 1]).or_default()[seg.kind as usize] +=
                bytes as i64;
        }
        for (id, arr) in &self.stats.reserved_bytes_by_private_pools {
            let w = want.remove(id).unwrap_or_default();
            let got = [arr.0[1].current, arr.0[2].current];
            if got != w || arr.0[0].current != w[0] + w[1] {
                return Err(format!(
                    "pool {}: reserved_bytes_by_private_pools says {} (small {}, large {}) \
                     but its segments map {} (small {}, large {})",
                    pool_name(*id),
                    arr.0[0].current,
                    got[0],
                    got[1],
                    w[0] + w[1],
                    w[0],
                    w[1]
                ));
            }
        }
        match want.into_iter().find(|(_, w)| w[0] + w[1] != 0) {
            Some((id, w)) => Err(format!(
                "pool {} maps {} bytes but reserved_bytes_by_private_pools has no entry for it",
                pool_name(id),
                w[0] + w[1]
            )),
            None => Ok(()),
        }
    }
}
