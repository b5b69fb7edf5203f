//! The C ABI behind PyTorch's memory debugging tools under vmmalloc: the
//! torch companion's `recordHistory`, `isHistoryEnabled` and `cacheInfo`
//! (python/vmmalloc/companion/vmmalloc_torch.cpp).
//!
//! ```c
//! // torch.cuda.memory._record_memory_history(enabled, max_entries=...):
//! // flags: 1 clear the events so far, 2 hand events to the sink only.
//! int  vmmalloc_record_history(int enabled, size_t max_entries, int flags);
//! int  vmmalloc_history_enabled(void);                  // 1 on, 0 off
//! // Each recorded event, on the thread that caused it (NULL: none).
//! void vmmalloc_set_trace_sink(void (*sink)(const VmmallocTraceEntry* e));
//! // cudnn.benchmark's cacheInfo: in/out, see vmmalloc_cache_info.
//! int  vmmalloc_cache_info(int device, uint64_t* largest);
//! ```
//!
//! `int` results: 0 (or the value asked for) on success, -1 with the reason in
//! `vmmalloc_last_error()`.

use crate::config::LogLevel::Error as LError;
use crate::error::Error;
use crate::history::{self, Recording, TraceSink};
use crate::{diag, entry, runtime};
use std::ffi::c_int;
use vmmalloc_alloc::{AllocError, BlockState, Snapshot};

/// [`vmmalloc_record_history`] flag: drop the events recorded so far
/// (PyTorch's `clear_history=True`).
pub const VMMALLOC_HISTORY_CLEAR: c_int = 1;
/// [`vmmalloc_record_history`] flag: events go to the trace sink only, not
/// into vmmalloc's own ring (the torch companion keeps PyTorch's ring, with
/// stack contexts; keeping both would hold every event twice).
pub const VMMALLOC_HISTORY_SINK_ONLY: c_int = 2;

/// Starts (`enabled` 1) or stops (0) recording allocator events on every
/// device, present and future, keeping at most `max_entries` per device
/// (`SIZE_MAX`: unbounded, PyTorch's default). Stopping drops the events, as
/// PyTorch's `recordHistory(false, ...)` does (c10/cuda/CUDACachingAllocator.cpp:
/// `if (!enabled || clearHistory) alloc_buffer.clear()`). `flags`:
/// [`VMMALLOC_HISTORY_CLEAR`], [`VMMALLOC_HISTORY_SINK_ONLY`]. Returns 0, or
/// -1 for unknown flags.
#[no_mangle]
pub extern "C" fn vmmalloc_record_history(
    enabled: c_int,
    max_entries: usize,
    flags: c_int,
) -> c_int {
    entry("vmmalloc_record_history", -1, || {
        if flags & !(VMMALLOC_HISTORY_CLEAR | VMMALLOC_HISTORY_SINK_ONLY) != 0 {
            diag::fail(
                runtime::log_level_unlocked(),
                LError,
                &format!("vmmalloc_record_history: unknown flags {flags:#x} (known: 1 clear, 2 sink only)"),
            );
            return -1;
        }
        runtime::set_recording(Recording {
            enabled: enabled != 0,
            max_entries: max_entries.max(1),
            clear: flags & VMMALLOC_HISTORY_CLEAR != 0,
            keep: flags & VMMALLOC_HISTORY_SINK_ONLY == 0,
        });
        0
    })
}

/// 1 while events are recorded (PyTorch's `isHistoryEnabled`), else 0.
#[no_mangle]
pub extern "C" fn vmmalloc_history_enabled() -> c_int {
    entry("vmmalloc_history_enabled", 0, || {
        c_int::from(runtime::recording())
    })
}

/// Sets the function that receives every recorded event (NULL: none), on
/// the thread that caused it, in the order the allocator acted, while that
/// device's history lock is held.
///
/// # Safety
///
/// `sink` must accept a pointer valid for the call, must not unwind and must
/// not call any `vmmalloc_*` function.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_set_trace_sink(sink: Option<TraceSink>) {
    history::set_sink(sink);
}

