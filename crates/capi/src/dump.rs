//! `vmmalloc_dump_snapshot`: the allocators' state as a pickle in PyTorch's
//! snapshot schema (`torch.cuda.memory._snapshot()`), so `torch.cuda._memory_viz`,
//! pytorch.org/memory_viz and our own trace reader can read it.
//!
//! ```text
//! {
//!   "segments": [ {device, address, total_size, stream, segment_type,
//!                  segment_pool_id: (0, 0), allocated_size, active_size,
//!                  requested_size, is_expandable, frames: [],
//!                  blocks: [ {address, size, requested_size, state, frames: []} ]} ],
//!   "device_traces": [ [ {action, addr, size, stream, time_us, frames: []
//!                          (+ device_free for oom)} ] per device ],
//!   "allocator_settings": {"VMMALLOC_CONF": str, "backend": str, ..., "expandable_segments": bool},
//!   "external_annotations": [],
//! }
//! ```
//!
//! Blocks cover their segment exactly (sizes sum to `total_size`), which
//! `_memory_viz.segsum` asserts, and states are PyTorch's (`active_allocated`,
//! `active_pending_free`, `inactive`). As PyTorch does for expandable
//! segments, each contiguous *mapped* run of an expandable segment is reported
//! as one segment, and address space without pages behind it is left out.
//! `device_traces` has one list
//! per device up to the highest ordinal in use (empty lists without
//! `record_history:True`). No stack frames are recorded: `frames` is empty.

use crate::config::Config;
use crate::runtime::Runtime;
use serde_pickle::{HashableValue, SerOptions, Value};
use std::collections::BTreeMap;
use std::path::Path;
use vmmalloc_alloc::{BlockInfo, BlockState, Policy, SegmentInfo, Snapshot};

fn key(k: &str) -> HashableValue {
    HashableValue::String(k.to_string())
}

fn int(x: u64) -> Result<Value, String> {
    i64::try_from(x)
        .map(Value::I64)
        .map_err(|_| format!("value {x:#x} does not fit a pickle int64"))
}

fn dict(items: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        items
            .into_iter()
            .map(|(k, v)| (key(k), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

/// One reported segment: a PyTorch segment, or a mapped run of an expandable one.
struct Run<'a> {
    seg: &'a SegmentInfo,
    blocks: &'a [BlockInfo],
}

/// The segments as PyTorch reports them: whole non-expandable segments, and
/// each contiguous run of mapped blocks of an expandable one.
fn runs(snap: &Snapshot) -> Vec<Run<'_>> {
    let mut out = Vec::new();
    for seg in &snap.segments {
        if !seg.is_expandable {
            out.push(Run {
                seg,
                blocks: &seg.blocks,
            });
            continue;
        }
        let mut start = None;
        for (i, b) in seg.blocks.iter().enumerate() {
            match (b.state == BlockState::Unmapped, start) {
                (false, None) => start = Some(i),
                (true, Some(s)) => {
                    out.push(Run {
                        seg,
                        blocks: &seg.blocks[s..i],
                    });
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            out.push(Run {
                seg,
                blocks: &seg.blocks[s..],
            });
        }
    }
    out
}

fn segments(snap: &Snapshot, out: &mut Vec<Value>) -> Result<(), String> {
    for Run {
        seg: s,
        blocks: run,
    } in runs(snap)
    {
        let (mut total, mut allocated, mut active, mut requested) = (0, 0, 0, 0);
        let mut blocks = Vec::with_capacity(run.len());
        for b in run {
            total += b.size;
            match b.state {
                BlockState::ActiveAllocated => {
                    allocated += b.size;
                    active += b.size;
                    requested += b.requested_size;
                }
                BlockState::ActivePendingFree => active += b.size,
                BlockState::Inactive | BlockState::Unmapped => {}
            }
            blocks.push(dict(vec![
                ("address", int(b.address)?),
                ("size", int(b.size)?),
                ("requested_size", int(b.requested_size)?),
                ("state", Value::String(b.state.as_str().to_string())),
                ("frames", Value::List(Vec::new())),
            ]));
        }
        let address = run.first().map_or(s.address, |b| b.address);
        out.push(dict(vec![
            ("device", int(snap.device as u64)?),
            ("address", int(address)?),
            (
                "total_size",
                int(if s.is_expandable { total } else { s.total_size })?,
            ),
            ("stream", int(s.stream.0)?),
            ("segment_type", Value::String(s.segment_type.to_string())),
            (
                "segment_pool_id",
                Value::Tuple(vec![Value::I64(0), Value::I64(0)]),
            ),
            (
                "allocated_size",
                int(if s.is_expandable {
                    allocated
                } else {
                    s.allocated_size
                })?,
            ),
            (
                "active_size",
                int(if s.is_expandable {
                    active
                } else {
                    s.active_size
                })?,
            ),
            (
                "requested_size",
                int(if s.is_expandable {
                    requested
                } else {
                    s.requested_size
                })?,
            ),
            ("is_expandable", Value::Bool(s.is_expandable)),
            ("frames", Value::List(Vec::new())),
            ("blocks", Value::List(blocks)),
        ]));
    }
    Ok(())
}

fn settings(config: &Config) -> Value {
    let mut items: Vec<(&str, Value)> =
        vec![("VMMALLOC_CONF", Value::String(config.source.clone()))];
    for (k, v) in config.settings() {
        items.push((k, Value::String(v)));
    }
    let policy = config.effective_policy();
    items.push((
        "expandable_segments",
        Value::Bool(matches!(policy, Policy::Expandable | Policy::TorchEs)),
    ));
    dict(items)
}

/// The whole snapshot as a pickle value.
pub fn snapshot_value(rt: &Runtime) -> Result<Value, String> {
    let config = rt.config()?;
    let mut segs = Vec::new();
    let mut traces: Vec<Value> = Vec::new();
    for d in rt.active_devices() {
        let snap = d.allocator.snapshot();
        segments(&snap, &mut segs)?;
        while traces.len() <= d.ordinal as usize {
            traces.push(Value::List(Vec::new()));
        }
        if let Some(h) = &d.history {
            let mut events = Vec::new();
            for e in h.entries() {
                let mut items = vec![
                    ("action", Value::String(e.action.to_string())),
                    ("addr", int(e.addr)?),
                    ("size", int(e.size)?),
                    ("stream", int(e.stream)?),
                    ("time_us", Value::I64(e.time_us)),
                    ("frames", Value::List(Vec::new())),
                ];
                if let Some(f) = e.device_free {
                    items.push(("device_free", int(f)?));
                }
                events.push(dict(items));
            }
            traces[d.ordinal as usize] = Value::List(events);
        }
    }
    if traces.is_empty() {
        traces.push(Value::List(Vec::new()));
    }
    Ok(dict(vec![
        ("segments", Value::List(segs)),
        ("device_traces", Value::List(traces)),
        ("allocator_settings", settings(config)),
        ("external_annotations", Value::List(Vec::new())),
    ]))
}

/// Writes the snapshot pickle to `path`.
pub fn dump(rt: &Runtime, path: &Path) -> Result<(), String> {
    let v = snapshot_value(rt)?;
    let bytes = serde_pickle::value_to_vec(&v, SerOptions::new())
        .map_err(|e| format!("pickling failed: {e}"))?;
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}
