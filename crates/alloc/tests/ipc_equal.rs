//! IPC export in PyTorch's expandable-segments layout (issue 40, item 2):
//! [`Export::export_equal`](vmmalloc_alloc::Export::export_equal) answers chunks of one size at every size and
//! layout, re-backing them once with equal handles at the same addresses,
//! and the bytes a reader sees when it maps them the way PyTorch's consumer
//! does equal the producer's.
//!
//! The reader (`read_like_pytorch`) follows `ExpandableSegment::fromShared`
//! (c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.15): one `segment_size`
//! for all handles, handle *i* mapped at `base + i * segment_size` of a
//! fresh reservation, the tensor at `base + offset`. On `host` a handle's
//! descriptor is a memfd, so the reader maps it with `mmap` (in this
//! process; the C ABI's tests, crates/capi/tests/ipc.rs, do it across
//! processes, on the fake libcuda too). `validate()` after every step.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::ipc::ExportedRange;
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Export, Sleep, Stream};
use vmmalloc_alloc_harness::{pattern_bytes, pattern_check, pattern_fill, pattern_ranges, tagged};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, GIB, MIB};

fn host(capacity: u64) -> Arc<HostDevice> {
    Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"))
}

/// The chunks of `r` have one size, follow each other and cover the block.
fn assert_equal(r: &ExportedRange) {
    let s = r.chunks[0].size;
    for w in r.chunks.windows(2) {
        assert_eq!(w[0].addr + w[0].size, w[1].addr, "contiguous");
    }
    assert!(
        r.chunks.iter().all(|c| c.size == s),
        "chunks of one size: {:?}",
        r.chunks.iter().map(|c| c.size >> 20).collect::<Vec<_>>()
    );
    assert!(r.offset() < s, "the block starts in the first handle");
    assert!(r.ptr + r.size <= r.chunks[0].addr + s * r.chunks.len() as u64);
}

