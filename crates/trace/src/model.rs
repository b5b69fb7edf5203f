//! The trace model: per device, the ordered allocation events, the allocations
//! that were live before recording began, and the recording allocator's own
//! state kept for reference.
//!
//! A [`DeviceTrace`] is checked once, when it is built ([`DeviceTrace::new`]):
//! every free matches a live allocation, no live address is allocated twice,
//! every size is in `1..=MAX_SIZE`. It then holds the dense replay view
//! ([`DeviceTrace::replay_ops`]) and the peak live bytes, so a replayer maps
//! nothing at replay time.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
pub use vmmalloc_alloc::{Frame, Stack};

use crate::error::{ErrorKind, Result, TraceError};

/// The largest size a trace may hold: 2^50 bytes (1 PiB), far beyond any
/// device. Larger values are treated as corrupt input.
pub const MAX_SIZE: u64 = 1 << 50;

/// What an [`Event`] records.
///
/// Only [`EventKind::Alloc`] and [`EventKind::Free`] are replayed; the others
/// describe what the recording allocator did and are kept for reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// A tensor allocation of `size` requested bytes at `addr` on `stream`.
    Alloc,
    /// The allocation at `addr` is gone and its memory reusable (PyTorch's
    /// `free_completed`).
    Free,
    /// The program dropped the tensor but the memory still waits for streams
    /// (PyTorch's `free_requested`); reference only.
    FreeRequested,
    /// The recording allocator obtained a segment from the driver; reference only.
    SegmentAlloc,
    /// The recording allocator returned a segment to the driver; reference only.
    SegmentFree,
    /// Pages mapped into an expandable segment; reference only.
    SegmentMap,
    /// Pages unmapped from an expandable segment; reference only.
    SegmentUnmap,
    /// A snapshot was taken; reference only.
    Snapshot,
    /// The recording allocator ran out of memory; `addr` holds the device's
    /// free bytes, `size` the request. Reference only.
    Oom,
    /// A user annotation; reference only.
    UserDefined,
    /// A growable region of up to `size` bytes at `addr` on `stream`, of
    /// length 0 (vmmalloc's `growable_create`; docs/expandable.md, "Growable
    /// regions"). Freed by a `free` event.
    Reserve,
    /// The growable region at `addr` becomes `size` bytes long.
    Resize,
}

impl EventKind {
    /// Every kind, in declaration order.
    pub const ALL: [EventKind; 12] = [
        EventKind::Alloc,
        EventKind::Free,
        EventKind::FreeRequested,
        EventKind::SegmentAlloc,
        EventKind::SegmentFree,
        EventKind::SegmentMap,
        EventKind::SegmentUnmap,
        EventKind::Snapshot,
        EventKind::Oom,
        EventKind::UserDefined,
        EventKind::Reserve,
        EventKind::Resize,
    ];

    /// The kind's name in the text format (`alloc`, `free`, `free_requested`, …).
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Alloc => "alloc",
            EventKind::Free => "free",
            EventKind::FreeRequested => "free_requested",
            EventKind::SegmentAlloc => "segment_alloc",
            EventKind::SegmentFree => "segment_free",
            EventKind::SegmentMap => "segment_map",
            EventKind::SegmentUnmap => "segment_unmap",
            EventKind::Snapshot => "snapshot",
            EventKind::Oom => "oom",
            EventKind::UserDefined => "user_defined",
            EventKind::Reserve => "reserve",
            EventKind::Resize => "resize",
        }
    }

    /// The kind named `name` in the text format.
    pub fn from_name(name: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether a replayer acts on this kind (alloc and free, and growable
    /// regions' reserve and resize).
    pub fn is_replayed(self) -> bool {
        matches!(
            self,
            EventKind::Alloc | EventKind::Free | EventKind::Reserve | EventKind::Resize
        )
    }
}

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// The allocation's address (or any unique id in a synthetic trace).
    pub addr: u64,
    /// Requested bytes (for a free: the size of the allocation freed, as recorded).
    pub size: u64,
    /// The stream the allocation belongs to (opaque id; PyTorch records the
    /// `cudaStream_t` value, 0 for the default stream).
    pub stream: u64,
    /// Time stamp in microseconds, where the source has one.
    pub time_us: Option<i64>,
}

