//! Generators of realistic allocation traces, deterministic by seed.
//!
//! Each workload has a parameter struct (`Default`, documented fields, and
//! `set(key, value)` for command-line overrides); [`workload_by_name`] takes
//! `name` or `name:key=value,key=value`:
//!
//! - [`train_varlen`] (`train-varlen`): transformer training with a long-tailed
//!   sequence length per batch;
//! - [`serve_kv`] (`serve-kv`): LLM serving with contiguous, re-allocated KV caches;
//! - [`frag_adversary`] (`frag-adversary`): a size pattern that defeats
//!   best-fit caching;
//! - [`rl_colocate`] (`rl-colocate`): RL post-training, trainer and inference
//!   engine on one GPU, with sleep and wake between phases.
//!
//! Sizes are realistic (peak live of a few to tens of GiB by default, for a
//! simulated 80 GiB device) while event counts stay in the tens of thousands,
//! so a full comparison runs in seconds. Addresses in generated traces are
//! plain allocation ids (1, 2, 3, …), never reused.

pub mod frag_adversary;
pub mod rl_colocate;
pub mod serve_kv;
pub mod train_varlen;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::error::{ErrorKind, Result};
use crate::model::{DeviceTrace, DeviceTraceParts, Event, EventKind, Trace};

pub use frag_adversary::FragAdversaryParams;
pub use rl_colocate::RlColocateParams;
pub use serve_kv::ServeKvParams;
pub use train_varlen::TrainVarlenParams;

/// The workload names [`workload_by_name`] knows.
pub const WORKLOADS: [&str; 4] = ["train-varlen", "serve-kv", "frag-adversary", "rl-colocate"];

/// Generates the workload `spec`: a name from [`WORKLOADS`], optionally
/// followed by `:key=value,key=value` overrides of its parameters. The trace
/// is named `spec` (trimmed).
///
/// Errors name the unknown workload or key (listing the valid ones) or the
/// value that does not parse.
pub fn workload_by_name(spec: &str) -> Result<Trace> {
    let spec = spec.trim();
    let (name, overrides) = match spec.split_once(':') {
        Some((n, o)) => (n, o),
        None => (spec, ""),
    };
    let pairs = parse_overrides(name, overrides)?;
    let mut trace = match name {
        "train-varlen" => {
            let mut p = TrainVarlenParams::default();
            for (k, v) in &pairs {
                p.set(k, v)?;
            }
            train_varlen::generate(&p)?
        }
        "serve-kv" => {
            let mut p = ServeKvParams::default();
            for (k, v) in &pairs {
                p.set(k, v)?;
            }
            serve_kv::generate(&p)?
        }
        "frag-adversary" => {
            let mut p = FragAdversaryParams::default();
            for (k, v) in &pairs {
                p.set(k, v)?;
            }
            frag_adversary::generate(&p)?
        }
        "rl-colocate" => {
            let mut p = RlColocateParams::default();
            for (k, v) in &pairs {
                p.set(k, v)?;
            }
            rl_colocate::generate(&p)?
        }
        _ => {
            return Err(ErrorKind::UnknownWorkload {
                name: name.to_string(),
                valid: WORKLOADS.join(", "),
            }
            .into());
        }
    };
    trace.name = spec.to_string();
    Ok(trace)
}

/// The parameter keys of workload `name` with their one-line docs, or `None`
/// for an unknown workload.
pub fn workload_params(name: &str) -> Option<&'static [(&'static str, &'static str)]> {
    match name {
        "train-varlen" => Some(TrainVarlenParams::KEYS),
        "serve-kv" => Some(ServeKvParams::KEYS),
        "frag-adversary" => Some(FragAdversaryParams::KEYS),
        "rl-colocate" => Some(RlColocateParams::KEYS),
        _ => None,
    }
}

/// The parameters of workload `name` with their bounds (`None`: any value
/// of the key's type), or `None` for an unknown workload.
pub fn workload_bounds(name: &str) -> Option<Vec<(&'static str, Option<String>)>> {
    match name {
        "train-varlen" => Some(TrainVarlenParams::bounds()),
        "serve-kv" => Some(ServeKvParams::bounds()),
        "frag-adversary" => Some(FragAdversaryParams::bounds()),
        "rl-colocate" => Some(RlColocateParams::bounds()),
        _ => None,
    }
}

/// The parameters of workload `name` with their default values, as the
/// command line writes them (`None`: no such workload).
pub fn workload_defaults(name: &str) -> Option<Vec<(&'static str, String)>> {
    match name {
        "train-varlen" => Some(TrainVarlenParams::defaults()),
        "serve-kv" => Some(ServeKvParams::defaults()),
        "frag-adversary" => Some(FragAdversaryParams::defaults()),
        "rl-colocate" => Some(RlColocateParams::defaults()),
        _ => None,
    }
}

