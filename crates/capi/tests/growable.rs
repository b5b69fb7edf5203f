//! The C ABI of growable regions and of the pressure callback, called as a
//! C caller would (over `device:host`: real bytes behind the pointers, so a
//! region's bytes are checked across growth and shrink).

use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use vmmalloc::*;

const MIB: usize = 1 << 20;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn fresh(conf: &str) {
    vmmalloc_reset_for_tests();
    let c = CString::new(conf).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { vmmalloc_configure(c.as_ptr()) }, 0, "{conf}");
}

fn last_error() -> String {
    let p = vmmalloc_last_error();
    assert!(!p.is_null(), "a failure sets the last error");
    // SAFETY: a NUL-terminated string owned by the library, copied at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn info(p: *mut c_void) -> Option<(usize, usize, usize)> {
    let (mut s, mut m, mut x) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    (unsafe { vmmalloc_growable_info(p, &mut s, &mut m, &mut x) } == 0).then_some((s, m, x))
}

fn malloc(size: usize) -> Result<*mut c_void, c_int> {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write.
    match unsafe { vmmalloc_try_malloc(size, 0, std::ptr::null_mut(), &mut out) } {
        0 => Ok(out),
        rc => Err(rc),
    }
}

#[test]
fn a_region_grows_and_shrinks_in_place_with_its_bytes() {
    let _g = serial();
    fresh("device:host,capacity_gb:1,log:off,backend:expandable");
    let p = vmmalloc_growable_create(0, 256 * MIB);
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(info(p), Some((0, 256 * MIB, 0)));
    assert_eq!(vmmalloc_growable_resize(p, 5 * MIB + 3), 0);
    // SAFETY: the region has 5 MiB + 3 mapped, writable host bytes.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x5A, 5 * MIB + 3) };
    for size in [100 * MIB, MIB, 256 * MIB, 5 * MIB + 3] {
        assert_eq!(vmmalloc_growable_resize(p, size), 0, "{}", last_error());
        let (s, _, mapped) = info(p).unwrap();
        assert_eq!(s, size);
        assert!(mapped >= size);
        let keep = size.min(MIB);
        // SAFETY: at least `keep` bytes are mapped at `p`.
        let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), keep) };
        assert!(bytes.iter().all(|&b| b == 0x5A), "bytes survive at {size}");
    }
    assert_eq!(vmmalloc_validate(0), 0);
    // Bad input: beyond max, not a region, destroy twice. State unchanged.
    assert_eq!(vmmalloc_growable_resize(p, 256 * MIB + 1), 2);
    assert!(last_error().contains("max_bytes"), "{}", last_error());
    assert_eq!(info(p).unwrap().0, 5 * MIB + 3);
    let x = malloc(MIB).unwrap();
    assert_eq!(vmmalloc_growable_resize(x, MIB), 2);
    assert!(last_error().contains("not a growable region"));
    assert_eq!(vmmalloc_growable_resize(std::ptr::null_mut(), MIB), 2);
    assert_eq!(vmmalloc_growable_destroy(p), 0);
    assert_eq!(vmmalloc_growable_destroy(p), -1, "destroy twice");
    assert!(info(p).is_none());
    assert_eq!(vmmalloc_validate(0), 0);
    vmmalloc_free(x, MIB, 0, std::ptr::null_mut());
}

#[test]
fn policies_without_regions_say_so() {
    let _g = serial();
    fresh("device:host,capacity_gb:1,log:off,backend:caching");
    assert!(vmmalloc_growable_create(0, MIB).is_null());
    assert!(
        last_error().contains("no growable regions"),
        "{}",
        last_error()
    );
    fresh("device:host,capacity_gb:1,log:off,backend:expandable");
    assert!(vmmalloc_growable_create(0, 0).is_null());
    assert!(vmmalloc_growable_create(7, MIB).is_null(), "bad ordinal");
}

static HELD: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static CALLS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn drop_cache(size: usize, device: c_int) -> usize {
    CALLS.fetch_add(1, Ordering::SeqCst);
    assert_eq!(device, 0);
    let mut freed = 0;
    let mut held = HELD.lock().unwrap();
    while freed < size {
        let Some(p) = held.pop() else { break };
        vmmalloc_free(
            std::ptr::with_exposed_provenance_mut(p),
            64 * MIB,
            0,
            std::ptr::null_mut(),
        );
        freed += 64 * MIB;
    }
    freed
}

