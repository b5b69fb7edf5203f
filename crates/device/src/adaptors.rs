//! Adaptors that wrap any [`Device`] and do one thing each (as RMM's resource
//! adaptors do): fault injection, call counting / logging, capacity limit.
//!
//! [`Hooked`] runs a [`CallHook`] before and after every call; [`FaultInjector`]
//! and [`CallLog`] are hooks. [`CapacityLimit`] is its own wrapper because it
//! needs handle sizes.

use crate::{
    Call, CallCounts, Device, DeviceCaps, DeviceError, DeviceResult, Event, HostBuffer,
    IpcMemHandle, MemInfo, PhysHandle, Stream,
};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Code run around every call of a [`Hooked`] device.
pub trait CallHook: Send + Sync {
    /// Runs before the call; an error is returned instead of making the call.
    fn before(&self, call: Call, bytes: u64) -> DeviceResult<()> {
        let _ = (call, bytes);
        Ok(())
    }
    /// Runs after the call was made (not when `before` failed).
    fn after(&self, call: Call, bytes: u64, result: Result<(), &DeviceError>) {
        let _ = (call, bytes, result);
    }
    /// Runs after a call that acted on an address range succeeded, with that
    /// range: `reserve` (the returned address), `free_reservation`, `map`,
    /// `unmap`, `set_access`, `alloc` (the returned pointer and its size) and
    /// `free` (the pointer; size 0, the caller knows it). Lets a hook follow
    /// the address space, e.g. to report segment map / unmap events.
    fn on_range(&self, call: Call, addr: u64, size: u64) {
        let _ = (call, addr, size);
    }
}

/// A device with a hook around every call.
#[derive(Debug)]
pub struct Hooked<D, H> {
    inner: D,
    hook: H,
}

impl<D: Device, H: CallHook> Hooked<D, H> {
    /// Wraps `inner` with `hook`.
    pub fn new(inner: D, hook: H) -> Self {
        Hooked { inner, hook }
    }
    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }
    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }
    fn run<T>(
        &self,
        call: Call,
        bytes: u64,
        f: impl FnOnce(&D) -> DeviceResult<T>,
    ) -> DeviceResult<T> {
        self.hook.before(call, bytes)?;
        let r = f(&self.inner);
        self.hook.after(call, bytes, r.as_ref().map(|_| ()));
        r
    }

    /// [`Hooked::run`] for a call on `[addr, addr+size)`: tells the hook the
    /// range when it succeeded.
    fn run_range(
        &self,
        call: Call,
        addr: u64,
        size: u64,
        f: impl FnOnce(&D) -> DeviceResult<()>,
    ) -> DeviceResult<()> {
        self.run(call, size, f)?;
        self.hook.on_range(call, addr, size);
        Ok(())
    }
}

