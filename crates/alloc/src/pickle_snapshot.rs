//! Allocator state as a pickle in PyTorch's snapshot schema
//! (`torch.cuda.memory._snapshot()`), so `torch.cuda._memory_viz`,
//! pytorch.org/memory_viz and vmmalloc's own trace reader can read it.
//!
//! ```text
//! {
//!   "segments": [ {device, address, total_size, stream, segment_type,
//!                  segment_pool_id, allocated_size, active_size,
//!                  requested_size, is_expandable, frames: [],
//!                  blocks: [ {address, size, requested_size, state, frames: []} ]} ],
//!   "device_traces": [ [ {action, addr, size, stream, time_us, frames: []
//!                          (+ device_free for oom)} ] per device ],
//!   "allocator_settings": {key: str | bool | int, ...},
//!   "external_annotations": [],
//! }
//! ```
//!
//! Blocks cover their segment exactly (sizes sum to `total_size`), which
//! `_memory_viz.segsum` asserts, and states are PyTorch's (`active_allocated`,
//! `active_pending_free`, `inactive`). As PyTorch does for expandable
//! segments, each contiguous *mapped* run of an expandable segment is reported
//! as one segment, and address space without pages behind it is left out.
//! `device_traces` has one list per device up to the highest ordinal given
//! (an empty list for a device without recorded events). `frames` lists are
//! empty unless the caller passes stacks ([`DumpFrames`], e.g. from an input
//! snapshot that had them).
//!
//! The writer is generic: it takes each device's [`Snapshot`], the settings as
//! `(key, value)` pairs and optional per-device [`TraceEntry`] events. The
//! plug-in's `vmmalloc_dump_snapshot` and the `vmmalloc snapshot` command both
//! use it.

/// The `action` strings of PyTorch's trace entries, in the order of its
/// `TraceEntry::Action` enum (c10/core/CachingDeviceAllocator.h: ALLOC,
/// FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
/// SEGMENT_UNMAP, SNAPSHOT, OOM, USER_DEFINED): an action's index is its
/// enum value. The one list the trace reader and the C ABI's history share.
pub const TRACE_ACTIONS: [&str; 10] = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "user_defined",
];

use crate::{BlockInfo, BlockState, SegmentInfo, Snapshot};
use serde_pickle::{HashableValue, SerOptions, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// One event, in PyTorch's `TraceEntry` shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`,
    /// `segment_free`, `segment_map`, `segment_unmap` or `oom`.
    pub action: &'static str,
    /// Address (for `oom`: the device's free bytes, as PyTorch records it).
    pub addr: u64,
    /// Bytes: requested size for alloc/free, range size for segment events.
    pub size: u64,
    /// The stream (raw `CUstream` value; 0 = default stream).
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// `oom` only: free device memory as the driver reported it.
    pub device_free: Option<u64>,
}

/// A value of `allocator_settings`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting {
    /// A string (most settings, rendered as the configuration writes them).
    Str(String),
    /// A flag (`expandable_segments`, as PyTorch writes it).
    Bool(bool),
    /// A number.
    Int(i64),
}

impl From<String> for Setting {
    fn from(s: String) -> Self {
        Setting::Str(s)
    }
}

impl From<&str> for Setting {
    fn from(s: &str) -> Self {
        Setting::Str(s.to_string())
    }
}

impl From<bool> for Setting {
    fn from(b: bool) -> Self {
        Setting::Bool(b)
    }
}

impl From<i64> for Setting {
    fn from(x: i64) -> Self {
        Setting::Int(x)
    }
}

/// One device's part of a snapshot.
#[derive(Debug, Clone, Copy)]
pub struct DeviceDump<'a> {
    /// The allocator's segments and blocks; its `device` is the ordinal the
    /// segments and the trace list are written under.
    pub snapshot: &'a Snapshot,
    /// The device's recorded events, oldest first (`None`: nothing recorded,
    /// an empty list is written).
    pub trace: Option<&'a [TraceEntry]>,
    /// Stack frames to write, where known (`None`: every `frames` is empty).
    pub frames: Option<&'a DumpFrames>,
}

