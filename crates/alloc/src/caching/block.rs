//! Blocks and block pools (`struct Block`, `struct BlockPool`).
//!
//! Blocks live in a slab and refer to their neighbours by index, as PyTorch's
//! `Block::prev` / `Block::next` pointers do. A pool keeps its free blocks
//! ordered as PyTorch's `std::set`s do: `blocks` by (stream, size, address)
//! (`BlockComparatorSize`) and `unmapped` by (stream, address)
//! (`BlockComparatorAddress`).
//!
//! Invariant: a block is in `blocks` iff it is free (not allocated, no
//! outstanding events, no stream uses) and mapped; in `unmapped` iff it is an
//! unmapped range of an expandable segment. Its key fields (stream, size, ptr)
//! never change while it is in a set: remove, change, insert.

use super::sizes::PoolKind;
use crate::size_classes::{self, ClassBits, CLASSES};
use crate::sorted_chunks::SortedChunks;
use std::collections::BTreeSet;
use vmmalloc_device::Stream;

/// A hash map keyed by integers (FxHash: one multiply per key; keys are
/// never attacker-chosen).
pub(crate) type IntMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// Index of a block in the slab.
pub(crate) type BlockId = usize;
/// Index of an expandable segment.
pub(crate) type EsId = u64;

/// A contiguous range of a segment (`struct Block`).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// Allocation stream.
    pub stream: Stream,
    /// Other streams that used the block (`recordStream`).
    pub stream_uses: BTreeSet<Stream>,
    /// Bytes.
    pub size: u64,
    /// Bytes originally requested (kept after free, as PyTorch does).
    pub requested_size: u64,
    /// Owning pool.
    pub pool: PoolKind,
    /// Device address.
    pub ptr: u64,
    /// In use by a caller.
    pub allocated: bool,
    /// Backed by physical pages (always true outside expandable segments).
    pub mapped: bool,
    /// Previous block of the same segment.
    pub prev: Option<BlockId>,
    /// Next block of the same segment.
    pub next: Option<BlockId>,
    /// Outstanding events (`event_count`).
    pub event_count: u32,
    /// `get_free_blocks_call_count` of the pool when the block was inserted.
    pub gc_count_base: i64,
    /// The expandable segment the block lies in (`expandable_segment_`).
    pub segment: Option<EsId>,
}

impl Block {
    /// A free block (`Block(device, stream, size, pool, ptr)`).
    #[inline]
    pub fn new(
        stream: Stream,
        size: u64,
        pool: PoolKind,
        ptr: u64,
        segment: Option<EsId>,
    ) -> Block {
        Block {
            stream,
            stream_uses: BTreeSet::new(),
            size,
            requested_size: 0,
            pool,
            ptr,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            event_count: 0,
            gc_count_base: 0,
            segment,
        }
    }
    /// `Block::is_split`.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
    /// Free and usable: not allocated, no outstanding events, no stream uses
    /// (`find_expandable_block`'s `allocatable`; `try_merge_blocks`'s condition).
    #[inline]
    pub fn is_allocatable(&self) -> bool {
        !self.allocated && self.event_count == 0 && self.stream_uses.is_empty()
    }
    /// Waiting for events after a free (`active_pending_free`).
    #[inline]
    pub fn is_pending_free(&self) -> bool {
        !self.allocated && (self.event_count > 0 || !self.stream_uses.is_empty())
    }
    /// Key in `BlockPool::blocks`.
    #[inline]
    pub fn size_key(&self, id: BlockId) -> SizeKey {
        (self.stream, self.size, self.ptr, id)
    }
    /// Key in `BlockPool::unmapped`.
    #[inline]
    pub fn addr_key(&self, id: BlockId) -> AddrKey {
        (self.stream, self.ptr, id)
    }
}

/// (stream, size, ptr, id): `BlockComparatorSize` order.
pub(crate) type SizeKey = (Stream, u64, u64, BlockId);
/// (stream, ptr, id): `BlockComparatorAddress` order.
pub(crate) type AddrKey = (Stream, u64, BlockId);

/// A sorted map from `u128` keys to block ids (see [`SortedChunks`]).
pub(crate) type SortedMap = SortedChunks<u128, BlockId>;

/// The size class of a key (`(size << 64) | address`): non-decreasing in size.
#[inline]
fn class_of(key: u128) -> usize {
    size_classes::class_of((key >> 64) as u64)
}

/// A position in a [`ClassedMap`]: (class, chunk, index); class `CLASSES` is the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pos {
    class: usize,
    ci: usize,
    i: usize,
}

