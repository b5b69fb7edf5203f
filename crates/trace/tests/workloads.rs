//! Generated workloads: determinism by seed, sanity of sizes, streams and frees.

use std::time::Instant;

use vmmalloc_trace::workloads::{workload_by_name, workload_params, WORKLOADS};
use vmmalloc_trace::{text, EventKind, Op, Trace};

const GIB: u64 = 1 << 30;

fn summary(t: &Trace) -> String {
    let d = &t.devices[0];
    format!(
        "{}: {} events, {} allocs, peak live {} ({:.2} GiB), streams {:?}",
        t.name,
        d.events().len(),
        d.allocs(),
        d.peak_live_bytes(),
        d.peak_live_bytes() as f64 / GIB as f64,
        d.streams()
    )
}

#[test]
fn same_seed_same_trace_other_seed_other_trace() {
    for w in WORKLOADS {
        let a = workload_by_name(w).unwrap();
        let b = workload_by_name(w).unwrap();
        assert_eq!(a, b, "{w}");
        let c = workload_by_name(&format!("{w}:seed=7")).unwrap();
        assert_ne!(a.devices[0].events(), c.devices[0].events(), "{w}");
        assert_eq!(c.name, format!("{w}:seed=7"));
    }
}

#[test]
fn defaults_are_realistic_and_consistent() {
    // (name, min peak live, max peak live, min streams)
    let expect = [
        ("train-varlen", 20 * GIB, 60 * GIB, 3),
        ("serve-kv", 18 * GIB, 60 * GIB, 2),
        ("frag-adversary", 10 * GIB, 60 * GIB, 1),
    ];
    for (w, lo, hi, streams) in expect {
        let start = Instant::now();
        let t = workload_by_name(w).unwrap();
        let took = start.elapsed();
        println!("{} (generated in {took:?})", summary(&t));
        let d = &t.devices[0];
        assert!(
            d.peak_live_bytes() >= lo && d.peak_live_bytes() <= hi,
            "{}",
            summary(&t)
        );
        assert!(d.streams().len() >= streams, "{}", summary(&t));
        assert!(
            (5_000..=100_000).contains(&d.events().len()),
            "{}",
            summary(&t)
        );
        assert!(d.pre_trace().is_empty());
        // Every free names a live id (also checked on build); ids are dense.
        let mut live = vec![false; d.num_ids() as usize];
        for op in d.replay_ops() {
            match *op {
                Op::Alloc { id, size, .. } => {
                    assert!(!live[id as usize] && size > 0);
                    live[id as usize] = true;
                }
                Op::Free { id } => {
                    assert!(live[id as usize], "free of unknown id {id} in {w}");
                    live[id as usize] = false;
                }
                Op::Reserve { id, .. } => {
                    assert!(!live[id as usize]);
                    live[id as usize] = true;
                }
                Op::Resize { id, .. } => assert!(live[id as usize], "resize of unknown id {id}"),
            }
        }
        assert!(d
            .events()
            .iter()
            .all(|e| matches!(e.kind, EventKind::Alloc | EventKind::Free)));
    }
}

#[test]
fn overrides_change_the_trace() {
    let small = workload_by_name("train-varlen:steps=2,layers=4,len_max=256").unwrap();
    let ckpt =
        workload_by_name("train-varlen:steps=2,layers=4,len_max=256,checkpointing=true").unwrap();
    assert!(ckpt.devices[0].peak_live_bytes() < small.devices[0].peak_live_bytes());
    assert!(small.devices[0].events().len() < 3_000);
    let kv = workload_by_name("serve-kv:steps=100,max_running=4").unwrap();
    assert!(kv.devices[0].events().len() < 2_000);
    let frag = workload_by_name("frag-adversary:rounds=1,blocks=10,align_kb=1").unwrap();
    assert!(frag.devices[0]
        .replay_ops()
        .iter()
        .any(|op| matches!(op, Op::Alloc { size, .. } if size % (2 << 20) != 0)));
}

