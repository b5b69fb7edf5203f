//! Sleep and wake (issue 12): tags, pause and resume of the expandable
//! allocator, on `host` (real bytes) and `sim`, with `validate()` after every
//! step and fault injection at every driver call inside pause and resume.

use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig};
use vmmalloc_alloc::{
    set_thread_tag, tag_stats_of, AllocError, Allocation, Allocator, Sleep, Stream, TagStats,
};
use vmmalloc_alloc_harness::{pattern_check, pattern_fill, tagged};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, Introspect, GIB, MIB};

fn host(capacity: u64) -> Arc<HostDevice> {
    Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"))
}

fn tags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn tag_of<A: Allocator>(a: &A, tag: &str) -> TagStats {
    tag_stats_of(a)
        .into_iter()
        .find(|t| t.tag == tag)
        .unwrap_or_else(|| panic!("no stats for tag {tag:?}"))
}

/// Worked example: a pattern survives pause with backup while another
/// allocation reuses the physical memory, and comes back at the same address.
#[test]
fn host_backup_survives_reuse_and_resumes_at_the_same_address() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let keep = a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 99, keep.ptr, keep.size).unwrap();
    let w = tagged(&a, "host-weights", &[24 * MIB, 3 * MIB + 4096, 1000]);
    for (i, b) in w.iter().enumerate() {
        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    let mapped = tag_of(&a, "host-weights").mapped_bytes;
    let free_before = dev.mem_info().unwrap().free;
    let released = a.pause(&tags(&["host-weights"]), true).unwrap();
    a.validate().unwrap();
    assert!(
        released as f64 >= 0.99 * mapped as f64,
        "released {released} of {mapped}"
    );
    assert!(dev.mem_info().unwrap().free - free_before >= released);
    let t = tag_of(&a, "host-weights");
    assert!(t.paused);
    assert_eq!(t.paused_bytes, w.iter().map(|b| b.size).sum::<u64>());
    assert_eq!(t.backup_bytes, t.paused_bytes);
    assert_eq!(t.mapped_bytes, 0);
    for b in &w {
        assert!(!dev.is_accessible(b.ptr, 1), "paused memory still mapped");
    }
    // The snapshot shows the paused blocks as such.
    let paused: Vec<u64> = a
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == vmmalloc_alloc::BlockState::Paused)
        .map(|b| b.address)
        .collect();
    assert_eq!(paused.len(), w.len());
    assert!(w.iter().all(|b| paused.contains(&b.ptr)));
    // Another allocation takes (more than) the memory the tag gave back.
    let other = a.malloc(56 * MIB, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 7, other.ptr, other.size).unwrap();
    a.validate().unwrap();
    // Allocating with the paused tag fails clearly and resumes nothing.
    set_thread_tag("host-weights").unwrap();
    let e = a.malloc(MIB, Stream::DEFAULT).unwrap_err();
    set_thread_tag("").unwrap();
    assert!(
        matches!(&e, AllocError::Sleep(m) if m.contains("paused")),
        "{e}"
    );
    // Resume needs the memory back: out of memory while `other` lives, and
    // the tag stays paused with its backups.
    let e = a.resume(&tags(&["host-weights"])).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(e.to_string().contains("host-weights"), "{e}");
    a.validate().unwrap();
    assert!(tag_of(&a, "host-weights").paused);
    pattern_check(&*dev, 7, other.ptr, other.size).unwrap();
    a.free(other.ptr).unwrap();
    let mapped_back = a.resume(&tags(&["host-weights"])).unwrap();
    assert!(mapped_back >= w.iter().map(|b| b.size).sum::<u64>());
    a.validate().unwrap();
    for (i, b) in w.iter().enumerate() {
        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    pattern_check(&*dev, 99, keep.ptr, keep.size).unwrap();
    assert!(!tag_of(&a, "host-weights").paused);
    for b in w {
        a.free(b.ptr).unwrap();
    }
    a.validate().unwrap();
}

