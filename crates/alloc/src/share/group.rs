//! A group read and changed from outside its members (`vmmalloc share`),
//! and the changes members make too: every change is one locked
//! read-check-write of the table that raises the revision and wakes the
//! members (`wake.rs`).

use super::file::{GroupFile, Scope, MIN_TOTAL};
use super::format::{Slot, Table, SLOTS};
use super::info::GroupInfo;
use super::{live, path, ShareError};
use crate::error::format_bytes;

/// Frees the slots of dead members in `t` (never `skip`, the reader's
/// own); returns their pids.
pub(super) fn reap(g: &GroupFile, t: &mut Table, skip: Option<usize>, my_ns: u64) -> Vec<u32> {
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

/// Opens group file `p` of group `name` and checks that no member runs on
/// a file that is no longer at `p` ([`ShareError::Orphaned`]).
pub(super) fn open_checked(
    name: &str,
    p: &std::path::Path,
    create: Option<u64>,
) -> Result<GroupFile, ShareError> {
    let scope = Scope::of(name);
    if create.is_some() {
        // The directory is made (mode 0700) on first use.
        super::file::open_dir(p.parent().unwrap_or(std::path::Path::new(".")), scope, true)?;
    }
    // A missing file is made only when no member of a removed one runs.
    let first = match GroupFile::open(p, None, scope) {
        Err(ShareError::Missing(_)) if create.is_some() => {
            if let Some(d) = p.parent() {
                let dir = super::file::open_dir(d, scope, true)?;
                if live::others_present(&dir, base(p), None) {
                    return Err(ShareError::Orphaned(p.to_path_buf()));
                }
            }
            GroupFile::open(p, create, scope)
        }
        r => r,
    };
    let file = match first {
        Err(ShareError::Missing(path)) => {
            // Nothing at the path: are members of a removed file running?
            if let Some(d) = p.parent() {
                if let Ok(dir) = super::file::open_dir(d, scope, false) {
                    if live::others_present(&dir, base(p), None) {
                        return Err(ShareError::Orphaned(path));
                    }
                }
            }
            return Err(ShareError::Missing(path));
        }
        r => r?,
    };
    if live::others_present(&file.dir, base(p), Some(file.ino)) {
        return Err(ShareError::Orphaned(file.path.clone()));
    }
    Ok(file)
}

/// The presence range of group file `p` (`live.rs`).
pub(super) fn base(p: &std::path::Path) -> i64 {
    use std::os::unix::ffi::OsStrExt;
    live::presence_base(p.file_name().map_or(&[][..], |n| n.as_bytes()))
}

/// A group read and changed from outside (the `vmmalloc share` command, or
/// any process that is not a member).
#[derive(Debug)]
pub struct Group {
    name: String,
    file: GroupFile,
    ns: u64,
}

/// One change of a group ([`Group::apply`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Sets member `pid`'s cap to `cap` bytes ([`super::NO_CAP`]: none).
    Cap {
        /// The member.
        pid: u32,
        /// Its new cap.
        cap: u64,
    },
    /// Sets the group's total.
    Total(u64),
}

impl Group {
    /// Opens group `name` on device `device` (`gpuN`, `hostN`, `simN`);
    /// the file must exist ([`ShareError::Missing`] otherwise).
    pub fn open(name: &str, device: &str) -> Result<Group, ShareError> {
        Group::open_path(name, &path(name, device)?)
    }

    /// Opens the group file at `p` (named `name` in reports).
    pub fn open_path(name: &str, p: &std::path::Path) -> Result<Group, ShareError> {
        Ok(Group {
            name: name.to_string(),
            file: open_checked(name, p, None)?,
            ns: live::pid_namespace(),
        })
    }

