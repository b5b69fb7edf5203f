//! Bad input: truncated, corrupt or foreign files, unknown actions, frees of
//! unknown addresses, negative or absurd sizes. Each is an error naming the
//! file, the event and the problem; nothing panics.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde_pickle::{HashableValue, SerOptions, Value};
use vmmalloc_trace::pytorch::parse_snapshot;
use vmmalloc_trace::{load_path, ErrorKind, Input, TraceError};

fn fixture_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        std::fs::read(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/cs336_lm_step.pickle"),
        )
        .unwrap()
    })
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("vmmalloc-trace-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

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

fn event(action: &str, addr: i64, size: Value) -> Value {
    dict(vec![
        ("action", s(action)),
        ("addr", Value::I64(addr)),
        ("size", size),
        ("stream", Value::I64(0)),
    ])
}

fn pickle_of(events: Vec<Value>) -> Vec<u8> {
    let v = dict(vec![
        ("segments", Value::List(vec![])),
        ("device_traces", Value::List(vec![Value::List(events)])),
    ]);
    serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()
}

fn load_err(dir: &TempDir, name: &str, bytes: &[u8]) -> (PathBuf, TraceError) {
    let p = dir.file(name, bytes);
    let e = load_path(&p).unwrap_err();
    (p, e)
}

fn assert_names(e: &TraceError, path: &Path, device: Option<u32>, index: Option<usize>, msg: &str) {
    let text = e.to_string();
    assert_eq!(e.path.as_deref(), Some(path), "{text}");
    assert!(text.starts_with(&path.display().to_string()), "{text}");
    assert_eq!((e.device, e.index), (device, index), "{text}");
    assert!(text.contains(msg), "expected `{msg}` in: {text}");
}

#[test]
fn truncated_fixture() {
    let dir = TempDir::new("trunc");
    let bytes = fixture_bytes();
    for (i, len) in [1usize, 2, 11, 1000, bytes.len() / 2, bytes.len() - 1]
        .into_iter()
        .enumerate()
    {
        let (p, e) = load_err(&dir, &format!("t{i}.pickle"), &bytes[..len]);
        assert_names(&e, &p, None, None, "pickle");
        assert!(matches!(*e.kind, ErrorKind::Pickle(_)), "{e}");
    }
}

#[test]
fn empty_and_foreign_files() {
    let dir = TempDir::new("foreign");
    let (p, e) = load_err(&dir, "empty.pickle", b"");
    assert_names(&e, &p, None, None, "empty file");
    assert!(matches!(*e.kind, ErrorKind::Empty), "{e}");
    let (p, e) = load_err(&dir, "blank.trace", b"\n \n");
    assert_names(&e, &p, None, None, "empty file");
    // A missing file says why once: the I/O error is the message, not a source too.
    let missing = dir.0.join("missing.pickle");
    let e = load_path(&missing).unwrap_err();
    assert!(std::error::Error::source(&e).is_none(), "{e}");
    let (p, e) = load_err(&dir, "notes.txt", b"hello world\n");
    assert_names(&e, &p, None, None, "unknown format");
    let (p, e) = load_err(&dir, "png.bin", b"\x89PNG\r\n\x1a\n");
    assert_names(&e, &p, None, None, "unknown format");

    let list =
        serde_pickle::value_to_vec(&Value::List(vec![Value::I64(1)]), SerOptions::new()).unwrap();
    let (p, e) = load_err(&dir, "list.pickle", &list);
    assert_names(
        &e,
        &p,
        None,
        None,
        "not a PyTorch memory snapshot: the top level is a list",
    );
    let other = serde_pickle::value_to_vec(
        &dict(vec![("weights", Value::List(vec![]))]),
        SerOptions::new(),
    )
    .unwrap();
    let (p, e) = load_err(&dir, "dict.pickle", &other);
    assert_names(
        &e,
        &p,
        None,
        None,
        "without `segments` or `device_traces` (keys: weights)",
    );
    let obj = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/foreign_object_proto4.pickle"),
    )
    .unwrap();
    let (p, e) = load_err(&dir, "obj.pickle", &obj);
    assert_eq!(e.path.as_deref(), Some(p.as_path()));
    assert!(
        matches!(*e.kind, ErrorKind::Pickle(_) | ErrorKind::Foreign(_)),
        "{e}"
    );
    let (p, e) = load_err(&dir, "proto9.pickle", b"\x80\x09}.");
    assert_names(&e, &p, None, None, "unsupported pickle protocol 9");
    // A trailing-garbage pickle.
    let mut trailing = pickle_of(vec![]);
    trailing.extend_from_slice(b"garbage");
    let (p, e) = load_err(&dir, "trailing.pickle", &trailing);
    assert_names(&e, &p, None, None, "pickle");
    // A missing file.
    let missing = dir.0.join("missing.pickle");
    let e = load_path(&missing).unwrap_err();
    assert_names(&e, &missing, None, None, "cannot read");
}

