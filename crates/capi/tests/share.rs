//! The shared budget's C ABI (docs/share.md) over `device:host`: a process
//! whose `VMMALLOC_CONF` holds `share:NAME` joins the group on its first
//! use of a device, reads it as JSON, lowers its own cap (its cached
//! memory goes back), and sees stale revisions refused. The group file
//! lives in a temporary `VMMALLOC_SHARE_DIR`.

use std::ffi::{c_char, CStr, CString};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use vmmalloc::*;

const MIB: u64 = 1 << 20;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn fresh(conf: &str) {
    vmmalloc_reset_for_tests();
    let dir = std::env::temp_dir().join(format!("vmmalloc-capi-share-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("VMMALLOC_SHARE_DIR", &dir);
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

/// Takes a string the library returned.
fn take(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string from the library, freed once below.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: `p` came from the library and is freed once.
    unsafe { vmmalloc_free_string(p) };
    Some(s)
}

fn info() -> serde_json::Value {
    let j = take(vmmalloc_share_info_json(0)).unwrap_or_else(|| panic!("{}", last_error()));
    serde_json::from_str(&j).unwrap()
}

fn me(g: &serde_json::Value) -> serde_json::Value {
    let pid = u64::from(std::process::id());
    g["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["pid"] == pid)
        .cloned()
        .unwrap_or_else(|| panic!("this process in {g}"))
}

#[test]
fn a_member_reads_its_group_lowers_its_cap_and_gives_back() {
    let _g = serial();
    let name = format!("capi{}", std::process::id());
    fresh(&format!(
        "device:host,capacity_gb:2,log:off,backend:expandable,share:{name}"
    ));
    // Joined on first use, before any allocation: no cap, nothing held.
    let g = info();
    assert_eq!(g["name"], name.as_str());
    assert_eq!(g["total"], 2u64 << 30);
    let m = me(&g);
    assert_eq!((m["used"].as_u64(), m["cap"].is_null()), (Some(0), true));
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is valid for a write.
    let rc = unsafe { vmmalloc_try_malloc(256 << 20, 0, std::ptr::null_mut(), &mut p) };
    assert_eq!(rc, 0, "{}", last_error());
    vmmalloc_free(p, 256 << 20, 0, std::ptr::null_mut());
    let held = me(&info())["used"].as_u64().unwrap();
    assert!(held >= 256 * MIB, "the freed block stays cached: {held}");
    // Lower the cap: the poller gives the cached memory back.
    let rev = info()["revision"].as_i64().unwrap();
    assert_eq!(vmmalloc_share_set_cap(0, 64 * MIB, rev), rev + 1);
    let t0 = Instant::now();
    loop {
        let m = me(&info());
        if m["used"].as_u64().unwrap() <= 64 * MIB {
            assert_eq!(m["state"], "active");
            assert_eq!(m["cap"], 64 * MIB);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "not given back: {m}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "capi share: {} MiB given back {:.1} ms after the cap was lowered",
        held / MIB,
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Above the cap a new block is refused, naming the group.
    let mut q = std::ptr::null_mut();
    // SAFETY: `q` is valid for a write.
    let rc = unsafe { vmmalloc_try_malloc(128 << 20, 0, std::ptr::null_mut(), &mut q) };
    assert_eq!(rc, VMMALLOC_E_OOM);
    assert!(
        last_error().contains(&format!("Shared budget \"{name}\"")),
        "{}",
        last_error()
    );
    // A stale revision is refused and changes nothing.
    assert_eq!(vmmalloc_share_set_cap(0, u64::MAX, rev), -1);
    assert!(last_error().contains("stale"), "{}", last_error());
    assert_eq!(me(&info())["cap"], 64 * MIB);
    // No revision: always applied. The total cannot go below the use.
    assert!(vmmalloc_share_set_cap(0, u64::MAX, -1) > rev);
    assert!(me(&info())["cap"].is_null());
    let mut live = std::ptr::null_mut();
    // SAFETY: `live` is valid for a write.
    let rc = unsafe { vmmalloc_try_malloc(32 << 20, 0, std::ptr::null_mut(), &mut live) };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(vmmalloc_share_set_total(0, MIB, -1), -1);
    assert!(last_error().contains("below"), "{}", last_error());
    assert!(vmmalloc_share_set_total(0, 1 << 30, -1) > 0);
    assert_eq!(info()["total"], 1u64 << 30);
    vmmalloc_free(live, 32 << 20, 0, std::ptr::null_mut());
    assert_eq!(vmmalloc_validate(0), 0);
    vmmalloc_reset_for_tests();
}

#[test]
fn a_process_without_share_is_told_so() {
    let _g = serial();
    fresh("device:host,capacity_gb:1,log:off");
    assert!(vmmalloc_share_info_json(0).is_null());
    assert!(last_error().contains("share:NAME"), "{}", last_error());
    assert_eq!(vmmalloc_share_set_cap(0, MIB, -1), -1);
    assert!(last_error().contains("not a member"), "{}", last_error());
    vmmalloc_reset_for_tests();
}
