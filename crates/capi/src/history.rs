//! The event history behind a snapshot's `device_traces`: `record_history:True`,
//! or turned on and off at run time by PyTorch's
//! `torch.cuda.memory._record_memory_history` (through the torch companion's
//! `recordHistory` and [`crate::torch_abi::vmmalloc_record_history`]).
//!
//! One [`History`] per device: a ring buffer of at most `max_entries` events in
//! PyTorch's `TraceEntry` shape (`action`, `addr`, `size`, `stream`, `time_us`),
//! oldest dropped first, kept in time order. Segment events come from where
//! memory is made:
//! - under `expandable`, from its physical layer: an observer there logs
//!   every map and unmap of a table as it happens
//!   ([`vmmalloc_alloc::MappingLog::log_mappings`], `expandable/physical/mappings.rs`), and the
//!   ring turns what an operation changed in the end ([`net_mappings`]: a
//!   chunk that unpinning or spill moved is unmapped and mapped again at the
//!   same addresses, which changes nothing) into `segment_unmap` /
//!   `segment_map` events, as PyTorch's expandable segments record them;
//! - under the other policies (replicas of PyTorch's allocators over the
//!   `Device` layer, with no physical layer to observe), by comparing the
//!   allocator's snapshot before and after an operation, only when its
//!   reserved bytes or segment count changed: a whole non-expandable segment
//!   that appears or disappears is a `segment_alloc` / `segment_free`, mapped
//!   ranges of an expandable one that appear or disappear are
//!   `segment_map` / `segment_unmap`.
//!
//! The history lock is held across the allocator call and its recording, so
//! the recorded order is the order in which the allocator acted (a free on one
//! thread and the reuse of the same address on another cannot be recorded
//! out of order).
//!
//! Every recorded event is also handed, in that order and on the thread that
//! caused it, to the trace sink ([`set_sink`]) if one is set: the torch
//! companion attaches PyTorch's own stack context (`CapturedTraceback`) to it
//! and keeps PyTorch's `TraceEntry` ring, so `torch.cuda.memory._snapshot()`
//! carries frames. With history off the hot path reads one relaxed atomic
//! ([`History::is_on`]).

use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use vmmalloc_alloc::pools::PoolId;
use vmmalloc_alloc::{Allocator, BlockState, MappingChange, Snapshot};

pub use vmmalloc_alloc::pickle_snapshot::TraceEntry;

/// Mapped ranges, as `(address, size)`, sorted by address.
type Ranges = Vec<(u64, u64)>;

/// Ranges with the stream that owns them, as `(address, size, stream)`.
type StreamRanges = Vec<(u64, u64, u64)>;

/// The actions of PyTorch's `TraceEntry::Action`, in its enum's order: an
/// action's index is its code in [`VmmallocTraceEntry::action`] (the
/// allocator crate's list, which the trace reader reads them by too).
pub use vmmalloc_alloc::pickle_snapshot::TRACE_ACTIONS as ACTIONS;

/// The code of `action` in [`ACTIONS`] (-1 if unknown).
pub fn action_code(action: &str) -> c_int {
    ACTIONS
        .iter()
        .position(|a| *a == action)
        .map_or(-1, |i| i as c_int)
}

/// One event as the trace sink receives it (C layout; the torch companion's
/// `TraceEvent`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmallocTraceEntry {
    /// Device ordinal.
    pub device: c_int,
    /// The action's index in [`ACTIONS`].
    pub action: c_int,
    /// Address; for `oom`, the device's free bytes (as PyTorch's `addr_`).
    pub addr: u64,
    /// Bytes (requested size for `alloc` and the frees).
    pub size: u64,
    /// The stream (a `cudaStream_t` value).
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// The private pool of an allocation or free ((0, 0): the main pool).
    pub pool_hi: u64,
    /// Second half of the pool id.
    pub pool_lo: u64,
}

/// The trace sink's type: called with each event, on the thread that caused
/// it, while the device's history lock is held. It must not unwind and must
/// not call back into libvmmalloc.
pub type TraceSink = unsafe extern "C" fn(*const VmmallocTraceEntry);

/// The trace sink, or null.
static SINK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Sets (or, with None, clears) the process-wide trace sink.
pub fn set_sink(sink: Option<TraceSink>) {
    SINK.store(
        sink.map_or(std::ptr::null_mut(), |f| f as *mut ()),
        Ordering::Release,
    );
}

fn sink() -> Option<TraceSink> {
    let p = SINK.load(Ordering::Acquire);
    // SAFETY: SINK holds null or a `TraceSink` stored by `set_sink`; function
    // pointers and data pointers have the same size on every target we build.
    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut (), TraceSink>(p) })
}

