//! The virtual-memory-management entry points: reserve, free, create,
//! release, map, unmap, set access, granularity, export and import.
//!
//! Each call checks what the driver checks before touching memory (pointers,
//! flags, the allocation properties, the device), then hands the rest to the
//! owning device's [`vmmalloc_device::host::HostDevice`], whose model names
//! the broken rule and its code. The owning device of an address is the one
//! that reserved it; of a handle, the one that created (or imported) it.
#![allow(non_snake_case)]

use crate::config::Fabric;
use crate::state::{code, fake, Fake};
use crate::{get, put, run, Fail, Res};
use std::ffi::{c_int, c_void};
use vmm_sys::{CUdevice, CU_MEM_LOCATION_TYPE_HOST_NUMA};
use vmm_sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationHandleType,
    CUmemAllocationProp, CUmemFabricHandle, CUmemGenericAllocationHandle, CUmemLocation, CUresult,
    CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED,
    CU_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_READ,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    CU_MEM_HANDLE_TYPE_FABRIC, CU_MEM_HANDLE_TYPE_NONE, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
};
use vmmalloc_device::{Device, Introspect};

/// `CU_MEM_HANDLE_TYPE_WIN32`.
const CU_MEM_HANDLE_TYPE_WIN32: u32 = 0x2;
/// `CU_MEM_HANDLE_TYPE_WIN32_KMT`.
const CU_MEM_HANDLE_TYPE_WIN32_KMT: u32 = 0x4;

/// Checks a shareable handle type named in an export or import: POSIX file
/// descriptors, and fabric handles where `FAKE_CUDA_FABRIC` offers them.
fn check_handle_type(f: &Fake, t: CUmemAllocationHandleType) -> Res<()> {
    match t {
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => Ok(()),
        CU_MEM_HANDLE_TYPE_FABRIC if f.config.fabric != Fabric::None => Ok(()),
        CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC => {
            Err(code(
                CUDA_ERROR_NOT_SUPPORTED,
                format!(
                    "handle type {t:#x} is not supported (POSIX file descriptors, and fabric \
                     handles with FAKE_CUDA_FABRIC=imex or no-imex)"
                ),
            ))
        }
        _ => Err(Fail::invalid(format!(
            "handle type {t:#x} is not a CUmemAllocationHandleType"
        ))),
    }
}

