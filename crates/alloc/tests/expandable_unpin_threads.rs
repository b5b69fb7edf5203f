//! Unpinning and host threads (docs/expandable.md, "Unpinning and
//! threads"): under the default `unpin:auto`, a thread that writes its live
//! buffers on its own stream never loses a byte while another thread
//! allocates under pressure, and two threads that take turns (forward on
//! one, backward on the other, as PyTorch's autograd does) still unpin. On
//! `host`: real bytes, every one checked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig, UnpinMode};
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Stream};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::{Device, MIB};

type Alloc = ExpandableAllocator<Arc<HostDevice>>;

/// 256 MiB of `host` memory (largest chunk 32 MiB) and the allocator with
/// exact mappings (no mapping ahead) and `unpin`.
fn setup(unpin: UnpinMode) -> (Arc<HostDevice>, Alloc) {
    let dev = Arc::new(HostDevice::new(HostConfig::with_capacity(256 * MIB)).unwrap());
    let cfg = ExpandableConfig {
        grow_granule: 0,
        unpin,
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(dev.clone(), cfg).unwrap();
    (dev, a)
}

/// The bytes of a buffer of `len` bytes filled with `seed`: each 8-byte
/// word a function of its offset and the seed.
fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|w| {
            (w.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed.wrapping_mul(0xD6E8_FEB8_6659_FD93))
                .to_le_bytes()
        })
        .collect()
}

/// Fills all of `a` with the pattern of `seed`.
fn fill(dev: &HostDevice, a: &Allocation, seed: u64) -> Result<(), String> {
    dev.copy_to_device(a.ptr, &pattern(seed, a.size))
        .map_err(|e| format!("writing {:#x} (seed {seed}): {e}", a.ptr))
}

/// Reads all of `a` back and checks every byte against `seed`'s pattern.
fn check(dev: &HostDevice, a: &Allocation, seed: u64) -> Result<(), String> {
    let mut buf = vec![0u8; a.size as usize];
    dev.copy_from_device(a.ptr, &mut buf)
        .map_err(|e| format!("reading {:#x} (seed {seed}): {e}", a.ptr))?;
    let want = pattern(seed, a.size);
    if buf == want {
        return Ok(());
    }
    let o = (0..buf.len()).find(|&o| buf[o] != want[o]).unwrap_or(0);
    Err(format!(
        "{:#x} (seed {seed}): byte {o:#x} of {:#x} lost",
        a.ptr, a.size
    ))
}

/// A 32 MiB chunk freed and a 4 MiB block carved from it (the chunk is
/// pinned, 28 MiB of it free), beside a live 32 MiB block, on `stream`.
/// Returns (the 4 MiB block, the 32 MiB block).
fn pinned_pair(a: &Alloc, stream: Stream) -> (Allocation, Allocation) {
    let x = a.malloc(32 * MIB, stream).unwrap();
    let y = a.malloc(32 * MIB, stream).unwrap();
    a.free(x.ptr).unwrap();
    let b = a.malloc(4 * MIB, stream).unwrap();
    assert_eq!(b.ptr, x.ptr, "carved from the freed chunk");
    (b, y)
}

/// (a) A writer thread allocates two buffers on a stream of its own (one
/// of them in a pinned chunk) and writes and re-reads them in a loop, the
/// way a prefetch thread copies the next batch; meanwhile the main thread
/// allocates under pressure, needing pages that only unpinning could give.
/// `unpin:auto` declines (the writer's stream holds live tensors), the
/// out-of-memory report says why, and every byte the writer wrote is read
/// back intact, as are the main thread's.
#[test]
fn a_writer_thread_on_its_own_stream_loses_no_byte() {
    let (dev, a) = setup(UnpinMode::Auto);
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::scope(|s| {
        let writer = s.spawn(|| -> Result<u64, String> {
            let w = dev.create_stream().unwrap();
            let (b, y) = pinned_pair(&a, w);
            ready_tx.send(()).unwrap();
            let mut gen = 0u64;
            while !stop.load(Ordering::Relaxed) || gen < 3 {
                gen += 1;
                for (i, buf) in [&b, &y].into_iter().enumerate() {
                    let seed = gen * 2 + i as u64;
                    fill(&dev, buf, seed)?;
                    check(&dev, buf, seed)?;
                }
                rounds.fetch_add(1, Ordering::Relaxed);
            }
            a.free(b.ptr).unwrap();
            a.free(y.ptr).unwrap();
            Ok(gen)
        });
        ready_rx.recv().unwrap();
        let (c, m) = pinned_pair(&a, Stream::DEFAULT);
        fill(&dev, &c, 1001).unwrap();
        fill(&dev, &m, 1002).unwrap();
        // 128 MiB mapped: a 120 MiB block leaves 8 MiB unmapped, and a
        // 40 MiB request then needs 32 MiB of the 56 MiB pinned in the two
        // carved chunks.
        let p = a.malloc(120 * MIB, Stream::DEFAULT).unwrap();
        let mut attempts = 0;
        let mut refused = 0;
        while attempts < 40 || rounds.load(Ordering::Relaxed) < 10 {
            attempts += 1;
            match a.malloc(40 * MIB, Stream::DEFAULT) {
                Ok(q) => panic!("served at {:#x}: unpinning ran beside the writer", q.ptr),
                Err(AllocError::OutOfMemory(r)) => {
                    assert!(
                        r.hint.contains("did not run (unpin:auto)")
                            && r.hint.contains("allocates only on stream")
                            && r.hint.contains("hold live tensors"),
                        "{}",
                        r.hint
                    );
                    refused += 1;
                }
                Err(e) => panic!("{e}"),
            }
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        let gens = writer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("writer: {e}"));
        assert!(gens >= 3);
        assert_eq!(refused, attempts);
        let st = a.stats();
        assert_eq!(st.chunk_unpins, 0);
        assert_eq!(st.unpin_refusals, attempts);
        check(&dev, &c, 1001).unwrap();
        check(&dev, &m, 1002).unwrap();
        a.validate().unwrap();
        for x in [c, m, p] {
            a.free(x.ptr).unwrap();
        }
    });
    a.validate().unwrap();
}

