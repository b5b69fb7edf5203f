//! PyTorch's `resetAccumulatedStats` (`torch.cuda.reset_accumulated_memory_stats`,
//! issue 40): the totals a device's statistics accumulate start again from 0.
//!
//! ```c
//! int vmmalloc_reset_accumulated_stats(int device);   // 0, or -1
//! ```
//!
//! As PyTorch's `DeviceCachingAllocator::resetAccumulatedStats`
//! (c10/cuda/CUDACachingAllocator.cpp): every stat array's `allocated` and
//! `freed`, `oversize_allocations` / `oversize_segments`' too, and
//! `num_alloc_retries`, `num_ooms`, `num_sync_all_streams`,
//! `num_device_alloc`, `num_device_free` (and each private pool's
//! `reserved_bytes_by_private_pools`' `allocated`/`freed`) read 0 afterwards; `current` and
//! `peak` are untouched. The allocators keep their counters running (several
//! derive `freed` from `allocated` and `current`); the values at the reset are
//! kept here per device and subtracted from every later reading
//! ([`apply`]: `vmmalloc_device_stats`, `vmmalloc_memory_stats_json`).

use crate::config::LogLevel::Error as LError;
use crate::runtime::{self, DeviceState};
use crate::{diag, entry};
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, PoisonError};
use vmmalloc_alloc::stats::StatArray;
use vmmalloc_alloc::{Stat, Stats};

/// Per device: the allocator the baseline was taken from (its address: a
/// device state made again starts with none) and the accumulated values then.
static BASELINES: Mutex<Option<HashMap<u32, (usize, Stats)>>> = Mutex::new(None);

fn key(d: &DeviceState) -> usize {
    std::ptr::from_ref(&*d.allocator).cast::<u8>() as usize
}

fn arrays(s: &mut Stats) -> [&mut StatArray; 9] {
    [
        &mut s.allocation,
        &mut s.segment,
        &mut s.active,
        &mut s.inactive_split,
        &mut s.allocated_bytes,
        &mut s.reserved_bytes,
        &mut s.active_bytes,
        &mut s.inactive_split_bytes,
        &mut s.requested_bytes,
    ]
}

fn sub_stat(s: &mut Stat, base: &Stat) {
    s.allocated -= base.allocated;
    s.freed -= base.freed;
}

/// Subtracts device `d`'s baseline (if one was taken from this allocator)
/// from the accumulated parts of `stats`, its allocator's reading.
pub fn apply(d: &DeviceState, stats: &mut Stats) {
    let guard = BASELINES.lock().unwrap_or_else(PoisonError::into_inner);
    let Some((k, base)) = guard.as_ref().and_then(|m| m.get(&d.ordinal)) else {
        return;
    };
    if *k != key(d) {
        return;
    }
    let mut base = base.clone();
    for (a, b) in arrays(stats).into_iter().zip(arrays(&mut base)) {
        for (s, bs) in a.0.iter_mut().zip(b.0.iter()) {
            sub_stat(s, bs);
        }
    }
    for (id, arr) in stats.reserved_bytes_by_private_pools.iter_mut() {
        if let Some(b) = base.reserved_bytes_by_private_pools.get(id) {
            for (s, bs) in arr.0.iter_mut().zip(b.0.iter()) {
                sub_stat(s, bs);
            }
        }
    }
    sub_stat(&mut stats.oversize_allocations, &base.oversize_allocations);
    sub_stat(&mut stats.oversize_segments, &base.oversize_segments);
    stats.num_alloc_retries = stats
        .num_alloc_retries
        .saturating_sub(base.num_alloc_retries);
    stats.num_ooms = stats.num_ooms.saturating_sub(base.num_ooms);
    stats.num_sync_all_streams = stats
        .num_sync_all_streams
        .saturating_sub(base.num_sync_all_streams);
    stats.num_device_alloc = stats.num_device_alloc.saturating_sub(base.num_device_alloc);
    stats.num_device_free = stats.num_device_free.saturating_sub(base.num_device_free);
}

/// Takes device `d`'s current readings as the new zero.
fn reset(d: &Arc<DeviceState>) {
    let stats = d.allocator.stats();
    let mut guard = BASELINES.lock().unwrap_or_else(PoisonError::into_inner);
    guard
        .get_or_insert_with(HashMap::new)
        .insert(d.ordinal, (key(d), stats));
}

/// PyTorch's `resetAccumulatedStats(device)`: the accumulated totals of
/// `device`'s statistics (see the module docs) read 0 from now on. A device
/// not used yet has nothing to reset. Returns 0, or -1 (bad ordinal, failed
/// device) with the reason in `vmmalloc_last_error()`.
#[no_mangle]
pub extern "C" fn vmmalloc_reset_accumulated_stats(device: c_int) -> c_int {
    entry("vmmalloc_reset_accumulated_stats", -1, || {
        let rt = runtime::runtime();
        let r = rt.check_ordinal(device).and_then(|o| match rt.existing(o) {
            Some(d) => d.check().map(|()| reset(d)),
            None => Ok(()),
        });
        match r {
            Ok(()) => 0,
            Err(m) => {
                diag::fail(
                    rt.log_level(),
                    LError,
                    &format!("vmmalloc_reset_accumulated_stats({device}): {m}"),
                );
                -1
            }
        }
    })
}
