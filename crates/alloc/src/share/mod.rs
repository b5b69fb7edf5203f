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
//! Pieces: `file.rs` (format, lock, path), `live.rs` (liveness),
//! [`Member`] (a process's membership: charge, credit, the view its
//! allocator plans with, the poller), [`Group`] (reading and changing a
//! group from outside).

mod file;
mod live;

pub use file::{check_name, dir, path, NO_CAP, SLOTS, VERSION};

use crate::error::format_bytes;
use file::{GroupFile, Slot, SlotState, Table};
use parking_lot::Mutex;
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often a member's poller reads the file by default: kvcached's
/// 100 ms (`kvcached/kv_cache_manager.py`, its limit poll).
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

/// How long a member plans with the figures it last read before reading
/// the file again (its allocator asks for room on every cache miss).
const VIEW_FRESH: Duration = Duration::from_millis(1);

/// Errors of a shared budget.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// A group or device name with characters a file name cannot take.
    #[error(
        "bad share group name {0:?}: use 1 to 64 of A-Z a-z 0-9 _ . - (not starting with a dot)"
    )]
    BadName(String),
    /// No file: no member has joined the group on this device.
    #[error("no share group file at {0} (no process has joined this group on this device; VMMALLOC_SHARE_DIR, XDG_RUNTIME_DIR or /dev/shm is where it is looked for)")]
    Missing(PathBuf),
    /// The file is not a whole, consistent group file.
    #[error("share group file {path} is corrupt: {why}; remove it once no member runs (members recreate it)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The file is of another format version.
    #[error("share group file {path} has format version {found}; this vmmalloc reads version {supported}")]
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
    /// This member's slot was taken from it (its lock was lost: the file
    /// was removed and made again while it ran).
    #[error("this process's slot in share group file {0} was lost (was the file removed while members ran?)")]
    Evicted(PathBuf),
}

/// A member's state as `vmmalloc share` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberState {
    /// Within its cap.
    Active,
    /// Above its cap: giving back, allocating only from what it holds.
    Deferred,
}

impl fmt::Display for MemberState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemberState::Active => "active",
            MemberState::Deferred => "deferred",
        })
    }
}

/// One member, as read from the file. Serialized (the CLI's `--json`, the
/// C ABI's `vmmalloc_share_info_json`) without its slot, with `cap` null
/// when there is none and `state` as its name.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MemberInfo {
    /// Its slot in the file.
    #[serde(skip)]
    pub slot: usize,
    /// Process id.
    pub pid: u32,
    /// Bytes it holds (charged).
    pub used: u64,
    /// Its cap ([`NO_CAP`]: none).
    #[serde(serialize_with = "cap_or_null")]
    pub cap: u64,
    /// The revision that set its cap.
    pub cap_rev: u64,
    /// Active or deferred.
    #[serde(serialize_with = "by_name")]
    pub state: MemberState,
    /// Bytes of its last refused charge (0 when its last charge succeeded).
    pub want: u64,
    /// Bytes it holds for no live tensor (as last published).
    pub cached: u64,
}

/// A cap as JSON: its bytes, or null for [`NO_CAP`].
fn cap_or_null<S: serde::Serializer>(cap: &u64, s: S) -> Result<S::Ok, S::Error> {
    match *cap {
        NO_CAP => s.serialize_none(),
        c => s.serialize_some(&c),
    }
}

/// A path as JSON: its text.
fn path_text<S: serde::Serializer>(p: &std::path::Path, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&p.display())
}

/// A value as JSON: its `Display` text.
fn by_name<S: serde::Serializer, T: fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// A group, as read from the file. Serialized with its path as text.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GroupInfo {
    /// Group name.
    pub name: String,
    /// The file.
    #[serde(serialize_with = "path_text")]
    pub path: PathBuf,
    /// Bytes the members may hold together.
    pub total: u64,
    /// Bytes they hold.
    pub used: u64,
    /// The revision changes must name.
    pub revision: u64,
    /// Live members.
    pub members: Vec<MemberInfo>,
    /// Pids of dead members whose bytes this read gave back.
    pub reaped: Vec<u32>,
}

