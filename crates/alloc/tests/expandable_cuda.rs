//! The expandable allocator through the real `cuda` backend (vmm-sys and
//! `CudaDevice`, unchanged), over the fake libcuda (`tests/fake-cuda`) in
//! every `cargo test`, and over a real driver in the `#[ignore]`d twins that
//! `scripts/gpu-check.sh` runs (`-- --ignored`; ordinal `VMMALLOC_TEST_DEVICE`,
//! default 0).
//!
//! The fake holds real bytes (memfd + mmap behind every mapping), so data
//! integrity is checked end to end: every block is filled with its own pattern
//! through `copy_to_device` and read back with `copy_from_device` when it is
//! freed, after `empty_cache`, and after every reclaim or injected fault.
//!
//! The fake keeps its state for the life of a process, so each fake test runs
//! in a child process of this binary with its own `FAKE_CUDA_*` environment
//! (`vmmalloc_test_support::in_child`); when the allocator and the device are
//! dropped, the fake must hold nothing (`fakeCudaLive`), not even something
//! its context destruction had to clean up.
//!
//! What the fake proves and what only a GPU can: docs/fake-cuda.md.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{AllocError, Allocation, Allocator};
use vmmalloc_device::cuda::CudaDevice;
use vmmalloc_device::{Device, DeviceError, MIB};
use vmmalloc_test_support::vmm_sys::Driver;
use vmmalloc_test_support::{fake_cuda_library, in_child, FakeCuda};

/// The allocator under test, over the `cuda` backend.
type Alloc = ExpandableAllocator<Arc<CudaDevice>>;

// ---------------------------------------------------------------------------
// Devices

/// Device 0 of the fake, through vmm-sys and the `cuda` backend.
fn open_fake() -> Arc<CudaDevice> {
    let driver = Driver::load_from(fake_cuda_library())
        .unwrap_or_else(|e| panic!("loading the fake libcuda: {e}"));
    Arc::new(CudaDevice::open_with(driver, 0).unwrap_or_else(|e| panic!("fake device 0: {e}")))
}

