//! The C ABI behind the torch companion (python/vmmalloc/companion/): what
//! PyTorch's `CUDAAllocator` interface asks beyond malloc/free, answered by
//! the allocator (the companion only translates types).
//!
//! ```c
//! // Private pools (torch.cuda.MemPool, CUDA graph trees): vmmalloc_alloc::pools;
//! // checkpoints hold no memory (checkpoints.rs).
//! int      vmmalloc_pool_create_or_incref(int device, uint64_t hi, uint64_t lo);
//! int      vmmalloc_pool_use_count(int device, uint64_t hi, uint64_t lo);   // count, or -1
//! int      vmmalloc_pool_set_use_on_oom(int device, uint64_t hi, uint64_t lo, int on);
//! int      vmmalloc_pool_set_no_split(int device, uint64_t hi, uint64_t lo);
//! int      vmmalloc_pool_check_live(int device, uint64_t hi, uint64_t lo,
//!                                   const uint64_t* ptrs, size_t n);       // 1 equal, 0 not, -1 error
//! uint64_t vmmalloc_pool_checkpoint(int device, uint64_t hi, uint64_t lo); // handle, or 0
//! int      vmmalloc_checkpoint_restore(int device, uint64_t handle,
//!              void (*freed)(void* ctx, uint64_t ptr),
//!              void (*allocated)(void* ctx, uint64_t ptr, size_t size, uint64_t stream),
//!              void* ctx);
//! int      vmmalloc_checkpoint_drop(int device, uint64_t handle);
//! char*    vmmalloc_pool_stats_json(int device, uint64_t hi, uint64_t lo);
//! // PyTorch's DeviceStats as VMMALLOC_STATS_LEN int64 values (layout below).
//! int      vmmalloc_device_stats(int device, int64_t* out, size_t n);
//! // Segments and blocks (PyTorch's snapshot()): all pools (only=0) or one (only=1).
//! int      vmmalloc_visit_segments(int device /* -1: all */, int only, uint64_t hi, uint64_t lo,
//!              void (*segment)(void* ctx, const VmmallocSegment* s,
//!                              const VmmallocBlock* blocks, size_t n),
//!              void* ctx);
//! ```
//!
//! `int` results: 0 (or the value asked for) on success, -1 with the reason in
//! `vmmalloc_last_error()`. Callbacks must not unwind.

use crate::config::LogLevel::{Error as LError, Info as LInfo};
use crate::error::Error;
use crate::runtime::{self, DeviceState};
use crate::{diag, entry, owned_c_string};
use std::ffi::{c_char, c_int, c_void};
use vmmalloc_alloc::pools::PoolId;
use vmmalloc_alloc::stats::StatArray;
use vmmalloc_alloc::{BlockState, Snapshot, Stat, Stats};

/// Number of values [`vmmalloc_device_stats`] writes: nine stat arrays
/// (allocation, segment, active, inactive_split, allocated_bytes,
/// reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes), each
/// three stat types (all, small_pool, large_pool) of four values (current,
/// peak, allocated, freed); then num_alloc_retries, num_ooms,
/// oversize_allocations (4 values), oversize_segments (4 values),
/// num_sync_all_streams, num_device_alloc, num_device_free, max_split_size.
/// The order of PyTorch's `DeviceStats` fields (c10/core/CachingDeviceAllocator.h).
pub const VMMALLOC_STATS_LEN: usize = 9 * 3 * 4 + 2 + 4 + 4 + 4;

/// One segment for [`vmmalloc_visit_segments`] (PyTorch's `SegmentInfo`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct VmmallocSegment {
    /// Device ordinal.
    pub device: c_int,
    /// 1 for the large pool, 0 small.
    pub is_large: c_int,
    /// 1 if the segment grows by mapping pages.
    pub is_expandable: c_int,
    /// Device address.
    pub address: u64,
    /// Bytes (mapped blocks only: PyTorch reports mapped ranges).
    pub total_size: u64,
    /// Bytes in allocated blocks.
    pub allocated_size: u64,
    /// Bytes in active blocks.
    pub active_size: u64,
    /// Bytes requested in active blocks.
    pub requested_size: u64,
    /// The owning stream (a `cudaStream_t` value; 0 is the default stream).
    pub stream: u64,
    /// The private pool owning the segment ((0, 0): none).
    pub pool_hi: u64,
    /// Second half of the pool id.
    pub pool_lo: u64,
}