const END: Pos = Pos {
    class: CLASSES,
    ci: 0,
    i: 0,
};

/// A sorted map from (size, address) keys to block ids, split by size class
/// (as TLSF allocators do): each class a small [`SortedMap`], a bitmap of the
/// non-empty ones. A best-fit lookup is one search in the request's class, or
/// else the first entry of the next non-empty class; updates touch one short
/// class instead of the whole pool.
#[derive(Debug, Clone)]
pub(crate) struct ClassedMap {
    classes: Vec<SortedMap>,
    nonempty: ClassBits,
}

impl Default for ClassedMap {
    fn default() -> Self {
        ClassedMap {
            classes: vec![SortedMap::default(); CLASSES],
            nonempty: ClassBits::default(),
        }
    }
}

impl ClassedMap {
    /// The first non-empty class >= `from` (`CLASSES` if none).
    #[inline]
    fn next_class(&self, from: usize) -> usize {
        self.nonempty.next(from).unwrap_or(CLASSES)
    }

    /// Updates the non-empty bit of class `c`.
    #[inline]
    fn mark(&mut self, c: usize) {
        self.nonempty.set(c, !self.classes[c].is_empty());
    }

    /// The position of the first entry whose key is >= `k` (`END` if none).
    #[inline]
    fn lower_bound(&self, k: u128) -> Pos {
        let class = class_of(k);
        let m = &self.classes[class];
        let (ci, i) = m.lower_bound(k);
        if m.has(ci, i) {
            return Pos { class, ci, i };
        }
        self.first_of(self.next_class(class + 1))
    }

    #[inline]
    fn first_of(&self, class: usize) -> Pos {
        Pos { class, ci: 0, i: 0 }
    }

    #[inline]
    fn entry(&self, p: Pos) -> Option<(u128, BlockId)> {
        self.classes.get(p.class)?.entry(p.ci, p.i)
    }

    /// The position after `p` (which holds an entry).
    #[inline]
    fn next_pos(&self, p: Pos) -> Pos {
        let m = &self.classes[p.class];
        let (ci, i) = m.next_pos(p.ci, p.i);
        if ci < m.num_chunks() {
            return Pos {
                class: p.class,
                ci,
                i,
            };
        }
        self.first_of(self.next_class(p.class + 1))
    }

    fn insert(&mut self, k: u128, id: BlockId) -> bool {
        let c = class_of(k);
        let inserted = self.classes[c].insert(k, id);
        self.mark(c);
        inserted
    }

    fn remove(&mut self, k: u128, id: BlockId) -> bool {
        let c = class_of(k);
        let removed = self.classes[c].remove(k, id);
        self.mark(c);
        removed
    }

    fn remove_at(&mut self, p: Pos) {
        self.classes[p.class].remove_at(p.ci, p.i);
        self.mark(p.class);
    }

    fn replace(&mut self, old: u128, old_id: BlockId, new: u128, id: BlockId) -> bool {
        let c = class_of(old);
        if c == class_of(new) {
            return self.classes[c].replace(old, old_id, new, id);
        }
        if !self.remove(old, old_id) {
            return false;
        }
        let inserted = self.insert(new, id);
        debug_assert!(inserted, "replace onto a present key");
        true
    }

    fn replace_at(&mut self, p: Pos, new: u128, id: BlockId) {
        if class_of(new) == p.class {
            self.classes[p.class].replace_at(p.ci, p.i, new, id);
        } else {
            self.remove_at(p);
            let inserted = self.insert(new, id);
            debug_assert!(inserted, "replace onto a present key");
        }
    }

    fn get(&self, k: u128) -> Option<BlockId> {
        self.classes[class_of(k)].get(k)
    }

    /// The non-empty classes, ascending.
    fn used(&self) -> impl DoubleEndedIterator<Item = &SortedMap> + '_ {
        self.classes.iter().filter(|m| !m.is_empty())
    }

    fn iter(&self) -> impl DoubleEndedIterator<Item = (u128, BlockId)> + '_ {
        self.used().flat_map(|m| m.iter())
    }

    fn iter_from(&self, k: u128) -> impl Iterator<Item = (u128, BlockId)> + '_ {
        let mut p = self.lower_bound(k);
        std::iter::from_fn(move || {
            let e = self.entry(p)?;
            p = self.next_pos(p);
            Some(e)
        })
    }

    fn iter_below_rev(&self, k: u128) -> impl Iterator<Item = (u128, BlockId)> + '_ {
        let c = class_of(k);
        self.classes[c]
            .iter_below_rev(k)
            .chain(self.classes[..c].iter().rev().flat_map(|m| m.iter().rev()))
    }
}

