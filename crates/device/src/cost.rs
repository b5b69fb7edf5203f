//! The cost model: modeled microseconds per driver call (version 2).
//!
//! Each call kind costs `fixed + per_mib × MiB of the call + per_handle ×
//! handles the call covers`. The real driver charges mostly per call and per
//! handle, little per byte: PyTorch's `c10/cuda/CUDACachingAllocator.cpp`,
//! Note [Expandable Segments], "The cost to map/unmap memory is proportional to
//! the number of physical memory chunks that were allocated (mapping 10
//! separately allocated 2MiB pages takes 10x time compared to mapping one 20MiB
//! physical allocation of 10 pages)".
//!
//! Three named presets (see docs/driver.md, "Cost model", for every figure and
//! its source):
//! - [`CostModel::h200`] (the default): `vmmalloc calibrate` on an H200 with
//!   driver 580 / CUDA 13.0, 2026-12-04 (the only preset measured on a
//!   current driver).
//! - [`CostModel::a100`]: per-call latencies measured on an A100
//!   by kvcached's `benchmarks/bench_vmm` (4096 × 2 MiB pages).
//! - [`CostModel::linear`]: the model before version 2, `cuMemCreate` linear in
//!   bytes (50 µs per 2 MiB), every other call a flat cost; kept for sensitivity.
//!
//! A model can also be read from a JSON file ([`CostModel::from_json`], the
//! format `vmmalloc calibrate` writes) and adjusted by `key=us` overrides
//! ([`CostModel::parse_overrides`]). [`CostModel::select`] does all three, as
//! the command line's `--cost` / `--cost-file` options do.

use crate::{Call, CallCounts, MIB};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::Path;

/// What one call kind costs, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CallCost {
    /// Paid once per call.
    pub fixed_us: f64,
    /// Paid per MiB of the call's size (the handle for `cuMemCreate`, the
    /// range for map / unmap / set access, the allocation for
    /// `cuMemAlloc` / `cuMemFree`).
    pub per_mib_us: f64,
    /// Paid per physical handle the call covers (one for `cuMemMap`; the
    /// mappings in the range for `cuMemUnmap` and `cuMemSetAccess`).
    pub per_handle_us: f64,
}

impl CallCost {
    /// A flat cost per call.
    pub const fn flat(us: f64) -> Self {
        CallCost {
            fixed_us: us,
            per_mib_us: 0.0,
            per_handle_us: 0.0,
        }
    }

    /// The cost of one call of `bytes` covering `handles` handles.
    #[inline]
    pub fn of(&self, bytes: u64, handles: u64) -> f64 {
        self.fixed_us
            + self.per_mib_us * (bytes as f64 / MIB as f64)
            + self.per_handle_us * handles as f64
    }

    /// The sum of two costs, part by part (a composite call).
    pub fn plus(self, other: CallCost) -> CallCost {
        CallCost {
            fixed_us: self.fixed_us + other.fixed_us,
            per_mib_us: self.per_mib_us + other.per_mib_us,
            per_handle_us: self.per_handle_us + other.per_handle_us,
        }
    }

    /// The parts as `(name, value)`, in file order.
    pub fn parts(&self) -> [(&'static str, f64); 3] {
        [
            ("fixed_us", self.fixed_us),
            ("per_mib_us", self.per_mib_us),
            ("per_handle_us", self.per_handle_us),
        ]
    }

    fn part_mut(&mut self, part: &str) -> Option<&mut f64> {
        match part {
            "fixed" | "fixed_us" => Some(&mut self.fixed_us),
            "per_mib" | "per_mib_us" => Some(&mut self.per_mib_us),
            "per_handle" | "per_handle_us" => Some(&mut self.per_handle_us),
            _ => None,
        }
    }
}

/// A bad preset name, cost file or override; the message names the file and key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostError {
    /// No preset of that name.
    #[error("unknown cost preset `{0}`; valid presets: {presets}", presets = CostModel::PRESETS.join(", "))]
    UnknownPreset(String),
    /// A cost file could not be read or parsed, or a key in it is wrong.
    #[error("cost file {file}: {message}")]
    File {
        /// The file (or its label).
        file: String,
        /// What is wrong, naming the key.
        message: String,
    },
    /// A `key=us` override is malformed or names an unknown key.
    #[error("{0}")]
    Override(String),
    /// Options that cannot go together.
    #[error("{0}")]
    Conflict(String),
}

