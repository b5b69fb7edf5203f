//! The mapping log: an [`Observer`] that keeps, while someone asks for them,
//! the table mappings the physical layer made and undid — what PyTorch's
//! memory history records as `segment_map` / `segment_unmap` for its own
//! expandable segments (`ExpandableSegment::mapAndSetAccess` / `unmapHandles`
//! call `trace_hook_` with `SEGMENT_MAP` / `SEGMENT_UNMAP`,
//! c10/cuda/CUDACachingAllocator.cpp). The C ABI's history ring drains it
//! ([`crate::MappingLog::take_mappings`]) instead of comparing the
//! allocator's state before and after each call (issue 33).
//!
//! Only successful maps and unmaps of tables (segments and growable regions)
//! are kept: unpinning's scratch mappings never hold user memory, and a
//! failed call changed nothing. A chunk that moves (unpinning, spill) is an
//! unmap and a map of the same pages; whoever drains the log nets them out.
//!
//! Cost: nothing while the log is off beyond one relaxed load per driver
//! call (never on a cache hit); while on, one uncontended lock and a push.

use super::observe::{Observer, Owner, PhysEvent};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use vmmalloc_device::Call;

/// One table mapping made or undone, as the observer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MappingRecord {
    /// A map (true) or an unmap (false).
    pub mapped: bool,
    /// The table it was made for (its stream is looked up when drained).
    pub owner: Owner,
    /// First byte.
    pub addr: u64,
    /// Bytes.
    pub bytes: u64,
}

/// The log the observer writes and the allocator drains, shared between
/// them (the observer lives inside the physical layer).
#[derive(Debug, Default)]
pub(crate) struct MappingLog {
    /// Whether records are kept.
    on: AtomicBool,
    /// Records not yet drained, oldest first.
    records: parking_lot::Mutex<Vec<MappingRecord>>,
}

impl MappingLog {
    /// Starts (`true`) or stops keeping records; stopping drops those kept.
    pub fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
        if !on {
            self.records.lock().clear();
        }
    }

    /// Whether records are being kept.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Whether no record waits to be drained.
    pub fn is_empty(&self) -> bool {
        self.records.lock().is_empty()
    }

    /// Takes every record kept so far, oldest first.
    pub fn take(&self) -> Vec<MappingRecord> {
        std::mem::take(&mut *self.records.lock())
    }
}

/// The observer half of a [`MappingLog`], attached to the physical layer.
#[derive(Debug)]
pub(crate) struct MappingObserver(pub Arc<MappingLog>);

impl Observer for MappingObserver {
    fn observe(&mut self, ev: &PhysEvent) {
        if !ev.ok || !ev.owner.is_table() || !self.0.is_on() {
            return;
        }
        let mapped = match ev.call {
            Call::Map => true,
            Call::Unmap => false,
            _ => return,
        };
        self.0.records.lock().push(MappingRecord {
            mapped,
            owner: ev.owner,
            addr: ev.addr,
            bytes: ev.bytes,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_successful_table_maps_and_unmaps_while_on() {
        let log = Arc::new(MappingLog::default());
        let mut obs = MappingObserver(Arc::clone(&log));
        let map = PhysEvent {
            ok: true,
            ..PhysEvent::new(Call::Map, Owner::Segment(3)).at(1 << 30, 2 << 20)
        };
        obs.observe(&map); // off: not kept
        assert!(log.is_empty());
        log.set_on(true);
        obs.observe(&map);
        obs.observe(&PhysEvent { ok: false, ..map }); // failed
        obs.observe(&PhysEvent {
            owner: Owner::Scratch,
            ..map
        }); // not a table
        obs.observe(&PhysEvent {
            call: Call::SetAccess,
            ..map
        }); // not a mapping
        obs.observe(&PhysEvent {
            call: Call::Unmap,
            owner: Owner::Region(1 << 40),
            ..map
        });
        let got = log.take();
        assert_eq!(
            got,
            vec![
                MappingRecord {
                    mapped: true,
                    owner: Owner::Segment(3),
                    addr: 1 << 30,
                    bytes: 2 << 20
                },
                MappingRecord {
                    mapped: false,
                    owner: Owner::Region(1 << 40),
                    addr: 1 << 30,
                    bytes: 2 << 20
                },
            ]
        );
        assert!(log.is_empty());
        obs.observe(&map);
        log.set_on(false);
        assert!(log.is_empty(), "stopping drops what was kept");
    }
}
