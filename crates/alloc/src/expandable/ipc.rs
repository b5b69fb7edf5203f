//! IPC export of live blocks (see [`crate::ipc`]): which chunks lie under a
//! block, and the marks that keep them in place while exported.
//!
//! Invariants (checked by `validate_ipc`): every exported block is
//! allocated and in the live map; `chunks` counts, for each chunk
//! `(segment, first page)`, the exported blocks lying on it, and every such
//! chunk is mapped.

use super::blocks::BlockState;
use super::Inner;
use crate::ipc::ExportedRange;
use crate::{AllocError, AllocResult};
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

impl Inner {
    /// Refuses to pause segments `segs` while a block in them is exported.
    pub(super) fn check_not_exported(&self, segs: &[u32]) -> AllocResult<()> {
        if self.phys.exports().blocks.is_empty() {
            return Ok(());
        }
        let held: Vec<String> = self
            .phys
            .exports()
            .blocks
            .iter()
            .filter(|(_, keys)| keys.iter().any(|(s, _)| segs.contains(s)))
            .map(|(a, _)| format!("{a:#x}"))
            .collect();
        if held.is_empty() {
            return Ok(());
        }
        Err(AllocError::Sleep(format!(
            "pause: allocation(s) {} are exported to other processes (IPC); their memory \
             cannot be given back while shared (nothing changed)",
            held.join(", ")
        )))
    }

    /// The chunks under live block `ptr`, marked exported (a second export
    /// of the same block answers the same chunks and marks nothing twice).
    pub(super) fn export_block(&mut self, ptr: u64) -> AllocResult<ExportedRange> {
        let refuse = |why: String| AllocError::Ipc(format!("cannot export {ptr:#x}: {why}"));
        let Some(&idx) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        let b = &self.slab[idx];
        if b.state != BlockState::Allocated {
            return Err(AllocError::InvalidPointer { ptr });
        }
        let (seg_i, size) = (b.seg, b.size);
        let s = self.seg(seg_i);
        if self.owner_paused(s.owner) {
            return Err(refuse("its tag is paused (resume it first)".into()));
        }
        let span = s.page_span(&self.layout, ptr, size);
        let chunks = self.phys.export_range(seg_i, span, ptr).map_err(refuse)?;
        Ok(ExportedRange { ptr, size, chunks })
    }

    /// Ends the export of live block `ptr`.
    pub(super) fn unexport_block(&mut self, ptr: u64) -> AllocResult<()> {
        if self.phys.exports_mut().forget(ptr) {
            Ok(())
        } else {
            Err(AllocError::Ipc(format!("{ptr:#x} is not exported")))
        }
    }

    /// Checks the export marks against the blocks and chunks.
    pub(super) fn validate_ipc(&self) -> Result<(), String> {
        let mut recount: HashMap<(u32, u64), u32> = HashMap::new();
        for (&addr, keys) in &self.phys.exports().blocks {
            let Some(&idx) = self.live.get(&addr) else {
                return Err(format!("exported block {addr:#x} is not live"));
            };
            if self.slab[idx].state != BlockState::Allocated {
                return Err(format!("exported block {addr:#x} is not allocated"));
            }
            for &(s, f) in keys {
                let live = self.segments.get(s as usize).is_some_and(|x| x.is_some());
                if !live || !self.table(s).has_chunk_at(f) {
                    return Err(format!(
                        "exported block {addr:#x}: chunk at page {f} of segment {s} is not mapped"
                    ));
                }
                *recount.entry((s, f)).or_default() += 1;
            }
        }
        if recount != self.phys.exports().chunks {
            return Err(format!(
                "exported chunk counts {:?} != recount {recount:?}",
                self.phys.exports().chunks
            ));
        }
        Ok(())
    }
}
