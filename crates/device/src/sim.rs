//! The `sim` backend: bookkeeping and a cost model, no memory touched.
//!
//! A [`SimDevice`] holds an 80–192 GiB GPU in a few kilobytes: the shared
//! [`AddressSpace`] enforces the driver's rules, a [`StreamModel`] tracks queued
//! work, every call is counted per kind and charged from a [`CostModel`].

use crate::cost::{CallCost, CostModel};
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

/// What one call kind costs on a [`SimDevice`], resolved once.
#[derive(Debug, Clone, Copy, Default)]
struct Price {
    cost: CallCost,
    /// Nanoseconds when `cost` is flat.
    flat_ns: Option<u64>,
    second: Option<CallCost>,
    second_flat_ns: Option<u64>,
}

impl Price {
    fn of(cost: &CostModel, second: Option<&CostModel>, call: Call) -> Price {
        let flat = |c: &CallCost| {
            (c.per_mib_us == 0.0 && c.per_handle_us == 0.0).then(|| SimDevice::ns(c.fixed_us))
        };
        let c = *cost.of_call(call);
        let s = second.map(|m| *m.of_call(call));
        Price {
            cost: c,
            flat_ns: flat(&c),
            second: s,
            second_flat_ns: s.as_ref().and_then(flat),
        }
    }
}

/// A simulated GPU.
///
/// Every call is charged from the [`CostModel`] as `fixed + per_mib × MiB of
/// the call + per_handle × handles covered`: the handle's size for
/// `cuMemCreate` / `cuMemRelease`, the range for map / unmap / set access (the
/// address-space model counts the mappings an unmap or set-access covers), the
/// allocation for `cuMemAlloc` / `cuMemFree`. A second model may price the same
/// calls alongside ([`SimDevice::also_priced_by`]).
#[derive(Debug)]
pub struct SimDevice {
    caps: DeviceCaps,
    cost: CostModel,
    /// A second model pricing the same calls (e.g. `linear` beside `a100`).
    second: Option<CostModel>,
    space: Mutex<AddressSpace>,
    streams: StreamModel,
    counts: [AtomicU64; Call::COUNT],
    /// Modeled nanoseconds per call kind (the total is their sum).
    kind_ns: [AtomicU64; Call::COUNT],
    /// Modeled time in nanoseconds under the second model.
    second_ns: AtomicU64,
    /// Per call kind, its cost under the model and the second model, and
    /// its nanoseconds when the cost is flat (no per-MiB or per-handle part).
    prices: [Price; Call::COUNT],
    /// Whether an unmap or set-access needs the handles it covers counted
    /// (some model has a per-handle cost for it).
    count_handles: [bool; 2],
    /// Fake exported descriptors: fd -> allocation id.
    exported: Mutex<HashMap<i32, u64>>,
    next_fd: AtomicU64,
}

