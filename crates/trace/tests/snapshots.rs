//! Synthetic snapshots: the PyTorch 2.0 schema, the current schema recorded
//! mid-run, protocols 2–5, several devices, events without time stamps.
//! The pickles in tests/data are written by tests/data/make_snapshots.py;
//! protocol 2 and 3 ones are also built here with serde-pickle.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_pickle::{HashableValue, SerOptions, Value};
use vmmalloc_trace::pytorch::{parse_snapshot, read_snapshot};
use vmmalloc_trace::{load_path, text, Alloc, BlockState, EventKind, Op};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

const MIB: u64 = 1 << 20;
const S: u64 = 0x7000_0000_0000;

#[test]
fn pytorch_2_0_schema_two_devices_protocol_5() {
    let t = read_snapshot(&data("v20_two_devices_proto5.pickle")).unwrap();
    assert_eq!(t.name, "v20_two_devices_proto5");
    // Device 2 has neither events nor segments: left out.
    assert_eq!(
        t.devices.iter().map(|d| d.device()).collect::<Vec<_>>(),
        vec![0, 1]
    );

    let d0 = t.device(0).unwrap();
    assert!(d0.events().iter().all(|e| e.time_us.is_none()));
    // Block addresses follow one another from the segment's address; the
    // requested size comes from the last history entry.
    let seg = &d0.segments_final()[0];
    assert_eq!(seg.is_expandable, None);
    assert_eq!(seg.blocks[1].address, 0x10000000 + 2 * MIB);
    assert_eq!(seg.blocks[0].requested_size, 1_500_000);
    assert_eq!(seg.blocks[1].state, BlockState::Inactive);
    assert_eq!(
        d0.pre_trace(),
        &[
            Alloc {
                addr: 0x10000000,
                size: 1_500_000,
                stream: 0
            },
            Alloc {
                addr: 0x10600000,
                size: 700,
                stream: 0
            }
        ]
    );
    assert_eq!(d0.pre_trace_live_bytes(), 1_500_700);
    assert_eq!(d0.peak_live_bytes(), 5_500_700);
    assert_eq!(d0.final_live_bytes(), 1_500_010);
    let oom = d0
        .events()
        .iter()
        .find(|e| e.kind == EventKind::Oom)
        .unwrap();
    assert_eq!((oom.addr, oom.size), (123, 1 << 40));
    assert!(d0.warnings().is_empty(), "{:?}", d0.warnings());

    // Device 1: no segments at all; one free_requested never completes.
    let d1 = t.device(1).unwrap();
    assert!(d1.segments_final().is_empty());
    assert_eq!(d1.peak_live_bytes(), 500);
    assert_eq!(d1.streams(), vec![5]);
    assert_eq!(
        d1.events()[5].kind,
        EventKind::Free,
        "promoted free_requested"
    );
    assert_eq!(d1.warnings().len(), 2, "{:?}", d1.warnings());
    assert!(d1.warnings()[0].starts_with("1 `free_requested` events have no `free_completed`"));
    assert!(d1.warnings()[1]
        .starts_with("1 allocations live at the end of the trace have no active block"));
}

fn check_current_midrun(t: &vmmalloc_trace::Trace) {
    assert_eq!(t.devices.len(), 1);
    let d = &t.devices[0];
    assert_eq!(d.events().len(), 9);
    assert_eq!(d.allocs(), 2);
    assert_eq!(
        d.pre_trace(),
        &[
            Alloc {
                addr: S,
                size: 2_000_000,
                stream: 0
            },
            Alloc {
                addr: S + 8 * MIB,
                size: 3_000_000,
                stream: 0
            }
        ]
    );
    assert_eq!(d.pre_trace_live_bytes(), 5_000_000);
    assert_eq!(d.peak_live_bytes(), 7_000_000);
    // The block pending free at the end stays live.
    assert_eq!(d.final_live_bytes(), 6_000_000);
    assert_eq!(d.events()[8].kind, EventKind::FreeRequested);
    assert_eq!(d.warnings().len(), 1, "{:?}", d.warnings());
    assert!(d.warnings()[0]
        .starts_with("1 blocks active in the final segments were freed by the trace"));
    assert_eq!(d.segments_final()[0].is_expandable, Some(true));
    assert_eq!(d.allocator_settings()["expandable_segments"], "True");
    assert_eq!(
        d.allocator_settings()["PYTORCH_CUDA_ALLOC_CONF"],
        "expandable_segments:True"
    );
    assert_eq!(d.allocator_settings()["max_split_size"], "-1");
    assert_eq!(d.events()[0].time_us, Some(1_700_000_000_000_000));
    assert_eq!(
        &d.replay_ops()[..4],
        &[
            Op::Alloc {
                id: 0,
                size: 2_000_000,
                stream: 0
            },
            Op::Alloc {
                id: 1,
                size: 3_000_000,
                stream: 0
            },
            Op::Free { id: 1 },
            Op::Alloc {
                id: 2,
                size: 4_000_000,
                stream: 0
            },
        ]
    );
}

