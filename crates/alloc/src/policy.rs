//! Naming and building policies.

use crate::{AllocError, AllocResult, Allocator};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use vmmalloc_device::Device;

/// The allocation policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// Ours: page-level reclaim, page pool, one arena per device.
    Expandable,
    /// PyTorch's plain caching allocator.
    Caching,
    /// PyTorch's `expandable_segments:True`.
    TorchEs,
    /// One device allocation per request.
    Native,
}

impl Policy {
    /// Every policy, ours first.
    pub const ALL: [Policy; 4] = [
        Policy::Expandable,
        Policy::Caching,
        Policy::TorchEs,
        Policy::Native,
    ];

    /// The policy's name as used on the command line and in VMMALLOC_CONF.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Expandable => "expandable",
            Policy::Caching => "caching",
            Policy::TorchEs => "torch-es",
            Policy::Native => "native",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = AllocError;
    fn from_str(s: &str) -> AllocResult<Policy> {
        Policy::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                AllocError::InvalidOption(format!(
                    "unknown policy `{s}`; valid policies: {}",
                    Policy::ALL.map(Policy::name).join(", ")
                ))
            })
    }
}

/// Options shared by the policies; each policy reads the ones it knows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyOptions {
    /// `expandable`: options of our allocator.
    pub expandable: crate::expandable::ExpandableConfig,
    /// `caching` and `torch-es`: PyTorch's allocator options.
    pub caching: crate::caching::CachingConfig,
    /// `caching` and `torch-es`: `torch.cuda.set_per_process_memory_fraction`
    /// applied right after creation (`memory_fraction=F`); PyTorch's
    /// `garbage_collection_threshold` acts only once a fraction is set
    /// (`DeviceCachingAllocator::malloc` in `CUDACachingAllocator.cpp`).
    pub memory_fraction: Option<f64>,
}

/// Parses a number in [0, 1] (a memory fraction, a split threshold).
fn parse_unit_fraction(value: &str) -> Result<f64, String> {
    let f: f64 = value
        .trim()
        .parse()
        .map_err(|_| format!("`{value}` is not a number"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("must be in [0, 1], got {f}"))
    }
}

/// Parses a size: bytes, or a number with a unit (decimals allowed, units
/// case-insensitive), e.g. `20MiB`, `12GB`, `1.5Gi`.
///
/// Binary units are binary and decimal units decimal, as IEC 80000-13 and
/// `numfmt --from=iec-i` / `--from=si` read them: `KiB`/`Ki` = 2^10,
/// `MiB`/`Mi` = 2^20, `GiB`/`Gi` = 2^30, `TiB`/`Ti` = 2^40; `kB` = 10^3,
/// `MB` = 10^6, `GB` = 10^9, `TB` = 10^12. A bare `K`, `M`, `G` or `T` is
/// ambiguous (2^30 or 10^9?) and rejected with a hint, as are negative and
/// zero sizes, a number without a unit that is not a whole byte count
/// (`1.5`: did you mean `1.5GiB`?), and sizes of 2^64 bytes or more.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let b = parse_size_unbounded(s)?;
    u64::try_from(b).map_err(|_| {
        format!(
            "`{}` is too large: a size is below 2^64 bytes (16 EiB)",
            s.trim()
        )
    })
}

/// [`parse_size`] without its upper bound: the bytes as a `u128` (saturated
/// far above any device), so that a caller with a limit of its own (the
/// simulated device's) names that limit for any size written.
pub fn parse_size_unbounded(s: &str) -> Result<u128, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!(
            "`{s}` is negative: a size must be positive (e.g. 80GiB, 512MiB, 1048576)"
        ));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("`{s}` is not a size (e.g. 80GiB, 12GB, 512MiB, 1048576)");
    let v: f64 = num.parse().map_err(|_| not_a_size())?;
    let unit = unit.trim();
    let mult: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "ki" => 1 << 10,
        "mib" | "mi" => 1 << 20,
        "gib" | "gi" => 1 << 30,
        "tib" | "ti" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u @ ("k" | "m" | "g" | "t") => {
            let up = u.to_ascii_uppercase();
            return Err(format!(
                "ambiguous size unit `{unit}` in `{s}`: write `{num}{up}iB` ({num} x 2^{}) or `{num}{up}B` ({num} x 10^{})",
                match u { "k" => 10, "m" => 20, "g" => 30, _ => 40 },
                match u { "k" => 3, "m" => 6, "g" => 9, _ => 12 },
            ));
        }
        _ => {
            return Err(format!(
                "unknown size unit `{unit}` in `{s}` (binary: B, KiB, MiB, GiB, TiB or Ki, Mi, Gi, Ti; decimal: kB, MB, GB, TB)"
            ))
        }
    };
    let bytes: u128 = if num.contains('.') {
        if mult == 1 {
            return Err(format!(
                "`{s}` is not a whole number of bytes: a size without a unit counts bytes \
                 (did you mean `{num}GiB`?)"
            ));
        }
        // `as` saturates: a decimal far beyond any device stays far beyond it.
        (v * mult as f64).round() as u128
    } else {
        // A whole number, exactly (no f64 rounding above 2^53), saturated.
        num.parse::<u128>()
            .unwrap_or(u128::MAX)
            .saturating_mul(mult)
    };
    if bytes == 0 {
        return Err(format!("`{s}` is not a positive size"));
    }
    Ok(bytes)
}

