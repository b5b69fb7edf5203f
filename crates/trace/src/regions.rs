//! Replaying growable regions (`reserve` / `resize` events, e.g.
//! `serve-kv:growable=1`): a policy with regions ([`Allocator::as_growable`])
//! grows and shrinks each in place; every other policy reallocates, as a
//! program without regions must: allocate the new length, copy, free the old
//! allocation. The copies are counted ([`ReplayResult::region_copies`]), and
//! both allocations are live during a copy, which is what raises the
//! reallocating policies' peak.

use crate::replay::ReplayResult;
use std::collections::HashMap;
use vmmalloc_alloc::{AllocError, Allocator, Stream};

/// One region being replayed.
#[derive(Debug, Clone, Copy)]
struct Region {
    /// The region's address (a policy with regions), or the current
    /// allocation (`u64::MAX`: none yet).
    ptr: u64,
    /// Current length in bytes.
    size: u64,
    /// Whether the policy holds it as a real region.
    native: bool,
    /// Its stream (where a reallocating policy allocates).
    stream: Stream,
}

/// Regions by trace id.
#[derive(Debug, Default)]
pub(crate) struct Regions(HashMap<u32, Region>);

/// Why a region op failed: out of memory (counted as the replay's OOMs are),
/// or another error (stops the replay).
pub(crate) enum RegionError {
    /// Out of memory.
    Oom(AllocError),
    /// Anything else.
    Fail(String),
}

impl From<AllocError> for RegionError {
    fn from(e: AllocError) -> Self {
        if e.is_out_of_memory() {
            RegionError::Oom(e)
        } else {
            RegionError::Fail(e.to_string())
        }
    }
}

impl Regions {
    /// Whether `id` is a region.
    pub fn contains(&self, id: u32) -> bool {
        self.0.contains_key(&id)
    }

    /// `Op::Reserve`.
    pub fn reserve(
        &mut self,
        alloc: &dyn Allocator,
        id: u32,
        max: u64,
        stream: Stream,
    ) -> Result<(), RegionError> {
        let r = match alloc.as_growable() {
            Some(g) => Region {
                ptr: g.growable_create(max, stream)?,
                size: 0,
                native: true,
                stream,
            },
            None => Region {
                ptr: u64::MAX,
                size: 0,
                native: false,
                stream,
            },
        };
        self.0.insert(id, r);
        Ok(())
    }

    /// `Op::Resize`; `live` is the replay's live requested bytes (updated,
    /// with its peak in `result`).
    pub fn resize(
        &mut self,
        alloc: &dyn Allocator,
        id: u32,
        size: u64,
        live: &mut u64,
        result: &mut ReplayResult,
        op: usize,
    ) -> Result<(), RegionError> {
        let Some(r) = self.0.get(&id).copied() else {
            return Err(RegionError::Fail(format!("region {id} was never reserved")));
        };
        let mut peak = |live: u64| {
            if live > result.peak_live {
                result.peak_live = live;
                result.peak_live_op = Some(op);
            }
        };
        if r.native {
            alloc
                .as_growable()
                .expect("native region")
                .growable_resize(r.ptr, size)?;
            *live = *live - r.size + size;
            peak(*live);
        } else {
            let mut ptr = u64::MAX;
            if size > 0 {
                ptr = alloc.malloc(size, r.stream)?.ptr;
                *live += size;
                peak(*live);
            }
            if r.ptr != u64::MAX {
                if size > 0 {
                    result.region_copies += 1;
                    result.region_copied_bytes += r.size.min(size);
                }
                alloc
                    .free(r.ptr)
                    .map_err(|e| RegionError::Fail(e.to_string()))?;
                *live -= r.size;
            }
            self.0.get_mut(&id).expect("region").ptr = ptr;
        }
        self.0.get_mut(&id).expect("region").size = size;
        Ok(())
    }

    /// `Op::Free` of a region; returns its length.
    pub fn free(&mut self, alloc: &dyn Allocator, id: u32) -> Result<u64, String> {
        let r = self.0.remove(&id).expect("caller checked");
        let e = if r.native {
            alloc
                .as_growable()
                .expect("native region")
                .growable_destroy(r.ptr)
        } else if r.ptr != u64::MAX {
            alloc.free(r.ptr)
        } else {
            Ok(())
        };
        e.map(|()| r.size).map_err(|e| e.to_string())
    }

    /// Region ids still live.
    pub fn ids(&self) -> Vec<u32> {
        self.0.keys().copied().collect()
    }
}