/// Without backup the addresses stay valid: mapped and accessible after resume.
#[test]
fn host_without_backup_addresses_are_mapped_after_resume() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let w = tagged(&a, "host-kv", &[10 * MIB, 700, 5 * MIB]);
    let s = a.pause(&tags(&["host-kv"]), false).unwrap();
    assert!(s >= 15 * MIB, "{s}");
    assert_eq!(tag_of(&a, "host-kv").backup_bytes, 0);
    a.validate().unwrap();
    a.resume(&[]).unwrap();
    a.validate().unwrap();
    for (i, b) in w.iter().enumerate() {
        assert!(dev.is_accessible(b.ptr, b.size));
        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    // New allocations with the tag work again, in the tag's segments.
    let more = tagged(&a, "host-kv", &[2 * MIB]);
    a.validate().unwrap();
    for b in w.into_iter().chain(more) {
        a.free(b.ptr).unwrap();
    }
}

/// Target: pause without backup returns ≥ 99 % of the tagged mapped bytes
/// to the driver, on `sim` (an 80 GiB device) and `host`.
#[test]
fn pause_returns_at_least_99_percent_of_tagged_bytes() {
    let sim = Arc::new(SimDevice::with_capacity(80 * GIB));
    let a = ExpandableAllocator::new(sim.clone(), ExpandableConfig::default()).unwrap();
    let _other = a.malloc(3 * GIB, Stream::DEFAULT).unwrap();
    let mut sizes = vec![GIB; 30];
    sizes.extend((0..200).map(|i| (i % 7 + 1) * 3 * MIB + 512 * i));
    sizes.extend((0..500).map(|i| 4096 + 100 * i));
    let w = tagged(&a, "sim-weights", &sizes);
    for (i, b) in w.iter().enumerate() {
        if i % 3 == 0 {
            a.free(b.ptr).unwrap();
        }
    }
    let mapped = tag_of(&a, "sim-weights").mapped_bytes;
    let free0 = sim.mem_info().unwrap().free;
    let released = a.pause(&tags(&["sim-weights"]), false).unwrap();
    let gained = sim.mem_info().unwrap().free - free0;
    a.validate().unwrap();
    eprintln!("sim: tagged mapped {mapped}, released {released}, driver free +{gained}");
    assert!(gained as f64 >= 0.99 * mapped as f64);
    a.resume(&tags(&["sim-weights"])).unwrap();
    a.validate().unwrap();

    let dev = host(256 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let _x = a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
    let sizes: Vec<u64> = (0..40).map(|i| (i % 5 + 1) * MIB + 512 * i).collect();
    let _w = tagged(&a, "host-99", &sizes);
    let mapped = tag_of(&a, "host-99").mapped_bytes;
    let free0 = dev.mem_info().unwrap().free;
    a.pause(&tags(&["host-99"]), false).unwrap();
    let gained = dev.mem_info().unwrap().free - free0;
    eprintln!("host: tagged mapped {mapped}, driver free +{gained}");
    assert!(gained as f64 >= 0.99 * mapped as f64);
    a.validate().unwrap();
}

/// Bad input: unknown tags, pausing a paused tag, resuming an awake one, bad
/// names; nothing changes and nothing is lost.
#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let w = tagged(&a, "bad-a", &[3 * MIB]);
    pattern_fill(&*dev, 1, w[0].ptr, w[0].size).unwrap();
    let e = a
        .pause(&tags(&["bad-a", "bad-never-seen", "bad-nor-this"]), true)
        .unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("'bad-never-seen'") && m.contains("'bad-nor-this'"),
        "{m}"
    );
    assert!(!tag_of(&a, "bad-a").paused);
    let e = a.resume(&tags(&["bad-a"])).unwrap_err();
    assert!(e.to_string().contains("not paused"), "{e}");
    assert!(a.pause(&tags(&[&"x".repeat(65)]), false).is_err());
    assert!(a.pause(&tags(&["a,b"]), false).is_err());
    a.pause(&tags(&["bad-a"]), true).unwrap();
    let e = a.pause(&tags(&["bad-a"]), true).unwrap_err();
    assert!(e.to_string().contains("already paused"), "{e}");
    a.validate().unwrap();
    a.resume(&tags(&["bad-a"])).unwrap();
    pattern_check(&*dev, 1, w[0].ptr, w[0].size).unwrap();
    a.validate().unwrap();
}