/// A policy with options, written `NAME[:key=value,...]`, e.g.
/// `expandable:max_chunk=20MiB` or `caching:max_split_size_mb=128`. Its label
/// (the text as written, trimmed) names its row in reports.
///
/// Options by policy (an unknown option is an error naming it):
/// - `expandable`: `max_chunk`, `split_threshold`, `split_slack`, `page_size`, `arena_size`, `release_threshold`, `spill`, `unpin`, `grow_granule`
///   (sizes: bytes or e.g. `20MiB`), `memory_fraction` (in (0, 1]).
/// - `caching`, `torch-es`: the `PYTORCH_CUDA_ALLOC_CONF` keys
///   [`crate::caching::CachingConfig::parse`] accepts, e.g. `max_split_size_mb=128`,
///   `garbage_collection_threshold=0.6`, plus `memory_fraction=F`
///   (`torch.cuda.set_per_process_memory_fraction(F)`, which
///   `garbage_collection_threshold` needs to act).
/// - `native`: none.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// The policy.
    pub policy: Policy,
    /// The spec as written (`expandable`, `expandable:max_chunk=20MiB`).
    pub label: String,
    /// The options, defaults where not given.
    pub options: PolicyOptions,
}

impl PolicySpec {
    /// A policy with default options.
    pub fn plain(policy: Policy) -> Self {
        PolicySpec {
            policy,
            label: policy.name().to_string(),
            options: PolicyOptions::default(),
        }
    }

    /// Whether no option was given.
    pub fn is_plain(&self) -> bool {
        self.label == self.policy.name()
    }

    /// Sets one option; `expandable`'s through the one option table
    /// ([`crate::options`]).
    fn set(&mut self, key: &str, value: &str) -> AllocResult<()> {
        if self.policy == Policy::Expandable {
            return match crate::options::set(&mut self.options.expandable, key, value) {
                Ok(true) => Ok(()),
                Ok(false) => Err(AllocError::InvalidOption(format!(
                    "policy `{}`: unknown option `{key}`; valid options for {}: {}",
                    self.label,
                    self.policy,
                    crate::options::names()
                ))),
                Err(msg) => Err(AllocError::InvalidOption(format!(
                    "policy `{}`: option `{key}`: {msg}",
                    self.label
                ))),
            };
        }
        Err(AllocError::InvalidOption(format!(
            "policy `{}`: unknown option `{key}`; valid options for {}: none",
            self.label, self.policy
        )))
    }
}

impl FromStr for PolicySpec {
    type Err = AllocError;
    fn from_str(s: &str) -> AllocResult<PolicySpec> {
        let label = s.trim();
        let (name, opts) = label.split_once(':').unwrap_or((label, ""));
        let mut spec = PolicySpec {
            policy: name.trim().parse()?,
            label: label.to_string(),
            options: PolicyOptions::default(),
        };
        // Items split at commas outside `[...]` (PyTorch's
        // `roundup_power2_divisions:[256:1,512:2,>:4]` is one item); caching
        // and torch-es options parse straight into their CachingConfig, key
        // by key, through PyTorch's own parser (CachingConfig::set).
        for kv in split_outside_brackets(opts)
            .into_iter()
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let (k, v) = split_option(kv).ok_or_else(|| {
                AllocError::InvalidOption(format!(
                    "policy `{label}`: option `{kv}` is not key=value (or key:value)"
                ))
            })?;
            match spec.policy {
                Policy::Caching | Policy::TorchEs if k == "memory_fraction" => {
                    let f = parse_unit_fraction(v).map_err(|m| {
                        AllocError::InvalidOption(format!(
                            "policy `{label}`: option `memory_fraction`: {m}"
                        ))
                    })?;
                    spec.options.memory_fraction = Some(f);
                }
                Policy::Caching | Policy::TorchEs => {
                    spec.options.caching.set(k, v).map_err(|e| match e {
                        AllocError::InvalidOption(m) => {
                            AllocError::InvalidOption(format!("policy `{label}`: {m}"))
                        }
                        other => other,
                    })?
                }
                _ => spec.set(k, v)?,
            }
        }
        Ok(spec)
    }
}