/// One block for [`vmmalloc_visit_segments`] (PyTorch's `BlockInfo`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct VmmallocBlock {
    /// Device address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes requested (0 when free).
    pub requested_size: u64,
    /// 1 if allocated to a caller.
    pub allocated: c_int,
    /// 1 if allocated or waiting for stream work before reuse.
    pub active: c_int,
}

/// The `vmmalloc.graph_pool*` rows of `vmmalloc_memory_stats_json`: how
/// many private pools exist, how many are paused, their share of the
/// allocated and reserved bytes (already in PyTorch's figures), the frees
/// deferred by captures, and the checkpoints alive (which hold nothing).
pub fn pool_totals(d: Option<&DeviceState>) -> Vec<(&'static str, i64)> {
    let (mut pools, mut paused, mut allocated, mut reserved, mut deferred) = (0, 0, 0, 0, 0);
    let mut checkpoints = 0;
    if let Some(d) = d {
        checkpoints = d.checkpoints.counts().0 as i64;
        if let Some(p) = d.allocator.pools() {
            deferred = p.deferred_frees() as i64;
            for id in p.pool_ids() {
                let Ok(s) = p.pool_stats(id) else { continue };
                pools += 1;
                paused += i64::from(s.paused);
                allocated += s.stats.allocated_bytes.all().current;
                reserved += s.stats.reserved_bytes.all().current;
            }
        }
    }
    vec![
        ("vmmalloc.graph_pools", pools),
        ("vmmalloc.graph_pools_paused", paused),
        ("vmmalloc.graph_pool_allocated_bytes", allocated),
        ("vmmalloc.graph_pool_reserved_bytes", reserved),
        ("vmmalloc.deferred_frees", deferred),
        ("vmmalloc.graph_pool_checkpoints", checkpoints),
    ]
}

/// The callback type of [`vmmalloc_visit_segments`].
pub type SegmentFn =
    unsafe extern "C" fn(*mut c_void, *const VmmallocSegment, *const VmmallocBlock, usize);
/// The freed-pointer callback of [`vmmalloc_checkpoint_restore`].
pub type FreedFn = unsafe extern "C" fn(*mut c_void, u64);
/// The allocated-block callback of [`vmmalloc_checkpoint_restore`].
pub type AllocatedFn = unsafe extern "C" fn(*mut c_void, u64, usize, u64);

/// Runs `body` on `device`'s state, logging and returning `on_error` on failure.
fn with_device<T: Clone>(
    name: &str,
    call: String,
    device: c_int,
    on_error: T,
    body: impl FnOnce(&DeviceState) -> Result<T, Error>,
) -> T {
    entry(name, on_error.clone(), || {
        let rt = runtime::runtime();
        match rt.device(device).and_then(|d| body(d)) {
            Ok(v) => {
                diag::log(rt.log_level(), LInfo, &call);
                v
            }
            Err(m) => {
                diag::fail(rt.log_level(), LError, &format!("{call}: {m}"));
                on_error
            }
        }
    })
}

/// PyTorch's `createOrIncrefPool` (every `torch.cuda.MemPool` calls it):
/// creates pool `(hi, lo)` of `device` with use count 1, or adds one user.
/// Returns 0, or -1.
#[no_mangle]
pub extern "C" fn vmmalloc_pool_create_or_incref(device: c_int, hi: u64, lo: u64) -> c_int {
    let call = format!("vmmalloc_pool_create_or_incref(device={device}, pool=({hi}, {lo}))");
    with_device("vmmalloc_pool_create_or_incref", call, device, -1, |d| {
        d.pools()?
            .create_or_incref_pool((hi, lo))
            .map(|()| 0)
            .map_err(|e| d.error(e))
    })
}

/// PyTorch's `getPoolUseCount`: the use count of pool `(hi, lo)`, or -1
/// (unknown pool).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_use_count(device: c_int, hi: u64, lo: u64) -> c_int {
    let call = format!("vmmalloc_pool_use_count(device={device}, pool=({hi}, {lo}))");
    with_device("vmmalloc_pool_use_count", call, device, -1, |d| {
        d.pools()?
            .pool_use_count((hi, lo))
            .map(|n| c_int::try_from(n).unwrap_or(c_int::MAX))
            .map_err(|e| d.error(e))
    })
}

