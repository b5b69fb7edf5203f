//! Pieces shared by this crate's property tests (`expandable_prop.rs`,
//! `segment_follow.rs`).

use proptest::prelude::*;

/// Sizes in `[1, max]`: half log-uniform (many tiny ones), half in
/// `[max / 16, max]` so that memory fills up (reclaim, unpinning, spill,
/// out-of-memory).
pub fn size(max: u64) -> impl Strategy<Value = u64> {
    let bits = 63 - max.leading_zeros();
    prop_oneof![
        (0..=bits, any::<u64>())
            .prop_map(move |(b, r)| ((1u64 << b) + r % (1u64 << b)).clamp(1, max)),
        (max / 16)..=max,
    ]
}
