//! The `sim` backend: bookkeeping and a cost model, no memory touched.
//!
//! A [`SimDevice`] holds an 80–192 GiB GPU in a few kilobytes: the shared
//! [`AddressSpace`] enforces the driver's rules, a [`StreamModel`] tracks queued
//! work, every call is counted per kind and charged from a [`CostModel`].

use crate::cost::CostModel;
use crate::model::{AddressSpace, LiveCounts};
use crate::{
    Call, CallCounts, Device, DeviceCaps, DeviceError, DeviceResult, Event, Introspect, MemInfo,
    PhysHandle, Rule, Stream, StreamModel, GIB, MIB,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Parameters of a simulated device; every one overridable.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Device name reported in [`DeviceCaps`].
    pub name: String,
    /// Device ordinal.
    pub ordinal: u32,
    /// Physical memory in bytes.
    pub capacity: u64,
    /// Allocation granularity (a power of two).
    pub granularity: u64,
    /// Modeled cost per call.
    pub cost: CostModel,
}

impl Default for SimConfig {
    /// An 80 GiB device with 2 MiB granularity (an H100 / A100-80GB).
    fn default() -> Self {
        SimConfig::with_capacity(80 * GIB)
    }
}

impl SimConfig {
    /// A device of `capacity` bytes, 2 MiB granularity, default costs.
    pub fn with_capacity(capacity: u64) -> Self {
        SimConfig {
            name: format!("sim ({} GiB)", capacity as f64 / GIB as f64),
            ordinal: 0,
            capacity,
            granularity: 2 * MIB,
            cost: CostModel::default(),
        }
    }
}

/// A simulated GPU.
#[derive(Debug)]
pub struct SimDevice {
    caps: DeviceCaps,
    cost: CostModel,
    space: Mutex<AddressSpace>,
    streams: StreamModel,
    counts: [AtomicU64; Call::COUNT],
    /// Modeled nanoseconds per call of each kind (`create` is charged by size).
    call_ns: [u64; Call::COUNT],
    /// Modeled time in nanoseconds.
    modeled_ns: AtomicU64,
    /// Fake exported descriptors: fd -> allocation id.
    exported: Mutex<HashMap<i32, u64>>,
    next_fd: AtomicU64,
}

impl SimDevice {
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

    /// A simulated device.
    pub fn new(config: SimConfig) -> Self {
        SimDevice {
            caps: DeviceCaps {
                name: config.name,
                ordinal: config.ordinal,
                granularity: config.granularity,
                total_memory: config.capacity,
                vmm_supported: true,
                posix_fd_handles: true,
                has_memory: false,
            },
            call_ns: std::array::from_fn(|i| Self::ns(&config.cost, Call::ALL[i], 0)),
            cost: config.cost,
            space: Mutex::new(AddressSpace::new(config.capacity, config.granularity)),
            streams: StreamModel::new(),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            modeled_ns: AtomicU64::new(0),
            exported: Mutex::new(HashMap::new()),
            next_fd: AtomicU64::new(1 << 20),
        }
    }

    /// A simulated device of `capacity` bytes with default parameters.
    pub fn with_capacity(capacity: u64) -> Self {
        Self::new(SimConfig::with_capacity(capacity))
    }

    fn ns(cost: &CostModel, call: Call, bytes: u64) -> u64 {
        (cost.cost_us(call, bytes) * 1000.0).round() as u64
    }