/// The stacks a snapshot carries: per block address (the allocation live
/// there) and per index into [`DeviceDump::trace`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DumpFrames {
    /// Block address -> the stack of the allocation in it.
    pub blocks: std::collections::HashMap<u64, crate::Stack>,
    /// Index of a trace entry -> its stack.
    pub trace: std::collections::HashMap<usize, crate::Stack>,
}

/// A stack as PyTorch's `frames` list of `{filename, line, name}` dicts.
fn frames_value(stack: Option<&crate::Stack>) -> Value {
    Value::List(
        stack
            .map(|st| {
                st.iter()
                    .map(|f| {
                        dict(vec![
                            ("filename", Value::String(f.filename.clone())),
                            ("line", Value::I64(f.line)),
                            ("name", Value::String(f.name.clone())),
                        ])
                    })
                    .collect()
            })
            .unwrap_or_default(),
    )
}

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
            // Unmapped and paused blocks have no memory behind them.
            let no_memory = matches!(b.state, BlockState::Unmapped | BlockState::Paused);
            match (no_memory, start) {
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

fn segments(
    snap: &Snapshot,
    frames: Option<&DumpFrames>,
    out: &mut Vec<Value>,
) -> Result<(), String> {
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
                BlockState::Inactive | BlockState::Unmapped | BlockState::Paused => {}
            }
            blocks.push(dict(vec![
                ("address", int(b.address)?),
                ("size", int(b.size)?),
                ("requested_size", int(b.requested_size)?),
                ("state", Value::String(b.state.as_str().to_string())),
                (
                    "frames",
                    frames_value(
                        frames
                            .filter(|_| {
                                matches!(
                                    b.state,
                                    BlockState::ActiveAllocated | BlockState::ActivePendingFree
                                )
                            })
                            .and_then(|f| f.blocks.get(&b.address)),
                    ),
                ),
            ]));
        }
        let address = run.first().map_or(s.address, |b| b.address);
        let pick =
            |run_value: u64, whole: u64| int(if s.is_expandable { run_value } else { whole });
        out.push(dict(vec![
            ("device", int(snap.device as u64)?),
            ("address", int(address)?),
            ("total_size", pick(total, s.total_size)?),
            ("stream", int(s.stream.0)?),
            ("segment_type", Value::String(s.segment_type.to_string())),
            (
                "segment_pool_id",
                Value::Tuple(vec![int(s.pool.0)?, int(s.pool.1)?]),
            ),
            ("allocated_size", pick(allocated, s.allocated_size)?),
            ("active_size", pick(active, s.active_size)?),
            ("requested_size", pick(requested, s.requested_size)?),
            ("is_expandable", Value::Bool(s.is_expandable)),
            ("frames", Value::List(Vec::new())),
            ("blocks", Value::List(blocks)),
        ]));
    }
    Ok(())
}

fn trace(events: &[TraceEntry], frames: Option<&DumpFrames>) -> Result<Value, String> {
    let mut out = Vec::with_capacity(events.len());
    for (i, e) in events.iter().enumerate() {
        let mut items = vec![
            ("action", Value::String(e.action.to_string())),
            ("addr", int(e.addr)?),
            ("size", int(e.size)?),
            ("stream", int(e.stream)?),
            ("time_us", Value::I64(e.time_us)),
            ("frames", frames_value(frames.and_then(|f| f.trace.get(&i)))),
        ];
        if let Some(f) = e.device_free {
            items.push(("device_free", int(f)?));
        }
        out.push(dict(items));
    }
    Ok(Value::List(out))
}

fn settings(items: &[(&str, Setting)]) -> Value {
    dict(
        items
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Setting::Str(s) => Value::String(s.clone()),
                    Setting::Bool(b) => Value::Bool(*b),
                    Setting::Int(x) => Value::I64(*x),
                };
                (*k, v)
            })
            .collect(),
    )
}