/// A pool's free mapped blocks in `BlockComparatorSize` order, (stream, size,
/// address): per stream (ascending), a [`ClassedMap`] keyed by (size, address)
/// packed into a `u128`. Addresses of free mapped blocks are unique (blocks
/// never overlap and are never empty), so (stream, size, address) identifies a
/// block; the id rides along.
#[derive(Debug, Default)]
pub(crate) struct FreeBlocks {
    streams: Vec<(Stream, ClassedMap)>,
    len: usize,
}

#[inline]
fn pack(size: u64, ptr: u64) -> u128 {
    ((size as u128) << 64) | ptr as u128
}

#[inline]
fn unpack(stream: Stream, e: (u128, BlockId)) -> SizeKey {
    (stream, (e.0 >> 64) as u64, e.0 as u64, e.1)
}

impl FreeBlocks {
    #[inline]
    fn stream(&self, s: Stream) -> Option<&ClassedMap> {
        self.streams.iter().find(|e| e.0 == s).map(|e| &e.1)
    }

    /// Inserts a key; false if its (stream, size, address) is present.
    pub fn insert(&mut self, k: SizeKey) -> bool {
        let m = match self.streams.iter().position(|e| e.0 == k.0) {
            Some(i) => &mut self.streams[i].1,
            None => {
                let at = self.streams.partition_point(|e| e.0 < k.0);
                self.streams.insert(at, (k.0, ClassedMap::default()));
                &mut self.streams[at].1
            }
        };
        let inserted = m.insert(pack(k.1, k.2), k.3);
        self.len += inserted as usize;
        inserted
    }

    /// Removes a key; false if absent.
    pub fn remove(&mut self, k: &SizeKey) -> bool {
        let Some(m) = self
            .streams
            .iter_mut()
            .find(|e| e.0 == k.0)
            .map(|e| &mut e.1)
        else {
            return false;
        };
        let removed = m.remove(pack(k.1, k.2), k.3);
        self.len -= removed as usize;
        removed
    }

    /// Replaces the key `old` by `new` of the same stream (not present): one
    /// move instead of a removal and an insertion. False (and no change) if
    /// `old` is absent.
    pub fn replace(&mut self, old: &SizeKey, new: SizeKey) -> bool {
        debug_assert_eq!(old.0, new.0, "replace within a stream");
        let Some(m) = self
            .streams
            .iter_mut()
            .find(|e| e.0 == old.0)
            .map(|e| &mut e.1)
        else {
            return false;
        };
        m.replace(pack(old.1, old.2), old.3, pack(new.1, new.2), new.3)
    }

    /// A cursor at the first key of `stream` not below (size, ptr) (past the end if none).
    pub fn cursor(&self, stream: Stream, size: u64, ptr: u64) -> Cursor {
        match self.streams.iter().position(|e| e.0 == stream) {
            Some(s) => Cursor {
                s,
                p: self.streams[s].1.lower_bound(pack(size, ptr)),
            },
            None => Cursor {
                s: usize::MAX,
                p: END,
            },
        }
    }

    /// The key under the cursor (`None` past the stream's last key).
    #[inline]
    pub fn at(&self, c: &Cursor) -> Option<SizeKey> {
        let (stream, m) = self.streams.get(c.s)?;
        m.entry(c.p).map(|e| unpack(*stream, e))
    }

    /// The cursor one key further (call only while `at` is `Some`).
    #[inline]
    pub fn advance(&self, c: &Cursor) -> Cursor {
        Cursor {
            s: c.s,
            p: self.streams[c.s].1.next_pos(c.p),
        }
    }

    /// Removes the key under the cursor (`at` must be `Some`).
    pub fn remove_at(&mut self, c: Cursor) {
        self.streams[c.s].1.remove_at(c.p);
        self.len -= 1;
    }

    /// Replaces the key under the cursor (`at` must be `Some`) by `new`, of the
    /// same stream and not present.
    pub fn replace_at(&mut self, c: Cursor, new: SizeKey) {
        let (stream, m) = &mut self.streams[c.s];
        debug_assert_eq!(*stream, new.0, "replace within a stream");
        m.replace_at(c.p, pack(new.1, new.2), new.3);
    }

