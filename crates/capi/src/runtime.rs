//! The process-wide state behind the C ABI: the configuration and one
//! allocator per device ordinal, created lazily and thread-safely.
//!
//! A [`Runtime`] is created on the first exported call that needs it, from the
//! text given to `vmmalloc_configure` or else from `VMMALLOC_CONF`. It keeps
//! the parse result, good or bad: with a bad configuration every call that
//! needs an allocator fails with the same message naming the key (logged once).
//! Allocators live in a fixed array of [`MAX_DEVICES`] slots, each a
//! `OnceLock` filled under a creation lock, so the hot path (malloc/free on an
//! existing allocator) takes no lock of ours beyond the allocator's own.
//!
//! The runtime itself is reached through a once-set pointer ([`runtime`]:
//! one acquire load, no lock, no reference count), so a cache-hit malloc +
//! free through the C ABI costs the policy's own pair plus a few loads
//! (docs/expandable.md, "Benchmarks"). A runtime is never freed while the
//! process may use it: one replaced by `vmmalloc_configure` (which holds no
//! allocator) is leaked, and only `vmmalloc_reset_for_tests` frees one.

use crate::checkpoints::Checkpoints;
use crate::config::{Config, ConfigError, DeviceKind, LogLevel};
use crate::diag;
use crate::error::Error;
use crate::history::{History, Recording};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use vmmalloc_alloc::pools::{PoolId, PrivatePools, Restored};
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Stream};
use vmmalloc_device::Device;

/// Joins group `name` for device `ordinal` (docs/share.md): the group of
/// that name on that device (`gpuN` for a CUDA ordinal, `hostN` / `simN`
/// for the test backends), created with the device's memory as its total.
fn join_share(
    name: &str,
    config: &Config,
    dev: &dyn Device,
    ordinal: u32,
) -> Result<Arc<vmmalloc_alloc::share::Member>, Error> {
    let device = match config.device {
        DeviceKind::Cuda => format!("gpu{ordinal}"),
        k => format!("{}{ordinal}", k.name()),
    };
    let opts = vmmalloc_alloc::share::JoinOptions {
        total: dev.caps().total_memory,
        cap: vmmalloc_alloc::share::NO_CAP,
        poll: vmmalloc_alloc::share::DEFAULT_POLL,
    };
    vmmalloc_alloc::share::Member::join(name, &device, opts).map_err(|e| {
        Error::invalid(format!(
            "share:{name}: cannot join the shared budget on device {ordinal}: {e}"
        ))
    })
}

/// Device ordinals the plug-in can serve (0 .. MAX_DEVICES-1).
pub const MAX_DEVICES: usize = 64;

/// One device's allocator and what it was built over.
pub struct DeviceState {
    /// The ordinal.
    pub ordinal: u32,
    /// The device.
    pub device: Arc<dyn Device>,
    /// The allocator.
    pub allocator: Box<dyn Allocator>,
    /// The event history (on with `record_history:True` or PyTorch's
    /// `_record_memory_history`; see [`set_recording`]).
    pub history: History,
    /// Checkpoints of private pools (`getCheckpointState`): lists of
    /// blocks, holding no memory.
    pub checkpoints: Checkpoints,
    /// The shared budget this device's allocator is a member of
    /// (`VMMALLOC_CONF=share:NAME`, docs/share.md).
    pub share: Option<Arc<vmmalloc_alloc::share::Member>>,
    /// Why the device failed: a panic during a call on it (`crate::entry`).
    /// Set once; from then on every call on the device fails with it.
    failure: OnceLock<String>,
}

thread_local! {
    /// The ordinal of the device the running call looked up last (or
    /// `u32::MAX`): the device a panic in the call is blamed on. Loops over
    /// devices look each one up before working on it.
    static CURRENT: Cell<u32> = const { Cell::new(u32::MAX) };
}

