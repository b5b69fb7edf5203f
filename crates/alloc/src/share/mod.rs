//! Elastic sharing of one GPU between processes (issue 33, part 2;
//! docs/share.md).
//!
//! Processes that join the same named group on the same GPU
//! (`VMMALLOC_CONF=share:NAME`) charge one budget before they create
//! memory, so together they never hold more than its total. Each member
//! has a cap that can be changed while it runs, from outside
//! ([`Group::set_cap`], `vmmalloc share NAME --cap PID=SIZE`) or from
//! inside ([`Member::set_cap`], the C ABI's `vmmalloc_share_set_cap`). A
//! member above a lowered cap gives memory back ([`GiveBack`], served by its
//! poller thread) and reads "deferred" until it is under again; nothing live
//! is revoked.
//!
//! The protocol follows kvcached's elastic KV-cache limits (a shared file
//! of `{total, used, prealloc}` under `flock`, limits polled every 100 ms,
//! shrink deferred until memory is freed, revisioned limits:
//! `kvcached/cli/utils.py`, `kvcached/kv_cache_manager.py`) and fixes what
//! its issues report: a crashed member's share comes back (`live.rs`: a
//! lock the kernel drops at exit, and the pid with its start time), a
//! missing or corrupt file is a [`ShareError`], never a crash, and the
//! format is versioned (`file.rs`).
//!
//! Issue 41 made it hold against careless and hostile neighbours
//! (DESIGN.md, "Hostile input and neighbours"): the file lives in a
//! directory only its user can write and is checked before use
//! (`file.rs`); a member notices a removed, replaced, cut or corrupt file
//! and takes nothing more, and nobody joins beside members of a file that
//! is gone (`member.rs`, `live.rs`); waits for the lock are bounded and
//! name the holder; a cap change wakes the members at once (`wake.rs`).
//!
//! Pieces: `format.rs` (the table and its encoding), `file.rs` (place,
//! checks, lock), `live.rs` (liveness, presence), `wake.rs` (wake-ups),
//! [`Member`] (`member.rs`: a process's membership: charge, credit, the
//! view its allocator plans with, the poller), [`Group`] (`group.rs`:
//! reading and changing a group from outside), [`GroupInfo`] (`info.rs`:
//! the listing).

mod file;
mod format;
mod group;
mod info;
mod live;
mod member;
mod wake;

pub use file::{check_device, check_name, dir, path, Scope, LOCK_WAIT, MIN_TOTAL};
pub use format::{NO_CAP, SLOTS, VERSION};
pub use group::{Change, Group};
pub use info::{cap_text, GroupInfo, MemberInfo, MemberState};
pub use member::{GiveBack, JoinOptions, Member, MemberCounts, Refusal, ShareRefused};

use crate::error::format_bytes;
use std::path::PathBuf;
use std::time::Duration;

/// How often a member's poller reads the file when no wake-up comes
/// (the fallback, `wake.rs`): kvcached's 100 ms
/// (`kvcached/kv_cache_manager.py`, its limit poll).
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

/// How long a member plans with the figures it last read before reading
/// the file again (its allocator asks for room on every cache miss).
const VIEW_FRESH: Duration = Duration::from_millis(1);

