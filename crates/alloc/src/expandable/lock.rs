//! The allocator's lock: one flag, acquired with a compare-and-swap and
//! released with a plain store.
//!
//! Why not `parking_lot::Mutex`: its unlock is a second compare-and-swap (to
//! find parked waiters), and the two atomic read-modify-writes per call were
//! about 40 % of a cache-hit malloc + free pair. Here an uncontended
//! lock/unlock costs one atomic operation.
//!
//! Waiting: spin briefly (critical sections on the fast path last tens of
//! nanoseconds), then yield the CPU, then sleep in short steps — a slow path
//! may hold the lock across device calls (a stream synchronize during a
//! reclaim), and waiters must not burn a core for that long.
//!
//! No poisoning: a panic while the lock is held releases it (the allocator
//! never panics on a driver result, so a panic is a bug either way).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A mutual-exclusion lock around a `T`.
pub(crate) struct Lock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached through a `Guard`, and at most one guard
// exists at a time (`locked` is set by a successful acquire-CAS and cleared by
// the guard's release-store), so sharing the lock shares `T` exclusively.
unsafe impl<T: Send> Sync for Lock<T> {}

impl<T> Lock<T> {
    /// A new, unlocked lock.
    pub fn new(value: T) -> Self {
        Lock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Acquires the lock.
    #[inline]
    pub fn lock(&self) -> Guard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        Guard { lock: self }
    }

    /// Acquires the lock and says whether it had to wait for another
    /// holder (a call that overlapped another thread's, `threads.rs`).
    #[inline]
    pub fn lock_noting_wait(&self) -> (Guard<'_, T>, bool) {
        let waited = self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err();
        if waited {
            self.lock_contended();
        }
        (Guard { lock: self }, waited)
    }

    #[cold]
    fn lock_contended(&self) {
        let mut round = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                if round < 100 {
                    std::hint::spin_loop();
                } else if round < 200 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
                round = round.saturating_add(1);
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// The value, without locking (exclusive access proves no guard exists).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

/// Proof that the lock is held; releases it when dropped.
pub(crate) struct Guard<'a, T> {
    lock: &'a Lock<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock, so no other reference to the
        // value exists until it is dropped.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow
        // through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::Lock;
    use std::sync::Arc;

    #[test]
    fn excludes_concurrent_increments() {
        let l = Arc::new(Lock::new(0u64));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let l = l.clone();
                s.spawn(move || {
                    for _ in 0..20_000 {
                        // A non-atomic read-modify-write: lost updates if the lock leaks.
                        let mut g = l.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                });
            }
        });
        assert_eq!(*l.lock(), 80_000);
    }
}