extern "C" fn frees_nothing(_: usize, _: c_int) -> usize {
    CALLS.fetch_add(1, Ordering::SeqCst);
    0
}

#[test]
fn the_pressure_callback_rescues_allocations_and_growth() {
    let _g = serial();
    fresh("device:sim,capacity_gb:1,log:off,backend:expandable,on_oom:null");
    CALLS.store(0, Ordering::SeqCst);
    let mut held = Vec::new();
    while let Ok(p) = malloc(64 * MIB) {
        held.push(p.addr());
    }
    assert!(held.len() >= 14, "{} blocks of 64 MiB", held.len());
    *HELD.lock().unwrap() = held;
    // Without a callback: out of memory.
    assert_eq!(malloc(200 * MIB), Err(1));
    assert_eq!(CALLS.load(Ordering::SeqCst), 0);
    // A callback that frees nothing: called once, no retry, still out of memory.
    assert_eq!(vmmalloc_set_pressure_callback(Some(frees_nothing)), 0);
    assert_eq!(malloc(200 * MIB), Err(1));
    assert_eq!(CALLS.load(Ordering::SeqCst), 1);
    // A callback that drops a cache: the allocation succeeds on the retry.
    assert_eq!(vmmalloc_set_pressure_callback(Some(drop_cache)), 0);
    let p = malloc(200 * MIB).expect("rescued");
    assert_eq!(CALLS.load(Ordering::SeqCst), 2);
    // And a region's growth.
    let r = vmmalloc_growable_create(0, 512 * MIB);
    assert_eq!(
        vmmalloc_growable_resize(r, 300 * MIB),
        0,
        "{}",
        last_error()
    );
    assert_eq!(CALLS.load(Ordering::SeqCst), 3);
    assert_eq!(vmmalloc_validate(0), 0);
    assert_eq!(vmmalloc_set_pressure_callback(None), 0);
    assert_eq!(vmmalloc_growable_destroy(r), 0);
    vmmalloc_free(p, 200 * MIB, 0, std::ptr::null_mut());
    for p in HELD.lock().unwrap().drain(..) {
        vmmalloc_free(
            std::ptr::with_exposed_provenance_mut(p),
            64 * MIB,
            0,
            std::ptr::null_mut(),
        );
    }
}

fn stats(device: c_int) -> serde_json::Value {
    let p = vmmalloc_memory_stats_json(device);
    assert!(!p.is_null());
    // SAFETY: an owned NUL-terminated string, freed once below.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: returned by vmmalloc_memory_stats_json, freed once.
    unsafe { vmmalloc_free_string(p) };
    serde_json::from_str(&s).unwrap()
}

#[test]
fn spill_true_runs_past_device_memory_and_reports_it() {
    let _g = serial();
    for spill in [false, true] {
        fresh(&format!(
            "device:sim,capacity_gb:1,log:off,backend:expandable,on_oom:null,spill:{spill}"
        ));
        let mut got = Vec::new();
        for _ in 0..19 {
            match malloc(64 * MIB) {
                Ok(p) => got.push(p),
                Err(rc) => {
                    assert_eq!(rc, 1);
                    assert!(last_error().contains("out of memory"));
                    break;
                }
            }
        }
        let st = stats(0);
        if spill {
            assert_eq!(got.len(), 19, "1.19 GiB on a 1 GiB device");
            assert!(st["vmmalloc.spilled_bytes"].as_i64().unwrap() >= 192 * MIB as i64);
        } else {
            assert!(got.len() < 17);
            assert_eq!(st["vmmalloc.spilled_bytes"], 0);
        }
        assert_eq!(vmmalloc_validate(0), 0);
        for p in got {
            vmmalloc_free(p, 64 * MIB, 0, std::ptr::null_mut());
        }
        vmmalloc_empty_cache();
        assert_eq!(stats(0)["vmmalloc.spilled_bytes"], 0);
    }
}