/// The shareable handle kinds an allocation was created with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Kinds {
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` requested.
    posix: bool,
    /// `CU_MEM_HANDLE_TYPE_FABRIC` requested.
    fabric: bool,
}

/// Checks allocation properties as `cuMemCreate` and
/// `cuMemGetAllocationGranularity` do; returns the device ordinal and the
/// handle kinds requested. A granularity query accepts the fabric type
/// wherever the device reports it; `cuMemCreate` then needs the permission
/// too (`FAKE_CUDA_FABRIC=imex`).
fn check_prop(f: &Fake, p: &CUmemAllocationProp) -> Res<(usize, Kinds)> {
    check_prop_located(f, p).map(|(dev, kinds, _)| (dev, kinds))
}

/// The one host NUMA node the fake has (`CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`).
pub(crate) const HOST_NUMA_NODE: i32 = 0;

/// [`check_prop`], also accepting `CU_MEM_LOCATION_TYPE_HOST_NUMA` (3, CUDA
/// 12.2+) on node [`HOST_NUMA_NODE`]: host-located memory, allocated for the
/// current context's device. Returns `(device, kinds, on_host)`.
fn check_prop_located(f: &Fake, p: &CUmemAllocationProp) -> Res<(usize, Kinds, bool)> {
    if p.location.type_ == CU_MEM_LOCATION_TYPE_HOST_NUMA {
        if p.location.id != HOST_NUMA_NODE {
            return Err(Fail::invalid(format!(
                "prop->location.id {} is not a host NUMA node (the fake has node {HOST_NUMA_NODE})",
                p.location.id
            )));
        }
        let dev = f.current()?;
        let as_device = CUmemAllocationProp {
            location: CUmemLocation::device(dev as CUdevice),
            ..*p
        };
        return check_prop_device(f, &as_device).map(|(d, kinds)| (d, kinds, true));
    }
    check_prop_device(f, p).map(|(d, kinds)| (d, kinds, false))
}

fn check_prop_device(f: &Fake, p: &CUmemAllocationProp) -> Res<(usize, Kinds)> {
    if p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED {
        return Err(Fail::invalid(format!(
            "prop->type {} is not CU_MEM_ALLOCATION_TYPE_PINNED",
            p.type_
        )));
    }
    if p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(Fail::invalid(format!(
            "prop->location.type {} is not CU_MEM_LOCATION_TYPE_DEVICE",
            p.location.type_
        )));
    }
    f.device(p.location.id)?;
    let kinds = match p.requestedHandleTypes {
        CU_MEM_HANDLE_TYPE_NONE => Kinds::default(),
        t => {
            for bit in [1u32, 2, 4, 8] {
                if t & bit != 0 {
                    check_handle_type(f, bit)?;
                }
            }
            if t & !0xf != 0 {
                return Err(Fail::invalid(format!(
                    "prop->requestedHandleTypes {t:#x} has unknown bits"
                )));
            }
            Kinds {
                posix: t & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0,
                fabric: t & CU_MEM_HANDLE_TYPE_FABRIC != 0,
            }
        }
    };
    let flags = &p.allocFlags;
    if flags.compressionType != 0 {
        return Err(code(
            CUDA_ERROR_NOT_SUPPORTED,
            "compressible memory is not supported",
        ));
    }
    if flags.gpuDirectRDMACapable > 1 || flags.usage != 0 || flags.reserved != [0; 4] {
        return Err(Fail::invalid(format!(
            "prop->allocFlags {flags:?}: unsupported or reserved bits set"
        )));
    }
    Ok((p.location.id as usize, kinds))
}

/// `CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t
/// alignment, CUdeviceptr addr, unsigned long long flags)`: a real `PROT_NONE`
/// range of this process, owned by the current context's device. The `addr`
/// hint is ignored (the driver may ignore it too); `flags` must be 0.
///
/// # Safety
/// As `cuda.h` requires: `ptr` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    let _ = addr;
    run("cuMemAddressReserve", || {
        let f = fake()?;
        if ptr.is_null() {
            return Err(Fail::invalid("ptr is NULL"));
        }
        if flags != 0 {
            return Err(Fail::invalid(format!("flags {flags:#x} must be 0")));
        }
        let dev = f.current()?;
        let host = f.host(dev);
        let start = host.reserve(size as u64, alignment as u64)?;
        f.add_reservation(start, size as u64, dev, host);
        // SAFETY: the caller passes a writable CUdeviceptr (cuda.h); non-null checked above.
        unsafe { put(ptr, start, "ptr") }
    })
}

/// `CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)`: exactly a
/// reserved range with nothing mapped in it.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    run("cuMemAddressFree", || {
        let f = fake()?;
        let (_, host) = f.judge(ptr);
        host.free_reservation(ptr, size as u64)?;
        f.remove_reservation(ptr);
        Ok(())
    })
}

/// `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
/// const CUmemAllocationProp *prop, unsigned long long flags)`: a memfd of
/// `size` bytes on `prop->location.id`. Checks the properties (pinned, on a
/// valid device, POSIX-fd or no handle type, no compression) and `flags` = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY` past the device's capacity. A host NUMA
/// location (`CU_MEM_LOCATION_TYPE_HOST_NUMA`, node 0) makes a host-located
/// allocation of the current context's device, charged to host memory.
///
/// # Safety
/// As `cuda.h` requires: `handle`, `prop` are each null or valid for what this call reads or writes through them.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    run("cuMemCreate", || {
        let f = fake()?;
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        // SAFETY: the caller passes null or a readable CUmemAllocationProp (cuda.h).
        let p = unsafe { get(prop, "prop") }?;
        if flags != 0 {
            return Err(Fail::invalid(format!("flags {flags:#x} must be 0")));
        }
        let (dev, kinds, on_host) = check_prop_located(f, &p)?;
        if kinds.fabric && f.config.fabric == Fabric::NoImex {
            // What NCCL's ncclMemAlloc expects without an IMEX channel
            // (NCCL's allocator.cc retries without the fabric type).
            return Err(code(
                CUDA_ERROR_NOT_PERMITTED,
                "CU_MEM_HANDLE_TYPE_FABRIC: this process may not use the fabric (no IMEX \
                 channel; FAKE_CUDA_FABRIC=no-imex)",
            ));
        }
        let host = f.host(dev);
        let inner = if on_host {
            host.create_on_host(size as u64)?
        } else {
            host.create(size as u64)?
        };
        let value = f.add_handle(dev, host, inner, kinds.posix, kinds.fabric);
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(handle, value, "handle") }
    })
}

/// `CUresult cuMemRelease(CUmemGenericAllocationHandle handle)`: the memory
/// goes back to the device once its last mapping is gone.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    run("cuMemRelease", || {
        let f = fake()?;
        let e = f.handle(handle)?;
        e.host.release(e.inner)?;
        f.remove_handle(handle);
        Ok(())
    })
}