/// Splits a workload's overrides (`seed=7,steps=100`; `seed:7` too, as
/// policy options and `VMMALLOC_CONF` write them: one splitter,
/// [`vmmalloc_alloc::split_option`]) into key and value pairs.
pub(crate) fn parse_overrides<'a>(workload: &str, s: &'a str) -> Result<Vec<(&'a str, &'a str)>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((k, v)) = vmmalloc_alloc::split_option(item) else {
            return Err(ErrorKind::BadParam {
                workload: workload.to_string(),
                key: item.to_string(),
                value: String::new(),
                reason: "expected key=value (or key:value)".into(),
            }
            .into());
        };
        out.push((k.trim(), v.trim()));
    }
    Ok(out)
}

/// A value a workload parameter can hold, parsed from the command line.
pub trait ParamValue: Sized {
    /// Parses `s`, or says why not.
    fn parse_param(s: &str) -> std::result::Result<Self, String>;
}

macro_rules! int_param {
    ($($t:ty),*) => {$(
        impl ParamValue for $t {
            fn parse_param(s: &str) -> std::result::Result<Self, String> {
                s.replace('_', "").parse::<$t>().map_err(|e| format!("expected a non-negative integer ({e})"))
            }
        }
    )*};
}
int_param!(u32, u64);

impl ParamValue for f64 {
    fn parse_param(s: &str) -> std::result::Result<Self, String> {
        let v: f64 = s.parse().map_err(|e| format!("expected a number ({e})"))?;
        if v.is_finite() {
            Ok(v)
        } else {
            Err("expected a finite number".into())
        }
    }
}

impl ParamValue for bool {
    fn parse_param(s: &str) -> std::result::Result<Self, String> {
        match s {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err("expected true or false".into()),
        }
    }
}

/// Declares a workload's parameter struct: fields with docs and defaults,
/// `Default`, `KEYS` (name, doc) and `set(key, value)`.
macro_rules! define_params {
    (
        $(#[$meta:meta])*
        $name:ident for $workload:literal {
            $( $(#[doc = $doc:literal])+ $field:ident : $ty:ty $([$lo:expr, $hi:expr])? = $default:expr, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name {
            $( $(#[doc = $doc])+ pub $field: $ty, )+
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $field: $default, )+ }
            }
        }

        impl $name {
            /// The workload's name.
            pub const WORKLOAD: &'static str = $workload;

            /// Every parameter key with its documentation.
            pub const KEYS: &'static [(&'static str, &'static str)] = &[
                $( (stringify!($field), concat!($($doc),+)), )+
            ];

            /// Every parameter key with its default value, as the command
            /// line writes it (e.g. `("seed", "0")`).
            pub fn defaults() -> Vec<(&'static str, String)> {
                let d = Self::default();
                vec![ $( (stringify!($field), format!("{:?}", d.$field)), )+ ]
            }

            /// Every parameter key with its bounds (`1..=1000`), `None` for a
            /// key any value of its type suits (a seed, a flag).
            pub fn bounds() -> Vec<(&'static str, Option<String>)> {
                vec![ $( (stringify!($field), None $( .or(Some(format!("{}..={}", $lo, $hi))) )? ), )+ ]
            }

            /// Sets parameter `key` from its command-line text `value`.
            ///
            /// An unknown key is an error listing the valid keys; a value that
            /// does not parse, or lies outside the key's bounds ([`Self::bounds`]:
            /// they keep a generated trace's size and time small), is an error
            /// naming the key and its bounds.
            pub fn set(&mut self, key: &str, value: &str) -> $crate::error::Result<()> {
                let bad = |reason: String| $crate::error::ErrorKind::BadParam {
                    workload: $workload.to_string(),
                    key: key.to_string(),
                    value: value.to_string(),
                    reason,
                };
                match key {
                    $( stringify!($field) => {
                        let v = <$ty as $crate::workloads::ParamValue>::parse_param(value).map_err(bad)?;
                        $(
                            if !($lo..=$hi).contains(&v) {
                                return Err(bad(format!(
                                    "must be in {}..={} (the bounds keep a generated trace small; \
                                     `vmmalloc workloads` lists them)",
                                    $lo, $hi
                                )).into());
                            }
                        )?
                        self.$field = v;
                    } )+
                    _ => {
                        return Err($crate::error::ErrorKind::UnknownParam {
                            workload: $workload.to_string(),
                            key: key.to_string(),
                            valid: Self::KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", "),
                        }
                        .into())
                    }
                }
                Ok(())
            }
        }
    };
}
pub(crate) use define_params;

