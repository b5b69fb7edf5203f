//! `VMMALLOC_CONF`: the plug-in's configuration.
//!
//! Same shape as `PYTORCH_CUDA_ALLOC_CONF`: `key:value` pairs separated by
//! commas, e.g. `backend:expandable,release_threshold_mb:1024`. Whitespace
//! around keys and values is ignored, empty items are skipped, and a key given
//! twice takes its last value (so `VMMALLOC_CONF="$VMMALLOC_CONF,log:info"`
//! works). Commas inside `[...]` belong to the value (PyTorch's
//! `roundup_power2_divisions:[256:1,512:2]` list syntax).
//!
//! An unknown key or a bad value is a [`ConfigError`] that names the key and
//! lists what is valid; nothing ever falls back silently to a default.
//! [`keys`] is the single list of keys, defaults and meanings that the error
//! messages and docs/pytorch.md are written from; the `expandable` keys in it
//! come from the allocator's one option table ([`vmmalloc_alloc::options`]).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use vmmalloc_alloc::caching::CachingConfig;
use vmmalloc_alloc::expandable::ExpandableConfig;
use vmmalloc_alloc::{Policy, PolicyOptions};
use vmmalloc_device::cuda::Peers;
use vmmalloc_device::{GIB, MIB};

/// The environment variable the configuration is read from.
pub const ENV_VAR: &str = "VMMALLOC_CONF";

/// One configuration key: its name, default and meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDoc {
    /// The key as written in `VMMALLOC_CONF`.
    pub name: &'static str,
    /// The default, as the user would write it (or a description of it).
    pub default: &'static str,
    /// What it does, one sentence.
    pub meaning: Cow<'static, str>,
}

/// Every key `VMMALLOC_CONF` accepts, in documentation order: `backend` and
/// `device`, then the `expandable` allocator's options from the one option
/// table ([`vmmalloc_alloc::options::OPTIONS`], in its order, documented
/// there), then the keys only the C ABI has ([`OWN_KEYS`]).
pub fn keys() -> Vec<KeyDoc> {
    let (head, tail) = OWN_KEYS.split_at(2);
    head.iter()
        .cloned()
        .chain(
            vmmalloc_alloc::options::OPTIONS
                .iter()
                .filter_map(option_key),
        )
        .chain(tail.iter().cloned())
        .collect()
}

/// The `VMMALLOC_CONF` key of an `expandable` option (none for options that
/// are not keys), its meaning the table's with the unit of its values.
fn option_key(o: &vmmalloc_alloc::options::OptionDef) -> Option<KeyDoc> {
    let (name, unit) = o.conf?;
    let unit = match unit {
        MIB => " (a whole number of MiB)",
        GIB => " (a whole number of GiB)",
        _ => "",
    };
    Some(KeyDoc {
        name,
        default: o.default,
        meaning: Cow::Owned(format!("expandable: {}{unit}", o.doc)),
    })
}

/// The keys only the C ABI has, in documentation order (`backend` and
/// `device` first; [`keys`] puts the `expandable` options after them).
pub const OWN_KEYS: [KeyDoc; 16] = [
    KeyDoc {
        name: "backend",
        default: "expandable",
        meaning: Cow::Borrowed("allocation policy: expandable (ours) | caching (PyTorch's caching allocator) | \
                  torch-es (PyTorch's expandable_segments:True) | native (one driver allocation per request)"),
    },
    KeyDoc {
        name: "device",
        default: "cuda",
        meaning: Cow::Borrowed("device backend: cuda (a real GPU) | host (CPU memory with the driver's rules, for tests) | \
                  sim (bookkeeping only, no memory behind the pointers)"),
    },
    KeyDoc {
        name: "capacity_gb",
        default: "4 (host), 80 (sim)",
        meaning: Cow::Borrowed("host and sim only: device memory in GiB (decimals allowed); an error with device:cuda"),
    },
    KeyDoc {
        name: "device_count",
        default: "1",
        meaning: Cow::Borrowed("host and sim only: number of device ordinals (0 .. device_count-1)"),
    },
    KeyDoc {
        name: "record_history",
        default: "False",
        meaning: Cow::Borrowed("True: record alloc/free/segment events per device for vmmalloc_dump_snapshot's device_traces"),
    },
    KeyDoc {
        name: "max_entries",
        default: "100000",
        meaning: Cow::Borrowed("history ring buffer size per device: the oldest events are dropped beyond it"),
    },
    KeyDoc {
        name: "log",
        default: "error",
        meaning: Cow::Borrowed("stderr logging: off | error (one line per failure) | info (also allocator creation and hooks)"),
    },
    KeyDoc {
        name: "on_oom",
        default: "raise",
        meaning: Cow::Borrowed("raise: vmmalloc_malloc throws a C++ exception whose message starts with `CUDA out of memory.` \
                  (PyTorch turns it into a Python exception; it does not check a pluggable allocator's NULL) | \
                  null: malloc returns NULL on failure (the C contract; opt-in) | abort: log the report and abort"),
    },
    KeyDoc {
        name: "max_split_size_mb",
        default: "unlimited",
        meaning: Cow::Borrowed("caching, torch-es: PyTorch's max_split_size_mb (blocks at least this large are not split)"),
    },
    KeyDoc {
        name: "roundup_power2_divisions",
        default: "0 (off)",
        meaning: Cow::Borrowed("caching, torch-es: PyTorch's roundup_power2_divisions (a number or a [size:div,...] list)"),
    },
    KeyDoc {
        name: "garbage_collection_threshold",
        default: "0 (off)",
        meaning: Cow::Borrowed("caching, torch-es: PyTorch's garbage_collection_threshold, a fraction in (0, 1)"),
    },
    KeyDoc {
        name: "expandable_segments",
        default: "False",
        meaning: Cow::Borrowed("caching only: accepted for PYTORCH_CUDA_ALLOC_CONF compatibility; use backend:torch-es instead"),
    },
    KeyDoc {
        name: "peers",
        default: "auto",
        meaning: Cow::Borrowed("cuda: devices granted read-write access to every mapping: auto (every device with \
                  cuDeviceCanAccessPeer = 1) | none | ordinals joined by + (e.g. 1+2; each must exist and be \
                  peer-capable)"),
    },
    KeyDoc {
        name: "ipc",
        default: "auto",
        meaning: Cow::Borrowed("cuda: request CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR on every cuMemCreate so memory can be \
                  shared with other processes (IPC): auto (where the device supports it) | True (opening fails \
                  where it does not) | False (export fails with an error)"),
    },
    KeyDoc {
        name: "nccl_register",
        default: "True",
        meaning: Cow::Borrowed("torch companion: serve NCCL's register hook (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK, \
                  register_mem_pool): each run of mapped memory is a segment entry for PyTorch's trace trackers, \
                  deregistered before any of it is unmapped or moved | False: the hook is not served and enable() \
                  turns it off (sets the variable to 0, with a warning). cuda: True also creates memory as NCCL's \
                  ncclMemAlloc does: CU_MEM_HANDLE_TYPE_FABRIC requested where the device reports it (dropped if \
                  cuMemCreate refuses it), gpuDirectRDMACapable where supported, and \
                  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED as the page; False keeps the minimum granularity"),
    },
    KeyDoc {
        name: "share",
        default: "none (this process's limit alone)",
        meaning: Cow::Borrowed("expandable: join the shared budget NAME on each device (created on first use with the \
                  device's memory as its total): every process of the group charges it before it creates \
                  memory, so together they never hold more than its total; caps are set with `vmmalloc share \
                  NAME` (docs/share.md)"),
    },
];

