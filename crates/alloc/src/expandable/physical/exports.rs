//! The export marks: which blocks are exported to other processes
//! (`crate::ipc`) and the chunks under them, which must stay in place
//! (never moved by unpinning or spill, [`super::Physical::may_move`]).
//! The block layer's IPC code (`expandable/ipc.rs`) marks and forgets
//! exports through [`super::Physical::export_range`] and
//! [`super::Physical::exports_mut`].

use std::collections::HashMap;

/// Exported blocks and the chunks they pin.
#[derive(Debug, Default)]
pub(crate) struct ExportState {
    /// Block address -> the chunks `(segment, first page)` under it.
    blocks: HashMap<u64, Vec<(u32, u64)>>,
    /// Chunk `(segment, first page)` -> exported blocks on it.
    chunks: HashMap<(u32, u64), u32>,
}

impl ExportState {
    /// Exported block address -> the chunks `(segment, first page)` under it.
    pub fn blocks(&self) -> &HashMap<u64, Vec<(u32, u64)>> {
        &self.blocks
    }

    /// Chunk `(segment, first page)` -> how many exported blocks lie on it.
    pub fn chunks(&self) -> &HashMap<(u32, u64), u32> {
        &self.chunks
    }

    /// Whether the chunk at page `first` of segment `seg` is under an exported block.
    #[inline]
    pub fn pins(&self, seg: u32, first: u64) -> bool {
        !self.chunks.is_empty() && self.chunks.contains_key(&(seg, first))
    }

    /// Marks block `addr` exported, lying on chunks `keys` (no-op when it
    /// already is).
    pub fn mark(&mut self, addr: u64, keys: Vec<(u32, u64)>) {
        if self.blocks.contains_key(&addr) {
            return;
        }
        for &k in &keys {
            *self.chunks.entry(k).or_default() += 1;
        }
        self.blocks.insert(addr, keys);
    }

    /// Drops the export of block `addr` (no-op if not exported); returns
    /// whether it was exported. Every `free` asks: with nothing exported
    /// that is one inlined test.
    #[inline]
    pub fn forget(&mut self, addr: u64) -> bool {
        !self.blocks.is_empty() && self.forget_exported(addr)
    }

    /// [`ExportState::forget`] while some block is exported.
    #[cold]
    fn forget_exported(&mut self, addr: u64) -> bool {
        let Some(list) = self.blocks.remove(&addr) else {
            return false;
        };
        for key in list {
            if let Some(n) = self.chunks.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.chunks.remove(&key);
                }
            }
        }
        true
    }
}