#[test]
fn bad_events_name_the_index() {
    let dir = TempDir::new("events");
    let ok = |a: i64| event("alloc", a, Value::I64(16));
    let cases: Vec<(&str, Vec<Value>, usize, &str)> = vec![
        (
            "action.pickle",
            vec![ok(1), event("frobnicate", 1, Value::I64(1))],
            1,
            "unknown action `frobnicate`",
        ),
        (
            "double_free.pickle",
            vec![
                ok(1),
                event("free_completed", 1, Value::I64(16)),
                event("free_completed", 1, Value::I64(16)),
            ],
            2,
            "free of unknown address 0x1",
        ),
        (
            "double_alloc.pickle",
            vec![ok(1), ok(2), ok(1)],
            2,
            "alloc at address 0x1, which is still live",
        ),
        (
            "negative.pickle",
            vec![ok(1), event("alloc", 2, Value::I64(-5))],
            1,
            "negative size: -5",
        ),
        (
            "absurd.pickle",
            vec![event("alloc", 2, Value::I64(1 << 51))],
            0,
            "absurd size: 2251799813685248 bytes",
        ),
        (
            "zero.pickle",
            vec![ok(1), event("alloc", 2, Value::I64(0))],
            1,
            "allocation of size 0",
        ),
        (
            "string_size.pickle",
            vec![ok(1), ok(2), event("alloc", 3, s("big"))],
            2,
            "`size` is a string",
        ),
        (
            "negative_addr.pickle",
            vec![event("alloc", -3, Value::I64(8))],
            0,
            "negative address: -3",
        ),
        (
            "not_dict.pickle",
            vec![ok(1), Value::I64(5)],
            1,
            "event is an integer, expected a dict",
        ),
        (
            "no_action.pickle",
            vec![dict(vec![("addr", Value::I64(1))])],
            0,
            "event without `action`",
        ),
        (
            "no_size.pickle",
            vec![dict(vec![("action", s("alloc")), ("addr", Value::I64(1))])],
            0,
            "`alloc` event without `size`",
        ),
        (
            "bigint.pickle",
            vec![event(
                "alloc",
                1,
                Value::Int("123456789012345678901234567890".parse().unwrap()),
            )],
            0,
            "absurd size",
        ),
    ];
    for (name, events, index, msg) in cases {
        let (p, e) = load_err(&dir, name, &pickle_of(events));
        assert_names(&e, &p, Some(0), Some(index), msg);
    }
}

#[test]
fn bad_layout_is_named() {
    let bad_segments = dict(vec![
        ("segments", s("x")),
        ("device_traces", Value::List(vec![])),
    ]);
    let e = parse_snapshot(
        &serde_pickle::value_to_vec(&bad_segments, SerOptions::new()).unwrap(),
        "x",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("`segments` is a string, expected a list"),
        "{e}"
    );
    let seg = dict(vec![
        ("address", Value::I64(0)),
        ("total_size", Value::I64(1 << 21)),
        (
            "blocks",
            Value::List(vec![dict(vec![
                ("size", Value::I64(1 << 21)),
                ("state", s("haunted")),
            ])]),
        ),
    ]);
    let v = dict(vec![
        ("segments", Value::List(vec![seg])),
        ("device_traces", Value::List(vec![])),
    ]);
    let e = parse_snapshot(
        &serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap(),
        "x",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("segment 0: block 0: unknown state `haunted`"),
        "{e}"
    );
    let far = dict(vec![
        ("device", Value::I64(1 << 40)),
        ("address", Value::I64(0)),
        ("total_size", Value::I64(1 << 21)),
    ]);
    let v = dict(vec![
        ("segments", Value::List(vec![far])),
        ("device_traces", Value::List(vec![])),
    ]);
    let e = parse_snapshot(
        &serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap(),
        "x",
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("segment 0: device 1099511627776 out of range"),
        "{e}"
    );
    let trace_not_list = dict(vec![("device_traces", Value::List(vec![Value::I64(3)]))]);
    let e = parse_snapshot(
        &serde_pickle::value_to_vec(&trace_not_list, SerOptions::new()).unwrap(),
        "x",
    )
    .unwrap_err();
    assert_eq!(e.device, Some(0));
    assert!(
        e.to_string().contains("a device trace is an integer"),
        "{e}"
    );
}

#[test]
fn inputs_that_are_neither_files_nor_workloads() {
    let e = Input::parse("trian-varlen").unwrap_err().to_string();
    assert!(
        e.contains("neither a file nor a workload") && e.contains("train-varlen"),
        "{e}"
    );
    assert_eq!(
        Input::parse("serve-kv:seed=2").unwrap(),
        Input::Workload("serve-kv:seed=2".into())
    );
    let missing = Input::parse("nowhere/run.pickle").unwrap();
    let e = missing.load().unwrap_err().to_string();
    assert!(e.starts_with("nowhere/run.pickle: cannot read"), "{e}");
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cs336_lm_step.pickle");
    let input: Input = fixture.to_str().unwrap().parse().unwrap();
    assert!(matches!(input, Input::Path(_)));
}

/// Parses `bytes`, turning any panic into a test failure with a clear message.
fn parse_without_panic(bytes: &[u8]) -> Result<(), String> {
    match catch_unwind(AssertUnwindSafe(|| parse_snapshot(bytes, "mutant"))) {
        Ok(_) => Ok(()),
        Err(_) => Err("the reader panicked".into()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn truncations_never_panic(frac in 0.0f64..1.0) {
        let bytes = fixture_bytes();
        let len = (bytes.len() as f64 * frac) as usize;
        let r = catch_unwind(AssertUnwindSafe(|| parse_snapshot(&bytes[..len], "cut")));
        prop_assert!(r.is_ok(), "panicked at length {}", len);
        prop_assert!(r.unwrap().is_err(), "a truncated pickle parsed at length {}", len);
    }

    #[test]
    fn byte_flips_never_panic(flips in proptest::collection::vec((0.0f64..1.0, 1u8..=255), 1..8)) {
        let mut bytes = fixture_bytes().to_vec();
        for (pos, mask) in &flips {
            let i = ((bytes.len() as f64) * pos) as usize;
            bytes[i] ^= mask;
        }
        prop_assert!(parse_without_panic(&bytes).is_ok());
    }
}