/// An allocation live before recording began, reconstructed from the trace
/// and the final state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    /// Its address.
    pub addr: u64,
    /// Requested bytes.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
}

/// State of a block in the recording allocator's final snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out to a tensor (`active_allocated`).
    ActiveAllocated,
    /// Freed by the program, waiting for streams (`active_pending_free`).
    ActivePendingFree,
    /// Cached and free (`inactive`).
    Inactive,
}

impl BlockState {
    /// Whether the block still holds a live allocation (allocated or pending free).
    pub fn is_active(self) -> bool {
        !matches!(self, BlockState::Inactive)
    }
}

/// A block of a final segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Start address.
    pub address: u64,
    /// Block size in bytes (rounded by the recording allocator).
    pub size: u64,
    /// Bytes requested by the last allocation in the block (the block size where
    /// the snapshot does not say).
    pub requested_size: u64,
    /// Allocated, pending free or free.
    pub state: BlockState,
}

/// A segment of the recording allocator at the time of the snapshot, for reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Device index.
    pub device: u32,
    /// Start address.
    pub address: u64,
    /// Bytes obtained from the driver.
    pub total_size: u64,
    /// The stream it belongs to.
    pub stream: u64,
    /// `large` or `small` (pool), as recorded.
    pub segment_type: String,
    /// Whether it is an expandable segment (absent in PyTorch 2.0 snapshots).
    pub is_expandable: Option<bool>,
    /// Its blocks, in address order.
    pub blocks: Vec<Block>,
}

/// One step of a replay: the trace's allocations and frees with dense ids.
///
/// Ids run from 0 to [`DeviceTrace::num_ids`]` - 1`; the pre-trace allocations
/// come first (ids `0..pre_trace().len()`, ascending address), then the
/// trace's allocations in order. Each id is allocated once and freed at most
/// once, after its allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` requested bytes on `stream` and call the result `id`.
    Alloc {
        /// Dense allocation id.
        id: u32,
        /// Requested bytes.
        size: u64,
        /// Stream.
        stream: u64,
    },
    /// Free the allocation `id` (or destroy the growable region `id`).
    Free {
        /// Dense allocation id.
        id: u32,
    },
    /// Create the growable region `id` of up to `max` bytes on `stream`, of
    /// length 0. A policy without regions allocates nothing yet.
    Reserve {
        /// Dense allocation id.
        id: u32,
        /// The region's maximum in bytes.
        max: u64,
        /// Stream.
        stream: u64,
    },
    /// Make the growable region `id` `size` bytes long. A policy without
    /// regions allocates `size` bytes, copies and frees the old allocation.
    Resize {
        /// Dense allocation id.
        id: u32,
        /// The new length in bytes.
        size: u64,
    },
}

impl Op {
    /// The allocation (or region) id the op acts on.
    #[inline]
    pub fn id(&self) -> u32 {
        match *self {
            Op::Alloc { id, .. }
            | Op::Free { id }
            | Op::Reserve { id, .. }
            | Op::Resize { id, .. } => id,
        }
    }
}

/// The parts of a [`DeviceTrace`], as readers and generators assemble them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceTraceParts {
    /// Device index.
    pub device: u32,
    /// Allocations live before the first event (sorted by address on build).
    pub pre_trace: Vec<Alloc>,
    /// The events, in order.
    pub events: Vec<Event>,
    /// The recording allocator's final segments (reference only; may be empty).
    pub segments_final: Vec<Segment>,
    /// The recording allocator's settings, rendered as strings.
    pub allocator_settings: BTreeMap<String, String>,
    /// Warnings about an incomplete source (each line counts one kind of problem).
    pub warnings: Vec<String>,
    /// Stack frames of allocation events, by event index (PyTorch snapshots
    /// recorded with stacks; empty otherwise).
    pub frames: BTreeMap<usize, Stack>,
}

/// Allocation id -> the stack it was allocated from (see [`DeviceTrace::frames`]).
pub type FrameTable = HashMap<u32, Stack>;

