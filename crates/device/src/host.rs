//! The `host` backend: the driver's virtual-memory semantics on real CPU memory.
//!
//! A [`HostDevice`] keeps the same checked [`AddressSpace`] and [`StreamModel`]
//! as the `sim` backend and does, for every call the model accepts, what the
//! driver would do to real pages:
//!
//! | driver call            | host implementation                                             |
//! |------------------------|-----------------------------------------------------------------|
//! | `cuMemAddressReserve`  | `mmap(NULL, size+align, PROT_NONE, MAP_PRIVATE\|MAP_ANONYMOUS\|MAP_NORESERVE)`, trimmed to the alignment |
//! | `cuMemAddressFree`     | `munmap`                                                        |
//! | `cuMemCreate`          | `memfd_create` + `ftruncate` (capacity checked by the model first) |
//! | `cuMemMap`             | `mmap(addr, size, PROT_NONE, MAP_SHARED\|MAP_FIXED, fd, 0)`     |
//! | `cuMemSetAccess`       | `mprotect(PROT_READ\|PROT_WRITE)` over the whole mappings touched |
//! | `cuMemUnmap`           | a `PROT_NONE` anonymous `MAP_FIXED\|MAP_NORESERVE` placeholder over the range |
//! | `cuMemRelease`         | `close` of the handle's descriptor (mappings keep the file alive) |
//! | `cuMemExportToShareableHandle` | `dup` of the descriptor                                |
//! | `cuMemImportFromShareableHandle` | `fstat` (inode → allocation) + `dup`; a host memfd of another process (IPC) becomes a new allocation charged to its creator |
//! | `cuMemAlloc` / `cuMemFree` | anonymous read-write `mmap` / `munmap`                      |
//! | `cuMemcpyHtoD` / `DtoH` | accessibility checked by the model, then `memcpy`             |
//!
//! Bytes written through one mapping therefore survive an unmap and a map of
//! the same handle elsewhere, and a page the model calls inaccessible is
//! `PROT_NONE` in the process, so the model and the memory cannot disagree.
//!
//! Every call takes one lock; the model is asked first, then the system call
//! is made, then the model records it, so a failed system call leaves the
//! model unchanged. Dropping the device unmaps, munmaps and closes everything
//! still live, logging one line per leaked object to stderr.

use crate::model::{AddressSpace, LiveCounts};
use crate::{
    round_up, Call, CallCounts, Device, DeviceCaps, DeviceError, DeviceResult, Event, Introspect,
    MemInfo, PhysHandle, Rule, Stream, StreamModel, GIB, MIB,
};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Parameters of a host device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// Device name reported in [`DeviceCaps`] (also names the memfds).
    pub name: String,
    /// Physical memory in bytes: `create` beyond it fails with out-of-memory.
    /// Pages are only committed when touched, so it may exceed the machine's RAM.
    pub capacity: u64,
    /// Allocation granularity: a power of two, at least the system page size
    /// (2 MiB by default, as on current NVIDIA GPUs; smaller values make tests cheaper).
    pub granularity: u64,
    /// Device ordinal reported in [`DeviceCaps`].
    pub ordinal: u32,
}

impl Default for HostConfig {
    /// A 1 GiB device with 2 MiB granularity.
    fn default() -> Self {
        HostConfig::with_capacity(GIB)
    }
}

impl HostConfig {
    /// A device of `capacity` bytes with 2 MiB granularity.
    pub fn with_capacity(capacity: u64) -> Self {
        HostConfig {
            name: format!("host ({} MiB)", capacity / MIB),
            capacity,
            granularity: 2 * MIB,
            ordinal: 0,
        }
    }

    /// The same configuration with another granularity.
    pub fn granularity(mut self, granularity: u64) -> Self {
        self.granularity = granularity;
        self
    }
}

/// A handle's descriptor and the allocation it names.
#[derive(Debug)]
struct HostHandle {
    /// Closed when the handle is released (dropped).
    fd: OwnedFd,
    alloc: u64,
}

/// The backing file of one allocation.
#[derive(Debug)]
struct HostAllocation {
    /// `(st_dev, st_ino)` of the memfd, to recognise imported descriptors.
    inode: (u64, u64),
    /// Handles naming it + mappings of it (the same count as the model's).
    refs: u32,
}

