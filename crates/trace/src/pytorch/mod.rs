//! Reader for PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`).
//!
//! A snapshot is a pickled dict (protocol 2–5) of plain Python values:
//!
//! - `segments`: the caching allocator's segments at the time of the dump, each
//!   a dict with `device`, `address`, `total_size`, `stream`, `segment_type`,
//!   `blocks` (each: `address` (absent before PyTorch 2.1: blocks then follow
//!   one another from the segment's address), `size`, `requested_size`,
//!   `state` ∈ {`active_allocated`, `active_pending_free`, `inactive`}, and in
//!   PyTorch 2.0 a `history` of `{addr, real_size, frames}`), and newer fields
//!   (`is_expandable`, `segment_pool_id`, `frames`, …) that are ignored;
//! - `device_traces`: one list of events per device (the device index is the
//!   list's position), each a dict with `action`, `addr` (`device_free` for
//!   `oom`), `size`, `stream`, and optionally `time_us`, `frames` (the
//!   stacks of `alloc` events are kept: [`crate::DeviceTrace::frames`]),
//!   `compile_context`, `user_metadata` (ignored);
//! - `allocator_settings`, `external_annotations`: optional.
//!
//! **Sizes.** PyTorch records an `alloc` event with the size the program
//! asked for (`orig_size` in `CUDACachingAllocator::malloc`), and its frees
//! with the block's `requested_size`; the rounded block size appears only in
//! the segments. So event sizes are requested sizes; rounding is the policy's
//! job.
//!
//! **Frees.** `free_completed` (the memory is reusable) is the replayed
//! [`EventKind::Free`]; `free_requested` (the program dropped the tensor, the
//! memory may still wait for streams) is kept for reference. Where an address
//! has a `free_requested` with no `free_completed` after it (before its next
//! `alloc`), the `free_requested` becomes the free, unless the trace ends there
//! and the final block is still `active_pending_free` (then it stays live);
//! such promotions are counted in a warning.
//!
//! Allocations live before recording began are reconstructed in
//! [`crate::reconstruct`].
//!
//! **Reading.** The file is streamed through a pull parser (`decode`, see its
//! docs for why not serde-pickle): each event dict is converted into a compact
//! [`Event`] as soon as its batch lands in its device's list and is then
//! freed; frame dicts and stacks shared through the pickle memo are converted
//! once and shared ([`Stack`] is an `Arc`, interned by content); strings are
//! interned. What stays in memory is what the replay and its reports use: the
//! events (48 bytes each), the final segments, the stacks of allocations, and
//! 4 bytes per memo entry. The file itself is never held in memory.
//! docs/trace-format.md gives the measured speed and memory.
//!
//! **Limits.** Whatever the pickle, the reader holds at most 48 MiB + 1.5 ×
//! the bytes read and takes steps linear in them ([`ReadLimits`]); a pickle
//! that asks for more is one [`ErrorKind::Limit`] naming the limit. Nothing
//! named in a pickle is ever called: a global reads as `None`.

mod decode;
mod limits;

pub use limits::{ReadLimits, ReadStats};

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde_pickle::{HashableValue, Value};

use crate::error::{ErrorKind, Result, TraceError};
use crate::model::{Block, BlockState, Event, EventKind, Frame, Segment, Stack, Trace, MAX_SIZE};
use crate::reconstruct::{build_device, RawDevice};
use decode::{type_name, Kind, Sink, Val, Vm, Whole, NO_ROLE};
use limits::Hit;

/// The most bytes one key of a foreign top-level dict expands to for the
/// message that lists them.
const KEY_BYTES: u64 = 4 << 10;

/// Device indices a snapshot may use (a larger one is treated as corrupt input).
pub const MAX_DEVICES: u32 = 1024;

/// The `action` values this reader knows, in the order of PyTorch's
/// `TraceEntry::Action` enum (the allocator crate's list).
pub use vmmalloc_alloc::pickle_snapshot::TRACE_ACTIONS as ACTIONS;

/// The [`EventKind`] of each of [`ACTIONS`].
const ACTION_KINDS: [EventKind; 10] = [
    EventKind::Alloc,
    EventKind::FreeRequested,
    EventKind::Free,
    EventKind::SegmentAlloc,
    EventKind::SegmentFree,
    EventKind::SegmentMap,
    EventKind::SegmentUnmap,
    EventKind::Snapshot,
    EventKind::Oom,
    EventKind::UserDefined,
];

/// Reads the snapshot at `path`; the trace is named after the file stem.
///
/// The file is streamed, never held in memory. Errors name the file, and
/// where it applies the device and event index.
pub fn read_snapshot(path: &Path) -> Result<Trace> {
    let f = std::fs::File::open(path).map_err(|e| TraceError::from(e).in_file(path))?;
    read_snapshot_from(f, &file_stem(path)).map_err(|e| e.in_file(path))
}

/// Parses snapshot bytes into a trace named `name`.
pub fn parse_snapshot(bytes: &[u8], name: &str) -> Result<Trace> {
    read_snapshot_from(bytes, name)
}

/// Reads a snapshot from any reader (a file, a pipe, a byte slice) into a
/// trace named `name`, streaming it: memory holds the trace, not the input.
/// The default [`ReadLimits`] apply.
pub fn read_snapshot_from<R: Read>(r: R, name: &str) -> Result<Trace> {
    read_snapshot_limited(r, name, &ReadLimits::default()).0
}

/// [`read_snapshot_from`] under `limits`, with what the read cost by the
/// reader's own counters (also when it fails: a limit hit says how far it got).
pub fn read_snapshot_limited<R: Read>(
    r: R,
    name: &str,
    limits: &ReadLimits,
) -> (Result<Trace>, ReadStats) {
    let mut vm = match decode::Vm::new(limits.clone(), NAMES) {
        Ok(vm) => vm,
        Err(e) => return (Err(e), ReadStats::default()),
    };
    let r = read_on(&mut vm, r, name);
    let r = match r {
        Err(_) | Ok(_) if vm.budget.exhausted() => Err(vm.limit_err()),
        r => r,
    };
    (r, vm.budget.stats())
}

