//! The format of a budget group's file.
//!
//! # Format (version 2, little-endian, [`FILE_LEN`] bytes)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `VMMSHARE` |
//! | 8 | 4 | format version ([`VERSION`]) |
//! | 12 | 4 | slots ([`SLOTS`]) |
//! | 16 | 8 | total: bytes the group may hold together |
//! | 24 | 8 | revision: +1 on every change of a cap or of the total |
//! | 32 | 8 | checksum of the rest of the file ([`checksum`]) |
//! | 40 | 4 | wake: +1 on every change a member must hear at once (a futex word) |
//! | 44 | 4 | zero (reserved) |
//! | 48 | 8 | max total: the memory of the device the group was made on |
//! | 56 | 8 | zero (reserved) |
//! | 64 + 64·i | 64 | slot `i` ([`Slot`]) |
//!
//! A slot: `pid` u32, `state` u32 (0 free, 1 active, 2 deferred), `start`
//! u64 (the process's start time, `/proc/PID/stat` field 22, in clock
//! ticks since boot), `used` u64 (bytes charged), `cap` u64 (bytes,
//! `u64::MAX` for none), `cap_rev` u64 (the revision that set the cap),
//! `want` u64 (bytes of the last refused charge, 0 once one succeeds),
//! `cached` u64 (bytes the member holds for no live tensor, as it last
//! published them), `pidns` u64 (inode of its pid namespace).
//!
//! Every read and write of the table is made under `flock(LOCK_EX)` of the
//! whole file (kvcached's `shm` file takes the same lock,
//! `kvcached/cli/utils.py`), waited for a bounded time (`file.rs`, `LOCK_WAIT`). Anything
//! that is not a whole version-2 file with a good checksum is refused as
//! corrupt, never read and never rewritten.

use super::ShareError;
use std::path::Path;

/// The file's first bytes.
pub const MAGIC: [u8; 8] = *b"VMMSHARE";
/// The format version this code reads and writes.
pub const VERSION: u32 = 2;
/// Member slots per group.
pub const SLOTS: usize = 32;
/// Bytes of the header.
const HEADER: usize = 64;
/// Bytes of one slot.
const SLOT: usize = 64;
/// Bytes of the whole file.
pub const FILE_LEN: usize = HEADER + SLOTS * SLOT;
/// Offset of the wake word (a futex word, `wake.rs`).
pub const WAKE_AT: usize = 40;
/// `cap` of a member without one.
pub const NO_CAP: u64 = u64::MAX;
/// First byte of the liveness locks: slot `i`'s member holds an
/// open-file-description lock on byte `LIVE_BASE + i` while it lives
/// (`live.rs`). Beyond the end of the file, where locks need no data.
pub const LIVE_BASE: i64 = 1 << 20;
/// A slot's state as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// No member.
    Free,
    /// A member within its cap.
    Active,
    /// A member above its cap, giving back.
    Deferred,
}

/// One member's slot (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Process id.
    pub pid: u32,
    /// Free, active or deferred.
    pub state: SlotState,
    /// Start time of the process (clock ticks since boot).
    pub start: u64,
    /// Bytes charged.
    pub used: u64,
    /// Most bytes it may hold ([`NO_CAP`]: none).
    pub cap: u64,
    /// The revision that set `cap`.
    pub cap_rev: u64,
    /// Bytes of its last refused charge (0 after a charge succeeds).
    pub want: u64,
    /// Bytes it holds for no live tensor (published by its poller).
    pub cached: u64,
    /// Inode of its pid namespace.
    pub pidns: u64,
}

impl Slot {
    /// A free slot.
    pub const FREE: Slot = Slot {
        pid: 0,
        state: SlotState::Free,
        start: 0,
        used: 0,
        cap: NO_CAP,
        cap_rev: 0,
        want: 0,
        cached: 0,
        pidns: 0,
    };

    /// Whether a member holds the slot.
    pub fn taken(&self) -> bool {
        self.state != SlotState::Free
    }