/// The recorder's state, behind the [`History`] lock.
#[derive(Debug)]
pub struct Ring {
    /// The device ordinal the events are of.
    device: c_int,
    max_entries: usize,
    /// Whether events are kept here (off when only the sink wants them).
    keep: bool,
    entries: VecDeque<TraceEntry>,
    /// Whether the allocator reports its mappings as they happen
    /// ([`vmmalloc_alloc::MappingLog::log_mappings`]: `expandable`, its physical layer's
    /// observer); otherwise segment events come from comparing snapshots.
    observed: bool,
    /// The mappings taken from the allocator, reused between looks.
    changes: Vec<MappingChange>,
    /// Whole non-expandable segments at the last look.
    segments: Ranges,
    /// Mapped ranges of expandable segments at the last look.
    mapped: Ranges,
    /// `(reserved bytes, segment count)` at the last look.
    last_reserved: (i64, i64),
    /// Events dropped because the ring was full.
    dropped: u64,
    /// Live allocations: address -> (requested size, stream, pool), for the free events.
    live: HashMap<u64, (u64, u64, PoolId)>,
}

/// A per-device event history.
#[derive(Debug)]
pub struct History {
    ring: Mutex<Ring>,
    /// Whether events are recorded (one relaxed load on the hot path).
    on: AtomicBool,
}

/// Microseconds since the Unix epoch (0 if the clock is before it).
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// How recording is set: [`History::set`]'s argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recording {
    /// Record events.
    pub enabled: bool,
    /// Ring size (at least 1).
    pub max_entries: usize,
    /// Drop the events recorded so far (always done when disabling, as
    /// PyTorch's `recordHistory` does).
    pub clear: bool,
    /// Keep events in this ring (off: only the trace sink receives them).
    pub keep: bool,
}

impl History {
    /// An empty history of device `device` keeping at most `max_entries`
    /// events, recording from the start if `on`.
    pub fn new(device: u32, max_entries: usize, on: bool) -> Self {
        History {
            ring: Mutex::new(Ring {
                device: device as c_int,
                max_entries: max_entries.max(1),
                keep: true,
                entries: VecDeque::new(),
                observed: false,
                changes: Vec::new(),
                segments: Vec::new(),
                mapped: Vec::new(),
                last_reserved: (0, 0),
                dropped: 0,
                live: HashMap::new(),
            }),
            on: AtomicBool::new(on),
        }
    }

