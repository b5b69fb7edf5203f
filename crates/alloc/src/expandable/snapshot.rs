//! Snapshot: segments and blocks in PyTorch's `memory_snapshot()` shape.
//!
//! Free blocks are cut at page-mapping boundaries: mapped parts are
//! `inactive`, unmapped parts `unmapped`.

use super::blocks::BlockState as B;
use super::physical::ChunkTable;
use super::Inner;
use crate::{BlockInfo, BlockState, SegmentInfo, Snapshot};

impl Inner {
    /// Cuts free block `[addr, end)` of `s` into mapped / unmapped pieces.
    fn free_pieces(&self, s: &ChunkTable, addr: u64, end: u64, out: &mut Vec<BlockInfo>) {
        let page = self.layout.page;
        let mut cur = addr;
        while cur < end {
            let p = self.layout.page_of(cur - s.base());
            let mapped = s.is_mapped(p);
            // Extend over pages with the same mapping state.
            let mut q = p + 1;
            let last = self.layout.page_of(end - 1 - s.base());
            while q <= last && s.is_mapped(q) == mapped {
                q += 1;
            }
            let piece_end = (s.base() + q * page).min(end);
            let state = if mapped {
                BlockState::Inactive
            } else {
                BlockState::Unmapped
            };
            match out.last_mut() {
                Some(prev) if prev.state == state && prev.address + prev.size == cur => {
                    prev.size += piece_end - cur
                }
                _ => out.push(BlockInfo {
                    address: cur,
                    size: piece_end - cur,
                    requested_size: 0,
                    state,
                }),
            }
            cur = piece_end;
        }
    }

    /// The allocator's segments and blocks.
    pub(super) fn snapshot(&self, ordinal: u32) -> Snapshot {
        let mut segments = Vec::new();
        for (si, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let paused = self.owner_paused(s.owner);
            let mut blocks = Vec::new();
            let (mut allocated, mut active, mut requested) = (0, 0, 0);
            for b in self.blocks_in(s) {
                match b.state {
                    B::Free => {
                        self.free_pieces(self.table(si as u32), b.addr, b.end(), &mut blocks)
                    }
                    B::Allocated | B::PendingFree => {
                        let state = if b.state == B::Allocated {
                            allocated += b.size;
                            requested += b.requested;
                            if paused {
                                BlockState::Paused
                            } else {
                                BlockState::ActiveAllocated
                            }
                        } else {
                            BlockState::ActivePendingFree
                        };
                        active += b.size;
                        blocks.push(BlockInfo {
                            address: b.addr,
                            size: b.size,
                            requested_size: b.requested,
                            state,
                        });
                    }
                }
            }
            segments.push(SegmentInfo {
                address: s.base,
                total_size: s.len,
                stream: self.streams[s.owner as usize].stream,
                segment_type: s.kind.name(),
                allocated_size: allocated,
                active_size: active,
                requested_size: requested,
                is_expandable: true,
                pool: self.owner_pool_id(s.owner),
                blocks,
            });
        }
        // Growable regions: one segment each, an active block over the mapped
        // pages (the region's current size requested) and the unmapped rest.
        let page = self.layout.page;
        for g in self.phys.regions() {
            let mapped = g.mapped_pages * page;
            let mut blocks = Vec::new();
            if mapped > 0 {
                blocks.push(BlockInfo {
                    address: g.base,
                    size: mapped,
                    requested_size: g.size,
                    state: BlockState::ActiveAllocated,
                });
            }
            if mapped < g.reserved {
                blocks.push(BlockInfo {
                    address: g.base + mapped,
                    size: g.reserved - mapped,
                    requested_size: 0,
                    state: BlockState::Unmapped,
                });
            }
            segments.push(SegmentInfo {
                address: g.base,
                total_size: g.reserved,
                stream: g.stream,
                segment_type: "large",
                allocated_size: mapped,
                active_size: mapped,
                requested_size: g.size,
                is_expandable: true,
                pool: (0, 0),
                blocks,
            });
        }
        segments.sort_by_key(|s| s.address);
        Snapshot {
            device: ordinal,
            segments,
            mapped_bytes: self.mapped_pages() * self.layout.page,
            pooled_bytes: self.phys.pool().pages() * self.layout.page,
        }
    }
}
