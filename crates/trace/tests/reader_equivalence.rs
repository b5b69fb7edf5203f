//! The streaming snapshot reader (issue 34) reads every snapshot the reader
//! before it read, with the same result: the same trace, or an error where
//! the old one failed. The old reader (`vmmalloc_trace_testkit::legacy`, serde-pickle's value
//! tree) is the oracle.
//!
//! Inputs: the bundled real snapshot, the checked-in test snapshots, and
//! synthetic ones rewritten by Python's own `pickle` into the layouts other
//! PyTorch versions and other writers produce (with and without frames,
//! shared or copied frames, `segment_pool_id`, no `device_traces`, the
//! PyTorch 2.0 block layout, protocols 0–5, MB-scale). Then every truncation
//! of small snapshots, and corrupted bytes: errors, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;

use proptest::prelude::*;
use vmmalloc_trace::pytorch::parse_snapshot;
use vmmalloc_trace::{load_path, Trace};
use vmmalloc_trace_testkit::legacy;
use vmmalloc_trace_testkit::synth::{write_snapshot, SynthConfig};

fn repo(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("vmmalloc-eq-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn synth(target_bytes: u64, devices: u32, protocol: u8) -> Vec<u8> {
    let mut b = Vec::new();
    write_snapshot(
        &mut b,
        &SynthConfig {
            target_bytes,
            layers: 4,
            devices,
            protocol,
            seed: 3,
        },
    )
    .unwrap();
    b
}

/// Old and new agree on `bytes`: both read the same trace, or both fail.
/// Returns the trace (if any) for further checks.
fn agree(what: &str, bytes: &[u8]) -> Option<Trace> {
    let new = catch_unwind(AssertUnwindSafe(|| parse_snapshot(bytes, "t")))
        .unwrap_or_else(|_| panic!("{what}: the new reader panicked"));
    let old = legacy::parse_snapshot(bytes, "t");
    match (new, old) {
        (Ok(n), Ok(o)) => {
            assert!(n == o, "{what}: old and new readers differ");
            Some(n)
        }
        (Err(n), Err(_)) => {
            let m = n.to_string();
            assert!(!m.is_empty() && !m.contains('\n'), "{what}: {m:?}");
            None
        }
        (Ok(_), Err(o)) => panic!("{what}: the old reader failed ({o}), the new one did not"),
        (Err(n), Ok(_)) => panic!("{what}: the new reader failed ({n}), the old one did not"),
    }
}

#[test]
fn the_real_snapshot_reads_the_same_from_bytes_and_from_the_file() {
    for p in [
        repo("../../tests/fixtures/cs336_lm_step.pickle"),
        // The shared copy beside the checkout (../shared/traces).
        repo("../../../shared/traces/cs336_lm_step.pickle"),
    ] {
        if !p.exists() {
            continue; // the shared copy exists on the project's machines only
        }
        let bytes = std::fs::read(&p).unwrap();
        let t = agree(&p.display().to_string(), &bytes).expect("reads");
        let from_file = load_path(&p).unwrap();
        let old = legacy::read_snapshot(&p).unwrap();
        assert!(from_file == old, "{}", p.display());
        // The reference figure of shared/traces/README.md.
        assert_eq!(t.devices[0].peak_live_bytes(), 13_923_997_700);
        assert_eq!(t.num_events(), 5_163);
    }
}

#[test]
fn the_checked_in_snapshots_read_the_same() {
    for entry in std::fs::read_dir(repo("tests/data")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "pickle") {
            agree(&p.display().to_string(), &std::fs::read(&p).unwrap());
        }
    }
}

#[test]
fn synthetic_snapshots_of_every_protocol_and_mb_scale_read_the_same() {
    for (bytes, devices, protocol) in [
        (30_000, 1, 2),
        (30_000, 2, 3),
        (30_000, 3, 4),
        (30_000, 1, 5),
        (3_000_000, 2, 4),
    ] {
        let b = synth(bytes, devices, protocol);
        let t = agree(&format!("synth {bytes} B protocol {protocol}"), &b).expect("reads");
        assert_eq!(t.devices.len(), devices as usize);
        assert!(t.devices.iter().all(|d| !d.frames().is_empty()));
    }
}

