//! Sleep and wake through the C ABI: tags, pause, resume (issue 12; design in
//! docs/expandable.md, "Sleep and wake").
//!
//! ```c
//! int     vmmalloc_set_tag(const char* tag);            // this thread's tag ("" = default); 0 / -1
//! char*   vmmalloc_get_tag(void);                       // this thread's tag; free with vmmalloc_free_string
//! int64_t vmmalloc_pause(const char* tags, int backup); // bytes given back, or -1
//! int64_t vmmalloc_resume(const char* tags);            // bytes mapped again, or -1
//! char*   vmmalloc_tag_stats_json(int device);          // [{"tag":..,"paused":..,...}]
//! // A CUDA graph's or MemPool's private pool (PyTorch's MempoolId_t (hi, lo)).
//! int64_t vmmalloc_pool_pause(int device, uint64_t hi, uint64_t lo, int keep); // bytes, or -1
//! int64_t vmmalloc_pool_resume(int device, uint64_t hi, uint64_t lo);          // bytes, or -1
//! ```
//!
//! `tags` is a comma-separated list; `""` (or NULL) means every tag (pause:
//! every non-default tag). Every device with an allocator is paused or
//! resumed; a failure on one device stops there and is reported (devices
//! done before stay done; the error names the device).

use super::{entry, fail, owned_c_string, runtime, LError, LInfo};
use crate::diag;
use std::ffi::{c_char, c_int, CStr};

/// Reads an optional C string as UTF-8 (NULL = "").
///
/// # Safety
///
/// `s` is NULL or a NUL-terminated string valid for reads.
unsafe fn text<'a>(s: *const c_char, what: &str) -> Result<&'a str, String> {
    if s.is_null() {
        return Ok("");
    }
    // SAFETY: non-null and, per the caller's contract, NUL-terminated.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| format!("{what} is not valid UTF-8"))
}

/// Parses a tag list and checks every name is known; unknown names are
/// named in the error.
fn tag_list(list: &str) -> Result<Vec<String>, String> {
    let tags = vmmalloc_alloc::parse_tag_list(list).map_err(|e| e.to_string())?;
    let unknown: Vec<String> = tags
        .iter()
        .filter(|t| !vmmalloc_alloc::is_known_tag(t))
        .map(|t| format!("'{t}'"))
        .collect();
    if !unknown.is_empty() {
        return Err(format!(
            "unknown tag(s) {} (no allocation was ever tagged so; nothing changed)",
            unknown.join(", ")
        ));
    }
    Ok(tags)
}

/// Sets the calling thread's tag: its later allocations carry it (`""` or
/// NULL: the default tag). Returns 0, or -1 (tag unchanged) when the tag is
/// not UTF-8, longer than 64 bytes, or holds `,` or a control character.
///
/// # Safety
///
/// `tag` is NULL or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_set_tag(tag: *const c_char) -> c_int {
    entry("vmmalloc_set_tag", -1, || {
        // SAFETY: the caller's contract.
        let r = unsafe { text(tag, "the tag") }
            .and_then(|t| vmmalloc_alloc::set_thread_tag(t).map_err(|e| e.to_string()));
        match r {
            Ok(()) => 0,
            Err(m) => {
                diag::fail(LError, LError, &format!("vmmalloc_set_tag: {m}"));
                -1
            }
        }
    })
}

/// The calling thread's tag (`""` by default); free it with
/// `vmmalloc_free_string`. NULL on failure.
#[no_mangle]
pub extern "C" fn vmmalloc_get_tag() -> *mut c_char {
    entry("vmmalloc_get_tag", std::ptr::null_mut(), || {
        owned_c_string(&vmmalloc_alloc::thread_tag())
    })
}

/// Pauses `tags` on every device with an allocator: waits for their streams,
/// copies live blocks to host memory if `backup` is non-zero, unmaps and
/// releases their physical memory (and the pool), keeping the addresses.
/// Returns the bytes given back to the driver, or -1 with the reason in
/// `vmmalloc_last_error` (unknown tag, tag already paused, a CUDA graph
/// capture underway, a driver failure, a policy that cannot sleep).
///
/// # Safety
///
/// `tags` is NULL or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_pause(tags: *const c_char, backup: c_int) -> i64 {
    // SAFETY: the caller's contract.
    let list = unsafe { text(tags, "tags") };
    run("vmmalloc_pause", list, |names, d| {
        vmmalloc_alloc::sleep_of(&*d.allocator).and_then(|s| s.pause(names, backup != 0))
    })
}

