//! The physical chunk pool: unmapped handles kept for reuse, keyed by size.
//!
//! A chunk is one `cuMemCreate` handle of a whole number of pages. Unmapped
//! chunks keep their handle here and are mapped again without
//! `cuMemRelease`/`cuMemCreate` (PyTorch issue #166116: releasing and
//! re-creating is what makes its expandable segments slow after
//! `empty_cache`). Lookups are by size in pages: the largest pooled chunk that
//! fits a run, or the largest overall (released first, so that trimming the
//! pool costs as few `cuMemRelease` calls as possible).
//!
//! Invariants (checked by `validate`): `pages` is the sum of the sizes of the
//! pooled chunks and `count` their number; no size maps to an empty list.

use std::collections::BTreeMap;
use vmmalloc_device::PhysHandle;

/// Unmapped chunks by size in pages.
#[derive(Debug, Default)]
pub(crate) struct ChunkPool {
    /// Size in pages -> handles of that size.
    by_pages: BTreeMap<u64, Vec<PhysHandle>>,
    /// Pages pooled.
    pages: u64,
    /// Handles pooled.
    count: u64,
}

impl ChunkPool {
    /// Pages held by pooled chunks.
    #[inline]
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Number of pooled chunks (handles).
    #[inline]
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Adds a chunk of `pages` pages.
    pub fn put(&mut self, handle: PhysHandle, pages: u64) {
        self.by_pages.entry(pages).or_default().push(handle);
        self.pages += pages;
        self.count += 1;
    }

    /// Removes one chunk of exactly `pages` pages.
    pub fn take(&mut self, pages: u64) -> Option<PhysHandle> {
        let list = self.by_pages.get_mut(&pages)?;
        let h = list.pop()?;
        if list.is_empty() {
            self.by_pages.remove(&pages);
        }
        self.pages -= pages;
        self.count -= 1;
        Some(h)
    }

    /// Removes the largest chunk, as `(handle, pages)`.
    pub fn take_largest(&mut self) -> Option<(PhysHandle, u64)> {
        let pages = *self.by_pages.keys().next_back()?;
        self.take(pages).map(|h| (h, pages))
    }

    /// Every pooled chunk as `(pages, count)`, ascending by size.
    pub fn sizes(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.by_pages.iter().map(|(&p, v)| (p, v.len()))
    }

    /// Every pooled handle with its size.
    pub fn iter(&self) -> impl Iterator<Item = (PhysHandle, u64)> + '_ {
        self.by_pages
            .iter()
            .flat_map(|(&p, v)| v.iter().map(move |&h| (h, p)))
    }

    /// Removes every chunk.
    pub fn drain(&mut self) -> Vec<(PhysHandle, u64)> {
        let all: Vec<_> = self.iter().collect();
        self.by_pages.clear();
        self.pages = 0;
        self.count = 0;
        all
    }

    /// Recounts `pages` and `count`.
    pub fn check(&self) -> Result<(), String> {
        let (mut pages, mut count) = (0, 0);
        for (&p, v) in &self.by_pages {
            if v.is_empty() || p == 0 {
                return Err(format!(
                    "chunk pool: empty or zero-page entry for {p} pages"
                ));
            }
            pages += p * v.len() as u64;
            count += v.len() as u64;
        }
        if (pages, count) != (self.pages, self.count) {
            return Err(format!(
                "chunk pool says {} pages in {} chunks, recount {pages} in {count}",
                self.pages, self.count
            ));
        }
        Ok(())
    }
}

/// Pooled chunk sizes as counts, for planning without touching the pool.
#[derive(Debug, Clone, Default)]
pub(crate) struct PoolView(BTreeMap<u64, usize>);

impl PoolView {
    /// A view of `pool`'s sizes.
    pub fn of(pool: &ChunkPool) -> PoolView {
        PoolView(pool.sizes().collect())
    }

    /// Takes the largest pooled size of at most `max_pages`, if any.
    pub fn take_largest_at_most(&mut self, max_pages: u64) -> Option<u64> {
        let (&p, n) = self.0.range_mut(..=max_pages).next_back()?;
        *n -= 1;
        if *n == 0 {
            self.0.remove(&p);
        }
        Some(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_take_and_counts() {
        let mut p = ChunkPool::default();
        p.put(PhysHandle(1), 1);
        p.put(PhysHandle(2), 10);
        p.put(PhysHandle(3), 10);
        assert_eq!((p.pages(), p.count()), (21, 3));
        assert_eq!(p.take(4), None);
        assert_eq!(p.take_largest(), Some((PhysHandle(3), 10)));
        assert_eq!(p.take(10), Some(PhysHandle(2)));
        assert_eq!((p.pages(), p.count()), (1, 1));
        p.check().unwrap();
        assert_eq!(p.drain(), vec![(PhysHandle(1), 1)]);
        assert_eq!(p.count(), 0);
        p.check().unwrap();
    }

    #[test]
    fn view_takes_the_largest_that_fits() {
        let mut p = ChunkPool::default();
        p.put(PhysHandle(1), 2);
        p.put(PhysHandle(2), 8);
        let mut v = PoolView::of(&p);
        assert_eq!(v.take_largest_at_most(7), Some(2));
        assert_eq!(v.take_largest_at_most(7), None);
        assert_eq!(v.take_largest_at_most(100), Some(8));
        assert_eq!(v.take_largest_at_most(100), None);
        assert_eq!(p.pages(), 10, "the view does not change the pool");
    }
}