/// The whole snapshot as a pickle value: every device's segments, one trace
/// list per ordinal up to the highest one in `devices` (at least one list),
/// and `settings` as `allocator_settings`.
pub fn snapshot_value(
    devices: &[DeviceDump<'_>],
    settings_items: &[(&str, Setting)],
) -> Result<Value, String> {
    let mut segs = Vec::new();
    let mut traces: Vec<Value> = Vec::new();
    for d in devices {
        segments(d.snapshot, d.frames, &mut segs)?;
        let ordinal = d.snapshot.device as usize;
        while traces.len() <= ordinal {
            traces.push(Value::List(Vec::new()));
        }
        if let Some(events) = d.trace {
            traces[ordinal] = trace(events, d.frames)?;
        }
    }
    if traces.is_empty() {
        traces.push(Value::List(Vec::new()));
    }
    let mut items = vec![
        ("segments", Value::List(segs)),
        ("device_traces", Value::List(traces)),
        ("allocator_settings", settings(settings_items)),
        ("external_annotations", Value::List(Vec::new())),
    ];
    // Sleep and wake: live blocks of paused tags hold no memory, so they are
    // in no segment; listed here (a key PyTorch's tools ignore), only when
    // there are any.
    let mut paused = Vec::new();
    for d in devices {
        for s in &d.snapshot.segments {
            for b in s.blocks.iter().filter(|b| b.state == BlockState::Paused) {
                paused.push(dict(vec![
                    ("device", int(d.snapshot.device as u64)?),
                    ("address", int(b.address)?),
                    ("size", int(b.size)?),
                    ("requested_size", int(b.requested_size)?),
                    ("stream", int(s.stream.0)?),
                ]));
            }
        }
    }
    if !paused.is_empty() {
        items.push(("vmmalloc_paused_blocks", Value::List(paused)));
    }
    Ok(dict(items))
}

/// The snapshot pickled (protocol 3, as `serde_pickle` writes it).
pub fn to_bytes(
    devices: &[DeviceDump<'_>],
    settings_items: &[(&str, Setting)],
) -> Result<Vec<u8>, String> {
    let v = snapshot_value(devices, settings_items)?;
    serde_pickle::value_to_vec(&v, SerOptions::new()).map_err(|e| format!("pickling failed: {e}"))
}

/// Writes the snapshot pickle to `path`.
pub fn write(
    path: &Path,
    devices: &[DeviceDump<'_>],
    settings_items: &[(&str, Setting)],
) -> Result<(), String> {
    let bytes = to_bytes(devices, settings_items)?;
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Stream;
    use serde_pickle::DeOptions;

    fn block(address: u64, size: u64, requested: u64, state: BlockState) -> BlockInfo {
        BlockInfo {
            address,
            size,
            requested_size: requested,
            state,
        }
    }

    /// An expandable segment with two mapped runs around a hole, and a plain one.
    fn snap(device: u32) -> Snapshot {
        let mib = 1u64 << 20;
        let exp = SegmentInfo {
            address: 0x1000_0000,
            total_size: 10 * mib,
            stream: Stream(0),
            segment_type: "large",
            allocated_size: 3 * mib,
            active_size: 3 * mib,
            requested_size: 3 * mib - 100,
            is_expandable: true,
            pool: (0, 0),
            blocks: vec![
                block(
                    0x1000_0000,
                    2 * mib,
                    2 * mib - 100,
                    BlockState::ActiveAllocated,
                ),
                block(0x1020_0000, 2 * mib, 0, BlockState::Inactive),
                block(0x1040_0000, 4 * mib, 0, BlockState::Unmapped),
                block(0x1080_0000, mib, mib, BlockState::ActiveAllocated),
                block(0x1090_0000, mib, 0, BlockState::Unmapped),
            ],
        };
        let plain = SegmentInfo {
            address: 0x2000_0000,
            total_size: 2 * mib,
            stream: Stream(7),
            segment_type: "small",
            allocated_size: 512,
            active_size: 1024,
            requested_size: 500,
            is_expandable: false,
            pool: (0, 0),
            blocks: vec![
                block(0x2000_0000, 512, 500, BlockState::ActiveAllocated),
                block(0x2000_0200, 512, 0, BlockState::ActivePendingFree),
                block(0x2000_0400, 2 * mib - 1024, 0, BlockState::Inactive),
            ],
        };
        Snapshot {
            device,
            segments: vec![exp, plain],
            mapped_bytes: 7 * mib,
            pooled_bytes: 0,
        }
    }

    fn get<'a>(v: &'a Value, k: &str) -> &'a Value {
        match v {
            Value::Dict(d) => &d[&key(k)],
            _ => panic!("not a dict: {v:?}"),
        }
    }

    fn list(v: &Value) -> &[Value] {
        match v {
            Value::List(l) => l,
            _ => panic!("not a list: {v:?}"),
        }
    }

    fn i(v: &Value) -> i64 {
        match v {
            Value::I64(x) => *x,
            _ => panic!("not an int: {v:?}"),
        }
    }

    #[test]
    fn expandable_segments_split_into_mapped_runs_that_blocks_cover() {
        let s = snap(0);
        let v = snapshot_value(
            &[DeviceDump {
                snapshot: &s,
                trace: None,
                frames: None,
            }],
            &[],
        )
        .unwrap();
        let segs = list(get(&v, "segments"));
        assert_eq!(segs.len(), 3, "two mapped runs + one plain segment");
        let mib = 1i64 << 20;
        let expect = [
            (0x1000_0000, 4 * mib, 2 * mib, 2 * mib - 100),
            (0x1080_0000, mib, mib, mib),
            (0x2000_0000, 2 * mib, 512, 500),
        ];
        for (seg, (addr, total, allocated, requested)) in segs.iter().zip(expect) {
            assert_eq!(i(get(seg, "address")), addr);
            assert_eq!(i(get(seg, "total_size")), total);
            assert_eq!(i(get(seg, "allocated_size")), allocated);
            assert_eq!(i(get(seg, "requested_size")), requested);
            let sum: i64 = list(get(seg, "blocks"))
                .iter()
                .map(|b| i(get(b, "size")))
                .sum();
            assert_eq!(sum, total, "blocks cover the segment");
            for b in list(get(seg, "blocks")) {
                assert_ne!(get(b, "state"), &Value::String("unmapped".into()));
            }
        }
        assert_eq!(i(get(&segs[2], "active_size")), 1024);
        assert_eq!(i(get(&segs[2], "stream")), 7);
    }

    #[test]
    fn traces_are_listed_per_ordinal_and_settings_keep_their_types() {
        let (a, b) = (snap(0), snap(2));
        let events = [
            TraceEntry {
                action: "alloc",
                addr: 0x1000_0000,
                size: 100,
                stream: 0,
                time_us: 5,
                device_free: None,
            },
            TraceEntry {
                action: "oom",
                addr: 1 << 20,
                size: 1 << 40,
                stream: 0,
                time_us: 6,
                device_free: Some(1 << 20),
            },
        ];
        let bytes = to_bytes(
            &[
                DeviceDump {
                    snapshot: &a,
                    trace: None,
                    frames: None,
                },
                DeviceDump {
                    snapshot: &b,
                    trace: Some(&events),
                    frames: None,
                },
            ],
            &[
                ("backend", "expandable".into()),
                ("expandable_segments", true.into()),
                ("capacity", Setting::Int(80)),
            ],
        )
        .unwrap();
        let v: Value = serde_pickle::value_from_slice(&bytes, DeOptions::new()).unwrap();
        let traces = list(get(&v, "device_traces"));
        assert_eq!(traces.len(), 3);
        assert!(list(&traces[0]).is_empty() && list(&traces[1]).is_empty());
        let t = list(&traces[2]);
        assert_eq!(t.len(), 2);
        assert_eq!(get(&t[0], "action"), &Value::String("alloc".into()));
        assert_eq!(i(get(&t[1], "device_free")), 1 << 20);
        let settings = get(&v, "allocator_settings");
        assert_eq!(
            get(settings, "backend"),
            &Value::String("expandable".into())
        );
        assert_eq!(get(settings, "expandable_segments"), &Value::Bool(true));
        assert_eq!(i(get(settings, "capacity")), 80);
        assert_eq!(list(get(&v, "segments")).len(), 6);
        assert!(list(get(&v, "external_annotations")).is_empty());
    }

    #[test]
    fn no_device_still_has_one_trace_list() {
        let v = snapshot_value(&[], &[]).unwrap();
        assert_eq!(list(get(&v, "device_traces")).len(), 1);
        assert!(list(get(&v, "segments")).is_empty());
    }

    #[test]
    fn addresses_beyond_int64_are_an_error() {
        let mut s = snap(0);
        s.segments[1].blocks[0].address = u64::MAX;
        let e = snapshot_value(
            &[DeviceDump {
                snapshot: &s,
                trace: None,
                frames: None,
            }],
            &[],
        )
        .unwrap_err();
        assert!(e.contains("does not fit"), "{e}");
    }
}
