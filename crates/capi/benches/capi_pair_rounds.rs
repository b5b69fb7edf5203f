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

use std::time::Instant;
use vmmalloc::*;
use vmmalloc_alloc::{Allocator, Stream};
use vmmalloc_test_support::median;

mod pair_common;
use pair_common::*;

/// The variants, in report order.
const NAMES: [&str; 3] = ["policy", "try_malloc", "malloc"];

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
    configure();
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
