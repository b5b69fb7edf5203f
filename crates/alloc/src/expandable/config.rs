//! Options of the expandable allocator and the layout they resolve to.

use super::physical::Layout;
use crate::{AllocError, AllocResult};
use vmmalloc_device::{round_up, DeviceCaps};

/// Options of the expandable allocator (`VMMALLOC_CONF` keys of the same names).
///
/// `Default` gives the documented defaults; `ExpandableConfig::resolve`
/// checks the options against a device and rejects bad ones with an
/// [`AllocError::InvalidOption`] that names the option.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpandableConfig {
    /// Bytes of one physical page (one `cuMemCreate` handle). `None`: the
    /// device's allocation granularity (2 MiB on current GPUs). Must be a
    /// positive multiple of the granularity, at most the device memory.
    pub page_size: Option<u64>,
    /// Bytes of virtual address space reserved per arena (`cuMemAddressReserve`).
    /// `None`: 4 × device memory. Each arena is cut into slices of the device
    /// memory size (rounded up to the page size), one slice per segment; more
    /// arenas are reserved when the slices run out. Must be a multiple of the
    /// page size and hold at least one slice.
    pub arena_size: Option<u64>,
    /// Bytes of unmapped pages kept in the page pool. Pages above this are
    /// released to the driver (`cuMemRelease`) as soon as they are pooled.
    /// Default: `u64::MAX` (keep every page until `empty_cache`).
    pub release_threshold: u64,
    /// Fraction of device memory this allocator may hold, mapped or pooled, in
    /// [0, 1] (PyTorch's `setMemoryFraction` accepts 0 to 1 inclusive; 0 allows
    /// nothing). Default 1.0. [`crate::Allocator::set_memory_fraction`] changes it
    /// at run time.
    pub memory_fraction: f64,
    /// Largest physical chunk (one `cuMemCreate` handle) in bytes; None =
    /// adaptive. A multiple of `page_size`. `None`: [`DEFAULT_MAX_CHUNK`],
    /// at most an eighth of the device memory. The driver charges per handle,
    /// not per byte (see docs/expandable.md, "Chunks"), so larger chunks mean
    /// fewer, cheaper calls; `page_size` here gives one handle per page.
    pub max_chunk: Option<u64>,
    /// Live bytes, as a fraction of the memory limit, above which a free
    /// chunk that a new block would cover only in part is split (unmapped and
    /// re-backed by exact chunks) instead of pinned; in [0, 1]. Default
    /// [`DEFAULT_SPLIT_THRESHOLD`] (1: never split; the pinned pages come
    /// back by unpinning when memory runs short, see [`Self::unpin`]; without
    /// unpinning, free memory pinned inside chunks can cause avoidable
    /// out-of-memory); 0 always splits. See docs/expandable.md, "Chunks: the
    /// trade-off".
    pub split_threshold: f64,
    /// Bytes a partly covered free chunk may leave uncovered and still be
    /// reused whole (pinned) rather than split, when memory is tight; rounded
    /// down to whole pages. Default [`DEFAULT_SPLIT_SLACK`]. A split costs a
    /// stream wait, an unmap and a new handle (~300 µs on an A100); pinning a
    /// few pages costs at most those pages until the block is freed. 0 splits
    /// every partly covered chunk. The same tolerance spares a block's shared
    /// edge page its own chunk when the rest of the run is no longer than
    /// this. See docs/expandable.md, "Chunks: the trade-off".
    pub split_slack: u64,
    /// When device memory is exhausted after reclaim, back the request with
    /// host-located chunks mapped into the same virtual range
    /// ([`vmmalloc_device::Device::create_on_host`]) instead of failing;
    /// they move back to device memory at a quiet point. Default `false`.
    /// See docs/expandable.md, "Spill and pressure".
    pub spill: bool,
    /// When an allocation still lacks pages after the pool, new handles and
    /// a targeted reclaim, give back the free pages of chunks that live
    /// blocks hold only in part (*unpin*): the live pages get exact chunks of
    /// their own at the same addresses (their bytes copied on the device or
    /// through host memory, after a device-wide synchronize) and the old
    /// chunk is unmapped. Default [`UnpinMode::Auto`]: only while no other
    /// host thread may be launching work alongside the allocating call.
    /// See docs/expandable.md, "Unpinning" and "Unpinning and threads".
    pub unpin: UnpinMode,
    /// Bytes to which a segment's tail grows at a time while mapped + pooled
    /// memory stays under 4/5 of the limit: a block that extends the tail
    /// maps up to the next multiple of this (in one chunk with its own
    /// pages), so the small blocks after it find their pages mapped. Default
    /// [`DEFAULT_GROW_GRANULE`] (PyTorch's 20 MiB large-pool page); 0 (or at
    /// most the page size) maps exactly what each block needs.
    pub grow_granule: u64,
}