/// PyTorch's `setUseOnOOM` (`MemPool(use_on_oom=True)`; `~MemPool` calls
/// it with 0 from 2.11): with `on` nonzero, a main-pool allocation of
/// `device` that would run out of memory takes a free block of pool
/// `(hi, lo)` instead (`vmmalloc_alloc::pools::PrivatePools::set_use_on_oom`).
/// Returns 0, or -1 (unknown pool).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_set_use_on_oom(
    device: c_int,
    hi: u64,
    lo: u64,
    on: c_int,
) -> c_int {
    let call = format!("vmmalloc_pool_set_use_on_oom(device={device}, pool=({hi}, {lo}), on={on})");
    with_device("vmmalloc_pool_set_use_on_oom", call, device, -1, |d| {
        d.pools()?
            .set_use_on_oom((hi, lo), on != 0)
            .map(|()| 0)
            .map_err(|e| d.error(e))
    })
}

/// PyTorch's `setNoSplit` (`MemPool(no_split=True)`, 2.10+): no block of
/// pool `(hi, lo)` of `device` is split or merged from now on
/// (`vmmalloc_alloc::pools::PrivatePools::set_no_split`). Returns 0, or -1
/// (unknown pool).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_set_no_split(device: c_int, hi: u64, lo: u64) -> c_int {
    let call = format!("vmmalloc_pool_set_no_split(device={device}, pool=({hi}, {lo}))");
    with_device("vmmalloc_pool_set_no_split", call, device, -1, |d| {
        d.pools()?
            .set_no_split((hi, lo))
            .map(|()| 0)
            .map_err(|e| d.error(e))
    })
}

/// PyTorch's `checkPoolLiveAllocations`: 1 if the blocks live in pool
/// `(hi, lo)` are exactly the `n` pointers at `ptrs`, 0 if not, -1 on error
/// (unknown pool, `ptrs` NULL with `n` > 0).
///
/// # Safety
///
/// `ptrs` is valid for reading `n` values (or `n` is 0).
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_pool_check_live(
    device: c_int,
    hi: u64,
    lo: u64,
    ptrs: *const u64,
    n: usize,
) -> c_int {
    let call = format!("vmmalloc_pool_check_live(device={device}, pool=({hi}, {lo}), n={n})");
    let expected: Vec<u64> = if n == 0 {
        Vec::new()
    } else if ptrs.is_null() {
        diag::fail(LError, LError, &format!("{call}: ptrs is NULL"));
        return -1;
    } else {
        // SAFETY: non-null and, per the contract, valid for `n` reads.
        unsafe { std::slice::from_raw_parts(ptrs, n) }.to_vec()
    };
    with_device("vmmalloc_pool_check_live", call, device, -1, |d| {
        // PyTorch's checkPoolLiveAllocations: every allocated block of the
        // pool is expected, and as many as expected.
        let live = d
            .pools()?
            .pool_live_blocks((hi, lo))
            .map_err(|e| d.error(e))?;
        let mut want = expected;
        want.sort_unstable();
        want.dedup();
        Ok(c_int::from(
            live.len() == want.len() && live.iter().all(|b| want.binary_search(&b.ptr).is_ok()),
        ))
    })
}

/// PyTorch's `getCheckpointState`: records the blocks live in pool
/// `(hi, lo)` (holding no memory, see checkpoints.rs). Returns the
/// checkpoint's handle, or 0 (unknown pool, a pool with no users left:
/// PyTorch's "Not expected to checkpoint freeable graph").
#[no_mangle]
pub extern "C" fn vmmalloc_pool_checkpoint(device: c_int, hi: u64, lo: u64) -> u64 {
    let call = format!("vmmalloc_pool_checkpoint(device={device}, pool=({hi}, {lo}))");
    with_device("vmmalloc_pool_checkpoint", call, device, 0, |d| {
        let pools = d.pools()?;
        if pools.pool_use_count((hi, lo)).map_err(|e| d.error(e))? == 0 {
            return Err(Error::invalid(format!(
                "pool ({hi}, {lo}) was released: no checkpoint of it"
            )));
        }
        let blocks = pools.pool_live_blocks((hi, lo)).map_err(|e| d.error(e))?;
        Ok(d.checkpoints.add((hi, lo), blocks))
    })
}

