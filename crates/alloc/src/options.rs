//! The one table of the `expandable` allocator's options ([`OPTIONS`]):
//! each option's name in policy specs (`expandable:max_chunk=20MiB`), its
//! name in `VMMALLOC_CONF` (`max_chunk_mb:20`, a whole number of its unit),
//! how its value is written, what it means, and the [`ExpandableConfig`]
//! field it sets and shows. Every reader of these options goes through it:
//! [`crate::PolicySpec`] (the CLI's `--policy`/`--policies`), the C ABI's
//! configuration (`crates/capi/src/config.rs`, `VMMALLOC_CONF` and
//! `vmmalloc_configure`) and, through the C ABI's `vmmalloc_config_json`,
//! the Python package. The C ABI's key table (`vmmalloc_capi::config::keys`)
//! is generated from this one, so adding an option is one entry here plus
//! its field and effect in the allocator, and its row in docs/pytorch.md and
//! mention in docs/guide.md (tests check both) (issues 36, 42).

use crate::expandable::{ExpandableConfig, UnpinMode};
use crate::policy::parse_size;

/// How an option's value is written, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A positive size (`20MiB`); unset means the allocator's default.
    Size,
    /// A size or `0` (`0` means none: no slack, no growth ahead).
    SizeOrZero,
    /// A number in [0, 1].
    Fraction,
    /// `true`/`false`/`1`/`0` (`True`/`False` too, as PyTorch writes them).
    Bool,
    /// `auto`, `always` (or `true`/`1`), `false` (or `0`): [`UnpinMode`].
    Unpin,
}

/// An option's value, parsed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// Bytes ([`Kind::Size`]: `None` is the default).
    Bytes(Option<u64>),
    /// A fraction or other number.
    Number(f64),
    /// A boolean.
    Bool(bool),
    /// An unpin mode.
    Unpin(UnpinMode),
}

