//! The memory-pressure callback ([`Pressure`]): called once on
//! out-of-memory, then the operation is retried once; not called when it
//! frees nothing (no retry), inside itself (never recursive) or during a
//! capture; a growable region's growth goes through it too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::pressure::Pressure;
use vmmalloc_alloc::{Allocator, Stream};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::MIB;

type A = Arc<ExpandableAllocator<Arc<SimDevice>>>;

fn setup() -> (A, Arc<Mutex<Vec<u64>>>) {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = Arc::new(ExpandableAllocator::new(dev, ExpandableConfig::default()).unwrap());
    // A cache the callback may drop: 6 blocks of 8 MiB.
    let cache: Vec<u64> = (0..6)
        .map(|_| a.malloc(8 * MIB, Stream::DEFAULT).unwrap().ptr)
        .collect();
    (a, Arc::new(Mutex::new(cache)))
}

#[test]
fn the_callback_frees_and_the_allocation_is_retried_once() {
    let (a, cache) = setup();
    let p = Pressure::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (a2, c2, s2) = (a.clone(), cache.clone(), seen.clone());
    p.set(Some(Arc::new(move |size, device| {
        s2.lock().unwrap().push((size, device));
        // Free (through the same allocator: no lock is held) until enough.
        let mut freed = 0;
        while freed < size {
            let Some(ptr) = c2.lock().unwrap().pop() else {
                break;
            };
            a2.free(ptr).unwrap();
            freed += 8 * MIB;
        }
        freed
    })));
    let x = p
        .retry(
            40 * MIB,
            3,
            || false,
            || a.malloc(40 * MIB, Stream::DEFAULT),
        )
        .expect("rescued by the callback");
    assert_eq!(*seen.lock().unwrap(), vec![(40 * MIB, 3)]);
    let c = p.counts();
    assert_eq!((c.calls, c.retries, c.rescued), (1, 1, 1));
    a.validate().unwrap();
    a.free(x.ptr).unwrap();
    // Without a callback the same request fails with the usual report.
    let q = Pressure::default();
    let e = q
        .retry(
            200 * MIB,
            0,
            || false,
            || a.malloc(60 * MIB, Stream::DEFAULT),
        )
        .map(|_| ())
        .unwrap_err();
    assert!(e.is_out_of_memory());
}

#[test]
fn a_callback_that_frees_nothing_gets_no_retry() {
    let (a, _cache) = setup();
    let p = Pressure::default();
    let tries = AtomicU64::new(0);
    p.set(Some(Arc::new(|_, _| 0)));
    let e = p
        .retry(
            40 * MIB,
            0,
            || false,
            || {
                tries.fetch_add(1, Ordering::Relaxed);
                a.malloc(40 * MIB, Stream::DEFAULT)
            },
        )
        .unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(tries.load(Ordering::Relaxed), 1);
    assert_eq!(p.counts().calls, 1);
    a.validate().unwrap();
}

#[test]
fn never_recursive_and_never_during_capture() {
    let (a, _cache) = setup();
    let p = Arc::new(Pressure::default());
    let calls = Arc::new(AtomicU64::new(0));
    let (p2, a2, c2) = (p.clone(), a.clone(), calls.clone());
    p.set(Some(Arc::new(move |_, _| {
        c2.fetch_add(1, Ordering::Relaxed);
        // An allocation inside the callback that runs out of memory is not
        // handed to the callback again.
        let inner = p2.retry(
            50 * MIB,
            0,
            || false,
            || a2.malloc(50 * MIB, Stream::DEFAULT),
        );
        assert!(inner.is_err());
        0
    })));
    assert!(p
        .retry(
            40 * MIB,
            0,
            || false,
            || a.malloc(40 * MIB, Stream::DEFAULT)
        )
        .is_err());
    assert_eq!(
        calls.load(Ordering::Relaxed),
        1,
        "called once, not recursively"
    );
    assert!(p
        .retry(40 * MIB, 0, || true, || a.malloc(40 * MIB, Stream::DEFAULT))
        .is_err());
    assert_eq!(
        calls.load(Ordering::Relaxed),
        1,
        "not called during capture"
    );
    // Errors other than out-of-memory are not the callback's business.
    assert!(p
        .retry(0, 0, || false, || a.malloc(0, Stream::DEFAULT))
        .is_err());
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

#[test]
fn a_growable_region_grows_after_the_callback_frees() {
    let (a, cache) = setup();
    let g = a.growable_create(1024 * MIB, Stream::DEFAULT).unwrap();
    let p = Pressure::default();
    let (a2, c2) = (a.clone(), cache.clone());
    p.set(Some(Arc::new(move |_, _| {
        let ptrs: Vec<u64> = c2.lock().unwrap().drain(..).collect();
        for &ptr in &ptrs {
            a2.free(ptr).unwrap();
        }
        ptrs.len() as u64 * 8 * MIB
    })));
    p.retry(60 * MIB, 0, || false, || a.growable_resize(g, 60 * MIB))
        .unwrap();
    assert_eq!(a.growable_info(g).unwrap().size, 60 * MIB);
    a.validate().unwrap();
}
