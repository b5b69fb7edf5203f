//! The snapshot reader's limits (docs/trace-format.md, "Limits"): whatever the
//! pickle, the reader holds at most its memory bound and takes at most its
//! work bound (both by its own counters, so asserted exactly), never panics,
//! and stops with one error naming the limit hit. Nothing named in a pickle
//! is ever called.
//!
//! The crafted files of issue 41 are written by the generators below (no
//! checked-in binaries). `VMMALLOC_CRAFTED_DIR=DIR cargo test -p
//! vmmalloc-trace --test reader_limits crafted` keeps them in `DIR`, for
//! `/usr/bin/time -v vmmalloc summary DIR/FILE`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use proptest::prelude::*;
use vmmalloc_trace::pytorch::{read_snapshot_limited, ReadLimits, ReadStats};
use vmmalloc_trace::{ErrorKind, Result, Trace};
use vmmalloc_trace_testkit::synth::{write_snapshot, SynthConfig};

/// A pickle written opcode by opcode (protocol 2 unless said otherwise).
struct P(Vec<u8>);

impl P {
    fn new() -> P {
        P(vec![0x80, 2])
    }
    fn op(&mut self, b: &[u8]) -> &mut P {
        self.0.extend_from_slice(b);
        self
    }
    /// BINUNICODE.
    fn str(&mut self, s: &str) -> &mut P {
        self.0.push(b'X');
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// BININT.
    fn int(&mut self, i: i32) -> &mut P {
        self.0.push(b'J');
        self.0.extend_from_slice(&i.to_le_bytes());
        self
    }
    /// BINPUT or LONG_BINPUT.
    fn put(&mut self, id: u32) -> &mut P {
        match u8::try_from(id) {
            Ok(i) => self.op(&[b'q', i]),
            Err(_) => {
                self.0.push(b'r');
                self.op(&id.to_le_bytes())
            }
        }
    }
    /// LONG_BINPUT, whatever the id.
    fn long_put(&mut self, id: u32) -> &mut P {
        self.0.push(b'r');
        self.op(&id.to_le_bytes())
    }
    /// BINGET or LONG_BINGET.
    fn get(&mut self, id: u32) -> &mut P {
        match u8::try_from(id) {
            Ok(i) => self.op(&[b'h', i]),
            Err(_) => {
                self.0.push(b'j');
                self.op(&id.to_le_bytes())
            }
        }
    }
    fn stop(&mut self) -> Vec<u8> {
        self.0.push(b'.');
        std::mem::take(&mut self.0)
    }
}

/// LONG_BINPUT with ids stepping by 65,535 (a dense memo would be indexed up
/// to 2^32): `n` puts, about 5 bytes each.
fn sparse_memo(n: u32) -> Vec<u8> {
    let mut p = P::new();
    p.op(b"N");
    for k in 0..n {
        p.long_put(k.wrapping_mul(65_535));
    }
    p.stop()
}

/// A "billion laughs" under `allocator_settings`: list `i + 1` holds list `i`
/// `width` times, through the memo; `levels` levels expand to `width^levels`.
fn laughs(levels: u32, width: u32) -> Vec<u8> {
    let mut p = P::new();
    p.op(b"}(");
    p.str("segments").op(b"]");
    p.str("device_traces").op(b"]");
    p.str("allocator_settings").op(b"}");
    p.str("k");
    p.op(b"]").put(0).str("lol").op(b"a0");
    for i in 0..levels {
        p.op(b"(");
        for _ in 0..width {
            p.get(i);
        }
        p.op(b"l").put(i + 1);
        if i + 1 < levels {
            p.op(b"0");
        }
    }
    p.op(b"su");
    p.stop()
}

/// One tuple of `2^depth` leaves (shared halves), used in `keys` dict keys
/// `(T, j)`; the dict sits under `x` in a snapshot, or is the top-level dict
/// itself (its keys are then kept for a message).
fn shared_tuple_keys(depth: u32, keys: u32, top_level: bool) -> Vec<u8> {
    let mut p = P::new();
    p.op(b"}(");
    p.str("leaf").put(0);
    for i in 0..depth {
        p.get(i).get(i).op(b"\x86").put(i + 1);
    }
    p.op(b"0");
    if !top_level {
        p.str("segments").op(b"]");
        p.str("device_traces").op(b"]");
        p.str("x").op(b"}(");
    }
    for j in 0..keys {
        p.get(depth).int(j as i32).op(b"\x86N");
    }
    if !top_level {
        p.op(b"u");
    }
    p.op(b"u");
    p.stop()
}

/// Lists nested `n` deep: `[[[...]]]`, 2 bytes a level.
fn deep_lists(n: usize) -> Vec<u8> {
    let mut p = P::new();
    p.op(&vec![b']'; n]);
    p.op(&vec![b'a'; n - 1]);
    p.stop()
}

/// Dicts nested `n` deep: `{0: {0: ...}}`, 4 bytes a level.
fn deep_dicts(n: usize) -> Vec<u8> {
    let mut p = P::new();
    for _ in 0..n {
        p.op(b"}K\x00");
    }
    p.op(b"}");
    p.op(&vec![b's'; n]);
    p.stop()
}

/// Events whose stacks each hold one distinct frame (its own line) with one
/// long file name, shared through the memo: each frame and each stack owns a
/// copy of the name.
fn long_frames(n: u32, name_len: usize) -> Vec<u8> {
    let mut p = P::new();
    p.op(b"}(");
    p.str("segments").op(b"]");
    p.str("device_traces").op(b"](");
    p.op(b"](");
    p.str(&"f".repeat(name_len)).put(0).op(b"0");
    for i in 0..n {
        p.op(b"}(");
        p.str("action").str("alloc");
        p.str("addr").int(i as i32 * 16);
        p.str("size").int(16);
        p.str("stream").int(0);
        p.str("frames").op(b"(}(");
        p.str("filename").get(0).str("line").int(i as i32);
        p.str("name").str("g").op(b"ulu");
    }
    p.op(b"ee");
    p.op(b"u");
    p.stop()
}

/// `list(L)` through REDUCE, again and again, of one list of `len` items:
/// each copy costs steps that no input byte pays for.
fn list_copies(len: u32, copies: u32) -> Vec<u8> {
    let mut p = P::new();
    p.op(b"}(");
    p.str("segments").op(b"]");
    p.str("device_traces").op(b"]");
    p.str("x");
    p.op(b"cbuiltins\nlist\n").put(0);
    p.op(b"(");
    for i in 0..len {
        p.int(i as i32);
    }
    p.op(b"l\x85").put(1).op(b"R");
    for _ in 0..copies {
        p.op(b"0").get(0).get(1).op(b"R");
    }
    p.op(b"u");
    p.stop()
}

/// Reads `bytes` under `limits`, failing the test on a panic.
fn read(bytes: &[u8], limits: &ReadLimits) -> (Result<Trace>, ReadStats) {
    catch_unwind(AssertUnwindSafe(|| {
        read_snapshot_limited(bytes, "crafted", limits)
    }))
    .unwrap_or_else(|_| panic!("the reader panicked on {} bytes", bytes.len()))
}

/// The budget held: memory by the counter's peak, work unless the read
/// stopped on the work limit (which it exceeds by the step that hit it).
fn assert_within(what: &str, r: &Result<Trace>, st: &ReadStats, limits: &ReadLimits) {
    let bound = limits.memory_bound(st.input_bytes);
    assert!(
        st.peak_held <= bound,
        "{what}: held {} bytes, bound {bound} ({st:?})",
        st.peak_held
    );
    let work_hit =
        matches!(r, Err(e) if matches!(&*e.kind, ErrorKind::Limit { limit: "work", .. }));
    assert!(
        work_hit || st.work <= limits.work_bound(st.input_bytes),
        "{what}: {} steps, bound {} ({st:?})",
        st.work,
        limits.work_bound(st.input_bytes)
    );
}

fn limit_of(r: &Result<Trace>) -> Option<&'static str> {
    match r {
        Err(e) => match &*e.kind {
            ErrorKind::Limit { limit, .. } => Some(limit),
            _ => None,
        },
        Ok(_) => None,
    }
}

