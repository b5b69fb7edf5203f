//! The place of a group's file, and the open file: its checks, its lock.
//!
//! Where it lives, and who may touch it (DESIGN.md, "Hostile input and
//! neighbours"):
//!
//! A group of one user (any name but `@NAME`) lives in a directory that
//! belongs to the user and that no one else can write: `$VMMALLOC_SHARE_DIR`,
//! else `$XDG_RUNTIME_DIR/vmmalloc`, else `/dev/shm/vmmalloc-UID`; a
//! directory made here is made mode 0700 whatever the umask. The directory
//! is opened without following a link and checked (a directory, owner, not
//! writable by group or others); the file is opened without following a
//! link, relative to that open directory, and checked (a regular file,
//! owner, mode 0600). It is made whole in a temporary file and linked to
//! its name, which fails if the name exists: the file at the name is never
//! half-written, and a file nobody made here is never taken over.
//!
//! A group shared by several users (`@NAME`, asked for by its name) lives
//! only in `$VMMALLOC_SHARE_DIR`, a directory owned by root or the user
//! and not writable by others; its file is mode 0660 and belongs to the
//! directory's group: everyone in that group can read and change the group.

use super::format::{Table, FILE_LEN};
use super::ShareError;
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest wait for the file's lock. A member holds it for a few
/// microseconds (a read and a write of 2 KiB); one that holds it longer is
/// stopped (Ctrl-Z, a debugger, a frozen cgroup) or stuck, and a waiter
/// gives up with [`ShareError::Stalled`] naming it.
pub const LOCK_WAIT: Duration = Duration::from_secs(1);
/// The wait for the lock after a wait gave up, until the lock is had again:
/// a stalled holder costs each later caller this, not [`LOCK_WAIT`].
const STALLED_WAIT: Duration = Duration::from_millis(10);
/// The smallest total that holds anything (one 2 MiB page); 0 is allowed
/// and holds nothing.
pub const MIN_TOTAL: u64 = 2 << 20;

/// Who may read and change a group (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The user who runs it, and no one else (every name but `@NAME`).
    User,
    /// Everyone in the group of `$VMMALLOC_SHARE_DIR` (a name `@NAME`).
    AllUsers,
}

impl Scope {
    /// The scope group `name` asks for.
    pub fn of(name: &str) -> Scope {
        if name.starts_with('@') {
            Scope::AllUsers
        } else {
            Scope::User
        }
    }

    /// The file's mode.
    fn mode(self) -> u32 {
        match self {
            Scope::User => 0o600,
            Scope::AllUsers => 0o660,
        }
    }
}

/// This process's effective user id.
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Where the groups of `scope` live (module docs): for one user
/// `$VMMALLOC_SHARE_DIR`, else `$XDG_RUNTIME_DIR/vmmalloc`, else
/// `/dev/shm/vmmalloc-UID`; for several users `$VMMALLOC_SHARE_DIR` only.
pub fn dir(scope: Scope) -> Result<PathBuf, ShareError> {
    let var = |k: &str| std::env::var_os(k).filter(|d| !d.is_empty());
    if let Some(d) = var("VMMALLOC_SHARE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if scope == Scope::AllUsers {
        return Err(ShareError::NoSharedDir);
    }
    if let Some(d) = var("XDG_RUNTIME_DIR") {
        return Ok(PathBuf::from(d).join("vmmalloc"));
    }
    Ok(PathBuf::from(format!("/dev/shm/vmmalloc-{}", euid())))
}

/// Checks a group name: 1 to 64 of `[A-Za-z0-9_.-]`, not starting with a
/// dot, after an optional `@` (a group of several users).
pub fn check_name(name: &str) -> Result<(), ShareError> {
    let base = name.strip_prefix('@').unwrap_or(name);
    let ok = !base.is_empty()
        && base.len() <= 64
        && !base.starts_with('.')
        && base
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(ShareError::BadName(name.to_string()))
    }
}

/// Checks a device name: `gpuN` (CUDA ordinal N), `hostN` or `simN` (the
/// test backends), N below 4096.
pub fn check_device(device: &str) -> Result<(), ShareError> {
    let n = ["gpu", "host", "sim"]
        .iter()
        .find_map(|k| device.strip_prefix(k));
    let ok = n.is_some_and(|n| {
        !n.is_empty()
            && n.len() <= 4
            && n.bytes().all(|c| c.is_ascii_digit())
            && n.parse::<u32>().is_ok_and(|v| v < 4096)
    });
    if ok {
        Ok(())
    } else {
        Err(ShareError::BadDevice(device.to_string()))
    }
}

