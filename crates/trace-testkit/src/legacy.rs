//! The reader as it was before the pull parser (issue 34): serde-pickle
//! decodes the whole file into its value tree, cloning every memoized value
//! at each reference, and the tree is then converted. Not for use: it is kept
//! as the baseline of `cargo bench -p vmmalloc-trace --bench snapshot_read`
//! (old against new, side by side) and as the oracle the streaming reader's
//! tests compare with (`tests/reader_equivalence.rs`).
//!
//! What it reads and how (sizes, frees, the allocations live before
//! recording) is what `vmmalloc_trace::pytorch` documents: both readers
//! share the reconstruction ([`vmmalloc_trace::reconstruct::build_device`]),
//! so on any snapshot both read they build equal traces.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use serde_pickle::{DeOptions, HashableValue, Value};

use vmmalloc_trace::model::{
    Block, BlockState, DeviceTrace, Event, EventKind, Frame, Segment, Stack, Trace, MAX_SIZE,
};
use vmmalloc_trace::pytorch::{ACTIONS, MAX_DEVICES};
use vmmalloc_trace::reconstruct::{build_device, RawDevice};
use vmmalloc_trace::{ErrorKind, Result, TraceError};

/// Parses snapshot bytes into a trace named `name`.
pub fn parse_snapshot(bytes: &[u8], name: &str) -> Result<Trace> {
    let value = decode(bytes)?;
    let top = match &value {
        Value::Dict(d) => d,
        other => {
            return Err(ErrorKind::Foreign(format!(
                "the top level is {}, expected a dict with `segments` and `device_traces`",
                type_name(other)
            ))
            .into())
        }
    };
    let segments_v = field(top, "segments");
    let traces_v = field(top, "device_traces");
    if segments_v.is_none() && traces_v.is_none() {
        let keys: Vec<String> = top
            .keys()
            .take(8)
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
    let settings = match field(top, "allocator_settings") {
        Some(Value::Dict(d)) => d.iter().map(|(k, v)| (render_key(k), render(v))).collect(),
        _ => BTreeMap::new(),
    };

    let mut segments = Vec::new();
    if let Some(v) = segments_v {
        for (si, sv) in as_list(v, "`segments`")?.iter().enumerate() {
            segments.push(
                parse_segment(sv).map_err(|m| {
                    TraceError::new(ErrorKind::Schema(format!("segment {si}: {m}")))
                })?,
            );
        }
    }
    let mut per_device: Vec<Vec<Event>> = Vec::new();
    // Per device: stacks of alloc events by event index, and how many
    // events had a `frames` value that is not PyTorch's list of dicts.
    let mut per_device_frames: Vec<(BTreeMap<usize, Stack>, usize)> = Vec::new();
    if let Some(v) = traces_v {
        for (d, dv) in as_list(v, "`device_traces`")?.iter().enumerate() {
            let device = u32::try_from(d)
                .ok()
                .filter(|&d| d < MAX_DEVICES)
                .ok_or_else(|| {
                    ErrorKind::Schema(format!("more than {MAX_DEVICES} device traces"))
                })?;
            let list = as_list(dv, "a device trace").map_err(|e| e.on_device(device))?;
            let mut events = Vec::with_capacity(list.len());
            let mut stacks = BTreeMap::new();
            let mut bad_frames = 0usize;
            for (i, ev) in list.iter().enumerate() {
                let e = parse_event(ev)
                    .map_err(|k| TraceError::new(k).on_device(device).at_event(i))?;
                if e.kind == EventKind::Alloc {
                    match parse_frames(ev) {
                        Ok(Some(st)) => {
                            stacks.insert(i, st);
                        }
                        Ok(None) => {}
                        Err(()) => bad_frames += 1,
                    }
                }
                events.push(e);
            }
            per_device.push(events);
            per_device_frames.push((stacks, bad_frames));
        }
    }

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
    for (d, events) in per_device.into_iter().enumerate() {
        raw[d].events = events;
    }
    for s in segments {
        raw[s.device as usize].segments.push(s);
    }
    let mut devices = Vec::new();
    for r in raw {
        if r.events.is_empty() && r.segments.is_empty() {
            continue;
        }
        let device = r.device;
        let dt = build_device(r, &settings).map_err(|e| e.on_device(device))?;
        match per_device_frames.get_mut(device as usize) {
            Some((stacks, bad)) if !stacks.is_empty() || *bad > 0 => {
                // Rebuilt with the stacks (the events are unchanged, so the
                // checks pass again).
                let mut parts = dt.into_parts();
                parts.frames = std::mem::take(stacks);
                if *bad > 0 {
                    parts.warnings.push(format!(
                        "{bad} allocation events have `frames` that are not a list of {{filename, line, name}} dicts; their stacks are dropped"
                    ));
                }
                devices.push(DeviceTrace::new(parts).map_err(|e| e.on_device(device))?);
            }
            _ => devices.push(dt),
        }
    }
    Ok(Trace {
        name: name.to_string(),
        devices,
    })
}

/// Decodes a pickle into a value, turning malformed input and reader panics into errors.
fn decode(bytes: &[u8]) -> Result<Value> {
    if bytes.is_empty() {
        return Err(ErrorKind::Pickle("empty file".into()).into());
    }
    if bytes[0] == 0x80 {
        match bytes.get(1) {
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
    let opts = DeOptions::new()
        .decode_strings()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    match catch_unwind(AssertUnwindSafe(|| {
        serde_pickle::value_from_slice(bytes, opts)
    })) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ErrorKind::Pickle(e.to_string()).into()),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(ErrorKind::ReaderPanic(msg).into())
        }
    }
}