impl GroupInfo {
    fn from_table(name: &str, path: PathBuf, t: &Table, reaped: Vec<u32>) -> GroupInfo {
        let members = t
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.taken())
            .map(|(i, s)| MemberInfo {
                slot: i,
                pid: s.pid,
                used: s.used,
                cap: s.cap,
                cap_rev: s.cap_rev,
                state: if s.used > s.cap {
                    MemberState::Deferred
                } else {
                    MemberState::Active
                },
                want: s.want,
                cached: s.cached,
            })
            .collect();
        GroupInfo {
            name: name.to_string(),
            path,
            total: t.total,
            used: t.used(),
            revision: t.revision,
            members,
            reaped,
        }
    }

    /// One line per member, for an out-of-memory report: the group, each
    /// member's use and cap, who could give back. `me` marks this process.
    pub fn explain(&self, me: Option<u32>) -> String {
        let mut s = format!(
            "Shared budget {:?}: {} of {} held by {} member(s):",
            self.name,
            format_bytes(self.used),
            format_bytes(self.total),
            self.members.len()
        );
        let mut could = Vec::new();
        for m in &self.members {
            let this = if Some(m.pid) == me {
                " (this process)"
            } else {
                ""
            };
            s.push_str(&format!(
                " pid {}{this} uses {} of cap {} ({}, {} cached);",
                m.pid,
                format_bytes(m.used),
                cap_text(m.cap),
                m.state,
                format_bytes(m.cached)
            ));
            if Some(m.pid) != me && (m.state == MemberState::Deferred || m.cached > 0) {
                could.push(format!("pid {} ({} cached)", m.pid, format_bytes(m.cached)));
            }
        }
        if could.is_empty() {
            s.push_str(" no other member holds cached memory it could give back: lower a member's cap (vmmalloc share NAME --cap PID=SIZE) so that it frees tensors, or raise the total.");
        } else {
            s.push_str(&format!(
                " Could give back: {}; lowering their cap (vmmalloc share NAME --cap PID=SIZE) makes them.",
                could.join(", ")
            ));
        }
        s
    }
}

/// A cap as text (`none` for [`NO_CAP`]).
pub fn cap_text(cap: u64) -> String {
    if cap == NO_CAP {
        "none".into()
    } else {
        format_bytes(cap)
    }
}

impl fmt::Display for GroupInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "group {}: total {}, used {}, revision {} ({})",
            self.name,
            format_bytes(self.total),
            format_bytes(self.used),
            self.revision,
            self.path.display()
        )?;
        for p in &self.reaped {
            writeln!(f, "  (pid {p} had died: its budget was given back)")?;
        }
        writeln!(
            f,
            "{:>8}  {:>12}  {:>12}  {:>9}  {:>12}  {:>12}  {:>7}",
            "pid", "used", "cap", "state", "cached", "want", "cap rev"
        )?;
        for m in &self.members {
            writeln!(
                f,
                "{:>8}  {:>12}  {:>12}  {:>9}  {:>12}  {:>12}  {:>7}",
                m.pid,
                format_bytes(m.used),
                cap_text(m.cap),
                m.state.to_string(),
                format_bytes(m.cached),
                if m.want == 0 {
                    "-".to_string()
                } else {
                    format_bytes(m.want)
                },
                m.cap_rev
            )?;
        }
        Ok(())
    }
}

/// Frees the slots of dead members in `t` (never `skip`, the reader's
/// own); returns their pids.
fn reap(g: &GroupFile, t: &mut Table, skip: Option<usize>, my_ns: u64) -> Vec<u32> {
    let mut dead = Vec::new();
    for i in 0..SLOTS {
        if Some(i) == skip || !t.slots[i].taken() {
            continue;
        }
        if !live::alive(&g.file, i, &t.slots[i], my_ns) {
            dead.push(t.slots[i].pid);
            t.slots[i] = Slot::FREE;
        }
    }
    dead
}

/// A group read and changed from outside (the `vmmalloc share` command, or
/// any process that is not a member).
#[derive(Debug)]
pub struct Group {
    name: String,
    file: GroupFile,
    ns: u64,
}

impl Group {
    /// Opens group `name` on device `device` (a GPU UUID or `gpuN`); the
    /// file must exist ([`ShareError::Missing`] otherwise).
    pub fn open(name: &str, device: &str) -> Result<Group, ShareError> {
        Group::open_path(name, &path(name, device)?)
    }

    /// Opens the group file at `p` (named `name` in reports).
    pub fn open_path(name: &str, p: &std::path::Path) -> Result<Group, ShareError> {
        Ok(Group {
            name: name.to_string(),
            file: GroupFile::open(p, None)?,
            ns: live::pid_namespace(),
        })
    }

