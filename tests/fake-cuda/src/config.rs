//! The fake driver's configuration, read once from environment variables.
//!
//! | variable                   | meaning                                              | default |
//! |----------------------------|------------------------------------------------------|---------|
//! | `FAKE_CUDA_DEVICES`        | number of devices (0: `cuInit` fails with `CUDA_ERROR_NO_DEVICE`) | 1 |
//! | `FAKE_CUDA_CAPACITY_MB`    | physical memory per device in MiB; a comma list gives one value per device, the last one repeating | 1024 |
//! | `FAKE_CUDA_GRANULARITY_KB` | allocation granularity in KiB (a power of two, at least the page size) | 2048 |
//! | `FAKE_CUDA_RECOMMENDED_GRANULARITY_KB` | what `cuMemGetAllocationGranularity` answers for `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`, in KiB (a power of two, at least the granularity) | the granularity, as on the GPUs checked so far |
//! | `FAKE_CUDA_FABRIC`         | fabric handles (`CU_MEM_HANDLE_TYPE_FABRIC`): `none` (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` 0, `cuMemCreate` refuses the type with `CUDA_ERROR_NOT_SUPPORTED`), `imex` (supported and permitted), `no-imex` (the attribute is 1 but `cuMemCreate` refuses the type with `CUDA_ERROR_NOT_PERMITTED`, as without an IMEX channel) | none |
//! | `FAKE_CUDA_FAIL`           | `entry:N[:code],...`: fail the Nth call (counted from 1) of each named entry point | none |
//! | `FAKE_CUDA_FAIL_CODE`      | the code of injected failures without their own      | 2 for `cuMemCreate`, 999 otherwise |
//! | `FAKE_CUDA_TRACE`          | `0` silent, `1` one stderr line per failed call, `2` per call | 0 |
//! | `FAKE_CUDA_PEERS`          | which devices can access each other's memory (`cuDeviceCanAccessPeer`): `all`, `none`, or pairs `A-B` separated by `+` (symmetric, e.g. `0-1+2-3`) | all |
//!
//! A malformed value is an error naming the variable; the fake then refuses to
//! initialize (`cuInit` returns `CUDA_ERROR_INVALID_VALUE` and says why on stderr).

use crate::ENTRY_POINTS;
use vmm_sys::{CUresult, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN};

/// Most devices the fake will pretend to have.
pub const MAX_DEVICES: u32 = 64;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// One injected failure: the `nth` call of `entry` returns `code`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailRule {
    /// The entry point, one of [`ENTRY_POINTS`].
    pub entry: &'static str,
    /// Which call fails, counted from 1 since the library was loaded.
    pub nth: u64,
    /// The `CUresult` it returns (never 0).
    pub code: CUresult,
}

/// Whether the fake offers fabric handles (`FAKE_CUDA_FABRIC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    /// Not supported: attribute 0, `cuMemCreate` says `CUDA_ERROR_NOT_SUPPORTED`.
    None,
    /// Supported, and this process may use the fabric (an IMEX channel).
    Imex,
    /// Supported by the device, but `cuMemCreate` says
    /// `CUDA_ERROR_NOT_PERMITTED` (no IMEX channel).
    NoImex,
}

/// How much the fake says on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Trace {
    /// Nothing.
    Off,
    /// One line per failed call, with the reason.
    Errors,
    /// One line per call.
    All,
}

/// Everything the environment configures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Number of devices.
    pub devices: u32,
    /// Physical memory per device in bytes (index = ordinal; the last entry repeats).
    pub capacities: Vec<u64>,
    /// Allocation granularity in bytes.
    pub granularity: u64,
    /// The recommended granularity in bytes (a multiple of `granularity`).
    pub recommended_granularity: u64,
    /// Fabric handles.
    pub fabric: Fabric,
    /// Injected failures.
    pub fail: Vec<FailRule>,
    /// Stderr tracing.
    pub trace: Trace,
    /// Peer access: `None` = every pair; else the symmetric pairs listed.
    pub peers: Option<Vec<(u32, u32)>>,
}

