//! Whether a member lives: its liveness lock, then its pid.
//!
//! A member holds an open-file-description lock (`F_OFD_SETLK`, Linux
//! 3.15+, fcntl(2)) on byte [`LIVE_BASE`]` + slot` of the group file for
//! as long as its file is open. The kernel drops the lock when the last
//! descriptor of that open file goes, however the process ends (`kill -9`
//! included), so "nobody holds the lock" means dead at once: no lease to
//! wait out. OFD locks, unlike classic `fcntl` locks, belong to the open
//! file, not the process: another open of the same file in the member
//! (the CLI's, a second device's) does not drop them.
//!
//! A child forked without exec shares the open file and so the lock; the
//! pid check catches the parent's death then: the slot's pid must exist
//! with the start time (`/proc/PID/stat` field 22, proc(5)) recorded at
//! join, which also rules out a reused pid. The check applies only when
//! the reader is in the member's pid namespace (same `/proc/self/ns/pid`
//! inode); across namespaces (containers) the lock alone decides.

use super::file::{Slot, LIVE_BASE};
use std::fs::File;
use std::os::fd::AsRawFd;

/// An `F_OFD_*` lock request on byte `LIVE_BASE + slot`.
fn flock_for(slot: usize, kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct for which all-zero is valid.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = LIVE_BASE + slot as i64;
    l.l_len = 1;
    l.l_pid = 0; // must be 0 for OFD locks
    l
}

/// Takes slot `slot`'s liveness lock on `file`, without waiting. `false`
/// when another open file holds it (a live member in that slot).
pub fn hold(file: &File, slot: usize) -> std::io::Result<bool> {
    let l = flock_for(slot, libc::F_WRLCK);
    // SAFETY: fcntl on a descriptor we own, with a valid `flock` pointer.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

/// Releases slot `slot`'s liveness lock held through `file`.
pub fn release(file: &File, slot: usize) {
    let l = flock_for(slot, libc::F_UNLCK);
    // SAFETY: fcntl on a descriptor we own, with a valid `flock` pointer.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
}

/// Whether some open file other than `file` holds slot `slot`'s lock.
/// An error counts as held (never declare a member dead on doubt).
pub fn held_elsewhere(file: &File, slot: usize) -> bool {
    let mut l = flock_for(slot, libc::F_WRLCK);
    // SAFETY: fcntl on a descriptor we own, with a valid `flock` pointer
    // that F_OFD_GETLK fills in.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    r != 0 || l.l_type != libc::F_UNLCK as libc::c_short
}

/// Start time of process `pid` in clock ticks since boot (`/proc/PID/stat`
/// field 22), `None` when there is no such process.
pub fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces:
    // count fields after its closing parenthesis (field 3 is the first).
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Inode of this process's pid namespace (0 when unknown).
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// Whether the member in `s` (slot `slot`) lives, as seen through `file`
/// by a process in pid namespace `my_ns` (module docs).
pub fn alive(file: &File, slot: usize, s: &Slot, my_ns: u64) -> bool {
    if !held_elsewhere(file, slot) {
        return false;
    }
    if s.pidns != 0 && s.pidns == my_ns {
        return start_time(s.pid) == Some(s.start);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_a_start_time_and_pid_0_does_not() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert_eq!(start_time(me), start_time(me));
        assert_eq!(start_time(0), None);
        assert!(pid_namespace() != 0);
    }
}