/// The crafted shapes of issue 41, at the sizes it measured, with the limit
/// each hits (`None`: it reads, or fails on its layout, within the budget).
fn crafted() -> Vec<(&'static str, Vec<u8>, Option<&'static str>)> {
    vec![
        ("sparse-memo-20KB", sparse_memo(4_000), None),
        ("sparse-memo-82KB", sparse_memo(16_400), None),
        ("sparse-memo-328KB", sparse_memo(65_600), None),
        ("laughs-580B", laughs(20, 10), Some("whole-value size")),
        ("laughs-680B", laughs(24, 10), Some("whole-value size")),
        ("tuple-keys-1KB", shared_tuple_keys(18, 100, false), None),
        (
            "tuple-keys-1MB",
            shared_tuple_keys(18, 112_000, false),
            None,
        ),
        (
            "tuple-keys-top-1MB",
            shared_tuple_keys(18, 112_000, true),
            None,
        ),
        ("deep-lists-2MB", deep_lists(1_000_000), Some("memory")),
        ("deep-dicts-4MB", deep_dicts(1_000_000), Some("memory")),
        (
            "long-frames-320KB",
            long_frames(2_000, 60_000),
            Some("memory"),
        ),
        (
            "list-copies-220KB",
            list_copies(20_000, 20_000),
            Some("work"),
        ),
    ]
}