/// When the expandable allocator unpins ([`ExpandableConfig::unpin`];
/// `VMMALLOC_CONF` key `unpin`, policy option `unpin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnpinMode {
    /// `auto` (the default): unpin unless another host thread may be
    /// running alongside the allocating call: one that allocates only on
    /// streams of its own (while they hold live blocks or it called
    /// lately), or calls that overlapped or interleaved lately
    /// (docs/expandable.md, "Unpinning and threads").
    #[default]
    Auto,
    /// `always` (`true`): unpin whenever an allocation needs it. Safe only
    /// when no other thread launches work on live tensors during an
    /// allocating call.
    Always,
    /// `false`: never move a live tensor; pinned pages stay until their
    /// blocks are freed.
    Never,
}

impl UnpinMode {
    /// The values accepted, as written in `VMMALLOC_CONF` and policy specs.
    pub const VALUES: &'static str = "auto, always (or true/1), false (or 0)";

    /// Parses `auto`, `always`/`true`/`1`, `false`/`0`.
    pub fn parse(v: &str) -> Option<UnpinMode> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(UnpinMode::Auto),
            "always" | "true" | "1" => Some(UnpinMode::Always),
            "false" | "0" | "never" => Some(UnpinMode::Never),
            _ => None,
        }
    }

    /// The canonical spelling (`auto`, `always`, `false`).
    pub fn as_str(self) -> &'static str {
        match self {
            UnpinMode::Auto => "auto",
            UnpinMode::Always => "always",
            UnpinMode::Never => "false",
        }
    }
}

impl std::str::FromStr for UnpinMode {
    type Err = String;
    fn from_str(v: &str) -> Result<Self, String> {
        UnpinMode::parse(v).ok_or_else(|| format!("expected {}, got `{v}`", UnpinMode::VALUES))
    }
}

impl std::fmt::Display for UnpinMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The default [`ExpandableConfig::grow_granule`]: 20 MiB, the page in which
/// PyTorch's expandable segments grow the large pool
/// (`CUDACachingAllocator.cpp`, `ExpandableSegment`, `kLargeBuffer`).
pub const DEFAULT_GROW_GRANULE: u64 = 20 << 20;

/// The default [`ExpandableConfig::split_threshold`]: 1, never split. With
/// unpinning ([`ExpandableConfig::unpin`]) the free pages a pin holds come
/// back when memory runs short, so splitting ahead of need only costs calls
/// (docs/expandable.md, "Chunks: the trade-off", measures 0.4, the default
/// before unpinning, against it).
pub const DEFAULT_SPLIT_THRESHOLD: f64 = 1.0;

/// The default [`ExpandableConfig::split_slack`]: 4 MiB, two pages of the
/// 2 MiB granularity of current GPUs (docs/results.md at commit e2520b3,
/// "Ablation: pinned slack", measured 0, 2, 4, 8 and 20 MiB while splitting
/// was the default). Used only while splitting (`split_threshold` below 1).
pub const DEFAULT_SPLIT_SLACK: u64 = 4 << 20;

/// The largest chunk when [`ExpandableConfig::max_chunk`] is `None`: 1 GiB.
/// Past a few hundred MiB the per-byte part of `cuMemCreate` dominates
/// (~0.7 µs/MiB against ~193 µs per call on an A100), so larger chunks save
/// almost nothing and only make reclaim coarser.
pub const DEFAULT_MAX_CHUNK: u64 = 1 << 30;

impl Default for ExpandableConfig {
    fn default() -> Self {
        ExpandableConfig {
            page_size: None,
            arena_size: None,
            release_threshold: u64::MAX,
            memory_fraction: 1.0,
            max_chunk: None,
            split_threshold: DEFAULT_SPLIT_THRESHOLD,
            split_slack: DEFAULT_SPLIT_SLACK,
            spill: false,
            unpin: UnpinMode::Auto,
            grow_granule: DEFAULT_GROW_GRANULE,
        }
    }
}

/// Checks a memory fraction.
pub(crate) fn check_fraction(fraction: f64) -> AllocResult<()> {
    if (0.0..=1.0).contains(&fraction) {
        Ok(())
    } else {
        Err(AllocError::InvalidOption(format!(
            "memory_fraction must be in [0, 1], got {fraction}"
        )))
    }
}

