//! The fake driver's state: devices (one [`HostDevice`] each), primary
//! contexts, the calling thread's context stack, and the tables that turn
//! the driver's process-wide values (allocation handles, streams, events,
//! addresses) into a device and that device's own identifiers.
//!
//! Invariants:
//! - every table entry names the [`HostDevice`] that made the object (an
//!   `Arc`, so a value from a destroyed context reaches the dead device and
//!   fails there, never a new object that happens to reuse an identifier);
//! - allocation handle, stream and event values are never reused;
//! - `reservations` and `plain` hold exactly the live ranges made through the
//!   fake, with the device that owns each.

use crate::config::Config;
use crate::{Fail, Res};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use vmm_sys::{
    CUresult, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_NOT_INITIALIZED,
};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::model::LiveCounts;
use vmmalloc_device::{Event, Introspect, PhysHandle, Rule, Stream};

/// The initialized driver (set by the first successful `cuInit`).
static FAKE: OnceLock<Fake> = OnceLock::new();

thread_local! {
    /// The calling thread's context stack; the top is the current context
    /// (cuda.h, "Context Management": every CPU thread has a stack of current
    /// contexts).
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The driver, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn fake() -> Res<&'static Fake> {
    FAKE.get().ok_or_else(|| {
        Fail::new(
            CUDA_ERROR_NOT_INITIALIZED,
            "cuInit has not been called (or failed)",
        )
    })
}

/// Initializes the driver with `config` (once; later calls keep the first).
pub fn init(config: &Config) -> Res<&'static Fake> {
    if let Some(f) = FAKE.get() {
        return Ok(f);
    }
    let made = Fake::new(config.clone())?;
    Ok(FAKE.get_or_init(|| made))
}

/// The calling thread's current context value: the top of its stack (0 = none).
pub fn current_context() -> usize {
    STACK.with(|s| s.borrow().last().copied().unwrap_or(0))
}

/// `cuCtxSetCurrent` semantics: replaces the top of the calling thread's
/// stack with `ctx` (pushes it on an empty stack); null pops the top (a no-op
/// on an empty stack).
pub fn set_current_context(ctx: usize) {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        match (ctx, s.last_mut()) {
            (0, _) => {
                s.pop();
            }
            (c, Some(top)) => *top = c,
            (c, None) => s.push(c),
        }
    });
}

/// `cuCtxPushCurrent`: pushes `ctx` (non-null) on the calling thread's stack.
pub fn push_context(ctx: usize) {
    STACK.with(|s| s.borrow_mut().push(ctx));
}

/// `cuCtxPopCurrent`: pops the calling thread's current context, if any.
pub fn pop_context() -> Option<usize> {
    STACK.with(|s| s.borrow_mut().pop())
}

/// Depth of the calling thread's context stack (`fakeCudaContextDepth`).
pub fn context_depth() -> usize {
    STACK.with(|s| s.borrow().len())
}

/// First value handed out for a stream (streams are spaced by 0x10).
const STREAM_BASE: u64 = 0x5000_0000_0010;
/// First value handed out for an event.
const EVENT_BASE: u64 = 0xe000_0000_0010;
/// First allocation handle value.
const HANDLE_BASE: u64 = 0x1000_0001;

/// `CU_STREAM_LEGACY`: the legacy default stream, by value.
pub const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the per-thread default stream, by value.
pub const CU_STREAM_PER_THREAD: usize = 0x2;

/// A physical allocation handle handed out by `cuMemCreate` or an import.
#[derive(Debug, Clone)]
pub struct HandleEntry {
    /// Ordinal of the device holding the memory.
    pub dev: usize,
    /// That device.
    pub host: Arc<HostDevice>,
    /// The device's own handle.
    pub inner: PhysHandle,
    /// Whether it may be exported as a POSIX file descriptor.
    pub posix_fd: bool,
    /// Whether it may be exported as a fabric handle.
    pub fabric: bool,
}

/// A virtual range (reservation or plain allocation) and its device.
#[derive(Debug, Clone)]
struct Range {
    len: u64,
    dev: usize,
    host: Arc<HostDevice>,
}

/// First value handed out for a captured graph (graphs are not modelled).
const GRAPH_BASE: u64 = 0x6000_0000_0010;

