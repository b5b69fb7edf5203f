//! Moving descriptors from the producer to the consumer, and the liveness
//! table that tells a consumer whether an export is still alive.
//!
//! Two ways, tried in this order (`VMMALLOC_IPC_TRANSPORT` forces one):
//!
//! 1. `pidfd`: the consumer opens the producer with `pidfd_open(2)` and
//!    copies each descriptor out of its table with `pidfd_getfd(2)` (Linux
//!    5.6+), as PyTorch's expandable segments do. That needs
//!    `PTRACE_MODE_ATTACH_REALCREDS` over the producer, which containers and
//!    Yama's `ptrace_scope` often deny (`EPERM`, pytorch#130890).
//! 2. `socket`: the producer runs one small thread serving an abstract Unix
//!    socket (named in the handle); the consumer connects, names the export
//!    and its token, and receives the descriptors as `SCM_RIGHTS` ancillary
//!    data (`unix(7)`). Only a peer with the producer's user id is served
//!    (`SO_PEERCRED`).
//!
//! Either way the consumer first takes the producer's **liveness table**
//! ([`LiveTable`]: one memfd, a 32-byte slot per export holding a magic, the
//! export's token and a live flag), checks that the handle's slot holds its
//! token, takes the chunk descriptors, then checks the live flag again.
//! The producer clears the flag *before* it closes the chunk descriptors when
//! the allocation is freed, so a consumer that still sees the flag set after
//! taking the chunks took the right ones; a descriptor number reused for
//! something else, or a recycled producer pid, fails the token check.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

/// Environment variable forcing a transport: `auto` (default), `pidfd`, `socket`.
pub const TRANSPORT_ENV: &str = "VMMALLOC_IPC_TRANSPORT";

/// How a consumer takes descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `pidfd_getfd`, falling back to the socket when denied.
    Auto,
    /// `pidfd_getfd` only.
    Pidfd,
    /// The producer's socket only.
    Socket,
    /// `Auto` as if `pidfd_getfd` answered `EPERM`: tests the fallback on
    /// machines that allow `pidfd_getfd` (value `auto-denied-for-tests`).
    AutoDeniedForTests,
}

impl Transport {
    /// From [`TRANSPORT_ENV`]; an unknown value is an error naming the valid ones.
    pub fn from_env() -> Result<Transport, String> {
        match std::env::var(TRANSPORT_ENV).as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Transport::Auto),
            Ok("pidfd") => Ok(Transport::Pidfd),
            Ok("socket") => Ok(Transport::Socket),
            Ok("auto-denied-for-tests") => Ok(Transport::AutoDeniedForTests),
            Ok(v) => Err(format!(
                "{TRANSPORT_ENV}={v:?} is not one of auto, pidfd, socket"
            )),
        }
    }
}

/// Why descriptors could not be taken.
#[derive(Debug)]
pub enum TakeError {
    /// The kernel refused (`EPERM`, `EACCES`, `ENOSYS`): try the other way.
    Denied(String),
    /// The producer process is gone.
    Exited(String),
    /// Anything else (the export was freed, a token mismatch, ...).
    Failed(String),
}

impl TakeError {
    /// The message.
    pub fn message(&self) -> &str {
        match self {
            TakeError::Denied(m) | TakeError::Exited(m) | TakeError::Failed(m) => m,
        }
    }
}

// ---------------------------------------------------------------------------
// The liveness table
// ---------------------------------------------------------------------------

const TOKEN_MAGIC: [u8; 8] = *b"VMMTOKEN";
/// Bytes per slot: magic (8), token (16), live flag (8).
const SLOT_LEN: usize = 32;

/// The producer's liveness table: **one** memfd for all of its exports
/// (issue 35: a descriptor per export ran out at `RLIMIT_NOFILE`), a 32-byte
/// slot per live export (magic, the export's token, a live flag). An export
/// takes a free slot; ending it clears the flag (before the chunk
/// descriptors close) and frees the slot for a later export, which writes
/// another token there, so a stale handle fails the token check.
#[derive(Debug)]
pub struct LiveTable {
    fd: OwnedFd,
    free: Vec<u32>,
    next: u32,
}