fn read_on<R: Read>(vm: &mut Vm, mut r: R, name: &str) -> Result<Trace> {
    let mut head = [0u8; 2];
    let mut n = 0;
    while n < 2 {
        match r.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    if n == 0 {
        return Err(ErrorKind::Pickle("empty file".into()).into());
    }
    if head[0] == 0x80 {
        match head[..n].get(1) {
            Some(p) if (2..=5).contains(p) => {}
            Some(p) => {
                return Err(
                    ErrorKind::Pickle(format!("unsupported pickle protocol {p} (2-5 are)")).into(),
                )
            }
            None => {
                return Err(ErrorKind::Pickle("truncated after the protocol opcode".into()).into())
            }
        }
    }
    let mut b = Builder::new();
    let top = decode::run(vm, head[..n].chain(r), &mut b)?;
    b.finish(vm, top, name)
}

// Names interned before decoding, so that their string ids are these indices.
const K_ACTION: u32 = 0;
const K_ADDR: u32 = 1;
const K_SIZE: u32 = 2;
const K_STREAM: u32 = 3;
const K_TIME: u32 = 4;
const K_DEVICE_FREE: u32 = 5;
const K_FRAMES: u32 = 6;
const K_FILENAME: u32 = 7;
const K_LINE: u32 = 8;
const K_NAME: u32 = 9;
const K_DEVICE: u32 = 10;
const K_ADDRESS: u32 = 11;
const K_TOTAL: u32 = 12;
const K_SEGTYPE: u32 = 13;
const K_EXPANDABLE: u32 = 14;
const K_BLOCKS: u32 = 15;
const K_STATE: u32 = 16;
const K_REQUESTED: u32 = 17;
const K_HISTORY: u32 = 18;
const K_REAL: u32 = 19;
const K_SEGMENTS: u32 = 20;
const K_TRACES: u32 = 21;
const K_SETTINGS: u32 = 22;
/// Field names: ids below this are looked up by [`fields`].
const N_KEYS: usize = 23;
/// Ids of [`ACTIONS`] start here.
const K_ACTIONS: u32 = 23;
const K_STATES: u32 = K_ACTIONS + ACTIONS.len() as u32;
const STATES: [(&str, BlockState); 3] = [
    ("active_allocated", BlockState::ActiveAllocated),
    ("active_pending_free", BlockState::ActivePendingFree),
    ("inactive", BlockState::Inactive),
];
const NAMES: &[&str] = &[
    "action",
    "addr",
    "size",
    "stream",
    "time_us",
    "device_free",
    "frames",
    "filename",
    "line",
    "name",
    "device",
    "address",
    "total_size",
    "segment_type",
    "is_expandable",
    "blocks",
    "state",
    "requested_size",
    "history",
    "real_size",
    "segments",
    "device_traces",
    "allocator_settings",
    ACTIONS[0],
    ACTIONS[1],
    ACTIONS[2],
    ACTIONS[3],
    ACTIONS[4],
    ACTIONS[5],
    ACTIONS[6],
    ACTIONS[7],
    ACTIONS[8],
    ACTIONS[9],
    STATES[0].0,
    STATES[1].0,
    STATES[2].0,
];

// Roles of containers (see `decode`).
const ROLE_ROOT: u32 = 1;
const ROLE_SEGMENTS: u32 = 2;
const ROLE_TRACES: u32 = 3;
/// `ROLE_TRACE + d`: the event list of device `d`.
const ROLE_TRACE: u32 = 4;

/// The fields of a dict this reader looks up, by name id (the last of a
/// repeated key wins, as in Python).
type Fields = [Option<Val>; N_KEYS];

///
/// Counted as work (one dict can be looked up many times); past the work
/// limit every field reads as absent and the read ends with the limit's error.
#[inline]
fn fields(vm: &Vm, items: &[Val]) -> Fields {
    let mut f: Fields = [None; N_KEYS];
    if !vm.budget.spend(items.len() as u64 / 2 + 1) {
        return f;
    }
    for p in items.chunks_exact(2) {
        if let Val::Str(k) = p[0] {
            if (k as usize) < N_KEYS {
                f[k as usize] = Some(p[1]);
            }
        }
    }
    f
}

/// The name of field `k`, for messages.
fn key_name(k: u32) -> &'static str {
    NAMES[k as usize]
}

/// One device's events as read.
#[derive(Default)]
struct DeviceEvents {
    events: Vec<Event>,
    /// Stacks of alloc events, by event index.
    frames: BTreeMap<usize, Stack>,
    /// Alloc events whose `frames` is not a list of frame dicts.
    bad_frames: usize,
}

/// Frames and stacks, each distinct one once.
struct FrameTable {
    frames: Vec<Frame>,
    frame_ids: FxHashMap<(u32, i64, u32), u32>,
    stacks: Vec<Stack>,
    stack_ids: FxHashMap<Box<[u32]>, u32>,
}

/// The id of the empty stack.
const EMPTY_STACK: u32 = 0;

/// Bytes of a frame beside its text: the struct and its two string buffers.
const FRAME_BYTES: u64 = std::mem::size_of::<Frame>() as u64 + 32;

impl FrameTable {
    fn new() -> FrameTable {
        let mut stack_ids = FxHashMap::default();
        stack_ids.insert(Box::from([]), EMPTY_STACK);
        FrameTable {
            frames: Vec::new(),
            frame_ids: FxHashMap::default(),
            stacks: vec![Arc::from(Vec::new())],
            stack_ids,
        }
    }