/// Forgets the device of the previous call (at the start of each call).
#[inline]
pub(crate) fn clear_current() {
    CURRENT.with(|c| c.set(u32::MAX));
}

#[inline]
fn set_current(ordinal: u32) {
    CURRENT.with(|c| c.set(ordinal));
}

/// After a panic in a call: marks the device that call looked up last as
/// failed with `why` (the call's name and the panic's text). Returns its ordinal.
pub(crate) fn fail_current(why: &str) -> Option<u32> {
    let ordinal = CURRENT.with(Cell::get);
    current_runtime()?.existing(ordinal)?.fail(why);
    Some(ordinal)
}

impl DeviceState {
    /// Marks the device failed (the first reason stays).
    pub fn fail(&self, why: &str) {
        let _ = self.failure.set(why.to_string());
    }

    /// The error every call on a failed device returns.
    fn failed_error(&self, why: &str) -> Error {
        Error::failed(format!(
            "device {}: the allocator failed and serves nothing any more ({why}); \
             its memory state cannot be trusted: restart the process, and please report it",
            self.ordinal
        ))
    }

    /// Why the device was marked failed after a panic during a call on it
    /// (one atomic load: for the hot path; [`DeviceState::check`] also asks
    /// the allocator).
    #[inline]
    pub fn failure(&self) -> Option<Error> {
        self.failure.get().map(|why| self.failed_error(why))
    }

    /// The C ABI error of an error of this device's allocator. An allocator
    /// that failed (a panic under its lock) fails the device too, so the
    /// message names the device like every later one.
    pub fn error(&self, e: AllocError) -> Error {
        match &e {
            AllocError::Failed(why) => {
                self.fail(why);
                self.check().err().unwrap_or_else(|| e.into())
            }
            _ => e.into(),
        }
    }

    /// Fails if the device failed: after a panic during a call on it, or
    /// (`expandable`) a panic under its allocator's lock.
    pub fn check(&self) -> Result<(), Error> {
        match self
            .failure
            .get()
            .map(String::as_str)
            .or_else(|| self.allocator.failure())
        {
            None => Ok(()),
            Some(why) => Err(self.failed_error(why)),
        }
    }

    /// Allocates, recording the events when history is on.
    #[inline]
    pub fn malloc(&self, size: u64, stream: Stream) -> Result<Allocation, AllocError> {
        if self.history.is_on() {
            self.malloc_recorded(size, stream, (0, 0), || self.allocator.malloc(size, stream))
        } else {
            self.allocator.malloc(size, stream)
        }
    }

    /// An allocation (`alloc`, of `size` bytes on `stream`) with history on:
    /// records its events.
    #[cold]
    fn malloc_recorded(
        &self,
        size: u64,
        stream: Stream,
        pool: PoolId,
        alloc: impl FnOnce() -> Result<Allocation, AllocError>,
    ) -> Result<Allocation, AllocError> {
        let mut ring = self.history.lock();
        let r = alloc();
        match &r {
            Ok(a) => {
                ring.segment_events(&*self.allocator);
                ring.push_alloc(a.ptr, a.requested, stream.0, pool);
            }
            Err(AllocError::OutOfMemory(rep)) => {
                ring.push_oom(rep.requested, rep.device_free, stream.0)
            }
            // A policy may call a request beyond the device an invalid size;
            // PyTorch records it as an out-of-memory.
            Err(AllocError::InvalidSize { .. }) if size > self.device.caps().total_memory => {
                let free = self.device.mem_info().map_or(0, |m| m.free);
                ring.push_oom(size, free, stream.0)
            }
            Err(_) => {}
        }
        r
    }

    /// Records an `oom` event for a request refused before reaching the allocator.
    pub fn record_oom(&self, size: u64, stream: Stream) {
        if self.history.is_on() {
            let free = self.device.mem_info().map_or(0, |m| m.free);
            self.history.lock().push_oom(size, free, stream.0);
        }
    }

