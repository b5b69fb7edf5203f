//! `cargo bench -p vmmalloc-alloc --bench sleep`: pause (with backup) and
//! resume of one 1 GiB tagged block on the `host` device (real bytes),
//! beside a plain memcpy of the same size, the physical limit of each (pause
//! copies 1 GiB out, resume copies it back). Target (issue 12, not
//! asserted): pause and resume throughput ≥ 0.5 × memcpy. `memcpy_fresh`
//! is the same copy into freshly allocated memory. Results:
//! docs/expandable.md, "Sleep and wake".

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{set_thread_tag, Allocator, Sleep, Stream};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::{Device, GIB};

const SIZE: u64 = GIB;

fn sleep(c: &mut Criterion) {
    let dev = match HostDevice::new(HostConfig::with_capacity(2 * GIB)) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            eprintln!("skipping: no host device ({e})");
            return;
        }
    };
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    set_thread_tag("bench-sleep").unwrap();
    let x = a.malloc(SIZE, Stream::DEFAULT).unwrap();
    set_thread_tag("").unwrap();
    let data: Vec<u8> = (0..SIZE).map(|i| (i * 31 % 251) as u8).collect();
    dev.copy_to_device(x.ptr, &data).unwrap();
    let tags = vec!["bench-sleep".to_string()];

    let mut g = c.benchmark_group("sleep_1GiB_host");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(20))
        .warm_up_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes(SIZE));
    let mut dst = vec![0u8; SIZE as usize];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(&data);
            std::hint::black_box(&dst);
        })
    });
    drop(dst);
    // The same copy into fresh memory (faulted in by the copy): what a
    // backup or a resume into new pages pays at least.
    g.bench_function("memcpy_fresh", |b| {
        b.iter(|| {
            let mut fresh = vec![0u8; SIZE as usize];
            fresh.copy_from_slice(&data);
            std::hint::black_box(&fresh);
        })
    });
    g.bench_function("pause_backup", |b| {
        b.iter_custom(|n| {
            let mut t = Duration::ZERO;
            for _ in 0..n {
                let s = Instant::now();
                a.pause(&tags, true).unwrap();
                t += s.elapsed();
                a.resume(&tags).unwrap();
            }
            t
        })
    });
    g.bench_function("resume_restore", |b| {
        b.iter_custom(|n| {
            let mut t = Duration::ZERO;
            for _ in 0..n {
                a.pause(&tags, true).unwrap();
                let s = Instant::now();
                a.resume(&tags).unwrap();
                t += s.elapsed();
            }
            t
        })
    });
    g.finish();
    // The data survived every round trip.
    let mut back = vec![0u8; SIZE as usize];
    dev.copy_from_device(x.ptr, &mut back).unwrap();
    assert!(back == data, "the block lost its bytes");
}

criterion_group!(benches, sleep);
criterion_main!(benches);