    fn charge(&self, call: Call, bytes: u64) {
        self.counts[call.index()].fetch_add(1, Ordering::Relaxed);
        let ns = if call == Call::Create {
            Self::ns(&self.cost, call, bytes)
        } else {
            self.call_ns[call.index()]
        };
        if ns > 0 {
            self.modeled_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// Calls made so far, per kind (failed calls included).
    pub fn counts(&self) -> CallCounts {
        let mut c = CallCounts::default();
        for (slot, n) in c.0.iter_mut().zip(self.counts.iter()) {
            *slot = n.load(Ordering::Relaxed);
        }
        c
    }

    /// Modeled driver time so far, in microseconds.
    pub fn modeled_us(&self) -> f64 {
        self.modeled_ns.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// Resets call counts and modeled time (not the address space).
    pub fn reset_counters(&self) {
        for n in &self.counts {
            n.store(0, Ordering::Relaxed);
        }
        self.modeled_ns.store(0, Ordering::Relaxed);
    }

    /// The cost model in use.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }
}

impl Device for SimDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        self.charge(Call::Reserve, size);
        let mut s = self.space.lock();
        let addr = s.find_free_va(size, align)?;
        s.reserve(addr, size, align)?;
        Ok(addr)
    }

    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.charge(Call::AddressFree, size);
        self.space.lock().free_reservation(addr, size)
    }

    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.charge(Call::Create, size);
        self.space.lock().create(size)
    }

    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        self.charge(Call::Release, 0);
        self.space.lock().release(handle).map(|_| ())
    }

    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.charge(Call::Map, size);
        self.space.lock().map(addr, size, handle)
    }

    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.charge(Call::Unmap, size);
        let mut s = self.space.lock();
        s.check_unmap(addr, size)?;
        if let Some(stream) = self.streams.pending_use(addr, size) {
            return Err(DeviceError::rule(
                Call::Unmap,
                Rule::InUseByStream,
                format!("[{addr:#x}, +{size:#x}) is used by queued work on {stream}"),
            ));
        }
        s.unmap(addr, size).map(|_| ())
    }

    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.charge(Call::SetAccess, size);
        self.space.lock().set_access(addr, size)
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.charge(Call::MemInfo, 0);
        let s = self.space.lock();
        Ok(MemInfo {
            free: s.free_bytes(),
            total: s.capacity(),
        })
    }

    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        self.charge(Call::Alloc, size);
        // cuMemAlloc is "potentially unsafe" during a capture (cuStreamBeginCapture docs).
        self.streams.check_unsafe_call(Call::Alloc)?;
        let mut s = self.space.lock();
        s.check_plain(size)?;
        let addr = s.find_plain_va(size)?;
        s.record_plain(addr, size)?;
        Ok(addr)
    }

    fn free(&self, ptr: u64) -> DeviceResult<()> {
        self.charge(Call::Free, 0);
        // cuMemFree synchronizes: forbidden during a (global-mode) capture.
        self.streams.check_unsafe_call(Call::Free)?;
        let mut s = self.space.lock();
        s.plain_size(ptr)?;
        // cuMemFree synchronizes implicitly: queued work finishes first.
        self.streams.complete_all();
        s.free_plain(ptr).map(|_| ())
    }

    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        self.charge(Call::Export, 0);
        let alloc = self.space.lock().allocation_of(Call::Export, handle)?;
        let fd = self.next_fd.fetch_add(1, Ordering::Relaxed) as i32;
        self.exported.lock().insert(fd, alloc);
        Ok(fd)
    }

    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        self.charge(Call::Import, 0);
        let alloc = self.exported.lock().get(&fd).copied().ok_or_else(|| {
            DeviceError::rule(
                Call::Import,
                Rule::UnknownShareableHandle,
                format!("fd {fd}"),
            )
        })?;
        self.space.lock().import(alloc)
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> DeviceResult<()> {
        self.charge(Call::CopyHtoD, src.len() as u64);
        self.space
            .lock()
            .check_accessible(Call::CopyHtoD, dst, src.len() as u64)?;
        Err(DeviceError::Unsupported {
            call: Call::CopyHtoD,
            what: "the sim device holds no bytes".into(),
        })
    }

    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()> {
        self.charge(Call::CopyDtoH, dst.len() as u64);
        self.space
            .lock()
            .check_accessible(Call::CopyDtoH, src, dst.len() as u64)?;
        Err(DeviceError::Unsupported {
            call: Call::CopyDtoH,
            what: "the sim device holds no bytes".into(),
        })
    }

    fn create_stream(&self) -> DeviceResult<Stream> {
        self.charge(Call::StreamCreate, 0);
        Ok(self.streams.create_stream())
    }

    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()> {
        self.charge(Call::StreamSync, 0);
        self.streams.complete(stream)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.charge(Call::DeviceSync, 0);
        // cuCtxSynchronize is forbidden during a (global-mode) capture.
        self.streams.check_unsafe_call(Call::DeviceSync)?;
        self.streams.complete_all();
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<Event> {
        self.charge(Call::EventCreate, 0);
        Ok(self.streams.create_event())
    }

    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        self.charge(Call::EventRecord, 0);
        self.streams.record(event, stream)
    }

    fn query_event(&self, event: Event) -> DeviceResult<bool> {
        self.charge(Call::EventQuery, 0);
        self.streams.query(event)
    }

    fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        self.charge(Call::EventSync, 0);
        self.streams.synchronize_event(event)
    }

    fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        self.charge(Call::EventDestroy, 0);
        self.streams.destroy_event(event)
    }

    fn is_capturing(&self, stream: Stream) -> DeviceResult<bool> {
        self.streams.is_capturing(stream)
    }

    fn introspect(&self) -> Option<&dyn Introspect> {
        Some(self)
    }
}

impl Introspect for SimDevice {
    fn is_accessible(&self, addr: u64, len: u64) -> bool {
        self.space.lock().is_accessible(addr, len)
    }
    fn live(&self) -> LiveCounts {
        self.space.lock().live()
    }
    fn check(&self) -> Result<(), String> {
        self.space.lock().check()
    }
    fn streams(&self) -> &StreamModel {
        &self.streams
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_a_141_gib_device_and_counts_calls() {
        let dev = SimDevice::with_capacity(141 * GIB);
        let g = dev.caps().granularity;
        let va = dev.reserve(200 * GIB, 0).unwrap();
        let mut handles = Vec::new();
        let pages = 141 * GIB / g;
        for i in 0..pages {
            let h = dev.create(g).unwrap();
            dev.map(va + i * g, g, h).unwrap();
            handles.push(h);
        }
        dev.set_access(va, pages * g).unwrap();
        assert!(dev.create(g).unwrap_err().is_out_of_memory());
        assert_eq!(dev.mem_info().unwrap().free, 0);
        dev.unmap(va, pages * g).unwrap();
        for h in handles {
            dev.release(h).unwrap();
        }
        dev.free_reservation(va, 200 * GIB).unwrap();
        let c = dev.counts();
        assert_eq!(c.get(Call::Create), pages + 1);
        assert_eq!(c.get(Call::Map), pages);
        assert_eq!(c.get(Call::SetAccess), 1);
        assert_eq!(c.get(Call::Unmap), 1);
        assert_eq!(c.get(Call::Release), pages);
        assert!(dev.live().is_empty());
        let expected =
            (pages + 1) as f64 * 50.0 + pages as f64 * (1.5 + 20.0) + 30.0 + 20.0 + 20.0 + 20.0;
        assert!(
            (dev.modeled_us() - expected).abs() < 1e-3,
            "{} vs {expected}",
            dev.modeled_us()
        );
    }
}
