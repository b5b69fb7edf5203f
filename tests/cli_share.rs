//! `vmmalloc share NAME` (docs/share.md): lists a group's members and
//! changes caps and the total from outside, refusing stale revisions; a
//! missing group, a bad size or an unknown member is one line and exit 1.
//! This test process is the member (it joins through the library, in a
//! temporary `VMMALLOC_SHARE_DIR` the CLI is pointed at too).

mod common;
use common::{cli, stderr, stdout, tmpdir};
use std::process::Output;
use vmmalloc_alloc::share::{JoinOptions, Member, DEFAULT_POLL, NO_CAP};

const GIB: u64 = 1 << 30;

fn share(dir: &std::path::Path, args: &[&str]) -> Output {
    cli()
        .arg("share")
        .args(args)
        .env("VMMALLOC_SHARE_DIR", dir)
        .output()
        .unwrap()
}

fn ok(dir: &std::path::Path, args: &[&str]) -> String {
    let o = share(dir, args);
    assert!(
        o.status.success(),
        "share {args:?}: {}{}",
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

fn user_error(dir: &std::path::Path, args: &[&str]) -> String {
    let o = share(dir, args);
    assert_eq!(o.status.code(), Some(1), "share {args:?}: {}", stdout(&o));
    let e = stderr(&o);
    assert!(
        e.starts_with("Error: ") && e.trim_end().lines().count() == 1,
        "{e}"
    );
    e
}

/// The member row of `pid` in a listing.
fn row<'a>(out: &'a str, pid: &str) -> &'a str {
    out.lines()
        .find(|l| l.trim_start().starts_with(pid))
        .unwrap_or_else(|| panic!("no row for pid {pid}: {out}"))
}

fn revision(dir: &std::path::Path, name: &str) -> u64 {
    let j: serde_json::Value = serde_json::from_str(&ok(dir, &[name, "--json"])).unwrap();
    j["revision"].as_u64().unwrap()
}