impl<D: Device, H: CallHook> Device for Hooked<D, H> {
    // Not driver calls the hook counts: the caps were queried at open,
    // capture status and the model are questions, not work.
    crate::forward_device_calls!(inner: caps, is_capturing, introspect);
    fn reserve(&self, size: u64, align: u64) -> DeviceResult<u64> {
        let addr = self.run(Call::Reserve, size, |d| d.reserve(size, align))?;
        self.hook.on_range(Call::Reserve, addr, size);
        Ok(addr)
    }
    fn free_reservation(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.run_range(Call::AddressFree, addr, size, |d| {
            d.free_reservation(addr, size)
        })
    }
    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.run(Call::Create, size, |d| d.create(size))
    }
    /// Hooked as a `create` (the same driver entry point, `cuMemCreate`).
    fn create_on_host(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.run(Call::Create, size, |d| d.create_on_host(size))
    }
    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        self.run(Call::Release, 0, |d| d.release(handle))
    }
    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.run_range(Call::Map, addr, size, |d| d.map(addr, size, handle))
    }
    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.run_range(Call::Unmap, addr, size, |d| d.unmap(addr, size))
    }
    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.run_range(Call::SetAccess, addr, size, |d| d.set_access(addr, size))
    }
    fn mem_info(&self) -> DeviceResult<MemInfo> {
        self.run(Call::MemInfo, 0, |d| d.mem_info())
    }
    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        let ptr = self.run(Call::Alloc, size, |d| d.alloc(size))?;
        self.hook.on_range(Call::Alloc, ptr, size);
        Ok(ptr)
    }
    fn free(&self, ptr: u64) -> DeviceResult<()> {
        self.run_range(Call::Free, ptr, 0, |d| d.free(ptr))
    }
    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        self.run(Call::Export, 0, |d| d.export_fd(handle))
    }
    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        self.run(Call::Import, 0, |d| d.import_fd(fd))
    }
    fn copy_to_device(&self, dst: u64, src: &[u8]) -> DeviceResult<()> {
        self.run(Call::CopyHtoD, src.len() as u64, |d| {
            d.copy_to_device(dst, src)
        })
    }
    fn copy_from_device(&self, src: u64, dst: &mut [u8]) -> DeviceResult<()> {
        let n = dst.len() as u64;
        self.run(Call::CopyDtoH, n, |d| d.copy_from_device(src, dst))
    }
    fn copy_device(&self, dst: u64, src: u64, len: u64) -> DeviceResult<()> {
        self.run_range(Call::CopyDtoD, dst, len, |d| d.copy_device(dst, src, len))
    }
    fn alloc_host_buffer(&self, len: u64) -> DeviceResult<HostBuffer> {
        self.run(Call::HostAlloc, len, |d| d.alloc_host_buffer(len))
    }
    fn create_stream(&self) -> DeviceResult<Stream> {
        self.run(Call::StreamCreate, 0, |d| d.create_stream())
    }
    fn synchronize_stream(&self, stream: Stream) -> DeviceResult<()> {
        self.run(Call::StreamSync, 0, |d| d.synchronize_stream(stream))
    }
    fn synchronize(&self) -> DeviceResult<()> {
        self.run(Call::DeviceSync, 0, |d| d.synchronize())
    }
    fn create_event(&self) -> DeviceResult<Event> {
        self.run(Call::EventCreate, 0, |d| d.create_event())
    }
    fn record_event(&self, event: Event, stream: Stream) -> DeviceResult<()> {
        self.run(Call::EventRecord, 0, |d| d.record_event(event, stream))
    }
    fn query_event(&self, event: Event) -> DeviceResult<bool> {
        self.run(Call::EventQuery, 0, |d| d.query_event(event))
    }
    fn synchronize_event(&self, event: Event) -> DeviceResult<()> {
        self.run(Call::EventSync, 0, |d| d.synchronize_event(event))
    }
    fn destroy_event(&self, event: Event) -> DeviceResult<()> {
        self.run(Call::EventDestroy, 0, |d| d.destroy_event(event))
    }
    fn ipc_open(&self, handle: &IpcMemHandle) -> DeviceResult<u64> {
        self.run(Call::IpcOpen, 0, |d| d.ipc_open(handle))
    }
    fn ipc_close(&self, ptr: u64) -> DeviceResult<()> {
        self.run(Call::IpcClose, 0, |d| d.ipc_close(ptr))
    }
}

/// The error an injected fault produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `CUDA_ERROR_OUT_OF_MEMORY` (recoverable).
    OutOfMemory,
    /// Any other driver code (e.g. 999 `CUDA_ERROR_UNKNOWN`).
    Driver(u32),
    /// No error: the call panics (`injected panic in <call>`), standing in
    /// for a bug in the code around a device call (tests of panic safety).
    Panic,
}

/// When to fail.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultPlan {
    /// Fail exactly the `n`th call (1-based) of `call`, once.
    Nth {
        /// The kind of call.
        call: Call,
        /// Which one (1 = the first).
        n: u64,
        /// The error to return.
        kind: FaultKind,
    },
    /// Fail each call of the listed kinds with probability `p`, from a seeded generator.
    Random {
        /// Kinds that may fail (empty = every kind).
        calls: Vec<Call>,
        /// Probability of failure per call.
        p: f64,
        /// Seed of the generator.
        seed: u64,
        /// The error to return.
        kind: FaultKind,
    },
    /// Never fail.
    None,
}

/// A hook that fails calls according to a [`FaultPlan`].
#[derive(Debug)]
pub struct FaultInjector {
    plan: Mutex<FaultPlan>,
    seen: [AtomicU64; Call::COUNT],
    injected: AtomicU64,
    rng: Mutex<ChaCha8Rng>,
}

