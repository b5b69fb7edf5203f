//! Wake-ups through the group file (issue 41, part 4): a member hears a
//! change of its cap at once, not at its next poll.
//!
//! The file's wake word (`format.rs`, offset 40) is a futex word: every
//! change a member must hear (a cap, the total, a charge refused above a
//! cap) raises it in the table it writes, then wakes the waiters
//! (`FUTEX_WAKE`). A member's poller waits on it (`FUTEX_WAIT` with the
//! value it last read, and the poll interval as the timeout, so the poll
//! stays as the fallback). The word is in a shared mapping of the file, so
//! the futex is keyed by the file's inode and offset and works between
//! processes (futex(2)).
//!
//! Only the kernel touches the mapping (the futex calls); the word is read
//! and written with the rest of the table through `pread`/`pwrite`. A file
//! cut short under the mapping therefore makes a futex call fail with
//! `EFAULT`, never raises `SIGBUS` in a member.

use super::format::{FILE_LEN, WAKE_AT};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// A read-only shared mapping of a group file, for its wake word.
#[derive(Debug)]
pub struct WakeWord {
    /// Start of the mapping.
    base: *mut libc::c_void,
}

// SAFETY: the mapping is never read or written through the pointer in
// user space; only futex calls take its address, from any thread.
unsafe impl Send for WakeWord {}
// SAFETY: as above.
unsafe impl Sync for WakeWord {}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// Woken, or the word was not the value waited on.
    Changed,
    /// The timeout passed.
    TimedOut,
    /// The futex call failed (the file was cut short, or futexes are not
    /// available): the caller sleeps instead.
    Failed,
}

impl WakeWord {
    /// Maps `file`; `None` when it cannot be mapped (the poll alone serves).
    pub fn map(file: &File) -> Option<WakeWord> {
        // SAFETY: a new shared read-only mapping of a file we hold open;
        // no Rust reference is ever made into it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        (base != libc::MAP_FAILED).then_some(WakeWord { base })
    }

    fn word(&self) -> *const u32 {
        // SAFETY: WAKE_AT is inside the mapping (FILE_LEN bytes) and 4-aligned.
        unsafe { self.base.cast::<u8>().add(WAKE_AT).cast::<u32>() }
    }

    /// Waits until the word is not `seen`, a wake-up, or `timeout`.
    pub fn wait(&self, seen: u32, timeout: Duration) -> Woken {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT (shared: no FUTEX_PRIVATE_FLAG) on an aligned
        // word of our mapping; the kernel reads it, and fails with EFAULT
        // if it cannot.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
            )
        };
        if r == 0 {
            return Woken::Changed;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) => Woken::Changed,
            Some(libc::ETIMEDOUT) => Woken::TimedOut,
            _ => Woken::Failed,
        }
    }

    /// Wakes every process waiting on the word.
    pub fn wake(&self) {
        // SAFETY: FUTEX_WAKE on an aligned word of our mapping.
        unsafe {
            libc::syscall(libc::SYS_futex, self.word(), libc::FUTEX_WAKE, i32::MAX);
        }
    }
}

impl Drop for WakeWord {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping `map` made, used by nobody now (the
        // last owner drops it).
        unsafe { libc::munmap(self.base, FILE_LEN) };
    }
}