    /// The allocator's private pools (CUDA graphs, `torch.cuda.MemPool`), or
    /// why it has none: only `backend:expandable` keeps pools (PyTorch's
    /// graph-pool semantics need owners inside the allocator, see
    /// `vmmalloc_alloc::pools`).
    pub fn pools(&self) -> Result<&dyn PrivatePools, Error> {
        self.allocator.pools().ok_or_else(|| {
            Error::unsupported(format!(
                "backend:{} has no CUDA-graph private pools: CUDA graphs, torch.compile's \
                 reduce-overhead mode and torch.cuda.MemPool need backend:expandable (the default)",
                self.allocator.name()
            ))
        })
    }

    /// Whether a capture into a private pool is underway on this device.
    pub fn capturing(&self) -> bool {
        self.allocator
            .pools()
            .is_some_and(|p| p.captures_underway() > 0)
    }

    /// Allocates `size` bytes on `stream` from private pool `id`, recording
    /// the events when history is on.
    pub fn pool_malloc(&self, id: PoolId, size: u64, stream: Stream) -> Result<Allocation, Error> {
        let pools = self.pools()?;
        let r = if self.history.is_on() {
            self.malloc_recorded(size, stream, id, || pools.pool_malloc(id, size, stream))
        } else {
            pools.pool_malloc(id, size, stream)
        };
        r.map_err(|e| self.error(e))
    }

    /// `setCheckpointPoolState` for checkpoint `handle`: restores its pool
    /// to the blocks it recorded (see `PrivatePools::restore_pool`).
    pub fn pool_restore(&self, handle: u64) -> Result<Restored, Error> {
        let (id, blocks) = self.checkpoints.get(handle)?;
        let r = self
            .pools()?
            .restore_pool(id, &blocks)
            .map_err(|e| self.error(e))?;
        if self.history.is_on() {
            let mut ring = self.history.lock();
            for p in &r.freed {
                ring.push_free(*p);
            }
            for b in &r.allocated {
                ring.push_alloc(b.ptr, b.requested, b.stream.0, id);
            }
            ring.segment_events(&*self.allocator);
        }
        Ok(r)
    }

    /// Frees `ptr` (of the main pool or a private pool), recording the
    /// events when history is on. During a capture the allocator defers
    /// only what PyTorch defers (a block with `record_stream` uses).
    #[inline]
    pub fn free(&self, ptr: u64) -> Result<(), AllocError> {
        // An IPC export of `ptr` ends before its memory can be reused.
        crate::ipc::on_free(ptr);
        if self.history.is_on() {
            self.free_recorded(ptr)
        } else {
            self.allocator.free(ptr)
        }
    }

    /// [`DeviceState::free`] with history on.
    #[cold]
    fn free_recorded(&self, ptr: u64) -> Result<(), AllocError> {
        let mut ring = self.history.lock();
        let r = self.allocator.free(ptr);
        if r.is_ok() {
            ring.push_free(ptr);
            ring.segment_events(&*self.allocator);
        }
        r
    }

    /// Returns cached memory to the device, recording segment events.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        if !self.history.is_on() {
            return self.allocator.empty_cache();
        }
        let mut ring = self.history.lock();
        let r = self.allocator.empty_cache();
        ring.segment_events(&*self.allocator);
        r
    }
}

/// PyTorch's recording (`torch.cuda.memory._record_memory_history`, through
/// `vmmalloc_record_history`): None until set, when the configuration's
/// `record_history` and `max_entries` decide. Process-wide, as PyTorch's is
/// (it sets every device allocator's), and applied to devices created later.
static RECORDING: parking_lot::Mutex<Option<Recording>> = parking_lot::Mutex::new(None);