    pub fn contains(&self, k: &SizeKey) -> bool {
        self.stream(k.0).and_then(|m| m.get(pack(k.1, k.2))) == Some(k.3)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Every key, in (stream, size, address) order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = SizeKey> + '_ {
        self.streams
            .iter()
            .flat_map(|(s, m)| m.iter().map(move |e| unpack(*s, e)))
    }

    /// The keys of `stream` not below (size, ptr), ascending.
    pub fn stream_from(
        &self,
        stream: Stream,
        size: u64,
        ptr: u64,
    ) -> impl Iterator<Item = SizeKey> + '_ {
        self.stream(stream)
            .into_iter()
            .flat_map(move |m| m.iter_from(pack(size, ptr)).map(move |e| unpack(stream, e)))
    }

    /// The keys of `stream` below `bound` (size, ptr), or all of them if `None`, descending.
    pub fn stream_below_rev(
        &self,
        stream: Stream,
        bound: Option<(u64, u64)>,
    ) -> impl Iterator<Item = SizeKey> + '_ {
        self.stream(stream).into_iter().flat_map(move |m| {
            let below: Box<dyn Iterator<Item = (u128, BlockId)>> = match bound {
                Some((size, ptr)) => Box::new(m.iter_below_rev(pack(size, ptr))),
                None => Box::new(m.iter().rev()),
            };
            below.map(move |e| unpack(stream, e))
        })
    }
}

/// A position in [`FreeBlocks`]: (stream index, position in its map).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cursor {
    s: usize,
    p: Pos,
}

/// Free blocks of one size class (`struct BlockPool`).
#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Free mapped blocks, best fit first.
    pub blocks: FreeBlocks,
    /// Unmapped ranges of expandable segments, lowest address first.
    pub unmapped: BTreeSet<AddrKey>,
    /// Which pool this is.
    pub kind: PoolKind,
    /// `get_free_blocks_call_count`: lookups since creation while garbage
    /// collection is active (the clock of block ages).
    pub get_free_blocks_call_count: i64,
}

impl BlockPool {
    pub fn new(kind: PoolKind) -> BlockPool {
        BlockPool {
            blocks: FreeBlocks::default(),
            unmapped: BTreeSet::new(),
            kind,
            get_free_blocks_call_count: 0,
        }
    }
}

/// The blocks, by index.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
    live: usize,
}