/// `CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
/// CUmemGenericAllocationHandle handle, unsigned long long flags)`: the whole
/// handle (offset 0, size = its size, as `cuda.h` requires today) into an
/// unmapped part of one reservation; `flags` must be 0.
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    run("cuMemMap", || {
        let f = fake()?;
        if offset != 0 {
            return Err(Fail::invalid(format!("offset {offset:#x} must be 0")));
        }
        if flags != 0 {
            return Err(Fail::invalid(format!("flags {flags:#x} must be 0")));
        }
        let e = f.handle(handle)?;
        if let Some((owner, _)) = f.owner_of(ptr) {
            if owner != e.dev {
                return Err(code(
                    CUDA_ERROR_NOT_SUPPORTED,
                    format!(
                        "mapping device {}'s memory into device {owner}'s reservation is not modelled by the fake",
                        e.dev
                    ),
                ));
            }
        }
        Ok(e.host.map(ptr, size as u64, e.inner)?)
    })
}

/// `CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)`: whole mappings only,
/// none still used by queued work (`fakeCudaSubmitWork`).
///
/// # Safety
/// No pointer is dereferenced: the fake validates every argument itself.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    run("cuMemUnmap", || {
        let f = fake()?;
        let (_, host) = f.judge(ptr);
        host.unmap(ptr, size as u64)?;
        // Access (peers' included) belongs to the mapping: gone with it.
        f.revoke_peers(ptr, size as u64);
        Ok(())
    })
}

/// `CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const
/// CUmemAccessDesc *desc, size_t count)`: the range must be fully mapped;
/// every descriptor names a device with `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`
/// (read-only and revoking are not modelled: `CUDA_ERROR_NOT_SUPPORTED`).
/// Descriptors for other devices than the owner grant peer access, which
/// `cuDeviceCanAccessPeer(peer, owner)` must allow (else
/// `CUDA_ERROR_INVALID_DEVICE`, a code cuda.h lists for this call); the owner
/// itself must be among the descriptors (granting only peers is not
/// modelled: `CUDA_ERROR_NOT_SUPPORTED`).
///
/// # Safety
/// As `cuda.h` requires: `desc` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    run("cuMemSetAccess", || {
        let f = fake()?;
        if desc.is_null() || count == 0 {
            return Err(Fail::invalid(format!(
                "desc {desc:p} with count {count}: no descriptor"
            )));
        }
        // Peer checks only for a known range: for any other the model names the rule.
        let owner = f.owner_of(ptr);
        let (dev, host) = owner.clone().unwrap_or_else(|| f.judge(ptr));
        let mut peers = 0u64;
        let mut owner_named = false;
        for i in 0..count {
            // SAFETY: `desc` points to `count` readable descriptors (cuda.h);
            // `i < count` keeps the offset inside that array.
            let d = unsafe { get(desc.add(i), "desc") }?;
            if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(Fail::invalid(format!(
                    "desc[{i}].location.type {} is not CU_MEM_LOCATION_TYPE_DEVICE",
                    d.location.type_
                )));
            }
            f.device(d.location.id)?;
            match d.flags {
                CU_MEM_ACCESS_FLAGS_PROT_READWRITE => {}
                CU_MEM_ACCESS_FLAGS_PROT_NONE | CU_MEM_ACCESS_FLAGS_PROT_READ => {
                    return Err(code(
                        CUDA_ERROR_NOT_SUPPORTED,
                        format!(
                            "desc[{i}].flags {}: only read-write access is modelled",
                            d.flags
                        ),
                    ))
                }
                other => {
                    return Err(Fail::invalid(format!(
                        "desc[{i}].flags {other} is not a CUmemAccess_flags"
                    )))
                }
            }
            let peer = d.location.id as usize;
            if peer == dev {
                owner_named = true;
            } else if owner.is_some() {
                if !f.config.can_access_peer(peer as u32, dev as u32) {
                    return Err(code(
                        CUDA_ERROR_INVALID_DEVICE,
                        format!(
                            "desc[{i}] grants device {peer} access to device {dev}'s memory, \
                             but cuDeviceCanAccessPeer({peer}, {dev}) = 0 (FAKE_CUDA_PEERS)"
                        ),
                    ));
                }
                peers |= 1 << peer;
            }
        }
        if owner.is_some() && !owner_named {
            return Err(code(
                CUDA_ERROR_NOT_SUPPORTED,
                format!("no descriptor names the owning device {dev}: granting only peers is not modelled"),
            ));
        }
        host.set_access(ptr, size as u64)?;
        if peers != 0 {
            f.grant_peers(ptr, size as u64, peers);
        }
        Ok(())
    })
}