#[test]
fn share_lists_members_and_changes_caps_by_revision() {
    let dir = tmpdir("share");
    let name = "cli";
    let e = user_error(&dir, &[name]);
    assert!(e.contains("no share group file"), "{e}");
    // This process joins (the group is made with a 4 GiB total) and holds 1 GiB.
    let path = dir.join(format!(
        "vmmalloc-share-{}-{name}-gpu0",
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() }
    ));
    let opts = JoinOptions {
        total: 4 * GIB,
        cap: NO_CAP,
        poll: DEFAULT_POLL,
    };
    let m = Member::join_path(name, &path, opts).unwrap();
    m.charge(GIB, true).unwrap();
    let pid = std::process::id().to_string();
    let out = ok(&dir, &[name]);
    assert!(
        out.contains("total 4.00 GiB, used 1.00 GiB, revision 0"),
        "{out}"
    );
    for col in ["pid", "used", "cap", "state", "cached", "want"] {
        assert!(out.contains(col), "{col}: {out}");
    }
    let r = row(&out, &pid);
    assert!(
        r.contains("1.00 GiB") && r.contains("none") && r.contains("active"),
        "{r}"
    );
    // Lower the cap below what it holds: deferred (nothing live is revoked).
    let out = ok(
        &dir,
        &[name, "--cap", &format!("{pid}=512MiB"), "--revision", "0"],
    );
    let r = row(&out, &pid);
    assert!(r.contains("512.00 MiB") && r.contains("deferred"), "{out}");
    assert_eq!(revision(&dir, name), 1);
    // A change against revision 0 is stale now, and changes nothing.
    let e = user_error(
        &dir,
        &[name, "--cap", &format!("{pid}=none"), "--revision", "0"],
    );
    assert!(e.contains("stale") && e.contains("revision 1"), "{e}");
    assert_eq!(revision(&dir, name), 1);
    // Without --revision it applies; none lifts the cap.
    let out = ok(&dir, &[name, "--cap", &format!("{pid}=none")]);
    assert!(row(&out, &pid).contains("active"), "{out}");
    // The total: not below what members hold.
    let e = user_error(&dir, &[name, "--total", "512MiB"]);
    assert!(e.contains("below"), "{e}");
    let j: serde_json::Value =
        serde_json::from_str(&ok(&dir, &[name, "--total", "2GiB", "--json"])).unwrap();
    assert_eq!(j["total"], 2 * GIB);
    assert_eq!(j["members"][0]["used"], GIB);
    assert!(j["members"][0]["cap"].is_null());
    // Bad input is one line.
    for (args, want) in [
        (vec![name, "--cap", "12"], "PID=SIZE"),
        (vec![name, "--cap", "x=1GiB"], "not a process id"),
        (vec![name, "--cap", "1=lots"], "--cap 1=lots"),
        (vec![name, "--cap", "1=1GiB"], "no live member with pid 1"),
        (vec![name, "--revision", "3"], "applies to a change"),
        (vec!["a/b"], "bad share group name"),
        (vec![name, "--device", "foo"], "bad share device \"foo\""),
        (
            vec![name, "--total", "10TiB"],
            "above the 4.00 GiB of the group's device",
        ),
        (vec![name, "--total", "1"], "below one page"),
        (
            vec![name, "--cap", &format!("{pid}=18446744073709551615")],
            "write `none`",
        ),
    ] {
        let e = user_error(&dir, &args);
        assert!(e.contains(want), "{args:?}: {e}");
    }
    // Several changes apply together or not at all.
    let before = revision(&dir, name);
    let e = user_error(
        &dir,
        &[name, "--cap", &format!("{pid}=1GiB"), "--cap", "1=1GiB"],
    );
    assert!(e.contains("no live member with pid 1"), "{e}");
    assert_eq!(revision(&dir, name), before, "nothing applied");
    let j: serde_json::Value = serde_json::from_str(&ok(&dir, &[name, "--json"])).unwrap();
    assert!(j["members"][0]["cap"].is_null(), "{j}");
    // A cap of 0 holds nothing: the member reads deferred above it.
    let out = ok(&dir, &[name, "--cap", &format!("{pid}=0")]);
    assert!(row(&out, &pid).contains("deferred"), "{out}");
    assert_eq!(m.limit(), 0);
    // --recover leaves a good file alone and refuses while members live.
    let out = ok(&dir, &[name, "--recover"]);
    assert!(out.starts_with("nothing to recover"), "{out}");
    drop(m);
    let out = ok(&dir, &[name]);
    assert!(
        !out.lines().any(|l| l.trim_start().starts_with(&pid)),
        "a member that left is gone: {out}"
    );
}

/// A cut group file: its member keeps what it holds, the listing and new
/// members are refused with what to do, `--recover` waits for the member
/// to leave and then removes the file.
#[test]
fn share_recover_removes_a_cut_file_once_no_member_holds_it() {
    let dir = tmpdir("share-recover");
    let name = "cut";
    let path = dir.join(format!(
        "vmmalloc-share-{}-{name}-gpu0",
        // SAFETY: getuid has no preconditions.
        unsafe { libc::getuid() }
    ));
    let opts = JoinOptions {
        total: 4 * GIB,
        cap: NO_CAP,
        poll: DEFAULT_POLL,
    };
    let m = Member::join_path(name, &path, opts.clone()).unwrap();
    m.charge(GIB, true).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = user_error(&dir, &[name]);
    assert!(e.contains("corrupt") && e.contains("--recover"), "{e}");
    let e = user_error(&dir, &[name, "--recover"]);
    assert!(e.contains("live members still hold it"), "{e}");
    assert!(m.charge(GIB, true).is_err());
    assert!(m.lost().unwrap().contains("keeps the 1.00 GiB"));
    drop(m);
    let out = ok(&dir, &[name, "--recover"]);
    assert!(out.starts_with("removed"), "{out}");
    drop(Member::join_path(name, &path, opts).unwrap());
    assert!(ok(&dir, &[name]).contains("total 4.00 GiB"));
}