/// Python rewrites a synthetic snapshot and the real one into other layouts.
const VARIANTS: &str = r#"
import copy, json, pickle, sys
src, out = sys.argv[1], sys.argv[2]
names = []
def dump(name, obj, protocols=(2, 4, 5)):
    for p in protocols:
        n = f"{name}.p{p}.pickle"
        with open(f"{out}/{n}", "wb") as f:
            pickle.dump(obj, f, protocol=p)
        names.append(n)
for base in ("synth", "real"):
    s = pickle.load(open(f"{src}/{base}.pickle", "rb"))
    dump(f"{base}-as-is", s, (0, 1, 2, 3, 4, 5))
    # Frames not shared: every dict its own object (json round trip).
    dump(f"{base}-unshared", json.loads(json.dumps(s)))
    # No frames anywhere (recorded with stacks=None / context=None).
    t = copy.deepcopy(s)
    for seg in t["segments"]:
        seg.pop("frames", None)
        for b in seg.get("blocks", []):
            b.pop("frames", None)
    for tr in t["device_traces"]:
        for e in tr:
            e.pop("frames", None)
    dump(f"{base}-noframes", t)
    # Empty frames everywhere (what vmmalloc's own dumps write).
    for tr in t["device_traces"]:
        for e in tr:
            e["frames"] = []
    dump(f"{base}-emptyframes", t)
    # segment_pool_id toggled; is_expandable dropped (older PyTorch).
    t = copy.deepcopy(s)
    for seg in t["segments"]:
        if "segment_pool_id" in seg:
            del seg["segment_pool_id"]
        else:
            seg["segment_pool_id"] = (0, 0)
        seg.pop("is_expandable", None)
    dump(f"{base}-poolid", t)
    # Segments only: dumped without recording history.
    t = copy.deepcopy(s)
    del t["device_traces"]
    dump(f"{base}-notraces", t)
    # Device traces only, segments empty.
    t = copy.deepcopy(s)
    t["segments"] = []
    dump(f"{base}-nosegments", t)
    # PyTorch 2.0: blocks without address or requested_size (a history
    # instead), events without time_us, no compile_context/user_metadata.
    t = copy.deepcopy(s)
    for seg in t["segments"]:
        for b in seg.get("blocks", []):
            r = b.pop("requested_size", b["size"])
            b["history"] = [{"addr": b.pop("address", 0), "real_size": r, "frames": b.pop("frames", [])}]
    for tr in t["device_traces"]:
        for e in tr:
            for k in ("time_us", "compile_context", "user_metadata"):
                e.pop(k, None)
    dump(f"{base}-v20", t)
    # Keys in another order, settings and annotations dropped.
    t = {k: s[k] for k in reversed(list(s.keys())) if k in ("segments", "device_traces")}
    dump(f"{base}-reordered", t)
# Hand-made: one dict object in several places (PyTorch never shares block or
# event dicts, a script building a snapshot may).
MIB = 1 << 20
blk = {"size": MIB, "requested_size": MIB, "state": "inactive"}
seg = lambda a: {"device": 0, "address": a, "total_size": 2 * MIB, "stream": 0,
                 "segment_type": "small", "blocks": [blk, dict(blk, address=a + MIB)]}
ev = {"action": "snapshot", "addr": 0, "size": 0, "stream": 0}
al = lambda a: {"action": "alloc", "addr": a, "size": 100, "stream": 0}
dump("shared-dicts", {"segments": [seg(0), seg(2 * MIB)],
                      "device_traces": [[al(5), ev, ev, al(9)]]})
dump("shared-segment", {"segments": [seg(0)] * 2, "device_traces": [[ev] * 3]})
print("\n".join(names))
"#;