    /// Whether events are being recorded.
    #[inline]
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts, changes or stops recording (PyTorch's `recordHistory`:
    /// c10/cuda/CUDACachingAllocator.cpp, `if (!enabled || clearHistory)
    /// alloc_buffer.clear()`). Turned on, the recorder first takes
    /// `allocator`'s current state as its baseline: what is mapped and live
    /// already causes no event, and a later free of a block allocated before
    /// recording carries its size and stream.
    pub fn set(&self, how: Recording, allocator: &dyn Allocator) {
        let was_on = self.on.swap(how.enabled, Ordering::SeqCst);
        let mut ring = self.ring.lock();
        ring.max_entries = how.max_entries.max(1);
        ring.keep = how.keep;
        if !how.enabled || how.clear || !how.keep {
            ring.entries.clear();
            ring.dropped = 0;
        }
        while ring.entries.len() > ring.max_entries {
            ring.entries.pop_front();
            ring.dropped += 1;
        }
        if how.enabled && !was_on {
            // The log first, then the baseline: what is mapped meanwhile is
            // in the baseline, and the log's copy of it is dropped.
            ring.observed = match allocator.as_mapping_log() {
                Some(log) => {
                    log.log_mappings(true);
                    true
                }
                None => false,
            };
            ring.baseline(allocator);
            let mut changes = std::mem::take(&mut ring.changes);
            if let Some(log) = allocator.as_mapping_log() {
                log.take_mappings(&mut changes);
            }
            changes.clear();
            ring.changes = changes;
        } else if !how.enabled && was_on && ring.observed {
            if let Some(log) = allocator.as_mapping_log() {
                log.log_mappings(false);
            }
            ring.observed = false;
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

    /// Whether the ring holds events.
    pub fn recorded_any(&self) -> bool {
        !self.ring.lock().entries.is_empty()
    }

    /// Events dropped because the ring buffer was full.
    pub fn dropped(&self) -> u64 {
        self.ring.lock().dropped
    }
}

impl Ring {
    /// Appends an event, dropping the oldest if full.
    pub fn push(&mut self, action: &'static str, addr: u64, size: u64, stream: u64) {
        self.push_in(action, addr, size, stream, (0, 0));
    }

    /// [`Ring::push`] of an event of pool `pool`.
    fn push_in(&mut self, action: &'static str, addr: u64, size: u64, stream: u64, pool: PoolId) {
        self.push_at(action, addr, size, stream, pool, now_us());
    }

    /// [`Ring::push_in`] at `time_us`.
    fn push_at(
        &mut self,
        action: &'static str,
        addr: u64,
        size: u64,
        stream: u64,
        pool: PoolId,
        time_us: i64,
    ) {
        self.push_entry(
            TraceEntry {
                action,
                addr,
                size,
                stream,
                time_us,
                device_free: None,
            },
            pool,
        );
    }

    /// Appends an `alloc` event and remembers the allocation for its free.
    pub fn push_alloc(&mut self, addr: u64, size: u64, stream: u64, pool: PoolId) {
        self.live.insert(addr, (size, stream, pool));
        self.push_in("alloc", addr, size, stream, pool);
    }

    /// Appends the `free_requested` and `free_completed` events of a free.
    /// (The allocator defers reuse across streams itself and does not report
    /// when; both are recorded at the free.)
    pub fn push_free(&mut self, addr: u64) {
        let (size, stream, pool) = self.live.remove(&addr).unwrap_or((0, 0, (0, 0)));
        self.push_in("free_requested", addr, size, stream, pool);
        self.push_in("free_completed", addr, size, stream, pool);
    }

    /// Appends an `oom` event.
    pub fn push_oom(&mut self, size: u64, device_free: u64, stream: u64) {
        self.push_entry(
            TraceEntry {
                action: "oom",
                addr: device_free,
                size,
                stream,
                time_us: now_us(),
                device_free: Some(device_free),
            },
            (0, 0),
        );
    }

    fn push_entry(&mut self, e: TraceEntry, pool: PoolId) {
        if let Some(sink) = sink() {
            let event = VmmallocTraceEntry {
                device: self.device,
                action: action_code(e.action),
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_us: e.time_us,
                pool_hi: pool.0,
                pool_lo: pool.1,
            };
            // SAFETY: the sink's contract (`TraceSink`): it accepts a pointer
            // valid for the call and does not unwind.
            unsafe { sink(&event) };
        }
        if !self.keep {
            return;
        }
        if self.entries.len() >= self.max_entries {
            self.entries.pop_front();
            self.dropped += 1;
        }
        self.entries.push_back(e);
    }

    /// Takes `allocator`'s current state as what was there before recording
    /// began: its mapped ranges and segments (no events for them) and its
    /// live blocks (their frees carry size and stream).
    fn baseline(&mut self, allocator: &dyn Allocator) {
        let st = allocator.stats();
        self.last_reserved = (st.reserved_bytes.all().current, st.segment.all().current);
        let snap = allocator.snapshot();
        let (segments, mapped) = ranges(&snap);
        self.segments = strip(&segments);
        self.mapped = strip(&mapped);
        self.live.clear();
        for seg in &snap.segments {
            for b in &seg.blocks {
                if b.state == BlockState::ActiveAllocated {
                    self.live
                        .insert(b.address, (b.requested_size, seg.stream.0, seg.pool));
                }
            }
        }
    }

    /// Records the segment events the last operation caused: the mappings
    /// the allocator's physical layer reported, netted out
    /// ([`net_mappings`]), or, for a policy without one, the difference
    /// between its segments now and at the last look.
    pub fn segment_events(&mut self, allocator: &dyn Allocator) {
        if self.observed {
            self.mapping_events(allocator);
        } else {
            self.diffed_segment_events(allocator);
        }
    }

    /// `segment_map` / `segment_unmap` events of the mappings `allocator`
    /// reported since the last look.
    fn mapping_events(&mut self, allocator: &dyn Allocator) {
        let mut changes = std::mem::take(&mut self.changes);
        changes.clear();
        if let Some(log) = allocator.as_mapping_log() {
            log.take_mappings(&mut changes);
        }
        if !changes.is_empty() {
            let time_us = now_us();
            for c in net_mappings(&changes) {
                let action = if c.mapped {
                    "segment_map"
                } else {
                    "segment_unmap"
                };
                self.push_at(action, c.addr, c.bytes, c.stream.0, (0, 0), time_us);
            }
        }
        self.changes = changes;
    }

    /// Segment events from comparing `allocator`'s segments with the last
    /// look, if reserved memory or the segment count changed since.
    fn diffed_segment_events(&mut self, allocator: &dyn Allocator) {
        let st = allocator.stats();
        let now = (st.reserved_bytes.all().current, st.segment.all().current);
        if now == self.last_reserved {
            return;
        }
        self.last_reserved = now;
        let (segments, mapped) = ranges(&allocator.snapshot());
        let time_us = now_us();
        let stream_of = |list: &[(u64, u64, u64)], a: u64| {
            list.iter()
                .find(|r| r.0 <= a && a < r.0 + r.1)
                .map_or(0, |r| r.2)
        };
        let (old_seg, old_map) = (
            std::mem::take(&mut self.segments),
            std::mem::take(&mut self.mapped),
        );
        let (new_seg, new_map) = (strip(&segments), strip(&mapped));
        let mut events = Vec::new();
        for (a, s) in difference(&old_seg, &new_seg) {
            events.push(("segment_free", a, s, 0));
        }
        for (a, s) in difference(&old_map, &new_map) {
            events.push(("segment_unmap", a, s, 0));
        }
        for (a, s) in difference(&new_seg, &old_seg) {
            events.push(("segment_alloc", a, s, stream_of(&segments, a)));
        }
        for (a, s) in difference(&new_map, &old_map) {
            events.push(("segment_map", a, s, stream_of(&mapped, a)));
        }
        for (action, addr, size, stream) in events {
            self.push_at(action, addr, size, stream, (0, 0), time_us);
        }
        self.segments = new_seg;
        self.mapped = new_map;
    }
}

/// What `changes` (in the order they happened) changed in the end: each
/// range whose state after the last change differs from its state before
/// the first (a chunk unmapped and mapped again at the same addresses by
/// unpinning or spill changed nothing), adjacent ranges of one kind and
/// stream merged; unmaps first, then maps, each by address (PyTorch's
/// order within one call: memory is released before it is mapped again).
pub fn net_mappings(changes: &[MappingChange]) -> Vec<MappingChange> {
    let mut cuts: Vec<u64> = changes
        .iter()
        .filter(|c| c.bytes > 0)
        .flat_map(|c| [c.addr, c.addr.saturating_add(c.bytes)])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let pieces = cuts.len().saturating_sub(1);
    // The first and last change covering each piece between two cuts.
    let mut first: Vec<Option<usize>> = vec![None; pieces];
    let mut last: Vec<Option<usize>> = vec![None; pieces];
    for (k, c) in changes.iter().enumerate().filter(|(_, c)| c.bytes > 0) {
        let end = c.addr.saturating_add(c.bytes);
        let mut i = cuts.partition_point(|&x| x < c.addr);
        while i < pieces && cuts[i] < end {
            first[i].get_or_insert(k);
            last[i] = Some(k);
            i += 1;
        }
    }
    let mut out: Vec<MappingChange> = Vec::new();
    for i in 0..pieces {
        let (Some(f), Some(l)) = (first[i], last[i]) else {
            continue;
        };
        let (was_mapped, is_mapped) = (!changes[f].mapped, changes[l].mapped);
        if was_mapped == is_mapped {
            continue;
        }
        let c = MappingChange {
            mapped: is_mapped,
            addr: cuts[i],
            bytes: cuts[i + 1] - cuts[i],
            stream: changes[l].stream,
        };
        match out.last_mut() {
            Some(p)
                if p.mapped == c.mapped && p.stream == c.stream && p.addr + p.bytes == c.addr =>
            {
                p.bytes += c.bytes
            }
            _ => out.push(c),
        }
    }
    out.sort_by_key(|c| (c.mapped, c.addr));
    out
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
            // Unmapped and paused blocks have no physical memory behind them.
            if matches!(b.state, BlockState::Unmapped | BlockState::Paused) {
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
    use vmmalloc_alloc::{Sleep, Stream};

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
    fn net_mappings_nets_out_moves_and_merges_neighbours() {
        let ch = |mapped: bool, addr: u64, bytes: u64, stream: u64| MappingChange {
            mapped,
            addr,
            bytes,
            stream: Stream(stream),
        };
        // Two chunks mapped side by side: one range.
        assert_eq!(
            net_mappings(&[ch(true, 0, 2, 7), ch(true, 2, 4, 7)]),
            vec![ch(true, 0, 6, 7)]
        );
        // A move: a run unmapped, then each chunk mapped again; only the
        // part not mapped again is a change.
        assert_eq!(
            net_mappings(&[ch(false, 0, 8, 7), ch(true, 0, 2, 7), ch(true, 6, 2, 7)]),
            vec![ch(false, 2, 4, 7)]
        );
        // Mapped and unmapped again within one call: nothing.
        assert_eq!(
            net_mappings(&[ch(true, 10, 4, 1), ch(false, 10, 4, 1)]),
            vec![]
        );
        // Unmaps come first, then maps, each by address; streams kept apart.
        assert_eq!(
            net_mappings(&[
                ch(true, 20, 2, 1),
                ch(true, 22, 2, 2),
                ch(false, 4, 2, 1),
                ch(false, 0, 2, 1),
            ]),
            vec![
                ch(false, 0, 2, 1),
                ch(false, 4, 2, 1),
                ch(true, 20, 2, 1),
                ch(true, 22, 2, 2),
            ]
        );
        assert_eq!(net_mappings(&[ch(true, 3, 0, 1)]), vec![]);
    }

    /// Pages `entries`' segment events leave mapped, applied to `pages`.
    fn apply(pages: &mut std::collections::BTreeSet<u64>, entries: &[TraceEntry], page: u64) {
        for e in entries {
            let range = (e.addr..e.addr + e.size).step_by(page as usize);
            match e.action {
                "segment_map" => range.for_each(|p| assert!(pages.insert(p), "{e:?}")),
                "segment_unmap" => range.for_each(|p| assert!(pages.remove(&p), "{e:?}")),
                _ => {}
            }
        }
    }

    /// Under `expandable` the ring takes its segment events from the
    /// physical layer's mapping log; through an unpinning move, a sleep and
    /// an emptied cache they leave exactly the memory the snapshot shows
    /// mapped.
    #[test]
    fn segment_events_from_the_mapping_log_match_the_snapshot() {
        use std::sync::Arc;
        use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
        use vmmalloc_device::{sim::SimDevice, Device, MIB};
        let page = 2 * MIB;
        let dev = Arc::new(SimDevice::with_capacity(1024 * MIB));
        let cfg = ExpandableConfig {
            grow_granule: 0,
            ..ExpandableConfig::default()
        };
        let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
        let before = a.malloc(8 * MIB, Stream(0)).unwrap();
        let h = History::new(0, 100_000, false);
        let how = Recording {
            enabled: true,
            max_entries: 100_000,
            clear: true,
            keep: true,
        };
        h.set(how, &a);
        assert!(h.lock().observed);
        let mapped = |a: &dyn Allocator| {
            let (_, m) = ranges(&a.snapshot());
            let mut pages = std::collections::BTreeSet::new();
            for (addr, size, _) in m {
                pages.extend((addr..addr + size).step_by(page as usize));
            }
            pages
        };
        let mut pages = mapped(&a);
        let mut seen = 0;
        let mut look = |what: &str, pages: &mut std::collections::BTreeSet<u64>| {
            h.lock().segment_events(&a);
            let entries = h.entries();
            apply(pages, &entries[seen..], page);
            seen = entries.len();
            assert_eq!(*pages, mapped(&a), "{what}");
        };
        let s = dev.create_stream().unwrap();
        let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
        let big = a.malloc(128 * MIB, s).unwrap();
        look("grown", &mut pages);
        a.free(big.ptr).unwrap();
        let small = a.malloc(16 * MIB, s).unwrap();
        look("pinned", &mut pages);
        let y = a.malloc(200 * MIB, dev.create_stream().unwrap()).unwrap();
        assert_eq!(a.stats().chunk_unpins, 1);
        look("unpinned", &mut pages);
        vmmalloc_alloc::set_thread_tag("kv").unwrap();
        let kv = a.malloc(30 * MIB, s).unwrap();
        vmmalloc_alloc::set_thread_tag("default").unwrap();
        look("tagged", &mut pages);
        a.pause(&["kv".to_string()], false).unwrap();
        look("paused", &mut pages);
        a.resume(&["kv".to_string()]).unwrap();
        look("resumed", &mut pages);
        for b in live.iter().chain([&small, &y, &kv, &before]) {
            a.free(b.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        look("emptied", &mut pages);
        assert!(pages.is_empty());
        let entries = h.entries();
        let count = |action: &str| entries.iter().filter(|e| e.action == action).count();
        assert!(
            count("segment_map") > 0 && count("segment_unmap") > 0,
            "{entries:?}"
        );
        h.set(
            Recording {
                enabled: false,
                ..how
            },
            &a,
        );
        assert!(!h.lock().observed);
    }

    #[test]
    fn ring_drops_oldest() {
        let h = History::new(0, 3, true);
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
