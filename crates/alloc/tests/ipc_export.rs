//! IPC export at the allocator level ([`vmmalloc_alloc::ipc`]): which chunks
//! lie under an allocation, and that exported chunks stay where they are
//! (unpinning skips them) until the export ends or the block is freed.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{build, export_of, AllocError, Allocator, Export, Policy, PolicyOptions};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, MIB};

fn exact() -> ExpandableConfig {
    ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    }
}

#[test]
fn export_names_the_chunks_under_an_allocation_and_free_ends_it() {
    let dev = Arc::new(SimDevice::with_capacity(1024 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    let s = dev.create_stream().unwrap();
    let first = a.malloc(1000, s).unwrap();
    let small = a.malloc(3000, s).unwrap();
    let r = a.export(small.ptr).unwrap();
    assert_eq!((r.ptr, r.size), (small.ptr, small.size));
    assert_eq!(r.offset(), small.ptr - r.chunks[0].addr);
    assert!(
        r.offset() > 0,
        "the second small block starts inside its chunk"
    );
    assert!(
        r.chunks[0].addr <= small.ptr
            && small.ptr + small.size <= r.chunks[0].addr + r.mapped_bytes()
    );
    assert_eq!(
        a.export(small.ptr).unwrap(),
        r,
        "a second export answers the same"
    );
    a.validate().unwrap();
    // A block spanning several chunks: they follow each other without gaps.
    let big = a.malloc(300 * MIB + 4096, s).unwrap();
    let rb = a.export(big.ptr).unwrap();
    for w in rb.chunks.windows(2) {
        assert_eq!(w[0].addr + w[0].size, w[1].addr);
    }
    assert!(rb.chunks[0].addr <= big.ptr);
    assert!(rb.chunks[0].addr + rb.mapped_bytes() >= big.ptr + big.size);
    a.validate().unwrap();
    // Ending an export; freeing ends the other.
    a.unexport(big.ptr).unwrap();
    assert!(matches!(a.unexport(big.ptr), Err(AllocError::Ipc(_))));
    a.free(small.ptr).unwrap();
    assert!(matches!(a.unexport(small.ptr), Err(AllocError::Ipc(_))));
    assert!(matches!(
        a.export(small.ptr),
        Err(AllocError::InvalidPointer { .. })
    ));
    assert!(matches!(
        a.export(first.ptr + 512),
        Err(AllocError::InvalidPointer { .. })
    ));
    a.validate().unwrap();
    for p in [first.ptr, big.ptr] {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

/// The pinned scenario of `expandable_unpin.rs`: six 128 MiB blocks live, a
/// 16 MiB block carved from a freed 128 MiB chunk. A 200 MiB request on
/// another stream needs the chunk's 112 free MiB, which unpinning would give
/// back by moving the 16 MiB block to a chunk of its own. Exported, the
/// block's chunk must not move: the request fails with out-of-memory; once
/// the export ends the same request succeeds.
#[test]
fn an_exported_chunk_is_never_unpinned() {
    let dev = Arc::new(SimDevice::with_capacity(1024 * MIB));
    let a = ExpandableAllocator::new(dev.clone(), exact()).unwrap();
    let s = dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| a.malloc(128 * MIB, s).unwrap()).collect();
    let big = a.malloc(128 * MIB, s).unwrap();
    a.free(big.ptr).unwrap();
    let small = a.malloc(16 * MIB, s).unwrap();
    let r = a.export(small.ptr).unwrap();
    assert_eq!(r.chunks.len(), 1);
    assert_eq!(
        r.chunks[0].size,
        128 * MIB,
        "the block pins its whole chunk"
    );
    let other = dev.create_stream().unwrap();
    let e = a.malloc(200 * MIB, other).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(a.stats().chunk_unpins, 0);
    assert_eq!(a.export(small.ptr).unwrap(), r, "still where it was");
    a.validate().unwrap();
    a.unexport(small.ptr).unwrap();
    let y = a
        .malloc(200 * MIB, other)
        .expect("unpinned once no longer exported");
    assert_eq!(a.stats().chunk_unpins, 1);
    a.validate().unwrap();
    for p in [small.ptr, y.ptr]
        .into_iter()
        .chain(live.iter().map(|l| l.ptr))
    {
        a.free(p).unwrap();
    }
    a.validate().unwrap();
}

#[test]
fn other_policies_refuse_to_export_naming_themselves() {
    for policy in [Policy::Caching, Policy::Native] {
        let dev: Arc<dyn Device> = Arc::new(SimDevice::with_capacity(1024 * MIB));
        let a = build(policy, dev.clone(), &PolicyOptions::default()).unwrap();
        let s = dev.create_stream().unwrap();
        let x = a.malloc(MIB, s).unwrap();
        assert!(
            a.as_export().is_none(),
            "{policy:?} has no export capability"
        );
        let e = export_of(&*a, x.ptr).err().expect("export_of refuses");
        assert!(
            matches!(e, AllocError::Ipc(_))
                && e.to_string().contains(a.name())
                && e.to_string().contains("no export capability"),
            "{e}"
        );
        a.free(x.ptr).unwrap();
    }
}
