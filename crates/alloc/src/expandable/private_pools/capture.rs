//! Allocating into a private pool: `beginAllocateToPool` and
//! `endAllocateToPool` (a CUDA graph capture, or `use_mem_pool`), the
//! allocations themselves, and the frees a capture defers.
//!
//! While a capture is underway (`captures` > 0) a freed block that other
//! streams used is *deferred* (`deferred`): it stays pending, no event is
//! recorded, until the first allocation with no capture underway
//! ([`Inner::flush_deferred`]). Every other free returns the block to its
//! owner at once, main pool or private pool, so the capture reuses it.

use super::super::Inner;
use super::err;
use crate::pools::{pool_name, PoolId};
use crate::{AllocResult, Allocation};
use vmmalloc_device::{Device, Stream};

impl Inner {
    /// `beginAllocateToPool`.
    pub(in crate::expandable) fn begin_allocate_to_pool(&mut self, id: PoolId) -> AllocResult<()> {
        let p = match self.pools.by_id.get(&id) {
            Some(&s) => {
                let x = self.pool_ref(s + 1);
                if x.recording {
                    // PyTorch's words (TORCH_CHECK in beginAllocateToPool).
                    return Err(err(format!(
                        "beginAllocateToPool: already recording to mempool_id {} (nothing changed)",
                        pool_name(id)
                    )));
                }
                if x.paused.is_some() {
                    return Err(err(format!(
                        "beginAllocateToPool: pool {} is paused; resume it first (nothing changed)",
                        pool_name(id)
                    )));
                }
                self.incref_pool(s + 1);
                s + 1
            }
            None => self.create_pool(id)?,
        };
        self.pool_mut(p).recording = true;
        self.pools.captures += 1;
        Ok(())
    }

    /// `endAllocateToPool`.
    pub(in crate::expandable) fn end_allocate_to_pool(&mut self, id: PoolId) -> AllocResult<()> {
        let p = self.pool_number(id)?;
        if !self.pool_ref(p).recording {
            return Err(err(format!(
                "endAllocateToPool: not currently recording to mempool_id {}",
                pool_name(id)
            )));
        }
        self.pool_mut(p).recording = false;
        self.pools.captures -= 1;
        Ok(())
    }

    /// Allocates from pool `id`.
    pub(in crate::expandable) fn pool_malloc<D: Device + ?Sized>(
        &mut self,
        dev: &D,
        id: PoolId,
        size: u64,
        stream: Stream,
    ) -> AllocResult<Allocation> {
        let p = self.pool_number(id)?;
        let x = self.pool_ref(p);
        if x.paused.is_some() {
            return Err(err(format!(
                "cannot allocate in pool {}: it is paused (resume it first; allocating resumes nothing)",
                pool_name(id)
            )));
        }
        if x.use_count == 0 {
            return Err(err(format!(
                "cannot allocate in pool {}: it was released (no users left)",
                pool_name(id)
            )));
        }
        self.malloc_owned(dev, size, stream, 0, p)
    }

    /// Records the end-of-life events of the blocks freed during captures
    /// (no capture is underway now); a block with no event left is free at
    /// once. A block whose streams are still capturing (between
    /// `endAllocateToPool` and the end of the stream capture), or whose
    /// events cannot be recorded, waits for the next call.
    pub(in crate::expandable) fn flush_deferred<D: Device + ?Sized>(&mut self, dev: &D) {
        for idx in std::mem::take(&mut self.pools.deferred) {
            let capturing = self.slab[idx]
                .streams
                .as_ref()
                .is_some_and(|v| v.iter().any(|&s| dev.is_capturing(s).unwrap_or(true)));
            if capturing {
                self.pools.deferred.push(idx);
                continue;
            }
            match self.record_free_events(dev, idx) {
                Ok(0) => self.free_block(idx),
                Ok(_) => {}
                Err(_) => self.pools.deferred.push(idx),
            }
        }
    }
}