/// A stream or event and its device.
#[derive(Debug, Clone)]
pub struct Owned<T> {
    /// Ordinal of the device.
    pub dev: usize,
    /// That device.
    pub host: Arc<HostDevice>,
    /// The device's own identifier.
    pub inner: T,
}

#[derive(Debug, Default)]
struct Tables {
    next_handle: u64,
    handles: HashMap<u64, HandleEntry>,
    /// start -> range.
    reservations: BTreeMap<u64, Range>,
    /// start -> range (the requested size).
    plain: BTreeMap<u64, Range>,
    next_stream: u64,
    streams: HashMap<u64, Owned<Stream>>,
    next_event: u64,
    events: HashMap<u64, Owned<Event>>,
    /// Streams created without `CU_STREAM_NON_BLOCKING` (they synchronize
    /// with the legacy default stream), by `CUstream` value.
    blocking: HashSet<u64>,
    /// Each thread's per-thread default stream on each device
    /// (`CU_STREAM_PER_THREAD`), made on first use.
    per_thread: HashMap<(ThreadId, usize), Owned<Stream>>,
    /// Peer access per granule of mapped memory: address -> bit mask of the
    /// devices (other than the owner) granted read-write by `cuMemSetAccess`.
    peer_access: BTreeMap<u64, u64>,
    next_graph: u64,
}

impl Tables {
    /// Drops every entry that belongs to `host` (its context was destroyed).
    fn purge(&mut self, host: &Arc<HostDevice>) {
        for (start, r) in &self.reservations {
            if Arc::ptr_eq(&r.host, host) {
                let gone: Vec<u64> = self
                    .peer_access
                    .range(*start..start + r.len)
                    .map(|(a, _)| *a)
                    .collect();
                for a in gone {
                    self.peer_access.remove(&a);
                }
            }
        }
        self.per_thread.retain(|_, s| !Arc::ptr_eq(&s.host, host));
        self.handles.retain(|_, e| !Arc::ptr_eq(&e.host, host));
        self.reservations.retain(|_, r| !Arc::ptr_eq(&r.host, host));
        self.plain.retain(|_, r| !Arc::ptr_eq(&r.host, host));
        self.streams.retain(|_, s| !Arc::ptr_eq(&s.host, host));
        self.events.retain(|_, e| !Arc::ptr_eq(&e.host, host));
    }
}

/// A device's primary context.
#[derive(Debug)]
struct Primary {
    /// `cuDevicePrimaryCtxRetain`s not yet released.
    refs: u32,
    /// The device's memory, streams and events; replaced by a fresh device
    /// when the last retain is released (the driver destroys the context and
    /// everything in it).
    host: Arc<HostDevice>,
    /// Objects that were still live when a context was destroyed.
    destroyed_live: u64,
}

/// One fake GPU.
#[derive(Debug)]
pub struct FakeDevice {
    /// `cuDeviceGetName`.
    pub name: CString,
    /// `cuDeviceTotalMem`.
    pub capacity: u64,
    /// The primary context's value: the address of this box, unique and stable.
    ctx: Box<u8>,
    primary: Mutex<Primary>,
}

impl FakeDevice {
    /// The primary context value.
    pub fn context(&self) -> usize {
        std::ptr::from_ref::<u8>(&*self.ctx).expose_provenance()
    }
}

/// Counts of one device's live objects (see `fakeCudaLive`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Live {
    /// The model's live objects.
    pub model: LiveCounts,
    /// Events not yet destroyed.
    pub events: u64,
    /// Streams created (the driver API vmm-sys loads cannot destroy them).
    pub streams: u64,
    /// Outstanding primary-context retains.
    pub primary_refs: u32,
    /// Objects still live when this device's primary context was destroyed
    /// (released to zero): leaks the driver cleaned up.
    pub destroyed_live: u64,
}

/// The initialized fake driver.
#[derive(Debug)]
pub struct Fake {
    /// The configuration read at initialization.
    pub config: Config,
    devices: Vec<FakeDevice>,
    tables: Mutex<Tables>,
}

fn host_device(config: &Config, ordinal: usize) -> Result<HostDevice, Fail> {
    HostDevice::new(HostConfig {
        name: format!("fake-cuda{ordinal}"),
        capacity: config.capacity(ordinal),
        granularity: config.granularity,
        ordinal: ordinal as u32,
    })
    .map_err(|e| Fail::invalid(format!("cannot create fake device {ordinal}: {e}")))
}