impl FaultInjector {
    /// A fault injector following `plan`.
    pub fn new(plan: FaultPlan) -> Self {
        let seed = match &plan {
            FaultPlan::Random { seed, .. } => *seed,
            _ => 0,
        };
        FaultInjector {
            plan: Mutex::new(plan),
            seen: std::array::from_fn(|_| AtomicU64::new(0)),
            injected: AtomicU64::new(0),
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
        }
    }
    /// Replaces the plan (counts of calls seen are kept).
    pub fn set_plan(&self, plan: FaultPlan) {
        if let FaultPlan::Random { seed, .. } = &plan {
            *self.rng.lock() = ChaCha8Rng::seed_from_u64(*seed);
        }
        *self.plan.lock() = plan;
    }
    /// Number of faults delivered so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
    /// Calls of a kind seen so far (including failed ones).
    pub fn seen(&self, call: Call) -> u64 {
        self.seen[call.index()].load(Ordering::Relaxed)
    }
    fn error(call: Call, bytes: u64, kind: FaultKind) -> DeviceError {
        match kind {
            FaultKind::OutOfMemory => DeviceError::OutOfMemory {
                call,
                requested: bytes,
                free: 0,
                total: 0,
            },
            FaultKind::Driver(code) => DeviceError::Driver {
                call,
                code,
                name: "injected".into(),
                detail: "fault injected by FaultInjector".into(),
            },
            FaultKind::Panic => panic!("injected panic in {call}"),
        }
    }
}

impl CallHook for FaultInjector {
    fn before(&self, call: Call, bytes: u64) -> DeviceResult<()> {
        let n = self.seen[call.index()].fetch_add(1, Ordering::Relaxed) + 1;
        let fail = match &*self.plan.lock() {
            FaultPlan::Nth {
                call: c,
                n: at,
                kind,
            } if *c == call && *at == n => Some(*kind),
            FaultPlan::Random { calls, p, kind, .. }
                if calls.is_empty() || calls.contains(&call) =>
            {
                self.rng.lock().gen_bool(p.clamp(0.0, 1.0)).then_some(*kind)
            }
            _ => None,
        };
        match fail {
            Some(kind) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                Err(Self::error(call, bytes, kind))
            }
            None => Ok(()),
        }
    }
}

/// A device that fails calls according to a plan.
pub type FaultInjecting<D> = Hooked<D, FaultInjector>;

impl<D: Device> FaultInjecting<D> {
    /// Wraps `inner` with a fault plan.
    pub fn with_plan(inner: D, plan: FaultPlan) -> Self {
        Hooked::new(inner, FaultInjector::new(plan))
    }
}

/// One logged call.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedCall {
    /// The kind.
    pub call: Call,
    /// Size argument, where the call has one.
    pub bytes: u64,
    /// Whether it succeeded.
    pub ok: bool,
}

/// A hook that counts every call per kind (attempts and failures) and optionally logs them.
#[derive(Debug, Default)]
pub struct CallLog {
    counts: [AtomicU64; Call::COUNT],
    failures: AtomicU64,
    log: Option<Mutex<Vec<LoggedCall>>>,
}

impl CallLog {
    /// Counts only.
    pub fn counting() -> Self {
        CallLog::default()
    }
    /// Counts and keeps every call in order.
    pub fn logging() -> Self {
        CallLog {
            log: Some(Mutex::new(Vec::new())),
            ..CallLog::default()
        }
    }
    /// Calls made per kind.
    pub fn counts(&self) -> CallCounts {
        let mut c = CallCounts::default();
        for (slot, n) in c.0.iter_mut().zip(self.counts.iter()) {
            *slot = n.load(Ordering::Relaxed);
        }
        c
    }
    /// Calls that returned an error.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
    /// The calls logged so far (empty unless created with [`CallLog::logging`]).
    pub fn entries(&self) -> Vec<LoggedCall> {
        self.log
            .as_ref()
            .map(|l| l.lock().clone())
            .unwrap_or_default()
    }
    /// The log as CSV (`call,bytes,ok`), in the spirit of RMM's logging adaptor.
    pub fn to_csv(&self) -> String {
        let mut s = String::from("call,bytes,ok\n");
        for e in self.entries() {
            s.push_str(&format!("{},{},{}\n", e.call, e.bytes, e.ok));
        }
        s
    }
}