/// The most events a generated trace may hold (its memory, a few hundred
/// MB, and a comparison's time grow with them; the defaults hold tens of
/// thousands): a generator stops and refuses once its trace passes it
/// ([`check_events`]). With every parameter within its bounds, one step of a
/// generator adds at most a few million events more, so memory stays bounded
/// whatever the parameters.
pub const MAX_EVENTS: usize = 4_000_000;

/// Refuses a trace that has passed [`MAX_EVENTS`] with `n` events, naming
/// the parameter `key` (of value `value`) whose loop it is in.
pub(crate) fn check_events(
    n: usize,
    workload: &str,
    key: &str,
    value: impl std::fmt::Display,
) -> Result<()> {
    if n <= MAX_EVENTS {
        return Ok(());
    }
    Err(out_of_range(
        workload,
        key,
        value,
        &format!(
            "the trace would hold more than {MAX_EVENTS} events, the most a generated trace may \
             hold; lower `{key}` (or the parameters that make each of them longer)"
        ),
    ))
}

/// One tensor a generator would allocate at its largest: what it is (with
/// its formula), its bytes, and the parameters it grows with (key, value,
/// default).
pub(crate) type Tensor<'a> = (&'a str, u128, &'a [(&'a str, u64, u64)]);

/// Refuses parameters that make one of `tensors` larger than
/// [`crate::model::MAX_SIZE`], naming the tensor and, as the value at
/// fault, its parameter furthest above its default.
pub(crate) fn check_tensors(workload: &str, tensors: &[Tensor<'_>]) -> Result<()> {
    let ratio = |&(_, v, d): &(&str, u64, u64)| v as f64 / d.max(1) as f64;
    for (what, bytes, factors) in tensors {
        if *bytes <= crate::model::MAX_SIZE as u128 {
            continue;
        }
        let Some(&(key, value, _)) = factors.iter().max_by(|a, b| ratio(a).total_cmp(&ratio(b)))
        else {
            continue;
        };
        let keys: Vec<&str> = factors.iter().map(|f| f.0).collect();
        return Err(out_of_range(
            workload,
            key,
            value,
            &format!(
                "{what} would take {bytes} bytes, more than 2^50; lower {}",
                keys.join(" or ")
            ),
        ));
    }
    Ok(())
}

/// An error for parameter `key` of `workload` that is out of range.
pub(crate) fn out_of_range(
    workload: &str,
    key: &str,
    value: impl std::fmt::Display,
    reason: &str,
) -> crate::TraceError {
    ErrorKind::BadParam {
        workload: workload.to_string(),
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
    .into()
}

/// A live allocation of a generator. Not `Clone`: freeing consumes it, so a
/// generator cannot free twice.
#[derive(Debug)]
#[must_use = "an allocation that is never freed stays live to the end of the trace; use Recorder::keep to say so"]
pub(crate) struct Buf {
    addr: u64,
    size: u64,
    stream: u64,
}

impl Buf {
    /// Requested bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// Records a generator's allocations and frees as events.
pub(crate) struct Recorder {
    events: Vec<Event>,
    next_addr: u64,
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder {
            events: Vec::new(),
            next_addr: 1,
        }
    }

    /// Allocates `size` bytes (at least 1) on `stream`.
    pub fn alloc(&mut self, size: u64, stream: u64) -> Buf {
        let size = size.max(1);
        let addr = self.next_addr;
        self.next_addr += 1;
        self.events.push(Event {
            kind: EventKind::Alloc,
            addr,
            size,
            stream,
            time_us: None,
        });
        Buf { addr, size, stream }
    }

    /// Frees `buf` (recorded on the stream it was allocated on).
    pub fn free(&mut self, buf: Buf) {
        self.events.push(Event {
            kind: EventKind::Free,
            addr: buf.addr,
            size: buf.size,
            stream: buf.stream,
            time_us: None,
        });
    }

    /// Reserves a growable region of up to `max` bytes (at least 1) on
    /// `stream`, of length 0; [`Recorder::resize`] sets its length and
    /// [`Recorder::free`] destroys it.
    pub fn reserve(&mut self, max: u64, stream: u64) -> Buf {
        let max = max.max(1);
        let addr = self.next_addr;
        self.next_addr += 1;
        self.events.push(Event {
            kind: EventKind::Reserve,
            addr,
            size: max,
            stream,
            time_us: None,
        });
        Buf {
            addr,
            size: 0,
            stream,
        }
    }

    /// Makes the growable region `buf` `size` bytes long.
    pub fn resize(&mut self, buf: &mut Buf, size: u64) {
        buf.size = size;
        self.events.push(Event {
            kind: EventKind::Resize,
            addr: buf.addr,
            size,
            stream: buf.stream,
            time_us: None,
        });
    }

    /// Leaves `buf` live to the end of the trace.
    pub fn keep(&mut self, buf: Buf) {
        let _ = buf;
    }

    /// The number of events recorded so far.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Builds the single-device trace.
    pub fn finish(self, name: &str) -> Result<Trace> {
        let dt = DeviceTrace::new(DeviceTraceParts {
            device: 0,
            events: self.events,
            ..Default::default()
        })?;
        Ok(Trace {
            name: name.to_string(),
            devices: vec![dt],
        })
    }
}

/// A standard normal variate (Box–Muller).
pub(crate) fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]
    let u2: f64 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A log-normal variate with the given median and log-space sigma, clamped to `[lo, hi]`.
pub(crate) fn lognormal_clamped(
    rng: &mut ChaCha8Rng,
    median: f64,
    sigma: f64,
    lo: u64,
    hi: u64,
) -> u64 {
    let x = median * (sigma * normal(rng)).exp();
    (x.round() as u64).clamp(lo, hi)
}

/// A Poisson variate (Knuth's method; fine for the small rates used here).
pub(crate) fn poisson(rng: &mut ChaCha8Rng, lambda: f64) -> u32 {
    if lambda <= 0.0 {
        return 0;
    }
    let l = (-lambda.min(30.0)).exp();
    let mut k = 0;
    let mut p = 1.0;
    loop {
        p *= rng.gen::<f64>();
        if p <= l {
            return k;
        }
        k += 1;
    }
}

/// `x` rounded up to a multiple of `align` (`align` ≥ 1).
pub(crate) fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align.max(1)) * align.max(1)
}

