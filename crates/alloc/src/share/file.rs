//! The shared file of a budget group: its format, its lock, its path.
//!
//! # Format (version 1, little-endian, [`FILE_LEN`] bytes)
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `VMMSHARE` |
//! | 8 | 4 | format version ([`VERSION`]) |
//! | 12 | 4 | slots ([`SLOTS`]) |
//! | 16 | 8 | total: bytes the group may hold together |
//! | 24 | 8 | revision: +1 on every change of a cap or of the total |
//! | 32 | 8 | checksum of the rest of the file ([`checksum`]) |
//! | 40 | 24 | zero (reserved) |
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
//! whole file (kvcached's `shm` file takes the same lock, `kvcached/cli/utils.py`).
//! An empty file is one a creator made and had not yet written: the next
//! opener writes the header under the lock. Anything else that is not a
//! whole version-1 file with a good checksum is refused as corrupt, never
//! read.

use super::ShareError;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The file's first bytes.
pub const MAGIC: [u8; 8] = *b"VMMSHARE";
/// The format version this code reads and writes.
pub const VERSION: u32 = 1;
/// Member slots per group.
pub const SLOTS: usize = 32;
/// Bytes of the header.
const HEADER: usize = 64;
/// Bytes of one slot.
const SLOT: usize = 64;
/// Bytes of the whole file.
pub const FILE_LEN: usize = HEADER + SLOTS * SLOT;
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
    /// The member slots.
    pub slots: [Slot; SLOTS],
}

impl Table {
    /// An empty group of `total` bytes.
    pub fn new(total: u64) -> Table {
        Table {
            total,
            revision: 0,
            slots: [Slot::FREE; SLOTS],
        }
    }

    /// Bytes charged by all members.
    pub fn used(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| s.taken())
            .map(|s| s.used)
            .sum()
    }

    /// Bytes charged by members other than slot `me`.
    pub fn used_by_others(&self, me: usize) -> u64 {
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, s)| *i != me && s.taken())
            .map(|(_, s)| s.used)
            .sum()
    }

    /// The encoded file.
    pub fn encode(&self) -> [u8; FILE_LEN] {
        let mut b = [0u8; FILE_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.total.to_le_bytes());
        b[24..32].copy_from_slice(&self.revision.to_le_bytes());
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
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
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

/// Where the group files live: `$VMMALLOC_SHARE_DIR`, else
/// `$XDG_RUNTIME_DIR/vmmalloc` (per user, tmpfs, removed at logout), else
/// `/dev/shm`.
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os("VMMALLOC_SHARE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("vmmalloc");
    }
    PathBuf::from("/dev/shm")
}

/// Checks a group name: 1 to 64 of `[A-Za-z0-9_.-]`, not starting with a dot.
pub fn check_name(name: &str) -> Result<(), ShareError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(ShareError::BadName(name.to_string()))
    }
}

/// The file of group `name` on device `device` (a GPU's UUID, or
/// `gpuN` when no UUID is known): `DIR/vmmalloc-share-UID-NAME-DEVICE`.
pub fn path(name: &str, device: &str) -> Result<PathBuf, ShareError> {
    check_name(name)?;
    check_name(device)?;
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    Ok(dir().join(format!("vmmalloc-share-{uid}-{name}-{device}")))
}

/// An open group file.
#[derive(Debug)]
pub struct GroupFile {
    /// Its path.
    pub path: PathBuf,
    /// The open file (close-on-exec, as std opens every file).
    pub file: File,
    /// Excludes this process's threads from each other: `flock` locks
    /// belong to the open file, so a second `LOCK_EX` through the same
    /// descriptor from another thread succeeds at once, and one thread's
    /// unlock would end the other's hold (a lost update between a
    /// member's poller and its allocating thread otherwise).
    threads: parking_lot::Mutex<()>,
}

/// The file's lock, held until dropped.
pub struct Locked<'a> {
    f: &'a GroupFile,
    /// Released after the `flock` (fields drop after `Drop::drop`).
    _threads: parking_lot::MutexGuard<'a, ()>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: flock on a file descriptor we own; unlocking cannot harm.
        unsafe { libc::flock(self.f.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl GroupFile {
    /// Opens the file at `path`; creates it (mode 0600, its directory
    /// 0700) when `create` is `Some(total)` and writes an empty group of
    /// `total` bytes into a file that is empty.
    pub fn open(path: &Path, create: Option<u64>) -> Result<GroupFile, ShareError> {
        let io = |what: &'static str, e: std::io::Error| ShareError::Io {
            what,
            path: path.to_path_buf(),
            source: e,
        };
        let file = match create {
            Some(_) => {
                if let Some(d) = path.parent() {
                    std::fs::create_dir_all(d).map_err(|e| io("create the directory of", e))?;
                }
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .open(path)
                    .map_err(|e| io("open or create", e))?
            }
            None => match OpenOptions::new().read(true).write(true).open(path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(ShareError::Missing(path.to_path_buf()))
                }
                Err(e) => return Err(io("open", e)),
            },
        };
        let g = GroupFile {
            path: path.to_path_buf(),
            file,
            threads: parking_lot::Mutex::new(()),
        };
        if let Some(total) = create {
            let _l = g.lock()?;
            let len = g.file.metadata().map_err(|e| io("stat", e))?.len();
            if len == 0 {
                g.write(&Table::new(total))?;
            }
        }
        Ok(g)
    }

    /// Takes the table's lock (this process's threads' mutex, then
    /// `flock(LOCK_EX)`), waiting for it. Not reentrant.
    pub fn lock(&self) -> Result<Locked<'_>, ShareError> {
        let threads = self.threads.lock();
        loop {
            // SAFETY: flock on a file descriptor we own.
            let r = unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(Locked {
                    f: self,
                    _threads: threads,
                });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(ShareError::Io {
                    what: "lock",
                    path: self.path.clone(),
                    source: e,
                });
            }
        }
    }

    /// Reads the table (the caller holds the lock).
    pub fn read(&self) -> Result<Table, ShareError> {
        let mut b = [0u8; FILE_LEN + 1];
        let mut n = 0;
        loop {
            match self.file.read_at(&mut b[n..], n as u64) {
                Ok(0) => break,
                Ok(k) => {
                    n += k;
                    if n == b.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(ShareError::Io {
                        what: "read",
                        path: self.path.clone(),
                        source: e,
                    })
                }
            }
        }
        Table::decode(&b[..n], &self.path)
    }

    /// Writes the table (the caller holds the lock).
    pub fn write(&self, t: &Table) -> Result<(), ShareError> {
        self.file
            .write_all_at(&t.encode(), 0)
            .map_err(|e| ShareError::Io {
                what: "write",
                path: self.path.clone(),
                source: e,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_survives_its_encoding_and_a_flipped_bit_is_corrupt() {
        let mut t = Table::new(4 << 30);
        t.revision = 7;
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
        let mut v2 = b;
        v2[8] = 2;
        assert!(matches!(
            Table::decode(&v2, p).unwrap_err(),
            ShareError::Version { found: 2, .. }
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
    fn names_are_checked() {
        for ok in ["train", "a.b-c_1", "GPU-5e3f"] {
            check_name(ok).unwrap();
        }
        for bad in ["", ".hidden", "a/b", "x y", &"n".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
