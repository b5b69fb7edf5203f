//! The event history behind a snapshot's `device_traces` (`record_history:True`).
//!
//! One [`History`] per device: a ring buffer of at most `max_entries` events in
//! PyTorch's `TraceEntry` shape (`action`, `addr`, `size`, `stream`, `time_us`),
//! oldest dropped first, kept in time order. Segment events are derived by
//! comparing the allocator's snapshot before and after an operation, only when
//! its reserved bytes or segment count changed:
//! - a whole non-expandable segment that appears or disappears is a
//!   `segment_alloc` / `segment_free`;
//! - mapped ranges of an expandable segment (its blocks that are not
//!   `unmapped`) that appear or disappear are `segment_map` / `segment_unmap`.
//!
//! The history lock is held across the allocator call and its recording, so
//! the recorded order is the order in which the allocator acted (a free on one
//! thread and the reuse of the same address on another cannot be recorded
//! out of order).

use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::time::{SystemTime, UNIX_EPOCH};
use vmmalloc_alloc::{Allocator, BlockState, Snapshot};

pub use vmmalloc_alloc::pickle_snapshot::TraceEntry;

/// Mapped ranges, as `(address, size)`, sorted by address.
type Ranges = Vec<(u64, u64)>;

/// Ranges with the stream that owns them, as `(address, size, stream)`.
type StreamRanges = Vec<(u64, u64, u64)>;

/// The recorder's state, behind the [`History`] lock.
#[derive(Debug)]
pub struct Ring {
    max_entries: usize,
    entries: VecDeque<TraceEntry>,
    /// Whole non-expandable segments at the last look.
    segments: Ranges,
    /// Mapped ranges of expandable segments at the last look.
    mapped: Ranges,
    /// `(reserved bytes, segment count)` at the last look.
    last_reserved: (i64, i64),
    /// Events dropped because the ring was full.
    dropped: u64,
    /// Live allocations: address -> (requested size, stream), for the free events.
    live: HashMap<u64, (u64, u64)>,
}

/// A per-device event history.
#[derive(Debug)]
pub struct History {
    ring: Mutex<Ring>,
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

impl History {
    /// An empty history keeping at most `max_entries` events.
    pub fn new(max_entries: usize) -> Self {
        History {
            ring: Mutex::new(Ring {
                max_entries: max_entries.max(1),
                entries: VecDeque::new(),
                segments: Vec::new(),
                mapped: Vec::new(),
                last_reserved: (0, 0),
                dropped: 0,
                live: HashMap::new(),
            }),
        }
    }

    /// Takes the lock; hold it across the allocator call being recorded.
    pub fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock()
    }

    /// The recorded events, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.ring.lock().entries.iter().cloned().collect()
    }

    /// Events dropped because the ring buffer was full.
    pub fn dropped(&self) -> u64 {
        self.ring.lock().dropped
    }
}