/// One mebibyte.
pub(crate) const MIB: u64 = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_and_keys_list_the_valid_ones() {
        let e = workload_by_name("train-fixed").unwrap_err().to_string();
        assert!(
            e.contains("unknown workload `train-fixed`") && e.contains("serve-kv"),
            "{e}"
        );
        let e = workload_by_name("serve-kv:sede=3").unwrap_err().to_string();
        assert!(
            e.contains("unknown parameter `sede`") && e.contains("seed"),
            "{e}"
        );
        let e = workload_by_name("serve-kv:seed=abc")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad value `abc` for `seed`"), "{e}");
        let e = workload_by_name("serve-kv:seed").unwrap_err().to_string();
        assert!(e.contains("expected key=value"), "{e}");
        let e = workload_by_name("train-varlen:checkpointing=maybe")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`checkpointing`") && e.contains("true or false"),
            "{e}"
        );
    }

    #[test]
    fn workload_options_split_as_policy_options_do() {
        // `key:value` and `key=value` are the same option (issue 36), as in
        // policy specs and VMMALLOC_CONF.
        let colon = workload_by_name("frag-adversary:seed:7,rounds:1").unwrap();
        let equals = workload_by_name("frag-adversary:seed=7,rounds=1").unwrap();
        assert_eq!(colon.devices, equals.devices);
        assert_ne!(
            colon.devices,
            workload_by_name("frag-adversary:rounds=1").unwrap().devices
        );
        // rl-colocate's sleep table reads its parameters the same way: an
        // item that is not an option is an error, not skipped.
        let p = rl_colocate::params_from_spec("rl-colocate:seed:3,iterations=2")
            .unwrap()
            .unwrap();
        assert_eq!((p.seed, p.iterations), (3, 2));
        let e = rl_colocate::params_from_spec("rl-colocate:iterations")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected key=value"), "{e}");
    }

    #[test]
    fn every_workload_documents_its_keys() {
        for w in WORKLOADS {
            let keys = workload_params(w).unwrap();
            assert!(keys.iter().any(|(k, _)| *k == "seed"));
            for (k, doc) in keys {
                assert!(!doc.trim().is_empty(), "{w}:{k} has no doc");
            }
        }
    }

    #[test]
    fn every_key_has_a_default_that_parses_back() {
        for w in WORKLOADS {
            let keys = workload_params(w).unwrap();
            let defaults = workload_defaults(w).unwrap();
            assert_eq!(
                keys.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
                defaults.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
                "{w}"
            );
            // Setting every default explicitly gives the default trace.
            let spec = format!(
                "{w}:{}",
                defaults
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let explicit = workload_by_name(&spec).unwrap();
            let plain = workload_by_name(w).unwrap();
            assert_eq!(explicit.devices, plain.devices, "{spec}");
        }
        assert!(workload_defaults("nope").is_none());
    }

    #[test]
    fn poisson_mean_is_close() {
        use rand::SeedableRng;
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let n = 20_000;
        let sum: u64 = (0..n).map(|_| poisson(&mut rng, 0.7) as u64).sum();
        let mean = sum as f64 / n as f64;
        assert!((mean - 0.7).abs() < 0.03, "{mean}");
    }
}
