//! End-to-end tests of `vmmalloc compare` and `vmmalloc replay` on small inputs.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

mod common;
use common::{run_ok, tmpdir};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vmmalloc"))
}

/// A small text trace with two streams and a pre-trace allocation (sizes in MiB).
fn small_trace(dir: &std::path::Path) -> PathBuf {
    let mib = 1u64 << 20;
    let mut s = String::from("vmmalloc-trace 1\nname small\ndevice 0\n");
    s.push_str(&format!("pre 0x100000000 {} 0\n", 8 * mib));
    let mut addr = 0x200000000u64;
    let mut live = Vec::new();
    for i in 0..40u64 {
        let size = (1 + (i * 7) % 13) * mib + 4096 * i;
        let stream = if i % 3 == 0 { 7 } else { 0 };
        s.push_str(&format!("alloc {addr:#x} {size} {stream} {}\n", i * 10));
        live.push(addr);
        addr += 64 * mib;
        if i % 2 == 1 {
            let a = live.remove(0);
            s.push_str(&format!("free {a:#x}\n"));
        }
    }
    let path = dir.join("small.trace");
    std::fs::write(&path, s).unwrap();
    path
}

#[test]
fn compare_json_matches_the_schema() {
    let dir = tmpdir("json");
    let trace = small_trace(&dir);
    let out = run_ok(&[
        "compare",
        trace.to_str().unwrap(),
        "--policies",
        "expandable,caching,torch-es,native",
        "--json",
        "-",
    ]);
    let v: Value =
        serde_json::from_slice(&out.stdout).expect("stdout is exactly the JSON document");
    assert_eq!(v["version"], 2, "version 2: syncs count every cuMemFree");
    assert_eq!(v["cost_model"], "h200", "the default preset");
    assert_eq!(v["second_cost_model"], "a100", "priced beside it");
    let traces = v["traces"].as_array().unwrap();
    assert_eq!(traces.len(), 1);
    let t = &traces[0];
    let keys: Vec<&str> = t.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    let mut expected = vec![
        "name",
        "device",
        "events",
        "allocs",
        "pre_trace_live_bytes",
        "peak_live_bytes",
        "policies",
        "reader_warnings",
        "tight_capacity_bytes",
    ];
    expected.sort();
    let mut got = keys.clone();
    got.sort();
    assert_eq!(got, expected);
    assert_eq!(t["name"], "small");
    assert_eq!(t["pre_trace_live_bytes"], 8u64 << 20);
    assert!(t["peak_live_bytes"].as_u64().unwrap() > 8 << 20);
    let pols = t["policies"].as_object().unwrap();
    assert_eq!(pols.len(), 4);
    for (name, p) in pols {
        let mut k: Vec<&String> = p.as_object().unwrap().keys().collect();
        k.sort();
        assert_eq!(
            k,
            ["min_capacity_bytes", "overhead", "tight", "unlimited"],
            "{name}"
        );
        let mut tk: Vec<&String> = p["tight"].as_object().unwrap().keys().collect();
        tk.sort();
        assert_eq!(
            tk,
            [
                "capacity_bytes",
                "device_syncs",
                "driver_calls",
                "modeled_driver_us",
                "modeled_driver_us_second",
                "ok",
                "ooms",
                "region_copied_bytes",
                "region_copies",
                "retries",
                "steady",
                "stream_syncs",
                "syncs"
            ],
            "{name}"
        );
        let mut uk: Vec<&String> = p["unlimited"].as_object().unwrap().keys().collect();
        uk.sort();
        assert_eq!(
            uk,
            [
                "driver_calls",
                "modeled_driver_us",
                "modeled_driver_us_second",
                "peak_reserved_bytes",
                "steady"
            ],
            "{name}"
        );
        for side in ["tight", "unlimited"] {
            let st = &p[side]["steady"];
            let mut sk: Vec<&String> = st.as_object().unwrap().keys().collect();
            sk.sort();
            assert_eq!(
                sk,
                [
                    "device_syncs",
                    "driver_calls",
                    "modeled_driver_us",
                    "modeled_driver_us_second",
                    "ooms",
                    "stream_syncs",
                    "syncs"
                ],
                "{name} {side}"
            );
            assert!(st["modeled_driver_us"].as_f64().unwrap() >= 0.0);
            assert!(p[side]["modeled_driver_us_second"].as_f64().unwrap() > 0.0);
        }
        if name == "expandable" || name == "torch-es" {
            // Segments that only grow: on an unlimited device, the second pass
            // reuses what the first mapped. (The caching replica may split its
            // cached segments differently in the second pass and allocate anew.)
            let st = &p["unlimited"]["steady"];
            assert_eq!(st["modeled_driver_us"].as_f64().unwrap(), 0.0, "{name}");
            assert_eq!(st["driver_calls"], serde_json::json!({}), "{name}");
        }
        let peak = t["peak_live_bytes"].as_u64().unwrap();
        let tight = p["tight"]["capacity_bytes"].as_u64().unwrap();
        assert_eq!(tight % (2 << 20), 0);
        assert!(
            tight as f64 >= peak as f64 * 1.05
                && (tight as f64) < peak as f64 * 1.05 + (2u64 << 20) as f64
        );
        if let Some(min) = p["min_capacity_bytes"].as_u64() {
            assert!(min >= peak, "{name}: min capacity below peak live");
            let o = p["overhead"].as_f64().unwrap();
            assert!((o - min as f64 / peak as f64).abs() < 1e-9);
        }
        assert!(
            p["unlimited"]["peak_reserved_bytes"].as_u64().unwrap() >= peak,
            "{name}"
        );
    }
    // native makes one alloc per request: its overhead is exactly the rounding.
    assert!(pols["native"]["overhead"].as_f64().unwrap() < 1.02);
}