/// Errors of a shared budget.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// A group or device name with characters a file name cannot take.
    #[error(
        "bad share group name {0:?}: use 1 to 64 of A-Z a-z 0-9 _ . - (not starting with a dot), \
         after an @ for a group of several users"
    )]
    BadName(String),
    /// A device name that is not `gpuN`, `hostN` or `simN`.
    #[error("bad share device {0:?}: write gpuN (CUDA ordinal N), hostN or simN")]
    BadDevice(String),
    /// A group of several users without a directory named for it.
    #[error(
        "a group shared by several users (@NAME) lives in VMMALLOC_SHARE_DIR, which is not set \
             (docs/share.md, \"Several users\")"
    )]
    NoSharedDir,
    /// The directory of the group files is not one only its user can write.
    #[error(
        "refusing share group directory {path}: {why} (docs/share.md, \"Who can read or \
             change a group\")"
    )]
    UnsafeDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The file at the group's path is not one vmmalloc made for this user.
    #[error(
        "refusing share group file {path}: {why}; vmmalloc did not make it: remove it \
             (`vmmalloc share NAME --recover`) and check who can write to its directory"
    )]
    UnsafeFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// No file: no member has joined the group on this device.
    #[error("no share group file at {0} (no process has joined this group on this device; VMMALLOC_SHARE_DIR, XDG_RUNTIME_DIR or /dev/shm is where it is looked for)")]
    Missing(PathBuf),
    /// The file is not a whole, consistent group file.
    #[error(
        "share group file {path} is corrupt: {why}; once no member runs, `vmmalloc share NAME \
             --recover` removes it and the next member makes it again"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The file is of another format version.
    #[error(
        "share group file {path} has format version {found}; this vmmalloc reads version \
             {supported} (members of both versions cannot share a group; once no member runs, \
             `vmmalloc share NAME --recover` removes it)"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
        /// The version read here.
        supported: u32,
    },
    /// A system call on the file failed.
    #[error("cannot {what} share group file {path}: {source}")]
    Io {
        /// What was tried.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// Every slot is taken by a live member.
    #[error("share group {0} is full: {SLOTS} live members")]
    Full(String),
    /// A change made against a revision that is no longer current.
    #[error("stale change refused: it was made against revision {expected}, the group is at revision {found} (read it again with `vmmalloc share NAME`)")]
    Stale {
        /// The revision the change expected.
        expected: u64,
        /// The group's revision.
        found: u64,
    },
    /// No live member with that pid.
    #[error("no live member with pid {0} in the group")]
    NoMember(u32),
    /// A total below what the members hold now.
    #[error("a total of {} is below the {} the members hold now: lower their caps first and let them give back", format_bytes(*.total), format_bytes(*.used))]
    TotalBelowUse {
        /// The total asked for.
        total: u64,
        /// Bytes the members hold.
        used: u64,
    },
    /// The file this member holds is no longer the group's file, whole.
    #[error("share group file {path} {why} while this process was a member{}", match why {
        file::Gone::Truncated(_) => "; once no member runs, `vmmalloc share NAME --recover` removes it",
        _ => "; new members can join once the members of the old file have exited",
    })]
    Lost {
        /// The file.
        path: PathBuf,
        /// What happened to it.
        why: file::Gone,
    },
    /// Members run on a file that was at the path and is no longer.
    #[error(
        "members of the share group whose file was {0} still run on a file that was removed \
             or replaced: nobody joins beside them (they would hold more than the total \
             together); start again once they have exited"
    )]
    Orphaned(PathBuf),
    /// Recovery refused: members still hold the file.
    #[error(
        "not recovering share group file {0}: live members still hold it (or a file that was \
             at its path); stop them first"
    )]
    Busy(PathBuf),
    /// The lock was held longer than the bound by another process.
    #[error("share group file {path}: its lock was held for more than {} by {} (stopped or \
             stuck?); gave up waiting", format_duration(*.bound), holder_text(*.holder))]
    Stalled {
        /// The file.
        path: PathBuf,
        /// The process holding the lock, when known.
        holder: Option<u32>,
        /// How long the wait was.
        bound: Duration,
    },
    /// A total that cannot be.
    #[error("{0}")]
    BadTotal(String),
    /// This member's slot was taken from it (its lock was lost: the file
    /// was removed and made again while it ran).
    #[error("this process's slot in share group file {0} was lost (was the file removed while members ran?)")]
    Evicted(PathBuf),
}

/// A wait's bound as text.
fn format_duration(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{} s", d.as_secs_f64())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// The holder of a lock as text.
fn holder_text(pid: Option<u32>) -> String {
    match pid {
        Some(p) if p == std::process::id() => format!("another thread of this process ({p})"),
        Some(p) => format!("pid {p}"),
        None => "a process that /proc/locks does not name".into(),
    }
}

#[cfg(test)]
mod tests;