/// PyTorch's `setCheckpointPoolState`: restores checkpoint `handle` of
/// `device`'s pools: frees every block of its pool and allocates the
/// checkpointed blocks again at their addresses. Calls `freed` for each
/// pointer freed and `allocated` for each block allocated again (a pointer
/// may be in both, as in PyTorch's `CheckpointDelta`). Returns 0, or -1
/// (unknown checkpoint, capture underway, pool paused) having changed
/// nothing and called neither.
///
/// # Safety
///
/// `freed` and `allocated` are NULL (skipped) or functions that do not unwind
/// and accept `ctx`.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_checkpoint_restore(
    device: c_int,
    handle: u64,
    freed: Option<FreedFn>,
    allocated: Option<AllocatedFn>,
    ctx: *mut c_void,
) -> c_int {
    let call = format!("vmmalloc_checkpoint_restore(device={device}, checkpoint={handle})");
    let restored = with_device("vmmalloc_checkpoint_restore", call, device, None, |d| {
        d.pool_restore(handle).map(Some)
    });
    let Some(r) = restored else { return -1 };
    if let Some(f) = freed {
        for p in &r.freed {
            // SAFETY: per the contract, `f` accepts `ctx` and does not unwind.
            unsafe { f(ctx, *p) };
        }
    }
    if let Some(f) = allocated {
        for b in &r.allocated {
            // SAFETY: as above.
            unsafe { f(ctx, b.ptr, b.size as usize, b.stream.0) };
        }
    }
    0
}

/// Drops checkpoint `handle` of `device` (PyTorch freed its
/// `AllocatorState`). Returns 0, or -1 (unknown checkpoint).
#[no_mangle]
pub extern "C" fn vmmalloc_checkpoint_drop(device: c_int, handle: u64) -> c_int {
    let call = format!("vmmalloc_checkpoint_drop(device={device}, checkpoint={handle})");
    with_device("vmmalloc_checkpoint_drop", call, device, -1, |d| {
        d.checkpoints.drop_handle(handle).map(|()| 0)
    })
}

/// Pool `(hi, lo)`'s statistics as JSON with PyTorch's `memory_stats()` keys
/// (current values; the pool's share of the device's figures), plus
/// `vmmalloc.live_blocks`, `vmmalloc.use_count`, `vmmalloc.recording`,
/// `vmmalloc.paused` and `vmmalloc.backup_bytes`. Free it with
/// `vmmalloc_free_string`; NULL on failure (unknown pool).
#[no_mangle]
pub extern "C" fn vmmalloc_pool_stats_json(device: c_int, hi: u64, lo: u64) -> *mut c_char {
    let call = format!("vmmalloc_pool_stats_json(device={device}, pool=({hi}, {lo}))");
    with_device(
        "vmmalloc_pool_stats_json",
        call,
        device,
        std::ptr::null_mut(),
        |d| {
            let p = d.pools()?.pool_stats((hi, lo)).map_err(|e| d.error(e))?;
            let mut map = serde_json::to_value(p.stats.to_map()).map_err(crate::json_error)?;
            if let Some(m) = map.as_object_mut() {
                m.insert("vmmalloc.live_blocks".into(), p.live_blocks.into());
                m.insert("vmmalloc.use_count".into(), p.use_count.into());
                m.insert("vmmalloc.recording".into(), p.recording.into());
                m.insert("vmmalloc.paused".into(), p.paused.into());
                m.insert("vmmalloc.backup_bytes".into(), p.backup_bytes.into());
            }
            let text = serde_json::to_string(&map).map_err(crate::json_error)?;
            Ok(owned_c_string(&text))
        },
    )
}

fn push_stat(out: &mut Vec<i64>, s: &Stat) {
    out.extend([s.current, s.peak, s.allocated, s.freed]);
}

fn push_array(out: &mut Vec<i64>, a: &StatArray) {
    a.0.iter().for_each(|s| push_stat(out, s));
}