impl CallHook for CallLog {
    fn after(&self, call: Call, bytes: u64, result: Result<(), &DeviceError>) {
        self.counts[call.index()].fetch_add(1, Ordering::Relaxed);
        if result.is_err() {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(log) = &self.log {
            log.lock().push(LoggedCall {
                call,
                bytes,
                ok: result.is_ok(),
            });
        }
    }
}

/// A device that counts (and optionally logs) its calls.
pub type Counting<D> = Hooked<D, CallLog>;

impl<D: Device> Counting<D> {
    /// Wraps `inner`, counting calls.
    pub fn counting(inner: D) -> Self {
        Hooked::new(inner, CallLog::counting())
    }
}

/// A device whose physical memory (handles + plain allocations) is limited to
/// `limit` bytes: creates and allocs beyond it fail with out-of-memory, and
/// [`Device::mem_info`] reports the limit.
#[derive(Debug)]
pub struct CapacityLimit<D> {
    inner: D,
    limit: u64,
    caps: DeviceCaps,
    state: Mutex<LimitState>,
}

/// A charged physical allocation: its size and holders (handles + mappings).
#[derive(Debug)]
struct Charge {
    size: u64,
    refs: u32,
}

/// Invariant: `used` = sizes of `charges` + sizes of `plain`. An allocation is
/// credited back when its last handle is released and its last mapping is gone
/// (as the driver frees physical memory); handles imported from descriptors this
/// adaptor exported share their exporter's charge.
#[derive(Debug, Default)]
struct LimitState {
    used: u64,
    /// charge id (the creating handle) -> charge
    charges: HashMap<u64, Charge>,
    /// handle -> charge id
    handles: HashMap<u64, u64>,
    /// mapping start -> charge id
    mappings: std::collections::BTreeMap<u64, u64>,
    /// exported descriptor -> charge id
    exported: HashMap<i32, u64>,
    plain: HashMap<u64, u64>,
}

impl LimitState {
    fn drop_ref(&mut self, charge: u64) {
        if let Some(c) = self.charges.get_mut(&charge) {
            c.refs -= 1;
            if c.refs == 0 {
                self.used -= c.size;
                self.charges.remove(&charge);
            }
        }
    }
    fn add_ref(&mut self, charge: u64) {
        if let Some(c) = self.charges.get_mut(&charge) {
            c.refs += 1;
        }
    }
}

impl<D: Device> CapacityLimit<D> {
    /// Wraps `inner` with a limit of `limit` bytes.
    pub fn new(inner: D, limit: u64) -> Self {
        let mut caps = inner.caps().clone();
        caps.total_memory = caps.total_memory.min(limit);
        CapacityLimit {
            inner,
            limit,
            caps,
            state: Mutex::new(LimitState::default()),
        }
    }
    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }
    /// Bytes charged against the limit.
    pub fn used(&self) -> u64 {
        self.state.lock().used
    }
    fn charge(&self, call: Call, size: u64) -> DeviceResult<()> {
        let mut s = self.state.lock();
        if s.used + size > self.limit {
            return Err(DeviceError::OutOfMemory {
                call,
                requested: size,
                free: self.limit - s.used,
                total: self.limit,
            });
        }
        s.used += size;
        Ok(())
    }
    fn uncharge(&self, size: u64) {
        self.state.lock().used -= size;
    }
}

