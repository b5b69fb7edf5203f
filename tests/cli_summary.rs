//! End-to-end tests of `vmmalloc summary` and `vmmalloc snapshot` on the
//! bundled fixture and a small text trace.

use std::path::Path;
use std::process::{Command, Output};
use vmmalloc_alloc::{Policy, Stats};
use vmmalloc_device::GIB;
use vmmalloc_trace::model::BlockState;
use vmmalloc_trace::replay::{replay, replay_keeping, ReplayConfig};

mod common;
use common::tmpdir;

/// The fixture's peak of requested live bytes (crates/trace/tests/fixture.rs).
const FIXTURE_PEAK_LIVE: u64 = 13_923_997_700;

fn fixture() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cs336_lm_step.pickle"
    )
    .to_string()
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a command that must fail cleanly; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(!err.trim().is_empty(), "{args:?}: no message");
    err
}

/// The first paragraph of `text` (the point's description, wrapped to 100
/// columns) as one line: its lines up to the table or a blank line.
fn first_paragraph(text: &str) -> String {
    text.lines()
        .take_while(|l| !l.is_empty() && !l.starts_with('|'))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The four columns (current, peak, allocated, freed) of the table row `name`.
fn row<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("| {name} ")))
        .unwrap_or_else(|| panic!("no row {name:?} in\n{text}"));
    let cols: Vec<&str> = line.split('|').map(str::trim).collect();
    // "", name, cur, peak, alloc, freed, ""
    assert_eq!(cols.len(), 7, "{line:?}");
    cols[2..6].to_vec()
}

/// A byte figure as the table writes it when the column's "all" value is in GiB range.
fn mib(b: i64) -> String {
    format!("{} MiB", b.div_euclid(1 << 20))
}

/// The stats of `policy` right after op `stop_after` of the fixture, replayed as the CLI does.
fn stats_at(policy: Policy, capacity: u64, stop_after: Option<usize>) -> (Stats, u64) {
    let trace = vmmalloc_trace::load_path(Path::new(&fixture())).unwrap();
    let ops = trace.devices[0].replay_ops();
    let mut cfg = ReplayConfig::new(policy, capacity);
    cfg.stop_after = stop_after;
    let kept = replay_keeping(ops, &cfg);
    let stats = kept.allocator.as_ref().unwrap().stats();
    (stats, kept.result.final_live)
}

fn fixture_peak_op() -> usize {
    let trace = vmmalloc_trace::load_path(Path::new(&fixture())).unwrap();
    let r = replay(
        trace.devices[0].replay_ops(),
        &ReplayConfig::new(Policy::Expandable, 80 * GIB),
    );
    r.peak_live_op.unwrap()
}

#[test]
fn summary_at_the_end_is_the_pytorch_table_of_the_final_state() {
    let f = fixture();
    let text = ok(&["summary", &f]);
    let first = &first_paragraph(&text);
    assert!(
        first.contains("cs336_lm_step device 0 — policy expandable on a 80.00 GiB"),
        "{first}"
    );
    assert!(first.contains("at the end (3671 of 3671 ops)"), "{first}");
    assert!(text.contains("vmmalloc CUDA memory summary, device ID 0"));
    assert!(text.contains("CUDA OOMs: 0 "), "{text}");
    assert!(text.contains("backend expandable on sim device"), "{text}");
    // The table, up to the blank line before the stacks section (the fixture
    // recorded stacks).
    for l in text
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| !l.is_empty())
    {
        assert_eq!(l.chars().count(), 77, "{l:?}");
    }
    assert!(
        text.contains("\n\nLive memory by where it was allocated"),
        "{text}"
    );
    let (stats, live) = stats_at(Policy::Expandable, 80 * GIB, None);
    let alloc = stats.allocated_bytes.all();
    assert_eq!(
        row(&text, "Allocated memory"),
        [
            mib(alloc.current),
            mib(alloc.peak),
            mib(alloc.allocated),
            mib(alloc.freed)
        ]
    );
    assert!(
        first.contains(&format!("({live} bytes) requested")),
        "{first}"
    );
    assert_eq!(
        row(&text, "Allocations")[0],
        stats.allocation.all().current.to_string()
    );
    // The default point is the end.
    assert_eq!(ok(&["summary", &f, "--at", "end"]), text);
}