/// Resumes `tags` on every device with an allocator: maps physical memory at
/// the same addresses, grants access and copies backups back. On failure
/// (out of memory included) the tags stay paused on that device. Returns the
/// bytes mapped, or -1 with the reason in `vmmalloc_last_error`.
///
/// # Safety
///
/// `tags` is NULL or a NUL-terminated string valid for reads.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_resume(tags: *const c_char) -> i64 {
    // SAFETY: the caller's contract.
    let list = unsafe { text(tags, "tags") };
    run("vmmalloc_resume", list, |names, d| {
        vmmalloc_alloc::sleep_of(&*d.allocator).and_then(|s| s.resume(names))
    })
}

/// Pauses private pool `(hi, lo)` of `device` (a CUDA graph's, whose id
/// `torch.cuda.CUDAGraph.pool()` returns, or a `torch.cuda.MemPool`'s
/// `.id`): synchronizes the device (a replay in flight must not fault),
/// copies the pool's live blocks to host memory if `keep` is non-zero (else
/// their contents are lost: for pools whose every replay writes before it
/// reads), unmaps every page of the pool and releases the physical memory.
/// Every address stays reserved, so the graph replays at the same addresses
/// once resumed. Returns the bytes given back, or -1 with the reason in
/// `vmmalloc_last_error` (unknown pool, paused already, a capture underway,
/// a policy without pools, a driver failure; nothing changed).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_pause(device: c_int, hi: u64, lo: u64, keep: c_int) -> i64 {
    let call = format!("vmmalloc_pool_pause(device={device}, pool=({hi}, {lo}), keep={keep})");
    pool_op("vmmalloc_pool_pause", call, device, |d| {
        d.pools()?
            .pause_pool((hi, lo), keep != 0)
            .map_err(|e| d.error(e))
    })
}

/// Resumes private pool `(hi, lo)` of `device`: maps physical memory at
/// every page the pool mapped before its pause, grants access to every
/// device that had it, copies the kept contents back. On failure (out of
/// memory included) nothing of the pool stays mapped and it stays paused: a
/// retry once memory is free succeeds. Returns the bytes mapped, or -1 with
/// the reason in `vmmalloc_last_error`.
#[no_mangle]
pub extern "C" fn vmmalloc_pool_resume(device: c_int, hi: u64, lo: u64) -> i64 {
    let call = format!("vmmalloc_pool_resume(device={device}, pool=({hi}, {lo}))");
    pool_op("vmmalloc_pool_resume", call, device, |d| {
        d.pools()?.resume_pool((hi, lo)).map_err(|e| d.error(e))
    })
}

/// Runs a pause or resume of one private pool of `device`.
fn pool_op(
    name: &str,
    call: String,
    device: c_int,
    op: impl FnOnce(&runtime::DeviceState) -> Result<u64, crate::Error>,
) -> i64 {
    entry(name, -1, || {
        let rt = runtime::runtime();
        match rt.device(device).and_then(|d| {
            d.check()?;
            op(d)
        }) {
            Ok(b) => {
                diag::log(rt.log_level(), LInfo, &format!("{call}: {b} bytes"));
                b.min(i64::MAX as u64) as i64
            }
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                -1
            }
        }
    })
}

