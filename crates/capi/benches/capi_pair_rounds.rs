//! `cargo bench -p vmmalloc-capi --bench capi_pair_rounds`: the same three
//! cache-hit malloc + free pairs as `capi_pair` (the policy itself,
//! `vmmalloc_try_malloc`, the C++ shim's `vmmalloc_malloc`; each + free),
//! measured in interleaved rounds so that their ratio survives a shared,
//! noisy machine: each round times a batch of pairs of every variant back to
//! back (in an order that rotates from round to round), and the report gives
//! each variant's median over the rounds and the median of the per-round
//! ratios to the policy. Criterion (`capi_pair`) measures one variant after
//! the other, so a load change between them moves the ratio.
//!
//! Options (after `--`): `--rounds N` (default 21), `--pairs N` per batch
//! (default 200000), `--only NAME` (one variant: for a profiler, e.g.
//! `valgrind --tool=callgrind`, whose instruction counts are immune to the
//! machine's load). `cargo test -p vmmalloc-capi --bench capi_pair_rounds`
//! runs one small round (checks the bench still works).

use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;
use std::time::Instant;
use vmmalloc::config::MODEL_GRANULARITY;
use vmmalloc::*;
use vmmalloc_alloc::{Allocator, Stream};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::Device;

// The C++ shim's entry point (crates/capi/src/shim.cpp), linked from this
// crate's static library. A cache hit never throws.
extern "C-unwind" {
    fn vmmalloc_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void;
}

/// The configuration of every variant: the default expandable policy over a
/// 1 GiB host device (as `capi_pair`).
const CONF: &str = "device:host,capacity_gb:1,log:off,backend:expandable";

/// Request sizes, cycled: small-pool and large-pool blocks of 512 B – 3 MiB.
const SIZES: [usize; 8] = [
    512,
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    (1 << 20) + 512,
    2 << 20,
    3 << 20,
];

/// The variants, in report order.
const NAMES: [&str; 3] = ["policy", "try_malloc", "malloc"];

/// The policy allocator the C ABI builds for `CONF`, built directly.
fn policy() -> Box<dyn Allocator> {
    let config = Config::parse(CONF).expect("CONF parses");
    let device: Arc<dyn Device> = Arc::new(
        HostDevice::new(HostConfig {
            name: "host0".into(),
            capacity: config.model_capacity(),
            granularity: MODEL_GRANULARITY,
            ordinal: 0,
        })
        .expect("host device"),
    );
    let options = config.policy_options().expect("options");
    vmmalloc_alloc::build(config.effective_policy(), device, &options).expect("allocator")
}

fn try_malloc(size: usize) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write; the stream is the default one.
    let rc = unsafe { vmmalloc_try_malloc(size, 0, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc, VMMALLOC_OK, "cache-hit malloc of {size}");
    out
}

fn shim_malloc(size: usize) -> *mut c_void {
    // SAFETY: the shim's contract: any size, a valid ordinal, a stream
    // (NULL: the default); it throws only on failure, which a cache hit of
    // a configured host device is not.
    let p = unsafe { vmmalloc_malloc(size, 0, std::ptr::null_mut()) };
    assert!(!p.is_null(), "cache-hit malloc of {size}");
    p
}

/// Times `pairs` pairs of variant `v`; returns nanoseconds per pair.
fn batch(v: usize, a: &dyn Allocator, pairs: usize) -> f64 {
    let t = Instant::now();
    for i in 0..pairs {
        let s = SIZES[i % SIZES.len()];
        match v {
            0 => {
                let x = a
                    .malloc(s as u64, Stream::DEFAULT)
                    .expect("cache-hit malloc");
                a.free(std::hint::black_box(x.ptr)).expect("free");
            }
            1 => vmmalloc_free(
                std::hint::black_box(try_malloc(s)),
                s,
                0,
                std::ptr::null_mut(),
            ),
            _ => vmmalloc_free(
                std::hint::black_box(shim_malloc(s)),
                s,
                0,
                std::ptr::null_mut(),
            ),
        }
    }
    t.elapsed().as_nanos() as f64 / pairs as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect("a number"))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --bench` passes no `--bench`: one small round.
    let quick = !args.iter().any(|a| a == "--bench");
    let rounds = if quick { 1 } else { arg(&args, "--rounds", 21) };
    let pairs = if quick {
        1000
    } else {
        arg(&args, "--pairs", 200_000)
    };

    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(|n| {
            NAMES
                .iter()
                .position(|m| m == n)
                .expect("--only: policy, try_malloc or malloc")
        });

    let a = policy();
    vmmalloc_reset_for_tests();
    let c = CString::new(CONF).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { vmmalloc_configure(c.as_ptr()) }, 0);
    // Warm-up: every size once in every variant (all later ones are cache hits).
    for v in 0..NAMES.len() {
        batch(v, &*a, SIZES.len() * 4);
    }
    if let Some(v) = only {
        let ns = batch(v, &*a, pairs);
        println!("{}: {pairs} pairs, {ns:.1} ns per pair", NAMES[v]);
        return;
    }

    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); NAMES.len()];
    for r in 0..rounds {
        let mut round = [0.0; NAMES.len()];
        for k in 0..NAMES.len() {
            let v = (r + k) % NAMES.len();
            round[v] = batch(v, &*a, pairs);
        }
        for v in 0..NAMES.len() {
            ns[v].push(round[v]);
            ratios[v].push(round[v] / round[0]);
        }
    }
    assert!(vmmalloc_last_error().is_null(), "the pairs succeeded");
    assert_eq!(vmmalloc_validate(0), 0);
    drop(a);
    vmmalloc_reset_for_tests();

    if quick {
        println!(
            "test mode (one small round, unoptimised): checks the bench runs, measures nothing"
        );
    }
    println!(
        "cache-hit malloc+free pair, host backend, {rounds} interleaved rounds of {pairs} pairs"
    );
    println!(
        "{:<12} {:>14} {:>22}",
        "variant", "median ns", "median ratio to policy"
    );
    for v in 0..NAMES.len() {
        println!(
            "{:<12} {:>14.1} {:>22.3}",
            NAMES[v],
            median(&mut ns[v]),
            median(&mut ratios[v])
        );
    }
}
