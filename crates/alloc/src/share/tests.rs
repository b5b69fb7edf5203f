//! The group's rules in one process: several opens of one file are
//! several members (each open holds its own liveness lock), so charges,
//! caps, revisions and errors are checked here; death needs real
//! processes (`crates/alloc/tests/share_procs.rs`).

use super::*;
use std::path::PathBuf;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmmalloc-share-unit-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join(name);
    let _ = std::fs::remove_file(&p);
    p
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
    std::fs::write(&p, b"not a group file").unwrap();
    let e = Member::join_path("g", &p, opts(GIB)).unwrap_err();
    assert!(matches!(e, ShareError::Corrupt { .. }), "{e}");
    let e = Group::open_path("g", &p).unwrap().info().unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");
    // An empty file (a creator died before writing it) is initialized.
    std::fs::write(&p, b"").unwrap();
    Member::join_path("g", &p, opts(GIB)).unwrap();
}

#[test]
fn a_corrupted_file_under_a_member_refuses_its_charges_without_panicking() {
    let p = tmp("corrupt-live");
    let a = Member::join_path("g", &p, opts(GIB)).unwrap();
    a.charge(2 * MIB, true).unwrap();
    std::fs::write(&p, vec![7u8; 4160]).unwrap();
    let r = a.charge(2 * MIB, true).unwrap_err();
    assert!(r.error.unwrap().contains("corrupt"));
    a.credit(2 * MIB); // logged, no panic
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