/// (b) Two threads taking turns like a training step: the main thread runs
/// "forward" (leaving a pinned chunk and filling its activations), hands
/// over and waits; the other thread runs "backward" on the same stream,
/// whose first allocation needs the pinned pages, then checks the
/// activations and frees its gradients; the main thread checks again, frees
/// everything and empties the cache. Unpinning runs every step, is never
/// declined, and no byte is lost.
#[test]
fn threads_that_take_turns_still_unpin() {
    const STEPS: u64 = 6;
    let (dev, a) = setup(UnpinMode::Auto);
    let (to_bwd, bwd_rx) = mpsc::channel::<Option<[Allocation; 3]>>();
    let (to_fwd, fwd_rx) = mpsc::channel::<Result<(), String>>();
    let (a, dev) = (&a, &dev);
    std::thread::scope(|s| {
        s.spawn(move || {
            while let Some(acts) = bwd_rx.recv().unwrap() {
                let r = (|| {
                    let g1 = a
                        .malloc(80 * MIB, Stream::DEFAULT)
                        .map_err(|e| format!("backward: {e}"))?;
                    fill(dev, &g1, 7)?;
                    let g2 = a.malloc(MIB, Stream::DEFAULT).unwrap();
                    let g3 = a.malloc(MIB, Stream::DEFAULT).unwrap();
                    for (i, x) in acts.iter().enumerate() {
                        check(dev, x, 100 + i as u64)?;
                    }
                    check(dev, &g1, 7)?;
                    for g in [g1, g2, g3] {
                        a.free(g.ptr).unwrap();
                    }
                    Ok(())
                })();
                to_fwd.send(r).unwrap();
            }
        });
        for step in 0..STEPS {
            // Forward: 32 + 96 + 64 MiB mapped, 28 MiB of it pinned free.
            let (small, big) = {
                let a1 = a.malloc(32 * MIB, Stream::DEFAULT).unwrap();
                let a2 = a.malloc(96 * MIB, Stream::DEFAULT).unwrap();
                a.free(a1.ptr).unwrap();
                let small = a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
                assert_eq!(small.ptr, a1.ptr);
                (small, a2)
            };
            let a3 = a.malloc(64 * MIB, Stream::DEFAULT).unwrap();
            let acts = [small, big, a3];
            for (i, x) in acts.iter().enumerate() {
                fill(dev, x, 100 + i as u64).unwrap();
            }
            let unpins = a.stats().chunk_unpins;
            to_bwd.send(Some(acts)).unwrap();
            fwd_rx
                .recv()
                .unwrap()
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
            assert_eq!(a.stats().chunk_unpins, unpins + 1, "step {step}");
            for (i, x) in acts.iter().enumerate() {
                check(dev, x, 100 + i as u64).unwrap();
                a.free(x.ptr).unwrap();
            }
            a.validate().unwrap();
            a.empty_cache().unwrap();
        }
        to_bwd.send(None).unwrap();
    });
    let st = a.stats();
    assert_eq!(st.chunk_unpins, STEPS);
    assert_eq!(st.unpin_refusals, 0);
    a.validate().unwrap();
}

/// `unpin:false` names both other choices in its report; the scenario of
/// (a) without the writer (one thread) unpins under `auto`.
#[test]
fn one_thread_unpins_under_auto_and_false_says_what_would_help() {
    for mode in [UnpinMode::Auto, UnpinMode::Never] {
        let (dev, a) = setup(mode);
        let w = dev.create_stream().unwrap();
        let pins = [pinned_pair(&a, w), pinned_pair(&a, Stream::DEFAULT)];
        let p = a.malloc(120 * MIB, Stream::DEFAULT).unwrap();
        match (mode, a.malloc(40 * MIB, Stream::DEFAULT)) {
            (UnpinMode::Auto, Ok(q)) => {
                assert!(a.stats().chunk_unpins >= 1);
                a.free(q.ptr).unwrap();
            }
            (UnpinMode::Never, Err(AllocError::OutOfMemory(r))) => {
                assert!(
                    r.hint
                        .contains("unpin:auto or unpin:always would give them back"),
                    "{}",
                    r.hint
                );
            }
            (m, r) => panic!("{m}: {r:?}"),
        }
        assert_eq!(a.stats().unpin_refusals, 0);
        for (b, y) in pins {
            a.free(b.ptr).unwrap();
            a.free(y.ptr).unwrap();
        }
        a.free(p.ptr).unwrap();
        a.validate().unwrap();
    }
}
