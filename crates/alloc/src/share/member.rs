//! One process's membership of a group: charge, credit, the view its
//! allocator plans with, the poller that gives back above the cap.
//!
//! A member checks that its file is still the group's before every read
//! (`file.rs`, `GroupFile::gone`: its size and link count before every
//! charge and credit, also the device and inode at the path at every poll
//! round). When it is not (removed, replaced, cut
//! short, corrupt, of another version) the member is *lost*: it keeps what
//! it holds, takes nothing more from the group (memory that replaces
//! memory it just released excepted), says so in one line naming the file
//! and what to do, and never writes the file again. Passing errors (a
//! stalled lock, an I/O error) refuse the charge at hand and are logged
//! once per change of error.

use super::file::GroupFile;
use super::format::{Slot, SlotState, Table, SLOTS};
use super::group::{base, change, open_checked, reap, set_cap_in, set_total_in};
use super::info::GroupInfo;
use super::wake::Woken;
use super::{live, path, ShareError, VIEW_FRESH};
use crate::error::format_bytes;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How a process joins a group.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// The total if this process creates the group (the device's memory,
    /// usually); an existing group keeps its own.
    pub total: u64,
    /// This member's cap at join ([`super::NO_CAP`]: none).
    pub cap: u64,
    /// How often the poller reads the file ([`super::DEFAULT_POLL`]).
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

/// One process's membership of a group (module docs). Dropping it leaves
/// the group (its slot is freed; its allocator has given its memory back
/// before).
#[derive(Debug)]
pub struct Member {
    name: String,
    file: GroupFile,
    pub(super) slot: usize,
    pid: u32,
    ns: u64,
    poll: Duration,
    local: Mutex<Local>,
    /// Bytes the allocator may hold: min(cap, total − others' use), as last read.
    limit: AtomicU64,
    counts: Mutex<MemberCounts>,
    serving: AtomicBool,
    /// Whether the file is no longer the group's (module docs).
    is_lost: AtomicBool,
    /// The line that said so.
    lost: Mutex<Option<String>>,
    /// The last passing error logged (each is logged once, until a read
    /// succeeds).
    said: Mutex<Option<String>>,
}

/// Whether an error means the file is no longer the group's.
fn losing(e: &ShareError) -> bool {
    matches!(
        e,
        ShareError::Lost { .. }
            | ShareError::Corrupt { .. }
            | ShareError::Version { .. }
            | ShareError::Evicted(_)
    )
}

impl Member {
    /// Joins group `name` on device `device` (`gpuN`, `hostN`, `simN`),
    /// creating it (of `opts.total` bytes) on first use.
    pub fn join(name: &str, device: &str, opts: JoinOptions) -> Result<Arc<Member>, ShareError> {
        Member::join_path(name, &path(name, device)?, opts)
    }