/// The GPU ordinal of the real-driver twins: `VMMALLOC_TEST_DEVICE`, default 0.
fn gpu_ordinal() -> u32 {
    std::env::var("VMMALLOC_TEST_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The real GPU (`CudaDevice::open`: libcuda.so.1 or `VMMALLOC_CUDA_LIBRARY`).
fn open_gpu() -> Arc<CudaDevice> {
    let ordinal = gpu_ordinal();
    Arc::new(
        CudaDevice::open(ordinal)
            .unwrap_or_else(|e| panic!("cannot open CUDA device {ordinal}: {e}")),
    )
}

/// An allocator with the default options over `dev`.
fn allocator(dev: &Arc<CudaDevice>) -> Alloc {
    ExpandableAllocator::new(Arc::clone(dev), ExpandableConfig::default())
        .unwrap_or_else(|e| panic!("expandable over {}: {e}", dev.caps().name))
}

/// Asserts the fake holds nothing of device 0 any more: every reservation,
/// handle, mapping and event given back, the context released, and nothing
/// left for the context's destruction to clean up. Call after dropping the
/// allocator and the device.
#[track_caller]
fn assert_all_gone(fake: &FakeCuda) {
    fake.check(0);
    let l = fake.live(0);
    assert!(l.is_all_gone(), "the fake still holds {l:?}");
}

// ---------------------------------------------------------------------------
// Blocks with a pattern

/// A deterministic generator (SplitMix64) for the scripted workloads.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (n > 0; the bias is irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Bytes of one tile of a pattern.
const TILE: usize = 4096;

/// `len` bytes of the pattern of `seed`: a pseudo-random 4 KiB tile of its
/// own per seed, repeated, each repetition stamped with its index in its
/// first 8 bytes. A block moved, shifted or overwritten by a neighbour is
/// caught; built with `memcpy`s only (these tests run unoptimised).
fn pattern(len: u64, seed: u64) -> Vec<u8> {
    let tile: Vec<u8> = (0..TILE as u64 / 8)
        .flat_map(|i| mix(seed.wrapping_mul(0x1_0000_0001) ^ i).to_le_bytes())
        .collect();
    let len = len as usize;
    let mut v = Vec::with_capacity(len + TILE);
    for t in 0..len.div_ceil(TILE) {
        let at = v.len();
        v.extend_from_slice(&tile);
        v[at..at + 8].copy_from_slice(&(t as u64 ^ seed.rotate_left(32)).to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A live allocation and the seed of the pattern written into it.
#[derive(Debug, Clone, Copy)]
struct Block {
    alloc: Allocation,
    seed: u64,
}

impl Block {
    /// Writes the pattern of `seed` over the requested bytes of `alloc`.
    fn fill(dev: &CudaDevice, alloc: Allocation, seed: u64) -> Block {
        dev.copy_to_device(alloc.ptr, &pattern(alloc.requested, seed))
            .unwrap_or_else(|e| panic!("writing {alloc:?}: {e}"));
        Block { alloc, seed }
    }

    /// Reads the block back and checks every byte.
    #[track_caller]
    fn verify(&self, dev: &CudaDevice) {
        let want = pattern(self.alloc.requested, self.seed);
        let mut got = vec![0u8; want.len()];
        dev.copy_from_device(self.alloc.ptr, &mut got)
            .unwrap_or_else(|e| panic!("reading {:?}: {e}", self.alloc));
        if got == want {
            return;
        }
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!(
                "block {:#x} ({} bytes, seed {}): byte {i} is {:#04x}, wrote {:#04x}",
                self.alloc.ptr, self.alloc.requested, self.seed, got[i], want[i]
            );
        }
    }

    /// Verifies the block, then frees it.
    #[track_caller]
    fn verify_and_free(self, dev: &CudaDevice, a: &Alloc) {
        self.verify(dev);
        a.free(self.alloc.ptr)
            .unwrap_or_else(|e| panic!("free {:?}: {e}", self.alloc));
    }
}

/// `a.validate()`, naming the step on failure.
#[track_caller]
fn validate(a: &Alloc, step: &str) {
    if let Err(e) = a.validate() {
        panic!("validate after {step}: {e}");
    }
}

/// Asserts the live blocks are pairwise disjoint.
#[track_caller]
fn assert_disjoint(blocks: &[Block]) {
    let mut spans: Vec<(u64, u64)> = blocks
        .iter()
        .map(|b| (b.alloc.ptr, b.alloc.ptr + b.alloc.size))
        .collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "overlapping blocks {:x?} and {:x?}",
            w[0],
            w[1]
        );
    }
}

/// After everything is freed and the cache emptied, the allocator holds
/// nothing: no allocation, no mapped or pooled page, no reserved byte.
#[track_caller]
fn assert_empty(a: &Alloc) {
    let st = a.stats();
    assert_eq!(st.allocated_bytes.all().current, 0, "{st:?}");
    assert_eq!(st.reserved_bytes.all().current, 0, "{st:?}");
    assert_eq!((st.pages_mapped, st.pages_pooled), (0, 0), "{st:?}");
}

// ---------------------------------------------------------------------------
// The scripted workload and the integrity scenario, shared by the fake tests
// and their real-GPU twins

/// Request sizes of the workload: small-pool (≤ 1 MiB) and large-pool
/// requests, page-aligned and not, so that blocks share pages.
const SIZES: [u64; 11] = [
    512,
    1000,
    4096,
    65_536 + 3,
    300 * 1024,
    MIB,
    MIB + 1,
    3 * MIB + 4096,
    6 * MIB,
    9 * MIB + 123,
    17 * MIB,
];

/// Most bytes the workload keeps live at once.
const BUDGET: u64 = 96 * MIB;

/// A seeded run of mallocs and frees of mixed sizes on two streams, with
/// blocks also used by the other stream (`record_stream`), a mid-run
/// `empty_cache`, `validate` after every step and every block's bytes checked
/// at free. Ends with everything freed and the cache emptied.
fn scripted_workload(dev: &Arc<CudaDevice>, steps: usize) {
    let a = allocator(dev);
    let streams = [
        dev.create_stream().expect("create stream 1"),
        dev.create_stream().expect("create stream 2"),
    ];
    assert_ne!(streams[0], streams[1]);
    let mut rng = Rng(0x5eed);
    let mut live: Vec<Block> = Vec::new();
    let mut live_bytes = 0u64;
    for step in 0..steps {
        let r = rng.below(100);
        if live.is_empty() || (r < 55 && live_bytes < BUDGET) {
            let size = SIZES[rng.below(SIZES.len() as u64) as usize];
            let stream = streams[rng.below(2) as usize];
            let alloc = a
                .malloc(size, stream)
                .unwrap_or_else(|e| panic!("step {step}: malloc({size}, {stream}): {e}"));
            assert!(alloc.size >= size && alloc.requested == size, "{alloc:?}");
            assert_eq!(alloc.stream, stream);
            live.push(Block::fill(dev, alloc, step as u64));
            live_bytes += size;
        } else if r < 62 {
            // Used by the other stream too: reused only after its work.
            let b = live[rng.below(live.len() as u64) as usize];
            let other = if b.alloc.stream == streams[0] {
                streams[1]
            } else {
                streams[0]
            };
            a.record_stream(b.alloc.ptr, other)
                .unwrap_or_else(|e| panic!("step {step}: record_stream: {e}"));
        } else if r < 64 {
            dev.synchronize_stream(streams[rng.below(2) as usize])
                .unwrap_or_else(|e| panic!("step {step}: synchronize_stream: {e}"));
        } else {
            let b = live.swap_remove(rng.below(live.len() as u64) as usize);
            live_bytes -= b.alloc.requested;
            b.verify_and_free(dev, &a);
        }
        validate(&a, &format!("step {step}"));
        if step == steps / 2 {
            a.empty_cache().expect("empty_cache mid-run");
            validate(&a, "empty_cache mid-run");
            assert_disjoint(&live);
            for b in &live {
                b.verify(dev);
            }
        }
    }
    let st = a.stats();
    assert_eq!(st.num_ooms, 0, "{st:?}");
    assert!(st.allocation.all().allocated as usize > steps / 3, "{st:?}");
    assert_disjoint(&live);
    for b in live.drain(..) {
        b.verify_and_free(dev, &a);
    }
    validate(&a, "freeing everything");
    a.empty_cache().expect("final empty_cache");
    validate(&a, "final empty_cache");
    assert_empty(&a);
}

/// Data integrity while pages move: blocks on stream 1 with free gaps between
/// them, then stream 2 asks for more than was ever mapped, and `empty_cache`
/// unmaps the gaps; every surviving block keeps its bytes throughout, and
/// memory freed and reused holds the new owner's bytes.
fn integrity(dev: &Arc<CudaDevice>) {
    let a = allocator(dev);
    let s1 = dev.create_stream().expect("create stream 1");
    let s2 = dev.create_stream().expect("create stream 2");
    let mut live = Vec::new();
    for i in 0..24u64 {
        let size = if i % 2 == 0 { 3 * MIB + 4096 } else { 1000 + i };
        let alloc = a.malloc(size, s1).expect("malloc on stream 1");
        live.push(Block::fill(dev, alloc, 1000 + i));
        validate(&a, "malloc on stream 1");
    }
    // Free every other large block: free gaps between live neighbours that
    // share their edge pages.
    let mut kept = Vec::new();
    for (i, b) in live.into_iter().enumerate() {
        if i % 4 == 0 {
            b.verify_and_free(dev, &a);
            validate(&a, "free on stream 1");
        } else {
            kept.push(b);
        }
    }
    for b in &kept {
        b.verify(dev);
    }
    // Stream 2, then more on stream 1 into the gaps.
    for (i, size) in [20 * MIB, 6 * MIB, 4096, 3 * MIB].into_iter().enumerate() {
        let stream = if i % 2 == 0 { s2 } else { s1 };
        let alloc = a.malloc(size, stream).expect("malloc after the gaps");
        kept.push(Block::fill(dev, alloc, 5000 + i as u64));
        validate(&a, "malloc after the gaps");
    }
    assert_disjoint(&kept);
    for b in &kept {
        b.verify(dev);
    }
    a.empty_cache().expect("empty_cache");
    validate(&a, "empty_cache");
    for b in &kept {
        b.verify(dev);
    }
    // Reuse after free returns the new owner's bytes, not the old ones.
    let b = kept.remove(0);
    let size = b.alloc.requested;
    let stream = b.alloc.stream;
    b.verify_and_free(dev, &a);
    let again = Block::fill(dev, a.malloc(size, stream).expect("malloc again"), 9999);
    again.verify(dev);
    kept.push(again);
    for b in kept {
        b.verify_and_free(dev, &a);
        validate(&a, "final frees");
    }
    a.empty_cache().expect("final empty_cache");
    validate(&a, "final empty_cache");
    assert_empty(&a);
}

// ---------------------------------------------------------------------------
// Over the fake

/// The scripted workload through the `cuda` backend over the fake; then the
/// fake holds nothing once the allocator and the device are dropped.
#[test]
fn workload_over_the_fake() {
    in_child(
        "workload_over_the_fake",
        &[("FAKE_CUDA_CAPACITY_MB", "256")],
        || {
            let fake = FakeCuda::attach();
            let dev = open_fake();
            scripted_workload(&dev, 400);
            fake.assert_clean(0);
            assert!(fake.calls("cuMemMap") > 0 && fake.calls("cuMemUnmap") > 0);
            drop(dev);
            assert_all_gone(&fake);
        },
    );
}

/// Every block keeps its bytes while pages are reclaimed and moved.
#[test]
fn integrity_over_the_fake() {
    in_child(
        "integrity_over_the_fake",
        &[("FAKE_CUDA_CAPACITY_MB", "128")],
        || {
            let fake = FakeCuda::attach();
            let dev = open_fake();
            integrity(&dev);
            fake.assert_clean(0);
            drop(dev);
            assert_all_gone(&fake);
        },
    );
}

/// A full 64 MiB device of 4 MiB blocks, every other one freed: 32 MiB free
/// in 4 MiB gaps. A 28 MiB block, larger than any gap but smaller than all
/// the free memory, must succeed (the allocator remaps the gaps' pages behind
/// fresh addresses), on the blocks' stream and then on another one, and the
/// surviving blocks keep their bytes.
#[test]
fn fragmented_device_serves_a_block_larger_than_any_gap() {
    in_child(
        "fragmented_device_serves_a_block_larger_than_any_gap",
        &[("FAKE_CUDA_CAPACITY_MB", "64")],
        || {
            let fake = FakeCuda::attach();
            let dev = open_fake();
            let a = allocator(&dev);
            let s1 = dev.create_stream().unwrap();
            let s2 = dev.create_stream().unwrap();
            const BLOCK: u64 = 4 * MIB;
            let mut blocks = Vec::new();
            let oom = loop {
                match a.malloc(BLOCK, s1) {
                    Ok(alloc) => blocks.push(Block::fill(&dev, alloc, blocks.len() as u64)),
                    Err(e) => break e,
                }
                validate(&a, "filling the device");
                assert!(blocks.len() <= 16, "more than 64 MiB handed out");
            };
            assert!(oom.is_out_of_memory(), "{oom}");
            assert_eq!(blocks.len(), 16, "a 64 MiB device holds 16 blocks of 4 MiB");
            validate(&a, "out of memory");
            let mut kept = Vec::new();
            for (i, b) in blocks.into_iter().enumerate() {
                if i % 2 == 1 {
                    b.verify_and_free(&dev, &a);
                    validate(&a, "freeing every other block");
                } else {
                    kept.push(b);
                }
            }
            let free = 8 * BLOCK;
            let big = free - BLOCK;
            assert!(big > BLOCK && big < free);
            for (stream, seed) in [(s1, 100), (s2, 200)] {
                let alloc = a
                    .malloc(big, stream)
                    .unwrap_or_else(|e| panic!("{} MiB on {stream}: {e}", big / MIB));
                let b = Block::fill(&dev, alloc, seed);
                validate(&a, "the big block");
                let mut all = kept.clone();
                all.push(b);
                assert_disjoint(&all);
                for k in &kept {
                    k.verify(&dev);
                }
                b.verify_and_free(&dev, &a);
                validate(&a, "freeing the big block");
            }
            for b in kept {
                b.verify_and_free(&dev, &a);
            }
            a.empty_cache().unwrap();
            validate(&a, "empty_cache");
            assert_empty(&a);
            fake.assert_clean(0);
            drop(a);
            drop(dev);
            assert_all_gone(&fake);
        },
    );
}

/// Unpinning through the real backend: the allocator capped at 1 GiB (a
/// memory fraction; chunks of at most 128 MiB), six 128 MiB blocks live, a
/// freed 128 MiB chunk with a 16 MiB block carved from it (pinning it). A
/// 200 MiB block on another stream needs the pinned chunk's free pages: the
/// 16 MiB block's page move to a chunk of their own (device synchronize,
/// copies through host memory, unmap, map, set access) and every live byte
/// survives.
fn unpinning(dev: &Arc<CudaDevice>) {
    let total = dev.caps().total_memory;
    let cfg = ExpandableConfig {
        memory_fraction: ((1024 * MIB + MIB) as f64 / total as f64).min(1.0),
        max_chunk: Some(128 * MIB),
        ..ExpandableConfig::default()
    };
    let a = ExpandableAllocator::new(Arc::clone(dev), cfg).unwrap();
    let s1 = dev.create_stream().unwrap();
    let s2 = dev.create_stream().unwrap();
    let live: Vec<Block> = (0..6)
        .map(|i| Block::fill(dev, a.malloc(128 * MIB, s1).unwrap(), i))
        .collect();
    let big = a.malloc(128 * MIB, s1).unwrap();
    a.free(big.ptr).unwrap();
    let small = Block::fill(dev, a.malloc(16 * MIB, s1).unwrap(), 10);
    assert_eq!(small.alloc.ptr, big.ptr);
    validate(&a, "pinned");
    let y = a
        .malloc(200 * MIB, s2)
        .unwrap_or_else(|e| panic!("the pinned chunk's free pages come back: {e}"));
    let y = Block::fill(dev, y, 11);
    assert_eq!(a.stats().chunk_unpins, 1);
    validate(&a, "unpinned");
    small.verify(dev);
    for b in &live {
        b.verify(dev);
    }
    for b in live.into_iter().chain([small, y]) {
        b.verify_and_free(dev, &a);
    }
    a.empty_cache().unwrap();
    validate(&a, "empty_cache");
    assert_empty(&a);
}

#[test]
fn unpinning_over_the_fake() {
    in_child(
        "unpinning_over_the_fake",
        &[("FAKE_CUDA_CAPACITY_MB", "1024")],
        || {
            let fake = FakeCuda::attach();
            let dev = open_fake();
            unpinning(&dev);
            fake.assert_clean(0);
            drop(dev);
            assert_all_gone(&fake);
        },
    );
}

/// How an injected fault may surface.
#[derive(Debug, Clone, Copy)]
enum Surfaces {
    /// As `AllocError::OutOfMemory` (or not at all, if recovered).
    OutOfMemory,
    /// As the driver's error code through `AllocError::Device` (or not at all).
    DriverCode(u32),
}

/// A workload under one injected fault (`FAKE_CUDA_FAIL`): each operation
/// that fails is retried once and must then succeed; every fault surfaces as
/// `expect` says (at most one: the fake fails one call); `validate` holds
/// after every step; live blocks keep their bytes; and nothing leaks.
fn survives_fault(entry: &str, nth: u64, expect: Surfaces) {
    let fake = FakeCuda::attach();
    let dev = open_fake();
    let a = allocator(&dev);
    let streams = [dev.create_stream().unwrap(), dev.create_stream().unwrap()];
    let mut errors: Vec<AllocError> = Vec::new();
    let mut retry = |what: &str, f: &mut dyn FnMut() -> Result<(), AllocError>| {
        if let Err(e) = f() {
            eprintln!("{what}: failed once ({e}); retrying");
            errors.push(e);
            f().unwrap_or_else(|e| panic!("{what} failed again: {e}"));
        }
    };
    let mut live: Vec<Block> = Vec::new();
    let sizes = [
        3 * MIB,
        1000,
        5 * MIB + 7,
        65_536,
        9 * MIB,
        2 * MIB,
        300_000,
    ];
    for round in 0..2u64 {
        for (i, &size) in sizes.iter().enumerate() {
            let stream = streams[i % 2];
            let mut got = None;
            retry(&format!("malloc({size})"), &mut || {
                got = Some(a.malloc(size, stream)?);
                Ok(())
            });
            live.push(Block::fill(&dev, got.unwrap(), round * 100 + i as u64));
            validate(&a, &format!("malloc({size})"));
            for b in &live {
                b.verify(&dev);
            }
        }
        // Free half, then give the cache back (unmaps, releases).
        let mut i = 0;
        live.retain(|b| {
            i += 1;
            if i % 2 == 0 {
                b.verify_and_free(&dev, &a);
                false
            } else {
                true
            }
        });
        validate(&a, "frees");
        retry("empty_cache", &mut || a.empty_cache());
        validate(&a, "empty_cache");
        for b in &live {
            b.verify(&dev);
        }
    }
    for b in live {
        b.verify_and_free(&dev, &a);
    }
    retry("final empty_cache", &mut || a.empty_cache());
    validate(&a, "final empty_cache");
    assert_empty(&a);
    let calls = fake.calls(entry);
    assert!(
        calls >= nth,
        "the injected {entry} #{nth} never happened ({calls} calls)"
    );
    assert!(
        errors.len() <= 1,
        "one injected fault, {} errors: {errors:?}",
        errors.len()
    );
    for e in &errors {
        match expect {
            Surfaces::OutOfMemory => assert!(e.is_out_of_memory(), "{e:?}"),
            Surfaces::DriverCode(code) => assert!(
                matches!(e, AllocError::Device(DeviceError::Driver { code: c, .. }) if *c == code),
                "expected CUresult {code}: {e:?}"
            ),
        }
    }
    eprintln!("{entry}: {} error(s) surfaced: {errors:?}", errors.len());
    fake.assert_clean(0);
    drop(a);
    drop(dev);
    assert_all_gone(&fake);
}

/// The third `cuMemCreate` runs out of memory (the fake's default code for it).
#[test]
fn fault_create_out_of_memory() {
    in_child(
        "fault_create_out_of_memory",
        &[("FAKE_CUDA_FAIL", "cuMemCreate:3")],
        || survives_fault("cuMemCreate", 3, Surfaces::OutOfMemory),
    );
}

/// The third `cuMemCreate` fails with `CUDA_ERROR_UNKNOWN`.
#[test]
fn fault_create_driver_error() {
    in_child(
        "fault_create_driver_error",
        &[("FAKE_CUDA_FAIL", "cuMemCreate:3:999")],
        || survives_fault("cuMemCreate", 3, Surfaces::DriverCode(999)),
    );
}

/// The second `cuMemMap` fails: the allocator rolls the page back.
#[test]
fn fault_map() {
    in_child("fault_map", &[("FAKE_CUDA_FAIL", "cuMemMap:2")], || {
        survives_fault("cuMemMap", 2, Surfaces::DriverCode(999))
    });
}

/// The fourth `cuMemSetAccess` fails after its page was mapped.
#[test]
fn fault_set_access() {
    in_child(
        "fault_set_access",
        &[("FAKE_CUDA_FAIL", "cuMemSetAccess:4")],
        || survives_fault("cuMemSetAccess", 4, Surfaces::DriverCode(999)),
    );
}

/// The first `cuMemUnmap` (in `empty_cache`) fails.
#[test]
fn fault_unmap() {
    in_child("fault_unmap", &[("FAKE_CUDA_FAIL", "cuMemUnmap:1")], || {
        survives_fault("cuMemUnmap", 1, Surfaces::DriverCode(999))
    });
}

// ---------------------------------------------------------------------------
// Over a real GPU (scripts/gpu-check.sh)

/// [`workload_over_the_fake`] on a real GPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn workload_on_gpu() {
    let dev = open_gpu();
    scripted_workload(&dev, 400);
}

/// [`integrity_over_the_fake`] on a real GPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn integrity_on_gpu() {
    let dev = open_gpu();
    integrity(&dev);
}

/// [`unpinning_over_the_fake`] on a real GPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn unpinning_on_gpu() {
    let dev = open_gpu();
    unpinning(&dev);
}
