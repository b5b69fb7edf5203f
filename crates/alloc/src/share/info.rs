//! A group as read from its file, and how it is shown: the listing of
//! `vmmalloc share`, its JSON, the out-of-memory report.

use super::format::{Table, NO_CAP};
use crate::error::format_bytes;
use std::fmt;
use std::path::PathBuf;

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
    pub(super) fn from_table(name: &str, path: PathBuf, t: &Table, reaped: Vec<u32>) -> GroupInfo {
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
            "group {}: total {}, used {}, revision {}",
            self.name,
            format_bytes(self.total),
            format_bytes(self.used),
            self.revision,
        )?;
        writeln!(f, "  file {}", self.path.display())?;
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