#[test]
fn layouts_of_other_pytorch_versions_and_protocols_read_the_same() {
    let dir = TempDir::new("layouts");
    std::fs::write(dir.0.join("synth.pickle"), synth(200_000, 2, 4)).unwrap();
    std::fs::copy(
        repo("../../tests/fixtures/cs336_lm_step.pickle"),
        dir.0.join("real.pickle"),
    )
    .unwrap();
    let out = Command::new("python3")
        .arg("-c")
        .arg(VARIANTS)
        .arg(&dir.0)
        .arg(&dir.0)
        .output()
        .expect("python3 runs (the CI has it for the plug-in's tests)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names = String::from_utf8(out.stdout).unwrap();
    let mut read = 0;
    for n in names.lines() {
        let p = dir.0.join(n);
        let t = agree(n, &std::fs::read(&p).unwrap());
        if n.starts_with("shared-") {
            assert!(t.is_some(), "{n}: shared dicts read");
        }
        read += usize::from(t.is_some());
        if n.starts_with("real-as-is.p4") || n.starts_with("synth-noframes.p5") {
            // Through the file, as the commands read it.
            assert!(
                load_path(&p).unwrap() == legacy::read_snapshot(&p).unwrap(),
                "{n}"
            );
        }
    }
    assert!(read >= 40, "{read} variants read:\n{names}");
}

fn check_prefixes(what: &str, b: &[u8], step: usize) {
    for n in (0..b.len()).step_by(step) {
        let r = catch_unwind(AssertUnwindSafe(|| parse_snapshot(&b[..n], "t")))
            .unwrap_or_else(|_| panic!("{what}: the new reader panicked on {n} bytes"));
        let e = r.err().unwrap_or_else(|| panic!("{what}: {n} bytes read"));
        let m = e.to_string();
        assert!(!m.contains('\n'), "{m}");
    }
}

#[test]
fn every_truncation_is_an_error() {
    for entry in std::fs::read_dir(repo("tests/data")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "pickle") {
            check_prefixes(&p.display().to_string(), &std::fs::read(&p).unwrap(), 1);
        }
    }
    check_prefixes("synth", &synth(20_000, 2, 4), 7);
    let real = std::fs::read(repo("../../tests/fixtures/cs336_lm_step.pickle")).unwrap();
    check_prefixes("real", &real, 4999);
}

#[test]
fn a_truncated_file_names_the_file_and_the_offset() {
    let dir = TempDir::new("trunc");
    let b = synth(20_000, 1, 4);
    let p: &Path = &dir.0.join("cut.pickle");
    std::fs::write(p, &b[..b.len() / 2]).unwrap();
    let m = load_path(p).unwrap_err().to_string();
    assert!(m.contains("cut.pickle") && m.contains("truncated"), "{m}");
    assert!(m.contains("at byte"), "{m}");
}

fn small() -> &'static [u8] {
    static B: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    B.get_or_init(|| synth(6_000, 2, 4))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Corrupt bytes: the new reader never panics and fails with one line.
    /// (It does not always fail where the old one failed, nor read what the
    /// old one read: a corrupted memo index can point at an event or block
    /// dict the stream has already consumed, which the new reader reads as
    /// `None`; Python's pickler never writes such a reference in a snapshot,
    /// see docs/trace-format.md. Well-formed inputs agree: the tests above.)
    #[test]
    fn corrupted_snapshots_never_panic(
        flips in proptest::collection::vec((0.0f64..1.0, any::<u8>()), 1..6)
    ) {
        let mut b = small().to_vec();
        for (at, v) in flips {
            let i = ((b.len() - 1) as f64 * at) as usize;
            b[i] = v;
        }
        let new = catch_unwind(AssertUnwindSafe(|| parse_snapshot(&b, "t")));
        prop_assert!(new.is_ok(), "the new reader panicked");
        if let Err(e) = new.unwrap() {
            prop_assert!(!e.to_string().contains('\n'), "{}", e);
        }
    }
}

/// One event dict object in two batches (a hand-made snapshot; PyTorch
/// writes a fresh dict per event): the one thing the old reader read and
/// this one refuses, with an error that says why.
#[test]
fn one_event_object_in_two_batches_is_a_clear_error() {
    let dir = TempDir::new("shared");
    let p = dir.0.join("shared.pickle");
    let script = "import pickle, sys\n\
        ev = {'action': 'snapshot', 'addr': 0, 'size': 0, 'stream': 0}\n\
        al = [{'action': 'alloc', 'addr': i * 512, 'size': 100, 'stream': 0} for i in range(1500)]\n\
        pickle.dump({'segments': [], 'device_traces': [[ev] + al + [ev]]}, open(sys.argv[1], 'wb'), protocol=4)\n";
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&p)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(legacy::read_snapshot(&p).is_ok());
    let m = load_path(&p).unwrap_err().to_string();
    assert!(
        m.contains("event 1501") && m.contains("already appeared earlier"),
        "{m}"
    );
}