#[test]
fn out_of_range_values_name_the_key() {
    for (spec, key) in [
        ("train-varlen:steps=0", "steps"),
        ("train-varlen:len_min=100,len_max=50", "len_max"),
        ("train-varlen:len_max=100000000", "len_max"),
        ("serve-kv:chunk_min=64,chunk_max=16", "chunk_max"),
        ("serve-kv:arrival_rate=-1", "arrival_rate"),
        ("frag-adversary:big_min_mb=8", "big_min_mb"),
        ("frag-adversary:align_kb=0", "align_kb"),
    ] {
        let e = workload_by_name(spec).unwrap_err().to_string();
        assert!(e.contains(&format!("`{key}`")), "{spec}: {e}");
    }
}

#[test]
fn workloads_survive_the_text_format() {
    for w in WORKLOADS {
        let t = workload_by_name(&format!("{w}:seed=3")).unwrap();
        let back = text::parse_text(&text::to_text(&t), "x").unwrap();
        assert_eq!(back, t, "{w}");
    }
    assert!(workload_params("serve-kv").unwrap().len() > 10);
}

/// `serve-kv:growable=1`: the same requests, each cache a growable region.
/// A policy with regions grows them in place (no copy, the address kept);
/// the others reallocate and copy, and need more memory at their peak.
#[test]
fn serve_kv_growable_grows_in_place_only_where_the_policy_can() {
    use vmmalloc_alloc::Policy;
    use vmmalloc_trace::replay::{replay, ReplayConfig};
    let spec = "serve-kv:steps=150,arrival_rate=0.5,layers=4,hidden=512,ffn=1024,vocab=4000,kv_heads=4,head_dim=64,max_running=16";
    let plain = workload_by_name(spec).unwrap();
    let grow = workload_by_name(&format!("{spec},growable=1")).unwrap();
    let (p, g) = (&plain.devices[0], &grow.devices[0]);
    assert!(g.events().iter().any(|e| e.kind == EventKind::Resize));
    assert!(
        g.peak_live_bytes() < p.peak_live_bytes(),
        "no old+new copy at once: {} < {}",
        g.peak_live_bytes(),
        p.peak_live_bytes()
    );
    let capacity = 4 * p.peak_live_bytes();
    let run = |policy, ops: &[Op]| {
        let mut c = ReplayConfig::new(policy, capacity);
        c.validate_every = 97;
        let r = replay(ops, &c);
        assert!(r.ok, "{policy}: {:?} {:?}", r.error, r.oom_message);
        r
    };
    let e = run(Policy::Expandable, g.replay_ops());
    assert_eq!(e.region_copies, 0);
    assert_eq!(e.peak_live, g.peak_live_bytes());
    let c = run(Policy::Caching, g.replay_ops());
    assert!(c.region_copies > 0 && c.region_copied_bytes > 0);
    assert_eq!(
        c.peak_live,
        p.peak_live_bytes(),
        "reallocation = the plain trace"
    );
    // The text format carries the region events.
    let back = text::parse_text(&text::to_text(&grow), "x").unwrap();
    assert_eq!(back.devices[0].replay_ops(), g.replay_ops());
    // Without regions the growable trace costs what the plain one does.
    let cp = run(Policy::Caching, p.replay_ops());
    assert_eq!(cp.peak_live, c.peak_live);
}

