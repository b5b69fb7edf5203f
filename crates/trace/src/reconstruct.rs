//! Reconstruction of the allocations that were live before a snapshot's
//! recording began, and the checks of the trace against the final state.
//!
//! PyTorch records a bounded history (`_record_memory_history(max_entries=…)`)
//! that usually starts after the model's weights and optimizer state exist, so
//! a trace alone understates the memory a run needs. Two facts recover the
//! missing allocations:
//!
//! 1. an address whose first replayed event is a **free** was live at the start
//!    (its size and stream come from that free event, which PyTorch records with
//!    the block's requested size);
//! 2. a block that is **active** in the final segments (`active_allocated` or
//!    `active_pending_free`) at an address the trace never allocates nor frees
//!    was live throughout (its size is the block's `requested_size`, its stream
//!    the segment's).
//!
//! Where the final state disagrees with the trace (a block active at the end
//! that the trace freed; an allocation live at the end of the trace without an
//! active block; different sizes), the trace wins and each kind of
//! disagreement is counted in one warning. Double allocations and double frees
//! inside the trace are errors: no truncation explains them.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::error::{ErrorKind, Result, TraceError};
use crate::model::{
    Alloc, BlockState, DeviceTrace, DeviceTraceParts, Event, EventKind, Segment, Stack,
};

/// One device of a snapshot, as read: events in order (frees not yet resolved)
/// and the final segments. Public so that another snapshot reader (the old
/// one kept as a test oracle in `vmmalloc-trace-testkit`) builds its traces
/// through the same reconstruction.
#[derive(Debug, Default)]
pub struct RawDevice {
    /// The device index.
    pub device: u32,
    /// The device's events, in order (`free_requested` not yet resolved).
    pub events: Vec<Event>,
    /// The final segments of the device.
    pub segments: Vec<Segment>,
    /// Stacks of alloc events, by event index.
    pub frames: BTreeMap<usize, Stack>,
    /// Alloc events whose `frames` were not a list of frame dicts (a warning).
    pub bad_frames: usize,
}