/// Freeing a paused block is allowed (its backup is dropped); resume maps
/// only what is still live.
#[test]
fn freeing_a_paused_block_drops_its_backup() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let w = tagged(&a, "free-paused", &[4 * MIB, 6 * MIB]);
    pattern_fill(&*dev, 2, w[1].ptr, w[1].size).unwrap();
    a.pause(&tags(&["free-paused"]), true).unwrap();
    a.free(w[0].ptr).unwrap();
    a.validate().unwrap();
    let t = tag_of(&a, "free-paused");
    assert_eq!((t.backup_bytes, t.paused_bytes), (6 * MIB, 6 * MIB));
    let mapped = a.resume(&[]).unwrap();
    assert_eq!(mapped, 6 * MIB);
    pattern_check(&*dev, 2, w[1].ptr, w[1].size).unwrap();
    a.validate().unwrap();
}

/// Pause waits for the streams that used the memory (the host model fails
/// an unmap under queued work) and refuses during graph capture.
#[test]
fn pause_waits_for_streams_and_refuses_during_capture() {
    let dev = host(64 * MIB);
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let s1 = dev.create_stream().unwrap();
    let w = tagged(&a, "stream-tag", &[4 * MIB]);
    a.record_stream(w[0].ptr, s1).unwrap();
    dev.streams()
        .submit(Stream::DEFAULT, w[0].ptr, w[0].size)
        .unwrap();
    dev.streams().submit(s1, w[0].ptr, w[0].size).unwrap();
    dev.begin_capture(s1).unwrap();
    let e = a.pause(&tags(&["stream-tag"]), false).unwrap_err();
    assert!(e.to_string().contains("capturing"), "{e}");
    dev.end_capture(s1).unwrap();
    a.validate().unwrap();
    a.pause(&tags(&["stream-tag"]), false).unwrap();
    a.validate().unwrap();
    a.resume(&tags(&["stream-tag"])).unwrap();
    a.validate().unwrap();
}

/// Other tags keep allocating and freeing on other threads while one tag
/// is paused and resumed.
#[test]
fn pause_and_resume_are_thread_safe_against_other_tags() {
    let dev = host(256 * MIB);
    let a = Arc::new(ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap());
    let w = tagged(&*a, "mt-paused", &[8 * MIB, 100]);
    pattern_fill(&*dev, 5, w[0].ptr, w[0].size).unwrap();
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let (a, dev) = (a.clone(), dev.clone());
            std::thread::spawn(move || {
                set_thread_tag(if t == 0 { "mt-other" } else { "" }).unwrap();
                for i in 0..200u64 {
                    let b = a.malloc((i % 9 + 1) * 300_000, Stream::DEFAULT).unwrap();
                    pattern_fill(&*dev, i, b.ptr, 4096.min(b.size)).unwrap();
                    pattern_check(&*dev, i, b.ptr, 4096.min(b.size)).unwrap();
                    a.free(b.ptr).unwrap();
                }
            })
        })
        .collect();
    for _ in 0..20 {
        a.pause(&tags(&["mt-paused"]), true).unwrap();
        a.resume(&tags(&["mt-paused"])).unwrap();
    }
    for h in workers {
        h.join().unwrap();
    }
    a.validate().unwrap();
    pattern_check(&*dev, 5, w[0].ptr, w[0].size).unwrap();
}

// ---------------------------------------------------------------------------
// Fault injection (generic over the device: host here, cuda over the fake below)

type FDev = FaultInjecting<Arc<dyn Device>>;

/// A scenario touching every call pause and resume make: an untagged block,
/// tagged blocks (one used on a second stream, one freed to a pending event),
/// an emptied cache. Returns the allocator and the live tagged blocks (filled).
fn scenario(dev: &Arc<FDev>) -> (ExpandableAllocator<Arc<FDev>>, Vec<Allocation>) {
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let s1 = dev.create_stream().unwrap();
    let _keep = a.malloc(3 * MIB, Stream::DEFAULT).unwrap();
    let gone = a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    a.free(gone.ptr).unwrap();
    a.empty_cache().unwrap();
    let w = tagged(&a, "fault-tag", &[6 * MIB, 5 * MIB + 512, 2000, 4 * MIB]);
    a.record_stream(w[1].ptr, s1).unwrap();
    a.record_stream(w[3].ptr, s1).unwrap();
    a.free(w[3].ptr).unwrap(); // pending on an event of s1
    let w: Vec<Allocation> = w.into_iter().take(3).collect();
    for (i, b) in w.iter().enumerate() {
        pattern_fill(dev.inner().as_ref(), i as u64, b.ptr, b.size).unwrap();
    }
    (a, w)
}

