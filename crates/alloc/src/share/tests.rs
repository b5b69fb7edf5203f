//! The group's rules in one process: several opens of one file are
//! several members (each open holds its own liveness lock), so charges,
//! caps, revisions and errors are checked here; death needs real
//! processes (`crates/alloc/tests/share_procs.rs`).

use super::format::Table;
use super::*;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn tmp(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let d = std::env::temp_dir().join(format!("vmmalloc-share-unit-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    let p = d.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// Writes `bytes` to a new file `p` of mode 0600 (as vmmalloc would).
fn plant(p: &std::path::Path, bytes: &[u8], mode: u32) {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let _ = std::fs::remove_file(p);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(p)
        .unwrap();
    f.write_all(bytes).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn opts(total: u64) -> JoinOptions {
    JoinOptions {
        total,
        cap: NO_CAP,
        poll: DEFAULT_POLL,
    }
}

#[test]
fn members_charge_one_total_and_a_full_group_refuses() {
    let p = tmp("full");
    let a = Member::join_path("g", &p, opts(4 * GIB)).unwrap();
    let b = Member::join_path("g", &p, opts(99 * GIB)).unwrap();
    a.charge(3 * GIB, true).unwrap();
    b.refresh().unwrap();
    assert_eq!(b.limit(), GIB, "b may take what a leaves of the total");
    b.charge(GIB, true).unwrap();
    let r = b.charge(2 * MIB, true).unwrap_err();
    assert_eq!(
        r.why,
        Some(Refusal::GroupFull {
            used: 4 * GIB,
            total: 4 * GIB
        })
    );
    assert!(
        r.info.explain(None).contains("4.00 GiB"),
        "{}",
        r.info.explain(None)
    );
    // Memory that replaces memory just released is never refused.
    b.charge(2 * MIB, false).unwrap();
    b.credit(2 * MIB);
    a.credit(GIB);
    b.charge(GIB, true).unwrap();
    let g = Group::open_path("g", &p).unwrap().info().unwrap();
    assert_eq!((g.total, g.used, g.members.len()), (4 * GIB, 4 * GIB, 2));
    assert_eq!(a.counts().refusals + b.counts().refusals, 1);
}

#[test]
fn a_cap_refuses_above_it_and_a_lowered_cap_reads_deferred_until_freed() {
    let p = tmp("cap");
    let a = Member::join_path("g", &p, opts(8 * GIB)).unwrap();
    let admin = Group::open_path("g", &p).unwrap();
    a.charge(3 * GIB, true).unwrap();
    let pid = std::process::id();
    let rev = admin.info().unwrap().revision;
    let rev2 = admin.set_cap(pid, 2 * GIB, Some(rev)).unwrap();
    assert_eq!(rev2, rev + 1);
    let m = &admin.info().unwrap().members[0];
    assert_eq!(
        (m.state, m.cap, m.cap_rev),
        (MemberState::Deferred, 2 * GIB, rev2)
    );
    a.refresh().unwrap();
    assert_eq!(a.excess(), Some(GIB));
    assert_eq!(a.limit(), 2 * GIB);
    let r = a.charge(2 * MIB, true).unwrap_err();
    assert_eq!(
        r.why,
        Some(Refusal::OverCap {
            used: 3 * GIB,
            cap: 2 * GIB
        })
    );
    a.credit(GIB);
    assert_eq!(a.excess(), None);
    assert_eq!(admin.info().unwrap().members[0].state, MemberState::Active);
    // Restoring the cap re-enables growth (kvcached's bug: it did not).
    admin.set_cap(pid, NO_CAP, None).unwrap();
    a.charge(5 * GIB, true).unwrap();
}

#[test]
fn a_stale_revision_is_refused_and_changes_nothing() {
    let p = tmp("stale");
    let _a = Member::join_path("g", &p, opts(8 * GIB)).unwrap();
    let x = Group::open_path("g", &p).unwrap();
    let y = Group::open_path("g", &p).unwrap();
    let rev = x.info().unwrap().revision;
    let pid = std::process::id();
    x.set_cap(pid, 3 * GIB, Some(rev)).unwrap();
    let e = y.set_cap(pid, 5 * GIB, Some(rev)).unwrap_err();
    assert!(
        matches!(e, ShareError::Stale { expected, found } if expected == rev && found == rev + 1),
        "{e}"
    );
    assert_eq!(y.info().unwrap().members[0].cap, 3 * GIB);
    let e = y.set_total(GIB, Some(rev)).unwrap_err();
    assert!(matches!(e, ShareError::Stale { .. }), "{e}");
    assert!(matches!(
        y.set_cap(1, GIB, None).unwrap_err(),
        ShareError::NoMember(1)
    ));
}

#[test]
fn a_total_below_the_use_is_refused() {
    let p = tmp("total");
    let a = Member::join_path("g", &p, opts(8 * GIB)).unwrap();
    a.charge(3 * GIB, true).unwrap();
    let e = a.set_total(2 * GIB, None).unwrap_err();
    assert!(matches!(e, ShareError::TotalBelowUse { .. }), "{e}");
    a.set_total(3 * GIB, None).unwrap();
    assert!(a.charge(2 * MIB, true).is_err());
}

#[test]
fn a_member_that_leaves_frees_its_slot() {
    let p = tmp("leave");
    let a = Member::join_path("g", &p, opts(4 * GIB)).unwrap();
    let b = Member::join_path("g", &p, opts(4 * GIB)).unwrap();
    b.charge(GIB, true).unwrap();
    b.credit(GIB);
    drop(b);
    let g = a.info().unwrap();
    assert_eq!(g.members.len(), 1);
    assert!(g.reaped.is_empty());
}

#[test]
fn a_missing_or_corrupt_file_is_a_clear_error() {
    let p = tmp("missing");
    let e = Group::open_path("g", &p).unwrap_err();
    assert!(matches!(e, ShareError::Missing(_)), "{e}");
    assert!(e.to_string().contains("no share group file"), "{e}");
    plant(&p, b"not a group file", 0o600);
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("--recover"), "says what to do: {e}");
    assert!(!e.to_string().contains("remove it"), "{e}");
    let e = Group::open_path("g", &p).unwrap().info().unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");
    // An empty file is corrupt too: a file is made whole before it has
    // its name, so an empty one was cut, never half-made.
    plant(&p, b"", 0o600);
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::Corrupt { .. }), "{e}");
    let said = Group::recover_path("g", &p).unwrap();
    assert!(said.starts_with("removed"), "{said}");
    Member::join_path("g", &p, opts(GIB)).unwrap();
    let said = Group::recover_path("g", &p).unwrap();
    assert!(said.starts_with("nothing to recover"), "{said}");
}

#[test]
fn a_corrupted_file_under_a_member_refuses_its_charges_without_panicking() {
    let p = tmp("corrupt-live");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    a.charge(2 * MIB, true).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .write_all_at(&[7u8; 64], 0)
        .unwrap();
    let r = a.charge(2 * MIB, true).unwrap_err();
    let e = r.error.unwrap();
    assert!(
        e.contains("corrupt") && e.contains("keeps the 2.00 MiB"),
        "{e}"
    );
    assert!(
        a.explain().contains("corrupt"),
        "the report names the error"
    );
    a.credit(2 * MIB); // no write, no panic
                       // Memory that replaces memory just released is still granted.
    a.charge(2 * MIB, false).unwrap();
    assert_eq!(a.limit(), 2 * MIB, "a lost member plans with what it holds");
    assert!(a.charge(2 * MIB, true).is_err());
}

#[test]
fn the_liveness_lock_is_held_while_a_member_lives() {
    let p = tmp("live");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    assert!(live::held_elsewhere(&f, a.slot));
    let slot = a.slot;
    drop(a);
    assert!(!live::held_elsewhere(&f, slot));
}

#[test]
fn a_removed_file_is_noticed_and_nobody_joins_beside_its_members() {
    let p = tmp("removed");
    let a = Member::join_path("g", &p, opts(512 * MIB)).unwrap();
    a.charge(400 * MIB, true).unwrap();
    std::fs::remove_file(&p).unwrap();
    let r = a.charge(2 * MIB, true).unwrap_err();
    let e = r.error.unwrap();
    assert!(
        e.contains("was removed") && e.contains(&p.display().to_string()),
        "{e}"
    );
    assert_eq!(a.lost().as_deref(), Some(e.as_str()));
    // A newcomer would make a new file and take 512 MiB beside a's 400:
    // refused while a runs.
    let e = Member::join_path("g", &p, opts(512 * MIB)).unwrap_err();
    assert!(matches!(e, ShareError::Orphaned(_)), "{e}");
    let e = Group::open_path("g", &p).unwrap_err();
    assert!(matches!(e, ShareError::Orphaned(_)), "{e}");
    let e = Group::recover_path("g", &p).unwrap_err();
    assert!(matches!(e, ShareError::Orphaned(_)), "{e}");
    a.credit(400 * MIB);
    drop(a);
    let b = Member::join_path("g", &p, opts(512 * MIB)).unwrap();
    b.charge(512 * MIB, true).unwrap();
}

#[test]
fn a_replaced_or_cut_file_is_noticed() {
    let p = tmp("replaced");
    let other = tmp("replaced-other");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    a.charge(2 * MIB, true).unwrap();
    drop(Member::join_path("g", &other, opts(8 * GIB)).unwrap());
    std::fs::rename(&other, &p).unwrap();
    let e = a.charge(2 * MIB, true).unwrap_err().error.unwrap();
    assert!(e.contains("was replaced"), "{e}");
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::Orphaned(_)), "{e}");
    drop(a);
    Member::join_path("g", &p, opts(GIB)).unwrap();

    let p = tmp("cut");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    a.charge(2 * MIB, true).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = a.charge(2 * MIB, true).unwrap_err().error.unwrap();
    assert!(
        e.contains("was cut to 0 bytes") && e.contains("--recover"),
        "{e}"
    );
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::Corrupt { .. }), "{e}");
    assert!(matches!(
        Group::recover_path("g", &p).unwrap_err(),
        ShareError::Busy(_)
    ));
    drop(a);
    Group::recover_path("g", &p).unwrap();
    Member::join_path("g", &p, opts(GIB)).unwrap();
}