#[test]
fn compare_writes_report_and_plots() {
    let dir = tmpdir("report");
    let trace = small_trace(&dir);
    let out_dir = dir.join("out");
    let out = run_ok(&[
        "compare",
        trace.to_str().unwrap(),
        "--policies",
        "native,expandable",
        "--out",
        out_dir.to_str().unwrap(),
        "--json",
        out_dir.join("results.json").to_str().unwrap(),
    ]);
    // The JSON goes into the report's directory, created on the way.
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("results.json")).unwrap())
            .unwrap();
    assert_eq!(json["version"], 2);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("overhead") && table.contains("native") && table.contains("small"),
        "{table}"
    );
    let md = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(md.contains("| native |") && md.contains("overhead.svg"));
    for f in ["overhead.svg", "memory-small-d0.svg"] {
        let svg = std::fs::read_to_string(out_dir.join(f)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{f}");
    }
    // Piped: no progress bar escape codes on stderr.
    assert!(!String::from_utf8_lossy(&out.stderr).contains('\u{1b}'));
}

#[test]
fn replay_prints_stats_and_reports_oom() {
    let dir = tmpdir("replay");
    let trace = small_trace(&dir);
    let ok = bin()
        .args([
            "replay",
            trace.to_str().unwrap(),
            "--policy",
            "native",
            "--capacity",
            "4GiB",
        ])
        .output()
        .unwrap();
    assert!(ok.status.success());
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(
        text.contains("result") && text.contains("ok") && text.contains("cuMemAlloc_v2"),
        "{text}"
    );
    let tight = bin()
        .args([
            "replay",
            trace.to_str().unwrap(),
            "--policy",
            "native",
            "--capacity",
            "16MiB",
        ])
        .output()
        .unwrap();
    assert!(tight.status.success());
    let text = String::from_utf8_lossy(&tight.stdout);
    assert!(text.contains("out-of-memory"), "{text}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tmpdir("bad");
    let junk = dir.join("junk.pickle");
    std::fs::write(&junk, b"\x80\x04\x95garbage").unwrap();
    for args in [
        vec!["compare", junk.to_str().unwrap()],
        vec!["compare", "no-such-workload"],
        vec!["compare", "train-varlen", "--policies", "bogus"],
        vec!["replay", "frag-adversary", "--capacity", "lots"],
    ] {
        let out = bin().args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains("Error"), "{args:?}: {err}");
    }
}

/// `modeled_driver_us` of every policy at the tight capacity, and the `cost_model` label.
fn modeled(args: &[&str]) -> (Vec<f64>, String) {
    let out = bin().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let us = v["traces"][0]["policies"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p["tight"]["modeled_driver_us"].as_f64().unwrap())
        .collect();
    (us, v["cost_model"].as_str().unwrap().to_string())
}

