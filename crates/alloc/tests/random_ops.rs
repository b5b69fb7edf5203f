//! Long seeded random-operation runs of the PyTorch replicas (`caching`,
//! `torch-es`) and `native` on `sim` and on `host`, with `validate()`, the
//! device model's check and the shadow model after every step
//! ([`Harness::run`]); on `host` every live block's bytes are also checked
//! (pattern written at malloc, verified at free and after every empty_cache).
//!
//! Together with the proptest files this keeps the random operations per CI
//! run above 100,000 over `sim` and `host` (issue 10, item 8); the
//! expandable allocator's runs live in `expandable_*.rs`. Each run asserts
//! how many steps it applied, so a shortened run fails instead of passing
//! quietly.

use std::sync::Arc;
use vmmalloc_alloc::caching::{CachingAllocator, CachingConfig};
use vmmalloc_alloc::native::NativeAllocator;
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::{Allocator, Policy};
use vmmalloc_alloc_harness::{Harness, OpMix, RandomOps};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, Introspect, GIB, MIB};

/// Steps per run on `sim` (per policy and seed) and on `host`.
const SIM_STEPS: usize = 8_000;
const HOST_STEPS: usize = 2_500;
/// Seeds per policy; each seed uses its own PYTORCH_CUDA_ALLOC_CONF.
const SEEDS: [u64; 3] = [1, 2, 3];
const CONFS: [&str; 3] = [
    "",
    "max_split_size_mb:40,garbage_collection_threshold:0.6",
    "roundup_power2_divisions:4",
];

fn build(policy: Policy, dev: Arc<dyn Device>, conf: &str) -> Box<dyn Allocator> {
    let c = CachingConfig::parse(conf).unwrap();
    match policy {
        Policy::Caching => Box::new(CachingAllocator::new(dev, c).unwrap()),
        Policy::TorchEs => Box::new(TorchEsAllocator::new(dev, c).unwrap()),
        Policy::Native => Box::new(NativeAllocator::new(dev).unwrap()),
        Policy::Expandable => unreachable!("expandable runs live in expandable_*.rs"),
    }
}

/// Runs `steps` random ops on `dev`, then frees everything; returns the steps
/// applied and the out-of-memory errors seen.
fn run<D: Device + Introspect + 'static>(
    dev: Arc<D>,
    policy: Policy,
    seed: u64,
    steps: usize,
    max_size: u64,
) -> (u64, u64) {
    let conf = CONFS[seed as usize % CONFS.len()];
    let a = build(policy, dev.clone(), conf);
    let (applied, ooms) = {
        let mut h = Harness::new(a.as_ref(), &*dev, 3).unwrap();
        // PyTorch's stats (requested bytes fall when the block is really
        // freed); native's driver allocation is its requested size.
        h.pytorch_stats = true;
        h.check_whole_block = policy != Policy::Native;
        let mut gen = RandomOps::new(
            seed * 7919 + policy as u64,
            OpMix {
                min_size: 1,
                max_size,
                streams: 3,
                weights: [42, 34, 4, 9, 9, 2],
            },
        );
        let ops = gen.take(steps);
        if let Err(e) = h.run(&ops) {
            panic!("{policy} seed {seed} ({conf:?}): {e}");
        }
        h.finish()
            .unwrap_or_else(|e| panic!("{policy} seed {seed}: {e}"));
        (h.steps, h.ooms)
    };
    drop(a);
    assert!(
        dev.live().is_empty(),
        "{policy} seed {seed}: left on the device: {:?}",
        dev.live()
    );
    (applied, ooms)
}

fn sim_runs(policy: Policy) {
    let mut total = 0;
    let mut ooms = 0;
    for seed in SEEDS {
        // Small enough that the mix runs out of memory now and then.
        let dev = Arc::new(SimDevice::with_capacity(2 * GIB));
        let (n, o) = run(dev, policy, seed, SIM_STEPS, 256 * MIB);
        total += n;
        ooms += o;
    }
    assert!(
        total >= (SEEDS.len() * SIM_STEPS) as u64,
        "{policy}: {total} steps"
    );
    assert!(ooms > 0, "{policy}: the runs must reach memory pressure");
    eprintln!("{policy} on sim: {total} steps, {ooms} out-of-memory errors");
}

fn host_runs(policy: Policy) {
    let mut total = 0;
    for seed in SEEDS {
        let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(96 * MIB)).unwrap());
        let (n, _) = run(dev, policy, seed, HOST_STEPS, 8 * MIB);
        total += n;
    }
    assert!(
        total >= (SEEDS.len() * HOST_STEPS) as u64,
        "{policy}: {total} steps"
    );
    eprintln!("{policy} on host: {total} steps");
}

#[test]
fn caching_random_ops_on_sim() {
    sim_runs(Policy::Caching);
}

#[test]
fn torch_es_random_ops_on_sim() {
    sim_runs(Policy::TorchEs);
}

#[test]
fn native_random_ops_on_sim() {
    sim_runs(Policy::Native);
}

#[test]
fn caching_random_ops_on_host() {
    host_runs(Policy::Caching);
}

#[test]
fn torch_es_random_ops_on_host() {
    host_runs(Policy::TorchEs);
}

#[test]
fn native_random_ops_on_host() {
    host_runs(Policy::Native);
}