    /// The id of a frame; `None` if the budget refuses a new one (its text
    /// is copied: a frame of long strings costs their length).
    fn frame(&mut self, vm: &Vm, filename: u32, line: i64, name: u32) -> Option<u32> {
        if let Some(&id) = self.frame_ids.get(&(filename, line, name)) {
            return Some(id);
        }
        let text = (vm.str(filename).len() + vm.str(name).len()) as u64;
        if !vm.budget.spend(text / 64 + 1) || !vm.budget.charge(FRAME_BYTES + 64 + text) {
            return None;
        }
        let id = self.frames.len() as u32;
        self.frame_ids.insert((filename, line, name), id);
        self.frames.push(Frame {
            filename: vm.str(filename).to_string(),
            line,
            name: vm.str(name).to_string(),
        });
        Some(id)
    }

    /// The id of a stack of frames; `None` if the budget refuses a new one
    /// (a [`Stack`] owns copies of its frames: charged in full).
    fn stack(&mut self, vm: &Vm, ids: &[u32]) -> Option<u32> {
        if let Some(&s) = self.stack_ids.get(ids) {
            return Some(s);
        }
        let mut bytes = 96 + ids.len() as u64 * 4;
        for &f in ids {
            let fr = &self.frames[f as usize];
            bytes += FRAME_BYTES + (fr.filename.len() + fr.name.len()) as u64;
        }
        if !vm.budget.spend(bytes / 64 + 1) || !vm.budget.charge(bytes) {
            return None;
        }
        let s = self.stacks.len() as u32;
        let st: Stack = ids
            .iter()
            .map(|&f| self.frames[f as usize].clone())
            .collect();
        self.stacks.push(st);
        self.stack_ids.insert(Box::from(ids), s);
        Some(s)
    }

    /// The stack `id` (`None` for the empty one).
    fn get(&self, id: u32) -> Option<Stack> {
        (id != EMPTY_STACK).then(|| self.stacks[id as usize].clone())
    }
}

/// The decoder's sink: converts segments and events as they land and keeps
/// what a trace needs.
struct Builder {
    root: Option<u32>,
    segments_role: bool,
    traces_role: bool,
    /// Keys of the top-level dict seen (`segments`, `device_traces`) and the
    /// smallest others (for the message about a foreign dict).
    has_segments: bool,
    has_traces: bool,
    /// (With the bytes charged for each.)
    other_keys: BTreeMap<HashableValue, u64>,
    settings: BTreeMap<String, String>,
    segments: Vec<Segment>,
    segments_error: Option<TraceError>,
    devices: Vec<DeviceEvents>,
    /// Device trace lists in `device_traces`.
    trace_lists: usize,
    traces_error: Option<TraceError>,
    table: FrameTable,
    scratch: Vec<Val>,
    fids: Vec<u32>,
}

fn layout(what: &str) -> TraceError {
    ErrorKind::Schema(format!(
        "{what}; this reader follows the layout Python's pickle writes for torch.cuda.memory._dump_snapshot"
    ))
    .into()
}

impl Builder {
    fn new() -> Builder {
        Builder {
            root: None,
            segments_role: false,
            traces_role: false,
            has_segments: false,
            has_traces: false,
            other_keys: BTreeMap::new(),
            settings: BTreeMap::new(),
            segments: Vec::new(),
            segments_error: None,
            devices: Vec::new(),
            trace_lists: 0,
            traces_error: None,
            table: FrameTable::new(),
            scratch: Vec::new(),
            fids: Vec::new(),
        }
    }

    /// A frame dict as a frame id, `None` if it is not `{filename, line, name}`.
    fn frame_of(&mut self, vm: &mut Vm, d: u32) -> Option<u32> {
        let f = fields(vm, &vm.obj(d).items);
        let mut text = |v: Option<Val>| match v {
            Some(Val::Str(s)) => Some(s),
            Some(Val::Bytes(b)) => {
                if !vm.budget.spend(vm.bytes(b).len() as u64 / 64 + 1) {
                    return None;
                }
                let s = String::from_utf8_lossy(vm.bytes(b)).into_owned();
                vm.intern(&s).ok()
            }
            _ => None,
        };
        let filename = text(f[K_FILENAME as usize])?;
        let name = text(f[K_NAME as usize])?;
        let line = match int(vm, f[K_LINE as usize], K_LINE) {
            Ok(Some(n)) => i64::try_from(n).ok()?,
            _ => return None,
        };
        self.table.frame(vm, filename, line, name)
    }

    /// The `frames` of an event or block: `Ok(None)` where absent or empty,
    /// `Err` where it is not a list of `{filename, line, name}` dicts. A
    /// converted list and its frame dicts are settled (their memo slots hold
    /// the stack and frame ids from now on).
    fn frames_of(&mut self, vm: &mut Vm, v: Option<Val>) -> std::result::Result<Option<Stack>, ()> {
        let v = match v {
            None => return Ok(None),
            Some(Val::Stack(s)) => return Ok(self.table.get(s)),
            Some(v) => v,
        };
        let Some(items) = vm.items(v, &[Kind::List, Kind::Tuple]) else {
            return Err(());
        };
        // A tuple of frames is not settled: it may be looked at again.
        if !vm.budget.spend(items.len() as u64 + 1) {
            return Err(());
        }
        // The scratch lists grow to the longest list of frames (charged).
        let grow = items.len().saturating_sub(self.scratch.capacity());
        if grow > 0 && !vm.budget.charge(grow as u64 * 20) {
            return Err(());
        }
        let is_list = matches!(v, Val::Obj(i) if vm.obj(i).kind == Kind::List);
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.extend_from_slice(items);
        let mut fids = std::mem::take(&mut self.fids);
        fids.clear();
        let mut ok = true;
        for &it in &scratch {
            match it {
                Val::Frame(f) => fids.push(f),
                Val::Obj(d) if vm.obj(d).kind == Kind::Dict => match self.frame_of(vm, d) {
                    Some(f) => {
                        vm.settle(it, Val::Frame(f));
                        fids.push(f);
                    }
                    None => {
                        ok = false;
                        break;
                    }
                },
                _ => {
                    ok = false;
                    break;
                }
            }
        }
        let out = match ok.then(|| self.table.stack(vm, &fids)).flatten() {
            Some(s) => {
                if is_list {
                    vm.settle(v, Val::Stack(s));
                }
                Ok(self.table.get(s))
            }
            None => Err(()),
        };
        self.scratch = scratch;
        self.fids = fids;
        out
    }