impl SimDevice {
    /// Limits host-located chunks ([`Device::create_on_host`], spill) to
    /// `bytes` in all (default: no limit).
    pub fn set_host_capacity(&self, bytes: u64) {
        self.space.lock().set_host_capacity(bytes);
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

    /// A simulated device.
    pub fn new(config: SimConfig) -> Self {
        let mut dev = SimDevice {
            caps: DeviceCaps {
                name: config.name,
                ordinal: config.ordinal,
                granularity: config.granularity,
                total_memory: config.capacity,
                vmm_supported: true,
                posix_fd_handles: true,
                has_memory: false,
            },
            cost: config.cost,
            second: None,
            space: Mutex::new(AddressSpace::new(config.capacity, config.granularity)),
            streams: StreamModel::new(),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            kind_ns: std::array::from_fn(|_| AtomicU64::new(0)),
            second_ns: AtomicU64::new(0),
            prices: [Price::default(); Call::COUNT],
            count_handles: [false; 2],
            exported: Mutex::new(HashMap::new()),
            next_fd: AtomicU64::new(1 << 20),
        };
        dev.update_handle_counting();
        dev
    }

    /// A simulated device of `capacity` bytes with default parameters.
    pub fn with_capacity(capacity: u64) -> Self {
        Self::new(SimConfig::with_capacity(capacity))
    }

    /// Also prices every call with `cost` (read with [`SimDevice::second_modeled_us`]).
    pub fn also_priced_by(mut self, cost: CostModel) -> Self {
        self.second = Some(cost);
        self.update_handle_counting();
        self
    }

    fn update_handle_counting(&mut self) {
        for (i, p) in self.prices.iter_mut().enumerate() {
            *p = Price::of(&self.cost, self.second.as_ref(), Call::ALL[i]);
        }
        let models = std::iter::once(&self.cost).chain(self.second.as_ref());
        let mut flags = [false; 2];
        for m in models {
            flags[0] |= m.unmap.per_handle_us != 0.0;
            flags[1] |= m.set_access.per_handle_us != 0.0;
        }
        self.count_handles = flags;
    }

    fn ns(us: f64) -> u64 {
        (us * 1000.0).round() as u64
    }

    /// Counts one call and charges it: `bytes` of the call, `handles` covered.
    #[inline]
    fn charge(&self, call: Call, bytes: u64, handles: u64) {
        let i = call.index();
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let p = &self.prices[i];
        let ns = p
            .flat_ns
            .unwrap_or_else(|| Self::ns(p.cost.of(bytes, handles)));
        if ns > 0 {
            self.kind_ns[i].fetch_add(ns, Ordering::Relaxed);
        }
        if let Some(second) = &p.second {
            let ns = p
                .second_flat_ns
                .unwrap_or_else(|| Self::ns(second.of(bytes, handles)));
            if ns > 0 {
                self.second_ns.fetch_add(ns, Ordering::Relaxed);
            }
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
        let ns: u64 = self.kind_ns.iter().map(|n| n.load(Ordering::Relaxed)).sum();
        ns as f64 / 1000.0
    }

    /// Modeled time of the calls of one kind so far, in microseconds.
    pub fn modeled_us_of(&self, call: Call) -> f64 {
        self.kind_ns[call.index()].load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// Modeled driver time so far under the second model
    /// ([`SimDevice::also_priced_by`]), in microseconds.
    pub fn second_modeled_us(&self) -> Option<f64> {
        self.second
            .as_ref()
            .map(|_| self.second_ns.load(Ordering::Relaxed) as f64 / 1000.0)
    }

    /// Resets call counts and modeled time (not the address space).
    pub fn reset_counters(&self) {
        for n in self.counts.iter().chain(&self.kind_ns) {
            n.store(0, Ordering::Relaxed);
        }
        self.second_ns.store(0, Ordering::Relaxed);
    }

    /// The cost model in use.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// The second cost model, if any.
    pub fn second_cost_model(&self) -> Option<&CostModel> {
        self.second.as_ref()
    }
}

impl Device for SimDevice {
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        self.charge(Call::Reserve, size, 0);
        let mut s = self.space.lock();
        let addr = s.find_free_va(size, align)?;
        s.reserve(addr, size, align)?;
        Ok(addr)
    }

    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.charge(Call::AddressFree, size, 0);
        self.space.lock().free_reservation(addr, size)
    }

    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.charge(Call::Create, size, 1);
        self.space.lock().create(size)
    }

