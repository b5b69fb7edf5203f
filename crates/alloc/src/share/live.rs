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
//!
//! A member also holds a shared lock on one byte of the group file's
//! *directory*, at [`presence_base`]` + ` the file's inode (mod 2^24): its
//! presence. It outlives the file's name: when the file is removed or
//! replaced while members run, a process that comes to join finds their
//! presence at another inode's byte ([`others_present`]) and is refused,
//! so the new file never grants what the old one's members hold
//! (issue 41, part 1).

use super::format::{Slot, LIVE_BASE};
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

/// Bytes of presence per group: one per inode (mod this).
const PRESENCE_SPAN: i64 = 1 << 24;

/// First byte of group file `name`'s presence range in its directory:
/// FNV-1a of the name, 38 bits of it, times [`PRESENCE_SPAN`] (below 2^62).
pub fn presence_base(name: &[u8]) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in name {
        h = (h ^ u64::from(c)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    ((h & ((1 << 38) - 1)) as i64) * PRESENCE_SPAN
}

/// An `F_OFD_*` lock request on `len` bytes from `start`.
fn range(start: i64, len: i64, kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct for which all-zero is valid.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = start;
    l.l_len = len;
    l
}

/// Takes a member's presence on `dir` for the file of inode `ino` whose
/// range starts at `base` (a shared lock; the kernel drops it with the
/// open directory, however the process ends).
pub fn be_present(dir: &File, base: i64, ino: u64) -> std::io::Result<()> {
    let l = range(base + (ino % PRESENCE_SPAN as u64) as i64, 1, libc::F_RDLCK);
    // SAFETY: fcntl on a descriptor we own, with a valid `flock` pointer.
    if unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_OFD_SETLK, &l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether a member of the group whose presence range starts at `base`
/// lives on a file other than the one of inode `except` (any file when
/// `None`). An error counts as present (never take over on doubt).
pub fn others_present(dir: &File, base: i64, except: Option<u64>) -> bool {
    let held = |start: i64, len: i64| {
        if len <= 0 {
            return false;
        }
        let mut l = range(start, len, libc::F_WRLCK);
        // SAFETY: fcntl on a descriptor we own, with a valid `flock`
        // pointer that F_OFD_GETLK fills in.
        let r = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
        r != 0 || l.l_type != libc::F_UNLCK as libc::c_short
    };
    match except {
        None => held(base, PRESENCE_SPAN),
        Some(ino) => {
            let at = (ino % PRESENCE_SPAN as u64) as i64;
            held(base, at) || held(base + at + 1, PRESENCE_SPAN - at - 1)
        }
    }
}

/// Whether any open file other than `file` holds a liveness lock on one of
/// its slots (a live member).
pub fn any_held_elsewhere(file: &File) -> bool {
    (0..super::format::SLOTS).any(|i| held_elsewhere(file, i))
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