/// `stats` in [`VMMALLOC_STATS_LEN`] values, PyTorch's `DeviceStats` order.
pub fn stats_values(stats: &Stats) -> Vec<i64> {
    let mut v = Vec::with_capacity(VMMALLOC_STATS_LEN);
    for a in [
        &stats.allocation,
        &stats.segment,
        &stats.active,
        &stats.inactive_split,
        &stats.allocated_bytes,
        &stats.reserved_bytes,
        &stats.active_bytes,
        &stats.inactive_split_bytes,
        &stats.requested_bytes,
    ] {
        push_array(&mut v, a);
    }
    let n = |x: u64| i64::try_from(x).unwrap_or(i64::MAX);
    v.push(n(stats.num_alloc_retries));
    v.push(n(stats.num_ooms));
    push_stat(&mut v, &stats.oversize_allocations);
    push_stat(&mut v, &stats.oversize_segments);
    v.push(n(stats.num_sync_all_streams));
    v.push(n(stats.num_device_alloc));
    v.push(n(stats.num_device_free));
    v.push(stats.max_split_size);
    v
}

/// `device`'s statistics net of `vmmalloc_reset_accumulated_stats`, `None`
/// before its first use; `Err` (logged as `name`'s failure) for a bad
/// ordinal.
fn device_stats_of(name: &str, device: c_int) -> Result<Option<Stats>, ()> {
    let rt = runtime::runtime();
    let ordinal = rt.check_ordinal(device).map_err(|m| {
        diag::fail(rt.log_level(), LError, &format!("{name}({device}): {m}"));
    })?;
    Ok(rt.existing(ordinal).map(|d| {
        let mut s = d.allocator.stats();
        crate::accumulated::apply(d, &mut s);
        s
    }))
}

/// PyTorch's `getDeviceStats`: writes `device`'s statistics (the figures of
/// `vmmalloc_memory_stats_json`, zeros before its first allocation) as
/// [`VMMALLOC_STATS_LEN`] values to `out` (at most `n`). Returns the number
/// of values written, or -1.
///
/// # Safety
///
/// `out` is valid for writing `n` values.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_device_stats(device: c_int, out: *mut i64, n: usize) -> c_int {
    if out.is_null() {
        diag::fail(LError, LError, "vmmalloc_device_stats: out is NULL");
        return -1;
    }
    entry("vmmalloc_device_stats", -1, || {
        let Ok(stats) = device_stats_of("vmmalloc_device_stats", device) else {
            return -1;
        };
        let stats = stats.unwrap_or_default();
        let values = stats_values(&stats);
        let k = values.len().min(n);
        // SAFETY: `out` is non-null and valid for `n` >= `k` writes.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, k) };
        k as c_int
    })
}

/// Callback of [`vmmalloc_private_pool_stats`]: `(ctx, pool_hi, pool_lo,
/// values)`, `values` 12 numbers (`all`, `small_pool`, `large_pool`, each
/// `current`, `peak`, `allocated`, `freed`), valid during the call.
pub type PrivatePoolStatsFn = Option<unsafe extern "C" fn(*mut c_void, u64, u64, *const i64)>;

/// PyTorch 2.13+'s `DeviceStats::reserved_bytes_by_private_pools`: calls
/// `cb` once per private pool of `device` that ever had memory mapped (a
/// released pool stays, its `current` 0, until the allocator is made
/// again), in pool-id order, with its reserved bytes as
/// [`PrivatePoolStatsFn`] describes (accumulated totals net of
/// `vmmalloc_reset_accumulated_stats`). Returns the number of pools, or -1.
///
/// # Safety
///
/// `cb` is a valid function; `ctx` is passed to it as is.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_private_pool_stats(
    device: c_int,
    cb: PrivatePoolStatsFn,
    ctx: *mut c_void,
) -> c_int {
    let Some(cb) = cb else {
        diag::fail(LError, LError, "vmmalloc_private_pool_stats: cb is NULL");
        return -1;
    };
    entry("vmmalloc_private_pool_stats", -1, || {
        let stats = match device_stats_of("vmmalloc_private_pool_stats", device) {
            Err(()) => return -1,
            Ok(None) => return 0,
            Ok(Some(s)) => s,
        };
        let mut n: c_int = 0;
        for (&(hi, lo), arr) in &stats.reserved_bytes_by_private_pools {
            let mut v = Vec::with_capacity(12);
            push_array(&mut v, arr);
            // SAFETY: the caller's `cb` reads the 12 values during the call.
            unsafe { cb(ctx, hi, lo, v.as_ptr()) };
            n = n.saturating_add(1);
        }
        n
    })
}

