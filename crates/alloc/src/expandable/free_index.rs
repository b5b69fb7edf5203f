//! The best-fit index of one (stream, pool)'s free blocks.
//!
//! Blocks are ordered by `(size, addr)`; addresses of free blocks are unique
//! (blocks never overlap), so the pair identifies a block and the block's slab
//! index rides along. A best-fit lookup returns the first block whose size is
//! at least the request: the smallest such size, lowest address first — the
//! order a `BTreeSet<(size, addr, idx)>` gives, at a fraction of its cost.
//!
//! Shape (as TLSF allocators do): the keys are split by size class, eight
//! classes per power of two, with a bitmap of the non-empty classes. Each
//! class is a sorted list of short sorted chunks (a two-level B-tree), so an
//! update is two binary searches and a short `memmove`. A lookup searches the
//! request's class, or else takes the first entry of the next non-empty class.

use crate::size_classes::{class_of, ClassBits, CLASSES};
use crate::sorted_chunks::SortedChunks;

/// `(size << 64) | addr`: orders by size, then address.
type Key = u128;

/// Packs a block's size and address into its key.
#[inline]
fn key(size: u64, addr: u64) -> Key {
    (u128::from(size) << 64) | u128::from(addr)
}

/// The sorted entries of one size class (see [`SortedChunks`]). A class that
/// empties keeps its last chunk, so one that often empties and fills again
/// does not allocate each time.
type Class = SortedChunks<Key, u32>;

/// Free blocks of one (stream, pool), ordered for best fit by `(size, addr)`.
#[derive(Debug, Clone)]
pub(crate) struct FreeIndex {
    /// One sorted class per size class (empty ones allocate nothing).
    classes: Vec<Class>,
    /// Bit `c` set iff class `c` is non-empty.
    nonempty: ClassBits,
    /// Number of entries.
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            classes: vec![Class::default(); CLASSES],
            nonempty: ClassBits::default(),
            len: 0,
        }
    }
}

impl FreeIndex {
    /// The first non-empty class >= `from`, if any.
    #[inline]
    fn next_class(&self, from: usize) -> Option<usize> {
        self.nonempty.next(from)
    }

    /// Updates the non-empty bit of class `c`.
    #[inline]
    fn mark(&mut self, c: usize) {
        self.nonempty.set(c, !self.classes[c].is_empty());
    }

    /// Files free block `idx` of `size` bytes at `addr`. Returns false (and
    /// changes nothing) if a block with that size and address is filed.
    #[inline]
    pub fn insert(&mut self, size: u64, addr: u64, idx: u32) -> bool {
        let c = class_of(size);
        let inserted = self.classes[c].insert(key(size, addr), idx);
        if inserted {
            self.len += 1;
            self.nonempty.set(c, true);
        }
        inserted
    }

    /// Removes free block `idx` of `size` bytes at `addr`. Returns false (and
    /// changes nothing) if it is not filed.
    #[inline]
    pub fn remove(&mut self, size: u64, addr: u64, idx: u32) -> bool {
        let c = class_of(size);
        let removed = self.classes[c].remove(key(size, addr), idx);
        if removed {
            self.len -= 1;
            self.mark(c);
        }
        removed
    }

    /// The best fit for `size` bytes: the smallest block of at least `size`
    /// bytes, lowest address first.
    #[inline]
    pub fn best_fit(&self, size: u64) -> Option<u32> {
        let c = class_of(size);
        if let Some(i) = self.classes[c].first_at_least(key(size, 0)) {
            return Some(i);
        }
        self.next_class(c + 1).and_then(|n| self.classes[n].first())
    }

    /// Whether free block `idx` of `size` bytes at `addr` is filed.
    pub fn contains(&self, size: u64, addr: u64, idx: u32) -> bool {
        self.classes[class_of(size)].contains(key(size, addr), idx)
    }

    /// Number of blocks filed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The blocks of at least `min_size` bytes, in `(size, addr)` order.
    pub fn iter_from(&self, min_size: u64) -> impl Iterator<Item = u32> + '_ {
        let from = key(min_size, 0);
        self.classes[class_of(min_size)..]
            .iter()
            .flat_map(move |c| c.iter().filter(move |e| e.0 >= from).map(|e| e.1))
    }
}

#[cfg(test)]
mod tests {
    use super::FreeIndex;
    use std::collections::{BTreeSet, HashSet};

    /// Agrees with a `BTreeSet<(size, addr, idx)>` on a random sequence.
    #[test]
    fn matches_a_btreeset() {
        let mut f = FreeIndex::default();
        let mut b: BTreeSet<(u64, u64, u32)> = BTreeSet::new();
        let mut addrs: HashSet<u64> = HashSet::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..5_000u32 {
            let r = next();
            let size = 512 * (1 + (r % 4096) * if r & (1 << 40) != 0 { 37 } else { 1 });
            if r % 3 != 0 || b.is_empty() {
                let addr = 512 * (next() % 100_000);
                if !addrs.insert(addr) {
                    continue;
                }
                assert!(f.insert(size, addr, step));
                b.insert((size, addr, step));
            } else {
                let e = *b.iter().nth((next() % b.len() as u64) as usize).unwrap();
                assert!(f.contains(e.0, e.1, e.2));
                assert!(f.remove(e.0, e.1, e.2));
                assert!(!f.remove(e.0, e.1, e.2));
                b.remove(&e);
                addrs.remove(&e.1);
            }
            let want = b.range((size, 0, 0)..).next().map(|e| e.2);
            assert_eq!(f.best_fit(size), want, "step {step}");
            assert_eq!(f.len(), b.len());
        }
        let all: Vec<u32> = f.iter_from(0).collect();
        let expect: Vec<u32> = b.iter().map(|e| e.2).collect();
        assert_eq!(all, expect);
        for min in [0, 512, 100 * 512, 3000 * 512, 1 << 40] {
            let got: Vec<u32> = f.iter_from(min).collect();
            let want: Vec<u32> = b.range((min, 0, 0)..).map(|e| e.2).collect();
            assert_eq!(got, want, "from {min}");
        }
        // Emptied classes (which keep a chunk) work as new ones.
        for e in std::mem::take(&mut b) {
            assert!(f.remove(e.0, e.1, e.2));
        }
        assert_eq!(
            (f.len(), f.best_fit(0), f.iter_from(0).count()),
            (0, None, 0)
        );
        assert!(f.insert(4096, 0, 1) && f.insert(1024, 512, 2) && !f.insert(1024, 512, 3));
        assert_eq!(
            (f.best_fit(1), f.best_fit(1025), f.best_fit(4097)),
            (Some(2), Some(1), None)
        );
    }
}
