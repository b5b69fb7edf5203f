//! Checkpoints of private pools for the torch companion
//! (`getCheckpointState` / `setCheckpointPoolState`, CUDA graph trees in
//! `torch/_inductor/cudagraph_trees.py`).
//!
//! As in PyTorch's allocator (`c10/cuda/CUDACachingAllocator.cpp`,
//! `PrivatePoolState`, Note [Checkpointing PrivatePoolState]) a checkpoint is
//! a record of the pool's live blocks and holds no memory: a restore
//! ([`vmmalloc_alloc::pools::PrivatePools::restore_pool`]) frees every block
//! of the pool and allocates the recorded ones again at their addresses. The
//! companion refers to a checkpoint by a handle (never 0) and drops it with
//! PyTorch's last reference.

use crate::error::Error;
use std::collections::HashMap;
use std::sync::Mutex;
use vmmalloc_alloc::pools::{PoolBlock, PoolId};

/// One device's checkpoints, by handle.
#[derive(Debug, Default)]
pub struct Checkpoints {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    by_handle: HashMap<u64, (PoolId, Vec<PoolBlock>)>,
}

impl Checkpoints {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `blocks` (pool `id`'s live blocks); returns the handle.
    pub fn add(&self, id: PoolId, blocks: Vec<PoolBlock>) -> u64 {
        let mut s = self.lock();
        s.next += 1;
        let handle = s.next;
        s.by_handle.insert(handle, (id, blocks));
        handle
    }

    /// Checkpoint `handle`: its pool and blocks.
    pub fn get(&self, handle: u64) -> Result<(PoolId, Vec<PoolBlock>), Error> {
        self.lock()
            .by_handle
            .get(&handle)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("unknown checkpoint {handle}")))
    }

    /// Drops checkpoint `handle`.
    pub fn drop_handle(&self, handle: u64) -> Result<(), Error> {
        match self.lock().by_handle.remove(&handle) {
            Some(_) => Ok(()),
            None => Err(Error::invalid(format!("unknown checkpoint {handle}"))),
        }
    }

    /// Checkpoints alive, and the bytes their blocks describe (memory they
    /// do not hold).
    pub fn counts(&self) -> (usize, u64) {
        let s = self.lock();
        let bytes = s
            .by_handle
            .values()
            .flat_map(|(_, b)| b.iter().map(|b| b.size))
            .sum();
        (s.by_handle.len(), bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_alloc::Stream;

    #[test]
    fn handles_are_distinct_and_dropped_once() {
        let c = Checkpoints::default();
        let b = PoolBlock {
            ptr: 0x1000,
            requested: 10,
            size: 512,
            stream: Stream(0),
        };
        let h1 = c.add((1, 0), vec![b]);
        let h2 = c.add((1, 0), vec![]);
        assert_ne!(h1, 0);
        assert_ne!(h1, h2);
        assert_eq!(c.get(h1).unwrap(), ((1, 0), vec![b]));
        assert_eq!(c.counts(), (2, 512));
        c.drop_handle(h1).unwrap();
        let e = c.drop_handle(h1).unwrap_err();
        assert!(e.message().contains("unknown checkpoint"), "{e}");
        assert!(c.get(h1).is_err());
        assert_eq!(c.counts(), (1, 0));
    }
}