/// The history of a new device `ordinal`'s `allocator`.
fn new_history(ordinal: u32, config: &Config, allocator: &dyn Allocator) -> History {
    let recording = *RECORDING.lock();
    match recording {
        None => History::new(ordinal, config.max_entries, config.record_history),
        Some(how) => {
            let h = History::new(ordinal, how.max_entries, false);
            h.set(how, allocator);
            h
        }
    }
}

/// Starts, changes or stops recording on every device, present and future.
pub fn set_recording(how: Recording) {
    let mut recording = RECORDING.lock();
    *recording = Some(how);
    if let Some(rt) = current_runtime() {
        // No device is created meanwhile (creation reads RECORDING under this lock).
        let _g = rt.creating.lock().unwrap_or_else(|e| e.into_inner());
        for d in rt.active_devices() {
            d.history.set(how, &*d.allocator);
        }
    }
}

/// Whether any device records events now (PyTorch's `isHistoryEnabled`):
/// what was last set, else the configuration's `record_history`.
pub fn recording() -> bool {
    match *RECORDING.lock() {
        Some(how) => how.enabled,
        None => current_runtime()
            .and_then(|rt| rt.config.as_ref().ok().map(|c| c.record_history))
            .unwrap_or(false),
    }
}

/// The configuration and the per-device allocators of this process.
pub struct Runtime {
    /// The configuration, or why it is invalid.
    pub config: Result<Config, ConfigError>,
    /// The configured log level (`error` when the configuration is bad).
    log: LogLevel,
    /// Device count PyTorch reported through `vmmalloc_init` (0: not called).
    init_count: AtomicU32,
    /// Ordinals below this are served ([`ordinal_limit`] of the
    /// configuration and `init_count`; 0 when the configuration is bad):
    /// the hot path's whole ordinal check is one load and one compare.
    served: AtomicU32,
    /// Whether the configuration error was logged already.
    config_error_logged: AtomicBool,
    slots: Box<[OnceLock<Arc<DeviceState>>]>,
    creating: Mutex<()>,
}

/// State changed only by the slow paths, under [`GLOBAL`]'s lock.
struct Global {
    /// Text from `vmmalloc_configure`, used instead of `VMMALLOC_CONF`.
    conf_override: Option<String>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    conf_override: None,
});

/// The current runtime: null until the first call that needs one (and after
/// `vmmalloc_configure` or a reset), else a pointer from `Box::into_raw`,
/// set under [`GLOBAL`]'s lock.
static RUNTIME: AtomicPtr<Runtime> = AtomicPtr::new(std::ptr::null_mut());

