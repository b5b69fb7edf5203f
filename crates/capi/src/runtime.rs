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

use crate::config::{Config, ConfigError, DeviceKind, LogLevel};
use crate::diag;
use crate::history::History;
use crate::pools::{GraphPools, PoolGuard, PoolHook, PoolId};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Policy, PolicyOptions, Stream};
use vmmalloc_device::adaptors::Hooked;
use vmmalloc_device::Device;

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
    /// The event history (`record_history:True`).
    pub history: Option<History>,
    /// CUDA graph private pools and the frees deferred during capture.
    pub pools: GraphPools,
    /// The policy and options a graph pool's allocator is built with.
    policy: Policy,
    options: PolicyOptions,
}

impl DeviceState {
    /// Allocates, recording the events when history is on.
    pub fn malloc(&self, size: u64, stream: Stream) -> Result<Allocation, AllocError> {
        let Some(h) = &self.history else {
            return self.allocator.malloc(size, stream);
        };
        let mut ring = h.lock();
        let r = self.allocator.malloc(size, stream);
        match &r {
            Ok(a) => {
                ring.segment_events(&*self.allocator);
                ring.push_alloc(a.ptr, a.requested, stream.0);
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
        if let Some(h) = &self.history {
            let free = self.device.mem_info().map_or(0, |m| m.free);
            h.lock().push_oom(size, free, stream.0);
        }
    }

    /// Frees `ptr` (of the main allocator or a graph pool); while a capture
    /// is underway on the device the free is queued (see [`GraphPools`]).
    pub fn free(&self, ptr: u64) -> Result<(), AllocError> {
        self.pools.free(ptr, &|p| self.free_main(p))
    }

    /// Applies the frees queued during capture if no capture is underway,
    /// returning what failed.
    pub fn flush(&self) -> Vec<String> {
        self.pools.flush_with(&|p| self.free_main(p))
    }

    /// `beginAllocateToPool`: creates the pool's allocator (same policy and
    /// options, same device) on first use.
    pub fn pool_begin(&self, id: PoolId) -> Result<(), String> {
        self.pools.begin(id, |guard| self.pool_allocator(guard))
    }

    /// `createOrIncrefPool`: creates pool `id` (same policy, options and
    /// device as the main allocator) or adds a user to it.
    pub fn pool_create_or_incref(&self, id: PoolId) -> Result<(), String> {
        self.pools
            .create_or_incref(id, |guard| self.pool_allocator(guard))
    }

    /// A pool's allocator over this device, behind the pool's guard.
    fn pool_allocator(&self, guard: Arc<PoolGuard>) -> Result<Box<dyn Allocator>, String> {
        let device: Arc<dyn Device> = Arc::new(Hooked::new(self.device.clone(), PoolHook(guard)));
        vmmalloc_alloc::build(self.policy, device, &self.options)
            .map_err(|e| format!("cannot create the pool's {} allocator: {e}", self.policy))
    }

    /// `setCheckpointPoolState` for checkpoint `handle` (see [`GraphPools::restore`]).
    pub fn pool_restore(&self, handle: u64) -> Result<crate::pools::Restored, String> {
        self.pools.restore(handle, &|p| self.free_main(p))
    }

    /// `releasePool`: one graph using pool `id` is gone (see [`GraphPools::release`]).
    pub fn pool_release(&self, id: PoolId) -> Result<(), String> {
        self.pools.release(id, &|p| self.free_main(p))
    }

    /// Frees from the main allocator, recording the events when history is on.
    fn free_main(&self, ptr: u64) -> Result<(), AllocError> {
        // An IPC export of `ptr` ends before its memory can be reused.
        crate::ipc::on_free(ptr);
        let Some(h) = &self.history else {
            return self.allocator.free(ptr);
        };
        let mut ring = h.lock();
        let r = self.allocator.free(ptr);
        if r.is_ok() {
            ring.push_free(ptr);
            ring.segment_events(&*self.allocator);
        }
        r
    }

    /// Returns cached memory to the device, recording segment events.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let Some(h) = &self.history else {
            return self.allocator.empty_cache();
        };
        let mut ring = h.lock();
        let r = self.allocator.empty_cache();
        ring.segment_events(&*self.allocator);
        r
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
    /// Whether the configuration error was logged already.
    config_error_logged: AtomicBool,
    slots: Box<[OnceLock<Arc<DeviceState>>]>,
    creating: Mutex<()>,
}

struct Global {
    runtime: Option<Arc<Runtime>>,
    /// Text from `vmmalloc_configure`, used instead of `VMMALLOC_CONF`.
    conf_override: Option<String>,
}

static GLOBAL: RwLock<Global> = RwLock::new(Global {
    runtime: None,
    conf_override: None,
});

fn read_global() -> std::sync::RwLockReadGuard<'static, Global> {
    GLOBAL.read().unwrap_or_else(|e| e.into_inner())
}

fn write_global() -> std::sync::RwLockWriteGuard<'static, Global> {
    GLOBAL.write().unwrap_or_else(|e| e.into_inner())
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