/// Runs pause or resume on every active device.
fn run(
    name: &str,
    list: Result<&str, String>,
    op: impl Fn(&[String], &runtime::DeviceState) -> Result<u64, vmmalloc_alloc::AllocError>,
) -> i64 {
    entry(name, -1, || {
        let rt = runtime::runtime();
        let call = match &list {
            Ok(l) => format!("{name}({l:?})"),
            Err(_) => format!("{name}(<not UTF-8>)"),
        };
        let names = match list.and_then(tag_list) {
            Ok(n) => n,
            Err(m) => {
                fail(&rt, LError, format!("{call}: {m}"));
                return -1;
            }
        };
        if let Err(m) = rt.config() {
            fail(&rt, LError, format!("{call}: {m}"));
            return -1;
        }
        let mut total: u64 = 0;
        for d in rt.active_devices() {
            if let Err(e) = d.check() {
                fail(&rt, LError, format!("{call}: {e}"));
                return -1;
            }
            if d.capturing() {
                fail(
                    &rt,
                    LError,
                    format!("{call}: device {}: a CUDA graph capture is underway; unmap and release are illegal during capture (nothing changed)", d.ordinal),
                );
                return -1;
            }
            match op(&names, d) {
                Ok(b) => total += b,
                Err(e) => {
                    fail(&rt, LError, format!("{call}: device {}: {e}", d.ordinal));
                    return -1;
                }
            }
        }
        diag::log(rt.log_level(), LInfo, &format!("{call}: {total} bytes"));
        total.min(i64::MAX as u64) as i64
    })
}

/// Device `device`'s memory per tag as a JSON list of objects (`tag`,
/// `paused`, `blocks`, `live_bytes`, `mapped_bytes`, `paused_bytes`,
/// `backup_bytes`); `[]` for a device not used yet. Free it with
/// `vmmalloc_free_string`; NULL on failure.
#[no_mangle]
pub extern "C" fn vmmalloc_tag_stats_json(device: c_int) -> *mut c_char {
    entry("vmmalloc_tag_stats_json", std::ptr::null_mut(), || {
        let rt = runtime::runtime();
        let r = rt.check_ordinal(device).and_then(|o| {
            let stats = match rt.existing(o) {
                Some(d) => {
                    d.check()?;
                    vmmalloc_alloc::tag_stats_of(&*d.allocator)
                }
                None => Vec::new(),
            };
            serde_json::to_string(&stats).map_err(super::json_error)
        });
        match r {
            Ok(j) => owned_c_string(&j),
            Err(m) => {
                fail(
                    &rt,
                    LError,
                    format!("vmmalloc_tag_stats_json({device}): {m}"),
                );
                std::ptr::null_mut()
            }
        }
    })
}

/// Adds per-tag keys to a `memory_stats` map: `vmmalloc.tags.<tag>.<field>`
/// (`<tag>` is `default` for `""`) and the totals `vmmalloc.paused_bytes`,
/// `vmmalloc.backup_bytes`.
pub(crate) fn add_stats(
    m: &mut serde_json::Map<String, serde_json::Value>,
    d: Option<&std::sync::Arc<runtime::DeviceState>>,
) {
    let stats = d
        .map(|d| vmmalloc_alloc::tag_stats_of(&*d.allocator))
        .unwrap_or_default();
    let (mut paused, mut backup) = (0u64, 0u64);
    for t in &stats {
        let name = if t.tag.is_empty() { "default" } else { &t.tag };
        let k = |f: &str| format!("vmmalloc.tags.{name}.{f}");
        m.insert(k("paused"), u64::from(t.paused).into());
        m.insert(k("live_bytes"), t.live_bytes.into());
        m.insert(k("mapped_bytes"), t.mapped_bytes.into());
        m.insert(k("paused_bytes"), t.paused_bytes.into());
        m.insert(k("backup_bytes"), t.backup_bytes.into());
        paused += t.paused_bytes;
        backup += t.backup_bytes;
    }
    m.insert("vmmalloc.paused_bytes".into(), paused.into());
    m.insert("vmmalloc.backup_bytes".into(), backup.into());
}

/// Rows appended to `memory_summary`: one line per tag, saying what is
/// paused and where memory went ("why is memory low?").
pub(crate) fn summary_rows(d: Option<&std::sync::Arc<runtime::DeviceState>>) -> String {
    let stats = d
        .map(|d| vmmalloc_alloc::tag_stats_of(&*d.allocator))
        .unwrap_or_default();
    if stats.iter().all(|t| t.tag.is_empty() && !t.paused) {
        return String::new();
    }
    vmmalloc_alloc::expandable::tag_summary(&stats)
}
