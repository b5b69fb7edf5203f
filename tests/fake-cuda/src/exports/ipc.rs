//! Legacy CUDA IPC of plain allocations: `cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle` — what PyTorch's default
//! caching allocator shares (`cudaIpcGetMemHandle` in
//! `DeviceCachingAllocator::shareIpcHandle`, written as `[version]['c']` +
//! the 64-byte handle; `cudaIpcOpenMemHandle` in
//! `NativeCachingAllocator::getIpcDevPtr`, c10/cuda/CUDACachingAllocator.cpp).
//!
//! # The rules modelled (cuda.h's documentation of each call)
//!
//! - `cuIpcGetMemHandle`: "Takes a pointer to the base of an existing device
//!   memory allocation created with `cuMemAlloc`"; any other pointer (inside
//!   one, `cuMemCreate` memory, nothing) is `CUDA_ERROR_INVALID_VALUE`. "May
//!   be called multiple times on an allocation without adverse effects": the
//!   same allocation answers the same handle; a new allocation at a freed
//!   address answers "a unique handle for the new memory" (a new token).
//!   Needs a current context (`CUDA_ERROR_INVALID_CONTEXT`).
//! - `cuIpcOpenMemHandle`: `Flags` "must be specified as
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`" (anything else:
//!   `CUDA_ERROR_INVALID_VALUE`); needs a current context; handles are for
//!   "other process[es]" ("may only be opened by one CUcontext per CUdevice
//!   per other process"), so opening a handle in the process that exported
//!   it is refused (`CUDA_ERROR_INVALID_CONTEXT`: the code the docs list for
//!   a context that may not open it; the real driver's code for this case is
//!   not documented, PyTorch never does it: `torch/multiprocessing/reductions.py`
//!   answers its own storages from a cache). "If the memory handle has
//!   already been opened by the current context, the reference count on the
//!   handle is incremented by 1 and the existing device pointer is
//!   returned." A handle this fake did not write is `CUDA_ERROR_INVALID_VALUE`;
//!   one whose memory was freed or whose exporter exited is
//!   `CUDA_ERROR_INVALID_HANDLE`; a failed mapping is `CUDA_ERROR_MAP_FAILED`.
//! - `cuIpcCloseMemHandle`: "Decrements the reference count of the memory
//!   returned by `cuIpcOpenMemHandle` by 1. When the reference count reaches
//!   0, this API unmaps the memory." A pointer it did not return (or one
//!   already closed) is `CUDA_ERROR_INVALID_VALUE`.
//!
//! # How the fake carries the memory
//!
//! A plain allocation is an anonymous private mapping (`HostDevice::alloc`).
//! The first `cuIpcGetMemHandle` of it moves its pages into a memfd mapped
//! `MAP_SHARED` at the same address (its bytes copied first), which the
//! exporter keeps open until `cuMemFree`. The 64-byte handle holds a magic,
//! the exporter's pid, the memfd's descriptor number there, the sizes and a
//! random token that is also in the memfd's name; the importer copies the
//! descriptor with `pidfd_getfd(2)` (the real driver passes its own kernel
//! objects instead; docs/fake-cuda.md), checks the token in the name it sees
//! under `/proc/self/fd`, and maps it anywhere (`MAP_SHARED`). The mapping is
//! outside the address-space model: read and write it with the CPU, not with
//! `cuMemcpy*`.
#![allow(non_snake_case)]

use crate::state::fake;
use crate::{put, run, Fail};
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use vmm_sys::{
    CUdeviceptr, CUipcMemHandle, CUresult, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_HANDLE,
    CU_IPC_HANDLE_SIZE, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
};

/// `CUDA_ERROR_MAP_FAILED` (cuda.h).
pub const CUDA_ERROR_MAP_FAILED: CUresult = 205;

/// First 8 bytes of every handle this fake writes.
const MAGIC: [u8; 8] = *b"FAKEIPC1";

/// One exported plain allocation (exporter side).
struct Exported {
    /// The memfd now backing the allocation: held (never read) so that it
    /// stays open until `cuMemFree` drops this entry.
    _memfd: OwnedFd,
    /// The handle's bytes.
    handle: [u8; CU_IPC_HANDLE_SIZE],
}

/// One opened handle (importer side).
struct Opened {
    /// Where it is mapped.
    ptr: u64,
    /// Mapped bytes.
    len: usize,
    /// References (`cuIpcOpenMemHandle` calls not yet closed).
    refs: u32,
}

#[derive(Default)]
struct Tables {
    /// Plain allocation address -> its export.
    exported: HashMap<u64, Exported>,
    /// (context, token) -> the opened mapping.
    opened: HashMap<(usize, [u8; 16]), Opened>,
}

static TABLES: Mutex<Option<Tables>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Tables) -> T) -> T {
    let mut g = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Tables::default))
}

fn page() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096)
}

fn random_token() -> [u8; 16] {
    let mut t = [0u8; 16];
    // SAFETY: `t` is writable for its length.
    let n = unsafe { libc::getrandom(t.as_mut_ptr().cast::<c_void>(), t.len(), 0) };
    if n != t.len() as isize {
        let x = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            ^ u128::from(std::process::id()) << 64;
        t = x.to_le_bytes();
    }
    t
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Moves the plain allocation `[addr, addr + len)` into a new memfd named
/// after `token`, mapped shared at the same address.
fn share_in_place(addr: u64, len: u64, token: &[u8; 16]) -> Result<OwnedFd, Fail> {
    let os = |what: &str| {
        Fail::new(
            CUDA_ERROR_MAP_FAILED,
            format!("{what}: {}", std::io::Error::last_os_error()),
        )
    };
    let name = std::ffi::CString::new(format!("fake-cuda-ipc-{}", hex(token)))
        .map_err(|_| Fail::invalid("memfd name"))?;
    // SAFETY: the name is NUL-terminated; memfd_create only reads it.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(os("memfd_create"));
    }
    // SAFETY: a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let n = usize::try_from(len).map_err(|_| Fail::invalid("size"))?;
    // SAFETY: `addr` is a live read-write mapping of `len` bytes (a plain
    // allocation of this process, rounded to whole pages as HostDevice maps
    // it); write only reads it.
    let w = unsafe { libc::pwrite(fd.as_raw_fd(), addr as *const c_void, n, 0) };
    if w != n as isize {
        return Err(os("copying the allocation into its memfd"));
    }
    // SAFETY: replaces exactly the allocation's own pages (same range, same
    // protection) with a shared view of the memfd holding the same bytes.
    let p = unsafe {
        libc::mmap(
            addr as *mut c_void,
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os("mmap of the allocation's memfd"));
    }
    Ok(fd)
}

/// `CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)`.
///
/// # Safety
/// As `cuda.h` requires: `pHandle` is null or valid for writing one handle.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    pHandle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    run("cuIpcGetMemHandle", || {
        let f = fake()?;
        if pHandle.is_null() {
            return Err(Fail::invalid("pHandle is NULL"));
        }
        f.current()?;
        let Some((bytes, owner)) = f.plain_at(dptr) else {
            return Err(Fail::invalid(format!(
                "{dptr:#x} is not the base of a cuMemAlloc allocation (cuIpcGetMemHandle \
                 exports only those, not cuMemCreate memory or interior pointers)"
            )));
        };
        let handle = with(|t| -> Result<[u8; CU_IPC_HANDLE_SIZE], Fail> {
            if let Some(e) = t.exported.get(&dptr) {
                return Ok(e.handle);
            }
            let len = bytes.div_ceil(page()) * page();
            let token = random_token();
            let memfd = share_in_place(dptr, len, &token)?;
            let mut h = [0u8; CU_IPC_HANDLE_SIZE];
            h[..8].copy_from_slice(&MAGIC);
            h[8..12].copy_from_slice(&std::process::id().to_le_bytes());
            h[12..16].copy_from_slice(&memfd.as_raw_fd().to_le_bytes());
            h[16..24].copy_from_slice(&len.to_le_bytes());
            h[24..32].copy_from_slice(&bytes.to_le_bytes());
            h[32..48].copy_from_slice(&token);
            h[48..52].copy_from_slice(&(owner as u32).to_le_bytes());
            t.exported.insert(
                dptr,
                Exported {
                    _memfd: memfd,
                    handle: h,
                },
            );
            Ok(h)
        })?;
        let out = CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(pHandle, out, "pHandle") }
    })
}

/// Called by `cuMemFree_v2` after a plain allocation is freed: closes its
/// memfd, so that importers of its handle fail from now on.
pub fn forget(dptr: CUdeviceptr) {
    with(|t| t.exported.remove(&dptr));
}

/// Copies descriptor `fd` out of process `pid` (`pidfd_open` + `pidfd_getfd`).
fn take_fd(pid: u32, fd: RawFd) -> Result<OwnedFd, Fail> {
    let gone = |what: &str| {
        Fail::new(
            CUDA_ERROR_INVALID_HANDLE,
            format!(
                "{what} (exporting process {pid}): {}; its memory was freed, its process \
                 exited, or it was never shared with this process",
                std::io::Error::last_os_error()
            ),
        )
    };
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let p = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if p < 0 {
        return Err(gone("pidfd_open"));
    }
    // SAFETY: a new descriptor nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(p as RawFd) };
    // SAFETY: pidfd_getfd takes descriptors and flags, no pointers.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if r < 0 {
        return Err(gone("pidfd_getfd"));
    }
    // SAFETY: pidfd_getfd returned a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
}

/// `CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
/// unsigned int Flags)`.
///
/// # Safety
/// As `cuda.h` requires: `pdptr` is null or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    Flags: c_uint,
) -> CUresult {
    run("cuIpcOpenMemHandle_v2", || {
        let f = fake()?;
        if pdptr.is_null() {
            return Err(Fail::invalid("pdptr is NULL"));
        }
        if Flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS {
            return Err(Fail::invalid(format!(
                "Flags {Flags:#x}: must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (0x1)"
            )));
        }
        f.current()?;
        let ctx = crate::state::current_context();
        let h: [u8; CU_IPC_HANDLE_SIZE] = handle.reserved.map(|c| c as u8);
        if h[..8] != MAGIC {
            return Err(Fail::invalid(
                "not a CUipcMemHandle this driver wrote (cuIpcGetMemHandle)",
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let (pid, fd, len) = (u32_at(8), u32_at(12) as RawFd, u64_at(16));
        let token: [u8; 16] = h[32..48].try_into().expect("16 bytes");
        if pid == std::process::id() {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                "the handle was exported by this process; IPC handles are opened by other \
                 processes (cuda.h: \"one CUcontext per CUdevice per other process\")",
            ));
        }
        let again = with(|t| {
            t.opened.get_mut(&(ctx, token)).map(|o| {
                o.refs += 1;
                o.ptr
            })
        });
        if let Some(p) = again {
            // SAFETY: non-null (checked above) and writable (cuda.h).
            return unsafe { put(pdptr, p, "pdptr") };
        }
        let memfd = take_fd(pid, fd)?;
        let link = std::fs::read_link(format!("/proc/self/fd/{}", memfd.as_raw_fd()))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !link.contains(&format!("fake-cuda-ipc-{}", hex(&token))) {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_HANDLE,
                format!(
                    "the memory of this handle was freed in exporting process {pid} \
                     (descriptor {fd} is {link:?} now)"
                ),
            ));
        }
        let n = usize::try_from(len).map_err(|_| Fail::invalid("size"))?;
        // SAFETY: a new shared mapping at an address the kernel chooses
        // touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Fail::new(
                CUDA_ERROR_MAP_FAILED,
                format!("mmap: {}", std::io::Error::last_os_error()),
            ));
        }
        let ptr = p as u64;
        with(|t| {
            t.opened.insert(
                (ctx, token),
                Opened {
                    ptr,
                    len: n,
                    refs: 1,
                },
            )
        });
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(pdptr, ptr, "pdptr") }
    })
}

