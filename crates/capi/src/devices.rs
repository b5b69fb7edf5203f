//! Opening the device behind one ordinal, as `device:` selects.

use crate::config::{Config, DeviceKind, MODEL_GRANULARITY};
use std::sync::Arc;
use vmmalloc_device::cuda::{CudaDevice, CudaOptions};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::{SimConfig, SimDevice};
use vmmalloc_device::{Device, GIB};

/// Opens device `ordinal` of the configured kind: `CudaDevice::open_configured`
/// with `peers:` and `ipc:` on `cuda`; a fresh host or sim device of
/// `capacity_gb` per ordinal otherwise.
pub fn open(config: &Config, ordinal: u32) -> Result<Arc<dyn Device>, String> {
    let capacity = config.model_capacity();
    let name = |kind: &str| format!("{kind}{ordinal} ({} GiB)", capacity as f64 / GIB as f64);
    match config.device {
        DeviceKind::Cuda => CudaDevice::open_configured(ordinal, &cuda_options(config))
            .map(|d| {
                // PyTorch hands us its own streams (side streams, NCCL's): accept them.
                d.accept_external_streams(true);
                Arc::new(d) as Arc<dyn Device>
            })
            .map_err(|e| format!("cannot open CUDA device {ordinal}: {e}")),
        DeviceKind::Host => HostDevice::new(HostConfig {
            name: name("host"),
            capacity,
            granularity: MODEL_GRANULARITY,
            ordinal,
        })
        .map(|d| Arc::new(d) as Arc<dyn Device>)
        .map_err(|e| format!("cannot create host device {ordinal}: {e}")),
        DeviceKind::Sim => Ok(Arc::new(SimDevice::new(SimConfig {
            name: name("sim"),
            ordinal,
            ..SimConfig::with_capacity(capacity)
        }))),
    }
}

/// The `cuda` backend's options from `peers:` and `ipc:`.
fn cuda_options(config: &Config) -> CudaOptions {
    CudaOptions {
        peers: config.peers.clone(),
        ipc: config.ipc == Some(true),
        ipc_auto: config.ipc.is_none(),
    }
}