/// Everything the device owns, under one lock.
///
/// Invariants (checked by [`Introspect::check`]): `reservations`, `mappings`,
/// `handles` and `plain` hold exactly the model's live objects; every
/// reservation is an `mmap` region of this process owned by the device,
/// `PROT_NONE` wherever nothing is mapped; every mapping is a `MAP_SHARED`
/// view of its allocation's memfd, read-write iff the model says accessible;
/// an allocation's `refs` = handles + mappings naming it, and it is removed
/// (with its `by_inode` entry) when that reaches zero.
#[derive(Debug)]
struct HostState {
    space: AddressSpace,
    /// start -> size.
    reservations: BTreeMap<u64, u64>,
    /// start -> (size, allocation id).
    mappings: BTreeMap<u64, (u64, u64)>,
    /// handle id -> descriptor.
    handles: HashMap<u64, HostHandle>,
    /// allocation id -> backing file.
    allocations: HashMap<u64, HostAllocation>,
    /// `(st_dev, st_ino)` -> allocation id.
    by_inode: HashMap<(u64, u64), u64>,
    /// plain allocation -> length of its `mmap`.
    plain: BTreeMap<u64, u64>,
}

impl HostState {
    fn drop_ref(&mut self, alloc: u64) {
        if let Some(a) = self.allocations.get_mut(&alloc) {
            a.refs = a.refs.saturating_sub(1);
            if a.refs == 0 {
                let inode = a.inode;
                self.allocations.remove(&alloc);
                self.by_inode.remove(&inode);
            }
        }
    }

    fn add_ref(&mut self, alloc: u64) {
        if let Some(a) = self.allocations.get_mut(&alloc) {
            a.refs += 1;
        }
    }
}

/// A device whose memory is CPU memory of this process.
#[derive(Debug)]
pub struct HostDevice {
    caps: DeviceCaps,
    memfd_name: CString,
    page_size: u64,
    state: Mutex<HostState>,
    streams: StreamModel,
    counts: [AtomicU64; Call::COUNT],
}

/// The error for a failed system call: `ENOMEM` is out-of-memory (code 2, as
/// the driver reports it), anything else `CUDA_ERROR_UNKNOWN` (999).
fn os_error(call: Call, op: &str, err: io::Error) -> DeviceError {
    let oom = err.raw_os_error() == Some(libc::ENOMEM);
    DeviceError::Driver {
        call,
        code: if oom { 2 } else { 999 },
        name: if oom {
            "CUDA_ERROR_OUT_OF_MEMORY"
        } else {
            "CUDA_ERROR_UNKNOWN"
        }
        .into(),
        detail: format!("{op}: {err}"),
    }
}

/// An inconsistency between the host's bookkeeping and the model (a bug).
fn internal(call: Call, what: String) -> DeviceError {
    DeviceError::Driver {
        call,
        code: 999,
        name: "CUDA_ERROR_UNKNOWN".into(),
        detail: format!("host backend bookkeeping: {what}"),
    }
}

fn to_usize(call: Call, v: u64) -> DeviceResult<usize> {
    usize::try_from(v).map_err(|_| internal(call, format!("{v:#x} does not fit in usize")))
}

fn as_ptr(addr: u64) -> *mut libc::c_void {
    std::ptr::with_exposed_provenance_mut::<libc::c_void>(addr as usize)
}