impl LiveTable {
    /// A new, empty table.
    pub fn new() -> io::Result<LiveTable> {
        // SAFETY: the name is NUL-terminated; memfd_create only reads it.
        let raw = unsafe { libc::memfd_create(c"vmmalloc-ipc-live".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(LiveTable {
            fd,
            free: Vec::new(),
            next: 0,
        })
    }

    /// The table's descriptor (named in every handle).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Takes a slot for an export with `token`, live; returns its index.
    pub fn open(&mut self, token: &[u8; 16]) -> io::Result<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.next;
                self.next = s
                    .checked_add(1)
                    .ok_or_else(|| io::Error::other("table full"))?;
                s
            }
        };
        let mut b = [0u8; SLOT_LEN];
        b[..8].copy_from_slice(&TOKEN_MAGIC);
        b[8..24].copy_from_slice(token);
        b[24..32].copy_from_slice(&1u64.to_le_bytes());
        // Writing past the end grows the memfd (pwrite(2)).
        if let Err(e) = pwrite_all(self.fd(), &b, slot as i64 * SLOT_LEN as i64) {
            self.free.push(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// Marks `slot` revoked (its export's memory is being freed) and frees it.
    pub fn revoke(&mut self, slot: u32) -> io::Result<()> {
        let r = pwrite_all(
            self.fd(),
            &0u64.to_le_bytes(),
            slot as i64 * SLOT_LEN as i64 + 24,
        );
        self.free.push(slot);
        r
    }
}

/// Checks that slot `slot` of the liveness table `fd` holds `token` and is
/// still live.
pub fn check_token(fd: RawFd, slot: u32, token: &[u8; 16], pid: u32) -> Result<(), String> {
    let mut b = [0u8; SLOT_LEN];
    // SAFETY: `b` is writable for its length; a bad fd only makes pread fail.
    let n = unsafe {
        libc::pread(
            fd,
            b.as_mut_ptr().cast::<c_void>(),
            SLOT_LEN,
            slot as i64 * SLOT_LEN as i64,
        )
    };
    if n != SLOT_LEN as isize || b[..8] != TOKEN_MAGIC || b[8..24] != token[..] {
        return Err(format!(
            "the handle's export is not (or no longer) live in producer process {pid}: its \
             token does not match (the producer freed the memory, or exited and the pid or \
             the descriptor now names something else)"
        ));
    }
    if b[24..32] != 1u64.to_le_bytes() {
        return Err(format!(
            "the handle names memory that producer process {pid} has freed"
        ));
    }
    Ok(())
}

fn pwrite_all(fd: RawFd, b: &[u8], off: i64) -> io::Result<()> {
    // SAFETY: `b` is readable for its length.
    let n = unsafe { libc::pwrite(fd, b.as_ptr().cast::<c_void>(), b.len(), off) };
    if n != b.len() as isize {
        return Err(if n < 0 {
            io::Error::last_os_error()
        } else {
            io::Error::other("short write")
        });
    }
    Ok(())
}

/// `n` random bytes from the kernel (`getrandom(2)`).
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: the rest of `b` is writable.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast::<c_void>(), N - got, 0) };
        if n <= 0 {
            // Fall back on time and address entropy; tokens only need to be
            // unlikely to repeat, not secret (descriptors are guarded by the
            // kernel's permission checks).
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            for (i, x) in b.iter_mut().enumerate().skip(got) {
                *x = (t >> ((i % 16) * 8)) as u8 ^ (i as u8);
            }
            break;
        }
        got += n as usize;
    }
    b
}

// ---------------------------------------------------------------------------
// pidfd
// ---------------------------------------------------------------------------