/// Maps the handles of `r` as PyTorch's `fromShared` does (see the module
/// docs) and compares block `id`'s pattern at `offset` with what it reads.
fn read_like_pytorch(dev: &dyn Device, r: &ExportedRange, id: u64, len: u64) -> Result<(), String> {
    let seg = r.chunks[0].size as usize;
    let n = r.chunks.len();
    // SAFETY: a fresh anonymous reservation, nothing else uses it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            seg * n,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    for (i, c) in r.chunks.iter().enumerate() {
        let fd = dev.export_fd(c.handle).map_err(|e| e.to_string())?;
        // SAFETY: MAP_FIXED inside our own reservation; `fd` is a memfd of
        // at least `seg` bytes (one handle).
        let p = unsafe {
            libc::mmap(
                base.cast::<u8>().add(i * seg).cast(),
                seg,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        // SAFETY: our descriptor; the mapping keeps the memory.
        unsafe { libc::close(fd) };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    }
    let mut result = Ok(());
    for (o, k) in pattern_ranges(len) {
        let at = r.offset() + o;
        // SAFETY: inside the mapping made above.
        let got =
            unsafe { std::slice::from_raw_parts(base.cast::<u8>().add(at as usize), k as usize) };
        if got != pattern_bytes(id, o, k as usize).as_slice() {
            result = Err(format!(
                "block {id}: byte range +{o:#x} differs as PyTorch reads it"
            ));
            break;
        }
    }
    // SAFETY: the reservation made above.
    unsafe { libc::munmap(base, seg * n) };
    result
}

/// Exports `b` (pattern `id`) in PyTorch's layout, checks it and reads it
/// back like PyTorch; returns the range.
fn export_and_read(dev: &dyn Device, a: &dyn Allocator, b: &Allocation, id: u64) -> ExportedRange {
    let x = a.as_export().expect("expandable can export");
    let r = x.export_equal(b.ptr).unwrap();
    a.validate().unwrap();
    assert_equal(&r);
    read_like_pytorch(dev, &r, id, b.requested).unwrap();
    pattern_check(dev, id, b.ptr, b.requested).unwrap();
    assert_eq!(
        x.export_equal(b.ptr).unwrap().chunks,
        r.chunks,
        "a second export answers the same handles, re-backing nothing"
    );
    r
}

/// Every size from 1 B to 1 GiB in a fresh allocator (a fresh process):
/// the default options (max chunk an eighth of the device, a growing tail
/// mapped ahead by 20 MiB) leave unequal chunks from 46 MiB up; exported in
/// PyTorch's layout all the same, bytes equal.
#[test]
fn every_size_in_a_fresh_allocator_exports_equal_handles() {
    let sizes = [
        1,
        4096,
        3 * MIB + 100,
        20 * MIB + 1,
        46 * MIB,
        100 * MIB,
        128 * MIB,
        300 * MIB + 4096,
        GIB,
    ];
    let mut rebacked = 0;
    for (i, &n) in sizes.iter().enumerate() {
        let dev = host(4 * GIB);
        let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
        let b = a.malloc(n, Stream::DEFAULT).unwrap();
        pattern_fill(&*dev, i as u64, b.ptr, n).unwrap();
        a.validate().unwrap();
        let r = export_and_read(&*dev, &a, &b, i as u64);
        rebacked += (r.rebacked_bytes > 0) as u32;
        a.free(b.ptr).unwrap();
        a.validate().unwrap();
        drop(a);
        assert_eq!(dev.live().handles, 0, "nothing leaked at {n}");
    }
    // On this 4 GiB device the largest chunk is 512 MiB: the 1 GiB block
    // lies on two of them, and no size needs re-backing in a fresh
    // allocator (on an 80 GiB device, up_to_eight_gib_on_sim, they do).
    assert_eq!(rebacked, 0);
}

/// After fragmentation (blocks of many sizes, every other freed, new ones
/// carved from the holes) every live block exports in PyTorch's layout, and
/// the re-backing leaves every other live block's bytes as they were.
#[test]
fn after_fragmentation_every_block_exports_and_neighbours_keep_their_bytes() {
    let dev = host(2 * GIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let s = Stream::DEFAULT;
    let sizes = [
        3 * MIB,
        46 * MIB,
        7 * MIB + 5,
        130 * MIB,
        MIB,
        64 * MIB,
        21 * MIB,
    ];
    let mut live: Vec<(u64, Allocation)> = Vec::new();
    let mut id = 0;
    for round in 0..3 {
        for &n in &sizes {
            let b = a.malloc(n + round * 4096, s).unwrap();
            pattern_fill(&*dev, id, b.ptr, b.requested).unwrap();
            live.push((id, b));
            id += 1;
        }
    }
    let mut i = 0;
    live.retain(|(_, b)| {
        i += 1;
        if i % 2 == 0 {
            a.free(b.ptr).unwrap();
        }
        i % 2 == 1
    });
    a.validate().unwrap();
    for &n in &[40 * MIB, 100 * MIB, 2 * MIB + 7] {
        let b = a.malloc(n, s).unwrap();
        pattern_fill(&*dev, id, b.ptr, b.requested).unwrap();
        live.push((id, b));
        id += 1;
    }
    a.validate().unwrap();
    let mut exported = Vec::new();
    for (k, b) in &live {
        match a.export_equal(b.ptr) {
            Ok(r) => {
                a.validate().unwrap();
                assert_equal(&r);
                read_like_pytorch(&*dev, &r, *k, b.requested).unwrap();
                exported.push(b.ptr);
            }
            // A block sharing a chunk with one exported before: that
            // chunk's handle is in other hands, so it cannot be re-backed.
            Err(AllocError::Ipc(m)) if m.contains("already exported") => {
                a.validate().unwrap();
            }
            Err(e) => panic!("{e}"),
        }
        for (k2, b2) in &live {
            pattern_check(&*dev, *k2, b2.ptr, b2.requested).unwrap();
        }
    }
    // Once the others' exports end, every one of them exports.
    for p in exported {
        a.unexport(p).unwrap();
    }
    for (k, b) in &live {
        export_and_read(&*dev, &a, b, *k);
        a.unexport(b.ptr).unwrap();
    }
    for (_, b) in &live {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
}

/// A vmmalloc-format export first (its handles are out): PyTorch's layout is
/// refused naming why, nothing moves; after the export ends it re-backs.
#[test]
fn a_chunk_exported_in_vmmalloc_format_is_not_rebacked() {
    let dev = host(2 * GIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let b = a.malloc(300 * MIB, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 1, b.ptr, b.requested).unwrap();
    let plain = a.export(b.ptr).unwrap();
    assert!(
        plain.chunks.iter().any(|c| c.size != plain.chunks[0].size),
        "this layout has unequal chunks: {:?}",
        plain
            .chunks
            .iter()
            .map(|c| c.size >> 20)
            .collect::<Vec<_>>()
    );
    let e = a.export_equal(b.ptr).unwrap_err().to_string();
    assert!(
        e.contains("already exported") && e.contains("vmmalloc's format"),
        "{e}"
    );
    assert_eq!(a.export(b.ptr).unwrap(), plain, "nothing moved");
    a.validate().unwrap();
    a.unexport(b.ptr).unwrap();
    export_and_read(&*dev, &a, &b, 1);
    assert_eq!(a.stats().ipc_rebacks, 1);
    a.free(b.ptr).unwrap();
    a.validate().unwrap();
}

/// After unpinning (exact chunks for live runs), after spill (host-located
/// chunks: re-backed onto the device), and after pause/resume: PyTorch's
/// layout, bytes equal; once exported nothing moves them, and after the
/// export ends unpinning may again, and the next export re-backs again.
#[test]
fn after_unpin_spill_and_pause_resume() {
    // Unpin: six 128 MiB blocks, one freed, a 16 MiB block carved from it;
    // a 200 MiB request on another stream unpins it.
    let dev = host(GIB);
    let cfg = ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let s = dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
    let big = a.malloc(128 * MIB, s).unwrap();
    a.free(big.ptr).unwrap();
    let small = a.malloc(16 * MIB, s).unwrap();
    pattern_fill(&*dev, 7, small.ptr, small.requested).unwrap();
    let other = dev.create_stream().unwrap();
    let y = a.malloc(200 * MIB, other).unwrap();
    assert_eq!(a.stats().chunk_unpins, 1);
    pattern_fill(&*dev, 8, y.ptr, y.requested).unwrap();
    a.validate().unwrap();
    export_and_read(&*dev, &a, &y, 8);
    export_and_read(&*dev, &a, &small, 7);
    for b in [&small, &y] {
        a.unexport(b.ptr).unwrap();
        a.free(b.ptr).unwrap();
    }
    for b in live {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
    drop(a);

    // Spill: the device is full, a block partly lives in host memory; once
    // room is made, the export re-backs it onto the device.
    let dev = host(256 * MIB);
    let cfg = ExpandableConfig {
        spill: true,
        max_chunk: Some(32 * MIB),
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let fill = a.malloc(200 * MIB, Stream::DEFAULT).unwrap();
    let b = a.malloc(90 * MIB, Stream::DEFAULT).unwrap();
    assert!(a.stats().spilled_bytes > 0, "the block spilled");
    pattern_fill(&*dev, 9, b.ptr, b.requested).unwrap();
    a.validate().unwrap();
    let e = a.export_equal(b.ptr).unwrap_err().to_string();
    assert!(
        e.contains("re-backing") && e.contains("as they were"),
        "{e}"
    );
    a.validate().unwrap();
    pattern_check(&*dev, 9, b.ptr, b.requested).unwrap();
    a.free(fill.ptr).unwrap();
    a.validate().unwrap();
    let r = export_and_read(&*dev, &a, &b, 9);
    assert!(r.rebacked_bytes > 0);
    a.validate().unwrap();
    a.free(b.ptr).unwrap();
    a.empty_cache().unwrap();
    a.validate().unwrap();
    drop(a);
    assert_eq!(dev.live().host_bytes, 0);

    // Pause / resume of a tag (public API), then export.
    let dev = host(2 * GIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let w = tagged(&a, "ipc-equal-w", &[150 * MIB, 3 * MIB, 70 * MIB]);
    for (i, b) in w.iter().enumerate() {
        pattern_fill(&*dev, 20 + i as u64, b.ptr, b.requested).unwrap();
    }
    a.pause(&["ipc-equal-w".to_string()], true).unwrap();
    a.validate().unwrap();
    let e = a.export_equal(w[0].ptr).unwrap_err().to_string();
    assert!(e.contains("paused"), "{e}");
    a.resume(&["ipc-equal-w".to_string()]).unwrap();
    a.validate().unwrap();
    for (i, b) in w.iter().enumerate() {
        export_and_read(&*dev, &a, b, 20 + i as u64);
    }
    let e = a.pause(&["ipc-equal-w".to_string()], true).unwrap_err();
    assert!(e.to_string().contains("exported"), "{e}");
    for b in &w {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
}

/// No room beside the old chunks (the limit is full): the bytes go through
/// host memory, the old chunks are released first.
#[test]
fn without_room_the_bytes_go_through_host_memory() {
    let dev = host(256 * MIB);
    let cfg = ExpandableConfig {
        max_chunk: Some(32 * MIB),
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    let b = a.malloc(200 * MIB + 5, Stream::DEFAULT).unwrap();
    let rest = a.malloc(40 * MIB, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 3, b.ptr, b.requested).unwrap();
    pattern_fill(&*dev, 4, rest.ptr, rest.requested).unwrap();
    let released = a.stats().num_device_free;
    let r = export_and_read(&*dev, &a, &b, 3);
    assert!(r.rebacked_bytes >= 200 * MIB);
    assert!(a.stats().num_device_free > released, "released in place");
    pattern_check(&*dev, 4, rest.ptr, rest.requested).unwrap();
    a.free(b.ptr).unwrap();
    a.free(rest.ptr).unwrap();
    a.validate().unwrap();
}

/// A failed driver call at any step of a re-backing (either way) leaves the
/// chunks as they were, the bytes too; the next try succeeds.
#[test]
fn a_failed_call_rolls_the_rebacking_back() {
    for (cap, call) in [
        (2 * GIB, Call::Create),
        (2 * GIB, Call::Map),
        (2 * GIB, Call::Unmap),
        (2 * GIB, Call::SetAccess),
        (2 * GIB, Call::CopyDtoD),
        (256 * MIB, Call::Release),
        (256 * MIB, Call::Create),
        (256 * MIB, Call::Map),
        (256 * MIB, Call::CopyHtoD),
    ] {
        for n in 1..4 {
            let host = HostDevice::new(HostConfig::with_capacity(cap)).unwrap();
            let dev = Arc::new(FaultInjecting::with_plan(Arc::new(host), FaultPlan::None));
            let cfg = ExpandableConfig {
                max_chunk: Some(32 * MIB),
                ..ExpandableConfig::default()
            };
            let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
            let b = a.malloc(200 * MIB + 5, Stream::DEFAULT).unwrap();
            pattern_fill(&*dev, 5, b.ptr, b.requested).unwrap();
            let before = a.export(b.ptr).unwrap();
            a.unexport(b.ptr).unwrap();
            let seen = dev.hook().seen(call);
            dev.hook().set_plan(FaultPlan::Nth {
                call,
                n: seen + n,
                kind: FaultKind::Driver(999),
            });
            let got = a.export_equal(b.ptr);
            dev.hook().set_plan(FaultPlan::None);
            a.validate().unwrap();
            pattern_check(&*dev, 5, b.ptr, b.requested).unwrap();
            match got {
                Ok(r) => assert_equal(&r),
                Err(e) => {
                    assert!(e.to_string().contains("as they were"), "{call:?} {n}: {e}");
                    let now = a.export(b.ptr).unwrap();
                    assert_eq!(now.mapped_bytes(), before.mapped_bytes());
                    a.unexport(b.ptr).unwrap();
                    export_and_read(&*dev, &a, &b, 5);
                }
            }
            a.free(b.ptr).unwrap();
            a.validate().unwrap();
        }
    }
}

/// Up to 8 GiB on `sim` (no bytes): the layout and the accounting.
#[test]
fn up_to_eight_gib_on_sim() {
    for n in [2 * GIB, 4 * GIB + 3 * MIB, 8 * GIB] {
        let dev = Arc::new(SimDevice::with_capacity(80 * GIB));
        let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
        let _small = a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
        let b = a.malloc(n, Stream::DEFAULT).unwrap();
        let plain = a.export(b.ptr).unwrap();
        assert!(plain.chunks.iter().any(|c| c.size != plain.chunks[0].size));
        a.unexport(b.ptr).unwrap();
        let r = a.export_equal(b.ptr).unwrap();
        a.validate().unwrap();
        assert_equal(&r);
        assert!(r.chunks.len() <= 64, "{} handles for {n}", r.chunks.len());
        a.free(b.ptr).unwrap();
        a.validate().unwrap();
    }
}

/// The re-backing's cost on `host` (not a test of speed: it prints ms per
/// GiB). `cargo test --release -p vmmalloc-alloc --test ipc_equal --
/// --ignored --nocapture rebacking_cost`.
#[test]
#[ignore]
fn rebacking_cost() {
    for (gib, beside) in [(1u64, true), (2, true), (1, false)] {
        let n = gib * GIB;
        let cap = if beside { 3 * n } else { n + 64 * MIB };
        let dev = host(cap);
        let cfg = ExpandableConfig {
            max_chunk: Some(64 * MIB),
            ..ExpandableConfig::default()
        };
        let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
        let _first = a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
        let b = a.malloc(n, Stream::DEFAULT).unwrap();
        pattern_fill(&*dev, 1, b.ptr, b.requested).unwrap();
        let t = std::time::Instant::now();
        let r = a.export_equal(b.ptr).unwrap();
        let dt = t.elapsed().as_secs_f64();
        assert!(r.rebacked_bytes > 0);
        let per = dt * 1e3 / (r.rebacked_bytes as f64 / GIB as f64);
        println!(
            "re-backing {} MiB ({} handles of {} MiB, {}): {:.1} ms, {per:.1} ms/GiB",
            r.rebacked_bytes >> 20,
            r.chunks.len(),
            r.chunks[0].size >> 20,
            if beside {
                "beside"
            } else {
                "through host memory"
            },
            dt * 1e3
        );
        pattern_check(&*dev, 1, b.ptr, b.requested).unwrap();
    }
}