    /// Reads the group, giving back the budget of dead members first.
    pub fn info(&self) -> Result<GroupInfo, ShareError> {
        let _l = self.file.lock()?;
        let mut t = self.file.read_checked(true)?;
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

    /// Sets the cap of member `pid` to `cap` bytes ([`super::NO_CAP`]: none).
    /// With `expect`, refused as [`ShareError::Stale`] unless the group is
    /// still at that revision. Returns the new revision.
    pub fn set_cap(&self, pid: u32, cap: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        self.apply(&[Change::Cap { pid, cap }], expect)
    }

    /// Sets the group's total. Refused below what the members hold
    /// ([`ShareError::TotalBelowUse`]), above the group's most, between 1
    /// byte and one page ([`ShareError::BadTotal`]) and, with `expect`,
    /// when stale. Returns the new revision.
    pub fn set_total(&self, total: u64, expect: Option<u64>) -> Result<u64, ShareError> {
        self.apply(&[Change::Total(total)], expect)
    }

    /// Makes `changes` together, as one change of one revision: all of
    /// them, or none when one is refused. Returns the new revision.
    pub fn apply(&self, changes: &[Change], expect: Option<u64>) -> Result<u64, ShareError> {
        change(&self.file, self.ns, None, expect, |t| {
            for c in changes {
                match *c {
                    Change::Cap { pid, cap } => set_cap_in(t, pid, cap)?,
                    Change::Total(total) => set_total_in(t, total)?,
                }
            }
            Ok(())
        })
    }

    /// Removes group `name`'s file on `device` when it is corrupt, of
    /// another version, or not a file vmmalloc made, so that the next
    /// member makes it again. Refused ([`ShareError::Busy`]) while a live
    /// member holds it or a file that was at its path; a good file is
    /// left alone. Returns what was done, as a line.
    pub fn recover(name: &str, device: &str) -> Result<String, ShareError> {
        Group::recover_path(name, &path(name, device)?)
    }

    /// [`Group::recover`] of the file at `p`.
    pub fn recover_path(name: &str, p: &std::path::Path) -> Result<String, ShareError> {
        let scope = Scope::of(name);
        let d = p.parent().unwrap_or(std::path::Path::new("."));
        let dir = super::file::open_dir(d, scope, false)?;
        let busy = |f: Option<&GroupFile>| {
            live::others_present(&dir, base(p), None)
                || f.is_some_and(|f| live::any_held_elsewhere(&f.file))
        };
        let why = match GroupFile::open(p, None, scope) {
            Err(ShareError::Missing(_)) => {
                if busy(None) {
                    return Err(ShareError::Orphaned(p.to_path_buf()));
                }
                return Ok(format!(
                    "nothing to recover: no file at {} (the next member makes it)",
                    p.display()
                ));
            }
            Err(e @ ShareError::UnsafeFile { .. }) => {
                if busy(None) {
                    return Err(ShareError::Busy(p.to_path_buf()));
                }
                remove_name(&dir, p)?;
                return Ok(format!("removed: {e}"));
            }
            Err(e) => return Err(e),
            Ok(f) => {
                let _l = f.lock()?;
                match f.read() {
                    Ok(_) => {
                        return Ok(format!(
                            "nothing to recover: {} is a good group file",
                            p.display()
                        ))
                    }
                    Err(e) => {
                        if busy(Some(&f)) {
                            return Err(ShareError::Busy(p.to_path_buf()));
                        }
                        f.unlink()?;
                        e
                    }
                }
            }
        };
        Ok(format!(
            "removed {} ({why}); the next member makes the group again",
            p.display()
        ))
    }
}

/// Removes the name of `p` in its open directory `dir`.
fn remove_name(dir: &std::fs::File, p: &std::path::Path) -> Result<(), ShareError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let io = |e| ShareError::Io {
        what: "remove",
        path: p.to_path_buf(),
        source: e,
    };
    let name = std::ffi::CString::new(p.file_name().map_or(&[][..], |n| n.as_bytes()))
        .map_err(|_| ShareError::BadName(p.display().to_string()))?;
    // SAFETY: unlinkat with a directory we own and a NUL-terminated name.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
        return Err(io(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Sets member `pid`'s cap in `t` (the change's revision is `t.revision +
/// 1`).
pub(super) fn set_cap_in(t: &mut Table, pid: u32, cap: u64) -> Result<(), ShareError> {
    let rev = t.revision.wrapping_add(1);
    let s = t
        .slots
        .iter_mut()
        .find(|s| s.taken() && s.pid == pid)
        .ok_or(ShareError::NoMember(pid))?;
    s.cap = cap;
    s.cap_rev = rev;
    s.settle();
    Ok(())
}

/// Sets the total in `t`, checked: 0 (nothing) or at least one page, at
/// most the group's most, not below what the members hold.
pub(super) fn set_total_in(t: &mut Table, total: u64) -> Result<(), ShareError> {
    if total != 0 && total < MIN_TOTAL {
        return Err(ShareError::BadTotal(format!(
            "a total of {total} bytes is below one page ({}): write 0 for a group that \
             holds nothing",
            format_bytes(MIN_TOTAL)
        )));
    }
    if total > t.max_total {
        return Err(ShareError::BadTotal(format!(
            "a total of {} is above the {} of the group's device (its most)",
            format_bytes(total),
            format_bytes(t.max_total)
        )));
    }
    let used = t.used();
    if total < used {
        return Err(ShareError::TotalBelowUse { total, used });
    }
    t.total = total;
    Ok(())
}

/// A change under the lock: dead members reaped, the revision checked
/// against `expect`, `f` applied, the revision raised, the wake word
/// raised, the file written, the members woken.
pub(super) fn change(
    g: &GroupFile,
    ns: u64,
    me: Option<usize>,
    expect: Option<u64>,
    f: impl FnOnce(&mut Table) -> Result<(), ShareError>,
) -> Result<u64, ShareError> {
    let rev = {
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
        let next = t.next_revision(&g.path)?;
        f(&mut t)?;
        t.revision = next;
        t.wake = t.wake.wrapping_add(1);
        g.write(&t)?;
        t.revision
    };
    g.wake_all();
    Ok(rev)
}
