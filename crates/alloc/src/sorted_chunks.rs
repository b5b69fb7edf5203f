//! A sorted map stored as a list of short sorted chunks (a two-level B-tree).
//!
//! Each chunk holds at most `2 × CHUNK` entries and the largest key of every
//! chunk is kept alongside, so a lookup is two binary searches and an update
//! a short `memmove`. Faster than `BTreeMap` for the few hundred entries the
//! allocators' free-block indexes usually hold, and no slower for many.
//!
//! A map that empties keeps its last (empty) chunk, so one that often empties
//! and fills again does not allocate each time.

/// Target chunk length; a chunk splits above twice this.
const CHUNK: usize = 16;

/// A sorted map from `K` to `V`, in chunks of at most `2 × CHUNK` entries.
///
/// Positions are `(chunk, index)` pairs; `(chunks, 0)` is the end.
#[derive(Debug, Clone)]
pub(crate) struct SortedChunks<K: Ord + Copy, V: Copy + Eq> {
    /// Sorted chunks, in key order. Only a lone chunk may be empty.
    chunks: Vec<Vec<(K, V)>>,
    /// Largest key of each chunk. A lone empty chunk keeps the last key it
    /// held: every lookup then finds that chunk empty, or no chunk at all.
    maxes: Vec<K>,
}

impl<K: Ord + Copy, V: Copy + Eq> Default for SortedChunks<K, V> {
    fn default() -> Self {
        SortedChunks {
            chunks: Vec::new(),
            maxes: Vec::new(),
        }
    }
}

