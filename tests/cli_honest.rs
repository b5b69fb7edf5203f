//! Issue 15 (honest results): what the CLI says matches what happened. Early
//! stops are not success, syncs mean one thing everywhere, a snapshot without
//! history says so, sizes mean what they say, and the paper cuts.

use serde_json::Value;
use std::path::PathBuf;

mod common;
use common::{ok, run, stderr, stdout, tmpdir};

/// Runs the CLI and asserts failure without a panic; returns stderr.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    assert!(!o.status.success(), "{args:?} should fail: {}", stdout(&o));
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{args:?}: {e}");
    e
}

/// The value of a `  key   value` row of `vmmalloc replay`.
fn row<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(key).map(str::trim))
        .unwrap_or_else(|| panic!("no row `{key}` in:\n{text}"))
}

/// The count after a driver symbol in `vmmalloc replay`'s call list (0 if absent).
fn calls(text: &str, symbol: &str) -> u64 {
    text.lines()
        .take_while(|l| !l.contains("steady state"))
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(symbol)).then(|| it.next().unwrap().parse().unwrap())
        })
        .unwrap_or(0)
}

// ---- 1. Early stops are not success ----

#[test]
fn a_request_larger_than_the_device_is_an_oom_for_every_policy() {
    for policy in ["expandable", "caching", "torch-es", "native"] {
        let text = ok(&[
            "replay",
            "frag-adversary",
            "--policy",
            policy,
            "--capacity",
            "100",
        ]);
        assert!(
            row(&text, "result").contains("out-of-memory errors"),
            "{policy}: {text}"
        );
        assert!(!row(&text, "result").starts_with('0'), "{policy}: {text}");
        assert!(!text.contains("  error:"), "{policy}: {text}");
        let replayed = row(&text, "ops replayed");
        let (done, total) = replayed.split_once(" of ").unwrap();
        assert_eq!(done, total, "{policy}: the replay goes on: {text}");
        assert!(text.contains("first out-of-memory"), "{policy}: {text}");
    }
}