    /// Device `d`'s events (`d` below [`MAX_DEVICES`], so at most a few
    /// dozen KiB of them; a refused charge ends the read all the same).
    fn device(&mut self, vm: &Vm, d: u32) -> &mut DeviceEvents {
        let d = d as usize;
        if self.devices.len() <= d {
            let add = (d + 1 - self.devices.len()) * std::mem::size_of::<DeviceEvents>();
            vm.budget.charge(add as u64);
            self.devices.resize_with(d + 1, DeviceEvents::default);
        }
        &mut self.devices[d]
    }

    /// Event `i` of device `d`.
    fn event(&mut self, vm: &mut Vm, d: u32, i: u32, v: Val) {
        if self.traces_error.is_some() || vm.budget.exhausted() {
            // The read fails; nothing more of the events is needed.
            vm.settle(v, Val::Dropped);
            return;
        }
        let parsed = parse_event(vm, v);
        let frames = match &parsed {
            Ok((_, f)) => *f,
            Err(_) => None,
        };
        let stack = self.frames_of(vm, frames);
        vm.settle(v, Val::Dropped);
        if self.traces_error.is_some() {
            return;
        }
        match parsed {
            Ok((e, _)) => {
                let dev = self.device(vm, d);
                if dev.events.len() == dev.events.capacity() {
                    let add = dev.events.capacity().max(64);
                    if !vm
                        .budget
                        .charge((add * std::mem::size_of::<Event>()) as u64)
                    {
                        return;
                    }
                    dev.events.reserve_exact(add);
                }
                if e.kind == EventKind::Alloc {
                    match stack {
                        Ok(Some(st)) => {
                            // A B-tree entry: key, value and its share of a node.
                            if !vm.budget.charge(48) {
                                return;
                            }
                            dev.frames.insert(dev.events.len(), st);
                        }
                        Ok(None) => {}
                        Err(()) => dev.bad_frames += 1,
                    }
                }
                dev.events.push(e);
            }
            Err(k) => {
                self.traces_error = Some(TraceError::new(k).on_device(d).at_event(i as usize))
            }
        }
    }

    /// Item `d` of `device_traces`.
    fn device_trace(&mut self, vm: &mut Vm, d: u32, v: Val) -> Result<()> {
        if let Val::Obj(o) = v {
            let role = vm.obj(o).role;
            if role != NO_ROLE {
                if role != ROLE_TRACE + d {
                    return Err(layout("a device trace list lands at another position"));
                }
                self.trace_lists = self.trace_lists.max(d as usize + 1);
                return Ok(());
            }
        }
        if self.traces_error.is_some() {
            return Ok(());
        }
        if d >= MAX_DEVICES {
            self.traces_error =
                Some(ErrorKind::Schema(format!("more than {MAX_DEVICES} device traces")).into());
            return Ok(());
        }
        self.trace_lists = self.trace_lists.max(d as usize + 1);
        self.device(vm, d);
        match vm.items(v, &[Kind::List, Kind::Tuple]) {
            Some(items) => {
                // A copy (the events are converted with the machine mutable).
                vm.spend(items.len() as u64)?;
                vm.charge(items.len() as u64 * 16)?;
                let items = items.to_vec();
                let n = items.len() as u64;
                for (i, ev) in items.into_iter().enumerate() {
                    if vm.budget.exhausted() {
                        break;
                    }
                    self.event(vm, d, i as u32, ev);
                }
                vm.budget.uncharge(n * 16);
            }
            None => {
                self.traces_error = Some(
                    TraceError::from(ErrorKind::Schema(format!(
                        "a device trace is {}, expected a list",
                        type_name(vm, v)
                    )))
                    .on_device(d),
                )
            }
        }
        Ok(())
    }

    /// Segment `si`.
    fn segment(&mut self, vm: &mut Vm, si: u32, v: Val) {
        if self.segments_error.is_some() || vm.budget.exhausted() {
            // The read fails; nothing more of the segments is needed.
            vm.settle(v, Val::Dropped);
            return;
        }
        let parsed = parse_segment(vm, v);
        // Settle what the segment holds: stacks may be shared with events
        // written later; the rest is consumed.
        if let Some(items) = vm.items(v, &[Kind::Dict]) {
            let f = fields(vm, items);
            let _ = self.frames_of(vm, f[K_FRAMES as usize]);
            if let Some(bl) = f[K_BLOCKS as usize] {
                if let Some(blocks) = vm.items(bl, &[Kind::List, Kind::Tuple]) {
                    // Owned: `frames_of` needs the machine mutably.
                    let n = blocks.len() as u64;
                    if !vm.budget.spend(n) || !vm.budget.charge(n * 16) {
                        return;
                    }
                    let blocks: Vec<Val> = blocks.to_vec();
                    for b in blocks {
                        if vm.budget.exhausted() {
                            break;
                        }
                        if let Some(bi) = vm.items(b, &[Kind::Dict]) {
                            let bf = fields(vm, bi)[K_FRAMES as usize];
                            let _ = self.frames_of(vm, bf);
                        }
                        vm.settle(b, Val::Dropped);
                    }
                    vm.budget.uncharge(n * 16);
                }
                vm.settle(bl, Val::Dropped);
            }
        }
        vm.settle(v, Val::Dropped);
        if self.segments_error.is_some() {
            return;
        }
        match parsed {
            Ok(s) => self.segments.push(s),
            Err(m) => {
                self.segments_error = Some(TraceError::new(ErrorKind::Schema(format!(
                    "segment {si}: {m}"
                ))))
            }
        }
    }