/// One option of the `expandable` allocator.
#[derive(Debug, Clone, Copy)]
pub struct OptionDef {
    /// The name in policy specs (`max_chunk`): values as written, sizes
    /// with a unit.
    pub name: &'static str,
    /// The name in `VMMALLOC_CONF` (`max_chunk_mb`) and the bytes of its
    /// unit (sizes there are whole numbers of it; 1 for options without a
    /// unit); `None`: not a `VMMALLOC_CONF` key (the plug-in's memory
    /// fraction comes from PyTorch's `set_per_process_memory_fraction`).
    pub conf: Option<(&'static str, u64)>,
    /// How the value is written.
    pub kind: Kind,
    /// The default, as the user would write it (or a description of it).
    pub default: &'static str,
    /// What it means, written once for every reader: the C ABI's key table
    /// (`vmmalloc_capi::config::keys`, which adds the unit of the
    /// `VMMALLOC_CONF` name) and the docs (details in [`ExpandableConfig`]'s
    /// field).
    pub doc: &'static str,
    /// Stores a parsed value in the field.
    pub set: fn(&mut ExpandableConfig, Value),
    /// Reads the field.
    pub get: fn(&ExpandableConfig) -> Value,
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Every option of the `expandable` allocator, in the order
/// `allocator_settings` shows them.
pub const OPTIONS: [OptionDef; 10] = [
    OptionDef {
        name: "page_size",
        conf: Some(("page_size_mb", MIB)),
        kind: Kind::Size,
        default: "the device granularity (2 MiB)",
        doc: "page size: the unit of address arithmetic and the smallest physical chunk, one \
              cuMemCreate handle",
        set: |c, v| {
            if let Value::Bytes(b) = v {
                c.page_size = b
            }
        },
        get: |c| Value::Bytes(c.page_size),
    },
    OptionDef {
        name: "arena_size",
        conf: Some(("arena_gb", GIB)),
        kind: Kind::Size,
        default: "4 × device memory",
        doc: "virtual address space reserved per arena (more arenas are reserved when one runs out)",
        set: |c, v| {
            if let Value::Bytes(b) = v {
                c.arena_size = b
            }
        },
        get: |c| Value::Bytes(c.arena_size),
    },
    OptionDef {
        name: "max_chunk",
        conf: Some(("max_chunk_mb", MIB)),
        kind: Kind::Size,
        default: "adaptive: 1 GiB, at most 1/8 of device memory",
        doc: "largest physical chunk (one cuMemCreate handle); a multiple of the page size",
        set: |c, v| {
            if let Value::Bytes(b) = v {
                c.max_chunk = b
            }
        },
        get: |c| Value::Bytes(c.max_chunk),
    },
    OptionDef {
        name: "split_threshold",
        conf: Some(("split_threshold", 1)),
        kind: Kind::Fraction,
        default: "1 (never split: unpin instead)",
        doc: "live bytes, as a fraction of the limit in [0, 1], above which a free chunk a new block \
              covers only in part is split instead of pinned (1: never, 0: always)",
        set: |c, v| {
            if let Value::Number(f) = v {
                c.split_threshold = f
            }
        },
        get: |c| Value::Number(c.split_threshold),
    },
    OptionDef {
        name: "split_slack",
        conf: Some(("split_slack_mb", MIB)),
        kind: Kind::SizeOrZero,
        default: "4 MiB",
        doc: "bytes a partly covered free chunk may leave uncovered and still be reused whole \
              (pinned) instead of split when memory is tight (and the longest run whose shared edge \
              page gets no chunk of its own); 0 splits every partly covered chunk",
        set: |c, v| {
            if let Value::Bytes(Some(b)) = v {
                c.split_slack = b
            }
        },
        get: |c| Value::Bytes(Some(c.split_slack)),
    },
    OptionDef {
        name: "release_threshold",
        conf: Some(("release_threshold_mb", MIB)),
        kind: Kind::SizeOrZero,
        default: "unlimited (pooled pages are kept until empty_cache)",
        doc: "bytes of unmapped chunks kept in the pool; chunks above it are released to the driver",
        set: |c, v| {
            if let Value::Bytes(Some(b)) = v {
                c.release_threshold = b
            }
        },
        get: |c| Value::Bytes(Some(c.release_threshold)),
    },
    OptionDef {
        name: "spill",
        conf: Some(("spill", 1)),
        kind: Kind::Bool,
        default: "false",
        doc: "when device memory is exhausted after reclaim, back the request with host-located \
              chunks (cuMemCreate on the host NUMA node, CUDA 12.2+) mapped at the same addresses; \
              they move back at a quiet point (empty_cache). Stats: vmmalloc.spilled_bytes",
        set: |c, v| {
            if let Value::Bool(b) = v {
                c.spill = b
            }
        },
        get: |c| Value::Bool(c.spill),
    },
    OptionDef {
        name: "unpin",
        conf: Some(("unpin", 1)),
        kind: Kind::Unpin,
        default: "auto",
        doc: "when an allocation still lacks memory after reclaim, give back the free pages of \
              chunks that live tensors hold in part: after one device synchronize, the live pages \
              move to chunks of their own at the same addresses (bytes copied on the device where it \
              has room for the new chunks, else through host memory). Tensors used on other streams \
              (record_stream) never move. auto: only while no other host thread may be launching \
              work alongside the allocating call (a thread allocating only on streams of its own, or \
              calls that overlapped or interleaved lately; docs/expandable.md); always (or true): \
              whenever needed; false: never. Stats: vmmalloc.chunk_unpins, vmmalloc.unpin_refusals",
        set: |c, v| {
            if let Value::Unpin(u) = v {
                c.unpin = u
            }
        },
        get: |c| Value::Unpin(c.unpin),
    },
    OptionDef {
        name: "grow_granule",
        conf: Some(("grow_mb", MIB)),
        kind: Kind::SizeOrZero,
        default: "20 MiB",
        doc: "a segment's tail grows to multiples of this at a time while mapped + pooled memory is \
              under 4/5 of the limit (PyTorch's 20 MiB large-pool page); 0 maps exactly what each \
              block needs",
        set: |c, v| {
            if let Value::Bytes(Some(b)) = v {
                c.grow_granule = b
            }
        },
        get: |c| Value::Bytes(Some(c.grow_granule)),
    },
    OptionDef {
        name: "memory_fraction",
        conf: None,
        kind: Kind::Fraction,
        default: "1 (the whole device)",
        doc: "fraction of device memory the allocator may hold",
        set: |c, v| {
            if let Value::Number(f) = v {
                c.memory_fraction = f
            }
        },
        get: |c| Value::Number(c.memory_fraction),
    },
];

/// The option `key` names, by its spec name or its `VMMALLOC_CONF` name;
/// `true` with it when `key` is the `VMMALLOC_CONF` name of a size (a whole
/// number of its unit).
pub fn find(key: &str) -> Option<(&'static OptionDef, bool)> {
    OPTIONS.iter().find_map(|o| {
        if o.name == key {
            Some((o, false))
        } else {
            match o.conf {
                Some((conf, unit)) if conf == key => Some((o, unit > 1)),
                _ => None,
            }
        }
    })
}

/// The names [`find`] knows, for error messages: spec names, then the
/// `VMMALLOC_CONF` names that differ.
pub fn names() -> String {
    let spec: Vec<&str> = OPTIONS.iter().map(|o| o.name).collect();
    let conf: Vec<&str> = OPTIONS
        .iter()
        .filter_map(|o| o.conf.map(|(c, _)| c).filter(|c| *c != o.name))
        .collect();
    format!(
        "{} (or VMMALLOC_CONF's names: {})",
        spec.join(", "),
        conf.join(", ")
    )
}

impl OptionDef {
    /// Parses `value` for this option, written as its spec name takes it
    /// (`in_units: false`: sizes with a unit) or as its `VMMALLOC_CONF`
    /// name takes it (`true`: a whole number of the unit). The error says
    /// what is valid.
    pub fn parse(&self, value: &str, in_units: bool) -> Result<Value, String> {
        let v = value.trim();
        match self.kind {
            Kind::Size | Kind::SizeOrZero if in_units => {
                let (conf, unit) = self.conf.expect("a VMMALLOC_CONF name");
                let unit_name = if unit == GIB { "GiB" } else { "MiB" };
                let n: u64 = v.parse().map_err(|_| {
                    format!(
                        "a {} integer (whole {unit_name}; or `{}={v}{unit_name}`-style sizes)",
                        if self.kind == Kind::Size {
                            "positive"
                        } else {
                            "non-negative"
                        },
                        self.name
                    )
                })?;
                if n == 0 && self.kind == Kind::Size {
                    return Err(format!(
                        "a positive integer (whole {unit_name} of `{conf}`)"
                    ));
                }
                let b = n
                    .checked_mul(unit)
                    .ok_or_else(|| format!("at most {} {unit_name}", u64::MAX / unit))?;
                Ok(Value::Bytes(Some(b)))
            }
            Kind::Size => parse_size(v).map(|b| Value::Bytes(Some(b))),
            Kind::SizeOrZero if v == "0" => Ok(Value::Bytes(Some(0))),
            Kind::SizeOrZero => parse_size(v).map(|b| Value::Bytes(Some(b))),
            Kind::Fraction => match v.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => Ok(Value::Number(f)),
                Ok(f) => Err(format!("a number in [0, 1], got {f}")),
                Err(_) => Err(format!("a number in [0, 1], got `{v}`")),
            },
            Kind::Bool => match v {
                "1" | "true" | "True" => Ok(Value::Bool(true)),
                "0" | "false" | "False" => Ok(Value::Bool(false)),
                _ => Err(format!("`{v}` is not a boolean (true/false/1/0)")),
            },
            Kind::Unpin => v.parse().map(Value::Unpin),
        }
    }

    /// The value in `cfg` as its `VMMALLOC_CONF` name writes it (sizes in
    /// its unit), or `default` where it is the allocator's default (booleans
    /// and modes are always written out).
    pub fn show(&self, cfg: &ExpandableConfig) -> String {
        let value = (self.get)(cfg);
        let is_default = value == (self.get)(&ExpandableConfig::default());
        match value {
            Value::Bool(b) => b.to_string(),
            Value::Unpin(u) => u.to_string(),
            _ if is_default => "default".to_string(),
            Value::Bytes(None) => "default".to_string(),
            Value::Bytes(Some(b)) => {
                let unit = self.conf.map_or(1, |(_, u)| u);
                if b % unit == 0 {
                    (b / unit).to_string()
                } else {
                    (b as f64 / unit as f64).to_string()
                }
            }
            Value::Number(f) => f.to_string(),
        }
    }
}

/// Sets option `key` (a spec or `VMMALLOC_CONF` name) to `value` in `cfg`:
/// `Ok(false)` when no option has that name, `Err` (what is valid) when the
/// value does not parse.
pub fn set(cfg: &mut ExpandableConfig, key: &str, value: &str) -> Result<bool, String> {
    let Some((o, in_units)) = find(key) else {
        return Ok(false);
    };
    let v = o.parse(value, in_units)?;
    (o.set)(cfg, v);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_sets_and_shows_its_own_field() {
        // A value unlike the default, per kind: setting it changes exactly
        // that option, and showing it reads it back.
        for o in &OPTIONS {
            let mut c = ExpandableConfig::default();
            let (text, shown) = match o.kind {
                Kind::Size | Kind::SizeOrZero => ("7GiB", 7 * GIB),
                Kind::Fraction => ("0.25", 0),
                Kind::Bool => ("true", 0),
                Kind::Unpin => ("always", 0),
            };
            assert!(set(&mut c, o.name, text).unwrap(), "{}", o.name);
            for other in &OPTIONS {
                let changed = (other.get)(&c) != (other.get)(&ExpandableConfig::default());
                assert_eq!(
                    changed,
                    other.name == o.name,
                    "{} set {}",
                    o.name,
                    other.name
                );
            }
            if let Some((conf, unit)) = o.conf {
                let want = match o.kind {
                    Kind::Size | Kind::SizeOrZero => (shown / unit).to_string(),
                    _ => text.to_string(),
                };
                assert_eq!(o.show(&c), want, "{}", o.name);
                // The VMMALLOC_CONF name sets the same field from what show wrote.
                let mut d = ExpandableConfig::default();
                assert!(set(&mut d, conf, &want).unwrap());
                assert_eq!(d, c, "{conf}");
            }
            assert!(!o.doc.is_empty() && !o.default.is_empty());
        }
        assert_eq!(
            set(&mut ExpandableConfig::default(), "colour", "1"),
            Ok(false)
        );
    }

    #[test]
    fn the_docs_describe_every_option_of_the_table() {
        // docs/pytorch.md has a row per VMMALLOC_CONF name, docs/guide.md
        // names every spec name (the policy options of `--policy`).
        let pytorch = include_str!("../../../docs/pytorch.md");
        let guide = include_str!("../../../docs/guide.md");
        for o in &OPTIONS {
            if let Some((conf, _)) = o.conf {
                assert!(
                    pytorch.contains(&format!("| `{conf}` |")),
                    "docs/pytorch.md has no row for `{conf}`"
                );
            }
            assert!(
                guide.contains(&format!("`{}", o.name)),
                "docs/guide.md does not name `{}`",
                o.name
            );
        }
    }

    #[test]
    fn values_are_checked_with_what_is_valid() {
        let mut c = ExpandableConfig::default();
        let e = set(&mut c, "page_size_mb", "0").unwrap_err();
        assert!(e.contains("positive integer"), "{e}");
        let e = set(&mut c, "split_slack_mb", "2.5").unwrap_err();
        assert!(
            e.contains("integer") && e.contains("split_slack=2.5MiB"),
            "{e}"
        );
        assert!(set(&mut c, "split_slack_mb", "0").unwrap());
        assert_eq!(c.split_slack, 0);
        let e = set(&mut c, "split_threshold", "1.5").unwrap_err();
        assert!(e.contains("[0, 1]"), "{e}");
        let e = set(&mut c, "unpin", "sometimes").unwrap_err();
        assert!(e.contains("auto"), "{e}");
        let e = set(&mut c, "max_chunk", "0").unwrap_err();
        assert!(e.contains("positive"), "{e}");
        assert!(set(&mut c, "grow_granule", "0").unwrap());
        assert_eq!(OPTIONS[0].show(&ExpandableConfig::default()), "default");
        assert!(names().contains("max_chunk_mb") && names().contains("grow_granule"));
    }
}