/// `munmap`s `[addr, addr+len)`.
///
/// # Safety
/// The range must be owned by the caller and nothing may reference its memory.
unsafe fn munmap(addr: u64, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller owns the range and nothing references it.
    if unsafe { libc::munmap(as_ptr(addr), len as usize) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Replaces `[addr, addr+len)` by an inaccessible anonymous placeholder.
///
/// # Safety
/// The range must lie inside a reservation owned by the caller and nothing may
/// reference its memory.
unsafe fn placeholder(addr: u64, len: u64) -> io::Result<()> {
    // SAFETY: MAP_FIXED replaces only pages of the caller's own reservation.
    let p = unsafe {
        libc::mmap(
            as_ptr(addr),
            len as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `(st_dev, st_ino)` of an open descriptor.
fn inode_of(fd: RawFd) -> io::Result<(u64, u64)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is writable memory of the size fstat expects; an invalid fd
    // only makes fstat fail with EBADF.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    #[allow(clippy::useless_conversion)] // dev_t / ino_t differ between targets.
    Ok((u64::from(st.st_dev), u64::from(st.st_ino)))
}

/// What `/proc/self/fd/N` reads for a memfd a host device created
/// (`memfd_create("vmmalloc-host-<name>")`; the kernel prefixes `memfd:`).
const FOREIGN_MEMFD_PREFIX: &str = "/memfd:vmmalloc-host-";

/// `st_size` of an open descriptor.
fn file_size(fd: RawFd) -> io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: as in `inode_of`.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    u64::try_from(st.st_size).map_err(|_| io::Error::other("negative size"))
}

/// A close-on-exec duplicate of `fd`.
fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only reads `fd` (an invalid one fails with EBADF).
    let raw = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

impl HostDevice {
    /// Limits host-located chunks ([`Device::create_on_host`], spill) to
    /// `bytes` in all (default: no limit).
    pub fn set_host_capacity(&self, bytes: u64) {
        self.state.lock().space.set_host_capacity(bytes);
    }

    /// `create` and `create_on_host`: the model checks the size and the
    /// capacity (out-of-memory) first, then a memfd backs the handle.
    fn create_located(&self, size: u64, on_host: bool) -> DeviceResult<PhysHandle> {
        self.count(Call::Create);
        let mut st = self.state.lock();
        let handle = if on_host {
            st.space.create_on_host(size)?
        } else {
            st.space.create(size)?
        };
        let made = st
            .space
            .allocation_of(Call::Create, handle)
            .and_then(|alloc| self.new_memfd(size).map(|(fd, inode)| (alloc, fd, inode)));
        match made {
            Ok((alloc, fd, inode)) => {
                st.handles.insert(handle.0, HostHandle { fd, alloc });
                st.allocations
                    .insert(alloc, HostAllocation { inode, refs: 1 });
                st.by_inode.insert(inode, alloc);
                Ok(handle)
            }
            Err(e) => {
                let _ = st.space.release(handle);
                Err(e)
            }
        }
    }

    /// Imports a descriptor this device did not export: a handle another
    /// host device (in this process or another one, received over IPC)
    /// exported. As the driver accepts only descriptors made by
    /// `cuMemExportToShareableHandle`, only memfds named by a host device
    /// (`/proc/self/fd/N` reads `/memfd:vmmalloc-host-...`) of a nonzero size
    /// that is a multiple of the granularity are accepted; anything else is
    /// [`Rule::UnknownShareableHandle`]. The allocation is charged to no
    /// capacity here (its creator holds it).
    fn import_foreign(
        &self,
        st: &mut HostState,
        fd: i32,
        inode: (u64, u64),
    ) -> DeviceResult<PhysHandle> {
        let unknown =
            |why: String| DeviceError::rule(Call::Import, Rule::UnknownShareableHandle, why);
        let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .map_err(|e| unknown(format!("fd {fd}: {e}")))?;
        if !target.to_string_lossy().starts_with(FOREIGN_MEMFD_PREFIX) {
            return Err(unknown(format!(
                "fd {fd} ({}) is not a descriptor exported by a host device",
                target.display()
            )));
        }
        let size = file_size(fd).map_err(|e| unknown(format!("fd {fd}: {e}")))?;
        if size == 0 || size % self.caps.granularity != 0 {
            return Err(unknown(format!(
                "fd {fd} holds {size} bytes, not a multiple of the granularity {:#x}",
                self.caps.granularity
            )));
        }
        let own = dup(fd).map_err(|e| os_error(Call::Import, "dup", e))?;
        let handle = st.space.import_foreign(size)?;
        let alloc = match st.space.allocation_of(Call::Import, handle) {
            Ok(a) => a,
            Err(e) => {
                let _ = st.space.release(handle);
                return Err(e);
            }
        };
        st.handles.insert(handle.0, HostHandle { fd: own, alloc });
        st.allocations
            .insert(alloc, HostAllocation { inode, refs: 1 });
        st.by_inode.insert(inode, alloc);
        Ok(handle)
    }

    /// Whether `fd` names an allocation this device created (or imported),
    /// i.e. whether [`Device::import_fd`] would find it without treating it
    /// as a foreign (other process's) allocation.
    pub fn knows_fd(&self, fd: i32) -> bool {
        inode_of(fd).is_ok_and(|inode| self.state.lock().by_inode.contains_key(&inode))
    }

    /// Test control: starts a CUDA-graph capture on `stream` in global mode
    /// (PyTorch's default), as `cuStreamBeginCapture` would. While it lasts the
    /// device refuses what the real driver refuses (see [`StreamModel`]).
    pub fn begin_capture(&self, stream: Stream) -> DeviceResult<()> {
        self.streams
            .begin_capture(stream, crate::CaptureMode::Global)
    }

    /// Test control: ends the capture on `stream` (`cuStreamEndCapture`);
    /// fails with `CaptureInvalidated` if a forbidden call was made during it.
    pub fn end_capture(&self, stream: Stream) -> DeviceResult<()> {
        self.streams.end_capture(stream)
    }

    /// Opens a host device. Fails with [`DeviceError::Unavailable`] when the
    /// granularity is not a power of two at least the system page size.
    pub fn new(config: HostConfig) -> DeviceResult<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page_size = u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096);
        let g = config.granularity;
        if !g.is_power_of_two() || g < page_size {
            return Err(DeviceError::Unavailable(format!(
                "host device: granularity {g:#x} must be a power of two of at least the page size {page_size:#x}"
            )));
        }
        let clean: String = config
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        let memfd_name = CString::new(format!("vmmalloc-host-{clean}"))
            .map_err(|e| DeviceError::Unavailable(format!("host device: bad name: {e}")))?;
        Ok(HostDevice {
            caps: DeviceCaps {
                name: config.name,
                ordinal: config.ordinal,
                granularity: g,
                total_memory: config.capacity,
                vmm_supported: true,
                posix_fd_handles: true,
                has_memory: true,
            },
            memfd_name,
            page_size,
            state: Mutex::new(HostState {
                space: AddressSpace::new(config.capacity, g),
                reservations: BTreeMap::new(),
                mappings: BTreeMap::new(),
                handles: HashMap::new(),
                allocations: HashMap::new(),
                by_inode: HashMap::new(),
                plain: BTreeMap::new(),
            }),
            streams: StreamModel::new(),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// A host device of `capacity` bytes with 2 MiB granularity.
    pub fn with_capacity(capacity: u64) -> DeviceResult<Self> {
        Self::new(HostConfig::with_capacity(capacity))
    }

    /// The name the device gives its memfds (they appear in `/proc/self/maps`
    /// as `/memfd:<name>`).
    pub fn memfd_name(&self) -> &str {
        self.memfd_name.to_str().unwrap_or("vmmalloc-host")
    }

    /// Calls made so far, per kind (failed calls included).
    pub fn counts(&self) -> CallCounts {
        let mut c = CallCounts::default();
        for (slot, n) in c.0.iter_mut().zip(self.counts.iter()) {
            *slot = n.load(Ordering::Relaxed);
        }
        c
    }

    /// Resets call counts (not the address space).
    pub fn reset_counters(&self) {
        for n in &self.counts {
            n.store(0, Ordering::Relaxed);
        }
    }

    fn count(&self, call: Call) {
        self.counts[call.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A new memfd of `size` bytes and its inode.
    fn new_memfd(&self, size: u64) -> DeviceResult<(OwnedFd, (u64, u64))> {
        // SAFETY: the name is a NUL-terminated string that outlives the call.
        let raw = unsafe { libc::memfd_create(self.memfd_name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_error(
                Call::Create,
                "memfd_create",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let len = libc::off_t::try_from(size)
            .map_err(|_| internal(Call::Create, format!("size {size:#x}")))?;
        // SAFETY: `fd` is a valid descriptor this function owns.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
            return Err(os_error(
                Call::Create,
                "ftruncate",
                io::Error::last_os_error(),
            ));
        }
        let inode = inode_of(fd.as_raw_fd()).map_err(|e| os_error(Call::Create, "fstat", e))?;
        Ok((fd, inode))
    }

    /// The start and end of the mappings covering `[addr, addr+size)` (which the
    /// model has checked to be fully mapped).
    fn mapped_extent(st: &HostState, addr: u64, size: u64) -> (u64, u64) {
        let end = addr + size;
        let lo = match st.mappings.range(..=addr).next_back() {
            Some((&s, &(l, _))) if s + l > addr => s,
            _ => addr,
        };
        let hi = match st.mappings.range(..end).next_back() {
            Some((&s, &(l, _))) => (s + l).max(end),
            None => end,
        };
        (lo, hi)
    }
}

impl Device for HostDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        self.count(Call::Reserve);
        let mut st = self.state.lock();
        st.space.check_reserve(size, align)?;
        let eff_align = if align == 0 {
            self.caps.granularity
        } else {
            align
        };
        // Over-reserve so an aligned start exists, then trim both ends.
        let len = size
            .checked_add(eff_align - self.page_size)
            .ok_or(DeviceError::OutOfMemory {
                call: Call::Reserve,
                requested: size,
                free: 0,
                total: 0,
            })?;
        let len_usize = to_usize(Call::Reserve, len)?;
        // SAFETY: a new anonymous mapping at an address the kernel chooses
        // touches no existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error(Call::Reserve, "mmap", io::Error::last_os_error()));
        }
        let base = base as u64;
        let addr = round_up(base, eff_align);
        let tail = base + len - (addr + size);
        // SAFETY: the head and tail are parts of the mapping just made, which
        // nothing references yet.
        let trimmed = unsafe { munmap(base, addr - base).and_then(|_| munmap(addr + size, tail)) };
        if let Err(e) = trimmed {
            // SAFETY: as above; whatever is left of the fresh mapping goes.
            let _ = unsafe { munmap(base, len) };
            return Err(os_error(Call::Reserve, "munmap", e));
        }
        if let Err(e) = st.space.reserve(addr, size, align) {
            // SAFETY: the reservation was made above and is not recorded anywhere.
            let _ = unsafe { munmap(addr, size) };
            return Err(e);
        }
        st.reservations.insert(addr, size);
        Ok(addr)
    }

    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.count(Call::AddressFree);
        let mut st = self.state.lock();
        st.space.free_reservation(addr, size)?;
        // SAFETY: the model accepted the free: `[addr, addr+size)` is exactly a
        // reservation this device made, with nothing mapped in it.
        if let Err(e) = unsafe { munmap(addr, size) } {
            // Put the model back as it was; the range is still reserved.
            let _ = st.space.reserve(addr, size, 0);
            return Err(os_error(Call::AddressFree, "munmap", e));
        }
        st.reservations.remove(&addr);
        Ok(())
    }

    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.create_located(size, false)
    }

    /// A memfd like [`Device::create`]'s, charged to the model's host limit
    /// ([`HostDevice::set_host_capacity`]): on the CPU both are host memory,
    /// the model keeps the two budgets apart as the driver does.
    fn create_on_host(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.create_located(size, true)
    }

    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        self.count(Call::Release);
        let mut st = self.state.lock();
        let alloc = st.space.allocation_of(Call::Release, handle)?;
        st.space.release(handle)?;
        // Closing the descriptor; mappings keep the file (and its bytes) alive.
        drop(st.handles.remove(&handle.0));
        st.drop_ref(alloc);
        Ok(())
    }

    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.count(Call::Map);
        let mut st = self.state.lock();
        let alloc = st.space.check_map(addr, size, handle)?;
        let fd = st
            .handles
            .get(&handle.0)
            .map(|h| h.fd.as_raw_fd())
            .ok_or_else(|| {
                internal(
                    Call::Map,
                    format!("no descriptor for handle {:#x}", handle.0),
                )
            })?;
        let len = to_usize(Call::Map, size)?;
        // SAFETY: the model checked that `[addr, addr+size)` lies inside one of
        // this device's reservations with nothing mapped there, so MAP_FIXED
        // replaces only our own PROT_NONE placeholder; `fd` is a live memfd of
        // exactly `size` bytes.
        let p = unsafe {
            libc::mmap(
                as_ptr(addr),
                len,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // A failed MAP_FIXED may have removed the placeholder: restore it.
            // SAFETY: the range is inside our reservation and unmapped in the model.
            let _ = unsafe { placeholder(addr, size) };
            return Err(os_error(Call::Map, "mmap", e));
        }
        if let Err(e) = st.space.map(addr, size, handle) {
            // SAFETY: as above; the mapping just made is not recorded anywhere.
            let _ = unsafe { placeholder(addr, size) };
            return Err(e);
        }
        st.mappings.insert(addr, (size, alloc));
        st.add_ref(alloc);
        Ok(())
    }

    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.count(Call::Unmap);
        let mut st = self.state.lock();
        st.space.check_unmap(addr, size)?;
        if let Some(stream) = self.streams.pending_use(addr, size) {
            return Err(DeviceError::rule(
                Call::Unmap,
                Rule::InUseByStream,
                format!("[{addr:#x}, +{size:#x}) is used by queued work on {stream}"),
            ));
        }
        // SAFETY: the model checked that the range is exactly a set of whole
        // mappings inside our reservations, and no queued work uses it; copies
        // hold the lock, so nothing references the pages.
        unsafe { placeholder(addr, size) }.map_err(|e| os_error(Call::Unmap, "mmap", e))?;
        st.space.unmap(addr, size)?;
        let gone: Vec<u64> = st
            .mappings
            .range(addr..addr + size)
            .map(|(&s, _)| s)
            .collect();
        for s in gone {
            if let Some((_, alloc)) = st.mappings.remove(&s) {
                st.drop_ref(alloc);
            }
        }
        Ok(())
    }

    /// Makes the range read-write. As in the model, every mapping the range
    /// touches becomes accessible as a whole.
    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.count(Call::SetAccess);
        let mut st = self.state.lock();
        st.space.check_set_access(addr, size)?;
        let (lo, hi) = Self::mapped_extent(&st, addr, size);
        let len = to_usize(Call::SetAccess, hi - lo)?;
        // SAFETY: `[lo, hi)` is covered by this device's own memfd mappings
        // (checked by the model); changing their protection touches no other memory.
        if unsafe { libc::mprotect(as_ptr(lo), len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
            return Err(os_error(
                Call::SetAccess,
                "mprotect",
                io::Error::last_os_error(),
            ));
        }
        st.space.set_access(addr, size)
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.count(Call::MemInfo);
        let st = self.state.lock();
        Ok(MemInfo {
            free: st.space.free_bytes(),
            total: st.space.capacity(),
        })
    }

    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        self.count(Call::Alloc);
        // cuMemAlloc is "potentially unsafe" during a capture (cuStreamBeginCapture docs).
        self.streams.check_unsafe_call(Call::Alloc)?;
        let mut st = self.state.lock();
        st.space.check_plain(size)?;
        let len = round_up(size, self.page_size);
        let len_usize = to_usize(Call::Alloc, len)?;
        // SAFETY: a new anonymous mapping at an address the kernel chooses
        // touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(Call::Alloc, "mmap", io::Error::last_os_error()));
        }
        let addr = p as u64;
        if let Err(e) = st.space.record_plain(addr, size) {
            // SAFETY: the mapping was just made and is not recorded anywhere.
            let _ = unsafe { munmap(addr, len) };
            return Err(e);
        }
        st.plain.insert(addr, len);
        Ok(addr)
    }

    fn free(&self, ptr: u64) -> DeviceResult<()> {
        self.count(Call::Free);
        // cuMemFree synchronizes: forbidden during a (global-mode) capture.
        self.streams.check_unsafe_call(Call::Free)?;
        let mut st = self.state.lock();
        st.space.plain_size(ptr)?;
        let len = *st.plain.get(&ptr).ok_or_else(|| {
            internal(
                Call::Free,
                format!("no mapping for plain allocation {ptr:#x}"),
            )
        })?;
        // cuMemFree synchronizes implicitly: queued work finishes first.
        self.streams.complete_all();
        // SAFETY: `ptr` is a plain allocation this device mmap'd with length
        // `len`; no queued work is left and copies hold the lock.
        unsafe { munmap(ptr, len) }.map_err(|e| os_error(Call::Free, "munmap", e))?;
        st.space.free_plain(ptr)?;
        st.plain.remove(&ptr);
        Ok(())
    }

    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        self.count(Call::Export);
        let st = self.state.lock();
        st.space.allocation_of(Call::Export, handle)?;
        let h = st.handles.get(&handle.0).ok_or_else(|| {
            internal(
                Call::Export,
                format!("no descriptor for handle {:#x}", handle.0),
            )
        })?;
        let fd = dup(h.fd.as_raw_fd()).map_err(|e| os_error(Call::Export, "dup", e))?;
        // The caller owns the duplicate.
        Ok(std::os::fd::IntoRawFd::into_raw_fd(fd))
    }

    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        self.count(Call::Import);
        let unknown =
            |why: String| DeviceError::rule(Call::Import, Rule::UnknownShareableHandle, why);
        let inode = inode_of(fd).map_err(|e| unknown(format!("fd {fd}: {e}")))?;
        let mut st = self.state.lock();
        let Some(&alloc) = st.by_inode.get(&inode) else {
            return self.import_foreign(&mut st, fd, inode);
        };
        let handle = st.space.import(alloc)?;
        match dup(fd) {
            Ok(own) => {
                st.handles.insert(handle.0, HostHandle { fd: own, alloc });
                st.add_ref(alloc);
                Ok(handle)
            }
            Err(e) => {
                let _ = st.space.release(handle);
                Err(os_error(Call::Import, "dup", e))
            }
        }
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> DeviceResult<()> {
        self.count(Call::CopyHtoD);
        let st = self.state.lock();
        st.space
            .check_accessible(Call::CopyHtoD, dst, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the model says every byte of `[dst, dst+len)` is inside an
        // accessible mapping or a plain allocation, which this device mapped
        // read-write; the lock keeps it mapped during the copy. No Rust
        // reference to device memory exists, and `copy` allows overlap.
        unsafe { std::ptr::copy(src.as_ptr(), as_ptr(dst).cast::<u8>(), src.len()) };
        Ok(())
    }

    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()> {
        self.count(Call::CopyDtoH);
        let st = self.state.lock();
        st.space
            .check_accessible(Call::CopyDtoH, src, dst.len() as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `copy_to_device`: the source range is mapped readable
        // and stays so while the lock is held.
        unsafe {
            std::ptr::copy(
                as_ptr(src).cast::<u8>().cast_const(),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    fn copy_device(&self, dst: u64, src: u64, len: u64) -> DeviceResult<()> {
        self.count(Call::CopyDtoD);
        let st = self.state.lock();
        st.space.check_accessible(Call::CopyDtoD, src, len)?;
        st.space.check_accessible(Call::CopyDtoD, dst, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: as in `copy_to_device`: both ranges are inside accessible
        // mappings this device made read-write, kept mapped by the lock;
        // `copy` allows overlap.
        unsafe {
            std::ptr::copy(
                as_ptr(src).cast::<u8>().cast_const(),
                as_ptr(dst).cast::<u8>(),
                len as usize,
            )
        };
        Ok(())
    }

    fn create_stream(&self) -> DeviceResult<Stream> {
        self.count(Call::StreamCreate);
        Ok(self.streams.create_stream())
    }

    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()> {
        self.count(Call::StreamSync);
        self.streams.complete(stream)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.count(Call::DeviceSync);
        // cuCtxSynchronize is forbidden during a (global-mode) capture.
        self.streams.check_unsafe_call(Call::DeviceSync)?;
        self.streams.complete_all();
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<Event> {
        self.count(Call::EventCreate);
        Ok(self.streams.create_event())
    }

    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        self.count(Call::EventRecord);
        self.streams.record(event, stream)
    }

    fn query_event(&self, event: Event) -> DeviceResult<bool> {
        self.count(Call::EventQuery);
        self.streams.query(event)
    }

    fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        self.count(Call::EventSync);
        self.streams.synchronize_event(event)
    }

    fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        self.count(Call::EventDestroy);
        self.streams.destroy_event(event)
    }

    fn is_capturing(&self, stream: Stream) -> DeviceResult<bool> {
        self.streams.is_capturing(stream)
    }

    fn introspect(&self) -> Option<&dyn Introspect> {
        Some(self)
    }
}

impl Introspect for HostDevice {
    fn is_accessible(&self, addr: u64, len: u64) -> bool {
        self.state.lock().space.is_accessible(addr, len)
    }

    fn live(&self) -> LiveCounts {
        self.state.lock().space.live()
    }

    /// The model's invariants, plus: the host's own tables hold exactly the
    /// model's live objects, and allocation reference counts match a recount.
    fn check(&self) -> Result<(), String> {
        let st = self.state.lock();
        st.space.check()?;
        let live = st.space.live();
        let host = (
            st.reservations.len(),
            st.handles.len(),
            st.mappings.len(),
            st.plain.len(),
        );
        let model = (
            live.reservations,
            live.handles,
            live.mappings,
            live.plain_allocs,
        );
        if host != model {
            return Err(format!(
                "host tables (reservations, handles, mappings, plain) = {host:?} but the model has {model:?}"
            ));
        }
        let mut refs: HashMap<u64, u32> = HashMap::new();
        for h in st.handles.values() {
            *refs.entry(h.alloc).or_default() += 1;
        }
        for &(_, alloc) in st.mappings.values() {
            *refs.entry(alloc).or_default() += 1;
        }
        if refs.len() != st.allocations.len() || st.by_inode.len() != st.allocations.len() {
            return Err(format!(
                "{} allocations referenced, {} backing files, {} inodes",
                refs.len(),
                st.allocations.len(),
                st.by_inode.len()
            ));
        }
        for (id, a) in &st.allocations {
            let n = refs.get(id).copied().unwrap_or(0);
            if n != a.refs {
                return Err(format!(
                    "allocation {id:#x}: refs {} but {n} holders",
                    a.refs
                ));
            }
            if st.by_inode.get(&a.inode) != Some(id) {
                return Err(format!(
                    "allocation {id:#x}: inode {:?} not indexed",
                    a.inode
                ));
            }
        }
        for (&s, &(l, _)) in &st.mappings {
            match st.reservations.range(..=s).next_back() {
                Some((&rs, &rl)) if s + l <= rs + rl => {}
                _ => {
                    return Err(format!(
                        "host mapping {s:#x} is outside every host reservation"
                    ))
                }
            }
        }
        Ok(())
    }

    fn streams(&self) -> &StreamModel {
        &self.streams
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        let name = self.caps.name.clone();
        let st = self.state.get_mut();
        for (&addr, &(size, _)) in &st.mappings {
            eprintln!(
                "vmmalloc host device '{name}': leaked mapping [{addr:#x}, +{size:#x}), unmapping"
            );
        }
        for (&addr, &size) in &st.reservations {
            eprintln!("vmmalloc host device '{name}': leaked reservation [{addr:#x}, +{size:#x}), freeing");
            // SAFETY: the device is being dropped: nothing can use the range
            // (or the mappings inside it) any more.
            if let Err(e) = unsafe { munmap(addr, size) } {
                eprintln!(
                    "vmmalloc host device '{name}': munmap of [{addr:#x}, +{size:#x}) failed: {e}"
                );
            }
        }
        for (id, h) in st.handles.drain() {
            eprintln!(
                "vmmalloc host device '{name}': leaked handle {id:#x} (fd {}), releasing",
                h.fd.as_raw_fd()
            );
            drop(h);
        }
        for (&addr, &len) in &st.plain {
            eprintln!("vmmalloc host device '{name}': leaked plain allocation {addr:#x} ({len} bytes), freeing");
            // SAFETY: as above, nothing can use the allocation any more.
            if let Err(e) = unsafe { munmap(addr, len) } {
                eprintln!("vmmalloc host device '{name}': munmap of {addr:#x} failed: {e}");
            }
        }
        st.mappings.clear();
        st.reservations.clear();
        st.plain.clear();
        st.allocations.clear();
        st.by_inode.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_a_granularity_below_the_page_size_or_not_a_power_of_two() {
        for g in [0, 1000, 3 * MIB, 512] {
            let e = HostDevice::new(HostConfig::with_capacity(GIB).granularity(g)).unwrap_err();
            assert!(matches!(e, DeviceError::Unavailable(_)), "{g}: {e}");
        }
        assert!(HostDevice::new(HostConfig::with_capacity(GIB).granularity(64 * 1024)).is_ok());
    }

    /// Virtual size of this process, from `/proc/self/status`.
    fn vm_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    #[test]
    fn reservations_are_aligned_as_asked_and_trimmed() {
        let dev = HostDevice::with_capacity(64 * MIB).unwrap();
        for align in [0, 2 * MIB, 64 * MIB, 4 * GIB] {
            let before = vm_size();
            let a = dev.reserve(6 * MIB, align).unwrap();
            let grown = vm_size().saturating_sub(before);
            assert_eq!(a % align.max(2 * MIB), 0, "align {align:#x}");
            // Untrimmed, a 4 GiB alignment would leave ~4 GiB of extra address
            // space; other test threads may map a few arenas meanwhile.
            assert!(
                grown < 6 * MIB + 512 * MIB,
                "align {align:#x}: grew by {grown:#x}"
            );
            dev.free_reservation(a, 6 * MIB).unwrap();
        }
        assert_eq!(dev.counts().get(Call::Reserve), 4);
        assert_eq!(dev.counts().get(Call::AddressFree), 4);
        assert!(dev.live().is_empty());
    }
}