    /// Reads the group, giving back the budget of dead members first.
    pub fn info(&self) -> Result<GroupInfo, ShareError> {
        let _l = self.file.lock()?;
        let mut t = self.file.read()?;
        let reaped = reap(&self.file, &mut t, None, self.ns);
        if !reaped.is_empty() {
            self.file.write(&t)?;
        }
        Ok(GroupInfo::from_table(
            &self.name,
            self.file.path.clone(),
            &t,
            reaped,
        ))
    }

    /// Sets the cap of member `pid` to `cap` bytes ([`NO_CAP`]: none).
    /// With `expect`, refused as [`ShareError::Stale`] unless the group is
    /// still at that revision. Returns the new revision.
    pub fn set_cap(&self, pid: u32, cap: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        change(&self.file, self.ns, None, expect, |t| {
            let s = t
                .slots
                .iter_mut()
                .find(|s| s.taken() && s.pid == pid)
                .ok_or(ShareError::NoMember(pid))?;
            s.cap = cap;
            s.cap_rev = t.revision + 1;
            s.settle();
            Ok(())
        })
    }

    /// Sets the group's total. Refused below what the members hold
    /// ([`ShareError::TotalBelowUse`]) and, with `expect`, when stale.
    /// Returns the new revision.
    pub fn set_total(&self, total: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        set_total(&self.file, self.ns, None, total, expect)
    }
}

fn set_total(
    g: &GroupFile,
    ns: u64,
    me: Option<usize>,
    total: u64,
    expect: Option<u64>,
) -> Result<u64, ShareError> {
    change(g, ns, me, expect, |t| {
        let used = t.used();
        if total < used {
            return Err(ShareError::TotalBelowUse { total, used });
        }
        t.total = total;
        Ok(())
    })
}

/// A change under the lock: dead members reaped, the revision checked
/// against `expect`, `f` applied, the revision raised, the file written.
fn change(
    g: &GroupFile,
    ns: u64,
    me: Option<usize>,
    expect: Option<u64>,
    f: impl FnOnce(&mut Table) -> Result<(), ShareError>,
) -> Result<u64, ShareError> {
    let _l = g.lock()?;
    let mut t = g.read()?;
    if let Some(expected) = expect {
        if expected != t.revision {
            return Err(ShareError::Stale {
                expected,
                found: t.revision,
            });
        }
    }
    reap(g, &mut t, me, ns);
    f(&mut t)?;
    t.revision += 1;
    g.write(&t)?;
    Ok(t.revision)
}

/// How a process joins a group.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// The total if this process creates the group (the device's memory,
    /// usually); an existing group keeps its own.
    pub total: u64,
    /// This member's cap at join ([`NO_CAP`]: none).
    pub cap: u64,
    /// How often the poller reads the file ([`DEFAULT_POLL`]).
    pub poll: Duration,
}

/// Why a charge was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// It would take this member above its cap.
    OverCap {
        /// Bytes it holds.
        used: u64,
        /// Its cap.
        cap: u64,
    },
    /// It would take the group above its total (after dead members' bytes
    /// came back).
    GroupFull {
        /// Bytes the group holds.
        used: u64,
        /// Its total.
        total: u64,
    },
}

/// What a member's allocator does when the poller finds it above its cap.
pub trait GiveBack: Send + Sync {
    /// Gives back what it can of `excess` bytes above the cap (cached pages
    /// at once, then a pressure callback, then sleep of tagged memory if
    /// opted in); returns the bytes given back.
    fn give_back(&self, excess: u64) -> u64;
    /// Bytes it holds for no live tensor (published for `vmmalloc share`
    /// and out-of-memory reports).
    fn cached(&self) -> u64;
}

/// What the member last read and holds.
#[derive(Debug)]
struct Local {
    /// Bytes charged (this process's own count; written into the slot on
    /// every change, so a failed write is repaired by the next one).
    used: u64,
    /// The table as last read.
    last: Table,
    /// When the view was last read.
    read_at: Instant,
}

/// Counters of a member.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemberCounts {
    /// Charges made (granted or refused).
    pub charges: u64,
    /// Charges refused.
    pub refusals: u64,
    /// Dead members whose bytes this member gave back to the group.
    pub reaped: u64,
    /// Give-back rounds the poller ran.
    pub give_backs: u64,
    /// Bytes given back by them.
    pub given_back: u64,
}