/// Copies descriptors `fds` out of process `pid` (`pidfd_open` + `pidfd_getfd`).
pub fn take_by_pidfd(pid: u32, fds: &[i32]) -> Result<Vec<OwnedFd>, TakeError> {
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if raw < 0 {
        let e = io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ESRCH) => TakeError::Exited(format!(
                "producer process {pid} has exited (pidfd_open: {e}); its memory is gone"
            )),
            Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::EACCES) => {
                TakeError::Denied(format!("pidfd_open({pid}): {e}"))
            }
            _ => TakeError::Failed(format!("pidfd_open({pid}): {e}")),
        });
    }
    // SAFETY: a new descriptor nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as RawFd) };
    let mut out = Vec::with_capacity(fds.len());
    for &fd in fds {
        // SAFETY: pidfd_getfd takes descriptors and flags, no pointers.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => TakeError::Exited(format!(
                    "producer process {pid} has exited (pidfd_getfd: {e}); its memory is gone"
                )),
                Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::EACCES) => {
                    TakeError::Denied(format!("pidfd_getfd(pid {pid}, fd {fd}): {e}"))
                }
                Some(libc::EBADF) => TakeError::Failed(format!(
                    "producer process {pid} no longer holds descriptor {fd}: the memory was freed \
                     (or the producer is another process now)"
                )),
                _ => TakeError::Failed(format!("pidfd_getfd(pid {pid}, fd {fd}): {e}")),
            });
        }
        // SAFETY: pidfd_getfd returned a new descriptor (close-on-exec) we own.
        out.push(unsafe { OwnedFd::from_raw_fd(r as RawFd) });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The socket server (producer) and client (consumer)
// ---------------------------------------------------------------------------

const REQ_MAGIC: [u8; 8] = *b"VMMIPCRQ";
const REQ_LEN: usize = 8 + 8 + 16;
/// Most descriptors one reply carries (the liveness table + chunks).
pub const MAX_FDS: usize = 250;

/// What the server asks the export registry: the descriptors (the liveness
/// table first, then the chunks, as fresh duplicates) of export `id` with
/// `token`, or why not.
pub type Lookup = fn(id: u64, token: &[u8; 16]) -> Result<Vec<OwnedFd>, String>;

static SERVER: OnceLock<Result<String, String>> = OnceLock::new();

/// The abstract socket name of this process's descriptor server, started
/// on first use.
pub fn server(lookup: Lookup) -> Result<String, String> {
    SERVER.get_or_init(|| start_server(lookup)).clone()
}

fn start_server(lookup: Lookup) -> Result<String, String> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let nonce: [u8; 8] = random_bytes();
    let name = format!(
        "vmmalloc-ipc-{}-{}",
        std::process::id(),
        nonce.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| format!("IPC socket name {name}: {e}"))?;
    let listener =
        UnixListener::bind_addr(&addr).map_err(|e| format!("IPC socket {name}: bind: {e}"))?;
    std::thread::Builder::new()
        .name("vmmalloc-ipc".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                // A failed reply concerns one consumer only; it sees the error.
                let _ = serve(&conn, lookup);
            }
        })
        .map_err(|e| format!("IPC server thread: {e}"))?;
    Ok(name)
}

/// Answers one request on `conn`.
fn serve(conn: &std::os::unix::net::UnixStream, lookup: Lookup) -> io::Result<()> {
    use std::io::Read;
    conn.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut req = [0u8; REQ_LEN];
    (&*conn).read_exact(&mut req)?;
    let reply = if req[..8] != REQ_MAGIC {
        Err("not a vmmalloc IPC request".to_string())
    } else if peer_uid(conn.as_raw_fd()) != Some(current_uid()) {
        Err("the consumer runs as another user; vmmalloc serves only its own user".into())
    } else {
        let id = u64::from_le_bytes(req[8..16].try_into().expect("8 bytes"));
        let token: [u8; 16] = req[16..32].try_into().expect("16 bytes");
        lookup(id, &token)
    };
    match reply {
        Ok(fds) => {
            let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            send_with_fds(conn.as_raw_fd(), &[0u8; 4], &raw)
        }
        Err(m) => {
            let mut b = 1u32.to_le_bytes().to_vec();
            b.extend_from_slice(m.as_bytes());
            send_with_fds(conn.as_raw_fd(), &b, &[])
        }
    }
}

fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