impl Default for Config {
    /// One 1 GiB device, 2 MiB granularity, no failures, silent.
    fn default() -> Self {
        Config {
            devices: 1,
            capacities: vec![1024 * MIB],
            granularity: 2048 * KIB,
            recommended_granularity: 2048 * KIB,
            fabric: Fabric::None,
            fail: Vec::new(),
            trace: Trace::Off,
            peers: None,
        }
    }
}

impl Config {
    /// Reads the configuration from the process environment.
    pub fn from_env() -> Result<Config, String> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// Reads the configuration through `get` (a variable's value, if set).
    /// Empty values count as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, String> {
        let get = |key: &str| {
            get(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let mut c = Config::default();
        if let Some(v) = get("FAKE_CUDA_DEVICES") {
            c.devices = parse_u64("FAKE_CUDA_DEVICES", &v)?
                .try_into()
                .ok()
                .filter(|n| *n <= MAX_DEVICES)
                .ok_or_else(|| format!("FAKE_CUDA_DEVICES={v}: at most {MAX_DEVICES} devices"))?;
        }
        if let Some(v) = get("FAKE_CUDA_CAPACITY_MB") {
            c.capacities = v
                .split(',')
                .map(|part| {
                    let mb = parse_u64("FAKE_CUDA_CAPACITY_MB", part.trim())?;
                    mb.checked_mul(MIB).filter(|b| *b > 0).ok_or_else(|| {
                        format!("FAKE_CUDA_CAPACITY_MB={v}: {mb} MiB is out of range")
                    })
                })
                .collect::<Result<_, _>>()?;
        }
        if let Some(v) = get("FAKE_CUDA_GRANULARITY_KB") {
            let kb = parse_u64("FAKE_CUDA_GRANULARITY_KB", &v)?;
            c.granularity = kb
                .checked_mul(KIB)
                .filter(|g| g.is_power_of_two())
                .ok_or_else(|| format!("FAKE_CUDA_GRANULARITY_KB={v}: not a power of two"))?;
        }
        c.recommended_granularity = c.granularity;
        if let Some(v) = get("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB") {
            let kb = parse_u64("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", &v)?;
            c.recommended_granularity = kb
                .checked_mul(KIB)
                .filter(|g| g.is_power_of_two() && *g >= c.granularity)
                .ok_or_else(|| {
                    format!(
                        "FAKE_CUDA_RECOMMENDED_GRANULARITY_KB={v}: not a power of two of at least \
                         the granularity ({} KiB)",
                        c.granularity / KIB
                    )
                })?;
        }
        if let Some(v) = get("FAKE_CUDA_FABRIC") {
            c.fabric = match v.as_str() {
                "none" => Fabric::None,
                "imex" => Fabric::Imex,
                "no-imex" => Fabric::NoImex,
                _ => {
                    return Err(format!(
                        "FAKE_CUDA_FABRIC={v}: expected none, imex or no-imex"
                    ))
                }
            };
        }
        let default_code = match get("FAKE_CUDA_FAIL_CODE") {
            Some(v) => Some(parse_code("FAKE_CUDA_FAIL_CODE", &v)?),
            None => None,
        };
        if let Some(v) = get("FAKE_CUDA_FAIL") {
            c.fail = parse_fail(&v, default_code)?;
        }
        if let Some(v) = get("FAKE_CUDA_PEERS") {
            c.peers = parse_peers(&v)?;
        }
        if let Some(v) = get("FAKE_CUDA_TRACE") {
            c.trace = match v.as_str() {
                "0" => Trace::Off,
                "1" => Trace::Errors,
                "2" => Trace::All,
                _ => return Err(format!("FAKE_CUDA_TRACE={v}: expected 0, 1 or 2")),
            };
        }
        Ok(c)
    }

    /// `cuDeviceCanAccessPeer(dev, peer)`: whether contexts on `dev` can
    /// access `peer`'s memory (never a device itself).
    pub fn can_access_peer(&self, dev: u32, peer: u32) -> bool {
        dev != peer
            && match &self.peers {
                None => true,
                Some(pairs) => pairs
                    .iter()
                    .any(|&(a, b)| (a, b) == (dev, peer) || (b, a) == (dev, peer)),
            }
    }

    /// Physical memory of device `ordinal` in bytes.
    pub fn capacity(&self, ordinal: usize) -> u64 {
        let i = ordinal.min(self.capacities.len().saturating_sub(1));
        self.capacities.get(i).copied().unwrap_or(1024 * MIB)
    }

    /// The code the `nth` call of `entry` must fail with, if any.
    pub fn injected(&self, entry: &str, nth: u64) -> Option<CUresult> {
        self.fail
            .iter()
            .find(|r| r.nth == nth && r.entry == entry)
            .map(|r| r.code)
    }
}

/// `all` | `none` | `A-B+C-D...`.
fn parse_peers(v: &str) -> Result<Option<Vec<(u32, u32)>>, String> {
    match v {
        "all" => return Ok(None),
        "none" => return Ok(Some(Vec::new())),
        _ => {}
    }
    v.split('+')
        .map(|pair| {
            let (a, b) = pair.trim().split_once('-').ok_or_else(|| {
                format!("FAKE_CUDA_PEERS={v}: `{pair}` is not a pair A-B (or use all / none)")
            })?;
            let a = parse_u64("FAKE_CUDA_PEERS", a.trim())?;
            let b = parse_u64("FAKE_CUDA_PEERS", b.trim())?;
            match (u32::try_from(a), u32::try_from(b)) {
                (Ok(a), Ok(b)) if a < MAX_DEVICES && b < MAX_DEVICES => Ok((a, b)),
                _ => Err(format!(
                    "FAKE_CUDA_PEERS={v}: ordinals go up to {}",
                    MAX_DEVICES - 1
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn parse_u64(key: &str, v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .map_err(|_| format!("{key}={v}: not a non-negative integer"))
}

fn parse_code(key: &str, v: &str) -> Result<CUresult, String> {
    match v.parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("{key}={v}: expected a non-zero CUresult")),
        Ok(code) => Ok(code),
    }
}

/// `cuMemCreate:3,cuMemMap:1:999`.
fn parse_fail(v: &str, default_code: Option<CUresult>) -> Result<Vec<FailRule>, String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let mut parts = item.split(':');
            let name = parts.next().unwrap_or_default();
            let entry = ENTRY_POINTS
                .iter()
                .copied()
                .find(|e| *e == name)
                .ok_or_else(|| {
                    format!(
                        "FAKE_CUDA_FAIL: unknown entry point `{name}` (expected one of: {})",
                        ENTRY_POINTS.join(", ")
                    )
                })?;
            let nth = match parts.next() {
                Some(n) => parse_u64("FAKE_CUDA_FAIL", n)
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        format!("FAKE_CUDA_FAIL: `{item}`: the call number must be 1 or more")
                    })?,
                None => return Err(format!("FAKE_CUDA_FAIL: `{item}`: expected entry:N[:code]")),
            };
            let code = match parts.next() {
                Some(c) => parse_code("FAKE_CUDA_FAIL", c)?,
                None => default_code.unwrap_or(if entry == "cuMemCreate" {
                    CUDA_ERROR_OUT_OF_MEMORY
                } else {
                    CUDA_ERROR_UNKNOWN
                }),
            };
            if parts.next().is_some() {
                return Err(format!("FAKE_CUDA_FAIL: `{item}`: expected entry:N[:code]"));
            }
            Ok(FailRule { entry, nth, code })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config, String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.devices, 1);
        assert_eq!(c.capacity(0), 1 << 30);
        assert_eq!(c.granularity, 2 << 20);
    }