impl ExpandableConfig {
    /// Checks the options against a device and derives the layout.
    pub(crate) fn resolve(&self, caps: &DeviceCaps) -> AllocResult<Layout> {
        let g = caps.granularity;
        if !caps.vmm_supported {
            return Err(AllocError::InvalidOption(format!(
                "the expandable allocator needs the virtual-memory API, which {} does not support",
                caps.name
            )));
        }
        if g == 0 || caps.total_memory < g {
            return Err(AllocError::InvalidOption(format!(
                "device {} reports granularity {g} and memory {}: cannot place pages",
                caps.name, caps.total_memory
            )));
        }
        let page = self.page_size.unwrap_or(g);
        if page == 0 || !page.is_multiple_of(g) {
            return Err(AllocError::InvalidOption(format!(
                "page_size must be a positive multiple of the allocation granularity ({g} bytes), got {page}"
            )));
        }
        if page > caps.total_memory {
            return Err(AllocError::InvalidOption(format!(
                "page_size ({page} bytes) is larger than the device memory ({} bytes)",
                caps.total_memory
            )));
        }
        let slice = round_up(caps.total_memory, page);
        let arena = match self.arena_size {
            Some(a) => a,
            None => 4 * slice,
        };
        if !arena.is_multiple_of(page) {
            return Err(AllocError::InvalidOption(format!(
                "arena_size must be a multiple of page_size ({page} bytes), got {arena}"
            )));
        }
        if arena < slice {
            return Err(AllocError::InvalidOption(format!(
                "arena_size ({arena} bytes) must hold at least one segment slice \
                 (the device memory rounded up to page_size: {slice} bytes)"
            )));
        }
        check_fraction(self.memory_fraction)?;
        if !(0.0..=1.0).contains(&self.split_threshold) {
            return Err(AllocError::InvalidOption(format!(
                "split_threshold must be in [0, 1], got {}",
                self.split_threshold
            )));
        }
        let max_chunk_pages = match self.max_chunk {
            Some(m) if m == 0 || !m.is_multiple_of(page) || m > caps.total_memory => {
                return Err(AllocError::InvalidOption(format!(
                    "max_chunk must be a positive multiple of page_size ({page} bytes) \
                     and at most the device memory, got {m}"
                )))
            }
            Some(m) => m / page,
            None => (DEFAULT_MAX_CHUNK.min(caps.total_memory / 8) / page).max(1),
        };
        Ok(Layout {
            page,
            page_shift: page.is_power_of_two().then(|| page.trailing_zeros()),
            slice,
            slices_per_arena: arena / slice,
            total: caps.total_memory,
            max_chunk_pages,
            slack_pages: self.split_slack / page,
            grow_pages: self.grow_granule / page,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_device::{sim::SimDevice, Device, GIB, MIB};

    fn caps() -> DeviceCaps {
        SimDevice::with_capacity(GIB).caps().clone()
    }

    #[test]
    fn defaults_resolve_to_granularity_pages_and_four_slices() {
        let l = ExpandableConfig::default().resolve(&caps()).unwrap();
        assert_eq!(l.page, 2 * MIB);
        assert_eq!(l.page_shift, Some(21));
        assert_eq!(l.slice, GIB);
        assert_eq!(l.slices_per_arena, 4);
        assert_eq!(l.limit_pages(1.0), 512);
        assert_eq!(l.limit_pages(0.5), 256);
        assert_eq!(l.max_chunk_pages, 64, "an eighth of 1 GiB in 2 MiB pages");
        let big = SimDevice::with_capacity(80 * GIB).caps().clone();
        let l = ExpandableConfig::default().resolve(&big).unwrap();
        assert_eq!(l.max_chunk_pages, 512, "1 GiB in 2 MiB pages");
    }

    #[test]
    fn bad_options_are_named() {
        let bad = |cfg: ExpandableConfig, key: &str| {
            let e = cfg.resolve(&caps()).unwrap_err();
            assert!(matches!(e, AllocError::InvalidOption(_)), "{e}");
            assert!(e.to_string().contains(key), "{e} should name {key}");
        };
        bad(
            ExpandableConfig {
                page_size: Some(3 * MIB),
                ..Default::default()
            },
            "page_size",
        );
        bad(
            ExpandableConfig {
                page_size: Some(0),
                ..Default::default()
            },
            "page_size",
        );
        bad(
            ExpandableConfig {
                page_size: Some(2 * GIB),
                ..Default::default()
            },
            "page_size",
        );
        bad(
            ExpandableConfig {
                arena_size: Some(GIB / 2),
                ..Default::default()
            },
            "arena_size",
        );
        bad(
            ExpandableConfig {
                arena_size: Some(GIB + MIB),
                ..Default::default()
            },
            "arena_size",
        );
        bad(
            ExpandableConfig {
                max_chunk: Some(3 * MIB),
                ..Default::default()
            },
            "max_chunk",
        );
        bad(
            ExpandableConfig {
                split_threshold: 1.5,
                ..Default::default()
            },
            "split_threshold",
        );
        bad(
            ExpandableConfig {
                max_chunk: Some(0),
                ..Default::default()
            },
            "max_chunk",
        );
        bad(
            ExpandableConfig {
                memory_fraction: 1.5,
                ..Default::default()
            },
            "memory_fraction",
        );
        bad(
            ExpandableConfig {
                memory_fraction: f64::NAN,
                ..Default::default()
            },
            "memory_fraction",
        );
    }

    #[test]
    fn non_power_of_two_pages_use_division() {
        let cfg = ExpandableConfig {
            page_size: Some(6 * MIB),
            ..Default::default()
        };
        let l = cfg.resolve(&caps()).unwrap();
        assert_eq!(l.page_shift, None);
        assert_eq!(l.page_of(6 * MIB - 1), 0);
        assert_eq!(l.page_of(6 * MIB), 1);
        assert_eq!(l.slice, round_up(GIB, 6 * MIB));
    }
}