/// The file of group `name` on device `device` (`gpuN`, `hostN`, `simN`):
/// `DIR/vmmalloc-share-UID-NAME-DEVICE`, or
/// `DIR/vmmalloc-share-all-NAME-DEVICE` for a group `@NAME`.
pub fn path(name: &str, device: &str) -> Result<PathBuf, ShareError> {
    check_name(name)?;
    check_device(device)?;
    let scope = Scope::of(name);
    let file = match name.strip_prefix('@') {
        Some(base) => format!("vmmalloc-share-all-{base}-{device}"),
        None => format!("vmmalloc-share-{}-{name}-{device}", euid()),
    };
    Ok(dir(scope)?.join(file))
}

/// `fstat` of an open file.
fn stat_fd(fd: &impl AsRawFd) -> std::io::Result<libc::stat> {
    // SAFETY: all-zero is a valid `stat`, which fstat fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a descriptor we own, with a valid `stat` pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// `openat(dir, name, flags, mode)` as a `File`.
fn open_at(dir: &File, name: &CString, flags: i32, mode: u32) -> std::io::Result<File> {
    loop {
        // SAFETY: openat with a directory we own and a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                flags | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NOCTTY,
                mode as libc::c_uint,
            )
        };
        if fd >= 0 {
            // SAFETY: a descriptor openat just returned, owned by nobody else.
            return Ok(unsafe { File::from_raw_fd(fd) });
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What kind of file a mode says.
fn kind(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a named pipe",
        libc::S_IFSOCK => "a socket",
        _ => "a device",
    }
}

/// Opens (making it, for one user's groups, when `create`) and checks the
/// directory `d` (module docs).
pub fn open_dir(d: &Path, scope: Scope, create: bool) -> Result<File, ShareError> {
    let unsafe_dir = |why: String| ShareError::UnsafeDir {
        path: d.to_path_buf(),
        why,
    };
    let io = |what: &'static str, e: std::io::Error| ShareError::Io {
        what,
        path: d.to_path_buf(),
        source: e,
    };
    let c = CString::new(d.as_os_str().as_bytes())
        .map_err(|_| unsafe_dir("its name holds a NUL byte".into()))?;
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let mut made = false;
    let fd = loop {
        // SAFETY: open with a NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), flags) };
        if fd >= 0 {
            break fd;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOENT) if create && scope == Scope::User && !made => {
                // SAFETY: mkdir with a NUL-terminated path.
                if unsafe { libc::mkdir(c.as_ptr(), 0o700) } != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(io("create the directory", e));
                    }
                } else {
                    made = true;
                }
            }
            Some(libc::ENOENT) => return Err(io("open the directory", e)),
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
                return Err(unsafe_dir(
                    "it is a symbolic link or not a directory".into(),
                ))
            }
            _ => return Err(io("open the directory", e)),
        }
    };
    // SAFETY: a descriptor open just returned, owned by nobody else.
    let dir = unsafe { File::from_raw_fd(fd) };
    if made {
        // mkdir's mode went through the umask: set it whatever the umask.
        // SAFETY: fchmod on a descriptor we own.
        if unsafe { libc::fchmod(dir.as_raw_fd(), 0o700) } != 0 {
            return Err(io("set the mode of", std::io::Error::last_os_error()));
        }
    }
    let st = stat_fd(&dir).map_err(|e| io("stat", e))?;
    let me = euid();
    let owner_ok = st.st_uid == me || (scope == Scope::AllUsers && st.st_uid == 0);
    if !owner_ok {
        return Err(unsafe_dir(format!(
            "it belongs to uid {}, not to you (uid {me})",
            st.st_uid
        )));
    }
    let mode = st.st_mode & 0o7777;
    let writable_by = match scope {
        Scope::User => mode & 0o022,
        Scope::AllUsers => mode & 0o002,
    };
    if writable_by != 0 {
        return Err(unsafe_dir(format!(
            "its mode {mode:04o} lets {} write to it",
            if scope == Scope::User {
                "other users"
            } else {
                "every user"
            }
        )));
    }
    Ok(dir)
}

/// Why the file at a group's path is no longer the file a process holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Nothing is at the path.
    Removed,
    /// Another file is at the path.
    Replaced,
    /// The file was cut to this many bytes.
    Truncated(u64),
}

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gone::Removed => f.write_str("was removed"),
            Gone::Replaced => f.write_str("was replaced by another file"),
            Gone::Truncated(n) => write!(f, "was cut to {n} bytes"),
        }
    }
}