    /// A key and value of the top-level dict.
    fn root_item(&mut self, vm: &mut Vm, key: Val, v: Val) -> Result<()> {
        let role = match v {
            Val::Obj(o) => vm.obj(o).role,
            _ => NO_ROLE,
        };
        match key {
            Val::Str(K_SEGMENTS) => {
                if self.has_segments {
                    return Err(layout("`segments` appears twice"));
                }
                self.has_segments = true;
                if role == ROLE_SEGMENTS {
                    return Ok(());
                }
                match vm.items(v, &[Kind::List, Kind::Tuple]) {
                    Some(items) => {
                        let n = items.len() as u64;
                        vm.spend(n)?;
                        vm.charge(n * 16)?;
                        let items: Vec<Val> = items.to_vec();
                        for (si, s) in items.into_iter().enumerate() {
                            if vm.budget.exhausted() {
                                break;
                            }
                            self.segment(vm, si as u32, s);
                        }
                        vm.budget.uncharge(n * 16);
                    }
                    None => {
                        self.segments_error = Some(
                            ErrorKind::Schema(format!(
                                "`segments` is {}, expected a list",
                                type_name(vm, v)
                            ))
                            .into(),
                        )
                    }
                }
            }
            Val::Str(K_TRACES) => {
                if self.has_traces {
                    return Err(layout("`device_traces` appears twice"));
                }
                self.has_traces = true;
                if role == ROLE_TRACES {
                    return Ok(());
                }
                match vm.items(v, &[Kind::List, Kind::Tuple]) {
                    Some(items) => {
                        let n = items.len() as u64;
                        vm.spend(n)?;
                        vm.charge(n * 16)?;
                        let items: Vec<Val> = items.to_vec();
                        for (d, dv) in items.into_iter().enumerate() {
                            if vm.budget.exhausted() {
                                break;
                            }
                            self.device_trace(vm, u32::try_from(d).unwrap_or(u32::MAX), dv)?;
                        }
                        vm.budget.uncharge(n * 16);
                    }
                    None => {
                        self.traces_error = Some(
                            ErrorKind::Schema(format!(
                                "`device_traces` is {}, expected a list",
                                type_name(vm, v)
                            ))
                            .into(),
                        )
                    }
                }
            }
            _ => {
                if role != NO_ROLE {
                    return Err(layout(
                        "a list read as `segments` or `device_traces` lands under another key",
                    ));
                }
                if key == Val::Str(K_SETTINGS) {
                    self.set_settings(vm, v)?;
                }
                // Kept for a message only: a key too large is shown as such.
                let (k, bytes) = match decode::to_value(vm, key, &|_| Value::None, KEY_BYTES)? {
                    Whole::Value(k, bytes) => (
                        k.into_hashable()
                            .map_err(|e| TraceError::from(ErrorKind::Pickle(e.to_string())))?,
                        bytes,
                    ),
                    Whole::TooBig | Whole::TooDeep => {
                        (HashableValue::String("<a key too large to show>".into()), 0)
                    }
                };
                if let Some(old) = self.other_keys.insert(k, bytes) {
                    vm.budget.uncharge(old);
                }
                if self.other_keys.len() > 8 {
                    if let Some((_, b)) = self.other_keys.pop_last() {
                        vm.budget.uncharge(b);
                    }
                }
            }
        }
        Ok(())
    }

    /// `allocator_settings`, rendered as text (bounded: [`Whole`]; what is
    /// kept is charged, and charged again per device in [`Builder::finish`]).
    fn set_settings(&mut self, vm: &mut Vm, v: Val) -> Result<()> {
        let cap = vm.budget.limits().whole_value_bytes;
        let (value, bytes) = match decode::to_value(vm, v, &|_| Value::None, cap)? {
            Whole::Value(value, bytes) => (value, bytes),
            Whole::TooBig => {
                vm.budget.hit_limit(Hit::WholeBytes);
                return Err(vm.limit_err());
            }
            Whole::TooDeep => {
                vm.budget.hit_limit(Hit::WholeDepth);
                return Err(vm.limit_err());
            }
        };
        let settings: BTreeMap<String, String> = match value {
            Value::Dict(d) => d.iter().map(|(k, v)| (render_key(k), render(v))).collect(),
            _ => BTreeMap::new(),
        };
        vm.budget.uncharge(bytes);
        let kept = settings_bytes(&settings);
        vm.charge(kept)?;
        vm.budget.uncharge(settings_bytes(&self.settings));
        self.settings = settings;
        Ok(())
    }