#[test]
fn planted_files_and_directories_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let p = tmp("planted");
    // A file of another mode.
    plant(&p, &Table::new(GIB).encode(), 0o666);
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("mode is 0666"), "{e}");
    // A symbolic link, to a file the victim could write.
    std::fs::remove_file(&p).unwrap();
    let target = tmp("planted-target");
    std::fs::write(&target, b"precious").unwrap();
    std::os::unix::fs::symlink(&target, &p).unwrap();
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    // A directory.
    std::fs::remove_file(&p).unwrap();
    std::fs::create_dir(&p).unwrap();
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("a directory"), "{e}");
    std::fs::remove_dir(&p).unwrap();
    // A directory others can write.
    let d = tmp("open-dir");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Member::join_path("g", &d.join("f"), opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::UnsafeDir { .. }), "{e}");
    assert!(e.to_string().contains("0777"), "{e}");
    // A directory that is a link.
    let l = tmp("dir-link");
    std::os::unix::fs::symlink(&d, &l).unwrap();
    let e = Member::join_path("g", &l.join("f"), opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    std::fs::remove_file(&l).unwrap();
    // Another user's file and directory (root can make them here).
    if !is_root() {
        eprintln!("skipped: other owners need root to be made here");
        return;
    }
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    let f = d.join("theirs");
    plant(&f, &Table::new(GIB).encode(), 0o600);
    std::os::unix::fs::chown(&f, Some(65534), Some(65534)).unwrap();
    let e = Member::join_path("g", &f, opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("belongs to uid 65534"), "{e}");
    std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
    let e = Member::join_path("g", &d.join("new"), opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::UnsafeDir { .. }), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_group_of_several_users_needs_its_directory_and_mode() {
    let p = tmp("@all");
    let d = p.parent().unwrap().join("all-users");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    let f = d.join("vmmalloc-share-all-team-gpu0");
    let a = Member::join_path("@team", &f, opts(GIB)).unwrap();
    let st = std::fs::metadata(&f).unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!(st.mode() & 0o7777, 0o660);
    assert_eq!(st.gid(), std::fs::metadata(&d).unwrap().gid());
    drop(a);
    // The same file as a one-user group is refused (its mode says several).
    let e = Member::join_path("team", &f, opts(GIB)).unwrap_err();
    assert!(e.to_string().contains("mode is 0660"), "{e}");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Member::join_path("@team", &f, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::UnsafeDir { .. }), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_stalled_lock_is_given_up_on_naming_its_holder() {
    use std::os::fd::AsRawFd;
    let p = tmp("stalled");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
    let t0 = Instant::now();
    let e = a.charge(2 * MIB, true).unwrap_err().error.unwrap();
    let took = t0.elapsed();
    assert!(took >= LOCK_WAIT && took < 10 * LOCK_WAIT, "{took:?}");
    assert!(
        e.contains("held for more than 1 s") && e.contains(&std::process::id().to_string()),
        "{e}"
    );
    assert!(a.lost().is_none(), "a stall is passing, not a lost file");
    // Later waits are short while the holder stays.
    let t0 = Instant::now();
    assert!(a.charge(2 * MIB, true).is_err());
    assert!(t0.elapsed() < LOCK_WAIT, "{:?}", t0.elapsed());
    drop(f);
    a.charge(2 * MIB, true).unwrap();
}

#[test]
fn changes_apply_all_or_none_and_totals_are_checked() {
    let p = tmp("apply");
    let a = Member::join_path("g", &p, opts(4 * GIB)).unwrap();
    let g = Group::open_path("g", &p).unwrap();
    let pid = std::process::id();
    let e = g
        .apply(
            &[
                Change::Cap { pid, cap: GIB },
                Change::Cap { pid: 1, cap: GIB },
            ],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, ShareError::NoMember(1)), "{e}");
    let info = g.info().unwrap();
    assert_eq!(
        (info.members[0].cap, info.revision),
        (NO_CAP, 0),
        "none applied"
    );
    let rev = g
        .apply(
            &[Change::Cap { pid, cap: GIB }, Change::Total(2 * GIB)],
            Some(0),
        )
        .unwrap();
    assert_eq!(rev, 1, "one change, one revision");
    let info = g.info().unwrap();
    assert_eq!((info.members[0].cap, info.total), (GIB, 2 * GIB));
    for (total, want) in [
        (1, "below one page"),
        (MIN_TOTAL - 1, "below one page"),
        (5 * GIB, "above the 4.00 GiB"),
        (u64::MAX, "above"),
    ] {
        let e = g.set_total(total, None).unwrap_err();
        assert!(e.to_string().contains(want), "{total}: {e}");
    }
    g.set_total(0, None).unwrap();
    assert!(
        a.charge(2 * MIB, true).is_err(),
        "a total of 0 holds nothing"
    );
    a.set_cap(0, None).unwrap();
    assert_eq!(a.limit(), 0);
}

/// A GiveBack that counts its rounds.
struct Rounds(std::sync::atomic::AtomicU64);

impl GiveBack for Rounds {
    fn give_back(&self, _excess: u64) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        0
    }
    fn cached(&self) -> u64 {
        0
    }
}

#[test]
fn a_cap_change_wakes_the_poller_without_waiting_for_a_poll() {
    let p = tmp("wake");
    // A poll of 10 minutes: only a wake-up can make the round below.
    let a = Member::join_path(
        "g",
        &p,
        JoinOptions {
            poll: Duration::from_secs(600),
            ..opts(GIB)
        },
    )
    .unwrap();
    a.charge(4 * MIB, true).unwrap();
    let rounds = std::sync::Arc::new(Rounds(Default::default()));
    a.serve(rounds.clone()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(rounds.0.load(std::sync::atomic::Ordering::SeqCst), 0);
    Group::open_path("g", &p)
        .unwrap()
        .set_cap(std::process::id(), 2 * MIB, None)
        .unwrap();
    let t0 = Instant::now();
    while rounds.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no wake-up");
        std::thread::sleep(Duration::from_millis(1));
    }
}