/// One process's membership of a group (module docs). Dropping it leaves
/// the group (its slot is freed; its allocator has given its memory back
/// before).
#[derive(Debug)]
pub struct Member {
    name: String,
    file: GroupFile,
    slot: usize,
    pid: u32,
    ns: u64,
    poll: Duration,
    local: Mutex<Local>,
    /// Bytes the allocator may hold: min(cap, total − others' use), as last read.
    limit: AtomicU64,
    counts: Mutex<MemberCounts>,
    nudge: crossbeam::channel::Sender<()>,
    wake: crossbeam::channel::Receiver<()>,
    serving: AtomicBool,
}

impl Member {
    /// Joins group `name` on device `device`, creating it (of
    /// `opts.total` bytes) on first use.
    pub fn join(name: &str, device: &str, opts: JoinOptions) -> Result<Arc<Member>, ShareError> {
        Member::join_path(name, &path(name, device)?, opts)
    }

    /// Joins the group whose file is `p`.
    pub fn join_path(
        name: &str,
        p: &std::path::Path,
        opts: JoinOptions,
    ) -> Result<Arc<Member>, ShareError> {
        let file = GroupFile::open(p, Some(opts.total))?;
        let ns = live::pid_namespace();
        let pid = std::process::id();
        let start = live::start_time(pid).unwrap_or(0);
        let (slot, t) = {
            let _l = file.lock()?;
            let mut t = file.read()?;
            reap(&file, &mut t, None, ns);
            let mut got = None;
            for i in 0..SLOTS {
                if t.slots[i].taken() {
                    continue;
                }
                let held = live::hold(&file.file, i).map_err(|e| ShareError::Io {
                    what: "lock a liveness byte of",
                    path: p.to_path_buf(),
                    source: e,
                })?;
                if held {
                    got = Some(i);
                    break;
                }
            }
            let slot = got.ok_or_else(|| ShareError::Full(name.to_string()))?;
            t.slots[slot] = Slot {
                pid,
                state: SlotState::Active,
                start,
                used: 0,
                cap: opts.cap,
                cap_rev: t.revision,
                want: 0,
                cached: 0,
                pidns: ns,
            };
            if let Err(e) = file.write(&t) {
                live::release(&file.file, slot);
                return Err(e);
            }
            (slot, t)
        };
        let (nudge, wake) = crossbeam::channel::bounded(1);
        let m = Member {
            name: name.to_string(),
            file,
            slot,
            pid,
            ns,
            poll: opts.poll,
            limit: AtomicU64::new(0),
            local: Mutex::new(Local {
                used: 0,
                last: t,
                read_at: Instant::now(),
            }),
            counts: Mutex::new(MemberCounts::default()),
            nudge,
            wake,
            serving: AtomicBool::new(false),
        };
        m.set_view(&m.local.lock().last);
        Ok(Arc::new(m))
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The group file.
    pub fn path(&self) -> &std::path::Path {
        &self.file.path
    }

    /// The poll interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll
    }

    /// Counters so far.
    pub fn counts(&self) -> MemberCounts {
        *self.counts.lock()
    }

    fn set_view(&self, t: &Table) {
        let me = &t.slots[self.slot];
        let room = t.total.saturating_sub(t.used_by_others(self.slot));
        self.limit.store(me.cap.min(room), Ordering::Relaxed);
    }

    /// Reads the table under the lock, checks that the slot is still ours.
    fn read_locked(&self) -> Result<Table, ShareError> {
        let t = self.file.read()?;
        let s = &t.slots[self.slot];
        if !s.taken() || s.pid != self.pid {
            return Err(ShareError::Evicted(self.file.path.clone()));
        }
        Ok(t)
    }

    /// Writes our slot's figures from `l` into `t`, then the file.
    fn write_locked(&self, t: &mut Table, l: &mut Local) -> Result<(), ShareError> {
        let s = &mut t.slots[self.slot];
        s.used = l.used;
        s.settle();
        let r = self.file.write(t);
        self.set_view(t);
        l.last = t.clone();
        l.read_at = Instant::now();
        r
    }

    /// Bytes this member's allocator may hold now: its cap, and what the
    /// others leave of the total (read again when older than 1 ms).
    pub fn limit(&self) -> u64 {
        let stale = self.local.lock().read_at.elapsed() > VIEW_FRESH;
        if stale {
            let _ = self.refresh();
        }
        self.limit.load(Ordering::Relaxed)
    }