impl Fake {
    /// A driver with `config.devices` devices.
    pub fn new(config: Config) -> Res<Fake> {
        let devices = (0..config.devices as usize)
            .map(|ordinal| {
                Ok(FakeDevice {
                    name: CString::new(format!("vmmalloc fake-cuda device {ordinal}"))
                        .map_err(|e| Fail::invalid(e.to_string()))?,
                    capacity: config.capacity(ordinal),
                    ctx: Box::new(0),
                    primary: Mutex::new(Primary {
                        refs: 0,
                        host: Arc::new(host_device(&config, ordinal)?),
                        destroyed_live: 0,
                    }),
                })
            })
            .collect::<Res<Vec<_>>>()?;
        Ok(Fake {
            config,
            devices,
            tables: Mutex::new(Tables {
                next_handle: HANDLE_BASE,
                next_stream: STREAM_BASE,
                next_event: EVENT_BASE,
                next_graph: GRAPH_BASE,
                ..Tables::default()
            }),
        })
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The device with ordinal `ordinal`, or `CUDA_ERROR_INVALID_DEVICE`.
    pub fn device(&self, ordinal: i32) -> Res<&FakeDevice> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i))
            .ok_or_else(|| {
                Fail::new(
                    CUDA_ERROR_INVALID_DEVICE,
                    format!(
                        "device {ordinal} does not exist ({} device(s))",
                        self.devices.len()
                    ),
                )
            })
    }

    /// The memory of device `dev` (an ordinal already validated).
    pub fn host(&self, dev: usize) -> Arc<HostDevice> {
        Arc::clone(&self.devices[dev].primary.lock().host)
    }

    /// The ordinal of the device whose primary context is `ctx`.
    pub fn device_of_context(&self, ctx: usize) -> Option<usize> {
        self.devices.iter().position(|d| d.context() == ctx)
    }

    /// The device of the calling thread's current context, which must be an
    /// active (retained) primary context: else `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn current(&self) -> Res<usize> {
        let ctx = current_context();
        if ctx == 0 {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                "no context is current on this thread",
            ));
        }
        let dev = self.device_of_context(ctx).ok_or_else(|| {
            Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                format!("{ctx:#x} is not a context"),
            )
        })?;
        if self.devices[dev].primary.lock().refs == 0 {
            return Err(Fail::new(
                CUDA_ERROR_INVALID_CONTEXT,
                format!("the current context (device {dev}'s primary context) is not retained"),
            ));
        }
        Ok(dev)
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub fn retain(&self, ordinal: i32) -> Res<usize> {
        let d = self.device(ordinal)?;
        d.primary.lock().refs += 1;
        Ok(d.context())
    }

    /// `cuDevicePrimaryCtxRelease`: the last release destroys the context and
    /// everything made in it (the device starts again empty), as the driver does.
    pub fn release_primary(&self, ordinal: i32) -> Res<()> {
        let d = self.device(ordinal)?;
        let dev = ordinal as usize;
        let old = {
            let mut p = d.primary.lock();
            if p.refs == 0 {
                return Err(Fail::new(
                    CUDA_ERROR_INVALID_CONTEXT,
                    format!("the primary context of device {ordinal} is not retained"),
                ));
            }
            p.refs -= 1;
            if p.refs > 0 {
                return Ok(());
            }
            let fresh = Arc::new(host_device(&self.config, dev)?);
            let old = std::mem::replace(&mut p.host, fresh);
            let l = old.live();
            let leaked = (l.reservations + l.handles + l.mappings + l.plain_allocs) as u64
                + old.streams().live_events() as u64;
            if leaked > 0 {
                p.destroyed_live += leaked;
                eprintln!(
                    "fake-cuda: the primary context of device {ordinal} was destroyed with live \
                     objects ({l:?}, {} event(s)); freeing them, as the driver does",
                    old.streams().live_events()
                );
            }
            old
        };
        self.tables.lock().purge(&old);
        Ok(())
    }

    /// Live objects of device `ordinal`.
    pub fn live(&self, ordinal: i32) -> Res<Live> {
        let d = self.device(ordinal)?;
        let (host, refs, destroyed_live) = {
            let p = d.primary.lock();
            (Arc::clone(&p.host), p.refs, p.destroyed_live)
        };
        let streams = self
            .tables
            .lock()
            .streams
            .values()
            .filter(|s| Arc::ptr_eq(&s.host, &host))
            .count() as u64;
        Ok(Live {
            model: host.live(),
            events: host.streams().live_events() as u64,
            streams,
            primary_refs: refs,
            destroyed_live,
        })
    }

    // -- Allocation handles ---------------------------------------------------

    /// Registers a handle made by device `dev`; returns the driver-wide value.
    pub fn add_handle(
        &self,
        dev: usize,
        host: Arc<HostDevice>,
        inner: PhysHandle,
        posix_fd: bool,
        fabric: bool,
    ) -> u64 {
        let mut t = self.tables.lock();
        let value = t.next_handle;
        t.next_handle += 1;
        t.handles.insert(
            value,
            HandleEntry {
                dev,
                host,
                inner,
                posix_fd,
                fabric,
            },
        );
        value
    }

    /// The handle behind `value`, or `CUDA_ERROR_INVALID_VALUE` (the model's
    /// code for an unknown handle).
    pub fn handle(&self, value: u64) -> Res<HandleEntry> {
        self.tables
            .lock()
            .handles
            .get(&value)
            .cloned()
            .ok_or_else(|| {
                Fail::invalid(format!(
                    "{}: handle {value:#x}",
                    Rule::UnknownHandle.describe()
                ))
            })
    }

    /// Forgets a released handle.
    pub fn remove_handle(&self, value: u64) {
        self.tables.lock().handles.remove(&value);
    }

    // -- Virtual ranges -------------------------------------------------------

    /// Records a reservation made by device `dev`.
    pub fn add_reservation(&self, addr: u64, len: u64, dev: usize, host: Arc<HostDevice>) {
        self.tables
            .lock()
            .reservations
            .insert(addr, Range { len, dev, host });
    }

    /// Forgets a freed reservation.
    pub fn remove_reservation(&self, addr: u64) {
        self.tables.lock().reservations.remove(&addr);
    }

    /// Records a plain allocation made by device `dev`.
    pub fn add_plain(&self, addr: u64, len: u64, dev: usize, host: Arc<HostDevice>) {
        self.tables
            .lock()
            .plain
            .insert(addr, Range { len, dev, host });
    }

    /// Forgets a freed plain allocation.
    pub fn remove_plain(&self, addr: u64) {
        self.tables.lock().plain.remove(&addr);
    }

    /// The requested size and device of the plain allocation starting
    /// exactly at `addr`, if there is one.
    pub fn plain_at(&self, addr: u64) -> Option<(u64, usize)> {
        self.tables.lock().plain.get(&addr).map(|r| (r.len, r.dev))
    }

    /// The device owning the reservation or plain allocation that contains
    /// `addr`, if any.
    pub fn owner_of(&self, addr: u64) -> Option<(usize, Arc<HostDevice>)> {
        let t = self.tables.lock();
        let hit = |m: &BTreeMap<u64, Range>| {
            m.range(..=addr)
                .next_back()
                .filter(|(&start, r)| addr - start < r.len.max(1))
                .map(|(_, r)| (r.dev, Arc::clone(&r.host)))
        };
        hit(&t.reservations).or_else(|| hit(&t.plain))
    }

    /// The device that must judge a call on `addr`: its owner, else the current
    /// context's device, else device 0 (whose model then names the broken
    /// rule, e.g. "not a range returned by reserve").
    pub fn judge(&self, addr: u64) -> (usize, Arc<HostDevice>) {
        if let Some(o) = self.owner_of(addr) {
            return o;
        }
        let dev = self.current().unwrap_or(0);
        (dev, self.host(dev))
    }

    // -- Streams and events ---------------------------------------------------

    /// Registers a stream of device `dev`; returns its `CUstream` value.
    pub fn add_stream(&self, dev: usize, host: Arc<HostDevice>, inner: Stream) -> u64 {
        let mut t = self.tables.lock();
        let value = t.next_stream;
        t.next_stream += 0x10;
        t.streams.insert(value, Owned { dev, host, inner });
        value
    }

    /// The stream behind a `CUstream` value: null, `CU_STREAM_LEGACY` and
    /// `CU_STREAM_PER_THREAD` are the current context's default stream;
    /// anything else unknown is `CUDA_ERROR_INVALID_HANDLE`.
    pub fn stream(&self, value: usize) -> Res<Owned<Stream>> {
        if value == 0 || value == CU_STREAM_LEGACY {
            let dev = self.current()?;
            return Ok(Owned {
                dev,
                host: self.host(dev),
                inner: Stream::DEFAULT,
            });
        }
        if value == CU_STREAM_PER_THREAD {
            // The calling thread's own default stream in the current context
            // (cuda.h, "Stream synchronization behavior": per-thread default
            // stream), a blocking stream distinct on every thread.
            let dev = self.current()?;
            let host = self.host(dev);
            let key = (std::thread::current().id(), dev);
            let mut t = self.tables.lock();
            if let Some(s) = t.per_thread.get(&key) {
                if Arc::ptr_eq(&s.host, &host) {
                    return Ok(s.clone());
                }
            }
            let inner = vmmalloc_device::Device::create_stream(&*host)?;
            let s = Owned { dev, host, inner };
            t.per_thread.insert(key, s.clone());
            return Ok(s);
        }
        self.tables
            .lock()
            .streams
            .get(&(value as u64))
            .cloned()
            .ok_or_else(|| {
                invalid_handle(format!("{}: {value:#x}", Rule::UnknownStream.describe()))
            })
    }

    /// Marks the stream `value` as blocking (made without `CU_STREAM_NON_BLOCKING`).
    pub fn set_blocking(&self, value: u64) {
        self.tables.lock().blocking.insert(value);
    }

    /// Whether some blocking stream of `host` (a per-thread default stream
    /// included) is capturing: the legacy stream then has an implicit
    /// dependency on that capture (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`).
    pub fn blocking_stream_capturing(&self, host: &Arc<HostDevice>) -> bool {
        use vmmalloc_device::Introspect;
        let t = self.tables.lock();
        let capturing = |s: &Owned<Stream>| {
            Arc::ptr_eq(&s.host, host) && host.streams().is_capturing(s.inner).unwrap_or(false)
        };
        t.blocking
            .iter()
            .filter_map(|v| t.streams.get(v))
            .chain(t.per_thread.values())
            .any(capturing)
    }

    /// The blocking streams of `host` (made without `CU_STREAM_NON_BLOCKING`,
    /// and every thread's per-thread stream), as the device knows them.
    pub fn blocking_streams_of(&self, host: &Arc<HostDevice>) -> Vec<Stream> {
        let t = self.tables.lock();
        t.blocking
            .iter()
            .filter_map(|v| t.streams.get(v))
            .chain(t.per_thread.values())
            .filter(|s| Arc::ptr_eq(&s.host, host))
            .map(|s| s.inner)
            .collect()
    }

    /// A new (unmodelled) graph value for `cuStreamEndCapture`.
    pub fn new_graph(&self) -> u64 {
        let mut t = self.tables.lock();
        let g = t.next_graph;
        t.next_graph += 0x10;
        g
    }

    // -- Peer access ------------------------------------------------------------

    /// Grants the devices in `mask` read-write access to `[addr, addr+len)`,
    /// granule by granule.
    pub fn grant_peers(&self, addr: u64, len: u64, mask: u64) {
        let g = self.config.granularity;
        let mut t = self.tables.lock();
        let mut a = addr;
        while a < addr.saturating_add(len) {
            *t.peer_access.entry(a).or_insert(0) |= mask;
            a += g;
        }
    }

    /// Forgets peer access to `[addr, addr+len)` (an unmap).
    pub fn revoke_peers(&self, addr: u64, len: u64) {
        let mut t = self.tables.lock();
        let gone: Vec<u64> = t
            .peer_access
            .range(addr..addr.saturating_add(len))
            .map(|(a, _)| *a)
            .collect();
        for a in gone {
            t.peer_access.remove(&a);
        }
    }

    /// The peers granted access to the granule containing `addr`.
    pub fn peers_of(&self, addr: u64) -> u64 {
        let g = self.config.granularity;
        let t = self.tables.lock();
        t.peer_access.get(&(addr - addr % g)).copied().unwrap_or(0)
    }

    /// Registers an event of device `dev`; returns its `CUevent` value.
    pub fn add_event(&self, dev: usize, host: Arc<HostDevice>, inner: Event) -> u64 {
        let mut t = self.tables.lock();
        let value = t.next_event;
        t.next_event += 0x10;
        t.events.insert(value, Owned { dev, host, inner });
        value
    }

    /// The event behind a `CUevent` value, or `CUDA_ERROR_INVALID_HANDLE`.
    pub fn event(&self, value: usize) -> Res<Owned<Event>> {
        self.tables
            .lock()
            .events
            .get(&(value as u64))
            .cloned()
            .ok_or_else(|| invalid_handle(format!("{}: {value:#x}", Rule::UnknownEvent.describe())))
    }

    /// Forgets a destroyed event.
    pub fn remove_event(&self, value: usize) {
        self.tables.lock().events.remove(&(value as u64));
    }
}