/// The runtime, created on first use.
pub fn runtime() -> Arc<Runtime> {
    if let Some(rt) = &read_global().runtime {
        return rt.clone();
    }
    let mut g = write_global();
    if let Some(rt) = &g.runtime {
        return rt.clone();
    }
    let config = match &g.conf_override {
        Some(text) => Config::parse(text),
        None => Config::from_env(),
    };
    crate::fork::install();
    let rt = Arc::new(Runtime::new(config));
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
    g.runtime = Some(rt.clone());
    rt
}

/// Sets the configuration text used instead of `VMMALLOC_CONF`. Fails if it
/// does not parse, or if an allocator exists already.
pub fn configure(text: &str) -> Result<(), String> {
    // Labelled by its origin: this text, not the environment variable.
    let parsed = Config::parse(text).map_err(|e| format!("vmmalloc_configure: {}", e.message))?;
    let mut g = write_global();
    if let Some(rt) = &g.runtime {
        if rt.active_devices().next().is_some() {
            return Err(format!(
                "vmmalloc_configure: allocators exist already (devices {}); configure before the first allocation",
                rt.active_devices().map(|d| d.ordinal.to_string()).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    g.conf_override = Some(text.to_string());
    g.runtime = None;
    diag::log(
        parsed.log,
        LogLevel::Info,
        &format!("vmmalloc_configure(\"{text}\") accepted"),
    );
    Ok(())
}

/// Drops every allocator and the configuration (tests only: pointers from
/// before are invalid afterwards).
pub fn reset() {
    ON_OOM.store(0, Ordering::Relaxed);
    LOG.store(1, Ordering::Relaxed);
    let mut g = write_global();
    g.runtime = None;
    g.conf_override = None;
}

impl Runtime {
    fn new(config: Result<Config, ConfigError>) -> Self {
        let log = config.as_ref().map_or(LogLevel::Error, |c| c.log);
        Runtime {
            config,
            log,
            init_count: AtomicU32::new(0),
            config_error_logged: AtomicBool::new(false),
            slots: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            creating: Mutex::new(()),
        }
    }

    /// The configuration, or its error (logged the first time only).
    pub fn config(&self) -> Result<&Config, String> {
        match &self.config {
            Ok(c) => Ok(c),
            Err(e) => {
                let m = e.to_string();
                if !self.config_error_logged.swap(true, Ordering::Relaxed) {
                    diag::log(self.log, LogLevel::Error, &m);
                }
                Err(m)
            }
        }
    }

    /// The configuration, or its error, without logging it: for callers
    /// that report the error themselves ([`crate::vmmalloc_check_config`]).
    pub fn config_unlogged(&self) -> Result<&Config, String> {
        self.config.as_ref().map_err(|e| e.to_string())
    }

    /// Records PyTorch's device count (from the init hook).
    pub fn set_device_count(&self, n: u32) {
        self.init_count.store(n, Ordering::Relaxed);
    }

    /// Checks that `device` is a valid ordinal; returns it as an index.
    pub fn check_ordinal(&self, device: i32) -> Result<u32, String> {
        let config = self.config()?;
        let init = self.init_count.load(Ordering::Relaxed);
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
            limit = init;
            why = format!("vmmalloc_init reported {init} device(s)");
        }
        match u32::try_from(device) {
            Ok(d) if d < limit => Ok(d),
            _ => Err(format!("invalid device ordinal {device}: {why}")),
        }
    }

    /// The allocator of `device` if it exists (no creation).
    pub fn existing(&self, device: u32) -> Option<&Arc<DeviceState>> {
        self.slots.get(device as usize).and_then(OnceLock::get)
    }

    /// Devices whose allocator exists, in ordinal order.
    pub fn active_devices(&self) -> impl Iterator<Item = &Arc<DeviceState>> {
        self.slots.iter().filter_map(OnceLock::get)
    }

    /// The allocator of `device`, created on first use.
    pub fn device(&self, device: i32) -> Result<&Arc<DeviceState>, String> {
        let ordinal = self.check_ordinal(device)?;
        let slot = &self.slots[ordinal as usize];
        if let Some(s) = slot.get() {
            return Ok(s);
        }
        let _g = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slot.get() {
            return Ok(s);
        }
        let config = self.config()?;
        let dev = crate::devices::open(config, ordinal)?;
        let policy = config.effective_policy();
        let options = config.policy_options().map_err(|e| e.to_string())?;
        let allocator = vmmalloc_alloc::build(policy, dev.clone(), &options).map_err(|e| {
            format!("cannot create the {policy} allocator on device {ordinal}: {e}")
        })?;
        let caps = dev.caps();
        diag::log(
            config.log,
            LogLevel::Info,
            &format!(
                "device {ordinal}: {policy} allocator on {} ({}, {} bytes, granularity {} bytes)",
                config.device, caps.name, caps.total_memory, caps.granularity
            ),
        );
        let state = Arc::new(DeviceState {
            ordinal,
            device: dev,
            allocator,
            history: config
                .record_history
                .then(|| History::new(config.max_entries)),
            pools: GraphPools::new(config.log),
            policy,
            options,
        });
        Ok(slot.get_or_init(|| state))
    }

    /// The configured log level, or `error` when the configuration is bad.
    pub fn log_level(&self) -> LogLevel {
        self.log
    }
}
