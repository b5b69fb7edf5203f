//! The cost model: modeled microseconds per driver call.

use crate::{Call, CallCounts};
use serde::{Deserialize, Serialize};

/// Modeled cost of each driver call, in microseconds.
///
/// Defaults are public A100 measurements (DESIGN.md, "Metrics"); every field can
/// be overridden, e.g. from `scripts/gpu-check.sh`'s calibration JSON or with
/// [`CostModel::parse_overrides`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// `cuMemAddressReserve`.
    pub reserve_us: f64,
    /// `cuMemAddressFree`.
    pub address_free_us: f64,
    /// `cuMemCreate` of one 2 MiB unit; a larger handle costs proportionally more.
    pub create_2mib_us: f64,
    /// `cuMemMap`.
    pub map_us: f64,
    /// `cuMemSetAccess`.
    pub set_access_us: f64,
    /// `cuMemUnmap`.
    pub unmap_us: f64,
    /// `cuMemRelease`.
    pub release_us: f64,
    /// `cuMemAlloc`.
    pub alloc_us: f64,
    /// `cuMemFree`.
    pub free_us: f64,
    /// A stream, device or event synchronization.
    pub sync_us: f64,
    /// Any other call (events, queries, streams, info).
    pub other_us: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            reserve_us: 20.0,
            address_free_us: 20.0,
            create_2mib_us: 50.0,
            map_us: 1.5,
            set_access_us: 30.0,
            unmap_us: 20.0,
            release_us: 20.0,
            alloc_us: 100.0,
            free_us: 50.0,
            sync_us: 50.0,
            other_us: 0.0,
        }
    }
}

impl CostModel {
    /// Modeled cost of one call; `bytes` is the size for `create` (ignored otherwise).
    pub fn cost_us(&self, call: Call, bytes: u64) -> f64 {
        match call {
            Call::Reserve => self.reserve_us,
            Call::AddressFree => self.address_free_us,
            Call::Create => {
                self.create_2mib_us * (bytes.max(1) as f64 / (2u64 << 20) as f64).max(1.0)
            }
            Call::Map => self.map_us,
            Call::SetAccess => self.set_access_us,
            Call::Unmap => self.unmap_us,
            Call::Release => self.release_us,
            Call::Alloc => self.alloc_us,
            Call::Free => self.free_us,
            Call::StreamSync | Call::DeviceSync | Call::EventSync => self.sync_us,
            _ => self.other_us,
        }
    }

    /// The names accepted by [`CostModel::set`].
    pub const KEYS: [&'static str; 11] = [
        "reserve",
        "address_free",
        "create",
        "map",
        "set_access",
        "unmap",
        "release",
        "alloc",
        "free",
        "sync",
        "other",
    ];

    /// Sets one cost by key (see [`CostModel::KEYS`]).
    pub fn set(&mut self, key: &str, us: f64) -> Result<(), String> {
        if !(us.is_finite() && us >= 0.0) {
            return Err(format!(
                "cost for `{key}` must be a non-negative number of microseconds, got {us}"
            ));
        }
        let slot = match key {
            "reserve" => &mut self.reserve_us,
            "address_free" => &mut self.address_free_us,
            "create" => &mut self.create_2mib_us,
            "map" => &mut self.map_us,
            "set_access" => &mut self.set_access_us,
            "unmap" => &mut self.unmap_us,
            "release" => &mut self.release_us,
            "alloc" => &mut self.alloc_us,
            "free" => &mut self.free_us,
            "sync" => &mut self.sync_us,
            "other" => &mut self.other_us,
            _ => {
                return Err(format!(
                    "unknown cost key `{key}`; valid keys: {}",
                    Self::KEYS.join(", ")
                ))
            }
        };
        *slot = us;
        Ok(())
    }

    /// Applies overrides written as `key=us,key=us` (e.g. `create=40,map=2`).
    pub fn parse_overrides(&mut self, text: &str) -> Result<(), String> {
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("cost override `{part}` is not key=microseconds"))?;
            let us: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("cost override `{part}`: `{v}` is not a number"))?;
            self.set(k.trim(), us)?;
        }
        Ok(())
    }

    /// Modeled time of a set of call counts where every create is of `unit` bytes
    /// (a rough total; the `sim` device accumulates exact time per call).
    pub fn total_us(&self, counts: &CallCounts, create_unit: u64) -> f64 {
        Call::ALL
            .iter()
            .map(|c| counts.get(*c) as f64 * self.cost_us(*c, create_unit))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_design() {
        let c = CostModel::default();
        assert_eq!(c.cost_us(Call::Create, 2 << 20), 50.0);
        assert_eq!(c.cost_us(Call::Create, 20 << 20), 500.0);
        assert_eq!(c.cost_us(Call::Map, 2 << 20), 1.5);
        assert_eq!(c.cost_us(Call::SetAccess, 0), 30.0);
        assert_eq!(c.cost_us(Call::StreamSync, 0), 50.0);
    }

    #[test]
    fn overrides_parse_and_reject_bad_keys() {
        let mut c = CostModel::default();
        c.parse_overrides("create=40, map=2").unwrap();
        assert_eq!(c.create_2mib_us, 40.0);
        assert_eq!(c.map_us, 2.0);
        assert!(c
            .parse_overrides("bogus=1")
            .unwrap_err()
            .contains("valid keys"));
        assert!(c.parse_overrides("map=-1").is_err());
        assert!(c.parse_overrides("map").is_err());
    }
}