    #[test]
    fn peers_are_all_none_or_symmetric_pairs() {
        let c = cfg(&[]).unwrap();
        assert!(c.can_access_peer(0, 1) && c.can_access_peer(1, 0) && !c.can_access_peer(1, 1));
        let c = cfg(&[("FAKE_CUDA_PEERS", "none")]).unwrap();
        assert!(!c.can_access_peer(0, 1));
        let c = cfg(&[("FAKE_CUDA_PEERS", "0-1 + 2-3")]).unwrap();
        assert!(c.can_access_peer(1, 0) && c.can_access_peer(2, 3) && !c.can_access_peer(0, 2));
        for bad in ["0", "0-x", "0-64", "some"] {
            let e = cfg(&[("FAKE_CUDA_PEERS", bad)]).unwrap_err();
            assert!(e.contains("FAKE_CUDA_PEERS"), "{e}");
        }
    }

    #[test]
    fn devices_capacities_granularity() {
        let c = cfg(&[
            ("FAKE_CUDA_DEVICES", "3"),
            ("FAKE_CUDA_CAPACITY_MB", "512, 256"),
            ("FAKE_CUDA_GRANULARITY_KB", "64"),
        ])
        .unwrap();
        assert_eq!(c.devices, 3);
        assert_eq!(
            [c.capacity(0), c.capacity(1), c.capacity(2)],
            [512 << 20, 256 << 20, 256 << 20]
        );
        assert_eq!(c.granularity, 64 << 10);
        assert_eq!(c.recommended_granularity, 64 << 10);
        assert_eq!(c.fabric, Fabric::None);
        let c = cfg(&[
            ("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "8192"),
            ("FAKE_CUDA_FABRIC", "no-imex"),
        ])
        .unwrap();
        assert_eq!(
            (c.granularity, c.recommended_granularity),
            (2 << 20, 8 << 20)
        );
        assert_eq!(c.fabric, Fabric::NoImex);
    }

    #[test]
    fn fail_rules_and_default_codes() {
        let c = cfg(&[(
            "FAKE_CUDA_FAIL",
            "cuMemCreate:3, cuMemMap:1,cuMemUnmap:2:700",
        )])
        .unwrap();
        assert_eq!(c.injected("cuMemCreate", 3), Some(2));
        assert_eq!(c.injected("cuMemCreate", 2), None);
        assert_eq!(c.injected("cuMemMap", 1), Some(999));
        assert_eq!(c.injected("cuMemUnmap", 2), Some(700));
        let c = cfg(&[
            ("FAKE_CUDA_FAIL", "cuMemCreate:1"),
            ("FAKE_CUDA_FAIL_CODE", "1"),
        ])
        .unwrap();
        assert_eq!(c.injected("cuMemCreate", 1), Some(1));
    }

    #[test]
    fn errors_name_the_variable() {
        for (k, v) in [
            ("FAKE_CUDA_DEVICES", "two"),
            ("FAKE_CUDA_DEVICES", "65"),
            ("FAKE_CUDA_CAPACITY_MB", "0"),
            ("FAKE_CUDA_CAPACITY_MB", "1,x"),
            ("FAKE_CUDA_GRANULARITY_KB", "3"),
            ("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "1024"),
            ("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "3072"),
            ("FAKE_CUDA_FABRIC", "yes"),
            ("FAKE_CUDA_FAIL", "cuMemCreat:1"),
            ("FAKE_CUDA_FAIL", "cuMemCreate"),
            ("FAKE_CUDA_FAIL", "cuMemCreate:0"),
            ("FAKE_CUDA_FAIL", "cuMemCreate:1:0"),
            ("FAKE_CUDA_FAIL", "cuMemCreate:1:2:3"),
            ("FAKE_CUDA_FAIL_CODE", "0"),
            ("FAKE_CUDA_TRACE", "yes"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err();
            let var = if k == "FAKE_CUDA_FAIL_CODE" {
                k
            } else {
                k.trim_end_matches("_CODE")
            };
            assert!(e.contains(var), "{k}={v}: {e}");
        }
    }
}