/// Modeled cost of each driver call kind.
///
/// The default is the [`CostModel::h200`] preset. Every part of every kind can
/// be overridden (see [`CostModel::set`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// `cuMemAddressReserve`.
    pub reserve: CallCost,
    /// `cuMemAddressFree`.
    pub address_free: CallCost,
    /// `cuMemCreate` (bytes = the handle's size).
    pub create: CallCost,
    /// `cuMemMap` (one handle, bytes = its size).
    pub map: CallCost,
    /// `cuMemSetAccess` (handles = mappings in the range).
    pub set_access: CallCost,
    /// `cuMemUnmap` (handles = mappings in the range).
    pub unmap: CallCost,
    /// `cuMemRelease` (bytes = the handle's size).
    pub release: CallCost,
    /// `cuMemAlloc` (bytes = the allocation).
    pub alloc: CallCost,
    /// `cuMemFree` (bytes = the allocation).
    pub free: CallCost,
    /// A stream, device or event synchronization.
    pub sync: CallCost,
    /// A copy between device and host memory (`cuMemcpyHtoD` /
    /// `cuMemcpyDtoH`; bytes = the copy).
    pub copy: CallCost,
    /// A device-to-device copy and the wait for it (`cuMemcpyDtoD` +
    /// `cuCtxSynchronize`; bytes = the copy).
    pub copy_device: CallCost,
    /// Any other call (events, queries, streams, info).
    pub other: CallCost,
}

impl Default for CostModel {
    /// The [`CostModel::h200`] preset.
    fn default() -> Self {
        CostModel::h200()
    }
}

