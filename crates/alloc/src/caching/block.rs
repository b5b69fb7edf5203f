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
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use vmmalloc_device::Stream;

/// A hasher for integer keys (addresses, indices): one multiply, as in
/// rustc's FxHash. Keys are never attacker-chosen.
#[derive(Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A hash map keyed by integers.
pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

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
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
    /// Free and usable: not allocated, no outstanding events, no stream uses
    /// (`find_expandable_block`'s `allocatable`; `try_merge_blocks`'s condition).
    pub fn is_allocatable(&self) -> bool {
        !self.allocated && self.event_count == 0 && self.stream_uses.is_empty()
    }
    /// Waiting for events after a free (`active_pending_free`).
    pub fn is_pending_free(&self) -> bool {
        !self.allocated && (self.event_count > 0 || !self.stream_uses.is_empty())
    }
    /// Key in `BlockPool::blocks`.
    pub fn size_key(&self, id: BlockId) -> SizeKey {
        (self.stream, self.size, self.ptr, id)
    }
    /// Key in `BlockPool::unmapped`.
    pub fn addr_key(&self, id: BlockId) -> AddrKey {
        (self.stream, self.ptr, id)
    }
}

/// (stream, size, ptr, id): `BlockComparatorSize` order.
pub(crate) type SizeKey = (Stream, u64, u64, BlockId);
/// (stream, ptr, id): `BlockComparatorAddress` order.
pub(crate) type AddrKey = (Stream, u64, BlockId);

/// Free blocks of one size class (`struct BlockPool`).
#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Free mapped blocks, best fit first.
    pub blocks: BTreeSet<SizeKey>,
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
            blocks: BTreeSet::new(),
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
    /// Start address -> block, for every live block (addresses are unique).
    by_ptr: IntMap<u64, BlockId>,
}

impl Slab {
    pub fn insert(&mut self, b: Block) -> BlockId {
        self.live += 1;
        let ptr = b.ptr;
        let id = match self.vacant.pop() {
            Some(id) => {
                self.slots[id] = Some(b);
                id
            }
            None => {
                self.slots.push(Some(b));
                self.slots.len() - 1
            }
        };
        self.by_ptr.insert(ptr, id);
        id
    }
    pub fn remove(&mut self, id: BlockId) -> Block {
        let b = self.slots[id].take().expect("slab: live block");
        self.vacant.push(id);
        self.live -= 1;
        if self.by_ptr.get(&b.ptr) == Some(&id) {
            self.by_ptr.remove(&b.ptr);
        }
        b
    }
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id].as_ref().expect("slab: live block")
    }
    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id].as_mut().expect("slab: live block")
    }
    /// Moves a block's start address (keeps the address index current).
    pub fn set_ptr(&mut self, id: BlockId, ptr: u64) {
        let old = self.get(id).ptr;
        if self.by_ptr.get(&old) == Some(&id) {
            self.by_ptr.remove(&old);
        }
        self.get_mut(id).ptr = ptr;
        self.by_ptr.insert(ptr, id);
    }
    /// The block starting at `ptr`.
    pub fn at(&self, ptr: u64) -> Option<BlockId> {
        self.by_ptr.get(&ptr).copied()
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
    pub fn by_ptr_len(&self) -> usize {
        self.by_ptr.len()
    }
}