fn check_patterns(dev: &Arc<FDev>, w: &[Allocation]) -> Result<(), String> {
    for (i, b) in w.iter().enumerate() {
        pattern_check(dev.inner().as_ref(), i as u64, b.ptr, b.size)?;
    }
    Ok(())
}

fn host_dyn() -> Arc<dyn Device> {
    host(64 * MIB)
}

/// On a model device, nothing may be left once the allocator is gone.
fn host_gone(d: &Arc<dyn Device>) {
    if let Some(m) = d.introspect() {
        assert!(m.live().is_empty(), "device holds {:?}", m.live());
    }
}

/// Calls of each kind made by a clean pause (with backup) or a clean resume.
fn calls_in(make: &dyn Fn() -> Arc<dyn Device>, phase: &str) -> Vec<(Call, u64)> {
    let dev = Arc::new(FaultInjecting::with_plan(make(), FaultPlan::None));
    let (a, _w) = scenario(&dev);
    let seen =
        |d: &Arc<FDev>| -> Vec<u64> { Call::ALL.iter().map(|&c| d.hook().seen(c)).collect() };
    if phase == "resume" {
        a.pause(&tags(&["fault-tag"]), true).unwrap();
    }
    let mid = seen(&dev);
    if phase == "pause" {
        a.pause(&tags(&["fault-tag"]), true).unwrap();
    } else {
        a.resume(&tags(&["fault-tag"])).unwrap();
    }
    let after = seen(&dev);
    Call::ALL
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, after[i] - mid[i]))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// Every driver call inside pause fails once (driver error, then out of
/// memory): pause fails before changing anything (the data is intact and the
/// tag awake) or leaves the tag paused and consistent; either way a clean
/// resume restores every byte and nothing leaks. Returns the runs made.
fn pause_faults(make: &dyn Fn() -> Arc<dyn Device>, gone: &dyn Fn(&Arc<dyn Device>)) -> usize {
    let kinds = calls_in(make, "pause");
    eprintln!("pause calls: {kinds:?}");
    assert!(kinds.iter().any(|k| k.0 == Call::Unmap));
    assert!(kinds.iter().any(|k| k.0 == Call::CopyDtoH));
    // Backups come from the device (pinned on `cuda`); a failure falls back.
    assert!(kinds.iter().any(|k| k.0 == Call::HostAlloc));
    let mut runs = 0;
    for &(call, count) in &kinds {
        for n in 1..=count {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let base_dev = make();
                {
                    let dev =
                        Arc::new(FaultInjecting::with_plan(base_dev.clone(), FaultPlan::None));
                    let (a, w) = scenario(&dev);
                    let base = dev.hook().seen(call);
                    dev.hook().set_plan(FaultPlan::Nth {
                        call,
                        n: base + n,
                        kind,
                    });
                    let r = a.pause(&tags(&["fault-tag"]), true);
                    dev.hook().set_plan(FaultPlan::None);
                    let ctx = format!("{call:?} #{n} {kind:?}: pause {r:?}");
                    a.validate().unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    if tag_of(&a, "fault-tag").paused {
                        a.resume(&tags(&["fault-tag"]))
                            .unwrap_or_else(|e| panic!("{ctx}: resume: {e}"));
                    } else {
                        assert!(r.is_err(), "{ctx}");
                    }
                    a.validate().unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    check_patterns(&dev, &w).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    runs += 1;
                }
                gone(&base_dev);
            }
        }
    }
    runs
}