    /// The trace, once the pickle's value is `top`.
    fn finish(mut self, vm: &mut Vm, top: Val, name: &str) -> Result<Trace> {
        let generic = match top {
            Val::Obj(o) if vm.obj(o).kind == Kind::Dict => {
                if self.root != Some(o) {
                    if self.root.is_some()
                        && (self.has_segments || self.has_traces || !self.other_keys.is_empty())
                    {
                        return Err(layout("the top-level dict is not the first value"));
                    }
                    let n = vm.obj(o).items.len() as u64;
                    vm.spend(n)?;
                    vm.charge(n * 16)?;
                    Some(vm.obj(o).items.clone())
                } else {
                    None
                }
            }
            other => {
                return Err(ErrorKind::Foreign(format!(
                    "the top level is {}, expected a dict with `segments` and `device_traces`",
                    type_name(vm, other)
                ))
                .into())
            }
        };
        if let Some(items) = generic {
            for p in items.chunks_exact(2) {
                if vm.budget.exhausted() {
                    break;
                }
                self.root_item(vm, p[0], p[1])?;
            }
            vm.budget.uncharge(items.len() as u64 * 16);
        }
        if !self.has_segments && !self.has_traces {
            let keys: Vec<String> = self
                .other_keys
                .keys()
                .map(|k| render(&k.clone().into_value()))
                .collect();
            return Err(ErrorKind::Foreign(format!(
                "a dict without `segments` or `device_traces` (keys: {})",
                if keys.is_empty() {
                    "none".to_string()
                } else {
                    keys.join(", ")
                }
            ))
            .into());
        }
        if let Some(e) = self.segments_error.take() {
            return Err(e);
        }
        if let Some(e) = self.traces_error.take() {
            return Err(e);
        }
        let mut per_device = std::mem::take(&mut self.devices);
        if !self.has_traces {
            per_device.clear();
        }
        per_device.resize_with(self.trace_lists, DeviceEvents::default);
        let segments = std::mem::take(&mut self.segments);
        let n_devices = segments
            .iter()
            .map(|s| s.device as usize + 1)
            .max()
            .unwrap_or(0)
            .max(per_device.len());
        let mut raw: Vec<RawDevice> = (0..n_devices)
            .map(|d| RawDevice {
                device: d as u32,
                ..RawDevice::default()
            })
            .collect();
        for (d, ev) in per_device.into_iter().enumerate() {
            raw[d].events = ev.events;
            raw[d].frames = ev.frames;
            raw[d].bad_frames = ev.bad_frames;
        }
        for s in segments {
            raw[s.device as usize].segments.push(s);
        }
        // Each device gets its own copy of the settings.
        let copies = raw
            .iter()
            .filter(|r| !r.events.is_empty() || !r.segments.is_empty());
        vm.charge(settings_bytes(&self.settings).saturating_mul(copies.count() as u64))?;
        let mut devices = Vec::new();
        for r in raw {
            if r.events.is_empty() && r.segments.is_empty() {
                continue;
            }
            let device = r.device;
            devices.push(build_device(r, &self.settings).map_err(|e| e.on_device(device))?);
        }
        Ok(Trace {
            name: name.to_string(),
            devices,
        })
    }
}

impl Sink for Builder {
    fn root_role(&mut self, kind: Kind) -> u32 {
        if kind == Kind::Dict && self.root.is_none() {
            ROLE_ROOT
        } else {
            NO_ROLE
        }
    }

    fn child_role(&mut self, _: &Vm, parent: u32, key: Option<Val>, index: u32, kind: Kind) -> u32 {
        if kind != Kind::List {
            return NO_ROLE;
        }
        match (parent, key) {
            (ROLE_ROOT, Some(Val::Str(K_SEGMENTS))) if !self.segments_role => {
                self.segments_role = true;
                ROLE_SEGMENTS
            }
            (ROLE_ROOT, Some(Val::Str(K_TRACES))) if !self.traces_role => {
                self.traces_role = true;
                ROLE_TRACES
            }
            (ROLE_TRACES, None) if index < MAX_DEVICES => ROLE_TRACE + index,
            _ => NO_ROLE,
        }
    }

    fn land(
        &mut self,
        vm: &mut Vm,
        target: u32,
        key: Option<Val>,
        index: u32,
        item: Val,
    ) -> Result<()> {
        let role = vm.obj(target).role;
        if role == ROLE_ROOT && self.root.is_none() {
            self.root = Some(target);
        }
        if role == ROLE_ROOT && self.root != Some(target) {
            return Err(layout("two top-level dicts"));
        }
        match role {
            ROLE_ROOT => self.root_item(vm, key.unwrap_or(Val::None), item)?,
            _ => {
                if let Val::Obj(o) = item {
                    let r = vm.obj(o).role;
                    if r != NO_ROLE && !(role == ROLE_TRACES && r >= ROLE_TRACE) {
                        return Err(layout(
                            "a list read as part of the snapshot lands inside an event or segment",
                        ));
                    }
                }
                match role {
                    ROLE_SEGMENTS => self.segment(vm, index, item),
                    ROLE_TRACES => self.device_trace(vm, index, item)?,
                    _ => self.event(vm, role - ROLE_TRACE, index, item),
                }
            }
        }
        Ok(())
    }
}

/// An integer field; `None` when absent or Python `None`.
fn int(vm: &Vm, v: Option<Val>, key: u32) -> std::result::Result<Option<i128>, ErrorKind> {
    match v {
        None | Some(Val::None) | Some(Val::Global(_)) => Ok(None),
        Some(Val::Int(i)) => Ok(Some(i as i128)),
        Some(Val::Big(b)) => vm
            .big(b)
            .to_string()
            .parse::<i128>()
            .map(Some)
            .map_err(|_| ErrorKind::Absurd {
                field: field_name(key),
                value: u128::MAX,
            }),
        Some(Val::Bool(b)) => Ok(Some(b as i128)),
        Some(other) => Err(ErrorKind::Schema(format!(
            "`{}` is {}, expected an integer",
            key_name(key),
            type_name(vm, other)
        ))),
    }
}

fn field_name(key: u32) -> &'static str {
    match key {
        K_ADDR | K_ADDRESS | K_DEVICE_FREE => "address",
        K_STREAM => "stream",
        K_TIME => "time",
        _ => "size",
    }
}

fn to_u64(v: i128, key: u32) -> std::result::Result<u64, ErrorKind> {
    if v < 0 {
        return Err(ErrorKind::Negative {
            field: field_name(key),
            value: v,
        });
    }
    u64::try_from(v).map_err(|_| ErrorKind::Absurd {
        field: field_name(key),
        value: v as u128,
    })
}