/// The names in [`keys`], comma-separated, for error messages.
pub fn key_names() -> String {
    keys().iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
}

/// A configuration error. Its message names the key and what is valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ENV_VAR}: {message}")]
pub struct ConfigError {
    /// The key at fault, if the error is about one key.
    pub key: Option<String>,
    /// What is wrong and what is valid.
    pub message: String,
}

impl ConfigError {
    fn bad_value(key: &str, value: &str, valid: &str) -> Self {
        ConfigError {
            key: Some(key.to_string()),
            message: format!("bad value `{value}` for key `{key}`; valid: {valid}"),
        }
    }
}

/// Which [`vmmalloc_device::Device`] backend the allocators run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A real GPU through the CUDA driver.
    Cuda,
    /// CPU memory with the driver's rules (memfd + mmap): pointers are writable.
    Host,
    /// Bookkeeping only; pointers are not backed by memory.
    Sim,
}

impl DeviceKind {
    /// Every kind, in documentation order.
    pub const ALL: [DeviceKind; 3] = [DeviceKind::Cuda, DeviceKind::Host, DeviceKind::Sim];

    /// The kind's name in `VMMALLOC_CONF`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Host => "host",
            DeviceKind::Sim => "sim",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How much the plug-in writes to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Nothing.
    Off,
    /// One line per failed call.
    Error,
    /// Failures, plus allocator creation, configuration and hooks.
    Info,
}

impl LogLevel {
    /// Every level, quietest first.
    pub const ALL: [LogLevel; 3] = [LogLevel::Off, LogLevel::Error, LogLevel::Info];

    /// The level's name in `VMMALLOC_CONF`.
    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Off => "off",
            LogLevel::Error => "error",
            LogLevel::Info => "info",
        }
    }
}

/// What `vmmalloc_malloc` does when the allocator is out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOom {
    /// `vmmalloc_malloc` (the C++ shim) throws; `vmmalloc_try_malloc` returns the error code.
    Raise,
    /// Return NULL (and set the last error).
    Null,
    /// Log the report and abort the process.
    Abort,
}

impl OnOom {
    /// Every choice, default first.
    pub const ALL: [OnOom; 3] = [OnOom::Raise, OnOom::Null, OnOom::Abort];

    /// The choice's name in `VMMALLOC_CONF`.
    pub fn name(self) -> &'static str {
        match self {
            OnOom::Raise => "raise",
            OnOom::Null => "null",
            OnOom::Abort => "abort",
        }
    }
}