/// Spill (docs/expandable.md, "Spill and pressure"): a trace that needs 1.2×
/// the device memory replays on `sim` with `expandable:spill=1`, the spilled
/// bytes reported; without spill it fails with the usual explanation.
#[test]
fn a_trace_needing_1_2x_the_device_completes_with_spill_only() {
    use vmmalloc_alloc::{Policy, PolicySpec};
    use vmmalloc_trace::replay::{replay_keeping, ReplayConfig};
    let t = workload_by_name("train-varlen:steps=6").unwrap();
    let d = &t.devices[0];
    let capacity = (d.peak_live_bytes() as f64 / 1.2) as u64 / (2 << 20) * (2 << 20);
    let run = |spec: &str| {
        let spec: PolicySpec = spec.parse().unwrap();
        let mut c = ReplayConfig::new(Policy::Expandable, capacity);
        c.options = spec.options;
        c.stop_at_oom = true;
        replay_keeping(d.replay_ops(), &c)
    };
    let plain = run("expandable");
    assert!(!plain.result.ok);
    let msg = plain.result.oom_message.clone().unwrap();
    assert!(msg.contains("lacking"), "{msg}");
    let spilled = run("expandable:spill=1");
    assert!(spilled.result.ok, "{:?}", spilled.result.oom_message);
    let st = spilled.allocator.as_ref().unwrap().stats();
    assert!(
        st.spilled_bytes_peak as f64 >= 0.15 * d.peak_live_bytes() as f64,
        "spilled at most {} of {}",
        st.spilled_bytes_peak,
        d.peak_live_bytes()
    );
    spilled.allocator.as_ref().unwrap().validate().unwrap();
}

#[test]
fn every_parameter_is_bounded_and_a_value_past_its_bound_is_refused_naming_it() {
    use vmmalloc_trace::workloads::workload_bounds;
    for w in WORKLOADS {
        for (key, bound) in workload_bounds(w).unwrap() {
            // Seeds and flags take any value of their type.
            let Some(bound) = bound else {
                assert!(
                    key == "seed" || key == "checkpointing",
                    "{w}:{key} has no bound"
                );
                continue;
            };
            let hi = bound.split("..=").nth(1).unwrap();
            let past = match hi.parse::<u64>() {
                Ok(n) => (n + 1).to_string(),
                Err(_) => format!("{}", hi.parse::<f64>().unwrap() * 2.0),
            };
            let spec = format!("{w}:{key}={past}");
            let started = Instant::now();
            let e = workload_by_name(&spec).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{key}`")) && e.contains(&format!("must be in {bound}")),
                "{spec}: {e}"
            );
            assert!(
                started.elapsed().as_secs() < 5,
                "{spec}: refused only after generating"
            );
        }
    }
    // The examples: refused up front, naming the bound.
    let e = workload_by_name("serve-kv:steps=4000000000")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`steps`") && e.contains("1..=1000000"), "{e}");
    let e = workload_by_name("train-varlen:layers=100000")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`layers`") && e.contains("1..=1000"), "{e}");
    let e = workload_by_name("train-varlen:hidden=1000000000")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`hidden`") && !e.contains("len_max"), "{e}");
}

#[test]
fn a_tensor_past_2_50_bytes_names_itself_and_the_parameter_at_fault() {
    // Each value within its bounds, the product not.
    let e = workload_by_name("train-varlen:batch=4096,heads=1024,len_max=1048576")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad value `4096` for `batch`") && e.contains("the attention scores"),
        "{e}"
    );
    let e = workload_by_name(
        "train-varlen:batch=4096,heads=1,act_bytes=1,len_max=131072,vocab=1048576",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("the logits") && e.contains("`batch`"), "{e}");
    let e = workload_by_name(
        "serve-kv:prompt_max=1048576,output_max=1048576,layers=1000,kv_heads=1024,head_dim=4096",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("KV cache") && e.contains("`output_max`"), "{e}");
}

#[test]
fn a_generator_stops_at_the_event_bound_and_says_so() {
    use vmmalloc_trace::workloads::MAX_EVENTS;
    // Every parameter within bounds; the trace would pass the event bound.
    let spec = "frag-adversary:rounds=1000,blocks=200000";
    let e = workload_by_name(spec).unwrap_err().to_string();
    assert!(
        e.contains("`rounds`") && e.contains(&format!("more than {MAX_EVENTS} events")),
        "{e}"
    );
}
