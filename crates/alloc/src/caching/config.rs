//! PyTorch's allocator options in `PYTORCH_CUDA_ALLOC_CONF` syntax.
//!
//! Mirrors `c10::CachingAllocator::ConfigTokenizer` and
//! `AcceleratorAllocatorConfig::parseArgs` (`c10/core/AllocatorConfig.{h,cpp}`)
//! plus the CUDA-only keys of `CUDAAllocatorConfig::parseArgs`
//! (`c10/cuda/CUDAAllocatorConfig.cpp`). Error messages use PyTorch's words.

use super::sizes::{K_LARGE_BUFFER, MB};
use crate::{AllocError, AllocResult};

/// Number of power-of-two intervals of `roundup_power2_divisions`
/// (`kRoundUpPowerOfTwoIntervals`): 1 MiB, 2 MiB, ..., 32 GiB and above.
pub const ROUNDUP_POWER2_INTERVALS: usize = 16;

/// log2 of the first interval's start (`kRoundUpPowerOfTwoStart` = 1 MiB).
const INTERVAL_START_LOG2: u32 = 20;

/// Keys PyTorch's CUDA allocator accepts (`AcceleratorAllocatorConfig::getKeys()`
/// plus the keys `CUDAAllocatorConfig` registers).
pub const KEYS: [&str; 12] = [
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
];

