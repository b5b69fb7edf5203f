//! Benchmark (docs/expandable.md, "Growable regions"): grow a region to
//! 1 GiB in 2 MiB steps on the `sim` device (a100 cost preset), shrink it
//! back, and grow it again from the chunk pool; prints driver calls per GiB
//! and the modeled driver time of each phase.
//!
//! ```text
//! cargo run --release -p vmmalloc-alloc --example growable_resize
//! ```

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::Stream;
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::MIB;

const GIB: u64 = 1024 * MIB;

fn main() {
    let dev = Arc::new(SimDevice::with_capacity(80 * GIB));
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).expect("allocator");
    let step = 2 * MIB;
    let phase = |name: &str, f: &mut dyn FnMut()| {
        let (c0, us0) = (dev.counts(), dev.modeled_us());
        let t = std::time::Instant::now();
        f();
        let cpu = t.elapsed();
        let c = dev.counts().since(&c0);
        let calls: Vec<String> = c
            .nonzero()
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!(
            "{name:<32} {:>5} driver calls per GiB ({}), modeled {:>8.1} ms, CPU {:.2} ms",
            c.total(),
            calls.join(", "),
            (dev.modeled_us() - us0) / 1000.0,
            cpu.as_secs_f64() * 1000.0
        );
    };
    let p = a.growable_create(GIB, Stream::DEFAULT).expect("create");
    phase("grow 0 -> 1 GiB (new chunks)", &mut || {
        for i in 1..=GIB / step {
            a.growable_resize(p, i * step).expect("grow");
        }
    });
    phase("shrink 1 GiB -> 0 in 2 MiB steps", &mut || {
        for i in (0..GIB / step).rev() {
            a.growable_resize(p, i * step).expect("shrink");
        }
    });
    phase("grow 0 -> 1 GiB (pooled chunks)", &mut || {
        for i in 1..=GIB / step {
            a.growable_resize(p, i * step).expect("grow");
        }
    });
    phase("shrink 1 GiB -> 0 at once", &mut || {
        a.growable_resize(p, 0).expect("shrink");
    });
    phase("grow 0 -> 1 GiB at once (pooled)", &mut || {
        a.growable_resize(p, GIB).expect("grow");
    });
    a.growable_destroy(p).expect("destroy");
}
