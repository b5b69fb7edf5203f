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
//! Failure: a panic while the lock is held (a bug: the allocator never panics
//! on a driver result) may leave the state half-updated — a block split but
//! not indexed, a chunk unmapped but still recorded — and serving from it
//! could hand out memory that overlaps live tensors. So the lock is never
//! released after a panic: the flag moves to a third state, *failed*, with the
//! panic's text, and every later `lock` returns that text instead of a guard
//! ([`Lock::run`] catches the panic to record its message; a guard dropped
//! while unwinding fails the lock too). The fast path is unchanged: the
//! acquire CAS expects *free*, so a failed lock costs nothing until it fails.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Nobody holds the lock.
const FREE: u8 = 0;
/// A guard exists.
const HELD: u8 = 1;
/// A panic happened under the lock: terminal, no guard is ever made again.
const FAILED: u8 = 2;

/// A mutual-exclusion lock around a `T` that fails for good on a panic.
pub(crate) struct Lock<T> {
    /// [`FREE`], [`HELD`] or [`FAILED`].
    state: AtomicU8,
    /// Why the lock failed; set before `state` becomes [`FAILED`].
    failure: OnceLock<String>,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached mutably only through a `Guard`, and at most
// one guard exists at a time (`state` becomes HELD by a successful acquire-CAS
// and leaves it by the guard's release-store), so sharing the lock shares `T`
// exclusively; shared references (`frozen`) exist only once the state is
// FAILED, when no guard exists or will, and only for `T: Sync`.
unsafe impl<T: Send> Sync for Lock<T> {}

impl<T> Lock<T> {
    /// A new, unlocked lock.
    pub fn new(value: T) -> Self {
        Lock {
            state: AtomicU8::new(FREE),
            failure: OnceLock::new(),
            value: UnsafeCell::new(value),
        }
    }

    /// Acquires the lock, or returns why it failed (a panic under it). The
    /// allocator goes through [`Lock::run`] / [`Lock::run_noting_wait`],
    /// which also catch a panic; the tests hold guards directly.
    #[cfg(test)]
    pub fn lock(&self) -> Result<Guard<'_, T>, &str> {
        if self
            .state
            .compare_exchange_weak(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended()?;
        }
        Ok(Guard { lock: self })
    }

    /// Runs `f` on the value under the lock. A panic in `f` fails the lock
    /// with `op` and the panic's text, which is returned (the panic stops
    /// here); a failed lock returns its text without running `f`.
    #[inline]
    pub fn run<R>(&self, op: &str, f: impl FnOnce(&mut T) -> R) -> Result<R, &str> {
        self.run_noting_wait(op, |t, _| f(t))
    }

    /// [`Lock::run`], telling `f` whether acquiring the lock had to wait for
    /// another holder (a call that overlapped another thread's, `threads.rs`).
    #[inline]
    pub fn run_noting_wait<R>(
        &self,
        op: &str,
        f: impl FnOnce(&mut T, bool) -> R,
    ) -> Result<R, &str> {
        let waited = self
            .state
            .compare_exchange_weak(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_err();
        if waited {
            self.lock_contended()?;
        }
        let mut guard = Guard { lock: self };
        match catch_unwind(AssertUnwindSafe(|| f(&mut guard, waited))) {
            Ok(r) => Ok(r),
            Err(payload) => {
                let text = format!("a panic in {op}: {}", panic_text(&*payload));
                Err(guard.fail(text))
            }
        }
    }

    /// Why the lock failed, or None while it works.
    pub fn failure(&self) -> Option<&str> {
        if self.state.load(Ordering::Acquire) == FAILED {
            self.failure.get().map(String::as_str)
        } else {
            None
        }
    }

    /// The value as the panic left it, once the lock has failed (for reading
    /// what is left: statistics, a snapshot); None while it works.
    pub fn frozen(&self) -> Option<&T>
    where
        T: Sync,
    {
        if self.state.load(Ordering::Acquire) != FAILED {
            return None;
        }
        // SAFETY: FAILED is terminal: the guard that failed the lock is gone
        // and no guard is ever made again, so nothing mutates the value while
        // this shared reference lives (`get_mut` needs `&mut self`).
        Some(unsafe { &*self.value.get() })
    }

    #[cold]
    fn lock_contended(&self) -> Result<(), &str> {
        let mut round = 0u32;
        loop {
            loop {
                match self.state.load(Ordering::Acquire) {
                    FREE => break,
                    FAILED => return Err(self.failure.get().map_or("", String::as_str)),
                    _ => {}
                }
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
                .state
                .compare_exchange_weak(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(());
            }
        }
    }

    /// The value, without locking (exclusive access proves no guard exists;
    /// also after a failure, for the teardown on drop).
    pub fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }
}

/// The text of a panic payload (`panic!` gives a `&str` or a `String`).
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "a panic without a message"
    }
}

/// Proof that the lock is held; releases it when dropped (or, dropped while
/// unwinding from a panic, fails it).
pub(crate) struct Guard<'a, T> {
    lock: &'a Lock<T>,
}

impl<'a, T> Guard<'a, T> {
    /// Fails the lock for good with `why` (the first failure's text stays)
    /// and returns the recorded text.
    fn fail(self, why: String) -> &'a str {
        let lock = self.lock;
        std::mem::forget(self);
        let _ = lock.failure.set(why);
        lock.state.store(FAILED, Ordering::Release);
        lock.failure.get().map_or("", String::as_str)
    }
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
        if std::thread::panicking() {
            // Unwinding past a guard that `run` did not catch: the value may
            // be half-updated (the panic's text went to the panic hook).
            let _ = self
                .lock
                .failure
                .set("a panic while the allocator's lock was held".into());
            self.lock.state.store(FAILED, Ordering::Release);
            return;
        }
        self.lock.state.store(FREE, Ordering::Release);
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
                        let mut g = l.lock().unwrap();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                });
            }
        });
        assert_eq!(*l.lock().unwrap(), 80_000);
    }

    #[test]
    fn a_panic_fails_the_lock_for_good_with_its_text() {
        let l = Lock::new(vec![1u32]);
        let r = l.run("push", |v| {
            v.push(2);
            if v.len() == 2 {
                panic!("half-way");
            }
        });
        assert_eq!(r.unwrap_err(), "a panic in push: half-way");
        // Every later call gets the same text, and runs nothing.
        assert_eq!(l.lock().err(), Some("a panic in push: half-way"));
        assert_eq!(l.run("len", |v| v.len()), Err("a panic in push: half-way"));
        assert_eq!(l.failure(), Some("a panic in push: half-way"));
        // What the panic left is readable.
        assert_eq!(l.frozen().map(|v| v.len()), Some(2));
    }

    #[test]
    fn a_guard_dropped_while_unwinding_fails_the_lock() {
        let l = Arc::new(Lock::new(0u32));
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let mut g = l2.lock().unwrap();
            *g = 1;
            panic!("uncaught");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(
            l.failure(),
            Some("a panic while the allocator's lock was held")
        );
        assert!(l.lock().is_err());
        // A working lock is not frozen.
        let ok = Lock::new(0u8);
        assert!(ok.frozen().is_none() && ok.failure().is_none());
    }
}