/// An open group file (module docs).
#[derive(Debug)]
pub struct GroupFile {
    /// Its path.
    pub path: PathBuf,
    /// The open file.
    pub file: File,
    /// Its directory, open (the identity check, the presence locks).
    pub dir: File,
    /// Its name in the directory.
    name: CString,
    /// Device and inode of the file opened.
    pub dev: u64,
    /// Inode of the file opened.
    pub ino: u64,
    /// Whether it was whole when opened (a cut is then news).
    whole: bool,
    /// Excludes this process's threads from each other: `flock` locks
    /// belong to the open file, so a second `LOCK_EX` through the same
    /// descriptor from another thread succeeds at once, and one thread's
    /// unlock would end the other's hold (a lost update between a
    /// member's poller and its allocating thread otherwise).
    threads: parking_lot::Mutex<()>,
    /// Until when waits for the lock are short ([`STALLED_WAIT`]): set when
    /// a wait gave up, cleared when the lock is had.
    stalled: parking_lot::Mutex<Option<Instant>>,
    /// Whether `stalled` is set (read without its mutex on the fast path).
    stalled_flag: std::sync::atomic::AtomicBool,
    /// The wake word, mapped (`None` where the file cannot be mapped).
    pub wake: Option<Arc<super::wake::WakeWord>>,
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
    /// Opens the group file at `path` for a group of `scope`; when it is
    /// missing and `create` is `Some(total)`, makes it (an empty group of
    /// `total` bytes, module docs) and its directory. Every check of the
    /// module docs is made before the file is used.
    pub fn open(path: &Path, create: Option<u64>, scope: Scope) -> Result<GroupFile, ShareError> {
        let io = |what: &'static str, e: std::io::Error| ShareError::Io {
            what,
            path: path.to_path_buf(),
            source: e,
        };
        let (Some(parent), Some(file_name)) = (path.parent(), path.file_name()) else {
            return Err(ShareError::UnsafeFile {
                path: path.to_path_buf(),
                why: "it names no file in a directory".into(),
            });
        };
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let dir = open_dir(parent, scope, create.is_some())?;
        let name = CString::new(file_name.as_bytes())
            .map_err(|_| ShareError::BadName(file_name.to_string_lossy().into_owned()))?;
        let mut tries = 0;
        let file = loop {
            tries += 1;
            match open_at(&dir, &name, libc::O_RDWR | libc::O_NONBLOCK, 0) {
                Ok(f) => break f,
                Err(e) => match e.raw_os_error() {
                    Some(libc::ENOENT) => {
                        let Some(total) = create else {
                            return Err(ShareError::Missing(path.to_path_buf()));
                        };
                        if let Some(f) = make(&dir, &name, total, scope, path)? {
                            break f;
                        }
                        if tries > 3 {
                            return Err(io("open", e));
                        }
                    }
                    Some(libc::ELOOP) => {
                        return Err(ShareError::UnsafeFile {
                            path: path.to_path_buf(),
                            why: "it is a symbolic link".into(),
                        })
                    }
                    Some(libc::EISDIR) => {
                        return Err(ShareError::UnsafeFile {
                            path: path.to_path_buf(),
                            why: "it is a directory".into(),
                        })
                    }
                    _ => return Err(io("open", e)),
                },
            }
        };
        let st = stat_fd(&file).map_err(|e| io("stat", e))?;
        let dir_st = stat_fd(&dir).map_err(|e| io("stat the directory of", e))?;
        let unsafe_file = |why: String| ShareError::UnsafeFile {
            path: path.to_path_buf(),
            why,
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(unsafe_file(format!("it is {}", kind(st.st_mode))));
        }
        let mode = st.st_mode & 0o7777;
        match scope {
            Scope::User if st.st_uid != euid() => {
                return Err(unsafe_file(format!(
                    "it belongs to uid {}, not to you (uid {})",
                    st.st_uid,
                    euid()
                )))
            }
            Scope::AllUsers if st.st_gid != dir_st.st_gid => {
                return Err(unsafe_file(format!(
                    "it belongs to group {}, not to its directory's group {}",
                    st.st_gid, dir_st.st_gid
                )))
            }
            _ => {}
        }
        if mode != scope.mode() {
            return Err(unsafe_file(format!(
                "its mode is {mode:04o}, not {:04o}",
                scope.mode()
            )));
        }
        // Back to blocking I/O (O_NONBLOCK only kept a planted pipe from
        // stalling the open).
        // SAFETY: fcntl on a descriptor we own.
        unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, 0) };
        let wake = super::wake::WakeWord::map(&file).map(Arc::new);
        Ok(GroupFile {
            path: path.to_path_buf(),
            file,
            dir,
            name,
            dev: st.st_dev,
            ino: st.st_ino,
            whole: st.st_size as u64 == FILE_LEN as u64,
            threads: parking_lot::Mutex::new(()),
            stalled: parking_lot::Mutex::new(None),
            stalled_flag: std::sync::atomic::AtomicBool::new(false),
            wake,
        })
    }

    /// Whether the file at the path is still the file open here, whole
    /// (module docs): `Some(why)` when it is not. Quick (`full: false`):
    /// the open file's size and link count only (one `fstat`: a removed
    /// file, or one replaced by a rename, has no link left); full: also
    /// the device and inode at the path (`fstatat`), which catches a file
    /// replaced while a link to the old one remains elsewhere.
    pub fn gone(&self, full: bool) -> Result<Option<Gone>, ShareError> {
        let io = |e| ShareError::Io {
            what: "stat",
            path: self.path.clone(),
            source: e,
        };
        let st = stat_fd(&self.file).map_err(io)?;
        if self.whole && st.st_size as u64 != FILE_LEN as u64 {
            return Ok(Some(Gone::Truncated(st.st_size.max(0) as u64)));
        }
        if !full && st.st_nlink > 0 {
            return Ok(None);
        }
        // SAFETY: all-zero is a valid `stat`, which fstatat fills in.
        let mut at: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstatat with a directory we own, a NUL-terminated name
        // and a valid `stat` pointer.
        let r = unsafe {
            libc::fstatat(
                self.dir.as_raw_fd(),
                self.name.as_ptr(),
                &mut at,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(Some(Gone::Removed)),
                _ => Err(io(e)),
            };
        }
        if at.st_dev != self.dev || at.st_ino != self.ino {
            return Ok(Some(Gone::Replaced));
        }
        Ok(None)
    }

    /// Takes the table's lock (this process's threads' mutex, then
    /// `flock(LOCK_EX)`), waiting at most [`LOCK_WAIT`] (after a wait gave
    /// up, [`STALLED_WAIT`] until the lock is had again); then
    /// [`ShareError::Stalled`] naming the holder. Not reentrant.
    pub fn lock(&self) -> Result<Locked<'_>, ShareError> {
        // The fast path (no other holder): no clock read.
        if let Some(threads) = self.threads.try_lock() {
            // SAFETY: flock on a file descriptor we own.
            let r = unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if r == 0 {
                self.unstall();
                return Ok(Locked {
                    f: self,
                    _threads: threads,
                });
            }
        }
        self.lock_slow()
    }

    /// Notes that the lock was had: the next waits get the whole bound.
    fn unstall(&self) {
        if self.stalled_flag.load(std::sync::atomic::Ordering::Relaxed) {
            *self.stalled.lock() = None;
            self.stalled_flag
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// [`Self::lock`] when someone holds the lock: waits with a bound.
    fn lock_slow(&self) -> Result<Locked<'_>, ShareError> {
        let t0 = Instant::now();
        let bound = match *self.stalled.lock() {
            Some(until) if t0 < until => STALLED_WAIT,
            _ => LOCK_WAIT,
        };
        let deadline = t0 + bound;
        let stalled = |holder: Option<u32>| {
            *self.stalled.lock() = Some(Instant::now() + LOCK_WAIT);
            self.stalled_flag
                .store(true, std::sync::atomic::Ordering::Relaxed);
            ShareError::Stalled {
                path: self.path.clone(),
                holder,
                bound,
            }
        };
        let Some(threads) = self.threads.try_lock_until(deadline) else {
            // Another thread of this process waited on the holder of the
            // file's lock, or holds it: name that holder.
            return Err(stalled(self.holder().or(Some(std::process::id()))));
        };
        let mut tries = 0u32;
        loop {
            // SAFETY: flock on a file descriptor we own.
            let r = unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if r == 0 {
                self.unstall();
                return Ok(Locked {
                    f: self,
                    _threads: threads,
                });
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) => {}
                _ => {
                    return Err(ShareError::Io {
                        what: "lock",
                        path: self.path.clone(),
                        source: e,
                    })
                }
            }
            let now = Instant::now();
            if now >= deadline {
                drop(threads);
                return Err(stalled(self.holder()));
            }
            tries += 1;
            if tries < 20 {
                std::thread::yield_now();
            } else {
                let nap = Duration::from_micros(20u64 << (tries - 20).min(6));
                std::thread::sleep(nap.min(deadline - now));
            }
        }
    }

    /// The pid holding the file's `flock`, from `/proc/locks` (proc(5)).
    pub fn holder(&self) -> Option<u32> {
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        let id = format!(
            "{:02x}:{:02x}:{}",
            libc::major(self.dev),
            libc::minor(self.dev),
            self.ino
        );
        locks.lines().find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // `N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END`; a
            // waiter's line has `->` after the number.
            (w.len() >= 6 && w[1] == "FLOCK" && w[5] == id)
                .then(|| w[4].parse().ok())
                .flatten()
        })
    }

    /// Reads the table (the caller holds the lock), after the quick check
    /// that the file is still the one at the path, whole ([`Self::gone`]).
    pub fn read(&self) -> Result<Table, ShareError> {
        self.read_checked(false)
    }

    /// [`Self::read`] after the full check ([`Self::gone`]).
    pub fn read_checked(&self, full: bool) -> Result<Table, ShareError> {
        if let Some(why) = self.gone(full)? {
            return Err(ShareError::Lost {
                path: self.path.clone(),
                why,
            });
        }
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

    /// Wakes every member waiting on the wake word (after a write that
    /// raised it).
    pub fn wake_all(&self) {
        if let Some(w) = &self.wake {
            w.wake();
        }
    }

    /// Removes the file's name (`vmmalloc share NAME --recover`).
    pub fn unlink(&self) -> Result<(), ShareError> {
        unlink_at(&self.dir, &self.name).map_err(|e| ShareError::Io {
            what: "remove",
            path: self.path.clone(),
            source: e,
        })
    }
}

