//! Blocks: the 512-byte-granular pieces a segment is split into.
//!
//! Blocks live in a [`Slab`] and are linked in address order inside their
//! segment (`prev`/`next`). Invariants (checked by `validate`):
//! - the blocks of a segment tile `[base, base + slice)` without gaps;
//! - no two neighbours are both [`BlockState::Free`] (free neighbours merge);
//! - a free block other than a segment's tail is in its (stream, pool) free
//!   index ([`super::free_index`]) under `(size, addr)`,
//!   and nothing else is;
//! - an allocated block is in the live map under its address.

use vmmalloc_device::Stream;

/// "No block" in a link.
pub(crate) const NIL: u32 = u32::MAX;

/// Requests are rounded up to a multiple of this (PyTorch's `kMinBlockSize`).
pub const MIN_BLOCK: u64 = 512;

/// Requests up to this size use the small pool (PyTorch's `kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;

/// What a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Free: in the free index, reusable on its stream.
    Free,
    /// Handed to a caller.
    Allocated,
    /// Freed by the caller, waiting for events on other streams.
    PendingFree,
}

/// One block.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    /// First byte.
    pub addr: u64,
    /// Bytes (a multiple of [`MIN_BLOCK`]).
    pub size: u64,
    /// Bytes the caller asked for (0 when free).
    pub requested: u64,
    /// Allocator tick at which (the newest part of) this block was freed;
    /// orders reclaim (oldest first) and decides whether its stream must be
    /// waited for before its pages are unmapped.
    pub freed_at: u64,
    /// Previous block in the segment, or [`NIL`].
    pub prev: u32,
    /// Next block in the segment, or [`NIL`].
    pub next: u32,
    /// Segment index.
    pub seg: u32,
    /// State.
    pub state: BlockState,
    /// Events still outstanding while [`BlockState::PendingFree`].
    pub pending_events: u32,
    /// Streams other than the segment's that used this block (`record_stream`);
    /// `None` when there are none, never an empty list. Boxed, so that a
    /// block is 64 bytes: one cache line.
    // A `Box<Vec>` on purpose: a thin pointer (a `Vec` or boxed slice is two
    // or three words), and blocks without other streams (most) allocate nothing.
    #[allow(clippy::box_collection)]
    pub streams: Option<Box<Vec<Stream>>>,
}

impl Block {
    /// One past the last byte.
    #[inline]
    pub fn end(&self) -> u64 {
        self.addr + self.size
    }
}

/// Storage for blocks with stable `u32` indices and slot reuse.
#[derive(Debug, Default)]
pub(crate) struct Slab {
    blocks: Vec<Block>,
    vacant: Vec<u32>,
}

impl Slab {
    /// An empty slab with room for `n` blocks.
    pub fn with_capacity(n: usize) -> Self {
        Slab {
            blocks: Vec::with_capacity(n),
            vacant: Vec::new(),
        }
    }

    /// Stores a block and returns its index.
    #[inline]
    pub fn insert(&mut self, b: Block) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.blocks[i as usize] = b;
                i
            }
            None => {
                self.blocks.push(b);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// Frees a slot (the block must be unlinked already).
    #[inline]
    pub fn remove(&mut self, i: u32) {
        let b = &mut self.blocks[i as usize];
        b.size = 0;
        b.streams = None;
        self.vacant.push(i);
    }

    /// Number of occupied slots.
    pub fn len(&self) -> usize {
        self.blocks.len() - self.vacant.len()
    }
}

impl std::ops::Index<u32> for Slab {
    type Output = Block;
    #[inline]
    fn index(&self, i: u32) -> &Block {
        &self.blocks[i as usize]
    }
}

impl std::ops::IndexMut<u32> for Slab {
    #[inline]
    fn index_mut(&mut self, i: u32) -> &mut Block {
        &mut self.blocks[i as usize]
    }
}

/// Live allocations: address -> block index (FxHash: one multiply per key).
pub(crate) type LiveMap = rustc_hash::FxHashMap<u64, u32>;

/// Which pool a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`] bytes.
    Small = 0,
    /// Larger requests.
    Large = 1,
}

impl PoolKind {
    /// The pool of a (rounded) request.
    #[inline]
    pub fn for_size(size: u64) -> PoolKind {
        if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// `"small"` / `"large"`.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

#[cfg(test)]
mod tests {
    /// A block fills one cache line (the fast path touches a few per call).
    #[test]
    fn block_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<super::Block>(), 64);
    }
}