    /// Reads the file again. When the group looks full (its free room
    /// under 1/8 of the total), dead members' bytes are taken back first.
    pub fn refresh(&self) -> Result<(), ShareError> {
        let mut l = self.local.lock();
        let _f = self.file.lock()?;
        let mut t = self.read_locked()?;
        if t.total.saturating_sub(t.used()) < t.total / 8 {
            let dead = reap(&self.file, &mut t, Some(self.slot), self.ns);
            if !dead.is_empty() {
                self.counts.lock().reaped += dead.len() as u64;
                return self.write_locked(&mut t, &mut l);
            }
        }
        self.set_view(&t);
        l.last = t;
        l.read_at = Instant::now();
        Ok(())
    }

    /// Gives the group back the bytes of members that died (their
    /// liveness lock is free, or their pid is gone: `live.rs`) and reads
    /// the group again. Returns how many were reaped. The allocator calls
    /// it once before it refuses an allocation for lack of memory.
    pub fn reap_dead(&self) -> Result<usize, ShareError> {
        let mut l = self.local.lock();
        let _f = self.file.lock()?;
        let mut t = self.read_locked()?;
        let dead = reap(&self.file, &mut t, Some(self.slot), self.ns);
        if dead.is_empty() {
            self.set_view(&t);
            l.last = t;
            l.read_at = Instant::now();
            return Ok(0);
        }
        self.counts.lock().reaped += dead.len() as u64;
        self.write_locked(&mut t, &mut l)?;
        Ok(dead.len())
    }