/// Splits `text` at the commas outside `[...]`.
fn split_outside_brackets(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (at, ch) in text.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth <= 0 => {
                out.push(&text[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

/// Splits one option into key and value at its first `=` or `:`, whichever
/// comes first (policy specs write `key=value`, `VMMALLOC_CONF` and
/// `PYTORCH_CUDA_ALLOC_CONF` write `key:value`; both are accepted). The one
/// splitter of every option list: policy specs, `VMMALLOC_CONF` (the C ABI's
/// configuration) and workload specs (`serve-kv:seed:7` = `serve-kv:seed=7`).
pub fn split_option(kv: &str) -> Option<(&str, &str)> {
    let at = kv.find(['=', ':'])?;
    Some((kv[..at].trim(), kv[at + 1..].trim()))
}

/// Splits a comma-separated list of policy specs: an item that does not
/// start with a policy name but is an option (`key=value` or `key:value`)
/// continues the options of the spec before it, so
/// `expandable,expandable:max_chunk=20MiB,page_size=4MiB,caching` and
/// `expandable:unpin:false,grow_mb:0,caching` are three and two specs.
pub fn split_policy_specs(items: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for item in items.iter().flat_map(|s| s.split(',')) {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let head = item.split([':', '=']).next().unwrap_or("").trim();
        let separators = item.matches([':', '=']).count();
        let is_option = separators == 1 && head.parse::<Policy>().is_err();
        match out.last_mut() {
            Some(prev) if is_option && prev.contains(':') => {
                prev.push(',');
                prev.push_str(item);
            }
            _ => out.push(item.to_string()),
        }
    }
    out
}

/// Builds a policy over a device.
pub fn build(
    policy: Policy,
    device: Arc<dyn Device>,
    options: &PolicyOptions,
) -> AllocResult<Box<dyn Allocator>> {
    let alloc: Box<dyn Allocator> = match policy {
        Policy::Expandable => Box::new(crate::expandable::ExpandableAllocator::new(
            device,
            options.expandable.clone(),
        )?),
        Policy::Caching => Box::new(crate::caching::CachingAllocator::new(
            device,
            options.caching.clone(),
        )?),
        Policy::TorchEs => Box::new(crate::torch_es::TorchEsAllocator::new(
            device,
            options.caching.clone(),
        )?),
        Policy::Native => Box::new(crate::native::NativeAllocator::new(device)?),
    };
    if let (Policy::Caching | Policy::TorchEs, Some(f)) = (policy, options.memory_fraction) {
        alloc.set_memory_fraction(f)?;
    }
    Ok(alloc)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("20MiB"), Ok(20 * MIB));
        assert_eq!(parse_size("2mib"), Ok(2 * MIB));
        assert_eq!(parse_size("1.5GiB"), Ok(1536 * MIB));
        assert_eq!(parse_size("12Gi"), Ok(12 << 30));
        assert_eq!(parse_size("1Ti"), Ok(1 << 40));
        assert_eq!(parse_size("512 KiB"), Ok(512 << 10));
        // Decimal units are decimal: 12 GB is 7 % less than 12 GiB.
        assert_eq!(parse_size("12GB"), Ok(12_000_000_000));
        assert_eq!(parse_size("1.5MB"), Ok(1_500_000));
        assert_eq!(parse_size("2kB"), Ok(2_000));
        assert_eq!(parse_size("1TB"), Ok(1_000_000_000_000));
        // Bare letters are ambiguous: rejected with both spellings offered.
        for s in ["12G", "2m", "1T", "4k"] {
            let e = parse_size(s).unwrap_err();
            assert!(
                e.contains("ambiguous") && e.contains("iB") && e.contains("10^"),
                "{e}"
            );
        }
        assert!(parse_size("-5GiB").unwrap_err().contains("negative"));
        assert!(parse_size("12 parsecs").unwrap_err().contains("GiB"));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").unwrap_err().contains("lots"));
        assert!(parse_size("3 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_size("0").is_err());
        // No unit: a whole byte count, or refused with the likely meaning.
        let e = parse_size("1.5").unwrap_err();
        assert!(
            e.contains("whole number of bytes") && e.contains("1.5GiB"),
            "{e}"
        );
        assert!(parse_size("2.0B").unwrap_err().contains("2.0GiB"));
        // 2^64 bytes is too large, not "not positive"; below it parses.
        let e = parse_size("18446744073709551616").unwrap_err();
        assert!(e.contains("too large"), "{e}");
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(
            parse_size_unbounded("18446744073709551616"),
            Ok(1u128 << 64)
        );
        assert!(parse_size("99999999999999999999999999999999999999999TiB")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_size("0.0000001KiB").is_err());
    }

    #[test]
    fn specs_carry_options_and_their_label() {
        let p: PolicySpec = "expandable".parse().unwrap();
        assert_eq!(p, PolicySpec::plain(Policy::Expandable));
        assert!(p.is_plain());
        let p: PolicySpec = "expandable:max_chunk=20MiB,page_size=4MiB,memory_fraction=0.5"
            .parse()
            .unwrap();
        assert_eq!(p.policy, Policy::Expandable);
        assert!(!p.is_plain());
        assert_eq!(
            p.label,
            "expandable:max_chunk=20MiB,page_size=4MiB,memory_fraction=0.5"
        );
        assert_eq!(p.options.expandable.max_chunk, Some(20 * MIB));
        let q: PolicySpec = "expandable:split_threshold=1".parse().unwrap();
        assert_eq!(q.options.expandable.split_threshold, 1.0);
        let q: PolicySpec = "expandable:split_slack=8MiB".parse().unwrap();
        assert_eq!(q.options.expandable.split_slack, 8 * MIB);
        let q: PolicySpec = "expandable:split_slack=0".parse().unwrap();
        assert_eq!(q.options.expandable.split_slack, 0);
        use crate::expandable::UnpinMode;
        assert_eq!(
            PolicySpec::plain(Policy::Expandable)
                .options
                .expandable
                .unpin,
            UnpinMode::Auto
        );
        let q: PolicySpec = "expandable:unpin=0".parse().unwrap();
        assert_eq!(q.options.expandable.unpin, UnpinMode::Never);
        let q: PolicySpec = "expandable:unpin=always".parse().unwrap();
        assert_eq!(q.options.expandable.unpin, UnpinMode::Always);
        let q: PolicySpec = "expandable:unpin=auto".parse().unwrap();
        assert_eq!(q.options.expandable.unpin, UnpinMode::Auto);
        let q: PolicySpec = "expandable:grow_granule=0".parse().unwrap();
        assert_eq!(q.options.expandable.grow_granule, 0);
        assert_eq!(p.options.expandable.page_size, Some(4 * MIB));
        assert_eq!(p.options.expandable.memory_fraction, 0.5);
        let p: PolicySpec = "caching:max_split_size_mb=128,garbage_collection_threshold=0.6"
            .parse()
            .unwrap();
        assert_eq!(p.options.caching.max_split_size, 128 * MIB);
        assert_eq!(p.options.caching.garbage_collection_threshold, 0.6);
        let p: PolicySpec = "torch-es:max_split_size_mb=64".parse().unwrap();
        assert_eq!(p.options.caching.max_split_size, 64 * MIB);
    }

    #[test]
    fn bad_specs_name_the_option() {
        for (spec, needle) in [
            ("expandable:max_chunks=20MiB", "max_chunks"),
            ("expandable:max_chunk=big", "max_chunk"),
            ("expandable:split_threshold=2", "split_threshold"),
            ("expandable:split_threshold=x", "split_threshold"),
            ("expandable:split_slack=lots", "split_slack"),
            ("expandable:split_slack=-4MiB", "split_slack"),
            ("expandable:unpin=maybe", "unpin"),
            ("expandable:grow_granule=big", "grow_granule"),
            ("expandable:max_chunk", "max_chunk"),
            ("expandable:memory_fraction=2", "memory_fraction"),
            ("native:max_chunk=2MiB", "max_chunk"),
            ("caching:no_such_key=1", "no_such_key"),
            ("bogus:max_chunk=2MiB", "bogus"),
        ] {
            let e = spec.parse::<PolicySpec>().unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn both_separators_and_the_vmmalloc_conf_names_are_accepted() {
        let want: PolicySpec = "expandable:split_threshold=0.4,unpin=0,grow_granule=0"
            .parse()
            .unwrap();
        for text in [
            "expandable:split_threshold:0.4,unpin:false,grow_mb:0",
            "expandable:split_threshold=0.4,unpin=false,grow_mb=0",
            "expandable:split_threshold:0.4,unpin=0,grow_granule:0",
        ] {
            let p: PolicySpec = text.parse().unwrap();
            assert_eq!(p.options, want.options, "{text}");
        }
        let p: PolicySpec = "expandable:max_chunk_mb:20,arena_gb=16,page_size_mb:4,split_slack_mb=0,release_threshold_mb:1024"
            .parse()
            .unwrap();
        let e = &p.options.expandable;
        assert_eq!(e.max_chunk, Some(20 * MIB));
        assert_eq!(e.arena_size, Some(16 << 30));
        assert_eq!(e.page_size, Some(4 * MIB));
        assert_eq!(e.split_slack, 0);
        assert_eq!(e.release_threshold, 1024 * MIB);
        // PyTorch's own syntax for the caching options.
        let c: PolicySpec = "caching:max_split_size_mb:128".parse().unwrap();
        let d: PolicySpec = "caching:max_split_size_mb=128".parse().unwrap();
        assert_eq!(c.options, d.options);
        // Key by key into the same CachingConfig the environment variable's
        // parser gives, `[...]` lists included.
        let e: PolicySpec =
            "caching:roundup_power2_divisions=[256:1,512:2,>:4],max_split_size_mb:128"
                .parse()
                .unwrap();
        assert_eq!(
            e.options.caching,
            crate::caching::CachingConfig::parse(
                "roundup_power2_divisions:[256:1,512:2,>:4],max_split_size_mb:128"
            )
            .unwrap()
        );
        let err = "caching:max_split_size_mb=1"
            .parse::<PolicySpec>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("policy `caching:max_split_size_mb=1`") && err.contains("too small"),
            "{err}"
        );
        assert!("caching:max_split_size_mb=128:3"
            .parse::<PolicySpec>()
            .is_err());
        assert!("expandable:grow_mb=big"
            .parse::<PolicySpec>()
            .unwrap_err()
            .to_string()
            .contains("grow_mb"));
        // Every VMMALLOC_CONF name stands for an option the spec knows.
        for (name, conf) in crate::options::OPTIONS
            .iter()
            .filter_map(|o| Some((o.name, o.conf.filter(|(_, u)| *u > 1)?.0)))
        {
            let spec = format!("expandable:{name}=4MiB");
            assert!(spec.parse::<PolicySpec>().is_ok(), "{spec}");
            let spec = format!("expandable:{conf}:4");
            assert!(spec.parse::<PolicySpec>().is_ok(), "{spec}");
        }
        // Lists split the same way with either separator.
        assert_eq!(
            split_policy_specs(&[
                "expandable:unpin:false,grow_mb:0,caching:max_split_size_mb:128,torch-es"
                    .to_string()
            ]),
            vec![
                "expandable:unpin:false,grow_mb:0",
                "caching:max_split_size_mb:128",
                "torch-es"
            ]
        );
    }

    #[test]
    fn lists_split_between_specs_not_inside_options() {
        let items = vec![
            "expandable,expandable:max_chunk=20MiB,page_size=4MiB".to_string(),
            "caching".to_string(),
        ];
        assert_eq!(
            split_policy_specs(&items),
            [
                "expandable",
                "expandable:max_chunk=20MiB,page_size=4MiB",
                "caching"
            ]
        );
    }

    #[test]
    fn caching_memory_fraction_is_applied_at_creation() {
        let p: PolicySpec = "caching:garbage_collection_threshold=0.6,memory_fraction=0.5"
            .parse()
            .unwrap();
        assert_eq!(p.options.memory_fraction, Some(0.5));
        assert_eq!(p.options.caching.garbage_collection_threshold, 0.6);
        let dev = Arc::new(vmmalloc_device::sim::SimDevice::with_capacity(64 * MIB));
        let a = build(p.policy, dev, &p.options).unwrap();
        // Half of 64 MiB is allowed: 40 MiB is refused, 30 MiB fits.
        assert!(a
            .malloc(40 * MIB, crate::Stream::DEFAULT)
            .unwrap_err()
            .is_out_of_memory());
        assert!(a.malloc(30 * MIB, crate::Stream::DEFAULT).is_ok());
        let bad = "torch-es:memory_fraction=2"
            .parse::<PolicySpec>()
            .unwrap_err();
        assert!(bad.to_string().contains("memory_fraction"), "{bad}");
    }
}