fn to_size(v: i128, key: u32) -> std::result::Result<u64, ErrorKind> {
    let s = to_u64(v, key)?;
    if s > MAX_SIZE {
        return Err(ErrorKind::Absurd {
            field: field_name(key),
            value: s.into(),
        });
    }
    Ok(s)
}

/// Streams are opaque: PyTorch stores the `cudaStream_t` as a signed 64-bit
/// integer, so a negative value is kept as its two's-complement bits.
fn to_stream(v: i128) -> std::result::Result<u64, ErrorKind> {
    if let Ok(i) = i64::try_from(v) {
        Ok(i as u64)
    } else {
        u64::try_from(v).map_err(|_| ErrorKind::Schema(format!("stream {v} out of range")))
    }
}

/// Why `v`, expected to be a dict, is not one.
fn not_a_dict(vm: &Vm, v: Val) -> String {
    if v == Val::Dropped {
        // A memo reference to an event, segment or block dict converted and
        // freed before (see docs/trace-format.md, "Reading large snapshots").
        "is a dict object that already appeared earlier in the file (one object in two \
         places, which PyTorch never writes; this reader converts each event, segment and \
         block dict once)"
            .to_string()
    } else {
        format!("is {}, expected a dict", type_name(vm, v))
    }
}

/// An event dict as an [`Event`], and its `frames` value.
fn parse_event(vm: &Vm, v: Val) -> std::result::Result<(Event, Option<Val>), ErrorKind> {
    let items = vm
        .items(v, &[Kind::Dict])
        .ok_or_else(|| ErrorKind::Schema(format!("event {}", not_a_dict(vm, v))))?;
    let d = fields(vm, items);
    let kind = match d[K_ACTION as usize] {
        Some(Val::Str(s)) => match s.checked_sub(K_ACTIONS) {
            Some(i) if (i as usize) < ACTIONS.len() => ACTION_KINDS[i as usize],
            _ => {
                return Err(ErrorKind::UnknownAction {
                    action: shorten(vm.str(s)),
                    known: ACTIONS.join(", "),
                })
            }
        },
        Some(other) => {
            return Err(ErrorKind::Schema(format!(
                "`action` is {}",
                type_name(vm, other)
            )))
        }
        None => return Err(ErrorKind::Schema("event without `action`".into())),
    };
    let action = || match d[K_ACTION as usize] {
        Some(Val::Str(s)) => vm.str(s),
        _ => "",
    };
    let tracked = matches!(
        kind,
        EventKind::Alloc | EventKind::Free | EventKind::FreeRequested
    );
    let addr_key = if kind == EventKind::Oom && d[K_ADDR as usize].is_none() {
        K_DEVICE_FREE
    } else {
        K_ADDR
    };
    let addr = match int(vm, d[addr_key as usize], addr_key)? {
        Some(a) => to_u64(a, addr_key)?,
        None if tracked => {
            return Err(ErrorKind::Schema(format!(
                "`{}` event without `addr`",
                action()
            )))
        }
        None => 0,
    };
    let size = match int(vm, d[K_SIZE as usize], K_SIZE)? {
        Some(s) => {
            if matches!(
                kind,
                EventKind::Oom | EventKind::UserDefined | EventKind::Snapshot
            ) {
                to_u64(s, K_SIZE)?
            } else {
                to_size(s, K_SIZE)?
            }
        }
        None if tracked => {
            return Err(ErrorKind::Schema(format!(
                "`{}` event without `size`",
                action()
            )))
        }
        None => 0,
    };
    let stream = match int(vm, d[K_STREAM as usize], K_STREAM)? {
        Some(s) => to_stream(s)?,
        None => 0,
    };
    let time_us = match int(vm, d[K_TIME as usize], K_TIME)? {
        Some(t) => Some(
            i64::try_from(t)
                .map_err(|_| ErrorKind::Schema(format!("`time_us` {t} out of range")))?,
        ),
        None => None,
    };
    Ok((
        Event {
            kind,
            addr,
            size,
            stream,
            time_us,
        },
        d[K_FRAMES as usize],
    ))
}

fn parse_segment(vm: &Vm, v: Val) -> std::result::Result<Segment, String> {
    let items = vm
        .items(v, &[Kind::Dict])
        .ok_or_else(|| not_a_dict(vm, v))?;
    let d = fields(vm, items);
    let e = |k: ErrorKind| k.to_string();
    let device = match int(vm, d[K_DEVICE as usize], K_DEVICE).map_err(e)? {
        Some(x) if (0..MAX_DEVICES as i128).contains(&x) => x as u32,
        Some(x) => return Err(format!("device {x} out of range (0..{MAX_DEVICES})")),
        None => 0,
    };
    let address = to_u64(
        int(vm, d[K_ADDRESS as usize], K_ADDRESS)
            .map_err(e)?
            .ok_or("no `address`")?,
        K_ADDRESS,
    )
    .map_err(e)?;
    let total_size = to_size(
        int(vm, d[K_TOTAL as usize], K_TOTAL)
            .map_err(e)?
            .ok_or("no `total_size`")?,
        K_TOTAL,
    )
    .map_err(e)?;
    let stream = int(vm, d[K_STREAM as usize], K_STREAM)
        .map_err(e)?
        .map(to_stream)
        .transpose()
        .map_err(e)?
        .unwrap_or(0);
    let segment_type = match d[K_SEGTYPE as usize] {
        Some(Val::Str(s)) => vm.str(s),
        _ => "",
    };
    // What the segment keeps (its type is copied: a long one costs its length).
    let n_blocks = match d[K_BLOCKS as usize] {
        Some(bv) => vm
            .items(bv, &[Kind::List, Kind::Tuple])
            .map_or(0, <[Val]>::len),
        None => 0,
    };
    let kept = std::mem::size_of::<Segment>() * 2
        + segment_type.len()
        + n_blocks * std::mem::size_of::<Block>();
    if !vm.budget.spend(n_blocks as u64 + 1) || !vm.budget.charge(kept as u64) {
        return Err("over the reader's budget".into());
    }
    let segment_type = segment_type.to_string();
    let is_expandable = match d[K_EXPANDABLE as usize] {
        Some(Val::Bool(b)) => Some(b),
        _ => None,
    };
    let mut blocks = Vec::new();
    let mut next_addr = address;
    if let Some(bv) = d[K_BLOCKS as usize] {
        let list = vm
            .items(bv, &[Kind::List, Kind::Tuple])
            .ok_or_else(|| format!("`blocks` is {}", type_name(vm, bv)))?;
        blocks.reserve(list.len());
        for (bi, &b) in list.iter().enumerate() {
            if vm.budget.exhausted() {
                return Err("over the reader's budget".into());
            }
            let block = parse_block(vm, b, next_addr).map_err(|m| format!("block {bi}: {m}"))?;
            next_addr = block.address.saturating_add(block.size);
            blocks.push(block);
        }
    }
    Ok(Segment {
        device,
        address,
        total_size,
        stream,
        segment_type,
        is_expandable,
        blocks,
    })
}