impl Ring {
    /// Appends an event, dropping the oldest if full.
    pub fn push(&mut self, action: &'static str, addr: u64, size: u64, stream: u64) {
        self.push_entry(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us: now_us(),
            device_free: None,
        });
    }

    /// Appends an `alloc` event and remembers the allocation for its free.
    pub fn push_alloc(&mut self, addr: u64, size: u64, stream: u64) {
        self.live.insert(addr, (size, stream));
        self.push("alloc", addr, size, stream);
    }

    /// Appends the `free_requested` and `free_completed` events of a free.
    /// (The allocator defers reuse across streams itself and does not report
    /// when; both are recorded at the free.)
    pub fn push_free(&mut self, addr: u64) {
        let (size, stream) = self.live.remove(&addr).unwrap_or((0, 0));
        self.push("free_requested", addr, size, stream);
        self.push("free_completed", addr, size, stream);
    }

    /// Appends an `oom` event.
    pub fn push_oom(&mut self, size: u64, device_free: u64, stream: u64) {
        self.push_entry(TraceEntry {
            action: "oom",
            addr: device_free,
            size,
            stream,
            time_us: now_us(),
            device_free: Some(device_free),
        });
    }

    fn push_entry(&mut self, e: TraceEntry) {
        if self.entries.len() >= self.max_entries {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(e);
    }

    /// Records the segment events the last operation caused, if reserved
    /// memory or the segment count changed since the last look.
    pub fn segment_events(&mut self, allocator: &dyn Allocator) {
        let st = allocator.stats();
        let now = (st.reserved_bytes.all().current, st.segment.all().current);
        if now == self.last_reserved {
            return;
        }
        self.last_reserved = now;
        let (segments, mapped) = ranges(&allocator.snapshot());
        let time_us = now_us();
        let mut add = |action: &'static str, (addr, size, stream): (u64, u64, u64)| {
            self.entries.push_back(TraceEntry {
                action,
                addr,
                size,
                stream,
                time_us,
                device_free: None,
            })
        };
        let stream_of = |list: &[(u64, u64, u64)], a: u64| {
            list.iter()
                .find(|r| r.0 <= a && a < r.0 + r.1)
                .map_or(0, |r| r.2)
        };
        let (old_seg, old_map) = (
            std::mem::take(&mut self.segments),
            std::mem::take(&mut self.mapped),
        );
        for (a, s) in difference(&old_seg, &strip(&segments)) {
            add("segment_free", (a, s, 0));
        }
        for (a, s) in difference(&old_map, &strip(&mapped)) {
            add("segment_unmap", (a, s, 0));
        }
        for (a, s) in difference(&strip(&segments), &old_seg) {
            add("segment_alloc", (a, s, stream_of(&segments, a)));
        }
        for (a, s) in difference(&strip(&mapped), &old_map) {
            add("segment_map", (a, s, stream_of(&mapped, a)));
        }
        while self.entries.len() > self.max_entries {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.segments = strip(&segments);
        self.mapped = strip(&mapped);
    }
}

fn strip(r: &[(u64, u64, u64)]) -> Ranges {
    r.iter().map(|&(a, s, _)| (a, s)).collect()
}

/// Whole non-expandable segments and mapped ranges of expandable ones, each
/// `(address, size, stream)`, sorted by address.
fn ranges(snap: &Snapshot) -> (StreamRanges, StreamRanges) {
    let mut whole = Vec::new();
    let mut mapped: StreamRanges = Vec::new();
    for seg in &snap.segments {
        if !seg.is_expandable {
            whole.push((seg.address, seg.total_size, seg.stream.0));
            continue;
        }
        for b in &seg.blocks {
            if b.state == BlockState::Unmapped {
                continue;
            }
            match mapped.last_mut() {
                Some(last) if last.0 + last.1 == b.address => last.1 += b.size,
                _ => mapped.push((b.address, b.size, seg.stream.0)),
            }
        }
    }
    whole.sort_unstable();
    mapped.sort_unstable();
    (whole, mapped)
}

/// The parts of `a` not covered by `b` (both sorted, non-overlapping).
fn difference(a: &[(u64, u64)], b: &[(u64, u64)]) -> Ranges {
    let mut out = Vec::new();
    let mut j = 0;
    for &(start, size) in a {
        let end = start + size;
        let mut cur = start;
        while j < b.len() && b[j].0 + b[j].1 <= cur {
            j += 1;
        }
        let mut k = j;
        while cur < end {
            match b.get(k) {
                Some(&(bs, bz)) if bs < end => {
                    if bs > cur {
                        out.push((cur, bs - cur));
                    }
                    cur = cur.max(bs + bz);
                    k += 1;
                }
                _ => {
                    out.push((cur, end - cur));
                    cur = end;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn difference_of_ranges() {
        assert_eq!(difference(&[(0, 10)], &[]), vec![(0, 10)]);
        assert_eq!(difference(&[(0, 10)], &[(0, 10)]), vec![]);
        assert_eq!(difference(&[(0, 10)], &[(2, 3)]), vec![(0, 2), (5, 5)]);
        assert_eq!(
            difference(&[(0, 10), (20, 10)], &[(5, 20)]),
            vec![(0, 5), (25, 5)]
        );
        assert_eq!(
            difference(&[(10, 10)], &[(0, 5), (12, 2), (18, 10)]),
            vec![(10, 2), (14, 4)]
        );
    }

    #[test]
    fn ring_drops_oldest() {
        let h = History::new(3);
        {
            let mut r = h.lock();
            for i in 0..5 {
                r.push("alloc", i, 1, 0);
            }
        }
        let e = h.entries();
        assert_eq!(e.iter().map(|e| e.addr).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(h.dropped(), 2);
    }
}