#[test]
fn crafted_files_stay_within_the_budget_and_name_the_limit() {
    let keep = std::env::var_os("VMMALLOC_CRAFTED_DIR").map(PathBuf::from);
    let limits = ReadLimits::default();
    for (name, bytes, want) in crafted() {
        if let Some(dir) = &keep {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join(format!("{name}.pickle")), &bytes).unwrap();
        }
        let (r, st) = read(&bytes, &limits);
        assert_within(name, &r, &st, &limits);
        assert!(st.input_bytes <= bytes.len() as u64, "{name}: {st:?}");
        if want.is_none() {
            assert_eq!(st.input_bytes, bytes.len() as u64, "{name}: {st:?}");
        }
        assert_eq!(
            limit_of(&r),
            want,
            "{name}: {:?}",
            r.as_ref().err().map(|e| e.to_string())
        );
        if want.is_none() {
            // What it does read, it reads as a plain unpickler would.
            if let Err(e) = &r {
                assert!(
                    matches!(&*e.kind, ErrorKind::Foreign(_) | ErrorKind::Schema(_)),
                    "{name}: {e}"
                );
            }
        }
    }
}

#[test]
fn the_error_names_the_limit_and_the_place() {
    let (r, _) = read(&laughs(20, 10), &ReadLimits::default());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("whole-value size limit hit"), "{e}");
    assert!(e.contains("16.0 MiB"), "{e}");
    assert!(e.contains("\"Limits\""), "{e}");
    let (r, _) = read(&deep_lists(1_000_000), &ReadLimits::default());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("memory limit hit at byte "), "{e}");
    assert!(e.contains(": 48.0 MiB + 1.5 x input = "), "{e}");
    assert!(e.lines().count() == 1, "{e}");
}

#[test]
fn deep_settings_hit_the_depth_limit() {
    // allocator_settings = {'k': [[[...]]]} 2000 deep.
    let mut p = P::new();
    p.op(b"}(");
    p.str("segments").op(b"]");
    p.str("device_traces").op(b"]");
    p.str("allocator_settings").op(b"}").str("k");
    p.op(&vec![b']'; 2000]).op(&vec![b'a'; 1999]);
    p.op(b"su");
    let (r, _) = read(&p.stop(), &ReadLimits::default());
    assert_eq!(limit_of(&r), Some("whole-value depth"));
}

fn fixture() -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cs336_lm_step.pickle"),
    )
    .unwrap()
}

#[test]
fn the_limits_are_deterministic_and_lowering_them_stops_the_real_snapshot() {
    let fixture = fixture();
    let limits = ReadLimits::default();
    let (a, sa) = read(&fixture, &limits);
    eprintln!("fixture: {sa:?}");
    let (b, sb) = read(&fixture, &limits);
    assert!(a.is_ok() && b.is_ok());
    assert_eq!(sa, sb, "the counters depend on the input alone");
    assert_within("fixture", &a, &sa, &limits);
    // The real snapshot holds about its own size and takes a few steps a byte.
    assert!(sa.peak_held < 4 << 20, "{sa:?}");
    assert!(sa.work < 2 * sa.input_bytes, "{sa:?}");
    for (limits, want) in [
        (
            ReadLimits {
                memory_base: 256 << 10,
                memory_per_input_byte: 0.5,
                ..ReadLimits::default()
            },
            "memory",
        ),
        (
            ReadLimits {
                work_base: 1000,
                work_per_input_byte: 0,
                ..ReadLimits::default()
            },
            "work",
        ),
    ] {
        let (r, st) = read(&fixture, &limits);
        assert_eq!(limit_of(&r), Some(want), "{st:?}");
        assert_within(want, &r, &st, &limits);
    }
}

#[test]
fn a_synthetic_training_snapshot_stays_far_below_the_limits() {
    // 4 MB of a training loop recorded with stacks, as PyTorch pickles it:
    // the reader holds about the file's size, a fraction of its bound.
    let mut bytes = Vec::new();
    write_snapshot(
        &mut bytes,
        &SynthConfig {
            target_bytes: 4_000_000,
            ..SynthConfig::default()
        },
    )
    .unwrap();
    let limits = ReadLimits::default();
    let (r, st) = read(&bytes, &limits);
    let t = r.expect("the synthetic snapshot reads");
    eprintln!("{} bytes, {} events: {st:?}", bytes.len(), t.num_events());
    assert_within("synthetic", &Ok(t), &st, &limits);
    assert!(
        st.peak_held < limits.memory_bound(st.input_bytes) / 4,
        "{st:?}"
    );
    assert!(st.work < 2 * st.input_bytes, "{st:?}");
}

