//! Fork safety: a child forked while another thread of the parent held one of
//! our locks (an allocator's, the runtime's, stderr's) would hang on it, and
//! CUDA cannot be used in a forked child anyway (CUDA C programming guide,
//! "a CUDA context ... cannot be used in a child process created by fork()";
//! PyTorch raises "Cannot re-initialize CUDA in forked subprocess"). So a
//! `pthread_atfork` child handler, installed when the runtime is first
//! created, marks the child, and every entry point of the child returns a
//! clear error before touching any lock (see `crate::entry`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

static FORKED: AtomicBool = AtomicBool::new(false);

/// The error every call of a forked child gets.
pub const MESSAGE: &str = "this process was forked from one that used vmmalloc: the allocator (like CUDA) \
                           cannot be used after fork(); use the 'spawn' or 'forkserver' start method of \
                           multiprocessing, or exec a new program";

extern "C" fn child() {
    FORKED.store(true, Ordering::SeqCst);
}

/// Installs the `pthread_atfork` child handler (once per process).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `child` is an `extern "C"` function that only stores to an
        // atomic (async-signal-safe), valid for the life of the process (the
        // library is never unloaded once loaded by PyTorch; see docs/pytorch.md).
        let rc = unsafe { libc::pthread_atfork(None, None, Some(child)) };
        if rc != 0 {
            crate::diag::log(
                crate::config::LogLevel::Error,
                crate::config::LogLevel::Error,
                &format!("pthread_atfork failed ({rc}): a forked child may hang in vmmalloc"),
            );
        }
    });
}

/// Whether this process is a forked child of one that used vmmalloc.
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}