/// `CUDA_ERROR_INVALID_HANDLE` (400).
pub fn invalid_handle(why: impl Into<String>) -> Fail {
    Fail::new(CUDA_ERROR_INVALID_HANDLE, why)
}

/// A code as a failure (for readability at call sites).
pub fn code(code: CUresult, why: impl Into<String>) -> Fail {
    Fail::new(code, why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_device::{Device, MIB};

    fn small() -> Fake {
        Fake::new(Config {
            devices: 2,
            capacities: vec![64 * MIB],
            ..Config::default()
        })
        .unwrap()
    }

    #[test]
    fn contexts_are_per_device_and_need_a_retain() {
        let f = small();
        assert_eq!(f.device(2).unwrap_err().code, 101);
        assert_eq!(f.device(-1).unwrap_err().code, 101);
        while pop_context().is_some() {}
        assert_eq!(f.current().unwrap_err().code, 201);
        let c1 = f.retain(1).unwrap();
        assert_ne!(c1, f.retain(0).unwrap());
        set_current_context(c1);
        assert_eq!(f.current().unwrap(), 1);
        f.release_primary(1).unwrap();
        assert_eq!(f.current().unwrap_err().code, 201);
        assert_eq!(f.release_primary(1).unwrap_err().code, 201);
        set_current_context(0);
        assert_eq!(context_depth(), 0);
    }

    #[test]
    fn the_context_stack_has_the_drivers_semantics() {
        while pop_context().is_some() {}
        set_current_context(0); // no-op on an empty stack
        assert_eq!((current_context(), context_depth()), (0, 0));
        set_current_context(7); // pushes on an empty stack
        assert_eq!((current_context(), context_depth()), (7, 1));
        push_context(9);
        assert_eq!((current_context(), context_depth()), (9, 2));
        set_current_context(8); // replaces the top
        assert_eq!((current_context(), context_depth()), (8, 2));
        assert_eq!(pop_context(), Some(8));
        assert_eq!(current_context(), 7);
        set_current_context(0); // pops
        assert_eq!((current_context(), context_depth()), (0, 0));
        assert_eq!(pop_context(), None);
    }

    #[test]
    fn destroying_a_context_frees_what_was_left_in_it() {
        let f = small();
        f.retain(0).unwrap();
        let host = f.host(0);
        let g = host.caps().granularity;
        let h = host.create(g).unwrap();
        let value = f.add_handle(0, Arc::clone(&host), h, false, false);
        assert_eq!(f.handle(value).unwrap().inner, h);
        f.release_primary(0).unwrap();
        assert_eq!(f.handle(value).unwrap_err().code, 1);
        let live = f.live(0).unwrap();
        assert!(live.model.is_empty());
        assert_eq!(live.destroyed_live, 1);
        assert_eq!(live.primary_refs, 0);
        // The old device is gone from the tables, not reused.
        assert!(!Arc::ptr_eq(&host, &f.host(0)));
    }

    #[test]
    fn owner_of_finds_ranges_by_any_address_inside() {
        let f = small();
        let h0 = f.host(0);
        f.add_reservation(0x4000_0000, 0x40_0000, 0, Arc::clone(&h0));
        f.add_plain(0x9000_0000, 100, 1, f.host(1));
        assert_eq!(f.owner_of(0x4000_0000).unwrap().0, 0);
        assert_eq!(f.owner_of(0x403f_ffff).unwrap().0, 0);
        assert!(f.owner_of(0x4040_0000).is_none());
        assert_eq!(f.owner_of(0x9000_0063).unwrap().0, 1);
        assert!(f.owner_of(0x9000_0064).is_none());
        f.remove_reservation(0x4000_0000);
        assert!(f.owner_of(0x4000_0000).is_none());
    }
}