/// The parsed configuration. [`Default`] is what an empty `VMMALLOC_CONF` means.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `backend`: the allocation policy.
    pub backend: Policy,
    /// The `expandable` options (`page_size_mb`, `max_chunk_mb`, `unpin`,
    /// ...), read through the one option table, [`vmmalloc_alloc::options`].
    pub expandable: ExpandableConfig,
    /// `device`: the device backend.
    pub device: DeviceKind,
    /// `capacity_gb`: host/sim device memory in bytes (`None`: 4 GiB host, 80 GiB sim).
    pub capacity: Option<u64>,
    /// `device_count`: host/sim device ordinals.
    pub device_count: u32,
    /// `record_history`: keep an event history for snapshots.
    pub record_history: bool,
    /// `max_entries`: history ring-buffer size per device.
    pub max_entries: usize,
    /// `log`: stderr verbosity.
    pub log: LogLevel,
    /// `on_oom`: raise, NULL or abort.
    pub on_oom: OnOom,
    /// The PyTorch allocator keys (`max_split_size_mb`,
    /// `roundup_power2_divisions`, `garbage_collection_threshold`), parsed
    /// straight into PyTorch's config by its own parser
    /// ([`CachingConfig::set`]) for caching and torch-es.
    pub caching: CachingConfig,
    /// Those keys as given, last value per key, for `allocator_settings`.
    caching_given: Vec<(String, String)>,
    /// `expandable_segments` (caching; accepted for compatibility).
    pub expandable_segments: Option<bool>,
    /// The text this configuration was parsed from.
    pub source: String,
    /// `peers`: devices granted access to every mapping (cuda).
    pub peers: Peers,
    /// `ipc`: request exportable (POSIX fd) handles (cuda): `None` = auto
    /// (where the device supports them), `Some(b)` = True / False.
    pub ipc: Option<bool>,
    /// `share`: the shared budget group joined on each device
    /// (docs/share.md), `None` for none.
    pub share: Option<String>,
    /// `nccl_register`: whether the torch companion serves NCCL's register
    /// hook (segment entries for PyTorch's trace trackers, issue 43).
    pub nccl_register: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backend: Policy::Expandable,
            device: DeviceKind::Cuda,
            expandable: ExpandableConfig::default(),
            capacity: None,
            device_count: 1,
            record_history: false,
            max_entries: 100_000,
            log: LogLevel::Error,
            on_oom: OnOom::Raise,
            caching: CachingConfig::default(),
            caching_given: Vec::new(),
            expandable_segments: None,
            source: String::new(),
            peers: Peers::Auto,
            ipc: None,
            share: None,
            nccl_register: true,
        }
    }
}

/// Default host capacity: small enough for a CI machine.
pub const DEFAULT_HOST_CAPACITY: u64 = 4 * GIB;
/// Default sim capacity: an 80 GiB GPU.
pub const DEFAULT_SIM_CAPACITY: u64 = 80 * GIB;
/// Granularity of the host and sim devices the plug-in creates.
pub const MODEL_GRANULARITY: u64 = 2 * MIB;