impl Slab {
    #[inline]
    pub fn insert(&mut self, b: Block) -> BlockId {
        self.live += 1;
        match self.vacant.pop() {
            Some(id) => {
                self.slots[id] = Some(b);
                id
            }
            None => {
                self.slots.push(Some(b));
                self.slots.len() - 1
            }
        }
    }
    #[inline]
    pub fn remove(&mut self, id: BlockId) {
        self.slots[id].take().expect("slab: live block");
        self.vacant.push(id);
        self.live -= 1;
    }
    #[inline]
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id].as_ref().expect("slab: live block")
    }
    #[inline]
    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id].as_mut().expect("slab: live block")
    }
    /// Moves a block's start address.
    #[inline]
    pub fn set_ptr(&mut self, id: BlockId, ptr: u64) {
        self.get_mut(id).ptr = ptr;
    }
    /// Every block by start address (for walks in snapshots and `validate`;
    /// the hot paths never look blocks up by address), and an address two
    /// blocks share, if any (addresses are unique).
    pub fn by_ptr(&self) -> (IntMap<u64, BlockId>, Option<u64>) {
        let mut m = IntMap::default();
        m.reserve(self.live);
        let mut shared = None;
        for (id, b) in self.iter() {
            if m.insert(b.ptr, id).is_some() {
                shared = Some(b.ptr);
            }
        }
        (m, shared)
    }
    pub fn len(&self) -> usize {
        self.live
    }
    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Size classes never decrease with the size.
    #[test]
    fn classes_follow_size_order() {
        let mut sizes: Vec<u64> = (0..64)
            .flat_map(|b| [1u64 << b, (1u64 << b) + 1, (1u64 << b).wrapping_mul(3) / 2])
            .collect();
        sizes.extend([0, 7, 8, 9, 15, 16, 17, 511, 512, 513, u64::MAX]);
        sizes.sort_unstable();
        let classes: Vec<usize> = sizes.iter().map(|&s| class_of(pack(s, 0))).collect();
        assert!(classes.windows(2).all(|w| w[0] <= w[1]));
        assert!(classes.iter().all(|&c| c < CLASSES));
    }

    /// `FreeBlocks` behaves as the `BTreeSet<(stream, size, ptr, id)>` it replaces.
    #[test]
    fn free_blocks_match_a_btreeset() {
        let mut fb = FreeBlocks::default();
        let mut set: BTreeSet<SizeKey> = BTreeSet::new();
        // (stream, size, ptr) of the keys in `set`: they identify a free block.
        let mut present: std::collections::HashSet<(Stream, u64, u64)> = Default::default();
        let taken = |p: &std::collections::HashSet<(Stream, u64, u64)>, k: &SizeKey| {
            p.contains(&(k.0, k.1, k.2))
        };
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let streams = [Stream(0), Stream(0x1000), Stream(0x1010)];
        let mut next_id = 0;
        for step in 0..20_000 {
            let r = rnd();
            let s = streams[(r % 3) as usize];
            // Sizes cluster (many equal sizes, as in DL traces) or spread.
            let size = match r & 24 {
                0 => 1024, // one crowded class: chunks split and merge
                8 => 512 * (1 + (r >> 8) % 8),
                _ => 512 * (1 + (r >> 8) % 200_000),
            };
            // Grow first, then churn.
            let op = match (r >> 4) % 6 {
                2 | 3 if step < 6000 => 0,
                op => op,
            };
            match op {
                0 | 1 => {
                    let ptr = (rnd() % (1 << 30)) * 512;
                    next_id += 1;
                    let k = (s, size, ptr, next_id);
                    if taken(&present, &k) {
                        continue;
                    }
                    present.insert((k.0, k.1, k.2));
                    assert_eq!(fb.insert(k), set.insert(k), "step {step}");
                }
                2 => {
                    if let Some(&k) = set.iter().nth((r >> 20) as usize % set.len().max(1)) {
                        assert!(fb.remove(&k) && set.remove(&k));
                        present.remove(&(k.0, k.1, k.2));
                    }
                    assert!(!fb.remove(&(s, size, 1, usize::MAX)));
                }
                3 => {
                    // Replace a key by another of its stream (a merge or a split).
                    if let Some(&k) = set.iter().nth((r >> 20) as usize % set.len().max(1)) {
                        let new = (k.0, size, k.2 + 256, k.3 + 1_000_000);
                        if !taken(&present, &new) {
                            assert!(fb.replace(&k, new));
                            set.remove(&k);
                            set.insert(new);
                            present.remove(&(k.0, k.1, k.2));
                            present.insert((new.0, new.1, new.2));
                        }
                    }
                }
                4 => {
                    // Best fit through a cursor, then take it out or replace it.
                    let mut c = fb.cursor(s, size, 0);
                    let want: Vec<SizeKey> = set
                        .range((s, size, 0, 0)..)
                        .take_while(|k| k.0 == s)
                        .take(3)
                        .copied()
                        .collect();
                    let mut got = Vec::new();
                    while let Some(k) = fb.at(&c) {
                        got.push(k);
                        if got.len() == 3 {
                            break;
                        }
                        c = fb.advance(&c);
                    }
                    assert_eq!(got, want, "step {step}");
                    let c = fb.cursor(s, size, 0);
                    if let Some(k) = fb.at(&c) {
                        set.remove(&k);
                        present.remove(&(k.0, k.1, k.2));
                        let new = (k.0, k.1 / 2 + 512, k.2 + 512, k.3);
                        if r & 16 == 0 || taken(&present, &new) {
                            fb.remove_at(c);
                        } else {
                            fb.replace_at(c, new);
                            set.insert(new);
                            present.insert((new.0, new.1, new.2));
                        }
                    }
                }
                _ => {
                    let bound = (r & 32 == 0).then_some((size, (rnd() % (1 << 30)) * 512));
                    let want: Vec<SizeKey> = match bound {
                        Some((sz, p)) => set
                            .range(..(s, sz, p, 0))
                            .rev()
                            .take_while(|k| k.0 == s)
                            .copied()
                            .collect(),
                        None => set.iter().rev().filter(|k| k.0 == s).copied().collect(),
                    };
                    assert_eq!(
                        fb.stream_below_rev(s, bound).collect::<Vec<_>>(),
                        want,
                        "step {step}"
                    );
                    assert_eq!(
                        fb.stream_from(s, size, 0).next(),
                        set.range((s, size, 0, 0)..).find(|k| k.0 == s).copied()
                    );
                }
            }
            assert_eq!(fb.len(), set.len());
            if step % 500 == 0 {
                assert!(fb.iter().eq(set.iter().copied()), "step {step}");
                assert!(set.iter().all(|k| fb.contains(k)));
            }
        }
    }
}