impl<K: Ord + Copy, V: Copy + Eq> SortedChunks<K, V> {
    /// Whether the map holds no entry.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.chunks.first().is_none_or(Vec::is_empty)
    }

    /// Number of chunks: positions `(chunk, index)` with `chunk` below it may
    /// hold entries.
    #[inline]
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Whether (chunk, index) holds an entry.
    #[inline]
    pub fn has(&self, ci: usize, i: usize) -> bool {
        self.chunks.get(ci).is_some_and(|c| i < c.len())
    }

    /// (chunk, index) of the first entry whose key is >= `k`; (chunks, 0) if none.
    #[inline]
    pub fn lower_bound(&self, k: K) -> (usize, usize) {
        let ci = self.maxes.partition_point(|m| *m < k);
        match self.chunks.get(ci) {
            Some(c) => (ci, c.partition_point(|e| e.0 < k)),
            None => (ci, 0),
        }
    }

    /// The entry at (chunk, index), if any.
    #[inline]
    pub fn entry(&self, ci: usize, i: usize) -> Option<(K, V)> {
        self.chunks.get(ci).and_then(|c| c.get(i)).copied()
    }

    /// The position after (chunk, index), which holds an entry.
    #[inline]
    pub fn next_pos(&self, ci: usize, i: usize) -> (usize, usize) {
        if i + 1 < self.chunks[ci].len() {
            (ci, i + 1)
        } else {
            (ci + 1, 0)
        }
    }

    /// The value of the first entry whose key is >= `k`.
    #[inline]
    pub fn first_at_least(&self, k: K) -> Option<V> {
        let (ci, i) = self.lower_bound(k);
        self.entry(ci, i).map(|e| e.1)
    }

    /// The value of the first entry.
    #[inline]
    pub fn first(&self) -> Option<V> {
        self.entry(0, 0).map(|e| e.1)
    }

    /// The value stored under `k`.
    pub fn get(&self, k: K) -> Option<V> {
        let (ci, i) = self.lower_bound(k);
        self.entry(ci, i).filter(|e| e.0 == k).map(|e| e.1)
    }

    /// Whether the entry `k -> v` is present.
    pub fn contains(&self, k: K, v: V) -> bool {
        let (ci, i) = self.lower_bound(k);
        self.entry(ci, i) == Some((k, v))
    }

    /// Inserts `k -> v`; false (and no change) if `k` is present.
    pub fn insert(&mut self, k: K, v: V) -> bool {
        if self.chunks.is_empty() {
            self.chunks.push(vec![(k, v)]);
            self.maxes.push(k);
            return true;
        }
        let (mut ci, mut i) = self.lower_bound(k);
        if ci == self.chunks.len() {
            ci -= 1;
            i = self.chunks[ci].len();
        } else if self.chunks[ci].get(i).is_some_and(|e| e.0 == k) {
            return false;
        }
        let c = &mut self.chunks[ci];
        c.insert(i, (k, v));
        self.maxes[ci] = c[c.len() - 1].0;
        if c.len() > 2 * CHUNK {
            let tail = c.split_off(CHUNK);
            self.maxes[ci] = c[c.len() - 1].0;
            self.maxes.insert(ci + 1, tail[tail.len() - 1].0);
            self.chunks.insert(ci + 1, tail);
        }
        true
    }

    /// Removes the entry `k -> v`; false (and no change) if absent.
    pub fn remove(&mut self, k: K, v: V) -> bool {
        let (ci, i) = self.lower_bound(k);
        if self.entry(ci, i) != Some((k, v)) {
            return false;
        }
        self.remove_at(ci, i);
        true
    }

    /// Removes the entry at (chunk, index), which exists.
    pub fn remove_at(&mut self, ci: usize, i: usize) {
        let c = &mut self.chunks[ci];
        c.remove(i);
        let n = c.len();
        if n == 0 {
            // A lone chunk stays (empty, its max stale): the map is empty and
            // refilling it allocates nothing.
            if self.chunks.len() > 1 {
                self.chunks.remove(ci);
                self.maxes.remove(ci);
            }
        } else {
            self.maxes[ci] = c[n - 1].0;
            // Keep chunks from thinning out: fold a small chunk into its successor.
            if n < CHUNK / 4 && ci + 1 < self.chunks.len() && n + self.chunks[ci + 1].len() <= CHUNK
            {
                let next = self.chunks.remove(ci + 1);
                self.maxes.remove(ci + 1);
                let c = &mut self.chunks[ci];
                c.extend(next);
                self.maxes[ci] = c[c.len() - 1].0;
            }
        }
    }

    /// Replaces the entry `old -> old_v` by `new -> v` (`new` absent from the
    /// map), moving it within its chunk when it stays there; false (and no
    /// change) if the entry is absent.
    pub fn replace(&mut self, old: K, old_v: V, new: K, v: V) -> bool {
        let (ci, i) = self.lower_bound(old);
        if self.entry(ci, i) != Some((old, old_v)) {
            return false;
        }
        self.replace_at(ci, i, new, v);
        true
    }

    /// Replaces the entry at (chunk, index), which exists, by `new -> v`
    /// (`new` absent from the map).
    pub fn replace_at(&mut self, ci: usize, i: usize, new: K, v: V) {
        let stays = (ci == 0 || new > self.maxes[ci - 1])
            && self.chunks.get(ci + 1).is_none_or(|next| new < next[0].0);
        if !stays {
            self.remove_at(ci, i);
            let inserted = self.insert(new, v);
            debug_assert!(inserted, "replace onto a present key");
            return;
        }
        let c = &mut self.chunks[ci];
        let j = c.partition_point(|e| e.0 < new);
        debug_assert!(j >= c.len() || c[j].0 != new, "replace onto a present key");
        if j > i {
            c.copy_within(i + 1..j, i);
            c[j - 1] = (new, v);
        } else {
            c.copy_within(j..i, j + 1);
            c[j] = (new, v);
        }
        self.maxes[ci] = c[c.len() - 1].0;
    }

    /// Every entry in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (K, V)> + '_ {
        self.chunks.iter().flat_map(|c| c.iter().copied())
    }

    /// The entries with keys < `k`, descending.
    pub fn iter_below_rev(&self, k: K) -> impl Iterator<Item = (K, V)> + '_ {
        let (ci, i) = self.lower_bound(k);
        let last = self.chunks.get(ci).map_or(&[][..], |c| &c[..i]);
        let head = &self.chunks[..ci.min(self.chunks.len())];
        head.iter()
            .flat_map(|c| c.iter().copied())
            .chain(last.iter().copied())
            .rev()
    }
}