#[test]
fn current_schema_mid_run_protocols_4_and_2() {
    for f in [
        "current_midrun_proto4.pickle",
        "current_midrun_proto2.pickle",
    ] {
        let t = load_path(&data(f)).unwrap();
        check_current_midrun(&t);
    }
}

#[test]
fn current_schema_through_text() {
    let t = load_path(&data("current_midrun_proto4.pickle")).unwrap();
    let back = text::parse_text(&text::to_text(&t), "x").unwrap();
    assert_eq!(back.devices[0].replay_ops(), t.devices[0].replay_ops());
    assert_eq!(back.devices[0].peak_live_bytes(), 7_000_000);
    assert_eq!(back.devices[0].warnings(), t.devices[0].warnings());
}

// ---- snapshots built here with serde-pickle (protocols 2 and 3) ----

fn s(x: &str) -> Value {
    Value::String(x.to_string())
}

fn dict(items: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        items
            .into_iter()
            .map(|(k, v)| (HashableValue::String(k.to_string()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn event(action: &str, addr: i64, size: i64) -> Value {
    dict(vec![
        ("action", s(action)),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(0)),
    ])
}

fn snapshot(events: Vec<Value>) -> Value {
    dict(vec![
        ("segments", Value::List(vec![])),
        ("device_traces", Value::List(vec![Value::List(events)])),
    ])
}

#[test]
fn protocol_2_and_3_built_with_serde_pickle() {
    let v = snapshot(vec![
        event("alloc", 0x100, 1000),
        event("alloc", 0x200, 24),
        event("free_requested", 0x100, 1000),
        event("free_completed", 0x100, 1000),
        event("free_completed", 0x300, 50),
    ]);
    for opts in [SerOptions::new().proto_v2(), SerOptions::new()] {
        let bytes = serde_pickle::value_to_vec(&v, opts).unwrap();
        assert_eq!(bytes[0], 0x80);
        let t = parse_snapshot(&bytes, "built").unwrap();
        let d = &t.devices[0];
        assert_eq!(
            d.pre_trace(),
            &[Alloc {
                addr: 0x300,
                size: 50,
                stream: 0
            }]
        );
        assert_eq!(d.peak_live_bytes(), 1074);
        assert_eq!(d.final_live_bytes(), 24);
        // Live at the end with no final segments: one counted warning.
        assert_eq!(d.warnings().len(), 1);
    }
}

#[test]
fn stream_values_are_opaque() {
    let mut e = event("alloc", 0x100, 8);
    if let Value::Dict(m) = &mut e {
        m.insert(HashableValue::String("stream".into()), Value::I64(-1));
    }
    let bytes = serde_pickle::value_to_vec(&snapshot(vec![e]), SerOptions::new()).unwrap();
    let t = parse_snapshot(&bytes, "x").unwrap();
    assert_eq!(t.devices[0].streams(), vec![u64::MAX]);
}

/// `_dump_snapshot` without `_record_memory_history`: segments, no events.
/// Not a trace: a warning says so and shows the two lines that record one.
#[test]
fn a_snapshot_without_history_warns_with_the_fix() {
    let block = dict(vec![
        ("address", Value::I64(S as i64)),
        ("size", Value::I64(2 * MIB as i64)),
        ("requested_size", Value::I64(MIB as i64)),
        ("state", s("active_allocated")),
    ]);
    let seg = dict(vec![
        ("device", Value::I64(0)),
        ("address", Value::I64(S as i64)),
        ("total_size", Value::I64(2 * MIB as i64)),
        ("stream", Value::I64(0)),
        ("blocks", Value::List(vec![block])),
    ]);
    let v = dict(vec![
        ("segments", Value::List(vec![seg])),
        ("device_traces", Value::List(vec![Value::List(vec![])])),
    ]);
    let bytes = serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap();
    let t = parse_snapshot(&bytes, "nohistory").unwrap();
    let d = &t.devices[0];
    assert!(d.events().is_empty());
    let w = d.warnings().join("\n");
    assert!(w.contains("no events were recorded"), "{w}");
    assert!(w.contains("_record_memory_history("), "{w}");
    assert!(w.contains("_dump_snapshot("), "{w}");
    // A snapshot with events has no such warning.
    let with = parse_snapshot(
        &serde_pickle::value_to_vec(
            &snapshot(vec![event("alloc", 0x100, 1000)]),
            SerOptions::new(),
        )
        .unwrap(),
        "with",
    )
    .unwrap();
    assert!(!with.devices[0].warnings().join("").contains("no events"));
}