fn peer_uid(fd: RawFd) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is writable for `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<c_void>(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

/// Takes the descriptors of export `id` from the server `name`: the
/// liveness table first, then `n` chunks.
pub fn take_by_socket(
    name: &str,
    pid: u32,
    id: u64,
    token: &[u8; 16],
    n: usize,
) -> Result<Vec<OwnedFd>, TakeError> {
    use std::io::Write;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| TakeError::Failed(format!("IPC socket name {name}: {e}")))?;
    let conn = UnixStream::connect_addr(&addr).map_err(|e| match e.raw_os_error() {
        Some(libc::ECONNREFUSED) | Some(libc::ENOENT) => TakeError::Exited(format!(
            "producer process {pid} has exited (its vmmalloc IPC socket {name} is gone: {e}); \
             its memory is gone"
        )),
        _ => TakeError::Failed(format!("connecting to IPC socket {name}: {e}")),
    })?;
    let fail =
        |what: &str, e: io::Error| TakeError::Failed(format!("IPC socket {name}: {what}: {e}"));
    conn.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .map_err(|e| fail("timeout", e))?;
    let mut req = Vec::with_capacity(REQ_LEN);
    req.extend_from_slice(&REQ_MAGIC);
    req.extend_from_slice(&id.to_le_bytes());
    req.extend_from_slice(token);
    (&conn).write_all(&req).map_err(|e| fail("send", e))?;
    let (data, fds) = recv_with_fds(conn.as_raw_fd(), n + 1).map_err(|e| fail("receive", e))?;
    if data.len() < 4 {
        return Err(TakeError::Exited(format!(
            "producer process {pid} closed its IPC socket without answering (it is exiting?)"
        )));
    }
    if data[..4] != [0u8; 4] {
        return Err(TakeError::Failed(format!(
            "producer process {pid}: {}",
            String::from_utf8_lossy(&data[4..])
        )));
    }
    if fds.len() != n + 1 {
        return Err(TakeError::Failed(format!(
            "producer process {pid} sent {} descriptors, expected {}",
            fds.len(),
            n + 1
        )));
    }
    Ok(fds)
}

fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast::<c_void>(),
        iov_len: data.len(),
    };
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8).max(1)];
    // SAFETY: zeroed msghdr is a valid "no name, no control" header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast::<c_void>();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer is `space` bytes, enough for one
        // cmsghdr carrying `payload` bytes (CMSG_SPACE), and aligned to 8.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), payload);
        }
    }
    // SAFETY: `msg` points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv_with_fds(sock: RawFd, max_fds: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut data = vec![0u8; 4096];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast::<c_void>(),
        iov_len: data.len(),
    };
    let max_fds = max_fds.min(MAX_FDS);
    // SAFETY: CMSG_SPACE only computes a size.
    let space =
        unsafe { libc::CMSG_SPACE((max_fds * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: zeroed msghdr is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast::<c_void>();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at live, writable buffers of the sizes given.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    data.truncate(n as usize);
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`,
    // within `msg_controllen`, with the CMSG_* macros.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    // Each is a new descriptor the kernel installed for us.
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other("descriptors were truncated (MSG_CTRUNC)"));
    }
    Ok((data, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_table_slots_are_checked_revoked_and_reused() {
        let mut t = LiveTable::new().unwrap();
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let sa = t.open(&a).unwrap();
        let sb = t.open(&b).unwrap();
        assert_ne!(sa, sb);
        check_token(t.fd(), sa, &a, 1).unwrap();
        check_token(t.fd(), sb, &b, 1).unwrap();
        assert!(check_token(t.fd(), sa, &b, 1)
            .unwrap_err()
            .contains("does not match"));
        t.revoke(sa).unwrap();
        assert!(check_token(t.fd(), sa, &a, 7)
            .unwrap_err()
            .contains("process 7 has freed"));
        // The freed slot goes to the next export, with its own token: the
        // old handle fails the token check, never reads as live.
        let c = [3u8; 16];
        assert_eq!(t.open(&c).unwrap(), sa);
        assert!(check_token(t.fd(), sa, &a, 7)
            .unwrap_err()
            .contains("does not match"));
        check_token(t.fd(), sa, &c, 7).unwrap();
        // A slot past the end of the table is not live.
        assert!(check_token(t.fd(), 1000, &c, 7).is_err());
    }
}