/// `CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation
/// *location, CUdeviceptr ptr)`: `CU_MEM_ACCESS_FLAGS_PROT_READWRITE` when
/// `location` may access the mapping at `ptr` (the owner after
/// `cuMemSetAccess`, a peer after a descriptor for it), else
/// `CU_MEM_ACCESS_FLAGS_PROT_NONE`. An address outside every reservation is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// As `cuda.h` requires: `flags`, `location` are each null or valid for what this call reads or writes through them.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAccess(
    flags: *mut u64,
    location: *const CUmemLocation,
    ptr: CUdeviceptr,
) -> CUresult {
    run("cuMemGetAccess", || {
        let f = fake()?;
        // SAFETY: null or readable (cuda.h).
        let loc = unsafe { get(location, "location") }?;
        if loc.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(Fail::invalid(format!(
                "location.type {} is not CU_MEM_LOCATION_TYPE_DEVICE",
                loc.type_
            )));
        }
        f.device(loc.id)?;
        let (dev, host) = f
            .owner_of(ptr)
            .ok_or_else(|| Fail::invalid(format!("{ptr:#x} is not inside a reservation")))?;
        let granted = if loc.id as usize == dev {
            host.is_accessible(ptr, 1)
        } else {
            host.is_accessible(ptr, 1) && f.peers_of(ptr) & (1 << loc.id) != 0
        };
        let value = if granted {
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            CU_MEM_ACCESS_FLAGS_PROT_NONE
        };
        // SAFETY: null or writable (cuda.h).
        unsafe { put(flags, u64::from(value), "flags") }
    })
}

/// `CUresult cuMemGetAllocationGranularity(size_t *granularity, const
/// CUmemAllocationProp *prop, CUmemAllocationGranularity_flags option)`:
/// `FAKE_CUDA_GRANULARITY_KB` for the minimum granularity,
/// `FAKE_CUDA_RECOMMENDED_GRANULARITY_KB` (by default the same) for the
/// recommended one.
///
/// # Safety
/// As `cuda.h` requires: `granularity`, `prop` are each null or valid for what this call reads or writes through them.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: CUmemAllocationGranularity_flags,
) -> CUresult {
    run("cuMemGetAllocationGranularity", || {
        let f = fake()?;
        if granularity.is_null() {
            return Err(Fail::invalid("granularity is NULL"));
        }
        // SAFETY: the caller passes null or a readable CUmemAllocationProp (cuda.h).
        let p = unsafe { get(prop, "prop") }?;
        check_prop(f, &p)?;
        if option != CU_MEM_ALLOC_GRANULARITY_MINIMUM
            && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        {
            return Err(Fail::invalid(format!(
                "option {option} is not a granularity flag"
            )));
        }
        let g = if option == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED {
            f.config.recommended_granularity
        } else {
            f.config.granularity
        };
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(granularity, g as usize, "granularity") }
    })
}

/// `CUresult cuMemExportToShareableHandle(void *shareableHandle,
/// CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType,
/// unsigned long long flags)`: for `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`,
/// writes a new descriptor (the caller's to close) into the `int` at
/// `shareableHandle`; for `CU_MEM_HANDLE_TYPE_FABRIC` (where
/// `FAKE_CUDA_FABRIC` offers it), a 64-byte `CUmemFabricHandle`. The handle
/// must have been created with that type requested.
///
/// # Safety
/// As `cuda.h` requires: `shareableHandle` is null or valid for what this call reads or writes through it.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareableHandle: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handleType: CUmemAllocationHandleType,
    flags: u64,
) -> CUresult {
    run("cuMemExportToShareableHandle", || {
        let f = fake()?;
        if shareableHandle.is_null() {
            return Err(Fail::invalid("shareableHandle is NULL"));
        }
        if flags != 0 {
            return Err(Fail::invalid(format!("flags {flags:#x} must be 0")));
        }
        check_handle_type(f, handleType)?;
        let e = f.handle(handle)?;
        if handleType == CU_MEM_HANDLE_TYPE_FABRIC {
            if !e.fabric {
                return Err(Fail::invalid(format!(
                    "handle {handle:#x} was created without CU_MEM_HANDLE_TYPE_FABRIC requested"
                )));
            }
            let out = fabric_handle(handle);
            // SAFETY: for fabric handles `shareableHandle` points to a
            // writable CUmemFabricHandle (cuda.h); non-null checked above.
            return unsafe {
                put(
                    shareableHandle.cast::<CUmemFabricHandle>(),
                    out,
                    "shareableHandle",
                )
            };
        }
        if !e.posix_fd {
            return Err(Fail::invalid(format!(
                "handle {handle:#x} was created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR requested"
            )));
        }
        let fd = e.host.export_fd(e.inner)?;
        // SAFETY: for POSIX file descriptors `shareableHandle` points to a
        // writable int (cuda.h); non-null checked above.
        unsafe { put(shareableHandle.cast::<c_int>(), fd, "shareableHandle") }
    })
}