/// The trace of one device, checked and ready to replay.
///
/// Invariant (checked by [`DeviceTrace::new`]): replaying `pre_trace` then
/// `events` never frees an address that is not live and never allocates one
/// that is; every allocation size is in `1..=MAX_SIZE`; `ops` and the figures
/// below are derived from the parts and never disagree with them.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceTrace {
    parts: DeviceTraceParts,
    ops: Vec<Op>,
    id_frames: Arc<FrameTable>,
    allocs: usize,
    peak_live: u64,
    pre_trace_live: u64,
    final_live: u64,
}

impl DeviceTrace {
    /// Checks the parts and builds the replay view.
    ///
    /// Sorts `pre_trace` by address. Errors name the device and the event index.
    ///
    /// # Time Complexity
    /// O(n) expected in the number of events and pre-trace allocations (plus
    /// the sort of the pre-trace allocations).
    pub fn new(mut parts: DeviceTraceParts) -> Result<DeviceTrace> {
        let device = parts.device;
        let err = |kind: ErrorKind| TraceError::new(kind).on_device(device);
        parts.pre_trace.sort_by_key(|a| a.addr);
        let n_alloc_events = parts
            .events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Alloc | EventKind::Reserve))
            .count();
        let n_ids = parts.pre_trace.len() + n_alloc_events;
        if n_ids >= u32::MAX as usize {
            return Err(err(ErrorKind::TooManyAllocs));
        }
        let mut ops = Vec::with_capacity(n_ids + parts.events.len());
        let mut sizes: Vec<u64> = Vec::with_capacity(n_ids);
        let mut live: HashMap<u64, u32> = HashMap::with_capacity(parts.pre_trace.len() * 2 + 64);
        let mut live_bytes: u64 = 0;
        for a in &parts.pre_trace {
            check_alloc_size(a.size).map_err(err)?;
            let id = sizes.len() as u32;
            if live.insert(a.addr, id).is_some() {
                return Err(err(ErrorKind::DuplicatePre { addr: a.addr }));
            }
            sizes.push(a.size);
            live_bytes = live_bytes.saturating_add(a.size);
            ops.push(Op::Alloc {
                id,
                size: a.size,
                stream: a.stream,
            });
        }
        let pre_trace_live = live_bytes;
        // Growable regions (`reserve` events): id -> maximum bytes.
        let mut regions: HashMap<u32, u64> = HashMap::new();
        let mut peak_live = live_bytes;
        let mut id_frames = FrameTable::new();
        for (i, e) in parts.events.iter().enumerate() {
            let at = |kind: ErrorKind| err(kind).at_event(i);
            match e.kind {
                EventKind::Alloc => {
                    check_alloc_size(e.size).map_err(at)?;
                    let id = sizes.len() as u32;
                    if let Some(st) = parts.frames.get(&i) {
                        id_frames.insert(id, st.clone());
                    }
                    if live.insert(e.addr, id).is_some() {
                        return Err(at(ErrorKind::DoubleAlloc { addr: e.addr }));
                    }
                    sizes.push(e.size);
                    live_bytes = live_bytes.saturating_add(e.size);
                    peak_live = peak_live.max(live_bytes);
                    ops.push(Op::Alloc {
                        id,
                        size: e.size,
                        stream: e.stream,
                    });
                }
                EventKind::Free => {
                    if e.size > MAX_SIZE {
                        return Err(at(ErrorKind::Absurd {
                            field: "size",
                            value: e.size.into(),
                        }));
                    }
                    let Some(id) = live.remove(&e.addr) else {
                        return Err(at(ErrorKind::FreeOfUnknown { addr: e.addr }));
                    };
                    live_bytes -= sizes[id as usize];
                    ops.push(Op::Free { id });
                }
                EventKind::Reserve => {
                    check_alloc_size(e.size).map_err(at)?;
                    let id = sizes.len() as u32;
                    if live.insert(e.addr, id).is_some() {
                        return Err(at(ErrorKind::DoubleAlloc { addr: e.addr }));
                    }
                    sizes.push(0);
                    regions.insert(id, e.size);
                    ops.push(Op::Reserve {
                        id,
                        max: e.size,
                        stream: e.stream,
                    });
                }
                EventKind::Resize => {
                    let Some(&id) = live.get(&e.addr) else {
                        return Err(at(ErrorKind::FreeOfUnknown { addr: e.addr }));
                    };
                    match regions.get(&id) {
                        Some(&max) if e.size <= max => {}
                        max => {
                            return Err(at(ErrorKind::BadResize {
                                addr: e.addr,
                                size: e.size,
                                max: max.copied(),
                            }))
                        }
                    }
                    live_bytes = live_bytes - sizes[id as usize] + e.size;
                    sizes[id as usize] = e.size;
                    peak_live = peak_live.max(live_bytes);
                    ops.push(Op::Resize { id, size: e.size });
                }
                _ => {}
            }
        }
        Ok(DeviceTrace {
            parts,
            ops,
            id_frames: Arc::new(id_frames),
            allocs: n_alloc_events,
            peak_live,
            pre_trace_live,
            final_live: live_bytes,
        })
    }

    /// Device index.
    pub fn device(&self) -> u32 {
        self.parts.device
    }

    /// All events, replayed and reference ones, in order.
    pub fn events(&self) -> &[Event] {
        &self.parts.events
    }

    /// Allocations live before the first event, in ascending address order.
    pub fn pre_trace(&self) -> &[Alloc] {
        &self.parts.pre_trace
    }

    /// The recording allocator's final segments (empty for text traces and workloads).
    pub fn segments_final(&self) -> &[Segment] {
        &self.parts.segments_final
    }

    /// The recording allocator's settings, rendered as strings.
    pub fn allocator_settings(&self) -> &BTreeMap<String, String> {
        &self.parts.allocator_settings
    }

    /// Warnings about an incomplete source; each line counts one kind of problem.
    pub fn warnings(&self) -> &[String] {
        &self.parts.warnings
    }

    /// The replay view: pre-trace allocations (ascending address), then the
    /// trace's allocations and frees in order, with dense ids.
    pub fn replay_ops(&self) -> &[Op] {
        &self.ops
    }

    /// Number of distinct allocation ids in [`DeviceTrace::replay_ops`]
    /// (pre-trace allocations plus allocation events).
    pub fn num_ids(&self) -> u32 {
        (self.parts.pre_trace.len() + self.allocs) as u32
    }

    /// Number of allocation events in the trace (not counting pre-trace allocations).
    pub fn allocs(&self) -> usize {
        self.allocs
    }

    /// Maximum over time of the requested bytes of live allocations, including
    /// the pre-trace ones: the least memory any allocator needs for this trace.
    pub fn peak_live_bytes(&self) -> u64 {
        self.peak_live
    }

    /// Requested bytes of the allocations live before the first event.
    pub fn pre_trace_live_bytes(&self) -> u64 {
        self.pre_trace_live
    }

    /// Requested bytes still live after the last event.
    pub fn final_live_bytes(&self) -> u64 {
        self.final_live
    }

    /// The distinct streams that allocations use, ascending.
    pub fn streams(&self) -> Vec<u64> {
        let mut s: BTreeSet<u64> = self.parts.pre_trace.iter().map(|a| a.stream).collect();
        s.extend(
            self.parts
                .events
                .iter()
                .filter(|e| e.kind == EventKind::Alloc)
                .map(|e| e.stream),
        );
        s.into_iter().collect()
    }

    /// The stacks of the allocations that have them, by allocation id (the
    /// `id` of [`Op::Alloc`]); empty when the source recorded none.
    pub fn frames(&self) -> &Arc<FrameTable> {
        &self.id_frames
    }

    /// The parts this trace was built from (pre-trace sorted by address).
    pub fn parts(&self) -> &DeviceTraceParts {
        &self.parts
    }

    /// Gives the parts back, to edit and rebuild.
    pub fn into_parts(self) -> DeviceTraceParts {
        self.parts
    }
}

