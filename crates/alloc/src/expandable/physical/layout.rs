//! The layout: the sizes derived from the options and the device
//! (`ExpandableConfig::resolve`, `config.rs`) that pages, segments, chunks
//! and the budget are measured in. It lives here, with the memory it
//! measures; the block layer reads it too.

/// Sizes derived from the options and the device; fixed for the allocator's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Bytes of one physical page.
    pub page: u64,
    /// `log2(page)` when the page size is a power of two (fast index math).
    pub page_shift: Option<u32>,
    /// Bytes of address space per segment: device memory rounded up to pages.
    pub slice: u64,
    /// Slices per arena.
    pub slices_per_arena: u64,
    /// Device memory in bytes.
    pub total: u64,
    /// Pages of the largest chunk.
    pub max_chunk_pages: u64,
    /// Uncovered pages a partly covered free chunk may keep and still be
    /// pinned rather than split (`split_slack` in pages).
    pub slack_pages: u64,
    /// Pages to which a growing tail maps ahead (`grow_granule` in pages,
    /// rounded down; 1 or 0: no mapping ahead).
    pub grow_pages: u64,
}

impl Layout {
    /// Index of the page holding byte `offset` of a segment.
    #[inline]
    pub fn page_of(&self, offset: u64) -> u64 {
        match self.page_shift {
            Some(s) => offset >> s,
            None => offset / self.page,
        }
    }

    /// Live bytes above which free chunks are split, for a memory fraction
    /// and a split threshold.
    pub fn split_above(&self, fraction: f64, threshold: f64) -> u64 {
        (self.limit_pages(fraction) as f64 * self.page as f64 * threshold) as u64
    }

    /// The most pages a memory fraction allows.
    pub fn limit_pages(&self, fraction: f64) -> u64 {
        ((self.total as f64 * fraction) as u64).min(self.total) / self.page
    }
}
