//! Opening the device behind one ordinal, as `device:` selects.

use crate::config::{Config, DeviceKind, MODEL_GRANULARITY};
use crate::error::Error;
use std::sync::{Arc, Mutex};
use vmmalloc_device::cuda::{CudaDevice, CudaOptions};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::{SimConfig, SimDevice};
use vmmalloc_device::{Device, GIB};

/// Opens device `ordinal` of the configured kind: `CudaDevice::open_configured`
/// with `peers:` and `ipc:` on `cuda`; a fresh host or sim device of
/// `capacity_gb` per ordinal otherwise.
pub fn open(config: &Config, ordinal: u32) -> Result<Arc<dyn Device>, Error> {
    let dev = open_plain(config, ordinal)?;
    let wrap = WRAP.lock().unwrap_or_else(|e| e.into_inner());
    Ok(match &*wrap {
        Some(f) => f(dev, ordinal),
        None => dev,
    })
}

/// A wrapper put around every device opened from now on.
pub type DeviceWrapper = Box<dyn Fn(Arc<dyn Device>, u32) -> Arc<dyn Device> + Send + Sync>;

static WRAP: Mutex<Option<DeviceWrapper>> = Mutex::new(None);

/// Tests only: wraps every device opened from now on (with a fault-injecting
/// adaptor, say) before its allocator is built over it; `None` stops.
/// Devices opened before keep what they had.
#[doc(hidden)]
pub fn wrap_devices_for_tests(wrapper: Option<DeviceWrapper>) {
    *WRAP.lock().unwrap_or_else(|e| e.into_inner()) = wrapper;
}

fn open_plain(config: &Config, ordinal: u32) -> Result<Arc<dyn Device>, Error> {
    let capacity = config.model_capacity();
    let name = |kind: &str| format!("{kind}{ordinal} ({} GiB)", capacity as f64 / GIB as f64);
    match config.device {
        DeviceKind::Cuda => CudaDevice::open_configured(ordinal, &cuda_options(config))
            .map(|d| {
                // PyTorch hands us its own streams (side streams, NCCL's): accept them.
                d.accept_external_streams(true);
                Arc::new(d) as Arc<dyn Device>
            })
            .map_err(|e| Error::from(e).context(format!("cannot open CUDA device {ordinal}"))),
        DeviceKind::Host => HostDevice::new(HostConfig {
            name: name("host"),
            capacity,
            granularity: MODEL_GRANULARITY,
            ordinal,
        })
        .map(|d| Arc::new(d) as Arc<dyn Device>)
        .map_err(|e| Error::from(e).context(format!("cannot create host device {ordinal}"))),
        DeviceKind::Sim => Ok(Arc::new(SimDevice::new(SimConfig {
            name: name("sim"),
            ordinal,
            ..SimConfig::with_capacity(capacity)
        }))),
    }
}

/// The `cuda` backend's options from `peers:`, `ipc:` and `nccl_register:`
/// (memory NCCL can register: fabric handles where offered, the RDMA flag and
/// the recommended granularity, as NCCL's own `ncclMemAlloc`).
fn cuda_options(config: &Config) -> CudaOptions {
    CudaOptions {
        peers: config.peers.clone(),
        ipc: config.ipc == Some(true),
        ipc_auto: config.ipc.is_none(),
        nccl_ready: config.nccl_register,
    }
}