fn write_global() -> std::sync::MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `on_oom` of the current runtime as a number (`OnOom` index; raise until
/// a configuration says otherwise), readable without a lock (by the shim, and
/// in a forked child).
static ON_OOM: AtomicU8 = AtomicU8::new(0);

/// The configured log level's index in `LogLevel::ALL` (error until configured).
static LOG: AtomicU8 = AtomicU8::new(1);

/// The configured log level, without taking a lock (for a forked child).
pub fn log_level_unlocked() -> LogLevel {
    LogLevel::ALL
        .get(LOG.load(Ordering::Relaxed) as usize)
        .copied()
        .unwrap_or(LogLevel::Error)
}

/// The configured `on_oom`, without taking a lock.
pub fn on_oom() -> crate::config::OnOom {
    crate::config::OnOom::ALL
        .get(ON_OOM.load(Ordering::Relaxed) as usize)
        .copied()
        .unwrap_or(crate::config::OnOom::Raise)
}

/// The most ordinals served: [`MAX_DEVICES`], bounded by `device_count` for
/// the modeled backends and by the count PyTorch's init hook reported
/// (`init`, 0 when it was not called).
#[inline]
fn ordinal_limit(config: &Config, init: u32) -> u32 {
    let mut limit = MAX_DEVICES as u32;
    if config.device != DeviceKind::Cuda {
        limit = limit.min(config.device_count);
    }
    if init > 0 {
        limit = limit.min(init);
    }
    limit
}

/// The runtime if one exists (none is created).
fn current_runtime() -> Option<&'static Runtime> {
    let p = RUNTIME.load(Ordering::Acquire);
    // SAFETY: a non-null `RUNTIME` came from `Box::into_raw` (published with
    // a release store after it was fully built) and is freed only by
    // `reset`, whose contract is that no other call is running.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The runtime as [`runtime`] hands it out: a plain shared reference (no
/// reference count) that derefs to it.
#[derive(Clone, Copy)]
pub struct RuntimeRef(&'static Runtime);

impl std::ops::Deref for RuntimeRef {
    type Target = Runtime;
    #[inline]
    fn deref(&self) -> &Runtime {
        self.0
    }
}

/// The runtime, created on first use.
#[inline]
pub fn runtime() -> RuntimeRef {
    RuntimeRef(match current_runtime() {
        Some(rt) => rt,
        None => create_runtime(),
    })
}

#[cold]
fn create_runtime() -> &'static Runtime {
    let g = write_global();
    if let Some(rt) = current_runtime() {
        return rt;
    }
    let config = match &g.conf_override {
        Some(text) => Config::parse(text),
        None => Config::from_env(),
    };
    crate::fork::install();
    let rt = Box::new(Runtime::new(config));
    let oom = rt
        .config
        .as_ref()
        .map_or(crate::config::OnOom::Raise, |c| c.on_oom);
    let index = crate::config::OnOom::ALL
        .iter()
        .position(|o| *o == oom)
        .unwrap_or(0);
    ON_OOM.store(index as u8, Ordering::Relaxed);
    let log = LogLevel::ALL.iter().position(|l| *l == rt.log).unwrap_or(1);
    LOG.store(log as u8, Ordering::Relaxed);
    if let Ok(c) = &rt.config {
        diag::log(
            c.log,
            LogLevel::Info,
            &format!(
                "configured from {}: {}",
                if g.conf_override.is_some() {
                    "vmmalloc_configure"
                } else {
                    "VMMALLOC_CONF"
                },
                c.settings()
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        );
    }
    let rt = Box::into_raw(rt);
    RUNTIME.store(rt, Ordering::Release);
    drop(g);
    // SAFETY: just built and published; freed only by `reset` (see `current_runtime`).
    unsafe { &*rt }
}

/// Sets the configuration text used instead of `VMMALLOC_CONF`. Fails if it
/// does not parse, or if an allocator exists already.
pub fn configure(text: &str) -> Result<(), Error> {
    // Labelled by its origin: this text, not the environment variable.
    let parsed = Config::parse(text)
        .map_err(|e| Error::invalid(format!("vmmalloc_configure: {}", e.message)))?;
    let mut g = write_global();
    if let Some(rt) = current_runtime() {
        if rt.active_devices().next().is_some() {
            return Err(Error::invalid(format!(
                "vmmalloc_configure: allocators exist already (devices {}); configure before the first allocation",
                rt.active_devices().map(|d| d.ordinal.to_string()).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    g.conf_override = Some(text.to_string());
    // The next call builds a runtime from this text. The old one holds no
    // allocator and another thread may still be reading it: it is leaked.
    RUNTIME.store(std::ptr::null_mut(), Ordering::Release);
    diag::log(
        parsed.log,
        LogLevel::Info,
        &format!("vmmalloc_configure(\"{text}\") accepted"),
    );
    Ok(())
}

/// Drops every allocator and the configuration (tests only: pointers from
/// before are invalid afterwards, and no other thread may be inside a
/// `vmmalloc_*` call: the runtime it may be using is freed).
pub fn reset() {
    *RECORDING.lock() = None;
    crate::history::set_sink(None);
    ON_OOM.store(0, Ordering::Relaxed);
    LOG.store(1, Ordering::Relaxed);
    let mut g = write_global();
    g.conf_override = None;
    let old = RUNTIME.swap(std::ptr::null_mut(), Ordering::AcqRel);
    drop(g);
    if !old.is_null() {
        // SAFETY: `old` came from `Box::into_raw` and is no longer published;
        // by this function's contract no other call is using it.
        drop(unsafe { Box::from_raw(old) });
    }
}

impl Runtime {
    fn new(config: Result<Config, ConfigError>) -> Self {
        let log = config.as_ref().map_or(LogLevel::Error, |c| c.log);
        let served = config.as_ref().map_or(0, |c| ordinal_limit(c, 0));
        Runtime {
            config,
            log,
            init_count: AtomicU32::new(0),
            served: AtomicU32::new(served),
            config_error_logged: AtomicBool::new(false),
            slots: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            creating: Mutex::new(()),
        }
    }

    /// The configuration, or its error (logged the first time only).
    #[inline]
    pub fn config(&self) -> Result<&Config, Error> {
        match &self.config {
            Ok(c) => Ok(c),
            Err(e) => Err(self.config_error(e)),
        }
    }

    /// The error of a bad configuration, logged the first time only.
    #[cold]
    fn config_error(&self, e: &ConfigError) -> Error {
        let e = Error::from(e.clone());
        if !self.config_error_logged.swap(true, Ordering::Relaxed) {
            diag::log(self.log, LogLevel::Error, e.message());
        }
        e
    }

    /// The configuration, or its error, without logging it: for callers
    /// that report the error themselves ([`crate::vmmalloc_check_config`]).
    pub fn config_unlogged(&self) -> Result<&Config, Error> {
        self.config.as_ref().map_err(|e| Error::from(e.clone()))
    }

    /// Records PyTorch's device count (from the init hook).
    pub fn set_device_count(&self, n: u32) {
        self.init_count.store(n, Ordering::Relaxed);
        if let Ok(c) = &self.config {
            self.served.store(ordinal_limit(c, n), Ordering::Relaxed);
        }
    }

    /// Checks that `device` is a valid ordinal; returns it as an index.
    /// Builds no text unless the ordinal is invalid.
    #[inline]
    pub fn check_ordinal(&self, device: i32) -> Result<u32, Error> {
        let config = self.config()?;
        match u32::try_from(device) {
            Ok(d) if d < self.served.load(Ordering::Relaxed) => Ok(d),
            _ => Err(self.bad_ordinal(config, device, self.init_count.load(Ordering::Relaxed))),
        }
    }

    /// The allocator of `device` when the hot path may use it as it is: the
    /// configuration is good, the ordinal valid, the allocator exists and
    /// has not failed. `None` sends the call down the general path, which
    /// creates the allocator or says what is wrong. Builds no text, takes no
    /// lock (issue 27: the C ABI pair costs the policy's pair plus a few
    /// loads).
    #[inline]
    pub fn ready(&self, device: i32) -> Option<&DeviceState> {
        // A negative ordinal becomes a huge one, above any limit.
        let ordinal = device as u32;
        if ordinal >= self.served.load(Ordering::Relaxed) {
            return None;
        }
        let d = self.slots.get(ordinal as usize)?.get()?;
        set_current(ordinal);
        d.failure.get().is_none().then_some(&**d)
    }

    /// Whether `spill:true` is configured (an allocation may then spill to
    /// host memory, which the general path reports).
    #[inline]
    pub fn spill(&self) -> bool {
        self.config.as_ref().is_ok_and(|c| c.expandable.spill)
    }

    /// Why `device` is not a valid ordinal (the tightest bound's reason).
    #[cold]
    fn bad_ordinal(&self, config: &Config, device: i32, init: u32) -> Error {
        let mut limit = MAX_DEVICES as u32;
        let mut why = format!("vmmalloc serves ordinals 0..{}", MAX_DEVICES - 1);
        if config.device != DeviceKind::Cuda && config.device_count < limit {
            limit = config.device_count;
            why = format!(
                "device:{} has device_count:{}",
                config.device, config.device_count
            );
        }
        if init > 0 && init < limit {
            why = format!("vmmalloc_init reported {init} device(s)");
        }
        Error::invalid(format!("invalid device ordinal {device}: {why}"))
    }

    /// The allocator of `device` if it exists (no creation). Failed or not
    /// (see [`DeviceState::check`]).
    pub fn existing(&self, device: u32) -> Option<&Arc<DeviceState>> {
        let d = self.slots.get(device as usize).and_then(OnceLock::get)?;
        set_current(d.ordinal);
        Some(d)
    }

    /// Devices whose allocator exists, in ordinal order, failed or not.
    pub fn active_devices(&self) -> impl Iterator<Item = &Arc<DeviceState>> {
        self.slots
            .iter()
            .filter_map(OnceLock::get)
            .inspect(|d| set_current(d.ordinal))
    }

    /// The allocator of `device`, created on first use.
    pub fn device(&self, device: i32) -> Result<&Arc<DeviceState>, Error> {
        let ordinal = self.check_ordinal(device)?;
        set_current(ordinal);
        let slot = &self.slots[ordinal as usize];
        if let Some(s) = slot.get() {
            if let Some(why) = s.failure.get() {
                return Err(s.failed_error(why));
            }
            return Ok(s);
        }
        let _g = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.get() {
            return Ok(s);
        }
        let config = self.config()?;
        let dev = crate::devices::open(config, ordinal)?;
        let policy = config.effective_policy();
        let options = config.policy_options()?;
        let cannot = |e: AllocError| {
            Error::from(e).context(format!(
                "cannot create the {policy} allocator on device {ordinal}"
            ))
        };
        let (allocator, share): (Box<dyn Allocator>, _) = match &config.share {
            None => (
                vmmalloc_alloc::build(policy, dev.clone(), &options).map_err(cannot)?,
                None,
            ),
            Some(name) => {
                let member = join_share(name, config, &*dev, ordinal)?;
                let pressure: Arc<vmmalloc_alloc::pressure::PressureFn> =
                    Arc::new(|bytes: u64, device: i32| {
                        crate::growable::PRESSURE
                            .current()
                            .map_or(0, |cb| cb(bytes, device))
                    });
                let a = vmmalloc_alloc::expandable::build_shared(
                    dev.clone(),
                    options.expandable.clone(),
                    &member,
                    Some(pressure),
                )
                .map_err(cannot)?;
                diag::log(
                    config.log,
                    LogLevel::Info,
                    &format!(
                        "device {ordinal}: joined shared budget {name} ({})",
                        member.path().display()
                    ),
                );
                (Box::new(a), Some(member))
            }
        };
        let caps = dev.caps();
        diag::log(
            config.log,
            LogLevel::Info,
            &format!(
                "device {ordinal}: {policy} allocator on {} ({}, {} bytes, granularity {} bytes)",
                config.device, caps.name, caps.total_memory, caps.granularity
            ),
        );
        if let Err(m) = crate::segments::apply_to_new(ordinal, &*allocator) {
            // NCCL registration is not served on this device; allocation is.
            diag::log(
                config.log,
                LogLevel::Error,
                &format!("device {ordinal}: segments are not followed for NCCL registration: {m}"),
            );
        }
        let history = new_history(ordinal, config, &*allocator);
        let state = Arc::new(DeviceState {
            ordinal,
            device: dev,
            allocator,
            history,
            checkpoints: Checkpoints::default(),
            share,
            failure: OnceLock::new(),
        });
        Ok(slot.get_or_init(|| state))
    }

    /// Holds off device creation (a setting applied to every device, present
    /// and future, is applied under it).
    pub fn creating_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.creating.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configured log level, or `error` when the configuration is bad.
    pub fn log_level(&self) -> LogLevel {
        self.log
    }
}
