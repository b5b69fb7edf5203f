//! `cargo bench -p vmmalloc-alloc --bench pair`: the malloc + free pair on a
//! cache hit (single thread) for every policy on `sim` and `host`, and pair
//! throughput with 1 vs 2 threads on 2 streams. Targets (not asserted):
//! expandable ≤ 100 ns median per pair on sim; ratio to `caching` ≤ 1.0.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use vmmalloc_alloc::bench::PAIR_SIZE;
use vmmalloc_alloc::{build, Allocator, Policy, PolicyOptions, Stream};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, GIB, MIB};

/// The devices benchmarked: an 80 GiB sim and a 256 MiB host device.
fn devices() -> Vec<(&'static str, Arc<dyn Device>)> {
    let mut v: Vec<(&'static str, Arc<dyn Device>)> =
        vec![("sim", Arc::new(SimDevice::with_capacity(80 * GIB)))];
    match HostDevice::new(HostConfig::with_capacity(256 * MIB)) {
        Ok(h) => v.push(("host", Arc::new(h))),
        Err(e) => eprintln!("skipping the host device: {e}"),
    }
    v
}

/// Every policy that can serve a pair on `dev` (placeholders are skipped).
fn policies(dev: &Arc<dyn Device>) -> Vec<(Policy, Box<dyn Allocator>)> {
    Policy::ALL
        .iter()
        .filter_map(|&p| {
            let a = build(p, dev.clone(), &PolicyOptions::default()).ok()?;
            let x = a.malloc(PAIR_SIZE, Stream::DEFAULT).ok()?;
            a.free(x.ptr).ok()?;
            Some((p, a))
        })
        .collect()
}

fn pair(c: &mut Criterion) {
    for (dname, dev) in devices() {
        let mut g = c.benchmark_group(format!("pair/{dname}"));
        g.throughput(Throughput::Elements(1));
        for (p, a) in policies(&dev) {
            g.bench_function(BenchmarkId::from_parameter(p.name()), |b| {
                b.iter(|| {
                    let x = a
                        .malloc(PAIR_SIZE, Stream::DEFAULT)
                        .expect("cache-hit malloc");
                    a.free(std::hint::black_box(x.ptr)).expect("free");
                })
            });
        }
        g.finish();
    }
}

/// Runs `iters` pairs on each stream, one thread per stream; wall time.
fn run_threads(a: &dyn Allocator, streams: &[Stream], iters: u64) -> Duration {
    let start = Barrier::new(streams.len() + 1);
    std::thread::scope(|scope| {
        for &s in streams {
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for _ in 0..iters {
                    let x = a.malloc(PAIR_SIZE, s).expect("cache-hit malloc");
                    a.free(std::hint::black_box(x.ptr)).expect("free");
                }
            });
        }
        start.wait();
        let t = Instant::now();
        // The scope joins the threads before returning.
        t
    })
    .elapsed()
}

fn threads(c: &mut Criterion) {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::with_capacity(80 * GIB));
    let streams = [Stream::DEFAULT, dev.create_stream().expect("stream")];
    for (p, a) in policies(&dev) {
        let mut g = c.benchmark_group(format!("threads/sim/{}", p.name()));
        for n in [1usize, 2] {
            g.throughput(Throughput::Elements(n as u64));
            g.bench_function(BenchmarkId::from_parameter(n), |b| {
                b.iter_custom(|iters| run_threads(a.as_ref(), &streams[..n], iters))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, pair, threads);
criterion_main!(benches);