    /// Charges `bytes` before a create. `grow: false` (memory that replaces
    /// memory the same operation released) is never refused. A refused
    /// charge charges nothing; a refusal above this member's cap wakes its
    /// poller.
    pub fn charge(&self, bytes: u64, grow: bool) -> Result<(), Box<ShareRefused>> {
        let mut l = self.local.lock();
        self.counts.lock().charges += 1;
        let r: Result<Result<(), Refusal>, ShareError> = (|| {
            let _f = self.file.lock()?;
            let mut t = self.read_locked()?;
            if grow {
                let me = t.slots[self.slot];
                if l.used + bytes > me.cap {
                    t.slots[self.slot].want = bytes;
                    self.write_locked(&mut t, &mut l)?;
                    return Ok(Err(Refusal::OverCap {
                        used: l.used,
                        cap: me.cap,
                    }));
                }
                let others = |t: &Table| t.used_by_others(self.slot);
                if others(&t) + l.used + bytes > t.total {
                    let dead = reap(&self.file, &mut t, Some(self.slot), self.ns);
                    self.counts.lock().reaped += dead.len() as u64;
                    if others(&t) + l.used + bytes > t.total {
                        t.slots[self.slot].want = bytes;
                        self.write_locked(&mut t, &mut l)?;
                        return Ok(Err(Refusal::GroupFull {
                            used: t.used(),
                            total: t.total,
                        }));
                    }
                }
            }
            l.used += bytes;
            t.slots[self.slot].want = 0;
            self.write_locked(&mut t, &mut l)?;
            Ok(Ok(()))
        })();
        let why = match r {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(why)) => Some(why),
            Err(e) => {
                // The file failed: refuse (an out-of-memory, as the driver's),
                // never guess.
                return Err(Box::new(ShareRefused {
                    why: None,
                    error: Some(e.to_string()),
                    info: GroupInfo::from_table(
                        &self.name,
                        self.file.path.clone(),
                        &l.last,
                        vec![],
                    ),
                }));
            }
        };
        self.counts.lock().refusals += 1;
        if matches!(why, Some(Refusal::OverCap { .. })) {
            let _ = self.nudge.try_send(());
        }
        Err(Box::new(ShareRefused {
            why,
            error: None,
            info: GroupInfo::from_table(&self.name, self.file.path.clone(), &l.last, vec![]),
        }))
    }

    /// Credits `bytes` after a release. A failed write is logged; the next
    /// write carries the right figure (the member counts its own use).
    pub fn credit(&self, bytes: u64) {
        let mut l = self.local.lock();
        l.used = l.used.saturating_sub(bytes);
        let r = (|| {
            let _f = self.file.lock()?;
            let mut t = self.read_locked()?;
            self.write_locked(&mut t, &mut l)
        })();
        if let Err(e) = r {
            eprintln!("vmmalloc: share: credit of {bytes} bytes not written: {e}");
        }
    }

    /// Bytes this member holds (its own count).
    pub fn used(&self) -> u64 {
        self.local.lock().used
    }

    /// Bytes above its cap (as last read), if any.
    pub fn excess(&self) -> Option<u64> {
        let l = self.local.lock();
        let cap = l.last.slots[self.slot].cap;
        (l.used > cap).then(|| l.used - cap)
    }

    /// Reads the group (dead members reaped).
    pub fn info(&self) -> Result<GroupInfo, ShareError> {
        let mut l = self.local.lock();
        let _f = self.file.lock()?;
        let mut t = self.read_locked()?;
        let reaped = reap(&self.file, &mut t, Some(self.slot), self.ns);
        if !reaped.is_empty() {
            self.write_locked(&mut t, &mut l)?;
        } else {
            self.set_view(&t);
            l.last = t.clone();
        }
        Ok(GroupInfo::from_table(
            &self.name,
            self.file.path.clone(),
            &t,
            reaped,
        ))
    }

    /// The out-of-memory text of the group as last read.
    pub fn explain(&self) -> String {
        let l = self.local.lock();
        GroupInfo::from_table(&self.name, self.file.path.clone(), &l.last, vec![])
            .explain(Some(self.pid))
    }

    /// Sets this member's own cap (from inside: C ABI, Python); as
    /// [`Group::set_cap`]. Lowering it below what it holds wakes the poller.
    pub fn set_cap(&self, cap: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        let slot = self.slot;
        let r = change(&self.file, self.ns, Some(slot), expect, |t| {
            let s = &mut t.slots[slot];
            s.cap = cap;
            s.cap_rev = t.revision + 1;
            s.settle();
            Ok(())
        })?;
        self.refresh()?;
        if self.excess().is_some() {
            let _ = self.nudge.try_send(());
        }
        Ok(r)
    }

    /// Sets the group's total (as [`Group::set_total`]).
    pub fn set_total(&self, total: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        let r = set_total(&self.file, self.ns, Some(self.slot), total, expect)?;
        self.refresh()?;
        Ok(r)
    }

    /// Publishes the bytes this member holds for no live tensor.
    fn publish_cached(&self, cached: u64) -> Result<(), ShareError> {
        let mut l = self.local.lock();
        if l.last.slots[self.slot].cached == cached {
            return Ok(());
        }
        let _f = self.file.lock()?;
        let mut t = self.read_locked()?;
        t.slots[self.slot].cached = cached;
        self.write_locked(&mut t, &mut l)
    }

    /// Starts the poller: every poll interval (or at once when a charge
    /// was refused above the cap, or the cap was lowered from inside) it
    /// reads the file and, above the cap, calls `g` to give back. It
    /// stops when the member is dropped. One poller per member.
    pub fn serve(self: &Arc<Self>, g: Arc<dyn GiveBack>) -> std::io::Result<()> {
        if self.serving.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let weak: Weak<Member> = Arc::downgrade(self);
        let wake = self.wake.clone();
        let poll = self.poll;
        std::thread::Builder::new()
            .name("vmmalloc-share".into())
            .spawn(move || loop {
                match wake.recv_timeout(poll) {
                    Ok(()) | Err(crossbeam::channel::RecvTimeoutError::Timeout) => {}
                    Err(crossbeam::channel::RecvTimeoutError::Disconnected) => return,
                }
                let Some(m) = weak.upgrade() else { return };
                m.poll_once(&*g);
            })
            .map(|_| ())
    }

    /// One round of the poller (also callable directly, e.g. by tests).
    pub fn poll_once(&self, g: &dyn GiveBack) {
        if let Err(e) = self.refresh() {
            eprintln!("vmmalloc: share {}: {e}", self.name);
            return;
        }
        if let Some(excess) = self.excess() {
            let freed = g.give_back(excess);
            let mut c = self.counts.lock();
            c.give_backs += 1;
            c.given_back += freed;
        }
        let _ = self.publish_cached(g.cached());
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let r = (|| {
            let _f = self.file.lock()?;
            let mut t = self.file.read()?;
            let s = &t.slots[self.slot];
            if s.taken() && s.pid == self.pid {
                t.slots[self.slot] = Slot::FREE;
                self.file.write(&t)?;
            }
            Ok::<(), ShareError>(())
        })();
        if let Err(e) = r {
            eprintln!("vmmalloc: share {}: leaving the group: {e}", self.name);
        }
        live::release(&self.file.file, self.slot);
    }
}

/// A refused charge: why, and the group as read then.
#[derive(Debug, Clone)]
pub struct ShareRefused {
    /// Over the cap or over the total; `None` when the file failed.
    pub why: Option<Refusal>,
    /// The file's error, when it failed.
    pub error: Option<String>,
    /// The group as read.
    pub info: GroupInfo,
}

#[cfg(test)]
mod tests;