    /// Charged as a `create` (the same entry point, `cuMemCreate`; no
    /// published measurement of host-located creation exists yet) and to
    /// the model's host limit ([`SimDevice::set_host_capacity`]).
    fn create_on_host(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.charge(Call::Create, size, 1);
        self.space.lock().create_on_host(size)
    }

    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        let mut s = self.space.lock();
        let bytes = s.handle_size(Call::Release, handle).unwrap_or(0);
        self.charge(Call::Release, bytes, 1);
        s.release(handle).map(|_| ())
    }

    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.charge(Call::Map, size, 1);
        self.space.lock().map(addr, size, handle)
    }

    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let mut s = self.space.lock();
        // A failed call is charged for the mappings it names (if some model
        // charges per handle); a valid one for the mappings it removed.
        let refuse = |s: &AddressSpace, e: DeviceError| {
            let handles = if self.count_handles[0] {
                s.mappings_covered(addr, size)
            } else {
                0
            };
            self.charge(Call::Unmap, size, handles);
            Err(e)
        };
        if let Err(e) = s.check_unmap(addr, size) {
            return refuse(&s, e);
        }
        if let Some(stream) = self.streams.pending_use(addr, size) {
            let e = DeviceError::rule(
                Call::Unmap,
                Rule::InUseByStream,
                format!("[{addr:#x}, +{size:#x}) is used by queued work on {stream}"),
            );
            return refuse(&s, e);
        }
        match s.unmap_counted(addr, size) {
            Ok((_, handles)) => {
                self.charge(Call::Unmap, size, handles);
                Ok(())
            }
            Err(e) => refuse(&s, e),
        }
    }

    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let mut s = self.space.lock();
        let handles = if self.count_handles[1] {
            s.mappings_covered(addr, size)
        } else {
            0
        };
        self.charge(Call::SetAccess, size, handles);
        s.set_access(addr, size)
    }

    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.charge(Call::MemInfo, 0, 0);
        let s = self.space.lock();
        Ok(MemInfo {
            free: s.free_bytes(),
            total: s.capacity(),
        })
    }

    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        self.charge(Call::Alloc, size, 1);
        // cuMemAlloc is "potentially unsafe" during a capture (cuStreamBeginCapture docs).
        self.streams.check_unsafe_call(Call::Alloc)?;
        let mut s = self.space.lock();
        s.check_plain(size)?;
        let addr = s.find_plain_va(size)?;
        s.record_plain(addr, size)?;
        Ok(addr)
    }

    fn free(&self, ptr: u64) -> DeviceResult<()> {
        // cuMemFree synchronizes: forbidden during a (global-mode) capture.
        if let Err(e) = self.streams.check_unsafe_call(Call::Free) {
            self.charge(Call::Free, 0, 1);
            return Err(e);
        }
        let mut s = self.space.lock();
        let size = s.plain_size(ptr);
        self.charge(Call::Free, *size.as_ref().unwrap_or(&0), 1);
        size?;
        // cuMemFree synchronizes implicitly: queued work finishes first.
        self.streams.complete_all();
        s.free_plain(ptr).map(|_| ())
    }

    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        self.charge(Call::Export, 0, 0);
        let alloc = self.space.lock().allocation_of(Call::Export, handle)?;
        let fd = self.next_fd.fetch_add(1, Ordering::Relaxed) as i32;
        self.exported.lock().insert(fd, alloc);
        Ok(fd)
    }

    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        self.charge(Call::Import, 0, 0);
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
        self.charge(Call::CopyHtoD, src.len() as u64, 0);
        self.space
            .lock()
            .check_accessible(Call::CopyHtoD, dst, src.len() as u64)?;
        Err(DeviceError::Unsupported {
            call: Call::CopyHtoD,
            what: "the sim device holds no bytes".into(),
        })
    }

    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()> {
        self.charge(Call::CopyDtoH, dst.len() as u64, 0);
        self.space
            .lock()
            .check_accessible(Call::CopyDtoH, src, dst.len() as u64)?;
        Err(DeviceError::Unsupported {
            call: Call::CopyDtoH,
            what: "the sim device holds no bytes".into(),
        })
    }

    fn copy_device(&self, dst: u64, src: u64, len: u64) -> DeviceResult<()> {
        self.charge(Call::CopyDtoD, len, 0);
        let space = self.space.lock();
        space.check_accessible(Call::CopyDtoD, src, len)?;
        space.check_accessible(Call::CopyDtoD, dst, len)?;
        Err(DeviceError::Unsupported {
            call: Call::CopyDtoD,
            what: "the sim device holds no bytes".into(),
        })
    }

    fn create_stream(&self) -> DeviceResult<Stream> {
        self.charge(Call::StreamCreate, 0, 0);
        Ok(self.streams.create_stream())
    }

    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()> {
        self.charge(Call::StreamSync, 0, 0);
        self.streams.complete(stream)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.charge(Call::DeviceSync, 0, 0);
        // cuCtxSynchronize is forbidden during a (global-mode) capture.
        self.streams.check_unsafe_call(Call::DeviceSync)?;
        self.streams.complete_all();
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<Event> {
        self.charge(Call::EventCreate, 0, 0);
        Ok(self.streams.create_event())
    }

    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        self.charge(Call::EventRecord, 0, 0);
        self.streams.record(event, stream)
    }

    fn query_event(&self, event: Event) -> DeviceResult<bool> {
        self.charge(Call::EventQuery, 0, 0);
        self.streams.query(event)
    }

    fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        self.charge(Call::EventSync, 0, 0);
        self.streams.synchronize_event(event)
    }

    fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        self.charge(Call::EventDestroy, 0, 0);
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
        let dev = SimDevice::new(SimConfig {
            cost: CostModel::linear(),
            ..SimConfig::with_capacity(141 * GIB)
        })
        .also_priced_by(CostModel::a100());
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
        // The same calls under a100: create 193 + 0.7/MiB, map 1.45, one set
        // access 36, one unmap over every page at 25.6 per handle.
        let p = pages as f64;
        let a100 = (p + 1.0) * (193.0 + 1.4) + p * (1.45 + 25.6 + 20.0) + 36.0 + 19.0 + 20.0;
        let second = dev.second_modeled_us().unwrap();
        assert!((second - a100).abs() < 1e-2, "{second} vs {a100}");
        let create = dev.modeled_us_of(Call::Create);
        assert!((create - (p + 1.0) * 50.0).abs() < 1e-3, "{create}");
    }

    #[test]
    fn a100_charges_per_handle_and_per_mib() {
        assert_eq!(
            *SimDevice::with_capacity(8 * GIB).cost_model(),
            CostModel::h200(),
            "the default"
        );
        let dev = SimDevice::new(SimConfig {
            cost: CostModel::a100(),
            ..SimConfig::with_capacity(8 * GIB)
        });
        assert_eq!(*dev.cost_model(), CostModel::a100());
        assert!(dev.second_modeled_us().is_none());
        let va = dev.reserve(GIB, 0).unwrap();
        // Ten 2 MiB handles and one 20 MiB handle: same bytes, 10x the handles.
        let small: Vec<_> = (0..10).map(|_| dev.create(2 * MIB).unwrap()).collect();
        let big = dev.create(20 * MIB).unwrap();
        let create = dev.modeled_us_of(Call::Create);
        assert!((create - (10.0 * 194.4 + 207.0)).abs() < 1e-3, "{create}");
        for (i, h) in small.iter().enumerate() {
            dev.map(va + i as u64 * 2 * MIB, 2 * MIB, *h).unwrap();
        }
        dev.map(va + 20 * MIB, 20 * MIB, big).unwrap();
        dev.set_access(va, 40 * MIB).unwrap();
        dev.reset_counters();
        assert_eq!(dev.modeled_us(), 0.0);
        dev.unmap(va, 20 * MIB).unwrap();
        let ten = dev.modeled_us_of(Call::Unmap);
        dev.unmap(va + 20 * MIB, 20 * MIB).unwrap();
        let one = dev.modeled_us_of(Call::Unmap) - ten;
        assert!((ten - 256.0).abs() < 1e-3, "{ten}");
        assert!((one - 25.6).abs() < 1e-3, "{one}");
        // A failed unmap covers nothing.
        assert!(dev.unmap(va, 2 * MIB).is_err());
        assert!((dev.modeled_us_of(Call::Unmap) - 281.6).abs() < 1e-3);
        for h in small.into_iter().chain([big]) {
            dev.release(h).unwrap();
        }
        assert!((dev.modeled_us_of(Call::Release) - 220.0).abs() < 1e-3);
        // cuMemAlloc of 20 MiB = create + map + set access; cuMemFree = unmap + release + sync.
        dev.reset_counters();
        let p = dev.alloc(20 * MIB).unwrap();
        dev.free(p).unwrap();
        let alloc = dev.modeled_us_of(Call::Alloc);
        assert!((alloc - (207.0 + 1.45 + 36.0)).abs() < 1e-3, "{alloc}");
        assert!((dev.modeled_us_of(Call::Free) - 95.6).abs() < 1e-3);
        dev.free_reservation(va, GIB).unwrap();
        assert!(dev.live().is_empty());
    }
}