#[test]
fn cost_presets_files_and_overrides_select_the_model() {
    let dir = tmpdir("cost");
    let trace = small_trace(&dir);
    let t = trace.to_str().unwrap();
    let base = [
        "compare",
        t,
        "--policies",
        "expandable,native",
        "--json",
        "-",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        modeled(&a)
    };
    let (h200, label) = with(&[]);
    assert_eq!(label, "h200");
    assert_eq!(with(&["--cost", "h200"]).0, h200);
    let (a100, label) = with(&["--cost", "a100"]);
    assert_eq!(label, "a100");
    assert_ne!(a100, h200, "the presets price the same calls differently");
    let (linear, label) = with(&["--cost", "linear"]);
    assert_eq!(label, "linear");
    assert_ne!(linear, a100, "the presets price the same calls differently");
    // A file holding the linear preset prices exactly as --cost linear.
    let file = dir.join("linear.json");
    let mut costs = serde_json::Map::new();
    for (kind, fixed, per_mib) in [
        ("reserve", 20.0, 0.0),
        ("address_free", 20.0, 0.0),
        ("create", 0.0, 25.0),
        ("map", 1.5, 0.0),
        ("set_access", 30.0, 0.0),
        ("unmap", 20.0, 0.0),
        ("release", 20.0, 0.0),
        ("alloc", 100.0, 0.0),
        ("free", 50.0, 0.0),
        ("sync", 50.0, 0.0),
        ("other", 0.0, 0.0),
    ] {
        costs.insert(
            kind.into(),
            serde_json::json!({"fixed_us": fixed, "per_mib_us": per_mib, "per_handle_us": 0.0}),
        );
    }
    let doc = serde_json::json!({"name": "linear copy", "costs_us": costs});
    std::fs::write(&file, doc.to_string()).unwrap();
    let (from_file, label) = with(&["--cost-file", file.to_str().unwrap()]);
    assert_eq!(from_file, linear);
    assert_eq!(label, file.to_str().unwrap());
    // Overrides apply on top of a preset: free sync makes native cheaper.
    let (cheap, label) = with(&["--cost", "linear,free=0"]);
    assert_eq!(label, "linear + free=0");
    assert!(cheap[1] < linear[1], "{cheap:?} vs {linear:?}");

    // Bad input: an error naming the preset, file or key, never a panic.
    let mut missing = doc.clone();
    missing["costs_us"].as_object_mut().unwrap().remove("unmap");
    let missing_file = dir.join("missing.json");
    std::fs::write(&missing_file, missing.to_string()).unwrap();
    let mut negative = doc.clone();
    negative["costs_us"]["map"]["fixed_us"] = serde_json::json!(-2.0);
    let negative_file = dir.join("negative.json");
    std::fs::write(&negative_file, negative.to_string()).unwrap();
    let malformed_file = dir.join("malformed.json");
    std::fs::write(&malformed_file, "{\"costs_us\": ").unwrap();
    let nowhere = dir.join("nowhere.json");
    for (extra, needles) in [
        (vec!["--cost", "h100"], vec!["h100", "h200, a100, linear"]),
        (vec!["--cost", "linear,bogus=1"], vec!["bogus"]),
        (
            vec!["--cost-file", missing_file.to_str().unwrap()],
            vec!["missing.json", "costs_us.unmap"],
        ),
        (
            vec!["--cost-file", negative_file.to_str().unwrap()],
            vec!["negative.json", "costs_us.map.fixed_us"],
        ),
        (
            vec!["--cost-file", malformed_file.to_str().unwrap()],
            vec!["malformed.json", "JSON"],
        ),
        (
            vec!["--cost-file", nowhere.to_str().unwrap()],
            vec!["nowhere.json"],
        ),
        (
            vec!["--cost", "linear", "--cost-file", file.to_str().unwrap()],
            vec!["linear", "linear.json"],
        ),
    ] {
        let mut a = base.to_vec();
        a.extend_from_slice(&extra);
        let out = bin().args(&a).output().unwrap();
        assert!(!out.status.success(), "{extra:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{extra:?}: `{n}` not in {err}");
        }
    }
    // replay takes the same options.
    let out = bin()
        .args(["replay", t, "--policy", "native", "--cost", "v100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("v100"));
}

#[test]
fn policy_options_label_rows_and_feed_the_ablation() {
    let dir = tmpdir("ablation");
    let trace = small_trace(&dir);
    let out_dir = dir.join("out");
    let out = run_ok(&[
        "compare",
        trace.to_str().unwrap(),
        "--policies",
        "expandable,expandable:max_chunk=20MiB,page_size=4MiB,caching:max_split_size_mb=64",
        "--json",
        "-",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let pols = v["traces"][0]["policies"].as_object().unwrap();
    let mut names: Vec<&String> = pols.keys().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "caching:max_split_size_mb=64",
            "expandable",
            "expandable:max_chunk=20MiB,page_size=4MiB"
        ]
    );
    // 4 MiB pages: a different policy configuration, different calls.
    assert_ne!(
        pols["expandable"]["tight"]["driver_calls"],
        pols["expandable:max_chunk=20MiB,page_size=4MiB"]["tight"]["driver_calls"]
    );
    let md = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(md.contains("## Ablation: expandable options"), "{md}");
    assert!(md.contains("| max_chunk=20MiB,page_size=4MiB |"), "{md}");
    assert!(md.contains("| default |"), "{md}");
    assert!(!md.contains("Ablation: caching"), "caching appears once");

    for (spec, needle) in [
        ("expandable:max_chunks=2MiB", "max_chunks"),
        ("expandable:max_chunk=huge", "max_chunk"),
        ("native:max_chunk=2MiB", "max_chunk"),
    ] {
        let out = bin()
            .args(["compare", "frag-adversary", "--policies", spec])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{spec}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle) && !err.contains("panicked"),
            "{spec}: {err}"
        );
    }
}