impl<D: Device> Device for CapacityLimit<D> {
    // Address space, access, copies, streams and events cost no physical
    // memory; host memory (`create_on_host`, `alloc_host_buffer`) is not
    // device capacity, nor is another process's memory opened by a legacy
    // IPC handle (`ipc_open`): all forwarded uncharged.
    crate::forward_device_calls!(inner: reserve, free_reservation, set_access, copy_to_device,
        copy_from_device, copy_device, alloc_host_buffer, create_stream, synchronize_stream,
        synchronize, create_event, record_event, query_event, synchronize_event, destroy_event,
        is_capturing, create_on_host, ipc_open, ipc_close, introspect);
    fn caps(&self) -> &DeviceCaps {
        &self.caps
    }
    fn create(&self, size: u64) -> DeviceResult<PhysHandle> {
        self.charge(Call::Create, size)?;
        match self.inner.create(size) {
            Ok(h) => {
                let mut s = self.state.lock();
                s.charges.insert(h.0, Charge { size, refs: 1 });
                s.handles.insert(h.0, h.0);
                Ok(h)
            }
            Err(e) => {
                self.uncharge(size);
                Err(e)
            }
        }
    }
    /// Releases the handle; the limit is credited once its last mapping is gone too.
    fn release(&self, handle: PhysHandle) -> DeviceResult<()> {
        self.inner.release(handle)?;
        let mut s = self.state.lock();
        if let Some(c) = s.handles.remove(&handle.0) {
            s.drop_ref(c);
        }
        Ok(())
    }
    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.inner.map(addr, size, handle)?;
        let mut s = self.state.lock();
        if let Some(&c) = s.handles.get(&handle.0) {
            s.add_ref(c);
            s.mappings.insert(addr, c);
        }
        Ok(())
    }
    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        self.inner.unmap(addr, size)?;
        let mut s = self.state.lock();
        let gone: Vec<(u64, u64)> = s
            .mappings
            .range(addr..addr.saturating_add(size))
            .map(|(&a, &c)| (a, c))
            .collect();
        for (a, c) in gone {
            s.mappings.remove(&a);
            s.drop_ref(c);
        }
        Ok(())
    }
    fn mem_info(&self) -> DeviceResult<MemInfo> {
        let inner = self.inner.mem_info()?;
        let used = self.used();
        let free = (self.limit - used).min(inner.free);
        Ok(MemInfo {
            free,
            total: self.limit.min(inner.total),
        })
    }
    fn alloc(&self, size: u64) -> DeviceResult<u64> {
        let charged = crate::round_up(size.max(1), crate::model::PLAIN_ALLOC_UNIT);
        self.charge(Call::Alloc, charged)?;
        match self.inner.alloc(size) {
            Ok(p) => {
                self.state.lock().plain.insert(p, charged);
                Ok(p)
            }
            Err(e) => {
                self.uncharge(charged);
                Err(e)
            }
        }
    }
    fn free(&self, ptr: u64) -> DeviceResult<()> {
        self.inner.free(ptr)?;
        let mut s = self.state.lock();
        if let Some(size) = s.plain.remove(&ptr) {
            s.used -= size;
        }
        Ok(())
    }
    fn export_fd(&self, handle: PhysHandle) -> DeviceResult<i32> {
        let fd = self.inner.export_fd(handle)?;
        let mut s = self.state.lock();
        if let Some(&c) = s.handles.get(&handle.0) {
            s.exported.insert(fd, c);
        }
        Ok(fd)
    }
    fn import_fd(&self, fd: i32) -> DeviceResult<PhysHandle> {
        let h = self.inner.import_fd(fd)?;
        let mut s = self.state.lock();
        if let Some(&c) = s.exported.get(&fd) {
            if s.charges.contains_key(&c) {
                s.add_ref(c);
                s.handles.insert(h.0, c);
            }
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimDevice;
    use crate::Introspect;
    use crate::{GIB, MIB};

    #[derive(Default)]
    struct Ranges(parking_lot::Mutex<Vec<(Call, u64, u64)>>);
    impl CallHook for Ranges {
        fn on_range(&self, call: Call, addr: u64, size: u64) {
            self.0.lock().push((call, addr, size));
        }
    }

    #[test]
    fn on_range_reports_each_successful_range_call() {
        let dev = Hooked::new(SimDevice::with_capacity(GIB), Ranges::default());
        let va = dev.reserve(64 * MIB, 0).unwrap();
        let h = dev.create(2 * MIB).unwrap();
        dev.map(va, 2 * MIB, h).unwrap();
        dev.set_access(va, 2 * MIB).unwrap();
        assert!(
            dev.unmap(va + 2 * MIB, 2 * MIB).is_err(),
            "nothing mapped there"
        );
        dev.unmap(va, 2 * MIB).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 64 * MIB).unwrap();
        let p = dev.alloc(3 * MIB).unwrap();
        dev.free(p).unwrap();
        assert_eq!(
            *dev.hook().0.lock(),
            [
                (Call::Reserve, va, 64 * MIB),
                (Call::Map, va, 2 * MIB),
                (Call::SetAccess, va, 2 * MIB),
                (Call::Unmap, va, 2 * MIB),
                (Call::AddressFree, va, 64 * MIB),
                (Call::Alloc, p, 3 * MIB),
                (Call::Free, p, 0),
            ]
        );
    }

    #[test]
    fn nth_call_fails_exactly_once_at_the_right_call() {
        let dev = FaultInjecting::with_plan(
            SimDevice::with_capacity(GIB),
            FaultPlan::Nth {
                call: Call::Create,
                n: 3,
                kind: FaultKind::Driver(999),
            },
        );
        let mut results = Vec::new();
        for _ in 0..6 {
            results.push(dev.create(2 * MIB));
        }
        let failed: Vec<usize> = results
            .iter()
            .enumerate()
            .filter(|r| r.1.is_err())
            .map(|r| r.0)
            .collect();
        assert_eq!(failed, vec![2]);
        assert_eq!(results[2].as_ref().unwrap_err().cuda_code(), 999);
        assert_eq!(dev.hook().injected(), 1);
        // Other kinds are not affected.
        assert!(dev.reserve(2 * MIB, 0).is_ok());
        assert_eq!(dev.inner().live().handles, 5);
    }

    #[test]
    fn random_faults_are_reproducible_by_seed() {
        let run = |seed| {
            let dev = FaultInjecting::with_plan(
                SimDevice::with_capacity(GIB),
                FaultPlan::Random {
                    calls: vec![Call::Create],
                    p: 0.3,
                    seed,
                    kind: FaultKind::OutOfMemory,
                },
            );
            (0..100)
                .map(|_| dev.create(2 * MIB).is_ok())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let fails = run(7).iter().filter(|ok| !**ok).count();
        assert!((10..60).contains(&fails), "{fails}");
    }

    #[test]
    fn counting_counts_attempts_and_failures() {
        let dev = Counting::new(SimDevice::with_capacity(4 * MIB), CallLog::logging());
        let a = dev.create(2 * MIB).unwrap();
        let _b = dev.create(2 * MIB).unwrap();
        assert!(dev.create(2 * MIB).is_err());
        dev.release(a).unwrap();
        let c = dev.hook().counts();
        assert_eq!(c.get(Call::Create), 3);
        assert_eq!(c.get(Call::Release), 1);
        assert_eq!(dev.hook().failures(), 1);
        assert_eq!(dev.hook().entries().len(), 4);
        assert!(dev.hook().to_csv().contains("create,2097152,false"));
    }

    #[test]
    fn capacity_limit_fails_create_and_alloc_beyond_the_limit() {
        let dev = CapacityLimit::new(SimDevice::with_capacity(GIB), 6 * MIB);
        let a = dev.create(4 * MIB).unwrap();
        let e = dev.create(4 * MIB).unwrap_err();
        assert!(e.is_out_of_memory());
        let p = dev.alloc(MIB).unwrap();
        assert!(dev.alloc(2 * MIB).unwrap_err().is_out_of_memory());
        assert_eq!(dev.mem_info().unwrap().free, MIB);
        dev.release(a).unwrap();
        dev.free(p).unwrap();
        assert_eq!(dev.used(), 0);
        assert!(dev.inner().live().is_empty());
    }

    #[test]
    fn capacity_limit_credits_a_mapped_handle_at_its_last_unmap() {
        let dev = CapacityLimit::new(SimDevice::with_capacity(GIB), 8 * MIB);
        assert_eq!(dev.caps().total_memory, 8 * MIB);
        let va = dev.reserve(8 * MIB, 0).unwrap();
        let h = dev.create(4 * MIB).unwrap();
        dev.map(va, 4 * MIB, h).unwrap();
        dev.release(h).unwrap();
        assert_eq!(dev.used(), 4 * MIB, "still mapped: still charged");
        dev.unmap(va, 4 * MIB).unwrap();
        assert_eq!(dev.used(), 0);
        dev.free_reservation(va, 8 * MIB).unwrap();
        assert!(dev.inner().live().is_empty());
    }

    #[test]
    fn capacity_limit_passes_the_conformance_suite() {
        let dev = CapacityLimit::new(SimDevice::with_capacity(256 * MIB), 128 * MIB);
        crate::conformance::run_all(&dev).unwrap();
    }
}