impl CostModel {
    /// The preset names accepted by [`CostModel::preset`]; the first is the default.
    pub const PRESETS: [&'static str; 3] = ["h200", "a100", "linear"];

    /// The call kinds of a cost file and of overrides, in file order.
    pub const KEYS: [&'static str; 13] = [
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
        "copy",
        "copy_device",
        "other",
    ];

    /// Keys of [`CostModel::KEYS`] a cost file may leave out (files written
    /// before they existed): they keep the [`CostModel::a100`] figures.
    pub const OPTIONAL_KEYS: [&'static str; 2] = ["copy", "copy_device"];

    /// Device-to-device copies on an A100 and the wait for them: `memcpy`
    /// moves ~1219 GiB/s of reads plus writes (GPUInspector.jl's
    /// `memory_bandwidth` on a DGX A100), so ~610 GiB/s of copied bytes,
    /// 1.6 µs per MiB; plus a synchronization (50 µs, as `sync`).
    pub const A100_DEVICE_COPY: CallCost = CallCost {
        fixed_us: 50.0,
        per_mib_us: 1.6,
        per_handle_us: 0.0,
    };

    /// Host-device copies of pageable host memory over PCIe 4.0 x16 (an
    /// A100's link: 31.5 GB/s per direction, PCI-SIG). Page-locked copies
    /// reach ~25 GB/s (CUDA's `bandwidthTest`); the driver stages pageable
    /// ones through its own page-locked buffers (NVIDIA, "How to Optimize
    /// Data Transfers in CUDA C/C++"), which we take to halve that:
    /// ~12.5 GB/s, 80 µs per MiB, plus ~10 µs per call. `vmmalloc
    /// calibrate` measures it.
    pub const PCIE4_COPY: CallCost = CallCost {
        fixed_us: 10.0,
        per_mib_us: 80.0,
        per_handle_us: 0.0,
    };

    /// The parts of a kind in a cost file (`KIND.PART=us` in overrides, where
    /// the `_us` suffix may be left out).
    pub const PARTS: [&'static str; 3] = ["fixed_us", "per_mib_us", "per_handle_us"];

    /// Per-call costs measured on an H200 (the default): the fit `vmmalloc
    /// calibrate` made on 2026-12-04 (NVIDIA H200, driver 580.159.04, CUDA
    /// 13.0; 200 iterations per point, fit distance 0.096), rounded to three
    /// significant digits; the file is kept as
    /// `tests/fixtures/h200-calibration-2026-12-04.json` and a test checks
    /// the preset against it. An independent measurement of the same calls
    /// on the same box (docs/driver.md) agrees within ~20 %.
    ///
    /// Against [`CostModel::a100`]: `cuMemCreate` is ~14 µs instead of 193
    /// up to 256 MiB, while `cuMemSetAccess` (31 µs) and `cuMemUnmap`
    /// (20 µs) are charged **per handle** in the range; `cuMemRelease`
    /// grows with the handle (15 µs + 0.6 µs/MiB). Synchronizing an idle
    /// device costs 0.7 µs: the model charges a sync's call, not the queued
    /// work it waits for.
    pub fn h200() -> Self {
        let c = |fixed_us: f64, per_mib_us: f64, per_handle_us: f64| CallCost {
            fixed_us,
            per_mib_us,
            per_handle_us,
        };
        CostModel {
            reserve: CallCost::flat(0.766),
            address_free: CallCost::flat(0.847),
            create: c(14.0, 0.0688, 0.0),
            map: c(1.39, 0.00138, 0.0),
            set_access: c(0.857, 0.0642, 31.3),
            unmap: c(1.26, 0.0208, 19.7),
            release: c(15.0, 0.595, 0.0),
            alloc: c(54.1, 0.164, 0.0),
            free: c(44.2, 0.618, 0.0),
            sync: CallCost::flat(0.717),
            copy: c(50.5, 126.0, 0.0),
            copy_device: c(28.0, 0.583, 0.0),
            other: CallCost::flat(0.602),
        }
    }

    /// Per-call latencies on an A100 (published figures).
    ///
    /// Sources: kvcached `benchmarks/bench_vmm` on an A100, 4096 × 2 MiB pages:
    /// `cuMemAddressReserve` 19 µs, `cuMemCreate` 193 µs, `cuMemMap` 1.45 µs,
    /// `cuMemSetAccess` 36 µs per call, `cuMemUnmap` 25.6 µs per handle.
    /// `cuMemCreate` is mostly fixed; zero-filling the handle at device
    /// bandwidth (~1.5 TB/s, A100 datasheet) adds ~0.7 µs per MiB.
    /// `cuMemRelease` and `cuMemAddressFree` 20 µs, syncs 50 µs (issue 10's
    /// figures; `vmmalloc calibrate` measures them). `cuMemAlloc` is priced as
    /// create + map + set access of the same size and `cuMemFree` as unmap +
    /// release + a device synchronization, which is what they do underneath.
    pub fn a100() -> Self {
        let create = CallCost {
            fixed_us: 193.0,
            per_mib_us: 0.7,
            per_handle_us: 0.0,
        };
        let map = CallCost::flat(1.45);
        let set_access = CallCost::flat(36.0);
        let unmap = CallCost {
            fixed_us: 0.0,
            per_mib_us: 0.0,
            per_handle_us: 25.6,
        };
        let release = CallCost::flat(20.0);
        let sync = CallCost::flat(50.0);
        // cuMemFree unmaps one handle: its per-handle cost is a fixed cost here.
        let one_handle_unmap = CallCost::flat(unmap.of(0, 1));
        CostModel {
            reserve: CallCost::flat(19.0),
            address_free: CallCost::flat(20.0),
            create,
            map,
            set_access,
            unmap,
            release,
            alloc: create.plus(map).plus(set_access),
            free: one_handle_unmap.plus(release).plus(sync),
            sync,
            copy: Self::PCIE4_COPY,
            copy_device: Self::A100_DEVICE_COPY,
            other: CallCost::flat(0.0),
        }
    }

    /// The model before version 2: `cuMemCreate` 50 µs per 2 MiB (25 µs per
    /// MiB, nothing fixed), every other call flat: reserve 20, address free
    /// 20, map 1.5, set access 30, unmap 20, release 20, `cuMemAlloc` 100,
    /// `cuMemFree` 50, syncs 50 µs.
    ///
    /// (Version 1 charged a create smaller than 2 MiB as 2 MiB; with the
    /// 2 MiB granularity of current GPUs there is no such create.)
    pub fn linear() -> Self {
        CostModel {
            reserve: CallCost::flat(20.0),
            address_free: CallCost::flat(20.0),
            create: CallCost {
                fixed_us: 0.0,
                per_mib_us: 25.0,
                per_handle_us: 0.0,
            },
            map: CallCost::flat(1.5),
            set_access: CallCost::flat(30.0),
            unmap: CallCost::flat(20.0),
            release: CallCost::flat(20.0),
            alloc: CallCost::flat(100.0),
            free: CallCost::flat(50.0),
            sync: CallCost::flat(50.0),
            copy: Self::PCIE4_COPY,
            copy_device: Self::A100_DEVICE_COPY,
            other: CallCost::flat(0.0),
        }
    }

    /// Where a preset's figures come from, in a few words (for reports).
    pub fn preset_source(name: &str) -> Option<&'static str> {
        match name {
            "h200" => Some(
                "measured by `vmmalloc calibrate` on an H200 (driver 580, CUDA 13.0) on 2026-12-04, \
                 tests/fixtures/h200-calibration-2026-12-04.json",
            ),
            "a100" => Some("published A100 figures (kvcached's bench_vmm)"),
            "linear" => Some("the model before version 2, for sensitivity"),
            _ => None,
        }
    }

    /// A preset by name (see [`CostModel::PRESETS`]).
    pub fn preset(name: &str) -> Result<Self, CostError> {
        match name.trim() {
            "h200" => Ok(Self::h200()),
            "a100" => Ok(Self::a100()),
            "linear" => Ok(Self::linear()),
            other => Err(CostError::UnknownPreset(other.to_string())),
        }
    }

    /// The cost of a kind of call (syncs share one entry; events, streams,
    /// queries are `other`; host-device copies are `copy`, device-to-device
    /// ones `copy_device`).
    pub fn of_call(&self, call: Call) -> &CallCost {
        match call {
            Call::Reserve => &self.reserve,
            Call::AddressFree => &self.address_free,
            Call::Create => &self.create,
            Call::Map => &self.map,
            Call::SetAccess => &self.set_access,
            Call::Unmap => &self.unmap,
            Call::Release => &self.release,
            Call::Alloc => &self.alloc,
            Call::Free => &self.free,
            Call::StreamSync | Call::DeviceSync | Call::EventSync => &self.sync,
            Call::CopyHtoD | Call::CopyDtoH => &self.copy,
            Call::CopyDtoD => &self.copy_device,
            _ => &self.other,
        }
    }

    /// Modeled cost of one call of `bytes` covering `handles` handles.
    #[inline]
    pub fn call_us(&self, call: Call, bytes: u64, handles: u64) -> f64 {
        self.of_call(call).of(bytes, handles)
    }

    /// Modeled cost of one call of `bytes` covering one handle.
    pub fn cost_us(&self, call: Call, bytes: u64) -> f64 {
        self.call_us(call, bytes, 1)
    }

    /// The kind named `key` (see [`CostModel::KEYS`]).
    pub fn kind(&self, key: &str) -> Option<&CallCost> {
        Some(match key {
            "reserve" => &self.reserve,
            "address_free" => &self.address_free,
            "create" => &self.create,
            "map" => &self.map,
            "set_access" => &self.set_access,
            "unmap" => &self.unmap,
            "release" => &self.release,
            "alloc" => &self.alloc,
            "free" => &self.free,
            "sync" => &self.sync,
            "copy" => &self.copy,
            "copy_device" => &self.copy_device,
            "other" => &self.other,
            _ => return None,
        })
    }

    fn kind_mut(&mut self, key: &str) -> Option<&mut CallCost> {
        Some(match key {
            "reserve" => &mut self.reserve,
            "address_free" => &mut self.address_free,
            "create" => &mut self.create,
            "map" => &mut self.map,
            "set_access" => &mut self.set_access,
            "unmap" => &mut self.unmap,
            "release" => &mut self.release,
            "alloc" => &mut self.alloc,
            "free" => &mut self.free,
            "sync" => &mut self.sync,
            "copy" => &mut self.copy,
            "copy_device" => &mut self.copy_device,
            "other" => &mut self.other,
            _ => return None,
        })
    }

    /// Sets one part by key: `KIND` (its fixed cost) or `KIND.PART` with PART
    /// one of `fixed`, `per_mib`, `per_handle` (the `_us` suffix optional).
    pub fn set(&mut self, key: &str, us: f64) -> Result<(), String> {
        if !(us.is_finite() && us >= 0.0) {
            return Err(format!(
                "cost for `{key}` must be a non-negative number of microseconds, got {us}"
            ));
        }
        let (kind, part) = key.split_once('.').unwrap_or((key, "fixed"));
        let slot = self.kind_mut(kind).ok_or_else(|| {
            format!(
                "unknown cost key `{key}`; valid kinds: {} (each optionally .fixed, .per_mib or .per_handle)",
                Self::KEYS.join(", ")
            )
        })?;
        let slot = slot.part_mut(part).ok_or_else(|| {
            format!("unknown cost key `{key}`: `{part}` is not one of fixed, per_mib, per_handle")
        })?;
        *slot = us;
        Ok(())
    }

    /// Applies overrides written as `key=us,key=us` (e.g. `create=40,unmap.per_handle=20`;
    /// see [`CostModel::set`]).
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

    /// Reads a cost file's text; `file` names it in errors.
    ///
    /// The format (what `vmmalloc calibrate` writes; other top-level keys are
    /// ignored as metadata):
    ///
    /// ```json
    /// { "costs_us": { "create": {"fixed_us": 193, "per_mib_us": 0.7, "per_handle_us": 0}, ... } }
    /// ```
    ///
    /// Every kind of [`CostModel::KEYS`] must be present with all three parts
    /// (except [`CostModel::OPTIONAL_KEYS`], which default to `a100`'s figures),
    /// each a non-negative number; unknown kinds or parts are errors.
    pub fn from_json(text: &str, file: &str) -> Result<Self, CostError> {
        let err = |message: String| CostError::File {
            file: file.to_string(),
            message,
        };
        let doc: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let top = doc
            .as_object()
            .ok_or_else(|| err("the top level must be an object".into()))?;
        let costs = top
            .get("costs_us")
            .ok_or_else(|| err("missing key `costs_us`".into()))?
            .as_object()
            .ok_or_else(|| err("`costs_us` must be an object".into()))?;
        if let Some(k) = costs.keys().find(|k| !Self::KEYS.contains(&k.as_str())) {
            return Err(err(format!(
                "unknown key `costs_us.{k}`; valid kinds: {}",
                Self::KEYS.join(", ")
            )));
        }
        let mut model = CostModel::linear();
        for kind in Self::KEYS {
            if !costs.contains_key(kind) && Self::OPTIONAL_KEYS.contains(&kind) {
                let a100 = *CostModel::a100().kind(kind).expect("a key of KEYS");
                *model.kind_mut(kind).expect("a key of KEYS") = a100;
                continue;
            }
            let entry = costs
                .get(kind)
                .ok_or_else(|| err(format!("missing key `costs_us.{kind}`")))?
                .as_object()
                .ok_or_else(|| {
                    err(format!(
                        "`costs_us.{kind}` must be an object with {}",
                        Self::PARTS.join(", ")
                    ))
                })?;
            if let Some(p) = entry.keys().find(|p| !Self::PARTS.contains(&p.as_str())) {
                return Err(err(format!(
                    "unknown key `costs_us.{kind}.{p}`; valid parts: {}",
                    Self::PARTS.join(", ")
                )));
            }
            let slot = model.kind_mut(kind).expect("a key of KEYS");
            for part in Self::PARTS {
                let v = entry
                    .get(part)
                    .ok_or_else(|| err(format!("missing key `costs_us.{kind}.{part}`")))?;
                let us = v.as_f64().ok_or_else(|| {
                    err(format!(
                        "`costs_us.{kind}.{part}` must be a number, got {v}"
                    ))
                })?;
                if !(us.is_finite() && us >= 0.0) {
                    return Err(err(format!(
                        "`costs_us.{kind}.{part}` must be a non-negative number of microseconds, got {us}"
                    )));
                }
                *slot.part_mut(part).expect("a part of PARTS") = us;
            }
        }
        Ok(model)
    }

    /// Reads a cost file (see [`CostModel::from_json`]).
    pub fn load(path: &Path) -> Result<Self, CostError> {
        let text = std::fs::read_to_string(path).map_err(|e| CostError::File {
            file: path.display().to_string(),
            message: format!("cannot read it: {e}"),
        })?;
        Self::from_json(&text, &path.display().to_string())
    }

    /// The `costs_us` object of a cost file (see [`CostModel::from_json`]).
    pub fn to_json(&self) -> Value {
        let mut costs = Map::new();
        for kind in Self::KEYS {
            let c = self.kind(kind).expect("a key of KEYS");
            let mut parts = Map::new();
            for (name, v) in c.parts() {
                parts.insert(name.to_string(), Value::from(v));
            }
            costs.insert(kind.to_string(), Value::Object(parts));
        }
        Value::Object(costs)
    }

    /// The model the command line asks for, and its label: `cost` is
    /// `[PRESET][,KEY=US,...]` (a first item without `=` names a preset;
    /// default `h200`), `file` a cost file; overrides apply on top of either.
    /// The label is the preset name or the file path, with ` + overrides` when there are any.
    pub fn select(cost: Option<&str>, file: Option<&Path>) -> Result<(Self, String), CostError> {
        let text = cost.unwrap_or("").trim();
        let (preset, overrides) = match text.split_once(',') {
            Some((first, rest)) if !first.contains('=') => (Some(first.trim()), rest),
            None if !text.is_empty() && !text.contains('=') => (Some(text), ""),
            _ => (None, text),
        };
        let (mut model, label) = match (preset, file) {
            (Some(p), Some(f)) => {
                return Err(CostError::Conflict(format!(
                    "--cost names the preset `{p}` and --cost-file gives {}; use one",
                    f.display()
                )))
            }
            (Some(p), None) => (Self::preset(p)?, p.to_string()),
            (None, Some(f)) => (Self::load(f)?, f.display().to_string()),
            (None, None) => (Self::default(), Self::PRESETS[0].to_string()),
        };
        model
            .parse_overrides(overrides)
            .map_err(CostError::Override)?;
        let overrides = overrides.trim().trim_matches(',');
        let label = if overrides.is_empty() {
            label
        } else {
            format!("{label} + {overrides}")
        };
        Ok((model, label))
    }

    /// Modeled time of a set of call counts, each call of `bytes` covering one
    /// handle (a rough total; the `sim` device accumulates exact time per call).
    pub fn total_us(&self, counts: &CallCounts, bytes: u64) -> f64 {
        Call::ALL
            .iter()
            .map(|c| counts.get(*c) as f64 * self.cost_us(*c, bytes))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn h200_is_the_default_and_the_calibration_of_2026_12_04() {
        assert_eq!(CostModel::default(), CostModel::h200());
        let (m, l) = CostModel::select(None, None).unwrap();
        assert_eq!((m, l.as_str()), (CostModel::h200(), "h200"));
        let file = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/h200-calibration-2026-12-04.json"
        );
        let measured = CostModel::load(Path::new(file)).unwrap();
        let h = CostModel::h200();
        for key in CostModel::KEYS {
            let (a, b) = (h.kind(key).unwrap(), measured.kind(key).unwrap());
            for ((part, x), (_, y)) in a.parts().into_iter().zip(b.parts()) {
                // Three significant digits: within 0.5 % (or both ~0).
                assert!(
                    (x - y).abs() <= 0.005 * y.abs().max(1e-3),
                    "{key}.{part}: preset {x}, calibration {y}"
                );
            }
        }
        // The shape that matters: creating is cheap, access and unmap are
        // charged per handle.
        assert!(h.call_us(Call::Create, 256 * MIB, 1) < 40.0);
        assert!(h.call_us(Call::SetAccess, 32 * MIB, 16) > 16.0 * 31.0);
        assert!(h.call_us(Call::Unmap, 32 * MIB, 16) > 16.0 * 19.0);
    }

    #[test]
    fn a100_matches_design() {
        let c = CostModel::a100();
        assert!(close(c.call_us(Call::Create, 2 * MIB, 1), 193.0 + 1.4));
        assert!(close(c.call_us(Call::Create, 20 * MIB, 1), 193.0 + 14.0));
        assert!(close(c.call_us(Call::Map, 20 * MIB, 1), 1.45));
        assert!(close(c.call_us(Call::SetAccess, 64 * MIB, 32), 36.0));
        assert!(close(c.call_us(Call::Unmap, 20 * MIB, 10), 256.0));
        assert!(close(c.call_us(Call::Reserve, 0, 0), 19.0));
        assert!(close(c.call_us(Call::StreamSync, 0, 0), 50.0));
        // cuMemAlloc = create + map + set access; cuMemFree = unmap + release + sync.
        assert!(close(
            c.call_us(Call::Alloc, 20 * MIB, 1),
            193.0 + 14.0 + 1.45 + 36.0
        ));
        assert!(close(
            c.call_us(Call::Free, 20 * MIB, 1),
            25.6 + 20.0 + 50.0
        ));
        assert!(close(c.call_us(Call::EventQuery, 0, 0), 0.0));
    }

    #[test]
    fn linear_is_the_old_model() {
        let c = CostModel::linear();
        assert!(close(c.call_us(Call::Create, 2 * MIB, 1), 50.0));
        assert!(close(c.call_us(Call::Create, 20 * MIB, 1), 500.0));
        assert!(close(c.call_us(Call::Map, 2 * MIB, 1), 1.5));
        assert!(close(c.call_us(Call::SetAccess, 64 * MIB, 32), 30.0));
        assert!(close(c.call_us(Call::Unmap, 64 * MIB, 32), 20.0));
        assert!(close(c.call_us(Call::Alloc, 64 * MIB, 1), 100.0));
        assert!(close(c.call_us(Call::Free, 64 * MIB, 1), 50.0));
        assert!(close(c.call_us(Call::DeviceSync, 0, 0), 50.0));
    }

    #[test]
    fn presets_by_name() {
        assert_eq!(CostModel::preset("a100").unwrap(), CostModel::a100());
        assert_eq!(CostModel::preset("linear").unwrap(), CostModel::linear());
        let e = CostModel::preset("h100").unwrap_err().to_string();
        assert!(
            e.contains("`h100`") && e.contains("h200, a100, linear"),
            "{e}"
        );
        assert_eq!(CostModel::preset("h200").unwrap(), CostModel::h200());
    }

    #[test]
    fn overrides_parse_and_reject_bad_keys() {
        let mut c = CostModel::default();
        c.parse_overrides("create=40, map=2, unmap.per_handle=3, create.per_mib_us=1")
            .unwrap();
        assert_eq!(c.create.fixed_us, 40.0);
        assert_eq!(c.create.per_mib_us, 1.0);
        assert_eq!(c.map.fixed_us, 2.0);
        assert_eq!(c.unmap.per_handle_us, 3.0);
        assert!(c
            .parse_overrides("bogus=1")
            .unwrap_err()
            .contains("valid kinds"));
        assert!(c
            .parse_overrides("map.slope=1")
            .unwrap_err()
            .contains("map.slope"));
        assert!(c.parse_overrides("map=-1").is_err());
        assert!(c.parse_overrides("map=x").is_err());
        assert!(c.parse_overrides("map").is_err());
    }

    #[test]
    fn files_round_trip() {
        let mut m = CostModel::a100();
        m.set("set_access.per_handle", 0.5).unwrap();
        let doc = serde_json::json!({ "name": "x", "costs_us": m.to_json() });
        let back = CostModel::from_json(&doc.to_string(), "x.json").unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn copies_are_priced_and_older_files_without_them_still_load() {
        let m = CostModel::a100();
        assert_eq!(m.of_call(Call::CopyDtoH), &CostModel::PCIE4_COPY);
        assert_eq!(m.of_call(Call::CopyHtoD), &CostModel::PCIE4_COPY);
        // 64 MiB: 10 + 64 × 80 µs.
        assert_eq!(m.call_us(Call::CopyDtoH, 64 * MIB, 0), 5130.0);
        assert_eq!(CostModel::linear().copy, CostModel::PCIE4_COPY);
        assert_eq!(m.of_call(Call::CopyDtoD), &CostModel::A100_DEVICE_COPY);
        assert_eq!(m.call_us(Call::CopyDtoD, 64 * MIB, 0), 50.0 + 64.0 * 1.6);
        let mut old = serde_json::json!({ "costs_us": CostModel::linear().to_json() });
        old["costs_us"].as_object_mut().unwrap().remove("copy");
        old["costs_us"]
            .as_object_mut()
            .unwrap()
            .remove("copy_device");
        let back = CostModel::from_json(&old.to_string(), "old.json").unwrap();
        assert_eq!(back, CostModel::linear());
        let mut m = CostModel::a100();
        m.set("copy.per_mib", 20.0).unwrap();
        let doc = serde_json::json!({ "costs_us": m.to_json() });
        assert_eq!(
            CostModel::from_json(&doc.to_string(), "x.json")
                .unwrap()
                .copy
                .per_mib_us,
            20.0
        );
    }

    #[test]
    fn bad_files_name_the_file_and_key() {
        let good = serde_json::json!({ "costs_us": CostModel::a100().to_json() });
        let cases: Vec<(Value, &str)> = {
            let mut missing_kind = good.clone();
            missing_kind["costs_us"]
                .as_object_mut()
                .unwrap()
                .remove("unmap");
            let mut missing_part = good.clone();
            missing_part["costs_us"]["map"]
                .as_object_mut()
                .unwrap()
                .remove("per_mib_us");
            let mut negative = good.clone();
            negative["costs_us"]["create"]["fixed_us"] = serde_json::json!(-1.0);
            let mut text = good.clone();
            text["costs_us"]["sync"]["fixed_us"] = serde_json::json!("fast");
            let mut unknown = good.clone();
            unknown["costs_us"]["cuMemMap"] = serde_json::json!({});
            let mut unknown_part = good.clone();
            unknown_part["costs_us"]["map"]["per_byte_us"] = serde_json::json!(1);
            vec![
                (missing_kind, "costs_us.unmap"),
                (missing_part, "costs_us.map.per_mib_us"),
                (negative, "costs_us.create.fixed_us"),
                (text, "costs_us.sync.fixed_us"),
                (unknown, "costs_us.cuMemMap"),
                (unknown_part, "costs_us.map.per_byte_us"),
                (serde_json::json!({"costs": {}}), "costs_us"),
                (serde_json::json!([1]), "top level"),
            ]
        };
        for (doc, key) in cases {
            let e = CostModel::from_json(&doc.to_string(), "my.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("my.json") && e.contains(key), "{key}: {e}");
        }
        let e = CostModel::from_json("{", "my.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("my.json") && e.contains("JSON"), "{e}");
        let e = CostModel::load(Path::new("/nonexistent/c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/c.json"), "{e}");
    }

    #[test]
    fn select_presets_files_and_overrides() {
        let (m, l) = CostModel::select(None, None).unwrap();
        assert_eq!((m, l.as_str()), (CostModel::h200(), "h200"));
        let (m, l) = CostModel::select(Some("a100"), None).unwrap();
        assert_eq!((m, l.as_str()), (CostModel::a100(), "a100"));
        let (m, l) = CostModel::select(Some("linear"), None).unwrap();
        assert_eq!((m, l.as_str()), (CostModel::linear(), "linear"));
        let (m, l) = CostModel::select(Some("linear,map=2"), None).unwrap();
        assert_eq!(m.map.fixed_us, 2.0);
        assert_eq!(m.create, CostModel::linear().create);
        assert_eq!(l, "linear + map=2");
        let (m, l) = CostModel::select(Some("map=3"), None).unwrap();
        assert_eq!(m.map.fixed_us, 3.0);
        assert_eq!(m.create, CostModel::h200().create);
        assert_eq!(l, "h200 + map=3");
        assert!(CostModel::select(Some("v100"), None)
            .unwrap_err()
            .to_string()
            .contains("`v100`"));
        assert!(matches!(
            CostModel::select(Some("linear"), Some(Path::new("f.json"))),
            Err(CostError::Conflict(_))
        ));
        let dir = std::env::temp_dir().join(format!("vmmalloc-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.json");
        let doc = serde_json::json!({ "costs_us": CostModel::linear().to_json() });
        std::fs::write(&f, doc.to_string()).unwrap();
        let (m, l) = CostModel::select(Some("sync=1"), Some(&f)).unwrap();
        assert_eq!(m.sync.fixed_us, 1.0);
        assert_eq!(m.create, CostModel::linear().create);
        assert_eq!(l, format!("{} + sync=1", f.display()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