#[test]
fn replay_steady_prints_the_second_pass() {
    let dir = tmpdir("steady");
    let trace = small_trace(&dir);
    let out = run_ok(&[
        "replay",
        trace.to_str().unwrap(),
        "--policy",
        "expandable:max_chunk=20MiB",
        "--steady",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("steady state (2nd pass): ok") && text.contains("0 memory calls"),
        "{text}"
    );
}

#[test]
fn compare_report_shows_sleep_per_phase_for_rl_colocate() {
    let dir = tmpdir("sleep");
    let spec = "rl-colocate:iterations=1,params_m=200,layers=4,kv_cache_mb=1024,gen_steps=4,micro_batches=2,act_mb=16";
    let out = run_ok(&[
        "compare",
        spec,
        "--policies",
        "expandable,caching",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    for text in [&*stdout, &md, &html] {
        assert!(text.contains("without sleep"), "{text}");
        // Only expandable can sleep; the others say so instead of a number.
        let phase_row = |l: &&str, policy: &str| {
            l.starts_with(policy) && (l.contains(" generate ") || l.contains(" train "))
        };
        let caching: Vec<&str> = text.lines().filter(|l| phase_row(l, "caching ")).collect();
        assert!(
            caching.len() >= 2 && caching.iter().all(|l| l.contains("cannot sleep")),
            "{text}"
        );
        let exp: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("expandable ") && l.contains("generate"))
            .collect();
        assert!(
            !exp.is_empty() && !exp[0].contains("cannot sleep"),
            "{text}"
        );
    }
    assert!(md.contains("## Sleep and wake"), "{md}");
}

#[test]
fn the_notes_define_every_column_and_the_unlimited_device() {
    let out = common::ok(&[
        "compare",
        "frag-adversary:rounds=1",
        "--policies",
        "expandable,native",
    ]);
    let text = out.split_whitespace().collect::<Vec<_>>().join(" ");
    for (column, legend) in [
        (
            "min cap GiB",
            "min cap = the smallest device on which the policy replays the trace",
        ),
        (
            "calls",
            "calls = driver memory calls (reserve, create, map,",
        ),
        (
            "driver ms",
            "tight: the device the calls, driver ms and syncs were measured on",
        ),
        ("syncs", "syncs = stream/event waits"),
    ] {
        assert!(
            out.contains(column) && text.contains(legend),
            "{legend}: {out}"
        );
    }
    assert!(
        text.contains("unlimited = a device of 8 x peak live, at least 80 GiB"),
        "{out}"
    );
}