impl Config {
    /// Reads `VMMALLOC_CONF` (unset means the defaults).
    pub fn from_env() -> Result<Config, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(s) => Config::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError {
                key: None,
                message: "the value is not valid UTF-8".into(),
            }),
        }
    }

    /// Parses `key:value,key:value` (`key=value` too, as `vmmalloc`'s policy
    /// specs write it: the key ends at its first `:` or `=`).
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut c = Config {
            source: text.to_string(),
            ..Config::default()
        };
        for item in split_items(text)? {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = vmmalloc_alloc::split_option(item).ok_or_else(|| ConfigError {
                key: Some(item.to_string()),
                message: format!(
                    "`{item}` is not a key:value pair; valid keys: {}",
                    key_names()
                ),
            })?;
            c.set(key.trim(), value.trim())?;
        }
        c.check()?;
        Ok(c)
    }

    fn set(&mut self, key: &str, v: &str) -> Result<(), ConfigError> {
        // The expandable options, by their VMMALLOC_CONF name
        // (`max_chunk_mb:20`) or their policy-spec name (`max_chunk:20MiB`,
        // as `vmmalloc replay --policy expandable:max_chunk=20MiB` writes
        // it): one table, vmmalloc_alloc::options.
        if vmmalloc_alloc::options::find(key).is_some_and(|(o, _)| o.conf.is_some()) {
            return vmmalloc_alloc::options::set(&mut self.expandable, key, v)
                .map(drop)
                .map_err(|valid| ConfigError::bad_value(key, v, &valid));
        }
        match key {
            "backend" => {
                self.backend = Policy::from_str(v).map_err(|_| {
                    ConfigError::bad_value(key, v, &Policy::ALL.map(Policy::name).join(" | "))
                })?
            }
            "device" => {
                self.device = DeviceKind::ALL
                    .into_iter()
                    .find(|d| d.name() == v)
                    .ok_or_else(|| {
                        ConfigError::bad_value(
                            key,
                            v,
                            &DeviceKind::ALL.map(DeviceKind::name).join(" | "),
                        )
                    })?
            }
            "capacity_gb" => {
                let gb = positive_float(key, v)?;
                let bytes = (gb * GIB as f64) as u64 / MODEL_GRANULARITY * MODEL_GRANULARITY;
                if bytes == 0 || gb > (1u64 << 20) as f64 {
                    return Err(ConfigError::bad_value(
                        key,
                        v,
                        "a number of GiB from 0.002 (one 2 MiB page) to 1048576",
                    ));
                }
                self.capacity = Some(bytes);
            }
            "device_count" => {
                let n = positive_int(key, v)?;
                if n > crate::runtime::MAX_DEVICES as u64 {
                    return Err(ConfigError::bad_value(
                        key,
                        v,
                        &format!("an integer from 1 to {}", crate::runtime::MAX_DEVICES),
                    ));
                }
                self.device_count = n as u32;
            }
            "record_history" => self.record_history = boolean(key, v)?,
            "max_entries" => {
                let n = positive_int(key, v)?;
                self.max_entries = usize::try_from(n).map_err(|_| {
                    ConfigError::bad_value(key, v, "a positive integer that fits in memory")
                })?;
            }
            "log" => {
                self.log = LogLevel::ALL
                    .into_iter()
                    .find(|l| l.name() == v)
                    .ok_or_else(|| {
                        ConfigError::bad_value(
                            key,
                            v,
                            &LogLevel::ALL.map(LogLevel::name).join(" | "),
                        )
                    })?
            }
            "on_oom" => {
                self.on_oom = OnOom::ALL
                    .into_iter()
                    .find(|o| o.name() == v)
                    .ok_or_else(|| {
                        ConfigError::bad_value(key, v, &OnOom::ALL.map(OnOom::name).join(" | "))
                    })?
            }
            "max_split_size_mb" | "roundup_power2_divisions" | "garbage_collection_threshold" => {
                // PyTorch's own parser and checks, as the CLI's policy specs use it.
                self.caching.set(key, v).map_err(|e| {
                    ConfigError::bad_value(
                        key,
                        v,
                        &format!("as PYTORCH_CUDA_ALLOC_CONF takes it ({e})"),
                    )
                })?;
                self.caching_given.retain(|(k, _)| k != key);
                self.caching_given.push((key.to_string(), v.to_string()));
            }
            "expandable_segments" => self.expandable_segments = Some(boolean(key, v)?),
            "peers" => self.peers = parse_peers(key, v)?,
            "share" => {
                vmmalloc_alloc::share::check_name(v).map_err(|_| {
                    ConfigError::bad_value(
                        key,
                        v,
                        "a group name of 1 to 64 of A-Z a-z 0-9 _ . - (not starting with a dot)",
                    )
                })?;
                self.share = Some(v.to_string());
            }
            "nccl_register" => self.nccl_register = boolean(key, v)?,
            "ipc" => {
                self.ipc = match v {
                    "auto" => None,
                    _ => Some(
                        boolean(key, v)
                            .map_err(|_| ConfigError::bad_value(key, v, "auto | True | False"))?,
                    ),
                }
            }
            _ => {
                return Err(ConfigError {
                    key: Some(key.to_string()),
                    message: format!("unknown key `{key}`; valid keys: {}", key_names()),
                })
            }
        }
        Ok(())
    }

    /// Checks combinations of keys.
    fn check(&self) -> Result<(), ConfigError> {
        if self.device == DeviceKind::Cuda {
            for (given, key) in [
                (self.capacity.is_some(), "capacity_gb"),
                (self.device_count != 1, "device_count"),
            ] {
                if given {
                    return Err(ConfigError {
                        key: Some(key.into()),
                        message: format!(
                            "`{key}` applies to device:host and device:sim only; on device:cuda the GPU decides \
                             (limit memory with torch.cuda.set_per_process_memory_fraction)"
                        ),
                    });
                }
            }
        }
        self.policy_options()?;
        if self.share.is_some() && self.effective_policy() != Policy::Expandable {
            return Err(ConfigError {
                key: Some("share".into()),
                message: format!(
                    "`share` needs backend:expandable (only its physical layer charges a shared budget); \
                     backend is {}",
                    self.effective_policy()
                ),
            });
        }
        if self.expandable_segments == Some(true) && self.backend != Policy::Caching {
            return Err(ConfigError {
                key: Some("expandable_segments".into()),
                message: format!(
                    "`expandable_segments:True` only makes sense with backend:caching (it selects torch-es); \
                     backend is {}",
                    self.backend
                ),
            });
        }
        Ok(())
    }

    /// The policy actually built: `backend:caching` with `expandable_segments:True`
    /// is PyTorch's expandable segments, i.e. `torch-es`.
    pub fn effective_policy(&self) -> Policy {
        if self.backend == Policy::Caching && self.expandable_segments == Some(true) {
            Policy::TorchEs
        } else {
            self.backend
        }
    }

    /// Memory of each host/sim device, in bytes.
    pub fn model_capacity(&self) -> u64 {
        self.capacity.unwrap_or(match self.device {
            DeviceKind::Sim => DEFAULT_SIM_CAPACITY,
            _ => DEFAULT_HOST_CAPACITY,
        })
    }

    /// The PyTorch caching options as `PYTORCH_CUDA_ALLOC_CONF` text (for the
    /// baselines' parser and for `allocator_settings`).
    pub fn pytorch_alloc_conf(&self) -> String {
        let mut parts: Vec<String> = self
            .caching_given
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect();
        if let Some(e) = self.expandable_segments {
            parts.push(format!(
                "expandable_segments:{}",
                if e { "True" } else { "False" }
            ));
        }
        parts.join(",")
    }

    /// The options handed to [`vmmalloc_alloc::build`]: the expandable keys
    /// as the option table set them ([`vmmalloc_alloc::options`]), the
    /// PyTorch keys as [`CachingConfig::set`] parsed them.
    pub fn policy_options(&self) -> Result<PolicyOptions, ConfigError> {
        let mut caching = self.caching.clone();
        if let Some(e) = self.expandable_segments {
            caching.expandable_segments = e;
        }
        Ok(PolicyOptions {
            expandable: self.expandable.clone(),
            caching,
            // The plug-in's fraction comes from PyTorch (`set_memory_fraction_fn`).
            memory_fraction: None,
        })
    }

    /// `key: value` for every setting, for `allocator_settings` and the summary.
    pub fn settings(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            ("backend", self.effective_policy().name().to_string()),
            ("device", self.device.name().to_string()),
        ];
        // The expandable options, as the one table shows them.
        out.extend(
            vmmalloc_alloc::options::OPTIONS
                .iter()
                .filter_map(|o| Some((o.conf?.0, o.show(&self.expandable)))),
        );
        out.extend([
            (
                "capacity_gb",
                match self.device {
                    DeviceKind::Cuda => "device".to_string(),
                    _ => format!("{}", self.model_capacity() as f64 / GIB as f64),
                },
            ),
            ("device_count", self.device_count.to_string()),
            (
                "record_history",
                if self.record_history { "True" } else { "False" }.to_string(),
            ),
            ("max_entries", self.max_entries.to_string()),
            ("log", self.log.name().to_string()),
            ("on_oom", self.on_oom.name().to_string()),
            ("pytorch_alloc_conf", self.pytorch_alloc_conf()),
            (
                "peers",
                match &self.peers {
                    Peers::Auto => "auto".to_string(),
                    Peers::None => "none".to_string(),
                    Peers::List(l) => l.iter().map(u32::to_string).collect::<Vec<_>>().join("+"),
                },
            ),
            (
                "ipc",
                match self.ipc {
                    None => "auto",
                    Some(true) => "True",
                    Some(false) => "False",
                }
                .to_string(),
            ),
            ("share", self.share.clone().unwrap_or_else(|| "none".into())),
            (
                "nccl_register",
                if self.nccl_register { "True" } else { "False" }.to_string(),
            ),
        ]);
        out
    }
}

