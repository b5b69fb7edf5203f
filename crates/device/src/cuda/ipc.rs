//! Legacy CUDA IPC on the `cuda` backend: opening another process's
//! `cuMemAlloc` memory by its 64-byte handle (`cuIpcOpenMemHandle`) and
//! closing it (`cuIpcCloseMemHandle`), in the device's primary context (the
//! one the CUDA runtime, and so PyTorch's `cudaIpcOpenMemHandle`, uses).
//!
//! The driver counts references: "If the memory handle has already been
//! opened by the current context, the reference count on the handle is
//! incremented by 1 and the existing device pointer is returned", and
//! `cuIpcCloseMemHandle` "decrements the reference count ... When the
//! reference count reaches 0, this API unmaps the memory" (cuda.h). The
//! device keeps the same count of what it opened (`ipc_opened`), so a close
//! of a pointer it did not open (or closed already) never reaches the driver
//! ([`Rule::UnknownPointer`], as the models answer a foreign pointer).

use super::*;
use vmm_sys::{CUipcMemHandle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS};

impl CudaDevice {
    /// [`Device::ipc_open`]: `cuIpcOpenMemHandle_v2` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, "the only flag" it takes (cuda.h).
    pub(super) fn open_ipc(&self, handle: &IpcMemHandle) -> DeviceResult<u64> {
        let _ctx = self.enter(Call::IpcOpen)?;
        let h = CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let ptr = self
            .driver
            .ipc_open_mem_handle(h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            .map_err(|e| self.fail(Call::IpcOpen, e, 0, || "a 64-byte handle".into()))?;
        self.ipc_opened.lock().insert(ptr);
        Ok(ptr)
    }

    /// [`Device::ipc_close`]: one `cuIpcCloseMemHandle` for one open.
    pub(super) fn close_ipc(&self, ptr: u64) -> DeviceResult<()> {
        let _ctx = self.enter(Call::IpcClose)?;
        let taken = self.ipc_opened.lock().take(ptr).ok_or_else(|| {
            DeviceError::rule(
                Call::IpcClose,
                Rule::UnknownPointer,
                format!("{ptr:#x} is not open (ipc_open did not return it, or it was closed)"),
            )
        })?;
        // SAFETY: `ptr` is what cuIpcOpenMemHandle returned on this device,
        // and one of its references has just been taken out of the registry,
        // so it is closed once per open. Waiting for the work that uses the
        // mapping is the caller's contract (`Device::ipc_close`); a violation
        // faults on the device, never in host memory.
        match unsafe { self.driver.ipc_close_mem_handle(ptr) } {
            Ok(()) => Ok(()),
            Err(e) => {
                self.ipc_opened.lock().restore(ptr, taken);
                Err(self.fail(Call::IpcClose, e, 0, || format!("ptr {ptr:#x}")))
            }
        }
    }
}