/// The `frames` of an event: `Ok(None)` where absent or empty, `Err` where
/// it is not a list of `{filename, line, name}` dicts.
fn parse_frames(v: &Value) -> std::result::Result<Option<Stack>, ()> {
    let Some(d) = as_dict(v) else {
        return Ok(None);
    };
    let list = match field(d, "frames") {
        None => return Ok(None),
        Some(Value::List(l)) | Some(Value::Tuple(l)) => l,
        Some(_) => return Err(()),
    };
    if list.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(list.len());
    for f in list {
        let fd = as_dict(f).ok_or(())?;
        let text = |k: &str| match field(fd, k) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Bytes(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
            _ => Err(()),
        };
        let line = match int(fd, "line") {
            Ok(Some(n)) => i64::try_from(n).map_err(|_| ())?,
            _ => return Err(()),
        };
        out.push(Frame {
            filename: text("filename")?,
            line,
            name: text("name")?,
        });
    }
    Ok(Some(out.into()))
}

fn parse_event(v: &Value) -> std::result::Result<Event, ErrorKind> {
    let d = as_dict(v)
        .ok_or_else(|| ErrorKind::Schema(format!("event is {}, expected a dict", type_name(v))))?;
    let action = match field(d, "action") {
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(ErrorKind::Schema(format!(
                "`action` is {}",
                type_name(other)
            )))
        }
        None => return Err(ErrorKind::Schema("event without `action`".into())),
    };
    let kind = match action {
        "alloc" => EventKind::Alloc,
        "free_completed" => EventKind::Free,
        "free_requested" => EventKind::FreeRequested,
        "segment_alloc" => EventKind::SegmentAlloc,
        "segment_free" => EventKind::SegmentFree,
        "segment_map" => EventKind::SegmentMap,
        "segment_unmap" => EventKind::SegmentUnmap,
        "snapshot" => EventKind::Snapshot,
        "oom" => EventKind::Oom,
        "user_defined" => EventKind::UserDefined,
        other => {
            return Err(ErrorKind::UnknownAction {
                action: other.to_string(),
                known: ACTIONS.join(", "),
            })
        }
    };
    let tracked = matches!(
        kind,
        EventKind::Alloc | EventKind::Free | EventKind::FreeRequested
    );
    let addr_key = if kind == EventKind::Oom && field(d, "addr").is_none() {
        "device_free"
    } else {
        "addr"
    };
    let addr = match int(d, addr_key)? {
        Some(a) => to_u64(a, addr_key)?,
        None if tracked => {
            return Err(ErrorKind::Schema(format!(
                "`{}` event without `addr`",
                action
            )))
        }
        None => 0,
    };
    let size = match int(d, "size")? {
        Some(s) => {
            if matches!(
                kind,
                EventKind::Oom | EventKind::UserDefined | EventKind::Snapshot
            ) {
                to_u64(s, "size")?
            } else {
                to_size(s, "size")?
            }
        }
        None if tracked => {
            return Err(ErrorKind::Schema(format!(
                "`{}` event without `size`",
                action
            )))
        }
        None => 0,
    };
    let stream = match int(d, "stream")? {
        Some(s) => to_stream(s)?,
        None => 0,
    };
    let time_us = match int(d, "time_us")? {
        Some(t) => Some(
            i64::try_from(t)
                .map_err(|_| ErrorKind::Schema(format!("`time_us` {t} out of range")))?,
        ),
        None => None,
    };
    Ok(Event {
        kind,
        addr,
        size,
        stream,
        time_us,
    })
}

