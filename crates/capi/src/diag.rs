//! The last error of each thread, and the one-line stderr log.
//!
//! Every exported function (except [`crate::vmmalloc_last_error`],
//! [`crate::vmmalloc_version`] and [`crate::vmmalloc_free_string`]) first
//! clears the calling thread's last error, and sets it if it fails. So after a
//! call, `vmmalloc_last_error()` is NULL if that call succeeded and its message
//! otherwise (errno-like, but never stale).

use crate::config::LogLevel;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
use std::io::Write;

thread_local! {
    /// The calling thread's last error. The pointer handed out by
    /// [`last_error_ptr`] stays valid until the next exported call on this thread.
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// Whether `LAST_ERROR` may hold a message. A plain flag with no
    /// destructor: clearing an empty last error, what every successful
    /// call does, is one thread-local load, not a visit to a slot whose
    /// destructor must be registered and checked (issue 27, the hot path).
    static ERROR_SET: Cell<bool> = const { Cell::new(false) };
}

/// Clears the calling thread's last error.
#[inline]
pub(crate) fn clear_error() {
    if ERROR_SET.get() {
        take_error();
    }
}

#[cold]
fn take_error() {
    ERROR_SET.set(false);
    // `try_with`: during thread teardown the slot may be gone; nothing to clear then.
    let _ = LAST_ERROR.try_with(|e| e.borrow_mut().take());
}

/// Sets the calling thread's last error.
pub(crate) fn set_error(message: &str) {
    let c = c_string_lossy(message);
    if LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(c)).is_ok() {
        ERROR_SET.set(true);
    }
}

/// The calling thread's last error as a C string owned by this library, or NULL.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// A C string from any text (interior NULs become `\0` escapes).
pub(crate) fn c_string_lossy(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// Writes one line `vmmalloc: <level>: <message>` to stderr if `level` is
/// enabled by `configured`. Never panics (a failed write is ignored).
pub(crate) fn log(configured: LogLevel, level: LogLevel, message: &str) {
    if level == LogLevel::Off || level > configured {
        return;
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "vmmalloc: {}: {}",
        level.name(),
        message.replace('\n', " ")
    );
}

/// Sets the last error and logs it at `level`.
pub(crate) fn fail(configured: LogLevel, level: LogLevel, message: &str) {
    set_error(message);
    log(configured, level, message);
}

/// Writes one line `vmmalloc: error: <message>` to stderr with a raw
/// `write(2)`, taking no lock (for a forked child, where a lock held by a
/// parent thread would never be released). Never panics.
pub(crate) fn log_unlocked(message: &str) {
    let line = format!("vmmalloc: error: {}\n", message.replace('\n', " "));
    // SAFETY: the buffer is valid for `line.len()` bytes; fd 2 may be closed,
    // in which case write fails harmlessly.
    let _ = unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}