#[test]
fn globals_are_never_called() {
    // {'segments': [], 'device_traces': [], 'x': os.system('touch MARKER')}
    // and the same through STACK_GLOBAL, and a bare `os.system(...)`.
    let marker = std::env::temp_dir().join(format!("vmmalloc-pwned-{}", std::process::id()));
    let cmd = format!("touch {}", marker.display());
    let snapshot = |stack_global: bool| {
        let mut p = P::new();
        p.op(b"}(");
        p.str("segments").op(b"]");
        p.str("device_traces").op(b"]");
        p.str("x");
        if stack_global {
            p.str("os").str("system").op(b"\x93");
        } else {
            p.op(b"cos\nsystem\n");
        }
        p.str(&cmd).op(b"\x85R");
        p.op(b"u");
        p.stop()
    };
    for stack_global in [false, true] {
        let (r, _) = read(&snapshot(stack_global), &ReadLimits::default());
        let t = r.expect("an opaque object reads as None");
        assert!(t.devices.is_empty());
    }
    let mut p = P::new();
    p.op(b"cos\nsystem\n").str(&cmd).op(b"\x85R");
    let (r, _) = read(&p.stop(), &ReadLimits::default());
    let e = r.unwrap_err().to_string();
    assert!(e.contains("the top level is None"), "{e}");
    assert!(!marker.exists(), "a global was called");
}

/// Opcodes with their operands, for random streams.
fn op_strategy() -> impl Strategy<Value = Vec<u8>> {
    let simple =
        prop::sample::select(b"(0123NRabdeltsu])}.\x85\x86\x87\x88\x89\x8f\x90\x91\x94".to_vec())
            .prop_map(|b| vec![b]);
    prop_oneof![
        4 => simple,
        1 => any::<u8>().prop_map(|i| vec![b'K', i]),
        1 => (0u8..4).prop_map(|i| vec![b'h', i]),
        1 => (0u8..4).prop_map(|i| vec![b'q', i]),
        1 => any::<u32>().prop_map(|i| {
            let mut v = vec![b'r'];
            v.extend_from_slice(&(i % 1024).to_le_bytes());
            v
        }),
        1 => "[a-z]{0,8}".prop_map(|s| {
            let mut v = vec![0x8c, s.len() as u8];
            v.extend_from_slice(s.as_bytes());
            v
        }),
        1 => prop::sample::select(vec![
            b"csegments\nx\n".to_vec(),
            b"cbuiltins\nlist\n".to_vec(),
            b"cbuiltins\nset\n".to_vec(),
            b"c_codecs\nencode\n".to_vec(),
            b"\x8c\x08segments".to_vec(),
            b"\x8c\x0ddevice_traces".to_vec(),
            b"\x8c\x12allocator_settings".to_vec(),
            b"\x8c\x06action\x8c\x05alloc".to_vec(),
        ]),
    ]
}

/// Small limits, so that short streams reach them.
fn small_limits() -> ReadLimits {
    ReadLimits {
        memory_base: 300 << 10,
        memory_per_input_byte: 1.5,
        work_base: 2_000,
        work_per_input_byte: 64,
        whole_value_bytes: 4 << 10,
        whole_value_depth: 20,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_opcode_streams_keep_the_budget(ops in prop::collection::vec(op_strategy(), 0..400)) {
        let mut bytes = vec![0x80, 4];
        for o in &ops {
            bytes.extend_from_slice(o);
        }
        bytes.push(b'.');
        for limits in [ReadLimits::default(), small_limits()] {
            let (r, st) = read(&bytes, &limits);
            assert_within("random", &r, &st, &limits);
        }
    }

    #[test]
    fn mutated_crafted_files_keep_the_budget(
        which in 0usize..7,
        edits in prop::collection::vec((0.0f64..1.0, any::<u8>(), any::<bool>()), 1..6),
    ) {
        // Small versions of the crafted shapes, and the real snapshot, mutated
        // (a byte replaced, or inserted).
        let base = match which {
            0 => sparse_memo(200),
            1 => laughs(8, 6),
            2 => shared_tuple_keys(10, 50, true),
            3 => deep_dicts(2_000),
            4 => list_copies(100, 30),
            5 => long_frames(20, 100),
            _ => fixture(),
        };
        let mut bytes = base;
        for (pos, b, insert) in &edits {
            let i = ((bytes.len() as f64) * pos) as usize;
            if *insert {
                bytes.insert(i, *b);
            } else if i < bytes.len() {
                bytes[i] = *b;
            }
        }
        for limits in [ReadLimits::default(), small_limits()] {
            let (r, st) = read(&bytes, &limits);
            assert_within("mutated", &r, &st, &limits);
        }
    }
}