/// The warning for a snapshot whose device has segments but no events: what
/// happened and the two lines of PyTorch that record the history.
pub const NO_HISTORY_WARNING: &str = "no events were recorded: the snapshot holds the final segments but its `device_traces` are empty, \
so this is not a trace and the replay sees only the allocations live at the end. \
Record the history before the work, then dump: \
`torch.cuda.memory._record_memory_history(max_entries=100000)` ... \
`torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")`";

/// Resolves frees, reconstructs the pre-trace allocations, checks the trace
/// against the final segments and builds the device trace.
pub fn build_device(raw: RawDevice, settings: &BTreeMap<String, String>) -> Result<DeviceTrace> {
    let RawDevice {
        device,
        mut events,
        segments,
        frames,
        bad_frames,
    } = raw;
    let mut warnings = Vec::new();
    if events.is_empty() {
        // The commonest mistake: `_dump_snapshot` without
        // `_record_memory_history` first (torch/cuda/memory.py) writes the
        // segments but an empty `device_traces` list.
        warnings.push(NO_HISTORY_WARNING.to_string());
    }

    // Final state per address (the last block listed wins if a corrupt file repeats one).
    let mut final_blocks: HashMap<u64, (u64, u64, BlockState)> = HashMap::new();
    let mut repeated = 0usize;
    for s in &segments {
        for b in &s.blocks {
            if final_blocks
                .insert(b.address, (b.requested_size, s.stream, b.state))
                .is_some()
            {
                repeated += 1;
            }
        }
    }
    if repeated > 0 {
        warnings.push(format!(
            "{repeated} final blocks repeat an address listed before; the last one is used"
        ));
    }

    let promoted = resolve_frees(&mut events, &final_blocks);
    if promoted > 0 {
        warnings.push(format!(
            "{promoted} `free_requested` events have no `free_completed` after them; they were replayed as the free"
        ));
    }

    // Forward walk: frees of untouched addresses reveal pre-trace allocations.
    let mut pre: BTreeMap<u64, Alloc> = BTreeMap::new();
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut touched: HashSet<u64> = HashSet::new();
    for (i, e) in events.iter().enumerate() {
        let at = |kind: ErrorKind| TraceError::new(kind).on_device(device).at_event(i);
        match e.kind {
            EventKind::Alloc => {
                if live.insert(e.addr, e.size).is_some() {
                    return Err(at(ErrorKind::DoubleAlloc { addr: e.addr }));
                }
                touched.insert(e.addr);
            }
            EventKind::Free => {
                if live.remove(&e.addr).is_some() {
                    continue;
                }
                if !touched.insert(e.addr) {
                    return Err(at(ErrorKind::FreeOfUnknown { addr: e.addr }));
                }
                if e.size == 0 {
                    return Err(at(ErrorKind::ZeroSize));
                }
                pre.insert(
                    e.addr,
                    Alloc {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                    },
                );
            }
            _ => {}
        }
    }

    // Final active blocks the trace never touches were live throughout.
    let mut freed_but_active = 0usize;
    let mut size_mismatch = 0usize;
    let mut empty_blocks = 0usize;
    for (&addr, &(requested, stream, state)) in &final_blocks {
        if !state.is_active() {
            continue;
        }
        if !touched.contains(&addr) {
            if requested == 0 {
                empty_blocks += 1;
                continue;
            }
            pre.insert(
                addr,
                Alloc {
                    addr,
                    size: requested,
                    stream,
                },
            );
        } else {
            match live.get(&addr) {
                None => freed_but_active += 1,
                Some(&size) if size != requested => size_mismatch += 1,
                Some(_) => {}
            }
        }
    }
    let live_without_block = live
        .keys()
        .filter(|a| !matches!(final_blocks.get(a), Some((_, _, s)) if s.is_active()))
        .count();
    if empty_blocks > 0 {
        warnings.push(format!(
            "{empty_blocks} active final blocks of size 0 were ignored"
        ));
    }
    if freed_but_active > 0 {
        warnings.push(format!(
            "{freed_but_active} blocks active in the final segments were freed by the trace and not allocated again; the trace wins"
        ));
    }
    if live_without_block > 0 {
        warnings.push(format!(
            "{live_without_block} allocations live at the end of the trace have no active block in the final segments (final segments missing or taken later); they stay live"
        ));
    }
    if size_mismatch > 0 {
        warnings.push(format!(
            "{size_mismatch} allocations live at the end of the trace differ in size from their final block's requested size; the trace wins"
        ));
    }

    if bad_frames > 0 {
        warnings.push(format!(
            "{bad_frames} allocation events have `frames` that are not a list of {{filename, line, name}} dicts; their stacks are dropped"
        ));
    }
    DeviceTrace::new(DeviceTraceParts {
        device,
        pre_trace: pre.into_values().collect(),
        events,
        segments_final: segments,
        allocator_settings: settings.clone(),
        warnings,
        frames,
    })
}

/// Decides, per `free_requested`, whether it is the replayed free (see the
/// module docs of [`crate::pytorch`]); returns how many were promoted to
/// [`EventKind::Free`].
fn resolve_frees(
    events: &mut [Event],
    final_blocks: &HashMap<u64, (u64, u64, BlockState)>,
) -> usize {
    let mut completed_later: HashSet<u64> = HashSet::new();
    let mut allocated_later: HashSet<u64> = HashSet::new();
    let mut promoted = 0;
    for e in events.iter_mut().rev() {
        match e.kind {
            EventKind::Free => {
                completed_later.insert(e.addr);
            }
            EventKind::Alloc => {
                completed_later.remove(&e.addr);
                allocated_later.insert(e.addr);
            }
            EventKind::FreeRequested => {
                if completed_later.contains(&e.addr) {
                    continue;
                }
                let pending_at_end = !allocated_later.contains(&e.addr)
                    && matches!(
                        final_blocks.get(&e.addr),
                        Some((_, _, BlockState::ActivePendingFree))
                    );
                if !pending_at_end {
                    e.kind = EventKind::Free;
                    completed_later.insert(e.addr);
                    promoted += 1;
                }
            }
            _ => {}
        }
    }
    promoted
}