/// `unlinkat(dir, name)`.
fn unlink_at(dir: &File, name: &CString) -> std::io::Result<()> {
    // SAFETY: unlinkat with a directory we own and a NUL-terminated name.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the group file `name` in `dir`, whole, without replacing
/// anything: written in a temporary file, then linked to its name.
/// `None` when another process made it first.
fn make(
    dir: &File,
    name: &CString,
    total: u64,
    scope: Scope,
    path: &Path,
) -> Result<Option<File>, ShareError> {
    let io = |what: &'static str, e: std::io::Error| ShareError::Io {
        what,
        path: path.to_path_buf(),
        source: e,
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = CString::new(format!(
        ".{}.{}.{nanos}",
        name.to_string_lossy(),
        std::process::id()
    ))
    .map_err(|_| ShareError::BadName(name.to_string_lossy().into_owned()))?;
    let f = open_at(
        dir,
        &tmp,
        libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
        scope.mode(),
    )
    .map_err(|e| io("create", e))?;
    let r = (|| {
        if scope == Scope::AllUsers {
            let dir_gid = stat_fd(dir)
                .map_err(|e| io("stat the directory of", e))?
                .st_gid;
            // SAFETY: fchown on a descriptor we own; -1 keeps the owner.
            if unsafe { libc::fchown(f.as_raw_fd(), u32::MAX, dir_gid) } != 0 {
                return Err(io(
                    "give the directory's group to",
                    std::io::Error::last_os_error(),
                ));
            }
        }
        // The umask took bits off the mode given to open: set it exactly.
        // SAFETY: fchmod on a descriptor we own.
        if unsafe { libc::fchmod(f.as_raw_fd(), scope.mode()) } != 0 {
            return Err(io("set the mode of", std::io::Error::last_os_error()));
        }
        f.write_all_at(&Table::new(total).encode(), 0)
            .map_err(|e| io("write", e))?;
        // SAFETY: linkat with a directory we own and NUL-terminated names.
        let r = unsafe {
            libc::linkat(
                dir.as_raw_fd(),
                tmp.as_ptr(),
                dir.as_raw_fd(),
                name.as_ptr(),
                0,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Ok(false);
            }
            return Err(io("link", e));
        }
        Ok(true)
    })();
    let _ = unlink_at(dir, &tmp);
    Ok(r?.then_some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_devices_are_checked() {
        for ok in ["train", "a.b-c_1", "GPU-5e3f", "@team"] {
            check_name(ok).unwrap();
        }
        for bad in [
            "",
            ".hidden",
            "a/b",
            "x y",
            &"n".repeat(65),
            "@",
            "@.x",
            "a@b",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for ok in ["gpu0", "gpu17", "host0", "sim3"] {
            check_device(ok).unwrap();
        }
        for bad in ["foo", "gpu", "gpu-1", "gpu99999", "GPU0", "gpu0x", ""] {
            let e = check_device(bad).unwrap_err();
            assert!(e.to_string().contains("gpuN"), "{e}");
        }
        assert_eq!(Scope::of("@team"), Scope::AllUsers);
        assert_eq!(Scope::of("team"), Scope::User);
    }
}
