//! A budget shared by the processes on one GPU, through the C ABI (issue
//! 33, part 2; docs/share.md). The device's allocator is a member when
//! `VMMALLOC_CONF` holds `share:NAME`; these calls read and change the
//! group from inside the member (`vmmalloc share NAME` does the same from
//! outside).
//!
//! ```c
//! char*   vmmalloc_share_info_json(int device);  // the group as JSON; free with vmmalloc_free_string; NULL on failure
//! int64_t vmmalloc_share_set_cap(int device, uint64_t cap, int64_t expect_revision);     // new revision, or -1
//! int64_t vmmalloc_share_set_total(int device, uint64_t total, int64_t expect_revision); // new revision, or -1
//! ```
//!
//! `cap` `UINT64_MAX` means no cap; 0 means nothing (the member gives back
//! everything it can and creates nothing), as `vmmalloc share NAME --cap
//! PID=0` and Python's `share_set_cap(0)`. A total is 0 or at least 2 MiB,
//! at most the memory of the device the group was made on. A call waits at
//! most 1 s for the group file's lock (a member stopped while holding it),
//! then fails naming the holder. `expect_revision` < 0 changes whatever
//! the revision; >= 0 refuses the change (-1, `vmmalloc_last_error` says
//! "stale") unless the group is still at that revision. The device's
//! allocator is created (and joins) on first use, so a cap can be set
//! before the first allocation.

use super::{entry, fail, owned_c_string, runtime, LError, LInfo};
use crate::diag;
use crate::error::Error;
use std::ffi::{c_char, c_int};
use std::sync::Arc;
use vmmalloc_alloc::share::{GroupInfo, Member};

/// The member of device `device` (created on first use), or an error
/// naming the missing `share` key.
fn member(rt: &runtime::Runtime, device: c_int) -> Result<Arc<Member>, Error> {
    let d = rt.device(device)?;
    d.check()?;
    d.share.clone().ok_or_else(|| {
        Error::invalid(format!(
            "device {}: not a member of a shared budget (set VMMALLOC_CONF share:NAME, docs/share.md)",
            d.ordinal
        ))
    })
}

/// The group as JSON: `name`, `path`, `total`, `used`, `revision`, `me`
/// (this process's pid), `reaped` (pids of dead members this read gave
/// back), `members` (`pid`, `used`, `cap` (`null`: none), `cap_rev`,
/// `state` (`active` | `deferred`), `cached`, `want`): the group's own
/// serialization ([`GroupInfo`]) and `me`.
pub fn info_json(g: &GroupInfo) -> serde_json::Value {
    let mut v = serde_json::to_value(g).unwrap_or_default();
    if let Some(map) = v.as_object_mut() {
        map.insert("me".into(), std::process::id().into());
    }
    v
}

/// Device `device`'s shared budget as JSON ([`info_json`]); dead members'
/// bytes are given back first. Free it with `vmmalloc_free_string`; NULL
/// on failure (not a member, a missing or corrupt file).
#[no_mangle]
pub extern "C" fn vmmalloc_share_info_json(device: c_int) -> *mut c_char {
    entry("vmmalloc_share_info_json", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        let r = member(&rt, device).and_then(|m| {
            let g = m.info().map_err(|e| Error::invalid(e.to_string()))?;
            serde_json::to_string(&info_json(&g)).map_err(super::json_error)
        });
        match r {
            Ok(j) => owned_c_string(&j),
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_share_info_json({device}): {m}"),
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// Runs a change of the group, logging it; -1 on failure.
fn change(
    call: String,
    device: c_int,
    f: impl FnOnce(&Member, Option<u64>) -> Result<u64, vmmalloc_alloc::share::ShareError>,
    expect_revision: i64,
) -> i64 {
    let rt = runtime::runtime();
    let expect = u64::try_from(expect_revision).ok();
    let r =
        member(&rt, device).and_then(|m| f(&m, expect).map_err(|e| Error::invalid(e.to_string())));
    match r {
        Ok(rev) => {
            diag::log(rt.log_level(), LInfo, &format!("{call}: revision {rev}"));
            rev.min(i64::MAX as u64) as i64
        }
        Err(m) => {
            fail(&rt, LError, format!("{call}: {m}"));
            -1
        }
    }
}

/// Sets this process's cap in device `device`'s shared budget to `cap`
/// bytes (`UINT64_MAX`: none). Lowering it below what the allocator holds
/// makes it give back at once (cached memory, then the pressure callback);
/// live memory is never revoked. With `expect_revision` >= 0 the change is
/// refused unless the group is still at that revision. Returns the new
/// revision, or -1 (reason in `vmmalloc_last_error`).
#[no_mangle]
pub extern "C" fn vmmalloc_share_set_cap(device: c_int, cap: u64, expect_revision: i64) -> i64 {
    entry("vmmalloc_share_set_cap", -1, || {
        change(
            format!("vmmalloc_share_set_cap({device}, {cap}, {expect_revision})"),
            device,
            |m, expect| m.set_cap(cap, expect),
            expect_revision,
        )
    })
}

/// Sets the total of device `device`'s shared budget to `total` bytes
/// (refused below what the members hold). `expect_revision` as for
/// [`vmmalloc_share_set_cap`]. Returns the new revision, or -1.
#[no_mangle]
pub extern "C" fn vmmalloc_share_set_total(device: c_int, total: u64, expect_revision: i64) -> i64 {
    entry("vmmalloc_share_set_total", -1, || {
        change(
            format!("vmmalloc_share_set_total({device}, {total}, {expect_revision})"),
            device,
            |m, expect| m.set_total(total, expect),
            expect_revision,
        )
    })
}
