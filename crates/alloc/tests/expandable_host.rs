//! The expandable allocator on the `host` device, which holds real bytes:
//! every live block carries a pattern derived from its id, verified at free
//! and after every reclaim, including blocks whose neighbours' pages were
//! unmapped and mapped elsewhere; and threads on distinct streams hammering
//! one allocator.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{Allocation, Allocator, Stream};
use vmmalloc_alloc_harness::{
    pattern_check, pattern_fill, Harness, Op, OpMix, RandomOps, SplitMix,
};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::{Call, Device, Introspect, MIB};

fn host(capacity: u64) -> Arc<HostDevice> {
    Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"))
}

/// Live blocks share pages with free neighbours; a reclaim for another stream
/// takes the whole free pages between them and maps them elsewhere, where new
/// data is written. Every surviving block still holds its bytes.
#[test]
fn blocks_keep_their_bytes_while_neighbour_pages_move() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let mut h = Harness::new(&a, &*dev, 2).unwrap();
    let mut ops = Vec::new();
    // Stream 0: 3 MiB blocks (not page-aligned ends: neighbours share pages)
    // interleaved with 1 KiB blocks in the small pool.
    for _ in 0..18 {
        ops.push(Op::Malloc {
            size: 3 * MIB + 4096,
            stream: 0,
        });
        ops.push(Op::Malloc {
            size: 1000,
            stream: 0,
        });
    }
    h.run(&ops).unwrap();
    // Queue work on every block, then free every other large block.
    let work: Vec<Op> = (0..h.live.len()).map(|slot| Op::Submit { slot }).collect();
    h.run(&work).unwrap();
    let mut i = 0;
    while i < h.live.len() {
        if h.live[i].alloc.size > MIB {
            h.run(&[Op::Free { slot: i }]).unwrap();
        }
        i += 1;
    }
    let before = a.stats();
    // Stream 1 needs more pages than are unused: targeted reclaim from the gaps.
    h.run(&[
        Op::Malloc {
            size: 20 * MIB,
            stream: 1,
        },
        Op::Malloc {
            size: 6 * MIB,
            stream: 1,
        },
    ])
    .unwrap();
    let after = a.stats();
    assert!(
        after.reclaims > before.reclaims,
        "the scenario must reclaim"
    );
    assert_eq!(after.num_ooms, 0);
    assert_eq!(dev.counts().get(Call::DeviceSync), 0);
    h.verify_all().unwrap();
    h.finish().unwrap();
    drop(h);
    drop(a);
    assert!(dev.live().is_empty());
}

/// A long seeded random run on a small host device: many reclaims, every
/// byte checked at free, after every reclaim and after every empty_cache.
#[test]
fn random_long_run_keeps_every_byte() {
    let dev = host(48 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    {
        let mut h = Harness::new(&a, &*dev, 3).unwrap();
        let mut gen = RandomOps::new(
            7,
            OpMix {
                min_size: 1,
                max_size: 12 * MIB,
                streams: 3,
                weights: [45, 35, 3, 8, 8, 1],
            },
        );
        h.run(&gen.take(600)).unwrap();
        h.finish().unwrap();
    }
    let st = a.stats();
    assert!(
        st.reclaims > 0 && st.num_ooms > 0,
        "the run must hit memory pressure: {st:?}"
    );
    drop(a);
    assert!(dev.live().is_empty());
}

/// One thread per stream, each allocating, filling, verifying and freeing;
/// memory is tight, so threads reclaim pages freed by each other.
fn hammer<D: Device + Introspect + 'static>(dev: Arc<D>, threads: usize, iters: usize, max: u64) {
    let a = Arc::new(ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap());
    let streams: Vec<Stream> = (0..threads).map(|_| dev.create_stream().unwrap()).collect();
    let check_bytes = dev.caps().has_memory;
    std::thread::scope(|scope| {
        for (t, &s) in streams.iter().enumerate() {
            let (a, dev) = (a.clone(), dev.clone());
            scope.spawn(move || {
                let mut rng = SplitMix(t as u64 + 1);
                let mut live: Vec<(u64, Allocation)> = Vec::new();
                for i in 0..iters {
                    let id = ((t as u64) << 32) | i as u64;
                    if live.len() >= 8 || (rng.below(3) == 0 && !live.is_empty()) {
                        let (id, x) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        if check_bytes {
                            pattern_check(&*dev, id, x.ptr, x.requested).unwrap();
                        }
                        a.free(x.ptr).unwrap();
                        continue;
                    }
                    let size = rng.log_size(1, max);
                    match a.malloc(size, s) {
                        Ok(x) => {
                            if check_bytes {
                                pattern_fill(&*dev, id, x.ptr, x.requested).unwrap();
                            }
                            dev.introspect()
                                .unwrap()
                                .streams()
                                .submit(s, x.ptr, x.size)
                                .unwrap();
                            live.push((id, x));
                        }
                        Err(e) if e.is_out_of_memory() => {
                            // Give some memory back and go on.
                            if let Some((id, x)) = live.pop() {
                                if check_bytes {
                                    pattern_check(&*dev, id, x.ptr, x.requested).unwrap();
                                }
                                a.free(x.ptr).unwrap();
                            }
                        }
                        Err(e) => panic!("thread {t}: {e}"),
                    }
                }
                for (id, x) in live {
                    if check_bytes {
                        pattern_check(&*dev, id, x.ptr, x.requested).unwrap();
                    }
                    a.free(x.ptr).unwrap();
                }
            });
        }
    });
    a.validate().unwrap();
    let st = a.stats();
    assert_eq!(st.allocation.all().current, 0);
    assert!(
        st.reclaims > 0,
        "threads must have moved pages between streams: {st:?}"
    );
    assert_eq!(st.num_sync_all_streams, 0);
    drop(a);
    assert!(dev.live().is_empty());
}

#[test]
fn threads_on_distinct_streams_keep_every_byte_on_host() {
    hammer(host(40 * MIB), 4, 300, 6 * MIB);
}

#[test]
fn threads_on_distinct_streams_on_sim() {
    hammer(
        Arc::new(vmmalloc_device::sim::SimDevice::with_capacity(256 * MIB)),
        4,
        2000,
        24 * MIB,
    );
}