/// The largest request vmmalloc can serve from what it holds without
/// creating physical memory: a run of free mapped blocks, extended by the
/// physical pages it keeps unmapped in its page pool when the run borders
/// unmapped address space (or those pages alone). Paused, allocated and
/// pending blocks do not count.
pub fn largest_servable(snap: &Snapshot) -> u64 {
    let mut best = snap.pooled_bytes;
    for seg in &snap.segments {
        let mut run = 0u64;
        let mut borders_unmapped = false;
        for b in &seg.blocks {
            match b.state {
                BlockState::Inactive => run += b.size,
                BlockState::Unmapped => {
                    borders_unmapped = true;
                    best = best.max(run + snap.pooled_bytes);
                    run = 0;
                    continue;
                }
                _ => {
                    best = best.max(
                        run + if borders_unmapped {
                            snap.pooled_bytes
                        } else {
                            0
                        },
                    );
                    run = 0;
                    borders_unmapped = false;
                    continue;
                }
            }
        }
        best = best.max(
            run + if borders_unmapped {
                snap.pooled_bytes
            } else {
                0
            },
        );
    }
    best
}

/// PyTorch's `cacheInfo(device, &largest)` (cudnn's `benchmark = True`
/// sizes its workspace by it: aten/src/ATen/native/cudnn/Conv_v7.cpp). As the
/// native allocator (c10/cuda/CUDACachingAllocator.cpp, `cacheInfo`): a zero
/// `*largest` is first replaced by the device's free bytes (its "optimistic
/// initial guess"), then raised to the largest request vmmalloc can serve
/// from what it holds ([`largest_servable`]; PyTorch's is its largest cached
/// block). Returns 0, or -1 (bad ordinal, NULL pointer, driver error).
///
/// # Safety
///
/// `largest` is valid for reading and writing one value.
#[no_mangle]
pub unsafe extern "C" fn vmmalloc_cache_info(device: c_int, largest: *mut u64) -> c_int {
    if largest.is_null() {
        diag::fail(LError, LError, "vmmalloc_cache_info: largest is NULL");
        return -1;
    }
    entry("vmmalloc_cache_info", -1, || {
        let rt = runtime::runtime();
        // SAFETY: non-null and, per the contract, valid for a read.
        let mut value = unsafe { largest.read() };
        let r = rt.device(device).and_then(|d| {
            d.check()?;
            if value == 0 {
                value = d
                    .device
                    .mem_info()
                    .map_err(|e| Error::from(AllocError::Device(e)))?
                    .free;
            }
            Ok(value.max(largest_servable(&d.allocator.snapshot())))
        });
        match r {
            Ok(v) => {
                // SAFETY: non-null and, per the contract, valid for a write.
                unsafe { largest.write(v) };
                0
            }
            Err(m) => {
                diag::fail(
                    rt.log_level(),
                    LError,
                    &format!("vmmalloc_cache_info(device={device}): {m}"),
                );
                -1
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_alloc::{BlockInfo, SegmentInfo};

    fn seg(blocks: &[(u64, BlockState)]) -> SegmentInfo {
        let mut address = 0;
        let blocks = blocks
            .iter()
            .map(|&(size, state)| {
                let b = BlockInfo {
                    address,
                    size,
                    requested_size: 0,
                    state,
                };
                address += size;
                b
            })
            .collect::<Vec<_>>();
        SegmentInfo {
            address: 0,
            total_size: address,
            stream: vmmalloc_alloc::Stream(0),
            segment_type: "large",
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            is_expandable: true,
            pool: (0, 0),
            blocks,
        }
    }

    #[test]
    fn largest_servable_counts_free_runs_and_pooled_pages_next_to_unmapped_space() {
        use BlockState::*;
        let mut snap = Snapshot {
            segments: vec![seg(&[
                (2, Inactive),
                (3, Inactive),
                (1, ActiveAllocated),
                (4, Inactive),
                (8, Unmapped),
            ])],
            ..Snapshot::default()
        };
        assert_eq!(largest_servable(&snap), 5);
        snap.pooled_bytes = 2;
        // 4 free bytes before unmapped space, plus 2 pooled: 6.
        assert_eq!(largest_servable(&snap), 6);
        snap.pooled_bytes = 10;
        assert_eq!(largest_servable(&snap), 14);
        // Paused and pending blocks break a run.
        snap.segments = vec![seg(&[
            (4, Inactive),
            (1, Paused),
            (4, Inactive),
            (1, ActivePendingFree),
        ])];
        snap.pooled_bytes = 0;
        assert_eq!(largest_servable(&snap), 4);
        assert_eq!(largest_servable(&Snapshot::default()), 0);
    }
}