    /// Joins the group whose file is `p`.
    pub fn join_path(
        name: &str,
        p: &std::path::Path,
        opts: JoinOptions,
    ) -> Result<Arc<Member>, ShareError> {
        let file = open_checked(name, p, Some(opts.total))?;
        let ns = live::pid_namespace();
        let pid = std::process::id();
        let start = live::start_time(pid).unwrap_or(0);
        let io = |what: &'static str, e: std::io::Error| ShareError::Io {
            what,
            path: p.to_path_buf(),
            source: e,
        };
        let (slot, t) = {
            let _l = file.lock()?;
            let mut t = file.read()?;
            reap(&file, &mut t, None, ns);
            let mut got = None;
            for i in 0..SLOTS {
                if t.slots[i].taken() {
                    continue;
                }
                if live::hold(&file.file, i).map_err(|e| io("lock a liveness byte of", e))? {
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
            let r = live::be_present(&file.dir, base(p), file.ino)
                .map_err(|e| io("mark this member's presence beside", e))
                .and_then(|()| file.write(&t));
            if let Err(e) = r {
                live::release(&file.file, slot);
                return Err(e);
            }
            (slot, t)
        };
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
            serving: AtomicBool::new(false),
            is_lost: AtomicBool::new(false),
            lost: Mutex::new(None),
            said: Mutex::new(None),
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

    /// The line said when the file stopped being the group's (module
    /// docs), `None` while it is.
    pub fn lost(&self) -> Option<String> {
        self.lost.lock().clone()
    }

    fn set_view(&self, t: &Table) {
        let me = &t.slots[self.slot];
        let room = t.total.saturating_sub(t.used_by_others(self.slot));
        self.limit.store(me.cap.min(room), Ordering::Relaxed);
    }

    /// Notes an error: a losing one makes the member lost (one line, once);
    /// a passing one is logged once until a read succeeds.
    fn note(&self, e: &ShareError, held: u64) {
        if losing(e) {
            let mut lost = self.lost.lock();
            if lost.is_none() {
                let line = format!(
                    "vmmalloc: share {}: {e}; this process keeps the {} it holds and takes no \
                     more from the group",
                    self.name,
                    format_bytes(held)
                );
                eprintln!("{line}");
                *lost = Some(line);
                self.is_lost.store(true, Ordering::Release);
            }
            return;
        }
        let line = format!("vmmalloc: share {}: {e}", self.name);
        let mut said = self.said.lock();
        if said.as_deref() != Some(line.as_str()) {
            eprintln!("{line}");
            *said = Some(line);
        }
    }

    /// Notes a successful read: the next error is logged again.
    fn note_ok(&self) {
        let mut said = self.said.lock();
        if said.take().is_some() {
            eprintln!(
                "vmmalloc: share {}: the group file answers again",
                self.name
            );
        }
    }

    fn lost_now(&self) -> bool {
        self.is_lost.load(Ordering::Acquire)
    }

    /// Reads the table under the lock, checks that the slot is still ours.
    fn read_locked(&self) -> Result<Table, ShareError> {
        self.read_locked_checked(false)
    }

    /// [`Self::read_locked`] with the file's full check when `full`.
    fn read_locked_checked(&self, full: bool) -> Result<Table, ShareError> {
        let t = self.file.read_checked(full)?;
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
    /// others leave of the total (read again when older than 1 ms); what
    /// it holds once lost.
    pub fn limit(&self) -> u64 {
        if self.lost_now() {
            return self.local.lock().used;
        }
        let stale = self.local.lock().read_at.elapsed() > VIEW_FRESH;
        if stale {
            let _ = self.refresh();
        }
        if self.lost_now() {
            return self.local.lock().used;
        }
        self.limit.load(Ordering::Relaxed)
    }

    /// [`Self::limit`] as last read, without reading the file again (what
    /// the allocator planned with when its view was fresh).
    pub fn limit_as_read(&self) -> u64 {
        if self.lost_now() {
            return self.local.lock().used;
        }
        self.limit.load(Ordering::Relaxed)
    }

    /// Reads the file again. When the group looks full (its free room
    /// under 1/8 of the total), dead members' bytes are taken back first.
    /// Nothing is read once the member is lost.
    pub fn refresh(&self) -> Result<(), ShareError> {
        self.refresh_checked(false)
    }

    /// [`Self::refresh`], with the file's full check (device and inode at
    /// the path, `GroupFile::gone`) when `full` (every poll round).
    fn refresh_checked(&self, full: bool) -> Result<(), ShareError> {
        if self.lost_now() {
            return Ok(());
        }
        let mut l = self.local.lock();
        let r = (|| {
            let _f = self.file.lock()?;
            let mut t = self.read_locked_checked(full)?;
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
        })();
        match &r {
            Ok(()) => self.note_ok(),
            Err(e) => self.note(e, l.used),
        }
        r
    }

    /// Gives the group back the bytes of members that died (their
    /// liveness lock is free, or their pid is gone: `live.rs`) and reads
    /// the group again. Returns how many were reaped. The allocator calls
    /// it once before it refuses an allocation for lack of memory.
    pub fn reap_dead(&self) -> Result<usize, ShareError> {
        if self.lost_now() {
            return Ok(0);
        }
        let mut l = self.local.lock();
        let r = (|| {
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
        })();
        match &r {
            Ok(_) => self.note_ok(),
            Err(e) => self.note(e, l.used),
        }
        r
    }

    /// Charges `bytes` before a create. `grow: false` (memory that replaces
    /// memory the same operation released) is never refused: when the
    /// file cannot be read it is counted here and written with the next
    /// change. A refused charge charges nothing; the first refusal above
    /// this member's cap after a granted charge wakes the pollers. A lost
    /// member refuses every growth.
    pub fn charge(&self, bytes: u64, grow: bool) -> Result<(), Box<ShareRefused>> {
        let mut l = self.local.lock();
        self.counts.lock().charges += 1;
        let refuse = |l: &Local, why: Option<Refusal>, error: Option<String>| {
            self.counts.lock().refusals += 1;
            Err(Box::new(ShareRefused {
                why,
                error,
                info: GroupInfo::from_table(&self.name, self.file.path.clone(), &l.last, vec![]),
            }))
        };
        let Some(new_used) = l.used.checked_add(bytes) else {
            return refuse(
                &l,
                None,
                Some(format!("a charge of {bytes} bytes overflows")),
            );
        };
        if self.lost_now() {
            if !grow {
                l.used = new_used;
                return Ok(());
            }
            return refuse(&l, None, self.lost());
        }
        let mut woke = false;
        let r: Result<Result<(), Refusal>, ShareError> = (|| {
            let _f = self.file.lock()?;
            let mut t = self.read_locked()?;
            if grow {
                let me = t.slots[self.slot];
                if new_used > me.cap {
                    if me.want == 0 {
                        t.wake = t.wake.wrapping_add(1);
                        woke = true;
                    }
                    t.slots[self.slot].want = bytes;
                    self.write_locked(&mut t, &mut l)?;
                    return Ok(Err(Refusal::OverCap {
                        used: l.used,
                        cap: me.cap,
                    }));
                }
                if !t.fits(self.slot, new_used) {
                    let dead = reap(&self.file, &mut t, Some(self.slot), self.ns);
                    self.counts.lock().reaped += dead.len() as u64;
                    if !t.fits(self.slot, new_used) {
                        t.slots[self.slot].want = bytes;
                        self.write_locked(&mut t, &mut l)?;
                        return Ok(Err(Refusal::GroupFull {
                            used: t.used(),
                            total: t.total,
                        }));
                    }
                }
            }
            l.used = new_used;
            t.slots[self.slot].want = 0;
            self.write_locked(&mut t, &mut l)?;
            Ok(Ok(()))
        })();
        if woke {
            self.file.wake_all();
        }
        match r {
            Ok(Ok(())) => {
                self.note_ok();
                Ok(())
            }
            Ok(Err(why)) => {
                self.note_ok();
                refuse(&l, Some(why), None)
            }
            Err(e) => {
                self.note(&e, l.used);
                if !grow {
                    l.used = new_used;
                    return Ok(());
                }
                // The file failed: refuse (an out-of-memory, as the
                // driver's), never guess.
                let error = self.lost().unwrap_or_else(|| e.to_string());
                refuse(&l, None, Some(error))
            }
        }
    }

    /// Credits `bytes` after a release. A failed write is logged (once);
    /// the next write carries the right figure (the member counts its own
    /// use).
    pub fn credit(&self, bytes: u64) {
        let mut l = self.local.lock();
        l.used = l.used.saturating_sub(bytes);
        if self.lost_now() {
            return;
        }
        let r = (|| {
            let _f = self.file.lock()?;
            let mut t = self.read_locked()?;
            self.write_locked(&mut t, &mut l)
        })();
        match &r {
            Ok(()) => self.note_ok(),
            Err(e) => self.note(e, l.used),
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

    /// The out-of-memory text: the group as last read, or, when the file
    /// failed, what failed.
    pub fn explain(&self) -> String {
        if let Some(line) = self.lost() {
            return line;
        }
        if let Some(line) = self.said.lock().clone() {
            return line;
        }
        let l = self.local.lock();
        GroupInfo::from_table(&self.name, self.file.path.clone(), &l.last, vec![])
            .explain(Some(self.pid))
    }

    /// Sets this member's own cap (from inside: C ABI, Python); as
    /// [`super::Group::set_cap`]. The change wakes the poller, which gives
    /// back above the cap.
    pub fn set_cap(&self, cap: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        let pid = self.pid;
        let r = change(&self.file, self.ns, Some(self.slot), expect, |t| {
            set_cap_in(t, pid, cap)
        })?;
        self.refresh()?;
        Ok(r)
    }

    /// Sets the group's total (as [`super::Group::set_total`]).
    pub fn set_total(&self, total: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        let r = change(&self.file, self.ns, Some(self.slot), expect, |t| {
            set_total_in(t, total)
        })?;
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

    /// Starts the poller: it reads the file and, above the cap, calls `g`
    /// to give back; then it waits on the file's wake word (`wake.rs`) for
    /// the next change, at most one poll interval (the fallback). It stops
    /// when the member is dropped. One poller per member.
    pub fn serve(self: &Arc<Self>, g: Arc<dyn GiveBack>) -> std::io::Result<()> {
        self.serve_with(g, true)
    }

    /// As [`Member::serve`], without wake-ups: the poller reads the file
    /// every poll interval only (how members heard changes before wake-ups,
    /// kept for comparison and where the file cannot be mapped).
    pub fn serve_polling(self: &Arc<Self>, g: Arc<dyn GiveBack>) -> std::io::Result<()> {
        self.serve_with(g, false)
    }

    fn serve_with(self: &Arc<Self>, g: Arc<dyn GiveBack>, wake: bool) -> std::io::Result<()> {
        if self.serving.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let weak: Weak<Member> = Arc::downgrade(self);
        let word = if wake { self.file.wake.clone() } else { None };
        let poll = self.poll;
        std::thread::Builder::new()
            .name("vmmalloc-share".into())
            .spawn(move || loop {
                let Some(m) = weak.upgrade() else { return };
                let seen = m.poll_round(&*g);
                drop(m);
                match (&word, seen) {
                    (Some(w), Some(seen)) => {
                        if w.wait(seen, poll) == Woken::Failed {
                            std::thread::sleep(poll);
                        }
                    }
                    _ => std::thread::sleep(poll),
                }
            })
            .map(|_| ())
    }

    /// One round of the poller (also callable directly, e.g. by tests).
    pub fn poll_once(&self, g: &dyn GiveBack) {
        let _ = self.poll_round(g);
    }

    /// One round; returns the wake word read, `None` when the file could
    /// not be read (the poller then sleeps a poll interval).
    fn poll_round(&self, g: &dyn GiveBack) -> Option<u32> {
        let seen = match self.refresh_checked(true) {
            Ok(()) if !self.lost_now() => Some(self.local.lock().last.wake),
            _ => None,
        };
        if let Some(excess) = self.excess() {
            let freed = g.give_back(excess);
            let mut c = self.counts.lock();
            c.give_backs += 1;
            c.given_back += freed;
        }
        if seen.is_some() {
            if let Err(e) = self.publish_cached(g.cached()) {
                let used = self.used();
                self.note(&e, used);
            }
        }
        seen
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if !self.lost_now() {
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
        }
        live::release(&self.file.file, self.slot);
    }
}