#[cfg(test)]
mod tests {
    use super::{SortedChunks, CHUNK};
    use std::collections::BTreeMap;

    /// Agrees with a `BTreeMap` on a random sequence of every operation,
    /// including emptying and refilling (the kept lone chunk).
    #[test]
    fn matches_a_btreemap() {
        let mut m: SortedChunks<u64, u32> = SortedChunks::default();
        let mut b: BTreeMap<u64, u32> = BTreeMap::new();
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000u32 {
            let r = rnd();
            // Keys crowd a small range so chunks split, merge and empty.
            let span = if step % 4000 < 3000 { 2_000 } else { 40 };
            let k = (r >> 8) % span;
            match r % 7 {
                0..=2 => {
                    let fresh = !b.contains_key(&k);
                    assert_eq!(m.insert(k, step), fresh, "step {step}");
                    if fresh {
                        b.insert(k, step);
                    }
                }
                3 | 4 => {
                    let v = b.get(&k).copied();
                    assert!(!m.remove(k, v.map_or(1, |v| v + 1)));
                    if let Some(v) = v {
                        assert!(m.contains(k, v));
                        assert!(m.remove(k, v) && !m.remove(k, v));
                        b.remove(&k);
                    }
                }
                5 => {
                    // Replace through a lower-bound position, or by key.
                    let new = (rnd() >> 8) % span;
                    if let Some((&old, &v)) = b.range(k..).next() {
                        if !b.contains_key(&new) {
                            if r & 64 == 0 {
                                let (ci, i) = m.lower_bound(k);
                                assert_eq!(m.entry(ci, i), Some((old, v)));
                                m.replace_at(ci, i, new, step);
                            } else {
                                assert!(m.replace(old, v, new, step));
                            }
                            b.remove(&old);
                            b.insert(new, step);
                        }
                    }
                    assert!(!m.replace(span, 0, span + 1, 0));
                }
                6 => {
                    // Walk from a lower bound by positions.
                    let (mut ci, mut i) = m.lower_bound(k);
                    let want: Vec<(u64, u32)> =
                        b.range(k..).take(40).map(|(&k, &v)| (k, v)).collect();
                    let mut got = Vec::new();
                    while m.has(ci, i) && got.len() < want.len() {
                        got.push(m.entry(ci, i).unwrap());
                        (ci, i) = m.next_pos(ci, i);
                    }
                    assert_eq!(got, want, "step {step}");
                    assert!(ci <= m.num_chunks());
                }
                _ => {}
            }
            // Empty the map now and then: the lone chunk is reused.
            if step % 1000 == 999 {
                for (k, v) in std::mem::take(&mut b) {
                    assert!(m.remove(k, v));
                }
                assert!(m.is_empty() && m.num_chunks() == 1);
                assert_eq!((m.first(), m.iter().next()), (None, None));
                let (ci, i) = m.lower_bound(k);
                assert!(!m.has(ci, i) && m.entry(ci, i).is_none());
            }
            assert_eq!(m.is_empty(), b.is_empty());
            assert_eq!(m.get(k), b.get(&k).copied(), "step {step}");
            assert_eq!(m.first_at_least(k), b.range(k..).next().map(|e| *e.1));
            assert_eq!(m.first(), b.values().next().copied());
            if step % 97 == 0 {
                assert!(m.iter().eq(b.iter().map(|(&k, &v)| (k, v))));
                assert!(m.iter().rev().eq(b.iter().rev().map(|(&k, &v)| (k, v))));
                assert!(m
                    .iter_below_rev(k)
                    .eq(b.range(..k).rev().map(|(&k, &v)| (k, v))));
                // Chunks stay within bounds, and only a lone chunk is empty.
                let n = m.num_chunks();
                assert!(m.chunks.iter().all(|c| c.len() <= 2 * CHUNK));
                assert!(n == 1 || m.chunks.iter().all(|c| !c.is_empty()));
                assert!(m
                    .chunks
                    .iter()
                    .zip(&m.maxes)
                    .all(|(c, mx)| c.last().is_none_or(|e| e.0 == *mx)));
            }
        }
    }
}