fn parse_block(vm: &Vm, v: Val, default_addr: u64) -> std::result::Result<Block, String> {
    let items = vm
        .items(v, &[Kind::Dict])
        .ok_or_else(|| not_a_dict(vm, v))?;
    let d = fields(vm, items);
    let e = |k: ErrorKind| k.to_string();
    let size = to_size(
        int(vm, d[K_SIZE as usize], K_SIZE)
            .map_err(e)?
            .ok_or("no `size`")?,
        K_SIZE,
    )
    .map_err(e)?;
    let address = match int(vm, d[K_ADDRESS as usize], K_ADDRESS).map_err(e)? {
        Some(a) => to_u64(a, K_ADDRESS).map_err(e)?,
        None => default_addr,
    };
    let state = match d[K_STATE as usize] {
        Some(Val::Str(s)) => match s.checked_sub(K_STATES) {
            Some(i) if (i as usize) < STATES.len() => STATES[i as usize].1,
            _ => return Err(format!("unknown state `{}`", shorten(vm.str(s)))),
        },
        Some(other) => return Err(format!("`state` is {}", type_name(vm, other))),
        None => return Err("no `state`".into()),
    };
    // Requested size: the block's own field (PyTorch >= 2.1), else the last
    // history entry at this address (PyTorch 2.0), else the block size.
    let mut requested = int(vm, d[K_REQUESTED as usize], K_REQUESTED)
        .map_err(e)?
        .map(|r| to_size(r, K_REQUESTED))
        .transpose()
        .map_err(e)?;
    if requested.is_none() {
        if let Some(h) = d[K_HISTORY as usize].and_then(|h| vm.items(h, &[Kind::List])) {
            for &entry in h.iter().rev() {
                if vm.budget.exhausted() {
                    break;
                }
                let Some(hi) = vm.items(entry, &[Kind::Dict]) else {
                    continue;
                };
                let hd = fields(vm, hi);
                let at = int(vm, hd[K_ADDR as usize], K_ADDR).map_err(e)?;
                if at.is_some() && at != Some(address as i128) {
                    continue;
                }
                if let Some(r) = int(vm, hd[K_REAL as usize], K_REAL).map_err(e)? {
                    requested = Some(to_size(r, K_REAL).map_err(e)?);
                    break;
                }
            }
        }
    }
    let requested_size = match requested {
        Some(r) if r > 0 => r,
        _ => size,
    };
    Ok(Block {
        address,
        size,
        requested_size,
        state,
    })
}

/// Bytes of rendered settings: their text and a map entry each.
fn settings_bytes(s: &BTreeMap<String, String>) -> u64 {
    s.iter().map(|(k, v)| (k.len() + v.len() + 96) as u64).sum()
}

/// `s` cut to 100 characters for a message (a crafted one can be megabytes).
fn shorten(s: &str) -> String {
    match s.char_indices().nth(100) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

fn render_key(k: &HashableValue) -> String {
    match k {
        HashableValue::String(s) => s.clone(),
        other => render(&other.clone().into_value()),
    }
}

/// Renders a value roughly as Python's `repr` (strings at the top level unquoted).
fn render(v: &Value) -> String {
    fn inner(v: &Value, out: &mut String) {
        use std::fmt::Write;
        match v {
            Value::None => out.push_str("None"),
            Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
            Value::I64(i) => {
                let _ = write!(out, "{i}");
            }
            Value::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Value::F64(f) => {
                let _ = write!(out, "{f:?}");
            }
            Value::Bytes(b) => {
                let _ = write!(out, "<{} bytes>", b.len());
            }
            Value::String(s) => {
                let _ = write!(out, "'{s}'");
            }
            Value::List(l) | Value::Tuple(l) => {
                out.push('[');
                for (i, x) in l.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    inner(x, out);
                }
                out.push(']');
            }
            Value::Set(s) | Value::FrozenSet(s) => {
                out.push('{');
                for (i, x) in s.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    inner(&x.clone().into_value(), out);
                }
                out.push('}');
            }
            Value::Dict(d) => {
                out.push('{');
                for (i, (k, x)) in d.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    inner(&k.clone().into_value(), out);
                    out.push_str(": ");
                    inner(x, out);
                }
                out.push('}');
            }
        }
    }
    match v {
        Value::String(s) => s.clone(),
        other => {
            let mut s = String::new();
            inner(other, &mut s);
            s
        }
    }
}

pub(crate) fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