#[test]
fn a_replay_that_cannot_finish_exits_non_zero() {
    // A page larger than the device: the allocator cannot even be created.
    let o = run(&[
        "replay",
        "frag-adversary",
        "--policy",
        "expandable:page_size=8MiB",
        "--capacity",
        "4MiB",
    ]);
    // Found before anything runs (issue 36): one line, no stats block.
    assert!(!o.status.success(), "{}", stdout(&o));
    assert_eq!(stdout(&o), "", "output before the error");
    let e = stderr(&o);
    assert!(
        e.contains("page_size") && e.contains("larger than the device memory"),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(!e.contains("panicked"), "{e}");
}

#[test]
fn fail_on_oom_makes_any_oom_an_error() {
    let args = ["replay", "frag-adversary", "--policy", "caching"];
    // Without the flag an OOM is reported, and the exit is 0.
    let text = ok(&[&args[..], &["--capacity", "20GiB"]].concat());
    assert!(row(&text, "result").contains("out-of-memory"), "{text}");
    let e = fails(&[&args[..], &["--capacity", "20GiB", "--fail-on-oom"]].concat());
    assert!(
        e.contains("--fail-on-oom") && e.contains("out-of-memory"),
        "{e}"
    );
    // With room to spare the flag changes nothing.
    ok(&[&args[..], &["--capacity", "80GiB", "--fail-on-oom"]].concat());
    // summary and compare take it too.
    let e = fails(&[
        "summary",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "8GiB",
        "--fail-on-oom",
    ]);
    assert!(e.contains("--fail-on-oom"), "{e}");
    ok(&[
        "summary",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "8GiB",
    ]);
    let e = fails(&[
        "compare",
        "frag-adversary",
        "--policies",
        "caching,native",
        "--fail-on-oom",
    ]);
    assert!(e.contains("caching on frag-adversary"), "{e}");
    assert!(
        !e.contains("native on"),
        "native fits at 1.05 x peak live: {e}"
    );
}

// ---- 2. Syncs are counted the same everywhere ----

#[test]
fn syncs_have_one_definition_in_replay_summary_and_compare() {
    // native: every cuMemFree synchronizes the device.
    let text = ok(&[
        "replay",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "24GiB",
    ]);
    let frees = calls(&text, "cuMemFree_v2");
    assert!(frees > 0, "{text}");
    assert_eq!(
        row(&text, "syncs"),
        format!("{frees} device-wide"),
        "{text}"
    );
    let summary = ok(&[
        "summary",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "24GiB",
    ]);
    assert!(
        summary.contains(&format!("0 stream/event, {frees} device-wide")),
        "{summary}"
    );
    // expandable: stream waits, and the device-wide synchronizes of
    // unpinning, the same numbers in replay and summary.
    let text = ok(&["replay", "frag-adversary", "--capacity", "24GiB"]);
    let waits = calls(&text, "cuStreamSynchronize") + calls(&text, "cuEventSynchronize");
    let device = calls(&text, "cuCtxSynchronize");
    assert!(waits > 0 && device > 0, "{text}");
    assert_eq!(
        row(&text, "syncs"),
        format!(
            "{} ({waits} stream/event + {device} device-wide)",
            waits + device
        )
    );
    let summary = ok(&["summary", "frag-adversary", "--capacity", "24GiB"]);
    assert!(
        summary.contains(&format!("{waits} stream/event, {device} device-wide")),
        "{summary}"
    );
    // Without unpinning, stream waits only.
    let text = ok(&[
        "replay",
        "frag-adversary",
        "--policy",
        "expandable:unpin=0",
        "--capacity",
        "24GiB",
    ]);
    let waits = calls(&text, "cuStreamSynchronize") + calls(&text, "cuEventSynchronize");
    assert_eq!(calls(&text, "cuCtxSynchronize"), 0, "{text}");
    assert_eq!(row(&text, "syncs"), format!("{waits} stream/event"));

    // compare: JSON syncs = stream/event + device-wide, each from the calls.
    let out = ok(&["compare", "frag-adversary", "--json", "-"]);
    let doc: Value = serde_json::from_str(&out).unwrap();
    let pols = doc["traces"][0]["policies"].as_object().unwrap();
    for (name, p) in pols {
        for r in [&p["tight"], &p["tight"]["steady"]] {
            let c = &r["driver_calls"];
            let n = |k: &str| c[k].as_u64().unwrap_or(0);
            assert_eq!(
                r["stream_syncs"],
                n("stream_sync") + n("event_sync"),
                "{name}"
            );
            assert_eq!(r["device_syncs"], n("device_sync") + n("free"), "{name}");
            assert_eq!(
                r["syncs"].as_u64().unwrap(),
                r["stream_syncs"].as_u64().unwrap() + r["device_syncs"].as_u64().unwrap(),
                "{name}"
            );
        }
    }
    assert!(pols["native"]["tight"]["device_syncs"].as_u64().unwrap() > 0);
    // The wide table shows the same numbers, with their kind.
    let table = ok(&[
        "compare",
        "frag-adversary",
        "--policies",
        "native",
        "--wide",
    ]);
    let native = pols["native"]["tight"]["device_syncs"].as_u64().unwrap();
    assert!(table.contains(&format!("{native} dev")), "{table}");
    assert!(
        table.contains("cuMemFree"),
        "the legend says what dev counts: {table}"
    );
}

// ---- 3. A snapshot without history is not a trace ----

/// A minimal pickle writer (protocol 2): enough for a snapshot dict.
enum P {
    S(&'static str),
    I(i64),
    L(Vec<P>),
    D(Vec<(&'static str, P)>),
}

fn pickle(v: &P, out: &mut Vec<u8>) {
    match v {
        P::S(s) => {
            out.push(b'X');
            out.extend((s.len() as u32).to_le_bytes());
            out.extend(s.as_bytes());
        }
        P::I(i) => {
            out.extend([0x8a, 8]); // LONG1, 8 bytes
            out.extend(i.to_le_bytes());
        }
        P::L(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                for i in items {
                    pickle(i, out);
                }
                out.push(b'e');
            }
        }
        P::D(items) => {
            out.push(b'}');
            if !items.is_empty() {
                out.push(b'(');
                for (k, v) in items {
                    pickle(&P::S(k), out);
                    pickle(v, out);
                }
                out.push(b'u');
            }
        }
    }
}

fn snapshot_without_history(dir: &std::path::Path) -> PathBuf {
    let base = 0x7000_0000_0000i64;
    let mib = 1i64 << 20;
    let block = P::D(vec![
        ("address", P::I(base)),
        ("size", P::I(2 * mib)),
        ("requested_size", P::I(mib)),
        ("state", P::S("active_allocated")),
    ]);
    let seg = P::D(vec![
        ("device", P::I(0)),
        ("address", P::I(base)),
        ("total_size", P::I(2 * mib)),
        ("stream", P::I(0)),
        ("blocks", P::L(vec![block])),
    ]);
    let snap = P::D(vec![
        ("segments", P::L(vec![seg])),
        ("device_traces", P::L(vec![P::L(vec![])])),
    ]);
    let mut bytes = vec![0x80, 2];
    pickle(&snap, &mut bytes);
    bytes.push(b'.');
    let path = dir.join("nohistory.pickle");
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_snapshot_without_history_says_so_and_shows_the_fix() {
    let dir = tmpdir("nohistory");
    let snap = snapshot_without_history(&dir);
    let snap = snap.to_str().unwrap();
    for args in [
        vec!["replay", snap],
        vec!["summary", snap],
        vec!["compare", snap, "--policies", "native"],
    ] {
        let o = run(&args);
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("no events were recorded"), "{args:?}: {e}");
        assert!(
            e.contains("torch.cuda.memory._record_memory_history(")
                && e.contains("torch.cuda.memory._dump_snapshot("),
            "{args:?}: {e}"
        );
        assert!(!e.contains("reader warnings"), "the text, not a count: {e}");
    }
}

// ---- 4. Sizes mean what they say ----

#[test]
fn decimal_units_are_decimal_and_binary_units_binary() {
    let cap = |size: &str| -> u64 {
        let out = ok(&[
            "compare",
            "frag-adversary",
            "--policies",
            "native",
            "--capacity",
            size,
            "--json",
            "-",
        ]);
        let doc: Value = serde_json::from_str(&out).unwrap();
        doc["traces"][0]["tight_capacity_bytes"].as_u64().unwrap()
    };
    let gran = 2u64 << 20;
    let up = |b: u64| b.div_ceil(gran) * gran;
    assert_eq!(cap("24GB"), up(24_000_000_000));
    assert_eq!(cap("24GiB"), 24 << 30);
    assert_eq!(cap("24Gi"), 24 << 30);
    assert_ne!(cap("24GB"), cap("24GiB"));
    // Ambiguous and negative sizes: our error, with the fix.
    let e = fails(&["replay", "frag-adversary", "--capacity", "12G"]);
    assert!(
        e.contains("ambiguous") && e.contains("12GiB") && e.contains("12GB"),
        "{e}"
    );
    let e = fails(&["replay", "frag-adversary", "--capacity", "-5GiB"]);
    assert!(e.contains("negative"), "{e}");
    assert!(
        !e.contains("tip:") && !e.contains("unexpected argument"),
        "not clap's: {e}"
    );
    let e = fails(&["compare", "frag-adversary", "--capacity", "-5GiB"]);
    assert!(e.contains("negative"), "{e}");
    let e = fails(&["replay", "frag-adversary", "--capacity", "12 parsecs"]);
    assert!(e.contains("GiB") && e.contains("GB"), "{e}");
}

#[test]
fn capacity_rounding_is_stated() {
    let text = ok(&[
        "replay",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "3MiB",
    ]);
    assert!(text.contains("on a 4.00 MiB simulated device"), "{text}");
    assert!(
        text.contains("rounded up to 4.00 MiB") && text.contains("granularity"),
        "{text}"
    );
    let o = run(&[
        "summary",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "3MiB",
    ]);
    assert!(
        stderr(&o).contains("rounded up to 4.00 MiB"),
        "{}",
        stderr(&o)
    );
    // No note when nothing was rounded.
    let text = ok(&[
        "replay",
        "frag-adversary",
        "--policy",
        "native",
        "--capacity",
        "4MiB",
    ]);
    assert!(!text.contains("rounded"), "{text}");
}

// ---- Paper cuts ----

#[test]
fn the_builtin_snapshot_replays_by_name() {
    let text = ok(&["replay", "cs336_lm_step", "--policy", "native"]);
    assert!(text.starts_with("cs336_lm_step device 0"), "{text}");
    assert_eq!(row(&text, "result"), "ok");
    let e = fails(&["replay", "cs336_lm_stepp"]);
    assert!(
        e.contains("cs336_lm_step"),
        "the error names the built-in: {e}"
    );
}

#[test]
fn workloads_lists_defaults() {
    let text = ok(&["workloads"]);
    assert!(text.contains("(default "), "{text}");
    assert!(
        text.contains("cs336_lm_step"),
        "the built-in snapshot is listed: {text}"
    );
}

#[test]
fn compare_capacity_and_tight_factor() {
    let json = |extra: &[&str]| -> Value {
        let args = [
            &[
                "compare",
                "frag-adversary",
                "--policies",
                "native",
                "--json",
                "-",
            ][..],
            extra,
        ]
        .concat();
        serde_json::from_str(&ok(&args)).unwrap()
    };
    let d = json(&[]);
    let peak = d["traces"][0]["peak_live_bytes"].as_u64().unwrap();
    let gran = 2u64 << 20;
    let up = |b: u64| b.div_ceil(gran) * gran;
    let t = |d: &Value| d["traces"][0]["tight_capacity_bytes"].as_u64().unwrap();
    assert_eq!(t(&d), up((peak as f64 * 1.05).ceil() as u64));
    assert_eq!(d["tight_capacity"]["factor"], 1.05);
    let d = json(&["--tight-factor", "1.5"]);
    assert_eq!(t(&d), up((peak as f64 * 1.5).ceil() as u64));
    assert_eq!(d["tight_capacity"]["rule"], "factor");
    let d = json(&["--capacity", "64GiB"]);
    assert_eq!(t(&d), 64 << 30);
    assert_eq!(
        d["traces"][0]["policies"]["native"]["tight"]["capacity_bytes"],
        64u64 << 30
    );
    assert_eq!(d["tight_capacity"]["rule"], "fixed");
    // A card too small: the tight columns say so.
    let text = ok(&[
        "compare",
        "frag-adversary",
        "--policies",
        "native",
        "--capacity",
        "8GiB",
    ]);
    assert!(text.contains("no ("), "{text}");
    assert!(text.contains("8.00 GiB (--capacity)"), "{text}");
    let e = fails(&["compare", "frag-adversary", "--tight-factor", "0.5"]);
    assert!(e.contains("--tight-factor"), "{e}");
    fails(&[
        "compare",
        "frag-adversary",
        "--tight-factor",
        "1.5",
        "--capacity",
        "8GiB",
    ]);
}

#[test]
fn compare_json_records_tool_cost_model_granularity_and_inputs() {
    let dir = tmpdir("meta");
    let snap = snapshot_without_history(&dir);
    let snap = snap.to_str().unwrap();
    let out = ok(&[
        "compare",
        snap,
        "frag-adversary:seed=3",
        "--policies",
        "native",
        "--granularity-mb",
        "4",
        "--json",
        "-",
    ]);
    let d: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(d["tool"]["name"], "vmmalloc");
    assert_eq!(d["tool"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(d["cost_model"], "h200");
    assert!(d["cost_model_us"]["create"]["fixed_us"].as_f64().unwrap() > 0.0);
    assert_eq!(d["granularity_bytes"], 4u64 << 20);
    let inputs = d["inputs"].as_array().unwrap();
    assert_eq!(inputs.len(), 2);
    let len = std::fs::metadata(snap).unwrap().len();
    assert_eq!(inputs[0]["bytes"], len);
    assert_eq!(inputs[0]["fnv1a64"].as_str().unwrap().len(), 16);
    assert_eq!(inputs[1]["workload"], "frag-adversary:seed=3");
}

// ---- 7. bench is hard to misread ----

#[test]
fn bench_refuses_too_few_iterations_and_says_what_it_measures() {
    let e = fails(&["bench", "--iters", "1000"]);
    assert!(
        e.contains("--iters 1000 is too few") && e.contains("10000"),
        "{e}"
    );
    // The notes are wrapped to 100 columns: read them as one paragraph.
    let text = ok(&[
        "bench",
        "--iters",
        "10000",
        "--rounds",
        "1",
        "--policies",
        "expandable,native",
    ])
    .replace('\n', " ");
    assert!(
        text.contains("pair time expandable / native:")
            && text.contains("expandable's median pair takes"),
        "each ratio says what it divides: {text}"
    );
    assert!(text.contains("2t / 1t = pairs/s with 2 threads"), "{text}");
    assert!(
        text.contains("on `sim` a driver call costs no time") && text.contains("native"),
        "{text}"
    );
    let out = ok(&[
        "bench",
        "--iters",
        "10000",
        "--rounds",
        "1",
        "--policies",
        "caching",
        "--json",
        "-",
    ]);
    let d: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(d["iters"], 10000);
    assert_eq!(d["rounds"], 1);
    assert!(d["policies"]["caching"]["pair_ns_median"].as_f64().unwrap() > 0.0);
}