    /// The state its figures give: deferred above its cap, else active.
    pub fn settle(&mut self) {
        if self.taken() {
            self.state = if self.used > self.cap {
                SlotState::Deferred
            } else {
                SlotState::Active
            };
        }
    }
}

/// The whole table, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Bytes the group may hold together.
    pub total: u64,
    /// +1 on every change of a cap or of the total.
    pub revision: u64,
    /// +1 (wrapping) on every change members must hear at once.
    pub wake: u32,
    /// The most the total may be set to (the device's memory as the
    /// group's first member saw it).
    pub max_total: u64,
    /// The member slots.
    pub slots: [Slot; SLOTS],
}

impl Table {
    /// An empty group of `total` bytes, which is also its most.
    pub fn new(total: u64) -> Table {
        Table {
            total,
            revision: 0,
            wake: 0,
            max_total: total,
            slots: [Slot::FREE; SLOTS],
        }
    }

    /// Bytes charged by all members (a decoded table's sum fits: checked
    /// by [`Table::decode`]; saturated otherwise).
    pub fn used(&self) -> u64 {
        self.used_except(None)
    }

    /// Bytes charged by members other than slot `me`.
    pub fn used_by_others(&self, me: usize) -> u64 {
        self.used_except(Some(me))
    }

    fn used_except(&self, me: Option<usize>) -> u64 {
        let sum: u128 = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| Some(*i) != me && s.taken())
            .map(|(_, s)| u128::from(s.used))
            .sum();
        u64::try_from(sum).unwrap_or(u64::MAX)
    }

    /// Whether `me`'s member may hold `used` bytes with the others' use
    /// beside it within the total (no overflow: sums in 128 bits).
    pub fn fits(&self, me: usize, used: u64) -> bool {
        u128::from(self.used_by_others(me)) + u128::from(used) <= u128::from(self.total)
    }

    /// The revision after this one (an error at the end of `u64`).
    pub fn next_revision(&self, path: &Path) -> Result<u64, ShareError> {
        self.revision
            .checked_add(1)
            .ok_or_else(|| ShareError::Corrupt {
                path: path.to_path_buf(),
                why: "its revision is at the largest number".into(),
            })
    }

    /// The encoded file.
    pub fn encode(&self) -> [u8; FILE_LEN] {
        let mut b = [0u8; FILE_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b[24..32].copy_from_slice(&self.revision.to_le_bytes());
        b[WAKE_AT..WAKE_AT + 4].copy_from_slice(&self.wake.to_le_bytes());
        b[48..56].copy_from_slice(&self.max_total.to_le_bytes());
        for (i, s) in self.slots.iter().enumerate() {
            let o = HEADER + i * SLOT;
            let state: u32 = match s.state {
                SlotState::Free => 0,
                SlotState::Active => 1,
                SlotState::Deferred => 2,
            };
            b[o..o + 4].copy_from_slice(&s.pid.to_le_bytes());
            b[o + 4..o + 8].copy_from_slice(&state.to_le_bytes());
            for (k, v) in [s.start, s.used, s.cap, s.cap_rev, s.want, s.cached, s.pidns]
                .into_iter()
                .enumerate()
            {
                b[o + 8 + 8 * k..o + 16 + 8 * k].copy_from_slice(&v.to_le_bytes());
            }
        }
        let sum = checksum(&b);
        b[32..40].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes a file; `path` names it in errors.
    pub fn decode(b: &[u8], path: &Path) -> Result<Table, ShareError> {
        let corrupt = |why: String| ShareError::Corrupt {
            path: path.to_path_buf(),
            why,
        };
        if b.len() < 16 || b[0..8] != MAGIC {
            return Err(corrupt(format!(
                "{} bytes that do not start with the magic VMMSHARE",
                b.len()
            )));
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let version = u32_at(8);
        if version != VERSION {
            return Err(ShareError::Version {
                path: path.to_path_buf(),
                found: version,
                supported: VERSION,
            });
        }
        if b.len() != FILE_LEN || u32_at(12) as usize != SLOTS {
            return Err(corrupt(format!(
                "{} bytes and {} slots, where version {VERSION} has {FILE_LEN} bytes and {SLOTS} slots",
                b.len(),
                u32_at(12)
            )));
        }
        if u64_at(32) != checksum(b) {
            return Err(corrupt("the checksum does not match the contents".into()));
        }
        let mut t = Table::new(u64_at(16));
        t.revision = u64_at(24);
        t.wake = u32_at(WAKE_AT);
        t.max_total = u64_at(48);
        for (i, s) in t.slots.iter_mut().enumerate() {
            let o = HEADER + i * SLOT;
            let state = match u32_at(o + 4) {
                0 => SlotState::Free,
                1 => SlotState::Active,
                2 => SlotState::Deferred,
                x => return Err(corrupt(format!("slot {i} has state {x}"))),
            };
            *s = Slot {
                pid: u32_at(o),
                state,
                start: u64_at(o + 8),
                used: u64_at(o + 16),
                cap: u64_at(o + 24),
                cap_rev: u64_at(o + 32),
                want: u64_at(o + 40),
                cached: u64_at(o + 48),
                pidns: u64_at(o + 56),
            };
        }
        let sum: u128 = t
            .slots
            .iter()
            .filter(|s| s.taken())
            .map(|s| u128::from(s.used))
            .sum();
        if sum > u128::from(u64::MAX) {
            return Err(corrupt(format!(
                "its members' use adds up to {sum} bytes, more than 2^64"
            )));
        }
        Ok(t)
    }
}

/// FNV-1a over the file's 8-byte words, the checksum field read as zero.
pub fn checksum(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, w) in b.chunks(8).enumerate() {
        let v = if i == 4 {
            0
        } else {
            let mut a = [0u8; 8];
            a[..w.len()].copy_from_slice(w);
            u64::from_le_bytes(a)
        };
        h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_survives_its_encoding_and_a_flipped_bit_is_corrupt() {
        let mut t = Table::new(4 << 30);
        t.revision = 7;
        t.wake = 3;
        t.max_total = 8 << 30;
        t.slots[3] = Slot {
            pid: 42,
            state: SlotState::Deferred,
            start: 99,
            used: 3 << 30,
            cap: 1 << 30,
            cap_rev: 7,
            want: 2 << 20,
            cached: 5,
            pidns: 4026531836,
        };
        let b = t.encode();
        let p = Path::new("/x");
        assert_eq!(Table::decode(&b, p).unwrap(), t);
        let mut bad = b;
        bad[64 * 4 + 17] ^= 1;
        let e = Table::decode(&bad, p).unwrap_err();
        assert!(matches!(e, ShareError::Corrupt { .. }), "{e}");
        let mut v1 = b;
        v1[8] = 1;
        assert!(matches!(
            Table::decode(&v1, p).unwrap_err(),
            ShareError::Version { found: 1, .. }
        ));
        assert!(matches!(
            Table::decode(&b[..100], p).unwrap_err(),
            ShareError::Corrupt { .. }
        ));
        assert!(matches!(
            Table::decode(b"garbage!", p).unwrap_err(),
            ShareError::Corrupt { .. }
        ));
    }

    #[test]
    fn sums_of_use_never_wrap() {
        let mut t = Table::new(1 << 30);
        for i in 0..2 {
            t.slots[i].state = SlotState::Active;
            t.slots[i].used = u64::MAX / 2 + 1;
        }
        let e = Table::decode(&t.encode(), Path::new("/x")).unwrap_err();
        assert!(e.to_string().contains("more than 2^64"), "{e}");
        t.slots[1].used = 1 << 20;
        assert!(!t.fits(1, u64::MAX), "no wrap in the check of a charge");
        assert!(!t.fits(2, 1));
        assert_eq!(t.used_by_others(0), 1 << 20);
    }
}