#[test]
fn summary_at_the_peak_shows_the_fixture_peak() {
    let f = fixture();
    let text = ok(&["summary", &f, "--at", "peak", "--policy", "caching"]);
    let first = &first_paragraph(&text);
    assert!(first.contains("at the peak of live bytes"), "{first}");
    assert!(
        first.contains(&format!("({FIXTURE_PEAK_LIVE} bytes) requested")),
        "{first}"
    );
    let op = fixture_peak_op();
    assert!(
        first.contains(&format!("(after {} of 3671 ops)", op + 1)),
        "{first}"
    );
    let (stats, live) = stats_at(Policy::Caching, 80 * GIB, Some(op));
    assert_eq!(live, FIXTURE_PEAK_LIVE);
    assert_eq!(
        stats.requested_bytes.all().current,
        FIXTURE_PEAK_LIVE as i64
    );
    // Requested memory: at its peak right now.
    let requested = row(&text, "Requested memory");
    assert_eq!(requested[0], mib(FIXTURE_PEAK_LIVE as i64));
    assert_eq!(requested[1], mib(FIXTURE_PEAK_LIVE as i64));
    // Allocated memory: the table's figures are the allocator's stats.
    let alloc = stats.allocated_bytes.all();
    let allocated = row(&text, "Allocated memory");
    assert_eq!(allocated[0], mib(alloc.current));
    assert_eq!(allocated[1], mib(alloc.peak));
    assert!(alloc.peak >= FIXTURE_PEAK_LIVE as i64);
    assert_eq!(
        row(&text, "GPU reserved memory")[1],
        mib(stats.reserved_bytes.all().peak)
    );
}

#[test]
fn summary_at_the_first_oom() {
    let f = fixture();
    let text = ok(&["summary", &f, "--at", "oom", "--capacity", "10GiB"]);
    let first = &first_paragraph(&text);
    assert!(
        first.contains("at the first out-of-memory (event "),
        "{first}"
    );
    let ooms: u64 = text
        .split("CUDA OOMs:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no OOM count in\n{text}"));
    assert!(ooms >= 1, "{text}");

    let err = fails(&["summary", &f, "--at", "oom"]);
    assert!(err.contains("no out-of-memory"), "{err}");
    assert!(err.contains("--capacity"), "{err}");
}

