//! PyTorch's size constants and rounding rules (`c10/cuda/CUDACachingAllocator.cpp`).
//!
//! Each function carries the name of the PyTorch function it mirrors.

use super::config::CachingConfig;

/// One mebibyte (`kMB`).
pub const MB: u64 = 1 << 20;
/// All sizes are rounded to at least 512 bytes (`kMinBlockSize`).
pub const K_MIN_BLOCK_SIZE: u64 = 512;
/// Largest "small" allocation, 1 MiB (`kSmallSize`).
pub const K_SMALL_SIZE: u64 = MB;
/// "Small" allocations are packed in 2 MiB segments (`kSmallBuffer`); also the
/// page size of small-pool expandable segments.
pub const K_SMALL_BUFFER: u64 = 2 * MB;
/// "Large" allocations may be packed in 20 MiB segments (`kLargeBuffer`); also
/// the page size of large-pool expandable segments.
pub const K_LARGE_BUFFER: u64 = 20 * MB;
/// Allocations between 1 and 10 MiB may use `kLargeBuffer` (`kMinLargeAlloc`).
pub const K_MIN_LARGE_ALLOC: u64 = 10 * MB;
/// Large allocations are rounded up to 2 MiB (`kRoundLarge`).
pub const K_ROUND_LARGE: u64 = 2 * MB;
/// PyTorch refuses requests of 1 EiB or more before reaching the allocator
/// (`NativeCachingAllocator::allocate`: "Tried to allocate more than 1EB memory").
pub const ONE_EXA_BYTES: u64 = 1 << 60;

/// Which of PyTorch's two block pools (`large_blocks`, `small_blocks`) a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// `small_blocks`: requests of at most 1 MiB.
    Small,
    /// `large_blocks`: everything larger.
    Large,
}

impl PoolKind {
    /// `BlockPool::is_small`.
    pub fn is_small(self) -> bool {
        self == PoolKind::Small
    }
    /// The stat type of the pool (`get_stat_types_for_pool`, besides `all`).
    pub fn stat_type(self) -> crate::StatType {
        match self {
            PoolKind::Small => crate::StatType::Small,
            PoolKind::Large => crate::StatType::Large,
        }
    }
    /// The snapshot's segment type (`"small"` / `"large"`).
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// `roundup_power2_next_division`: rounds `size` up to the next of `divisions`
/// equal steps between the powers of two around it. PyTorch's example: 1200
/// with 4 divisions lies between 1024 and 2048, whose steps are 1024, 1280,
/// 1536, 1792, so the result is 1280. Powers of two are returned unchanged.
/// `divisions` must be a power of two, at least 2.
pub fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    debug_assert!(divisions >= 2, "Only 2 or more divisions are supported");
    let power2_floor = 1u64 << size.ilog2();
    let power2_division = power2_floor >> divisions.max(1).ilog2();
    if power2_division == 0 {
        return power2_floor << 1;
    }
    let round_size_floor = size & !(power2_division - 1);
    if round_size_floor == size {
        size
    } else {
        round_size_floor + power2_division
    }
}

/// `round_size`: at least 512 bytes; with `roundup_power2_divisions` > 1 for
/// the size's interval and a size above `512 × divisions`, the next power-of-two
/// division; otherwise the next multiple of 512.
pub fn round_size(size: u64, config: &CachingConfig) -> u64 {
    if size < K_MIN_BLOCK_SIZE {
        return K_MIN_BLOCK_SIZE;
    }
    let divisions = config.roundup_power2_divisions(size);
    if divisions > 1 && size > K_MIN_BLOCK_SIZE * divisions {
        roundup_power2_next_division(size, divisions)
    } else {
        K_MIN_BLOCK_SIZE * size.div_ceil(K_MIN_BLOCK_SIZE)
    }
}

/// `get_pool`: the small pool for (rounded) sizes up to 1 MiB, else the large pool.
pub fn get_pool(size: u64) -> PoolKind {
    if size <= K_SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// `get_allocation_size`: the segment `cudaMalloc`ed for a (rounded) request
/// that no cached block serves: 2 MiB for small requests, 20 MiB below 10 MiB,
/// else the request rounded up to 2 MiB.
pub fn get_allocation_size(size: u64) -> u64 {
    if size <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if size < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER
    } else {
        K_ROUND_LARGE * size.div_ceil(K_ROUND_LARGE)
    }
}

/// `should_split`: whether a `block_size` block handed out for a `size` request
/// is split. Small pool or expandable segments: when at least 512 bytes remain;
/// large pool: when the request is below `max_split_size` and more than 1 MiB remains.
pub fn should_split(
    block_size: u64,
    size: u64,
    pool: PoolKind,
    expandable_segments: bool,
    max_split_size: u64,
) -> bool {
    let remaining = block_size - size;
    if pool.is_small() || expandable_segments {
        remaining >= K_MIN_BLOCK_SIZE
    } else {
        size < max_split_size && remaining > K_SMALL_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundup_power2_next_division_matches_pytorch_comment() {
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(roundup_power2_next_division(1024, 4), 1024);
        assert_eq!(roundup_power2_next_division(1280, 4), 1280);
        assert_eq!(roundup_power2_next_division(1793, 4), 2048);
        // A division below one byte: the next power of two.
        assert_eq!(roundup_power2_next_division(3, 4), 4);
    }

    #[test]
    fn get_allocation_size_boundaries() {
        assert_eq!(get_allocation_size(512), K_SMALL_BUFFER);
        assert_eq!(get_allocation_size(MB), K_SMALL_BUFFER);
        assert_eq!(get_allocation_size(MB + 512), K_LARGE_BUFFER);
        assert_eq!(get_allocation_size(10 * MB - 512), K_LARGE_BUFFER);
        assert_eq!(get_allocation_size(10 * MB), 10 * MB);
        assert_eq!(get_allocation_size(10 * MB + 512), 12 * MB);
    }
}
