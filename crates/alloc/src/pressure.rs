//! The memory-pressure callback: when an allocation (or a growable region's
//! growth) fails with out-of-memory after the policy's own reclaim, a
//! user callback may free memory (offload weights, drop a cache), and the
//! operation is retried once.
//!
//! Rules (docs/expandable.md, "Spill and pressure"):
//! - called on the allocating thread, **without** the allocator's lock (the
//!   failed operation has returned; the callback may free, and even
//!   allocate, through the same allocator);
//! - **never recursive**: an out-of-memory inside the callback (on the same
//!   thread) is not handed to it again;
//! - **never during CUDA graph capture**: freeing during a capture would
//!   change memory a graph being recorded may use (PyTorch defers frees
//!   during capture for the same reason, `CUDACachingAllocator.cpp`,
//!   `insert_events_deferred_until_no_capture`); the caller says whether a
//!   capture is underway (`Device::is_capturing`);
//! - bounded: one callback, one retry; a callback that frees nothing (returns
//!   0) gets no retry, and the original error is returned.

use crate::{AllocError, AllocResult};
use std::cell::Cell;
use std::sync::{Arc, RwLock};

/// The callback: `(bytes requested, device ordinal) -> bytes it freed`.
pub type PressureFn = dyn Fn(u64, i32) -> u64 + Send + Sync;

thread_local! {
    /// Set while this thread runs the callback.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// What happened on the last [`Pressure::retry`] that reached the callback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PressureCounts {
    /// Callback invocations.
    pub calls: u64,
    /// Retries after the callback freed something.
    pub retries: u64,
    /// Retries that succeeded.
    pub rescued: u64,
}

/// A settable pressure callback with its counters.
#[derive(Default)]
pub struct Pressure {
    cb: RwLock<Option<Arc<PressureFn>>>,
    counts: std::sync::Mutex<PressureCounts>,
}

impl Pressure {
    /// No callback (usable in a `static`).
    pub const fn new() -> Self {
        Pressure {
            cb: RwLock::new(None),
            counts: std::sync::Mutex::new(PressureCounts {
                calls: 0,
                retries: 0,
                rescued: 0,
            }),
        }
    }

    /// Sets (or with `None` clears) the callback.
    pub fn set(&self, cb: Option<Arc<PressureFn>>) {
        *self.cb.write().unwrap_or_else(|e| e.into_inner()) = cb;
    }

    /// The callback set now, if any (a shared budget's poller calls it
    /// when its member is above a lowered cap, `expandable/share.rs`).
    pub fn current(&self) -> Option<Arc<PressureFn>> {
        self.cb.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether a callback is set.
    pub fn is_set(&self) -> bool {
        self.cb.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Counters so far.
    pub fn counts(&self) -> PressureCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `op`; if it fails with out-of-memory, no capture is underway
    /// (`capturing()` is asked only then) and this thread is not already in
    /// the callback, calls the callback with `(size, device)` and, when it
    /// reports freed bytes, runs `op` once more.
    #[inline]
    pub fn retry<T>(
        &self,
        size: u64,
        device: i32,
        capturing: impl FnOnce() -> bool,
        mut op: impl FnMut() -> AllocResult<T>,
    ) -> AllocResult<T> {
        let first = op();
        self.retry_after(first, size, device, capturing, op)
    }

    /// [`Pressure::retry`] after the first attempt was made (its result is
    /// `first`): for a caller whose hot path made the attempt itself and
    /// takes this path only on failure.
    pub fn retry_after<T>(
        &self,
        first: AllocResult<T>,
        size: u64,
        device: i32,
        capturing: impl FnOnce() -> bool,
        mut op: impl FnMut() -> AllocResult<T>,
    ) -> AllocResult<T> {
        let err = match first {
            Err(e @ AllocError::OutOfMemory(_)) => e,
            other => return other,
        };
        if IN_CALLBACK.with(Cell::get) {
            return Err(err);
        }
        // Clone the callback out: no lock of ours is held while it runs.
        let Some(cb) = self.cb.read().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Err(err);
        };
        if capturing() {
            return Err(err);
        }
        IN_CALLBACK.with(|c| c.set(true));
        // A panicking callback must not leave the flag set.
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                IN_CALLBACK.with(|c| c.set(false));
            }
        }
        let freed = {
            let _reset = Reset;
            cb(size, device)
        };
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.calls += 1;
        if freed == 0 {
            return Err(err);
        }
        c.retries += 1;
        drop(c);
        let r = op();
        if r.is_ok() {
            self.counts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .rescued += 1;
        }
        r
    }
}
