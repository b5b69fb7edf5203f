//! Panic safety through the C ABI (issue 27): a panic inside a device call —
//! standing in for any bug while an allocator's state is half-updated —
//! fails that device for good: the call and every later one on the device
//! return `VMMALLOC_E_FAILED` with an error naming the panic, nothing is
//! handed out from it again, and the other devices carry on. Also the
//! driver-error code, from the same fault injector.
//!
//! The exported functions are called as a C caller would, over `device:host`
//! (real memory), with device 0 wrapped in a fault injector
//! (`wrap_devices_for_tests`).

use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::{Arc, Mutex, MutexGuard};
use vmmalloc::*;
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::{Call, Device};

const MIB: usize = 1 << 20;

type Injected = FaultInjecting<Arc<dyn Device>>;

/// The fault injector around device 0 of the current configuration.
static DEVICE0: Mutex<Option<Arc<Injected>>> = Mutex::new(None);

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh state with `conf`; device 0 opens behind a fault injector.
fn fresh(conf: &str) -> Arc<Injected> {
    vmmalloc_reset_for_tests();
    *DEVICE0.lock().unwrap() = None;
    wrap_devices_for_tests(Some(Box::new(|dev: Arc<dyn Device>, ordinal| {
        if ordinal != 0 {
            return dev;
        }
        let d = Arc::new(FaultInjecting::with_plan(dev, FaultPlan::None));
        *DEVICE0.lock().unwrap() = Some(d.clone());
        d as Arc<dyn Device>
    })));
    let c = CString::new(conf).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { vmmalloc_configure(c.as_ptr()) }, 0, "{conf}");
    // Opens device 0 (and its injector).
    let (rc, p) = malloc(512, 0);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    vmmalloc_free(p, 512, 0, std::ptr::null_mut());
    let d = DEVICE0
        .lock()
        .unwrap()
        .clone()
        .expect("device 0 was opened");
    d
}