/// `CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)`.
///
/// # Safety
/// No pointer is dereferenced: the fake validates `dptr` itself.
#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    run("cuIpcCloseMemHandle", || {
        fake()?.current()?;
        let ctx = crate::state::current_context();
        let unmap = with(|t| -> Result<Option<(u64, usize)>, Fail> {
            let key = t
                .opened
                .iter()
                .find(|(k, o)| k.0 == ctx && o.ptr == dptr)
                .map(|(k, _)| *k)
                .ok_or_else(|| {
                    Fail::invalid(format!(
                        "{dptr:#x} is not memory cuIpcOpenMemHandle returned in this context \
                         (or it was closed)"
                    ))
                })?;
            let o = t.opened.get_mut(&key).expect("found above");
            o.refs -= 1;
            if o.refs > 0 {
                return Ok(None);
            }
            let o = t.opened.remove(&key).expect("found above");
            Ok(Some((o.ptr, o.len)))
        })?;
        if let Some((p, n)) = unmap {
            // SAFETY: exactly the mapping cuIpcOpenMemHandle_v2 made, whose
            // last reference just went.
            if unsafe { libc::munmap(p as *mut c_void, n) } != 0 {
                return Err(Fail::new(
                    CUDA_ERROR_MAP_FAILED,
                    format!("munmap: {}", std::io::Error::last_os_error()),
                ));
            }
        }
        Ok(())
    })
}