/// Every driver call inside resume fails once (driver error, then out of
/// memory): resume fails and the tag is paused as before (validate holds,
/// backups kept, the memory given back again), or it succeeds by another
/// route; a clean resume then restores every byte, and nothing leaks.
/// Returns the resumes rolled back.
fn resume_faults(make: &dyn Fn() -> Arc<dyn Device>, gone: &dyn Fn(&Arc<dyn Device>)) -> usize {
    let kinds = calls_in(make, "resume");
    eprintln!("resume calls: {kinds:?}");
    assert!(kinds.iter().any(|k| k.0 == Call::Create));
    assert!(kinds.iter().any(|k| k.0 == Call::CopyHtoD));
    let mut rolled_back = 0;
    for &(call, count) in &kinds {
        for n in 1..=count {
            for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                let base_dev = make();
                {
                    let dev =
                        Arc::new(FaultInjecting::with_plan(base_dev.clone(), FaultPlan::None));
                    let (a, w) = scenario(&dev);
                    a.pause(&tags(&["fault-tag"]), true).unwrap();
                    let free_paused = dev.inner().mem_info().unwrap().free;
                    let base = dev.hook().seen(call);
                    dev.hook().set_plan(FaultPlan::Nth {
                        call,
                        n: base + n,
                        kind,
                    });
                    let r = a.resume(&tags(&["fault-tag"]));
                    dev.hook().set_plan(FaultPlan::None);
                    let ctx = format!("{call:?} #{n} {kind:?}: resume {r:?}");
                    a.validate().unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    if r.is_err() {
                        rolled_back += 1;
                        let t = tag_of(&a, "fault-tag");
                        assert!(t.paused && t.backup_bytes > 0, "{ctx}: {t:?}");
                        // Rolled back: the memory is given back again (a
                        // chunk whose unmap or release failed may stay).
                        let free_now = dev.inner().mem_info().unwrap().free;
                        assert!(free_now + 6 * MIB >= free_paused, "{ctx}");
                        a.resume(&tags(&["fault-tag"]))
                            .unwrap_or_else(|e| panic!("{ctx}: clean resume: {e}"));
                    }
                    a.validate().unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    check_patterns(&dev, &w).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                }
                gone(&base_dev);
            }
        }
    }
    assert!(rolled_back > 0);
    rolled_back
}

#[test]
fn every_failed_call_in_pause_is_survived_on_host() {
    let runs = pause_faults(&host_dyn, &host_gone);
    eprintln!("{runs} faulty pauses survived");
}

#[test]
fn every_failed_call_in_resume_rolls_back_on_host() {
    let n = resume_faults(&host_dyn, &host_gone);
    eprintln!("{n} faulty resumes rolled back");
}

// ---------------------------------------------------------------------------
// The `cuda` backend over the fake libcuda (real bytes behind every mapping)

mod over_the_fake {
    use super::*;
    use vmmalloc_device::cuda::CudaDevice;
    use vmmalloc_test_support::vmm_sys::Driver;
    use vmmalloc_test_support::{fake_cuda_library, in_child, FakeCuda};

    fn open_fake() -> Arc<dyn Device> {
        let driver = Driver::load_from(fake_cuda_library()).expect("loading the fake libcuda");
        Arc::new(CudaDevice::open_with(driver, 0).expect("fake device 0"))
    }

    fn all_gone(fake: &FakeCuda) {
        fake.check(0);
        let l = fake.live(0);
        assert!(l.is_all_gone(), "the fake still holds {l:?}");
    }