fn parse_segment(v: &Value) -> std::result::Result<Segment, String> {
    let d = as_dict(v).ok_or_else(|| format!("is {}, expected a dict", type_name(v)))?;
    let e = |k: ErrorKind| k.to_string();
    let device = match int(d, "device").map_err(e)? {
        Some(x) if (0..MAX_DEVICES as i128).contains(&x) => x as u32,
        Some(x) => return Err(format!("device {x} out of range (0..{MAX_DEVICES})")),
        None => 0,
    };
    let address = to_u64(
        int(d, "address").map_err(e)?.ok_or("no `address`")?,
        "address",
    )
    .map_err(e)?;
    let total_size = to_size(
        int(d, "total_size").map_err(e)?.ok_or("no `total_size`")?,
        "total_size",
    )
    .map_err(e)?;
    let stream = int(d, "stream")
        .map_err(e)?
        .map(to_stream)
        .transpose()
        .map_err(e)?
        .unwrap_or(0);
    let segment_type = match field(d, "segment_type") {
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    };
    let is_expandable = match field(d, "is_expandable") {
        Some(Value::Bool(b)) => Some(*b),
        _ => None,
    };
    let mut blocks = Vec::new();
    let mut next_addr = address;
    if let Some(bv) = field(d, "blocks") {
        let list = match bv {
            Value::List(l) | Value::Tuple(l) => l,
            other => return Err(format!("`blocks` is {}", type_name(other))),
        };
        for (bi, b) in list.iter().enumerate() {
            let block = parse_block(b, next_addr).map_err(|m| format!("block {bi}: {m}"))?;
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

fn parse_block(v: &Value, default_addr: u64) -> std::result::Result<Block, String> {
    let d = as_dict(v).ok_or_else(|| format!("is {}, expected a dict", type_name(v)))?;
    let e = |k: ErrorKind| k.to_string();
    let size = to_size(int(d, "size").map_err(e)?.ok_or("no `size`")?, "size").map_err(e)?;
    let address = match int(d, "address").map_err(e)? {
        Some(a) => to_u64(a, "address").map_err(e)?,
        None => default_addr,
    };
    let state = match field(d, "state") {
        Some(Value::String(s)) => match s.as_str() {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            other => return Err(format!("unknown state `{other}`")),
        },
        Some(other) => return Err(format!("`state` is {}", type_name(other))),
        None => return Err("no `state`".into()),
    };
    // Requested size: the block's own field (PyTorch >= 2.1), else the last
    // history entry at this address (PyTorch 2.0), else the block size.
    let mut requested = int(d, "requested_size")
        .map_err(e)?
        .map(|r| to_size(r, "requested_size"))
        .transpose()
        .map_err(e)?;
    if requested.is_none() {
        if let Some(Value::List(h)) = field(d, "history") {
            for entry in h.iter().rev() {
                let Some(hd) = as_dict(entry) else { continue };
                let at = int(hd, "addr").map_err(e)?;
                if at.is_some() && at != Some(address as i128) {
                    continue;
                }
                if let Some(r) = int(hd, "real_size").map_err(e)? {
                    requested = Some(to_size(r, "real_size").map_err(e)?);
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

type Dict = BTreeMap<HashableValue, Value>;

fn as_dict(v: &Value) -> Option<&Dict> {
    match v {
        Value::Dict(d) => Some(d),
        _ => None,
    }
}

fn as_list<'a>(v: &'a Value, what: &str) -> Result<&'a [Value]> {
    match v {
        Value::List(l) | Value::Tuple(l) => Ok(l),
        other => Err(
            ErrorKind::Schema(format!("{what} is {}, expected a list", type_name(other))).into(),
        ),
    }
}

fn field<'a>(d: &'a Dict, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_string()))
}

/// An integer field; `None` when absent or Python `None`.
fn int(d: &Dict, key: &str) -> std::result::Result<Option<i128>, ErrorKind> {
    match field(d, key) {
        None | Some(Value::None) => Ok(None),
        Some(Value::I64(i)) => Ok(Some(*i as i128)),
        Some(Value::Int(b)) => {
            b.to_string()
                .parse::<i128>()
                .map(Some)
                .map_err(|_| ErrorKind::Absurd {
                    field: field_name(key),
                    value: u128::MAX,
                })
        }
        Some(Value::Bool(b)) => Ok(Some(*b as i128)),
        Some(other) => Err(ErrorKind::Schema(format!(
            "`{key}` is {}, expected an integer",
            type_name(other)
        ))),
    }
}

fn field_name(key: &str) -> &'static str {
    match key {
        "addr" | "address" | "device_free" => "address",
        "stream" => "stream",
        "time_us" => "time",
        _ => "size",
    }
}

fn to_u64(v: i128, key: &str) -> std::result::Result<u64, ErrorKind> {
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

fn to_size(v: i128, key: &str) -> std::result::Result<u64, ErrorKind> {
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

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::I64(_) | Value::Int(_) => "an integer",
        Value::F64(_) => "a float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "a string",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Dict(_) => "a dict",
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

/// Reads the snapshot at `path` as the old `load_path` did: the whole file
/// into memory, then [`parse_snapshot`].
pub fn read_snapshot(path: &Path) -> Result<Trace> {
    let bytes = std::fs::read(path).map_err(|e| TraceError::from(e).in_file(path))?;
    parse_snapshot(&bytes, &file_stem(path)).map_err(|e| e.in_file(path))
}

/// The file's name without its extension (the trace's name), as the library's
/// reader names it.
fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}