/// The first bytes of the fake's fabric handles.
const FABRIC_MAGIC: &[u8; 8] = b"FAKEFAB\0";

/// The fake's `CUmemFabricHandle` for `handle`: a magic, this process's id
/// and the handle's value (a real one names the allocation fabric-wide).
fn fabric_handle(handle: CUmemGenericAllocationHandle) -> CUmemFabricHandle {
    let mut data = [0u8; 64];
    data[..8].copy_from_slice(FABRIC_MAGIC);
    data[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    data[16..24].copy_from_slice(&handle.to_le_bytes());
    CUmemFabricHandle { data }
}

/// Imports a fabric handle [`fabric_handle`] made: only in the process that
/// exported it, while the exported handle is live (docs/fake-cuda.md).
fn import_fabric(f: &Fake, osHandle: *mut c_void) -> Res<u64> {
    if osHandle.is_null() {
        return Err(Fail::invalid("osHandle is NULL"));
    }
    // SAFETY: for fabric handles `osHandle` points to a readable
    // CUmemFabricHandle (cuda.h); non-null checked above.
    let h = unsafe {
        get(
            osHandle.cast::<CUmemFabricHandle>().cast_const(),
            "osHandle",
        )
    }?;
    if &h.data[..8] != FABRIC_MAGIC {
        return Err(Fail::invalid(
            "osHandle is not a fabric handle this driver exported",
        ));
    }
    let pid = u32::from_le_bytes(h.data[8..12].try_into().expect("4 bytes"));
    if pid != std::process::id() {
        return Err(code(
            CUDA_ERROR_NOT_SUPPORTED,
            format!("fabric handle of process {pid}: the fake imports fabric handles only in the process that exported them"),
        ));
    }
    let value = u64::from_le_bytes(h.data[16..24].try_into().expect("8 bytes"));
    let e = f.handle(value)?;
    // The same memory through a second handle, as an import of a descriptor.
    let fd = e.host.export_fd(e.inner)?;
    let inner = e.host.import_fd(fd);
    // SAFETY: `fd` is the descriptor just exported, owned here.
    unsafe { libc::close(fd) };
    Ok(f.add_handle(e.dev, e.host.clone(), inner?, false, true))
}

/// `CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle
/// *handle, void *osHandle, CUmemAllocationHandleType shHandleType)`: for POSIX
/// file descriptors `osHandle` is the descriptor itself, `(void *)(uintptr_t)fd`;
/// the new handle names the same memory (on whichever device made it) and the
/// descriptor stays the caller's.
///
/// # Safety
/// As `cuda.h` requires: `handle` is null or writable; `osHandle` is the descriptor's value, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    osHandle: *mut c_void,
    shHandleType: CUmemAllocationHandleType,
) -> CUresult {
    run("cuMemImportFromShareableHandle", || {
        let f = fake()?;
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        check_handle_type(f, shHandleType)?;
        if shHandleType == CU_MEM_HANDLE_TYPE_FABRIC {
            let value = import_fabric(f, osHandle)?;
            // SAFETY: non-null (checked above) and writable (cuda.h).
            return unsafe { put(handle, value, "handle") };
        }
        // `(void *)(uintptr_t)fd` in C sign-extends an int; its low 32 bits are the fd.
        let fd = osHandle.expose_provenance() as c_int;
        if f.device_count() == 0 {
            return Err(Fail::invalid(format!("fd {fd}: no device")));
        }
        // The device that made the allocation; a descriptor exported by
        // another process (IPC) is imported on device 0: the fake cannot
        // tell which of that process's devices made it (docs/fake-cuda.md).
        let dev = (0..f.device_count())
            .find(|&d| f.host(d).knows_fd(fd))
            .unwrap_or(0);
        let host = f.host(dev);
        let inner = host.import_fd(fd)?;
        let value = f.add_handle(dev, host, inner, true, false);
        // SAFETY: non-null (checked above) and writable (cuda.h).
        unsafe { put(handle, value, "handle") }
    })
}
