//! `cargo bench -p vmmalloc-alloc --bench share`: what a budget shared by
//! processes costs (issue 33, part 2; docs/share.md). Plain timing loops,
//! medians printed; `cargo test -p vmmalloc-alloc --bench share` (CI) runs
//! each once with a few samples, checking that it works. Nothing asserts
//! a speed.
//!
//! - `charge`: one charge + credit of a 2 MiB page by a member
//!   (`Member::charge`, `Member::credit`: the group file under its lock,
//!   read, checked, written);
//! - `miss`: a malloc that misses the cache (2 MiB, after `empty_cache`,
//!   so the physical layer creates and charges a page) + free + empty_cache
//!   on the `sim` device, with the local budget and with the shared one:
//!   the difference is what sharing adds to a cache miss;
//! - `give back 1 GiB`: an allocator holding 1 GiB of cached memory on the
//!   `host` device (real memory); its cap is lowered to 0 from outside
//!   (`Group::set_cap`, as `vmmalloc share --cap` does) for a member woken
//!   through the file's wake word (`Member::serve`) and, side by side, for
//!   one that only polls every 100 ms (`Member::serve_polling`, how every
//!   member heard it before issue 41); then from inside (`Member::set_cap`);
//!   timed until the member holds nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};
use vmmalloc_alloc::expandable::{
    join_and_serve, AllocatorGiveBack, ExpandableAllocator, ExpandableConfig,
};
use vmmalloc_alloc::share::{Group, JoinOptions, Member, DEFAULT_POLL, NO_CAP};
use vmmalloc_alloc::{Allocator, Stream};
use vmmalloc_device::host::HostDevice;
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, GIB, MIB};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median ns per call of `f`, over `samples` batches of `batch` calls.
fn time_ns(samples: usize, batch: usize, mut f: impl FnMut()) -> f64 {
    f();
    let v = (0..samples)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..batch {
                f();
            }
            t.elapsed().as_nanos() as f64 / batch as f64
        })
        .collect();
    median(v)
}

fn join(dir: &std::path::Path, name: &str, poll: Duration) -> Arc<Member> {
    let opts = JoinOptions {
        total: 1 << 40,
        cap: NO_CAP,
        poll,
    };
    Member::join_path(name, &dir.join(name), opts).expect("join")
}

fn serve<D: Device + 'static>(a: &Arc<ExpandableAllocator<D>>, m: &Arc<Member>) {
    let give_back = AllocatorGiveBack {
        alloc: Arc::downgrade(a),
        pressure: None,
        sleep_tags: vec![],
        sleep_backup: false,
    };
    join_and_serve(a, m, give_back).expect("join the allocator");
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (samples, batch, rounds) = if full { (31, 200, 15) } else { (3, 5, 2) };
    let dir = std::env::temp_dir().join(format!("vmmalloc-bench-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let m = join(&dir, "charge", DEFAULT_POLL);
    let ns = time_ns(samples, batch, || {
        m.charge(2 * MIB, true).unwrap();
        m.credit(2 * MIB);
    });
    println!("share/charge+credit 2 MiB (member, file under flock): median {ns:.0} ns");
    drop(m);

    let miss = |shared: bool| {
        let dev = Arc::new(SimDevice::with_capacity(80 * GIB));
        let a = Arc::new(ExpandableAllocator::new(dev, ExpandableConfig::default()).unwrap());
        let m = shared.then(|| {
            let m = join(&dir, "miss", DEFAULT_POLL);
            serve(&a, &m);
            m
        });
        let ns = time_ns(samples, batch, || {
            let x = a.malloc(2 * MIB, Stream::DEFAULT).unwrap();
            a.free(x.ptr).unwrap();
            a.empty_cache().unwrap();
        });
        drop(m);
        ns
    };
    let local = miss(false);
    let shared = miss(true);
    println!(
        "share/cache miss (malloc 2 MiB + free + empty_cache, sim): local budget median {local:.0} ns, \
         shared budget median {shared:.0} ns (+{:.0} ns)",
        shared - local
    );

    // Give-back of 1 GiB after the cap is lowered from outside: a member
    // woken through the file's wake word (`share/wake.rs`) beside one that
    // only polls (every 100 ms, as before issue 41), then from inside.
    let host = || match HostDevice::with_capacity(2 * GIB) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            println!("share/give back 1 GiB: skipped (no host device: {e})");
            None
        }
    };
    let Some((dev_w, dev_p)) = host().zip(host()) else {
        return;
    };
    let pid = std::process::id();
    let member = |dev, name: &str, wake: bool| {
        let a = Arc::new(ExpandableAllocator::new(dev, ExpandableConfig::default()).unwrap());
        let m = join(&dir, name, DEFAULT_POLL);
        a.join_share(Arc::clone(&m)).unwrap();
        let g = Arc::new(AllocatorGiveBack {
            alloc: Arc::downgrade(&a),
            pressure: None,
            sleep_tags: vec![],
            sleep_backup: false,
        });
        if wake {
            m.serve(g).unwrap();
        } else {
            m.serve_polling(g).unwrap();
        }
        let admin = Group::open_path(name, &dir.join(name)).unwrap();
        (a, m, admin)
    };
    let woken = member(dev_w, "giveback-wake", true);
    let polled = member(dev_p, "giveback-poll", false);
    // Fills 1 GiB of cache, lowers the cap to 0 (from outside, or from
    // inside), and times until the member holds nothing.
    let round = |(a, m, admin): &(
        Arc<ExpandableAllocator<Arc<HostDevice>>>,
        Arc<Member>,
        Group,
    ),
                 inside: bool| {
        m.set_cap(NO_CAP, None).unwrap();
        let x = a.malloc(GIB, Stream::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        assert!(m.used() >= GIB);
        let t = Instant::now();
        if inside {
            m.set_cap(0, None).unwrap();
        } else {
            admin.set_cap(pid, 0, None).unwrap();
        }
        while m.used() > 0 {
            assert!(t.elapsed() < Duration::from_secs(60), "not given back");
            std::hint::spin_loop();
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    let (mut by_wake, mut by_poll, mut inside) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        by_wake.push(round(&woken, false));
        by_poll.push(round(&polled, false));
        inside.push(round(&woken, true));
    }
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        format!("{lo:.2}-{hi:.2}")
    };
    println!(
        "share/give back 1 GiB (host) after the cap is lowered to 0 from outside: woken median \
         {:.2} ms ({} ms), by the poll only (every {} ms) median {:.1} ms ({} ms); from inside \
         median {:.2} ms",
        median(by_wake.clone()),
        range(&by_wake),
        DEFAULT_POLL.as_millis(),
        median(by_poll.clone()),
        range(&by_poll),
        median(inside)
    );
    drop(woken);
    drop(polled);
    let _ = std::fs::remove_dir_all(&dir);
}
