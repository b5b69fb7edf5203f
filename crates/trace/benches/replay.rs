//! `cargo bench -p vmmalloc-trace --bench replay`: the replay rate (trace
//! events per second of replay CPU time, as `vmmalloc replay` prints it) of
//! the built-in `train-varlen` and `serve-kv` workloads and of their long
//! variants, per policy, on an 80 GiB simulated device.
//!
//! Each sample is the replay's own `cpu_time` (the allocator's construction,
//! the trace's generation and the teardown excluded), so the figure is what
//! the CLI's "replay rate" line shows, measured many times. Targets (issue
//! 10, not asserted): ≥ 5 M events/s on train-varlen and ≥ 4 M on serve-kv
//! for `expandable`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;
use vmmalloc_alloc::Policy;
use vmmalloc_device::GIB;
use vmmalloc_trace::replay::{replay, ReplayConfig};
use vmmalloc_trace::Input;

/// The traces benchmarked (built-in workload names).
const TRACES: [&str; 4] = [
    "train-varlen",
    "serve-kv",
    "train-varlen:steps=100",
    "serve-kv:steps=8000",
];

/// The policies benchmarked.
const POLICIES: [Policy; 3] = [Policy::Expandable, Policy::TorchEs, Policy::Caching];

fn replay_rate(c: &mut Criterion) {
    for name in TRACES {
        let trace = name
            .parse::<Input>()
            .and_then(|i| i.load())
            .unwrap_or_else(|e| panic!("loading {name}: {e}"));
        let dt = &trace.devices[0];
        let ops = dt.replay_ops();
        let mut group = c.benchmark_group(format!("replay/{name}"));
        group.throughput(Throughput::Elements(dt.events().len() as u64));
        group.sample_size(20);
        group.measurement_time(Duration::from_secs(4));
        for policy in POLICIES {
            let mut cfg = ReplayConfig::new(policy, 80 * GIB);
            cfg.pre_trace_ops = dt.pre_trace().len();
            group.bench_function(BenchmarkId::from_parameter(policy), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let r = replay(ops, &cfg);
                        assert!(r.ok, "{name} on {policy}: {:?}", r.error);
                        total += r.cpu_time;
                    }
                    total
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, replay_rate);
criterion_main!(benches);