#[test]
fn snapshot_reads_back_with_the_live_bytes_of_its_point() {
    let f = fixture();
    let dir = tmpdir("snapshot");
    let cases: [(&str, &str, u64); 3] = [
        ("peak", "expandable", FIXTURE_PEAK_LIVE),
        ("peak", "torch-es", FIXTURE_PEAK_LIVE),
        ("end", "caching", 0),
    ];
    for (at, policy, want) in cases {
        let path = dir.join(format!("{at}-{policy}.pickle"));
        let out = ok(&[
            "snapshot",
            &f,
            "--at",
            at,
            "--policy",
            policy,
            "--out",
            path.to_str().unwrap(),
        ]);
        // One statement, wrapped to 100 columns (its later lines indented).
        assert_eq!(
            out.lines().filter(|l| !l.starts_with("  ")).count(),
            1,
            "{out}"
        );
        assert!(
            out.starts_with(&format!("wrote {}: ", path.display())),
            "{out}"
        );
        let out = out.split_whitespace().collect::<Vec<_>>().join(" ");
        let t = vmmalloc_trace::pytorch::read_snapshot(&path).unwrap();
        assert_eq!(t.devices.len(), 1);
        let d = &t.devices[0];
        assert_eq!(d.device(), 0);
        assert!(d.warnings().is_empty(), "{at} {policy}: {:?}", d.warnings());
        // The history (device_traces) reads back: every allocation of the
        // replay up to the point is an event, so nothing is pre-trace, and
        // the live bytes at the end of the history are the point's.
        assert!(d.pre_trace().is_empty(), "{at} {policy}");
        let live = d.final_live_bytes();
        if want > 0 {
            assert_eq!(live, want, "{at} {policy}");
            assert_eq!(
                d.peak_live_bytes(),
                want,
                "{at} {policy}: the peak is the point"
            );
        }
        assert!(
            out.contains(&format!("({live} bytes) requested")),
            "{out} vs {live}"
        );
        let ops = d.replay_ops();
        let allocs = ops
            .iter()
            .filter(|o| matches!(o, vmmalloc_trace::model::Op::Alloc { .. }))
            .count();
        let n = allocs - (ops.len() - allocs);
        assert!(out.contains(&format!(": {n} live allocations")), "{out}");
        let kinds: std::collections::BTreeSet<&str> =
            d.events().iter().map(|e| e.kind.name()).collect();
        let segment_kind = if policy == "caching" {
            "segment_alloc"
        } else {
            "segment_map"
        };
        for k in ["alloc", "free", "free_requested", segment_kind] {
            assert!(kinds.contains(k), "{at} {policy}: no {k} in {kinds:?}");
        }
        assert!(
            d.events().windows(2).all(|w| w[0].time_us <= w[1].time_us),
            "{at} {policy}: time_us goes forward"
        );
        let active: u64 = d
            .segments_final()
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum();
        assert!(
            out.contains(&format!(" {active} bytes in active blocks")),
            "{out} vs {active}"
        );
        // Blocks cover their segments (torch.cuda._memory_viz asserts it).
        for s in d.segments_final() {
            assert_eq!(
                s.blocks.iter().map(|b| b.size).sum::<u64>(),
                s.total_size,
                "{at} {policy}"
            );
        }
        assert_eq!(d.allocator_settings()["backend"], policy);
        assert_eq!(d.allocator_settings()["at"], at);
    }
    // At the end, the live bytes are the trace's own final live bytes.
    let trace = vmmalloc_trace::load_path(Path::new(&f)).unwrap();
    let end = vmmalloc_trace::pytorch::read_snapshot(&dir.join("end-caching.pickle")).unwrap();
    assert_eq!(
        end.devices[0].final_live_bytes(),
        trace.devices[0].final_live_bytes()
    );
    // The whole history replays to the same peak as the trace it came from.
    assert_eq!(
        end.devices[0].peak_live_bytes(),
        trace.devices[0].peak_live_bytes()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn text_traces_and_workloads_are_inputs_too() {
    let dir = tmpdir("summary-text");
    let mib = 1u64 << 20;
    let mut s = String::from("vmmalloc-trace 1\nname small\ndevice 3\n");
    for i in 0..6u64 {
        s.push_str(&format!(
            "alloc {:#x} {} 0 {}\n",
            0x1_0000_0000u64 + i * 64 * mib,
            (i + 1) * mib,
            i
        ));
    }
    let path = dir.join("small.trace");
    std::fs::write(&path, s).unwrap();
    let p = path.to_str().unwrap();
    let text = ok(&[
        "summary",
        p,
        "--policy",
        "native",
        "--capacity",
        "8MiB",
        "--at",
        "oom",
        "--device",
        "3",
    ]);
    assert!(text.starts_with("small device 3 — policy native"), "{text}");
    assert!(text.contains("device ID 3"), "{text}");
    assert!(text.contains("CUDA OOMs: 1 "), "{text}");
    let out = dir.join("w.pickle");
    let line = ok(&[
        "snapshot",
        "train-varlen:steps=2,layers=2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(line.contains("train-varlen"), "{line}");
    assert!(vmmalloc_trace::pytorch::read_snapshot(&out).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_a_clear_error() {
    let f = fixture();
    let err = fails(&["summary", "/no/such/trace.pickle"]);
    assert!(err.contains("/no/such/trace.pickle"), "{err}");
    let err = fails(&["summary", &f, "--policy", "bogus"]);
    assert!(err.contains("unknown policy `bogus`"), "{err}");
    let err = fails(&["summary", &f, "--at", "bogus"]);
    assert!(err.contains("possible values: end, peak, oom"), "{err}");
    let err = fails(&["summary", &f, "--capacity", "lots"]);
    assert!(err.contains("not a size"), "{err}");
    let err = fails(&["summary", &f, "--device", "7"]);
    assert!(
        err.contains("the input has no device 7; its devices: 0"),
        "{err}"
    );
    let err = fails(&["snapshot", &f]);
    assert!(err.contains("--out"), "{err}");
    let err = fails(&["snapshot", &f, "--out", "/no/such/dir/x.pickle"]);
    assert!(
        err.contains("/no/such/dir/x.pickle") && err.contains("--mkdir"),
        "{err}"
    );
    // `--steady` is replay's alone: not offered by summary's help, and
    // refused as clap refuses any unknown option, in one line.
    let err = fails(&["summary", &f, "--steady"]);
    assert!(
        err.contains("--steady") && err.lines().count() == 1,
        "{err}"
    );
    assert!(!err.contains("'-- --steady'"), "{err}");
    for c in ["summary", "snapshot"] {
        let help = String::from_utf8_lossy(&run(&[c, "--help"]).stdout).into_owned();
        assert!(!help.contains("--steady"), "{c}: {help}");
    }
    let help = String::from_utf8_lossy(&run(&["replay", "--help"]).stdout).into_owned();
    assert!(help.contains("--steady"), "{help}");
    let never = std::env::temp_dir().join("never.pickle");
    let err = fails(&[
        "snapshot",
        &f,
        "--at",
        "oom",
        "--out",
        never.to_str().unwrap(),
    ]);
    assert!(err.contains("no out-of-memory"), "{err}");
}

#[test]
fn snapshot_history_records_the_out_of_memory() {
    let f = fixture();
    let dir = tmpdir("snapshot-oom");
    let path = dir.join("oom.pickle");
    ok(&[
        "snapshot",
        &f,
        "--policy",
        "caching",
        "--capacity",
        "12GiB",
        "--at",
        "oom",
        "--out",
        path.to_str().unwrap(),
    ]);
    let t = vmmalloc_trace::pytorch::read_snapshot(&path).unwrap();
    let d = &t.devices[0];
    let last = d.events().last().expect("events");
    assert_eq!(
        last.kind.name(),
        "oom",
        "the history stops at the out-of-memory"
    );
    assert!(last.size > 0);
    let _ = std::fs::remove_dir_all(&dir);
}