/// PyTorch's caching-allocator options (`AcceleratorAllocatorConfig` +
/// `CUDAAllocatorConfig`), used by the `caching` and `torch-es` policies.
///
/// Sizes are in bytes. `Default` is PyTorch's default: no split limit, no
/// power-of-two rounding, no garbage collection, no expandable segments.
#[derive(Debug, Clone, PartialEq)]
pub struct CachingConfig {
    /// `max_split_size_mb` in bytes: blocks at least this large are never split
    /// (`u64::MAX`, PyTorch's `SIZE_MAX`, when unlimited).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes: how much larger than an oversize
    /// request a cached oversize block may be (default `kLargeBuffer`, 20 MiB).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions` per power-of-two interval starting at 1 MiB
    /// (index `i` covers sizes in `[2^(20+i), 2^(21+i))`, the last one everything
    /// above); 0 or 1 means no power-of-two rounding.
    pub roundup_power2_divisions: [u64; ROUNDUP_POWER2_INTERVALS],
    /// `garbage_collection_threshold` (0 = off); only active together with a
    /// memory fraction (`set_memory_fraction`).
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`. Parsed and kept for `PYTORCH_CUDA_ALLOC_CONF`
    /// compatibility; the policy (`caching` or `torch-es`) decides the mode.
    pub expandable_segments: bool,
    /// `release_lock_on_cudamalloc` (accepted; the replicas hold their lock).
    pub release_lock_on_cudamalloc: bool,
}

impl Default for CachingConfig {
    fn default() -> Self {
        CachingConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding_size: K_LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_POWER2_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
        }
    }
}

/// Splits a config string into keys, values and the tokens `:` `,` `[` `]`,
/// ignoring whitespace (`ConfigTokenizer`).
fn tokenize(env: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    for ch in env.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !buf.is_empty() {
                out.push(std::mem::take(&mut buf));
            }
            out.push(ch.to_string());
        } else if !ch.is_whitespace() {
            buf.push(ch);
        }
    }
    if !buf.is_empty() {
        out.push(buf);
    }
    out
}

fn err(msg: impl Into<String>) -> AllocError {
    AllocError::InvalidOption(msg.into())
}

/// The tokens with PyTorch's accessors (`checkToken`, `toSizeT`, `toDouble`, `toBool`).
struct Tokens {
    t: Vec<String>,
}

impl Tokens {
    fn get(&self, i: usize, key: &str) -> AllocResult<&str> {
        self.t
            .get(i)
            .map(String::as_str)
            .ok_or_else(|| err(format!("Error, expecting {key} value")))
    }
    fn expect(&self, i: usize, c: &str) -> AllocResult<()> {
        match self.t.get(i) {
            Some(s) if s == c => Ok(()),
            _ => Err(err(format!(
                "Error parsing CachingAllocator::AllocatorConfig settings, expected {c}"
            ))),
        }
    }
    fn to_size(&self, i: usize, key: &str) -> AllocResult<u64> {
        let s = self.get(i, key)?;
        s.parse::<u64>().map_err(|_| {
            err(format!(
                "Error parsing {key} value: expected a non-negative integer, got '{s}'"
            ))
        })
    }
    fn to_double(&self, i: usize, key: &str) -> AllocResult<f64> {
        let s = self.get(i, key)?;
        s.parse::<f64>().map_err(|_| {
            err(format!(
                "Error parsing {key} value: expected a number, got '{s}'"
            ))
        })
    }
    fn to_bool(&self, i: usize, key: &str) -> AllocResult<bool> {
        match self.get(i, key)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => Err(err(format!(
                "Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{other}'"
            ))),
        }
    }
}

impl CachingConfig {
    /// Parses options written as `PYTORCH_CUDA_ALLOC_CONF`, e.g.
    /// `max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6,expandable_segments:True`
    /// (`AcceleratorAllocatorConfig::parseArgs`). Unknown keys and bad values are
    /// errors worded as PyTorch words them. An empty string gives the defaults.
    pub fn parse(env: &str) -> AllocResult<CachingConfig> {
        let mut c = CachingConfig::default();
        let tk = Tokens { t: tokenize(env) };
        let mut i = 0;
        while i < tk.t.len() {
            i = c.apply(&tk, i)?;
            if i + 1 < tk.t.len() {
                i += 1;
                tk.expect(i, ",")?;
            }
            i += 1;
        }
        Ok(c)
    }

    /// Sets one option, `key` to `value` (written as in
    /// `PYTORCH_CUDA_ALLOC_CONF`, `[...]` lists included), checked as
    /// [`Self::parse`] checks it: the policy specs' caching options
    /// (`caching:max_split_size_mb=128`) parse straight into the config, key
    /// by key, through the same code as the environment variable.
    pub fn set(&mut self, key: &str, value: &str) -> AllocResult<()> {
        let tk = Tokens {
            t: tokenize(&format!("{}:{}", key.trim(), value.trim())),
        };
        let last = self.apply(&tk, 0)?;
        if last + 1 != tk.t.len() {
            return Err(err(format!(
                "Error parsing {key} value: expected one value, got '{}'",
                value.trim()
            )));
        }
        Ok(())
    }

    /// Applies the option whose key is token `i` (`parseArgs`' loop body);
    /// returns the index of its last token.
    fn apply(&mut self, tk: &Tokens, i: usize) -> AllocResult<usize> {
        let c = self;
        let key = tk.t[i].as_str();
        Ok(match key {
            "max_split_size_mb" => c.parse_max_split_size(tk, i)?,
            "max_non_split_rounding_mb" => c.parse_max_non_split_rounding_size(tk, i)?,
            "garbage_collection_threshold" => c.parse_garbage_collection_threshold(tk, i)?,
            "roundup_power2_divisions" => c.parse_roundup_power2_divisions(tk, i)?,
            "expandable_segments" => {
                tk.expect(i + 1, ":")?;
                c.expandable_segments = tk.to_bool(i + 2, key)?;
                i + 2
            }
            "release_lock_on_cudamalloc" => {
                tk.expect(i + 1, ":")?;
                c.release_lock_on_cudamalloc = tk.to_bool(i + 2, key)?;
                i + 2
            }
            "backend" => {
                tk.expect(i + 1, ":")?;
                match tk.get(i + 2, key)? {
                    "native" => i + 2,
                    "cudaMallocAsync" => {
                        return Err(err(
                            "backend:cudaMallocAsync is a different allocator; the caching and torch-es \
                             replicas model backend:native only",
                        ))
                    }
                    _ => return Err(err("Unknown allocator backend, options are native and cudaMallocAsync")),
                }
            }
            "pinned_use_cuda_host_register"
            | "pinned_use_background_threads"
            | "graph_capture_record_stream_reuse" => {
                // Host (pinned) allocator and graph options: validated, no effect here.
                tk.expect(i + 1, ":")?;
                tk.to_bool(i + 2, key)?;
                i + 2
            }
            "pinned_num_register_threads" => {
                tk.expect(i + 1, ":")?;
                let v = tk.to_size(i + 2, key)?;
                if !v.is_power_of_two() {
                    return Err(err(format!(
                        "Number of register threads has to be power of 2, got {v}"
                    )));
                }
                if v > 128 {
                    return Err(err(format!(
                        "Number of register threads should be less than or equal to 128, got {v}"
                    )));
                }
                i + 2
            }
            "pinned_reserve_segment_size_mb" => {
                tk.expect(i + 1, ":")?;
                if tk.to_size(i + 2, key)? == 0 {
                    return Err(err("Pinned reserve segment size has to be greater than 0"));
                }
                i + 2
            }
            other => {
                return Err(err(format!(
                    "Unrecognized key '{other}' in Accelerator allocator config. (valid keys: {})",
                    KEYS.join(", ")
                )))
            }
        })
    }

    /// `parseMaxSplitSize`: at least `kLargeBuffer / 1 MiB` = 20.
    fn parse_max_split_size(&mut self, tk: &Tokens, i: usize) -> AllocResult<usize> {
        tk.expect(i + 1, ":")?;
        let v = tk.to_size(i + 2, "max_split_size_mb")?;
        let min = K_LARGE_BUFFER / MB;
        if v < min {
            return Err(err(format!(
                "CachingAllocator option max_split_size_mb too small, must be >= {min}"
            )));
        }
        self.max_split_size = v.min(u64::MAX / MB) * MB;
        Ok(i + 2)
    }

    /// `parseMaxNonSplitRoundingSize`: at least 20.
    fn parse_max_non_split_rounding_size(&mut self, tk: &Tokens, i: usize) -> AllocResult<usize> {
        tk.expect(i + 1, ":")?;
        let v = tk.to_size(i + 2, "max_non_split_rounding_mb")?;
        let min = K_LARGE_BUFFER / MB;
        if v < min {
            return Err(err(format!(
                "CachingAllocator option max_non_split_rounding_mb too small, must be >= {min}"
            )));
        }
        self.max_non_split_rounding_size = v.min(u64::MAX / MB) * MB;
        Ok(i + 2)
    }

    /// `parseGarbageCollectionThreshold`: in (0.0, 1.0).
    fn parse_garbage_collection_threshold(&mut self, tk: &Tokens, i: usize) -> AllocResult<usize> {
        tk.expect(i + 1, ":")?;
        let v = tk.to_double(i + 2, "garbage_collection_threshold")?;
        if !(v > 0.0 && v < 1.0) {
            return Err(err(
                "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            ));
        }
        self.garbage_collection_threshold = v;
        Ok(i + 2)
    }

    /// `parseRoundUpPower2Divisions`: a single power of two for every interval,
    /// or `[size_mb:divisions,...,>:divisions]`. In the bracket form the first
    /// entry also fills every interval below it, each `size_mb` (a power of two)
    /// names the interval that starts there (index `log2(size_mb)`), and `>`
    /// fills every interval after the last one named.
    fn parse_roundup_power2_divisions(&mut self, tk: &Tokens, i: usize) -> AllocResult<usize> {
        const KEY: &str = "roundup_power2_divisions";
        tk.expect(i + 1, ":")?;
        let mut i = i + 2;
        let table = &mut self.roundup_power2_divisions;
        if tk.get(i, KEY)? == "[" {
            let mut first = true;
            let mut last_index = 0usize;
            loop {
                i += 1;
                match tk.t.get(i).map(String::as_str) {
                    None => return Err(err(
                        "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                    )),
                    Some("]") => break,
                    Some(_) => {}
                }
                let boundary_index = i;
                tk.expect(i + 1, ":")?;
                i += 2;
                let value = tk.to_size(i, KEY)?;
                if !(value == 0 || value.is_power_of_two()) {
                    return Err(err(
                        "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                    ));
                }
                if tk.t[boundary_index] == ">" {
                    for d in table.iter_mut().skip(last_index + 1) {
                        *d = value;
                    }
                } else {
                    let boundary = tk.to_size(boundary_index, KEY)?;
                    if !boundary.is_power_of_two() {
                        return Err(err("For roundups, the intervals have to be power of 2 "));
                    }
                    let index = (boundary.ilog2() as usize).min(ROUNDUP_POWER2_INTERVALS - 1);
                    if first {
                        for d in table.iter_mut().take(index) {
                            *d = value;
                        }
                        first = false;
                    }
                    table[index] = value;
                    last_index = index;
                }
                match tk.t.get(i + 1).map(String::as_str) {
                    Some("]") => {}
                    None => return Err(err(
                        "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
                    )),
                    Some(_) => {
                        i += 1;
                        tk.expect(i, ",")?;
                    }
                }
            }
        } else {
            let value = tk.to_size(i, KEY)?;
            if !value.is_power_of_two() {
                return Err(err("For roundups, the divisions has to be power of 2 "));
            }
            table.fill(value);
        }
        Ok(i)
    }

    /// `AcceleratorAllocatorConfig::roundup_power2_divisions(size)`: the number of
    /// divisions for the power-of-two interval holding `size` (intervals start at
    /// 1 MiB; smaller sizes use the first, sizes of 32 GiB and more the last).
    pub fn roundup_power2_divisions(&self, size: u64) -> u64 {
        let log_size = if size == 0 { 0 } else { size.ilog2() };
        let index = log_size.saturating_sub(INTERVAL_START_LOG2) as usize;
        self.roundup_power2_divisions[index.min(ROUNDUP_POWER2_INTERVALS - 1)]
    }

    /// Whether `max_split_size_mb` was set (PyTorch compares with `SIZE_MAX`).
    pub fn has_split_limit(&self) -> bool {
        self.max_split_size != u64::MAX
    }
}
