//! The out-of-memory report: what was asked, what is live, cached, pooled,
//! the largest free range, per stream, and what would help.

use super::blocks::BlockState;
use super::Inner;
use crate::error::format_bytes;
use crate::{AllocError, OomReport, StreamUsage};
use vmmalloc_device::{Device, Stream};

impl Inner {
    /// Longest run of contiguous mapped bytes inside a free block.
    fn largest_mapped_run(&self, idx: u32) -> u64 {
        let b = &self.slab[idx];
        let s = self.seg(b.seg);
        let page = self.layout.page;
        let (p0, p1) = s.page_span(&self.layout, b.addr, b.size);
        let mut best = 0;
        self.table(b.seg)
            .for_each_mapped_run(p0, p1 + 1, |first, count| {
                let lo = (s.base + first * page).max(b.addr);
                let hi = (s.base + (first + count) * page).min(b.end());
                best = best.max(hi - lo);
            });
        best
    }

    /// Counts an out-of-memory error and explains it.
    pub(super) fn oom<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        size: u64,
        rounded: u64,
        stream: Stream,
        lacking_pages: u64,
    ) -> AllocError {
        self.stats.num_ooms += 1;
        let device_free = self.phys.mem_info(dev).map(|m| m.free).unwrap_or(0);
        let page = self.layout.page;
        let capacity = self.phys.limit_pages() * page;
        let mut per_stream = Vec::with_capacity(self.streams.len());
        let mut largest_free = 0;
        let mut pending_bytes = 0;
        for e in &self.streams {
            let (mut live, mut mapped) = (0u64, 0u64);
            for pool in &e.pools {
                for &si in &pool.segments {
                    live += self.seg(si).active_bytes;
                    mapped += self.table(si).mapped_pages() * page;
                }
            }
            per_stream.push(StreamUsage {
                stream: e.stream,
                live,
                cached: mapped.saturating_sub(live),
            });
        }
        for idx in self.free_blocks(0) {
            largest_free = largest_free.max(self.largest_mapped_run(idx));
        }
        for p in &self.events.pending {
            if self.slab[p.block].state == BlockState::PendingFree {
                pending_bytes += self.slab[p.block].size;
            }
        }
        let live = self.counters.allocated_bytes.current() as u64;
        let mapped = self.mapped_pages() * page;
        let pooled = self.phys.pool().pages() * page;
        let active = self.counters.active_bytes.current() as u64;
        let mut hint = format!(
            "On {stream}, {} of physical pages ({} pages of {}) were lacking after counting every free, pooled and reclaimable page.",
            format_bytes(lacking_pages * page),
            lacking_pages,
            format_bytes(page)
        );
        if rounded > capacity {
            hint.push_str(" The request alone exceeds the memory limit.");
        } else if live + rounded > capacity {
            hint.push_str(&format!(
                " Live tensors ({}) plus this request exceed the limit: free tensors or reduce the batch size.",
                format_bytes(live)
            ));
        } else {
            hint.push_str(&format!(
                " Pages partly used by live tensors cannot be reclaimed ({} mapped for {} active); \
                 a larger page_size wastes more, a smaller one less.",
                format_bytes(mapped),
                format_bytes(active)
            ));
            let unpinnable = self.unpinnable_pages();
            if unpinnable > 0 {
                let pinned = format!(
                    " {} of free pages sit in chunks that live tensors hold in part",
                    format_bytes(unpinnable * page)
                );
                if self.unpin == super::UnpinMode::Never {
                    hint.push_str(&format!(
                        "{pinned}: unpin:auto or unpin:always would give them back."
                    ));
                } else if let Some(why) = self.unpin_refusal() {
                    hint.push_str(&format!(
                        "{pinned}; unpinning would give them back but did not run (unpin:auto): {why}. \
                         unpin:always unpins anyway: safe only if no other thread launches work on live \
                         tensors during an allocation (or those tensors are marked with record_stream)."
                    ));
                }
            }
        }
        if pending_bytes > 0 {
            hint.push_str(&format!(
                " {} wait for events on other streams (record_stream).",
                format_bytes(pending_bytes)
            ));
        }
        if self.phys.spilled_pages() > 0 {
            hint.push_str(&format!(
                " {} live in host memory (spill) already.",
                format_bytes(self.phys.spilled_pages() * page)
            ));
        }
        if let Some(group) = self.phys.budget_explain() {
            hint.push(' ');
            hint.push_str(&group);
        }
        if self.phys.fraction() < 1.0 {
            hint.push_str(&format!(
                " The memory fraction {} caps this allocator at {}.",
                self.phys.fraction(),
                format_bytes(capacity)
            ));
        } else if device_free + mapped + pooled < self.layout.total / 2 {
            hint.push_str(" Other users of the device hold much of its memory.");
        }
        AllocError::OutOfMemory(Box::new(OomReport {
            policy: "expandable",
            device: dev.caps().ordinal,
            requested: size,
            rounded,
            capacity: self.layout.total,
            allowed: (capacity < self.layout.total).then_some(capacity),
            device_free,
            live,
            cached: mapped.saturating_sub(active),
            pooled,
            largest_free,
            per_stream,
            hint,
            caching: None,
        }))
    }
}