/// Calls `cb` for each mapped run of each segment of `snapshot` (of pool
/// `only`'s segments when given).
fn visit(
    snapshot: &Snapshot,
    device: c_int,
    only: Option<PoolId>,
    cb: SegmentFn,
    ctx: *mut c_void,
) {
    for seg in &snapshot.segments {
        if only.is_some_and(|o| o != seg.pool) {
            continue;
        }
        let pool = seg.pool;
        // PyTorch reports one segment per contiguous mapped range: unmapped
        // blocks of an expandable segment are not part of any
        // (CUDACachingAllocator.cpp, snapshot()). Its Python side computes
        // each block's address from the segment's and the sizes before it.
        // A paused pool's blocks have no physical memory behind them either
        // (its reserved bytes are 0): they are left out as unmapped pages
        // are, so the segments' total_size adds up to reserved_bytes as in
        // PyTorch's snapshot, which has no state for a live block without
        // memory (Module.cpp writes only active_allocated,
        // active_pending_free, inactive); issue 40, docs/pytorch.md.
        let mut runs: Vec<Vec<VmmallocBlock>> = vec![Vec::new()];
        for b in &seg.blocks {
            if matches!(b.state, BlockState::Unmapped | BlockState::Paused) {
                runs.push(Vec::new());
                continue;
            }
            let allocated = b.state == BlockState::ActiveAllocated;
            runs.last_mut().expect("never empty").push(VmmallocBlock {
                address: b.address,
                size: b.size,
                requested_size: b.requested_size,
                allocated: c_int::from(allocated),
                active: c_int::from(b.state != BlockState::Inactive),
            });
        }
        for blocks in runs.into_iter().filter(|r| !r.is_empty()) {
            let sum = |f: &dyn Fn(&VmmallocBlock) -> u64| blocks.iter().map(f).sum::<u64>();
            let s = VmmallocSegment {
                device,
                is_large: c_int::from(seg.segment_type != "small"),
                is_expandable: c_int::from(seg.is_expandable),
                address: blocks[0].address,
                total_size: sum(&|b| b.size),
                allocated_size: sum(&|b| if b.allocated != 0 { b.size } else { 0 }),
                active_size: sum(&|b| if b.active != 0 { b.size } else { 0 }),
                requested_size: sum(&|b| if b.active != 0 { b.requested_size } else { 0 }),
                stream: seg.stream.0,
                pool_hi: pool.0,
                pool_lo: pool.1,
            };
            // SAFETY: per vmmalloc_visit_segments' contract, `cb` accepts
            // `ctx` and does not unwind; both pointers are valid for the call.
            unsafe { cb(ctx, &s, blocks.as_ptr(), blocks.len()) };
        }
    }
}

/// PyTorch's `snapshot(mempool_id)`: calls `segment` once per segment of
/// `device` (-1: every device used so far) with its blocks: the main allocator's and every pool's
/// (`only` 0), or pool `(hi, lo)`'s alone (`only` 1). Returns the number of
/// pools visited, or -1.
///
/// # Safety
///
/// `segment` does not unwind and accepts `ctx`.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_visit_segments(
    device: c_int,
    only: c_int,
    hi: u64,
    lo: u64,
    segment: Option<SegmentFn>,
    ctx: *mut c_void,
) -> c_int {
    let Some(cb) = segment else {
        diag::fail(LError, LError, "vmmalloc_visit_segments: segment is NULL");
        return -1;
    };
    entry("vmmalloc_visit_segments", -1, || {
        let rt = runtime::runtime();
        let devices: Vec<_> = if device < 0 {
            rt.active_devices().collect()
        } else {
            match rt.check_ordinal(device) {
                Ok(o) => rt.existing(o).into_iter().collect(),
                Err(m) => {
                    diag::fail(
                        rt.log_level(),
                        LError,
                        &format!("vmmalloc_visit_segments({device}): {m}"),
                    );
                    return -1;
                }
            }
        };
        let mut visited = 0;
        for d in devices {
            let ordinal = d.ordinal as c_int;
            let only = (only != 0).then_some((hi, lo));
            visit(&d.allocator.snapshot(), ordinal, only, cb, ctx);
            if let Some(p) = d.allocator.pools() {
                visited += p
                    .pool_ids()
                    .into_iter()
                    .filter(|id| only.is_none_or(|o| o == *id))
                    .count() as c_int;
            }
        }
        visited
    })
}