/// The `VMMALLOC_CONF` items that ask vmmalloc for what a
/// `PYTORCH_CUDA_ALLOC_CONF` line asks PyTorch for, comma-joined (empty when
/// nothing carries over): `backend` (PyTorch's `native` is vmmalloc's
/// `caching`; `cudaMallocAsync` has no counterpart) and the keys both read
/// (`max_split_size_mb`, `roundup_power2_divisions`,
/// `garbage_collection_threshold`, `expandable_segments`, which implies
/// `backend:caching`). vmmalloc replaces the allocator that reads that
/// variable; the Python package's warning quotes this line
/// (`vmmalloc_pytorch_conf_line`), so the library is the one reader of both
/// variables. Items split as PyTorch splits them: commas inside `[...]`
/// belong to the value.
pub fn from_pytorch_alloc_conf(text: &str) -> String {
    let mut items: Vec<String> = Vec::new();
    let mut backend = false;
    for item in split_items(text).unwrap_or_default() {
        let Some((key, value)) = vmmalloc_alloc::split_option(item.trim()) else {
            continue;
        };
        match key {
            "backend" => {
                let mapped = match value {
                    "expandable" | "caching" | "torch-es" => Some(value),
                    // PyTorch's `native` is its caching allocator
                    // (c10/cuda/CUDAAllocatorConfig.cpp, parseAllocatorConfig).
                    v if v.eq_ignore_ascii_case("native") => Some("caching"),
                    _ => None,
                };
                if let Some(b) = mapped {
                    items.push(format!("backend:{b}"));
                    backend = true;
                }
            }
            "max_split_size_mb"
            | "roundup_power2_divisions"
            | "garbage_collection_threshold"
            | "expandable_segments" => items.push(format!("{key}:{value}")),
            _ => {}
        }
    }
    let es = items
        .iter()
        .any(|i| i.eq_ignore_ascii_case("expandable_segments:true"));
    if es && !backend {
        items.insert(0, "backend:caching".to_string());
    }
    items.join(",")
}

/// Splits on commas outside `[...]`.
fn split_items(text: &str) -> Result<Vec<&str>, ConfigError> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, ch) in text.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    break;
                }
            }
            ',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(ConfigError {
            key: None,
            message: format!("unbalanced `[` `]` in `{text}`"),
        });
    }
    items.push(&text[start..]);
    Ok(items)
}

fn int(key: &str, v: &str) -> Result<u64, ConfigError> {
    v.parse::<u64>()
        .ok()
        .filter(|n| n.checked_mul(GIB).is_some())
        .ok_or_else(|| ConfigError::bad_value(key, v, "a non-negative integer"))
}

fn positive_int(key: &str, v: &str) -> Result<u64, ConfigError> {
    match int(key, v) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ConfigError::bad_value(key, v, "a positive integer")),
    }
}

fn positive_float(key: &str, v: &str) -> Result<f64, ConfigError> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(ConfigError::bad_value(key, v, "a positive number")),
    }
}

fn boolean(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(ConfigError::bad_value(key, v, "True | False")),
    }
}

