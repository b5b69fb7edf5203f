//! How a device is opened: which peers get access to its memory, and
//! whether its handles can be exported (see the parent module's "Peers and
//! handle types").

use super::*;

/// Which other devices get read-write access to a device's memory
/// (`VMMALLOC_CONF` key `peers:`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Peers {
    /// Every other device with `cuDeviceCanAccessPeer(peer, this) = 1`.
    #[default]
    Auto,
    /// None: only this device may access its memory.
    None,
    /// These ordinals (this device itself is skipped); each must exist and be
    /// able to access this device (`cuDeviceCanAccessPeer`), else opening fails.
    List(Vec<u32>),
}

/// How a [`CudaDevice`] is opened.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CudaOptions {
    /// Peers granted access on every `set_access`.
    pub peers: Peers,
    /// Request `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` so handles can be
    /// exported (`ipc:true`); opening fails if the device cannot.
    pub ipc: bool,
    /// With `ipc` false: request it anyway when the device supports it
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`),
    /// else silently not (`ipc:auto`, the C ABI's default). Off here, so
    /// that a bare `CudaDevice::open` requests nothing it was not asked for.
    pub ipc_auto: bool,
    /// Create memory as NCCL's own `ncclMemAlloc` does, so that NCCL can
    /// register it (user-buffer registration; NCCL's allocator.cc): also
    /// request `CU_MEM_HANDLE_TYPE_FABRIC` where the device reports
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` (dropped for good
    /// after the first `cuMemCreate` refused with `CUDA_ERROR_NOT_PERMITTED`
    /// or `CUDA_ERROR_NOT_SUPPORTED`, as NCCL retries without it), set
    /// `gpuDirectRDMACapable` where the device reports
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`, and use
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED` as the page (where it is a
    /// multiple of the minimum). The C ABI sets it from `nccl_register`
    /// (default on); off here.
    pub nccl_ready: bool,
}

/// The ordinals to grant access to device `ordinal` (`dev`), per `peers`.
/// `cuDeviceCanAccessPeer(peer, dev)` says whether contexts on `peer` can
/// access `dev`'s memory; it needs no context.
pub(super) fn resolve_peers(
    driver: &Driver,
    dev: CUdevice,
    ordinal: u32,
    peers: &Peers,
) -> DeviceResult<Vec<u32>> {
    let fail = |e: CuError| DeviceError::Unavailable(format!("peers: {}", describe(driver, e)));
    let count = u32::try_from(driver.device_get_count().map_err(fail)?).unwrap_or(0);
    let can = |p: u32| -> DeviceResult<bool> {
        let peer = driver.device_get(p as i32).map_err(fail)?;
        driver.device_can_access_peer(peer, dev).map_err(fail)
    };
    match peers {
        Peers::None => Ok(Vec::new()),
        Peers::Auto => {
            let mut out = Vec::new();
            for p in (0..count).filter(|&p| p != ordinal) {
                if can(p)? {
                    out.push(p);
                }
            }
            Ok(out)
        }
        Peers::List(list) => {
            let mut out = Vec::new();
            for &p in list {
                if p >= count {
                    return Err(DeviceError::Unavailable(format!(
                        "peers: device {p} does not exist ({count} CUDA device(s) visible)"
                    )));
                }
                if p == ordinal || out.contains(&p) {
                    continue;
                }
                if !can(p)? {
                    return Err(DeviceError::Unavailable(format!(
                        "peers: device {p} cannot access the memory of device {ordinal} \
                         (cuDeviceCanAccessPeer({p}, {ordinal}) = 0); list only peer-capable \
                         devices, or use peers:auto"
                    )));
                }
                out.push(p);
            }
            Ok(out)
        }
    }
}