/// A named trace: one [`DeviceTrace`] per device that has events or segments.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// A short name for tables (file stem, or the workload spec).
    pub name: String,
    /// The devices, ascending by index.
    pub devices: Vec<DeviceTrace>,
}

impl Trace {
    /// The trace of device `device`, if present.
    pub fn device(&self, device: u32) -> Option<&DeviceTrace> {
        self.devices.iter().find(|d| d.device() == device)
    }

    /// Total number of events over all devices.
    pub fn num_events(&self) -> usize {
        self.devices.iter().map(|d| d.events().len()).sum()
    }
}

fn check_alloc_size(size: u64) -> std::result::Result<(), ErrorKind> {
    if size == 0 {
        Err(ErrorKind::ZeroSize)
    } else if size > MAX_SIZE {
        Err(ErrorKind::Absurd {
            field: "size",
            value: size.into(),
        })
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: EventKind, addr: u64, size: u64, stream: u64) -> Event {
        Event {
            kind,
            addr,
            size,
            stream,
            time_us: None,
        }
    }

    #[test]
    fn ids_are_dense_pre_trace_first_in_address_order() {
        let parts = DeviceTraceParts {
            pre_trace: vec![
                Alloc {
                    addr: 0x300,
                    size: 30,
                    stream: 0,
                },
                Alloc {
                    addr: 0x100,
                    size: 10,
                    stream: 0,
                },
            ],
            events: vec![
                ev(EventKind::Alloc, 0x200, 20, 7),
                ev(EventKind::SegmentAlloc, 0x0, 1 << 21, 7),
                ev(EventKind::Free, 0x100, 10, 0),
                ev(EventKind::Alloc, 0x100, 5, 7),
                ev(EventKind::Free, 0x200, 20, 7),
            ],
            ..Default::default()
        };
        let t = DeviceTrace::new(parts).unwrap();
        assert_eq!(
            t.replay_ops(),
            &[
                Op::Alloc {
                    id: 0,
                    size: 10,
                    stream: 0
                },
                Op::Alloc {
                    id: 1,
                    size: 30,
                    stream: 0
                },
                Op::Alloc {
                    id: 2,
                    size: 20,
                    stream: 7
                },
                Op::Free { id: 0 },
                Op::Alloc {
                    id: 3,
                    size: 5,
                    stream: 7
                },
                Op::Free { id: 2 },
            ]
        );
        assert_eq!(t.num_ids(), 4);
        assert_eq!(t.allocs(), 2);
        assert_eq!(t.pre_trace_live_bytes(), 40);
        assert_eq!(t.peak_live_bytes(), 60);
        assert_eq!(t.final_live_bytes(), 35);
        assert_eq!(t.streams(), vec![0, 7]);
        assert_eq!(t.pre_trace()[0].addr, 0x100);
    }

    #[test]
    fn bad_sequences_name_the_event() {
        let cases: Vec<(Vec<Event>, usize, &str)> = vec![
            (
                vec![ev(EventKind::Free, 1, 1, 0)],
                0,
                "free of unknown address 0x1",
            ),
            (
                vec![ev(EventKind::Alloc, 1, 1, 0), ev(EventKind::Alloc, 1, 1, 0)],
                1,
                "still live",
            ),
            (
                vec![
                    ev(EventKind::Alloc, 1, 1, 0),
                    ev(EventKind::Free, 1, 1, 0),
                    ev(EventKind::Free, 1, 1, 0),
                ],
                2,
                "free of unknown",
            ),
            (vec![ev(EventKind::Alloc, 1, 0, 0)], 0, "size 0"),
            (
                vec![ev(EventKind::Alloc, 1, MAX_SIZE + 1, 0)],
                0,
                "absurd size",
            ),
        ];
        for (events, index, msg) in cases {
            let e = DeviceTrace::new(DeviceTraceParts {
                device: 3,
                events,
                ..Default::default()
            })
            .unwrap_err();
            assert_eq!(e.device, Some(3));
            assert_eq!(e.index, Some(index));
            let s = e.to_string();
            assert!(s.contains(msg), "{s}");
            assert!(s.starts_with(&format!("device 3, event {index}: ")), "{s}");
        }
        let dup = DeviceTraceParts {
            pre_trace: vec![
                Alloc {
                    addr: 1,
                    size: 1,
                    stream: 0,
                },
                Alloc {
                    addr: 1,
                    size: 2,
                    stream: 0,
                },
            ],
            ..Default::default()
        };
        assert!(DeviceTrace::new(dup)
            .unwrap_err()
            .to_string()
            .contains("two pre-trace"));
    }

    #[test]
    fn kind_names_round_trip() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::from_name(k.name()), Some(k));
        }
        assert_eq!(EventKind::from_name("free_completed"), None);
    }
}