fn last_error() -> String {
    let p = vmmalloc_last_error();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string owned by the library, copied at once.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn malloc(size: usize, device: c_int) -> (c_int, *mut c_void) {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write.
    let rc = unsafe { vmmalloc_try_malloc(size, device, std::ptr::null_mut(), &mut out) };
    (rc, out)
}

fn stats_json(device: c_int) -> Option<String> {
    let p = vmmalloc_memory_stats_json(device);
    if p.is_null() {
        return None;
    }
    // SAFETY: an owned C string from the library, read once and freed once.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { vmmalloc_free_string(p) };
    Some(s)
}

/// Checks that device 0 has failed with `why` and device 1 still works.
fn device0_failed_for_good(why: &str, live: *mut c_void) {
    let named = |what: &str| {
        let e = last_error();
        assert!(
            e.contains(why) && e.contains("device 0"),
            "{what}: the error must name the panic: {e:?}"
        );
    };
    for size in [512, 4 * MIB, 60 * MIB] {
        let (rc, p) = malloc(size, 0);
        assert_eq!((rc, p), (VMMALLOC_E_FAILED, std::ptr::null_mut()), "{size}");
        named("malloc");
    }
    vmmalloc_free(live, 28 * MIB, 0, std::ptr::null_mut());
    named("free");
    vmmalloc_record_stream(live, std::ptr::null_mut());
    named("record_stream");
    assert_eq!(stats_json(0), None);
    named("memory_stats_json");
    assert_eq!(vmmalloc_validate(0), -1);
    named("validate");
    assert_eq!(vmmalloc_reset_peak_stats(0), -1);
    named("reset_peak_stats");
    vmmalloc_empty_cache();
    named("empty_cache");
    assert_eq!(vmmalloc_pool_begin(0, 1, 1), -1);
    named("pool_begin");
    // Still failed after all that.
    assert_eq!(malloc(512, 0).0, VMMALLOC_E_FAILED);
    // Device 1 is untouched.
    let (rc, p) = malloc(4 * MIB, 1);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    // SAFETY: a live host-device allocation of 4 MiB.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0x5A, 4 * MIB) };
    vmmalloc_free(p, 4 * MIB, 1, std::ptr::null_mut());
    assert_eq!(last_error(), "");
    assert_eq!(vmmalloc_validate(1), 0, "{}", last_error());
}

/// Over `backend:expandable`: the panic hits the `cuMemCreate` of a chunk
/// split (28 MiB live, 24 MiB freed as three 8 MiB chunks, then 4 MiB that
/// splits the first; the figures of expandable_faults.rs's split script),
/// under the allocator's lock, which fails.
#[test]
fn a_panic_inside_a_split_fails_the_device_for_good() {
    let _g = serial();
    let conf = "device:host,device_count:2,capacity_gb:0.0625,log:off,backend:expandable,\
                split_threshold:0.4,split_slack_mb:0,grow_mb:0";
    let dev = fresh(conf);
    let (rc, live) = malloc(28 * MIB, 0);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    let (rc, freed) = malloc(24 * MIB, 0);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    vmmalloc_free(freed, 24 * MIB, 0, std::ptr::null_mut());
    let n = dev.hook().seen(Call::Create) + 1;
    dev.hook().set_plan(FaultPlan::Nth {
        call: Call::Create,
        n,
        kind: FaultKind::Panic,
    });
    let (rc, p) = malloc(4 * MIB, 0);
    assert_eq!(dev.hook().injected(), 1, "the split made the create");
    assert_eq!((rc, p), (VMMALLOC_E_FAILED, std::ptr::null_mut()));
    let why = "a panic in malloc: injected panic in create";
    assert!(last_error().contains(why), "{}", last_error());
    dev.hook().set_plan(FaultPlan::None);
    device0_failed_for_good(why, live);
    vmmalloc_reset_for_tests();
    wrap_devices_for_tests(None);
}

/// Over `backend:caching`, whose lock does not fail by itself: the panic in
/// its `cuMemAlloc` unwinds to the C ABI's entry point, which marks the
/// device failed.
#[test]
fn a_panic_in_any_policy_fails_the_device_for_good() {
    let _g = serial();
    let dev = fresh("device:host,device_count:2,capacity_gb:0.0625,log:off,backend:caching");
    let (rc, live) = malloc(28 * MIB, 0);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    let n = dev.hook().seen(Call::Alloc) + 1;
    dev.hook().set_plan(FaultPlan::Nth {
        call: Call::Alloc,
        n,
        kind: FaultKind::Panic,
    });
    let (rc, p) = malloc(24 * MIB, 0);
    assert_eq!(dev.hook().injected(), 1);
    assert_eq!((rc, p), (VMMALLOC_E_FAILED, std::ptr::null_mut()));
    let why = "a panic in vmmalloc_malloc: injected panic in alloc";
    assert!(
        last_error().contains("injected panic in alloc"),
        "{}",
        last_error()
    );
    dev.hook().set_plan(FaultPlan::None);
    device0_failed_for_good(why, live);
    vmmalloc_reset_for_tests();
    wrap_devices_for_tests(None);
}

/// A driver error (not a panic) is `VMMALLOC_E_DRIVER`, and the device
/// keeps working: only panics fail a device.
#[test]
fn a_driver_error_is_its_own_code_and_fails_nothing() {
    let _g = serial();
    let dev = fresh("device:host,capacity_gb:0.0625,log:off,backend:expandable");
    let n = dev.hook().seen(Call::Create) + 1;
    dev.hook().set_plan(FaultPlan::Nth {
        call: Call::Create,
        n,
        kind: FaultKind::Driver(999),
    });
    let (rc, p) = malloc(16 * MIB, 0);
    assert_eq!(
        (rc, p),
        (VMMALLOC_E_DRIVER, std::ptr::null_mut()),
        "{}",
        last_error()
    );
    assert!(last_error().contains("injected"), "{}", last_error());
    let (rc, p) = malloc(16 * MIB, 0);
    assert_eq!(rc, VMMALLOC_OK, "{}", last_error());
    vmmalloc_free(p, 16 * MIB, 0, std::ptr::null_mut());
    assert_eq!(vmmalloc_validate(0), 0, "{}", last_error());
    vmmalloc_reset_for_tests();
    wrap_devices_for_tests(None);
}
