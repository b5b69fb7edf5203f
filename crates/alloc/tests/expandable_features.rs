//! The expandable allocator's features together: sleep and wake (issue 12)
//! with spilled chunks and with a growable region alongside (issue 13), on
//! `host` (real bytes), with `validate()` after every step.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{Allocator, Sleep, Stream};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill, tagged};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::{Introspect, MIB};

fn host(capacity: u64) -> Arc<HostDevice> {
    Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"))
}

/// A tag whose blocks partly live in host-located (spilled) chunks pauses
/// with backup, gives back its device and host memory, and resumes with its
/// bytes at the same addresses.
#[test]
fn spilled_blocks_pause_and_resume_with_their_bytes() {
    let dev = host(64 * MIB);
    let cfg = ExpandableConfig {
        spill: true,
        max_chunk: Some(8 * MIB),
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let base = tagged(&a, "", &[40 * MIB]);
    let w = tagged(&a, "feat-spill-w", &[8 * MIB - 4096; 5]);
    a.validate().unwrap();
    assert!(a.stats().spilled_bytes > 0, "the tag needed host memory");
    for (i, b) in base.iter().chain(&w).enumerate() {
        pattern_fill(&*dev, i as u64, b.ptr, b.requested).unwrap();
    }
    let released = a.pause(&["feat-spill-w".to_string()], true).unwrap();
    a.validate().unwrap();
    // Device and host chunks both count: at least the tagged bytes.
    assert!(released >= 5 * (8 * MIB - 4096), "released {released}");
    for b in &w {
        assert!(!dev.is_accessible(b.ptr, 1), "paused memory still mapped");
    }
    assert_eq!(dev.live().host_bytes, 0, "the spilled chunks went back too");
    assert_eq!(a.stats().spilled_bytes, 0);
    // The device memory the tag held is free for others meanwhile.
    let other = a.malloc(16 * MIB, Stream::DEFAULT).unwrap();
    a.free(other.ptr).unwrap();
    a.validate().unwrap();
    a.resume(&["feat-spill-w".to_string()]).unwrap();
    a.validate().unwrap();
    for (i, b) in base.iter().chain(&w).enumerate() {
        pattern_check(&*dev, i as u64, b.ptr, b.requested).unwrap();
    }
    for b in base.iter().chain(&w) {
        a.free(b.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    a.validate().unwrap();
    drop(a);
    assert_eq!(dev.live().handles, 0, "nothing leaked");
}

/// Pausing a tag leaves a growable region (which carries no tag) mapped with
/// its bytes; the region can grow into the memory the pause gave back, and
/// the tag resumes once the region shrinks again.
#[test]
fn a_growable_region_lives_through_a_pause() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let r = a.growable_create(256 * MIB, Stream::DEFAULT).unwrap();
    a.growable_resize(r, 16 * MIB).unwrap();
    pattern_fill(&*dev, 7, r, 16 * MIB).unwrap();
    let w = tagged(&a, "feat-grow-w", &[32 * MIB]);
    pattern_fill(&*dev, 8, w[0].ptr, w[0].requested).unwrap();
    // 48 MiB in use on a 64 MiB device: the region cannot reach 40 MiB yet.
    assert!(a
        .growable_resize(r, 40 * MIB)
        .unwrap_err()
        .is_out_of_memory());
    a.validate().unwrap();
    a.pause(&["feat-grow-w".to_string()], true).unwrap();
    a.validate().unwrap();
    a.growable_resize(r, 40 * MIB).unwrap();
    a.validate().unwrap();
    pattern_check(&*dev, 7, r, 16 * MIB).unwrap();
    // Resuming needs the memory the region now holds: it fails and changes nothing.
    let e = a.resume(&["feat-grow-w".to_string()]).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    a.validate().unwrap();
    a.growable_resize(r, 16 * MIB).unwrap();
    a.resume(&["feat-grow-w".to_string()]).unwrap();
    a.validate().unwrap();
    pattern_check(&*dev, 7, r, 16 * MIB).unwrap();
    pattern_check(&*dev, 8, w[0].ptr, w[0].requested).unwrap();
    a.free(w[0].ptr).unwrap();
    a.growable_destroy(r).unwrap();
    a.empty_cache().unwrap();
    a.validate().unwrap();
    drop(a);
    assert_eq!(dev.live().handles, 0, "nothing leaked");
}