    /// The worked example through vmm-sys and `CudaDevice`: pause with
    /// backup gives ≥ 99 % of the tagged bytes back as `cuMemGetInfo` sees
    /// it, another block reuses them, resume restores every byte in place.
    #[test]
    fn pause_and_resume_through_the_cuda_backend() {
        in_child(
            "over_the_fake::pause_and_resume_through_the_cuda_backend",
            &[("FAKE_CUDA_CAPACITY_MB", "64")],
            || {
                let fake = FakeCuda::attach();
                let dev = open_fake();
                {
                    let a =
                        ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
                    let w = tagged(&a, "fake-weights", &[24 * MIB, 3 * MIB + 4096, 1000]);
                    for (i, b) in w.iter().enumerate() {
                        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                    let mapped = tag_of(&a, "fake-weights").mapped_bytes;
                    let free0 = dev.mem_info().unwrap().free;
                    a.pause(&tags(&["fake-weights"]), true).unwrap();
                    let gained = dev.mem_info().unwrap().free - free0;
                    assert!(
                        gained as f64 >= 0.99 * mapped as f64,
                        "{gained} of {mapped}"
                    );
                    a.validate().unwrap();
                    let other = a.malloc(60 * MIB, Stream::DEFAULT).unwrap();
                    pattern_fill(&*dev, 9, other.ptr, other.size).unwrap();
                    assert!(a
                        .resume(&tags(&["fake-weights"]))
                        .unwrap_err()
                        .is_out_of_memory());
                    a.validate().unwrap();
                    a.free(other.ptr).unwrap();
                    a.resume(&tags(&["fake-weights"])).unwrap();
                    a.validate().unwrap();
                    for (i, b) in w.iter().enumerate() {
                        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                }
                fake.assert_clean(0);
                drop(dev);
                all_gone(&fake);
            },
        );
    }

    /// Backups through the `cuda` backend are page-locked (`cuMemHostAlloc`,
    /// one per live block), the data survives, a second pause reuses the
    /// buffers the resume kept (no new `cuMemHostAlloc`), and dropping the
    /// allocator frees every one (`cuMemFreeHost`; the fake holds 0 pinned
    /// bytes).
    #[test]
    fn backups_are_pinned_reused_and_freed() {
        in_child(
            "over_the_fake::backups_are_pinned_reused_and_freed",
            &[("FAKE_CUDA_CAPACITY_MB", "64")],
            || {
                let fake = FakeCuda::attach();
                let dev = open_fake();
                {
                    let a =
                        ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
                    let w = tagged(&a, "pinned-w", &[6 * MIB, 3 * MIB + 4096, 1000]);
                    for (i, b) in w.iter().enumerate() {
                        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                    let bytes: u64 = w.iter().map(|b| b.size).sum();
                    let allocs0 = fake.calls("cuMemHostAlloc");
                    assert_eq!(fake.pinned(), (0, 0));
                    a.pause(&tags(&["pinned-w"]), true).unwrap();
                    assert_eq!(fake.calls("cuMemHostAlloc") - allocs0, 3);
                    assert_eq!(
                        fake.pinned(),
                        (bytes, 3),
                        "one pinned buffer per live block"
                    );
                    assert_eq!(tag_of(&a, "pinned-w").backup_bytes, bytes);
                    a.resume(&tags(&["pinned-w"])).unwrap();
                    a.validate().unwrap();
                    for (i, b) in w.iter().enumerate() {
                        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                    // Kept as spares for the next pause, which reuses them.
                    assert_eq!(fake.pinned(), (bytes, 3));
                    for (i, b) in w.iter().enumerate() {
                        pattern_fill(&*dev, 10 + i as u64, b.ptr, b.size).unwrap();
                    }
                    a.pause(&tags(&["pinned-w"]), true).unwrap();
                    assert_eq!(fake.calls("cuMemHostAlloc") - allocs0, 3, "spares reused");
                    // Freeing a paused block drops (frees) its backup.
                    a.free(w[2].ptr).unwrap();
                    assert_eq!(fake.pinned(), (bytes - w[2].size, 2));
                    a.resume(&tags(&["pinned-w"])).unwrap();
                    for (i, b) in w.iter().take(2).enumerate() {
                        pattern_check(&*dev, 10 + i as u64, b.ptr, b.size).unwrap();
                    }
                    // A pause without backup drops the unused spares.
                    a.pause(&tags(&["pinned-w"]), false).unwrap();
                    assert_eq!(fake.pinned(), (0, 0));
                    a.resume(&tags(&["pinned-w"])).unwrap();
                    a.pause(&tags(&["pinned-w"]), true).unwrap();
                    assert_eq!(fake.pinned(), (bytes - w[2].size, 2));
                }
                // Dropping the allocator (tag still paused) frees the backups.
                assert_eq!(fake.pinned(), (0, 0));
                fake.assert_clean(0);
                drop(dev);
                all_gone(&fake);
            },
        );
    }

    /// A failing `cuMemHostAlloc` (out of memory, then a driver error) makes
    /// that backup pageable memory: pause and resume succeed, every byte
    /// comes back, nothing leaks.
    #[test]
    fn failed_pinning_falls_back_without_losing_data() {
        in_child(
            "over_the_fake::failed_pinning_falls_back_without_losing_data",
            &[
                ("FAKE_CUDA_CAPACITY_MB", "64"),
                ("FAKE_CUDA_FAIL", "cuMemHostAlloc:1:2,cuMemHostAlloc:3:999"),
            ],
            || {
                let fake = FakeCuda::attach();
                let dev = open_fake();
                {
                    let a =
                        ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
                    let w = tagged(&a, "pin-fail", &[2 * MIB, 5000, 3 * MIB]);
                    for (i, b) in w.iter().enumerate() {
                        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                    a.pause(&tags(&["pin-fail"]), true).unwrap();
                    assert_eq!(fake.calls("cuMemHostAlloc"), 3);
                    assert_eq!(
                        fake.pinned().1,
                        1,
                        "calls 1 and 3 failed: one pinned buffer"
                    );
                    assert_eq!(
                        tag_of(&a, "pin-fail").backup_bytes,
                        w.iter().map(|b| b.size).sum::<u64>()
                    );
                    a.resume(&tags(&["pin-fail"])).unwrap();
                    a.validate().unwrap();
                    for (i, b) in w.iter().enumerate() {
                        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
                    }
                }
                assert_eq!(fake.pinned(), (0, 0));
                fake.assert_clean(0);
                drop(dev);
                all_gone(&fake);
            },
        );
    }

    /// Fault injection at every call of pause and resume, through the `cuda`
    /// backend over the fake; the fake holds nothing after each run.
    #[test]
    fn every_failed_call_through_the_cuda_backend() {
        in_child(
            "over_the_fake::every_failed_call_through_the_cuda_backend",
            &[("FAKE_CUDA_CAPACITY_MB", "64")],
            || {
                let fake = FakeCuda::attach();
                let gone = |_: &Arc<dyn Device>| {
                    fake.assert_clean(0);
                    assert_eq!(fake.pinned(), (0, 0), "pinned backups leaked");
                };
                let runs = pause_faults(&open_fake, &gone);
                let rolled = resume_faults(&open_fake, &gone);
                eprintln!("fake: {runs} faulty pauses, {rolled} resumes rolled back");
            },
        );
    }
}

// ---------------------------------------------------------------------------
// Over a real GPU (scripts/gpu-check.sh runs `-- --ignored`; the dry run,
// scripts/gpu-dry-run.sh, runs it against the fake libcuda)

/// On a real driver (`CudaDevice::open`: libcuda.so.1 or
/// `VMMALLOC_CUDA_LIBRARY`; ordinal `VMMALLOC_TEST_DEVICE`, default 0):
/// pause with backup gives ≥ 95 % of the tagged bytes back as `cuMemGetInfo`
/// sees them, another allocation can use them, resume restores every byte
/// at the same addresses, and a resume that lacks memory rolls back.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pause_and_resume_on_gpu() {
    use vmmalloc_device::cuda::CudaDevice;
    let ordinal = std::env::var("VMMALLOC_TEST_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let dev: Arc<dyn Device> = Arc::new(
        CudaDevice::open(ordinal).unwrap_or_else(|e| panic!("CUDA device {ordinal}: {e}")),
    );
    let a = ExpandableAllocator::new(dev.clone(), ExpandableConfig::default()).unwrap();
    let w = tagged(
        &a,
        "gpu-weights",
        &[192 * MIB, 40 * MIB + 4096, 1000, 24 * MIB],
    );
    for (i, b) in w.iter().enumerate() {
        pattern_fill(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    let mapped = tag_of(&a, "gpu-weights").mapped_bytes;
    let free0 = dev.mem_info().unwrap().free;
    let released = a.pause(&tags(&["gpu-weights"]), true).unwrap();
    let gained = dev.mem_info().unwrap().free.saturating_sub(free0);
    eprintln!("tagged mapped {mapped}, released {released}, cuMemGetInfo free +{gained}");
    assert!(
        gained as f64 >= 0.95 * mapped as f64,
        "{gained} of {mapped}"
    );
    a.validate().unwrap();
    // The released memory is usable by another allocation.
    let other = a.malloc(mapped / 2, Stream::DEFAULT).unwrap();
    pattern_fill(&*dev, 77, other.ptr, other.size).unwrap();
    a.resume(&tags(&["gpu-weights"])).unwrap();
    a.validate().unwrap();
    for (i, b) in w.iter().enumerate() {
        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    pattern_check(&*dev, 77, other.ptr, other.size).unwrap();
    // A memory fraction that leaves no room: resume fails and rolls back.
    a.pause(&tags(&["gpu-weights"]), true).unwrap();
    a.set_memory_fraction((other.size as f64 + 4.0 * MIB as f64) / dev.caps().total_memory as f64)
        .unwrap();
    let e = a.resume(&tags(&["gpu-weights"])).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(tag_of(&a, "gpu-weights").paused);
    a.validate().unwrap();
    a.set_memory_fraction(1.0).unwrap();
    a.resume(&tags(&["gpu-weights"])).unwrap();
    for (i, b) in w.iter().enumerate() {
        pattern_check(&*dev, i as u64, b.ptr, b.size).unwrap();
    }
    a.validate().unwrap();
}