/// `auto` | `none` | ordinals joined by `+` (`1+2`). Whether each ordinal
/// exists and can access the device is checked when the device opens.
fn parse_peers(key: &str, v: &str) -> Result<Peers, ConfigError> {
    let valid = "auto | none | device ordinals joined by + (e.g. 1+2)";
    match v {
        "auto" => Ok(Peers::Auto),
        "none" => Ok(Peers::None),
        _ => v
            .split('+')
            .map(|p| {
                p.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| (n as usize) < crate::runtime::MAX_DEVICES)
                    .ok_or_else(|| ConfigError::bad_value(key, v, valid))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Peers::List),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_default() {
        let c = Config::parse("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(Config::parse(" , ,").unwrap().backend, Policy::Expandable);
    }

    #[test]
    fn every_key_parses() {
        let c = Config::parse(
            "backend:native, device:host,page_size_mb:4,arena_gb:64,release_threshold_mb:0,capacity_gb:0.5,\
             device_count:2,record_history:True,max_entries:10,log:info,on_oom:abort",
        )
        .unwrap();
        assert_eq!(c.backend, Policy::Native);
        assert_eq!(c.device, DeviceKind::Host);
        assert_eq!(c.expandable.page_size, Some(4 * MIB));
        assert_eq!(c.expandable.arena_size, Some(64 * GIB));
        assert_eq!(c.expandable.release_threshold, 0);
        assert_eq!(c.capacity, Some(GIB / 2));
        assert_eq!(c.device_count, 2);
        assert!(c.record_history);
        assert_eq!(c.max_entries, 10);
        assert_eq!(c.log, LogLevel::Info);
        assert_eq!(c.on_oom, OnOom::Abort);
        let p = Config::parse(
            "backend:caching,max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:8],\
             garbage_collection_threshold:0.6,expandable_segments:True",
        )
        .unwrap();
        assert_eq!(p.caching.max_split_size, 512 * MIB);
        assert_eq!(
            p.caching,
            CachingConfig::parse("max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6").unwrap()
        );
        assert_eq!(p.effective_policy(), Policy::TorchEs);
        assert_eq!(
            p.pytorch_alloc_conf(),
            "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,\
             expandable_segments:True"
        );
    }

    #[test]
    fn every_documented_key_is_accepted() {
        let sample = |k: &str| match k {
            "backend" => "native",
            "device" => "sim",
            "record_history" | "expandable_segments" => "False",
            "log" => "off",
            "on_oom" => "null",
            "capacity_gb" => "1",
            "garbage_collection_threshold" => "0.5",
            "max_split_size_mb" => "64",
            _ => "1",
        };
        for k in keys() {
            let text = format!("device:sim,{}:{}", k.name, sample(k.name));
            Config::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    #[test]
    fn options_reach_the_policies() {
        let c = Config::parse(
            "page_size_mb:4,arena_gb:16,release_threshold_mb:256,max_split_size_mb:64,\
             roundup_power2_divisions:4,garbage_collection_threshold:0.5,max_chunk_mb:64,\
             split_threshold:0.25,split_slack_mb:6",
        )
        .unwrap();
        let o = c.policy_options().unwrap();
        assert_eq!(o.expandable.split_slack, 6 * MIB);
        let none = Config::parse("split_slack_mb:0")
            .unwrap()
            .policy_options()
            .unwrap();
        assert_eq!(none.expandable.split_slack, 0);
        let default = Config::parse("").unwrap().policy_options().unwrap();
        assert_eq!(
            default.expandable.split_slack,
            vmmalloc_alloc::expandable::DEFAULT_SPLIT_SLACK
        );
        use vmmalloc_alloc::expandable::UnpinMode;
        assert_eq!(default.expandable.unpin, UnpinMode::Auto);
        for (v, want) in [
            ("auto", UnpinMode::Auto),
            ("always", UnpinMode::Always),
            ("true", UnpinMode::Always),
            ("false", UnpinMode::Never),
        ] {
            let c = Config::parse(&format!("unpin:{v}")).unwrap();
            assert_eq!(c.policy_options().unwrap().expandable.unpin, want, "{v}");
        }
        let off = Config::parse("unpin:false").unwrap();
        assert!(off
            .settings()
            .iter()
            .any(|(k, v)| *k == "unpin" && v == "false"));
        assert!(Config::parse("unpin:maybe").is_err());
        assert_eq!(
            default.expandable.grow_granule,
            vmmalloc_alloc::expandable::DEFAULT_GROW_GRANULE
        );
        let flat = Config::parse("grow_mb:0").unwrap();
        assert_eq!(flat.policy_options().unwrap().expandable.grow_granule, 0);
        assert!(Config::parse("grow_mb:-2").is_err());
        assert_eq!(o.expandable.max_chunk, Some(64 * MIB));
        assert_eq!(o.expandable.split_threshold, 0.25);
        assert_eq!(o.expandable.page_size, Some(4 * MIB));
        assert_eq!(o.expandable.arena_size, Some(16 * GIB));
        assert_eq!(o.expandable.release_threshold, 256 * MIB);
        assert_eq!(o.caching.max_split_size, 64 * MIB);
        assert_eq!(o.caching.roundup_power2_divisions[0], 4);
        assert_eq!(o.caching.garbage_collection_threshold, 0.5);
        let d = Config::default().policy_options().unwrap();
        assert_eq!(d, PolicyOptions::default());
    }

    #[test]
    fn a_pytorch_line_becomes_the_vmmalloc_line_that_asks_the_same() {
        for (pytorch, want) in [
            ("", ""),
            ("backend:caching", "backend:caching"),
            (
                "backend:native,max_split_size_mb:128",
                "backend:caching,max_split_size_mb:128",
            ),
            (
                "expandable_segments:True",
                "backend:caching,expandable_segments:True",
            ),
            ("backend:cudaMallocAsync", ""),
            ("pinned_use_cuda_host_register:True", ""),
            // A list stays one value (PyTorch's tokenizer keeps `[...]` whole).
            (
                "roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6",
                "roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6",
            ),
        ] {
            let got = from_pytorch_alloc_conf(pytorch);
            assert_eq!(got, want, "{pytorch}");
            // What it asks for is a valid VMMALLOC_CONF.
            Config::parse(&got).unwrap_or_else(|e| panic!("{got}: {e}"));
        }
    }

    #[test]
    fn the_expandable_keys_are_the_option_tables() {
        // Every VMMALLOC_CONF name of the one option table is a documented
        // key, and each key sets what the CLI's policy spec sets with it
        // (one parser: vmmalloc_alloc::options).
        for o in &vmmalloc_alloc::options::OPTIONS {
            let Some((conf, unit)) = o.conf else {
                assert!(Config::parse(&format!("{}:0.5", o.name)).is_err());
                continue;
            };
            assert!(
                keys().iter().any(|k| k.name == conf),
                "{conf} is not in keys()"
            );
            let value = match o.kind {
                vmmalloc_alloc::options::Kind::Bool => "true".to_string(),
                vmmalloc_alloc::options::Kind::Unpin => "false".to_string(),
                vmmalloc_alloc::options::Kind::Fraction => "0.5".to_string(),
                _ => (8 * MIB.max(unit) / unit).to_string(),
            };
            let c = Config::parse(&format!("{conf}:{value}")).unwrap();
            let spec: vmmalloc_alloc::PolicySpec =
                format!("expandable:{conf}={value}").parse().unwrap();
            assert_eq!(
                c.policy_options().unwrap().expandable,
                spec.options.expandable,
                "{conf}"
            );
            assert_ne!(c.expandable, ExpandableConfig::default(), "{conf}");
            let shown = c.settings();
            let (_, v) = shown.iter().find(|(k, _)| *k == conf).unwrap();
            assert_eq!(v, &value, "{conf}");
        }
    }

    #[test]
    fn the_expandable_keys_are_written_once_in_the_option_table() {
        // keys() takes each expandable key's default and meaning from
        // vmmalloc_alloc::options::OPTIONS; no key is listed twice, and the
        // C ABI's own keys name no option of that table.
        let all = keys();
        for (i, k) in all.iter().enumerate() {
            assert!(
                all[..i].iter().all(|o| o.name != k.name),
                "{} twice",
                k.name
            );
        }
        for o in &vmmalloc_alloc::options::OPTIONS {
            let Some((conf, _)) = o.conf else { continue };
            assert!(OWN_KEYS.iter().all(|k| k.name != conf), "{conf} twice");
            let k = all.iter().find(|k| k.name == conf).unwrap();
            assert_eq!(k.default, o.default, "{conf}");
            assert!(k.meaning.starts_with("expandable: "), "{conf}");
            assert!(k.meaning.contains(o.doc), "{conf}");
        }
        assert_eq!(
            all.len(),
            OWN_KEYS.len()
                + vmmalloc_alloc::options::OPTIONS
                    .iter()
                    .filter(|o| o.conf.is_some())
                    .count()
        );
        assert_eq!(&all[..2], &OWN_KEYS[..2], "backend and device first");
    }

    #[test]
    fn docs_describe_every_key() {
        let doc = include_str!("../../../docs/pytorch.md");
        for k in keys() {
            let row = format!("| `{}` |", k.name);
            assert!(
                doc.contains(&row),
                "docs/pytorch.md has no table row for `{}`",
                k.name
            );
        }
    }

    #[test]
    fn peers_and_ipc_parse_or_name_the_key() {
        let c = Config::default();
        assert_eq!((c.peers.clone(), c.ipc), (Peers::Auto, None));
        assert_eq!(Config::parse("ipc:auto").unwrap().ipc, None);
        assert_eq!(Config::parse("ipc:False").unwrap().ipc, Some(false));
        assert_eq!(Config::parse("peers:none").unwrap().peers, Peers::None);
        assert_eq!(Config::parse("peers:auto").unwrap().peers, Peers::Auto);
        assert_eq!(
            Config::parse("peers:1+2,ipc:True").unwrap().peers,
            Peers::List(vec![1, 2])
        );
        assert_eq!(Config::parse("ipc:true").unwrap().ipc, Some(true));
        for (text, key) in [
            ("peers:1,2", "2"),
            ("peers:all", "peers"),
            ("peers:1+x", "peers"),
            ("peers:64", "peers"),
            ("peers:", "peers"),
            ("ipc:yes", "ipc"),
            ("ipc:2", "ipc"),
        ] {
            let e = Config::parse(text).unwrap_err();
            assert_eq!(e.key.as_deref(), Some(key), "{text}: {e}");
        }
        let s = Config::parse("peers:3+1").unwrap().settings();
        assert!(s.contains(&("peers", "3+1".to_string())), "{s:?}");
    }

    #[test]
    fn last_value_wins() {
        assert_eq!(
            Config::parse("backend:native,backend:caching")
                .unwrap()
                .backend,
            Policy::Caching
        );
    }

    #[test]
    fn unknown_key_names_it_and_lists_valid_ones() {
        let e = Config::parse("backend:native,colour:blue").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("colour"));
        let m = e.to_string();
        assert!(m.starts_with("VMMALLOC_CONF: unknown key `colour`"), "{m}");
        for k in keys() {
            assert!(m.contains(k.name), "{m} lacks {}", k.name);
        }
    }

    #[test]
    fn bad_values_name_the_key_and_the_choices() {
        for (text, key, needle) in [
            (
                "backend:fast",
                "backend",
                "expandable | caching | torch-es | native",
            ),
            ("device:tpu", "device", "cuda | host | sim"),
            ("log:loud", "log", "off | error | info"),
            ("on_oom:panic", "on_oom", "raise | null | abort"),
            ("record_history:yes", "record_history", "True | False"),
            ("page_size_mb:0", "page_size_mb", "positive integer"),
            ("page_size_mb:-2", "page_size_mb", "positive integer"),
            ("arena_gb:1.5", "arena_gb", "positive integer"),
            ("max_chunk_mb:0", "max_chunk_mb", "positive integer"),
            ("split_threshold:1.5", "split_threshold", "[0, 1]"),
            ("split_threshold:x", "split_threshold", "[0, 1]"),
            (
                "split_slack_mb:2.5",
                "split_slack_mb",
                "non-negative integer",
            ),
            (
                "split_slack_mb:-1",
                "split_slack_mb",
                "non-negative integer",
            ),
            (
                "release_threshold_mb:x",
                "release_threshold_mb",
                "non-negative integer",
            ),
            (
                "device:host,capacity_gb:0",
                "capacity_gb",
                "positive number",
            ),
            (
                "device:host,capacity_gb:nan",
                "capacity_gb",
                "positive number",
            ),
            (
                "device:sim,capacity_gb:0.0001",
                "capacity_gb",
                "one 2 MiB page",
            ),
            ("device:sim,device_count:65", "device_count", "1 to 64"),
            ("max_entries:0", "max_entries", "positive integer"),
            // PyTorch's own checks and words (AcceleratorAllocatorConfig:
            // 20 MiB, kLargeBuffer, is the least).
            ("max_split_size_mb:19", "max_split_size_mb", "must be >= 20"),
            (
                "roundup_power2_divisions:3",
                "roundup_power2_divisions",
                "power of 2",
            ),
            (
                "roundup_power2_divisions:[256:3]",
                "roundup_power2_divisions",
                "power of 2",
            ),
            (
                "garbage_collection_threshold:1.0",
                "garbage_collection_threshold",
                "set it in (0.0, 1.0)",
            ),
            (
                "capacity_gb:4",
                "capacity_gb",
                "device:host and device:sim only",
            ),
            (
                "device_count:2",
                "device_count",
                "device:host and device:sim only",
            ),
            (
                "backend:native,expandable_segments:True",
                "expandable_segments",
                "backend:caching",
            ),
        ] {
            let e = Config::parse(text).unwrap_err();
            assert_eq!(e.key.as_deref(), Some(key), "{text}: {e}");
            let m = e.to_string();
            assert!(m.contains(key) && m.contains(needle), "{text}: {m}");
        }
    }

    #[test]
    fn both_separators_and_both_name_sets_are_accepted() {
        // `key=value` as policy specs write it, and the spec names with sizes.
        let a = Config::parse("backend:expandable,max_chunk_mb:20,grow_mb:0,unpin:false").unwrap();
        for text in [
            "backend=expandable,max_chunk_mb=20,grow_mb=0,unpin=false",
            "backend:expandable,max_chunk:20MiB,grow_granule:0,unpin:false",
            "backend=expandable,max_chunk=20MiB,grow_granule=0,unpin=false",
        ] {
            let b = Config::parse(text).unwrap();
            assert_eq!(
                (
                    b.expandable.max_chunk,
                    b.expandable.grow_granule,
                    b.expandable.unpin
                ),
                (
                    a.expandable.max_chunk,
                    a.expandable.grow_granule,
                    a.expandable.unpin
                ),
                "{text}"
            );
            assert_eq!(
                b.policy_options().unwrap(),
                a.policy_options().unwrap(),
                "{text}"
            );
        }
        let c =
            Config::parse("arena_size=64GiB,split_slack=8MiB,page_size:4MiB,release_threshold:0")
                .unwrap();
        assert_eq!(
            (
                c.expandable.arena_size,
                c.expandable.split_slack,
                c.expandable.page_size,
                c.expandable.release_threshold
            ),
            (Some(64 * GIB), 8 * MIB, Some(4 * MIB), 0)
        );
        // A size by its spec name is exact; allocator_settings shows it in
        // the VMMALLOC_CONF unit, exactly.
        let c = Config::parse("max_chunk:3KiB").unwrap();
        assert_eq!(c.expandable.max_chunk, Some(3 << 10));
        let shown = c.settings();
        let (_, v) = shown.iter().find(|(k, _)| *k == "max_chunk_mb").unwrap();
        assert_eq!(v, "0.0029296875");
        // memory_fraction is a policy option, not a VMMALLOC_CONF key (the
        // plug-in's fraction comes from PyTorch).
        let e = Config::parse("memory_fraction:0.5").unwrap_err();
        assert!(e.to_string().contains("unknown key"), "{e}");
        let e = Config::parse("max_chunk:lots").unwrap_err();
        assert!(e.to_string().contains("max_chunk"), "{e}");
    }

    #[test]
    fn share_takes_a_group_name_and_needs_expandable() {
        let c = Config::parse("share:train-1").unwrap();
        assert_eq!(c.share.as_deref(), Some("train-1"));
        assert!(c
            .settings()
            .iter()
            .any(|(k, v)| *k == "share" && v == "train-1"));
        assert_eq!(Config::default().share, None);
        let e = Config::parse("share:a/b").unwrap_err();
        assert!(
            e.to_string().contains("share") && e.to_string().contains("1 to 64"),
            "{e}"
        );
        let e = Config::parse("backend:caching,share:x").unwrap_err();
        assert!(e.to_string().contains("backend:expandable"), "{e}");
    }

    #[test]
    fn malformed_items_are_errors() {
        let e = Config::parse("backend").unwrap_err();
        assert!(e.to_string().contains("not a key:value pair"), "{e}");
        assert!(Config::parse("roundup_power2_divisions:[256:1").is_err());
        assert!(Config::parse("a]:b").is_err());
    }

    #[test]
    fn capacity_defaults_per_device() {
        assert_eq!(
            Config::parse("device:host").unwrap().model_capacity(),
            4 * GIB
        );
        assert_eq!(
            Config::parse("device:sim").unwrap().model_capacity(),
            80 * GIB
        );
        assert_eq!(
            Config::parse("device:sim,capacity_gb:1.001")
                .unwrap()
                .model_capacity(),
            GIB
        );
    }
}
