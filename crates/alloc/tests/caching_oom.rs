//! The out-of-memory report of `caching` and `torch-es`: PyTorch's wording
//! plus the cause in the caching allocator's terms.

use std::sync::Arc;
use vmmalloc_alloc::caching::{CachingAllocator, CachingConfig};
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::{AllocError, Allocator, OomReport};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Stream, MIB};

const S0: Stream = Stream::DEFAULT;

fn report(e: AllocError) -> Box<OomReport> {
    match e {
        AllocError::OutOfMemory(r) => r,
        e => panic!("expected out of memory, got {e}"),
    }
}

#[test]
fn live_plus_request_beyond_the_device_is_said_first_and_fragmentation_not_blamed() {
    for es in [false, true] {
        let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
        let a: Box<dyn Allocator> = if es {
            Box::new(TorchEsAllocator::new(dev, CachingConfig::default()).unwrap())
        } else {
            Box::new(CachingAllocator::new(dev, CachingConfig::default()).unwrap())
        };
        // 50 MiB live in 20 MiB segments (with free tails), then 16 MiB more:
        // 66 MiB > 64 MiB, whatever the arrangement.
        for _ in 0..5 {
            a.malloc(10 * MIB, S0).unwrap();
        }
        let text = a.malloc(16 * MIB, S0).unwrap_err().to_string();
        let why = text.split("\nWhy: ").nth(1).expect("a Why line");
        assert!(
            why.starts_with(
                "live tensors hold 50.00 MiB and the request needs 16.00 MiB more: together 66.00 MiB, \
                 more than the 64.00 MiB device, so no allocator could serve it"
            ),
            "{text}"
        );
        assert!(
            !why.contains("largest") && !why.contains("Pinning") && !why.contains("fragment"),
            "{text}"
        );
    }
}

#[test]
fn fragmented_segments_are_named_with_what_pins_them() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = CachingAllocator::new(dev, CachingConfig::default()).unwrap();
    // Three 20 MiB segments (6 MiB requests get kLargeBuffer), each split into
    // a 6 MiB block that stays and a 14 MiB block that is freed.
    let mut keep = Vec::new();
    let mut drop = Vec::new();
    for _ in 0..3 {
        keep.push(a.malloc(6 * MIB, S0).unwrap());
        drop.push(a.malloc(14 * MIB, S0).unwrap());
    }
    for y in drop {
        a.free(y.ptr).unwrap();
    }
    let e = a.malloc(16 * MIB, S0).unwrap_err();
    let text = e.to_string();
    let r = report(e);
    let c = r.caching.as_ref().expect("caching cause");
    assert_eq!((c.segments, c.fragmented), (3, 3));
    assert_eq!(c.fragmented_free, 42 * MIB);
    assert_eq!(c.pins.len(), 3);
    assert!(c
        .pins
        .iter()
        .all(|p| p.size == 6 * MIB && p.segment_free == 14 * MIB && p.segment_size == 20 * MIB));
    // PyTorch's wording (DeviceCachingAllocator::malloc).
    assert!(
        text.starts_with("CUDA out of memory (caching). Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which 4.00 MiB is free. Of the allocated memory 18.00 MiB is allocated by PyTorch, and 42.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"),
        "{text}"
    );
    assert!(
        text.contains("Why: live tensors plus the request fit in the 64.00 MiB, but 60.00 MiB is reserved across 3 segments"),
        "{text}"
    );
    assert!(
        text.contains("the largest is 14.00 MiB, too small for the 16.00 MiB request"),
        "{text}"
    );
    assert!(
        text.contains("42.00 MiB of it is in 3 segments that also hold live tensors"),
        "{text}"
    );
    assert!(
        text.contains("6.00 MiB at 0x")
            && text.contains("keeps 14.00 MiB free in its 20.00 MiB segment"),
        "{text}"
    );
    // No lines that do not apply to the caching allocator.
    assert!(
        !text.contains("pooled") && !text.contains("Rounding"),
        "{text}"
    );
}

#[test]
fn the_20_mib_rounding_is_named_where_it_is_the_reason() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = CachingAllocator::new(dev, CachingConfig::default()).unwrap();
    let _x = a.malloc(40 * MIB, S0).unwrap();
    let _y = a.malloc(12 * MIB, S0).unwrap();
    // 12 MiB free on the device, the 3 MiB request needs a 20 MiB segment.
    let e = a.malloc(3 * MIB, S0).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("Tried to allocate 20.00 MiB"), "{text}");
    assert!(
        text.contains("Rounding is the reason: the device has 12.00 MiB free, enough for the 3.00 MiB requested, but the caching allocator asks the driver for a 20.00 MiB segment"),
        "{text}"
    );
    assert!(text.contains("nothing is cached"), "{text}");
}

#[test]
fn torch_es_report_has_no_caching_only_or_pool_lines() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = TorchEsAllocator::new(dev, CachingConfig::default()).unwrap();
    let _x = a.malloc(50 * MIB, S0).unwrap();
    // 50 + 12 MiB fit in 64 MiB, but the 20 MiB pages do not.
    let e = a.malloc(12 * MIB, S0).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("CUDA out of memory (torch-es). Tried to allocate"),
        "{text}"
    );
    assert!(
        !text.contains("pooled")
            && !text.contains("try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments"),
        "{text}"
    );
    assert!(text.contains("reserved across 1 segment;"), "{text}");
}

#[test]
fn native_report_names_only_what_applies() {
    let dev = Arc::new(SimDevice::with_capacity(64 * MIB));
    let a = vmmalloc_alloc::native::NativeAllocator::new(dev).unwrap();
    let _x = a.malloc(50 * MIB, S0).unwrap();
    let text = a.malloc(30 * MIB, S0).unwrap_err().to_string();
    assert!(
        text.starts_with("out of memory (native). Tried to allocate 30.00 MiB"),
        "{text}"
    );
    assert!(text.contains("Live tensors hold 50.00 MiB"), "{text}");
    for absent in ["pooled", "cached", "largest free"] {
        assert!(!text.contains(absent), "{absent}: {text}");
    }
}
