//! CUDA graph private pools: PyTorch's `beginAllocateToPool` /
//! `endAllocateToPool` / `releasePool`, one device's worth.
//!
//! PyTorch (`c10/cuda/CUDACachingAllocator.cpp`, `DeviceCachingAllocator`)
//! routes the allocations a graph capture makes to a private pool, so that
//! their addresses stay valid for every replay: nothing in the pool is handed
//! to anyone else until PyTorch frees it. We do the same with a separate
//! allocator instance per pool over the same device ([`GraphPools::begin`]
//! creates it), so pool memory is never shared with the device's main
//! allocator or with another pool.
//!
//! Capture rules (CUDA programming guide, "Prohibited and Unhandled
//! Operations" of stream capture: synchronizing or querying a capturing
//! stream or an event recorded in it is illegal; PyTorch skips
//! `process_events` "if a capture might be underway" because "process_events
//! involves cudaEventQueries, illegal during CUDA graph capture",
//! `DeviceCachingAllocator::malloc`): while any capture is underway on the
//! device, frees are queued instead of reaching an allocator (a free can record
//! or query events, unmap and release pages), and applied by the first call
//! after the last capture ended ([`GraphPools::flush`]). Allocations made
//! during capture come from the pool's allocator, which maps pages (as
//! PyTorch's expandable segments do during capture, under
//! `CUDAStreamCaptureModeGuard(cudaStreamCaptureModeRelaxed)`) but has nothing
//! to reclaim, so it needs no event query, sync, unmap or release.
//!
//! **Pinned memory.** A graph replays at the addresses it captured, including
//! those of blocks it freed during capture (their memory is part of every
//! replay). So while any graph may use a pool (use count > 0), the pool's
//! device refuses `unmap` ([`PoolGuard`]): the pool's allocator may reuse a
//! freed block in place (as PyTorch reuses a shared pool's blocks) but never
//! move its pages elsewhere (a targeted reclaim) or return them; under memory
//! pressure the pool's allocation fails instead. While a capture into the pool
//! is underway, `release` is refused too.
//!
//! `releasePool` follows PyTorch's use count: each `begin` on a pool adds one
//! (graphs may share a pool), each `release` removes one; at zero the pool's
//! cached memory goes back to the device, and the pool itself (its allocator,
//! and so all its memory) once its last live allocation is freed: the user
//! may still hold a graph's output tensors.
//!
//! **Checkpoints** (CUDA graph trees, `torch/_inductor/cudagraph_trees.py`:
//! `_cuda_getCheckpointState` after each recording, `_cuda_setCheckpointPoolState`
//! when a new path diverges from a recorded one, then raw deletes of the
//! tensors that died). PyTorch's allocator (`c10/cuda/CUDACachingAllocator.cpp`,
//! `setCheckpointPoolState`, Note [Checkpointing PrivatePoolState]) restores
//! a pool by freeing every block allocated in it and allocating again, at the
//! same addresses, the blocks the checkpoint held. We reach the same end state
//! without allocating at a chosen address: while a checkpoint holds a block,
//! a free of it leaves it allocated in the pool's allocator (*held*), so its
//! address cannot be handed to anyone else; a restore frees what the pool has
//! live now and the checkpoint did not hold, and hands back every block the
//! checkpoint held (the live ones and the held ones). A held block goes back
//! to the pool's allocator when the last checkpoint holding it is dropped.
//! The price: memory of a block freed after a checkpoint is reused only once
//! that checkpoint is dropped (PyTorch could reuse it for a later recording).
//!
//! `createOrIncrefPool` (every `torch.cuda.MemPool`) creates a pool, or adds
//! one user to it, without a capture; `getPoolUseCount` reads the count.

use crate::config::LogLevel;
use crate::error::Error;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use vmmalloc_alloc::{AllocError, Allocation, Allocator, Stream};
use vmmalloc_device::adaptors::CallHook;
use vmmalloc_device::{Call, DeviceError, DeviceResult};

/// PyTorch's `MempoolId_t` (`std::pair<CaptureId_t, CaptureId_t>`).
pub type PoolId = (u64, u64);

/// The state a pool's device checks before each call (see the module docs).
#[derive(Debug, Default)]
pub struct PoolGuard {
    /// A graph may replay: no unmap.
    pinned: AtomicBool,
    /// A capture into the pool is underway: no release either.
    capturing: AtomicBool,
    /// Calls refused so far.
    refused: AtomicU32,
}

/// The hook on a pool allocator's device: checks the pool's [`PoolGuard`].
#[derive(Debug, Clone)]
pub struct PoolHook(pub Arc<PoolGuard>);

impl CallHook for PoolHook {
    fn before(&self, call: Call, bytes: u64) -> DeviceResult<()> {
        self.0.check(call, bytes)
    }
}

impl PoolGuard {
    fn check(&self, call: Call, _bytes: u64) -> DeviceResult<()> {
        let refuse = match call {
            Call::Unmap => self.pinned.load(Ordering::Acquire),
            Call::Release => self.capturing.load(Ordering::Acquire),
            _ => false,
        };
        if !refuse {
            return Ok(());
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        Err(DeviceError::Unsupported {
            call,
            what: "a CUDA graph pool's memory stays mapped while a graph may replay it                    (vmmalloc refuses to unmap or release it until releasePool)"
                .into(),
        })
    }
}

/// A block of a pool as a checkpoint records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolBlock {
    /// Device address.
    pub ptr: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Bytes set aside by the pool's allocator.
    pub size: u64,
    /// The stream it was allocated on.
    pub stream: Stream,
}

/// What a restore did: the pointers freed (PyTorch's `ptrs_freed`) and the
/// blocks handed back (`dataptrs_allocd`). A block live both before and in
/// the checkpoint is in both lists, as PyTorch's restore frees and
/// re-allocates it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Pointers freed.
    pub freed: Vec<u64>,
    /// Blocks allocated now, as the checkpoint held them.
    pub allocated: Vec<PoolBlock>,
}

/// A checkpoint: the pool's live blocks when it was taken.
struct Checkpoint {
    pool: PoolId,
    blocks: Vec<PoolBlock>,
}

/// One private pool.
struct Pool {
    allocator: Box<dyn Allocator>,
    /// Blocks allocated in the pool and not freed by the caller, by address.
    live: HashMap<u64, PoolBlock>,
    /// Number of live checkpoints holding each block (see the module docs).
    holds: HashMap<u64, u32>,
    /// Blocks the caller freed that a checkpoint still holds: allocated in
    /// `allocator`, not in `live`.
    held_freed: HashMap<u64, PoolBlock>,
    /// Shared with the hook on the pool allocator's device.
    guard: Arc<PoolGuard>,
    /// Graphs using the pool (PyTorch's `PrivatePool::use_count`).
    use_count: u32,
    /// A capture is allocating into it now.
    capturing: bool,
}

impl Pool {
    fn live(&self) -> i64 {
        self.allocator.stats().allocation.all().current
    }
}

#[derive(Default)]
struct State {
    pools: HashMap<PoolId, Pool>,
    /// Live checkpoints by handle (never 0).
    checkpoints: HashMap<u64, Checkpoint>,
    next_checkpoint: u64,
    /// Pools whose use count reached zero, kept to name the error of a second release.
    released: HashSet<PoolId>,
    /// Frees made while a capture was underway, oldest first.
    deferred: Vec<u64>,
}

/// The graph pools of one device, and the frees deferred during capture.
pub struct GraphPools {
    /// The configured log level (for frees that fail when applied late).
    log: LogLevel,
    /// Captures underway on the device (begin without end yet).
    capturing: AtomicU32,
    /// Number of pools that exist (the hot free path skips the lock at 0).
    count: AtomicU32,
    /// Frees queued or a sweep wanted (the hot malloc path skips the lock when false).
    pending: AtomicBool,
    state: Mutex<State>,
}

fn name(id: PoolId) -> String {
    format!("({}, {})", id.0, id.1)
}

impl GraphPools {
    /// No pools, no capture; failures of deferred frees are logged at `log`.
    pub fn new(log: LogLevel) -> Self {
        GraphPools {
            log,
            capturing: AtomicU32::new(0),
            count: AtomicU32::new(0),
            pending: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether frees queued during a capture (or a sweep) wait for the next
    /// allocation outside capture: while false, [`GraphPools::flush_with`]
    /// does nothing.
    #[inline]
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Whether a capture is underway on the device.
    #[inline]
    pub fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire) > 0
    }

    /// Whether no pool exists and no capture is underway: a free goes
    /// straight to the main allocator.
    #[inline]
    pub fn idle(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0 && !self.capturing()
    }

    /// `beginAllocateToPool`: creates the pool (with `make`) or adds a graph
    /// to it, and marks it capturing. Errors: the pool is capturing already
    /// (PyTorch: "beginAllocateToPool: already recording to mempool_id").
    /// `make` builds the pool's allocator over the device wrapped with the
    /// given guard (`Hooked::new(device, PoolHook(guard))`).
    pub fn begin(
        &self,
        id: PoolId,
        make: impl FnOnce(Arc<PoolGuard>) -> Result<Box<dyn Allocator>, Error>,
    ) -> Result<(), Error> {
        let mut s = self.lock();
        match s.pools.get_mut(&id) {
            Some(p) if p.capturing => {
                return Err(Error::invalid(format!(
                    "pool {} is already being captured into",
                    name(id)
                )))
            }
            Some(p) => {
                p.use_count += 1;
                p.capturing = true;
                p.guard.pinned.store(true, Ordering::Release);
                p.guard.capturing.store(true, Ordering::Release);
            }
            None => self.create(&mut s, id, true, make)?,
        }
        self.capturing.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Creates pool `id` with one user (`capturing`: a capture into it starts).
    fn create(
        &self,
        s: &mut State,
        id: PoolId,
        capturing: bool,
        make: impl FnOnce(Arc<PoolGuard>) -> Result<Box<dyn Allocator>, Error>,
    ) -> Result<(), Error> {
        let guard = Arc::new(PoolGuard {
            pinned: AtomicBool::new(true),
            capturing: AtomicBool::new(capturing),
            refused: AtomicU32::new(0),
        });
        let allocator = make(guard.clone())?;
        s.pools.insert(
            id,
            Pool {
                allocator,
                live: HashMap::new(),
                holds: HashMap::new(),
                held_freed: HashMap::new(),
                guard,
                use_count: 1,
                capturing,
            },
        );
        s.released.remove(&id);
        self.count.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// `createOrIncrefPool` (PyTorch's `create_or_incref_pool`, called by
    /// every `torch.cuda.MemPool`): creates pool `id` with use count 1, or
    /// adds one user to it. No capture starts; the pool's memory stays
    /// mapped while its use count is above zero (see [`PoolGuard`]).
    pub fn create_or_incref(
        &self,
        id: PoolId,
        make: impl FnOnce(Arc<PoolGuard>) -> Result<Box<dyn Allocator>, Error>,
    ) -> Result<(), Error> {
        let mut s = self.lock();
        match s.pools.get_mut(&id) {
            Some(p) => {
                p.use_count += 1;
                p.guard.pinned.store(true, Ordering::Release);
                Ok(())
            }
            None => self.create(&mut s, id, false, make),
        }
    }

    /// `getPoolUseCount`: the number of users of pool `id` (graphs, MemPools,
    /// `use_mem_pool` blocks underway).
    pub fn use_count(&self, id: PoolId) -> Result<u32, Error> {
        let s = self.lock();
        match s.pools.get(&id) {
            Some(p) => Ok(p.use_count),
            None => Err(unknown(&s, id)),
        }
    }

    /// The blocks live in pool `id` (allocated, not freed by the caller;
    /// frees queued during a capture count as done, as they are for PyTorch).
    fn live_blocks(s: &State, id: PoolId) -> Result<Vec<PoolBlock>, Error> {
        let p = s.pools.get(&id).ok_or_else(|| unknown(s, id))?;
        let queued: HashSet<u64> = s.deferred.iter().copied().collect();
        let mut blocks: Vec<PoolBlock> = p
            .live
            .values()
            .filter(|b| !queued.contains(&b.ptr))
            .copied()
            .collect();
        blocks.sort_by_key(|b| b.ptr);
        Ok(blocks)
    }

    /// `checkPoolLiveAllocations`: whether the blocks live in pool `id` are
    /// exactly `expected` (PyTorch's `DeviceCachingAllocator::checkPoolLiveAllocations`:
    /// every allocated block of the pool is expected, and as many as expected).
    pub fn check_live(&self, id: PoolId, expected: &HashSet<u64>) -> Result<bool, Error> {
        let s = self.lock();
        let live = Self::live_blocks(&s, id)?;
        Ok(live.len() == expected.len() && live.iter().all(|b| expected.contains(&b.ptr)))
    }

    /// `getCheckpointState`: records the blocks live in pool `id` and holds
    /// them (see the module docs). Returns the checkpoint's handle (never 0).
    pub fn checkpoint(&self, id: PoolId) -> Result<u64, Error> {
        let mut s = self.lock();
        let blocks = Self::live_blocks(&s, id)?;
        let p = s.pools.get_mut(&id).ok_or_else(|| unknown_plain(id))?;
        if p.use_count == 0 {
            // PyTorch: "Not expected to checkpoint freeable graph".
            return Err(Error::invalid(format!(
                "pool {} was released: no checkpoint of it",
                name(id)
            )));
        }
        for b in &blocks {
            *p.holds.entry(b.ptr).or_insert(0) += 1;
        }
        s.next_checkpoint += 1;
        let handle = s.next_checkpoint;
        s.checkpoints
            .insert(handle, Checkpoint { pool: id, blocks });
        Ok(handle)
    }

    /// `setCheckpointPoolState`: frees the blocks live in the checkpoint's
    /// pool that the checkpoint did not hold, and hands back those it held,
    /// live or freed since (PyTorch's `setCheckpointPoolState`: "free all the
    /// blocks currently allocated to the pool", "allocate all the blocks in a
    /// checkpointed segment", "free the blocks ... which are not live").
    /// Not during a capture on the device.
    pub fn restore(
        &self,
        handle: u64,
        main_free: &dyn Fn(u64) -> Result<(), AllocError>,
    ) -> Result<Restored, Error> {
        if self.capturing() {
            return Err(Error::invalid(
                "a CUDA graph capture is underway on the device: no restore now",
            ));
        }
        for e in self.flush_with(main_free) {
            crate::diag::log(self.log, LogLevel::Error, &e);
        }
        let mut s = self.lock();
        let (id, blocks) = match s.checkpoints.get(&handle) {
            Some(c) => (c.pool, c.blocks.clone()),
            None => return Err(Error::invalid(format!("unknown checkpoint {handle}"))),
        };
        let live = Self::live_blocks(&s, id)?;
        let p = s.pools.get_mut(&id).ok_or_else(|| unknown_plain(id))?;
        let wanted: HashMap<u64, PoolBlock> = blocks.iter().map(|b| (b.ptr, *b)).collect();
        // Every block the checkpoint holds is still allocated in the pool's
        // allocator (live, or held since the caller freed it), unchanged.
        for b in &blocks {
            let now = p.live.get(&b.ptr).or_else(|| p.held_freed.get(&b.ptr));
            if now != Some(b) {
                return Err(Error::invalid(format!(
                    "checkpoint {handle} of pool {}: block {:#x} ({} bytes) is no longer held ({now:?})",
                    name(id),
                    b.ptr,
                    b.size
                )));
            }
        }
        let mut out = Restored::default();
        for b in live {
            out.freed.push(b.ptr);
            if !wanted.contains_key(&b.ptr) {
                Self::free_in_pool(p, b.ptr)?;
            }
        }
        for b in blocks {
            p.held_freed.remove(&b.ptr);
            p.live.insert(b.ptr, b);
            out.allocated.push(b);
        }
        Ok(out)
    }

    /// Drops checkpoint `handle` (PyTorch dropped its `AllocatorState`): the
    /// blocks only it held and the caller freed go back to the pool's allocator.
    pub fn drop_checkpoint(&self, handle: u64) -> Result<(), Error> {
        let mut s = self.lock();
        let Some(c) = s.checkpoints.remove(&handle) else {
            return Err(Error::invalid(format!("unknown checkpoint {handle}")));
        };
        let Some(p) = s.pools.get_mut(&c.pool) else {
            return Ok(()); // the pool went with everything in it
        };
        let mut errors = Vec::new();
        for b in &c.blocks {
            let Some(n) = p.holds.get_mut(&b.ptr) else {
                continue;
            };
            *n -= 1;
            if *n > 0 {
                continue;
            }
            p.holds.remove(&b.ptr);
            if p.held_freed.remove(&b.ptr).is_some() {
                if let Err(e) = p.allocator.free(b.ptr) {
                    errors.push(format!("{:#x}: {e}", b.ptr));
                }
            }
        }
        if p.use_count == 0 && !p.capturing && p.live() == 0 {
            s.pools.remove(&c.pool);
            s.released.insert(c.pool);
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            // A pool's allocator refused its own block: a bug, reported
            // as the failure it is.
            Err(Error::failed(format!(
                "dropping checkpoint {handle}: {}",
                errors.join("; ")
            )))
        }
    }

    /// Frees `ptr` in pool `p`: a block a checkpoint holds stays allocated
    /// (held) until the checkpoint goes.
    fn free_in_pool(p: &mut Pool, ptr: u64) -> Result<(), AllocError> {
        if p.holds.contains_key(&ptr) {
            return match p.live.remove(&ptr) {
                Some(b) => {
                    p.held_freed.insert(ptr, b);
                    Ok(())
                }
                None => Err(AllocError::InvalidPointer { ptr }),
            };
        }
        p.allocator.free(ptr)?;
        p.live.remove(&ptr);
        Ok(())
    }

    /// The statistics of pool `id`'s allocator (PyTorch's per-pool figures of
    /// `torch.cuda.MemPool`), and its live block count.
    pub fn pool_stats(&self, id: PoolId) -> Result<(vmmalloc_alloc::Stats, usize), Error> {
        let s = self.lock();
        let p = s.pools.get(&id).ok_or_else(|| unknown(&s, id))?;
        Ok((p.allocator.stats(), p.live.len()))
    }

    /// Each pool's id and snapshot (`only`: just that pool).
    pub fn snapshots(&self, only: Option<PoolId>) -> Vec<(PoolId, vmmalloc_alloc::Snapshot)> {
        let s = self.lock();
        let mut out: Vec<_> = s
            .pools
            .iter()
            .filter(|(id, _)| only.is_none_or(|o| o == **id))
            .map(|(id, p)| (*id, p.allocator.snapshot()))
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// `endAllocateToPool`: the capture into `id` ends. Errors: no capture
    /// into it is underway (PyTorch: "endAllocatePool: not currently recording
    /// to mempool_id").
    pub fn end(&self, id: PoolId) -> Result<(), Error> {
        let mut s = self.lock();
        match s.pools.get_mut(&id) {
            Some(p) if p.capturing => {
                p.capturing = false;
                p.guard.capturing.store(false, Ordering::Release);
                self.capturing.fetch_sub(1, Ordering::AcqRel);
                Ok(())
            }
            Some(_) => Err(Error::invalid(format!(
                "no capture into pool {} is underway",
                name(id)
            ))),
            None => Err(unknown(&s, id)),
        }
    }

    /// `releasePool`: one graph using `id` is gone. At use count zero the
    /// pool's cache goes back to the device, and the whole pool once nothing
    /// in it is live. Errors: unknown pool, released twice, still capturing.
    pub fn release(
        &self,
        id: PoolId,
        main_free: &dyn Fn(u64) -> Result<(), AllocError>,
    ) -> Result<(), Error> {
        for e in self.flush_with(main_free) {
            crate::diag::log(self.log, LogLevel::Error, &e);
        }
        let mut s = self.lock();
        let p = match s.pools.get_mut(&id) {
            Some(p) => p,
            None => return Err(unknown(&s, id)),
        };
        if p.capturing {
            return Err(Error::invalid(format!(
                "pool {} is still being captured into (endAllocateToPool first)",
                name(id)
            )));
        }
        if p.use_count == 0 {
            return Err(Error::invalid(format!(
                "pool {} was released already",
                name(id)
            )));
        }
        p.use_count -= 1;
        if p.use_count > 0 {
            return Ok(());
        }
        // No graph uses the pool any more: its memory may move and go, now
        // or (while another capture is underway on the device) at the next flush.
        p.guard.pinned.store(false, Ordering::Release);
        if self.capturing() {
            self.pending.store(true, Ordering::Release);
            return Ok(());
        }
        self.sweep(&mut s).into_iter().next().map_or(Ok(()), Err)
    }

    /// `empty_cache` for the pools: returns the cache of the pools no graph
    /// uses any more (and drops the empty ones); pools a graph may still
    /// replay are left alone. Nothing while a capture is underway.
    pub fn empty_released(&self) -> Vec<String> {
        if self.capturing() || self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let errors = self.sweep(&mut self.lock());
        errors.iter().map(Error::to_string).collect()
    }

    /// Returns the cache of every pool no graph uses, and drops those with
    /// nothing live (their allocator gives all their memory back). Not
    /// during capture. Returns the failures.
    fn sweep(&self, s: &mut State) -> Vec<Error> {
        let mut errors = Vec::new();
        let mut gone = Vec::new();
        for (id, p) in s.pools.iter() {
            if p.use_count > 0 || p.capturing {
                continue;
            }
            if let Err(e) = p.allocator.empty_cache() {
                errors.push(Error::from(e).context(format!("pool {}", name(*id))));
            }
            if p.live() == 0 {
                gone.push(*id);
            }
        }
        for id in gone {
            s.pools.remove(&id);
            s.released.insert(id);
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        errors
    }

    /// Allocates in pool `id` (routed here by the shim's capture filter).
    pub fn malloc(&self, id: PoolId, size: u64, stream: Stream) -> Result<Allocation, Error> {
        let mut s = self.lock();
        match s.pools.get_mut(&id) {
            Some(p) => {
                let a = p.allocator.malloc(size, stream).map_err(Error::from)?;
                p.live.insert(
                    a.ptr,
                    PoolBlock {
                        ptr: a.ptr,
                        requested: a.requested,
                        size: a.size,
                        stream: a.stream,
                    },
                );
                Ok(a)
            }
            None => Err(unknown(&s, id)),
        }
    }

    /// Frees `ptr` on this device: queued while a capture is underway;
    /// otherwise the queue is applied first, then `ptr` goes to the main
    /// allocator (`main_free`) or the pool that owns it.
    pub fn free(
        &self,
        ptr: u64,
        main_free: &dyn Fn(u64) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        if self.idle() {
            return main_free(ptr);
        }
        if self.capturing() {
            self.lock().deferred.push(ptr);
            self.pending.store(true, Ordering::Release);
            return Ok(());
        }
        for e in self.flush_with(main_free) {
            crate::diag::log(self.log, LogLevel::Error, &e);
        }
        self.free_now(ptr, main_free)
    }

    fn free_now(
        &self,
        ptr: u64,
        main_free: &dyn Fn(u64) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        match main_free(ptr) {
            Err(AllocError::InvalidPointer { .. }) => {}
            other => return other,
        }
        let mut s = self.lock();
        let mut owner = None;
        for (id, p) in s.pools.iter_mut() {
            if !p.live.contains_key(&ptr) {
                continue;
            }
            owner = Some((*id, Self::free_in_pool(p, ptr)));
            break;
        }
        let Some((id, r)) = owner else {
            return Err(AllocError::InvalidPointer { ptr });
        };
        // A released pool goes once its last allocation does.
        if s.pools[&id].use_count == 0 && !s.pools[&id].capturing && s.pools[&id].live() == 0 {
            s.pools.remove(&id);
            s.released.insert(id);
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        r
    }

    /// `recordStream` for a block of one of the pools.
    pub fn record_stream(&self, ptr: u64, stream: Stream) -> Result<(), AllocError> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Err(AllocError::InvalidPointer { ptr });
        }
        let s = self.lock();
        for p in s.pools.values() {
            match p.allocator.record_stream(ptr, stream) {
                Err(AllocError::InvalidPointer { .. }) => continue,
                r => return r,
            }
        }
        Err(AllocError::InvalidPointer { ptr })
    }

    /// Applies the frees queued during capture (`main_free` frees from the
    /// main allocator), unless a capture is still underway. Errors (a pointer
    /// no allocator knows) are returned as text.
    pub fn flush_with(&self, main_free: &dyn Fn(u64) -> Result<(), AllocError>) -> Vec<String> {
        // A plain load first: the hot malloc path finds nothing pending and
        // makes no atomic read-modify-write.
        if self.capturing()
            || !self.pending.load(Ordering::Acquire)
            || !self.pending.swap(false, Ordering::AcqRel)
        {
            return Vec::new();
        }
        let queued = std::mem::take(&mut self.lock().deferred);
        let mut errors: Vec<String> = queued
            .into_iter()
            .filter_map(|p| {
                self.free_now(p, main_free)
                    .err()
                    .map(|e| format!("free of {p:#x} deferred during capture: {e}"))
            })
            .collect();
        if self.count.load(Ordering::Acquire) > 0 {
            let swept = self.sweep(&mut self.lock());
            errors.extend(swept.iter().map(Error::to_string));
        }
        errors
    }

    /// Pools that exist, and frees waiting for the end of capture.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.lock();
        (s.pools.len(), s.deferred.len())
    }

    /// Bytes allocated and reserved in the pools (current values).
    pub fn bytes(&self) -> (i64, i64) {
        let s = self.lock();
        s.pools.values().fold((0, 0), |(a, r), p| {
            let st = p.allocator.stats();
            (
                a + st.allocated_bytes.all().current,
                r + st.reserved_bytes.all().current,
            )
        })
    }

    /// Device calls the pools' guards refused so far.
    pub fn refused(&self) -> u32 {
        let s = self.lock();
        s.pools
            .values()
            .map(|p| p.guard.refused.load(Ordering::Relaxed))
            .sum()
    }
}

fn unknown_plain(id: PoolId) -> Error {
    Error::invalid(format!("unknown pool {}", name(id)))
}

fn unknown(s: &State, id: PoolId) -> Error {
    Error::invalid(if s.released.contains(&id) {
        format!("pool {} was released already", name(id))
    } else {
        format!("unknown pool {} (no beginAllocateToPool for it)", name(id))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asserts `r` failed as an invalid argument whose message holds `needle`.
    #[track_caller]
    fn invalid<T: std::fmt::Debug>(r: Result<T, Error>, needle: &str) {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains(needle), "{e} lacks {needle:?}");
    }
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use vmmalloc_alloc::{build, Policy, PolicyOptions};
    use vmmalloc_device::adaptors::{CallHook, Hooked};
    use vmmalloc_device::sim::{SimConfig, SimDevice};
    use vmmalloc_device::{Call, Device, DeviceError, DeviceResult, GIB};

    const MIB: u64 = 1 << 20;

    /// Stands in for a stream capture: while `capturing`, the calls the CUDA
    /// driver rejects during capture (sync, event query, unmap, release) fail
    /// with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900, cuda.h) and are recorded.
    #[derive(Default)]
    struct CaptureGuard {
        capturing: AtomicBool,
        violations: Mutex<Vec<Call>>,
    }

    impl CallHook for CaptureGuard {
        fn before(&self, call: Call, _bytes: u64) -> DeviceResult<()> {
            let forbidden = matches!(
                call,
                Call::EventQuery
                    | Call::EventSync
                    | Call::StreamSync
                    | Call::DeviceSync
                    | Call::Unmap
                    | Call::Release
            );
            if forbidden && self.capturing.load(Ordering::SeqCst) {
                self.violations.lock().unwrap().push(call);
                return Err(DeviceError::Driver {
                    call,
                    code: 900,
                    name: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED".into(),
                    detail: "during stream capture".into(),
                });
            }
            Ok(())
        }
    }

    type Guarded = Hooked<SimDevice, CaptureGuard>;

    /// What `DeviceState::pool_allocator` does: a pool's allocator over
    /// `device` behind the pool's guard, with the main allocator's policy
    /// and options.
    fn pool_maker<'a>(
        device: &'a Arc<dyn Device>,
        policy: Policy,
        options: &'a PolicyOptions,
    ) -> impl Fn(Arc<PoolGuard>) -> Result<Box<dyn Allocator>, Error> + Copy + 'a {
        move |guard| {
            let d: Arc<dyn Device> = Arc::new(Hooked::new(device.clone(), PoolHook(guard)));
            build(policy, d, options).map_err(Error::from)
        }
    }

    fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
        a.0 < b.0 + b.1 && b.0 < a.0 + a.1
    }

    fn capture_scenario(policy: Policy) {
        let dev: Arc<Guarded> = Arc::new(Hooked::new(
            SimDevice::new(SimConfig::with_capacity(8 * GIB)),
            CaptureGuard::default(),
        ));
        let device: Arc<dyn Device> = dev.clone();
        let options = PolicyOptions::default();
        let main = build(policy, device.clone(), &options).unwrap();
        let main_free = |p: u64| main.free(p);
        let pools = GraphPools::new(LogLevel::Off);
        let make = pool_maker(&device, policy, &options);
        let st: Vec<Stream> = (0..4).map(|_| device.create_stream().unwrap()).collect();
        let s = st[3];
        // Main-allocator memory used on two streams, some freed (events pending).
        let before: Vec<_> = (0..6)
            .map(|i| {
                main.malloc((i + 1) * 3 * MIB, st[(i % 2) as usize])
                    .unwrap()
            })
            .collect();
        for a in &before[..3] {
            pools.free(a.ptr, &main_free).unwrap();
        }

        // Capture 1 into pool (1, 1).
        pools.begin((1, 1), make).unwrap();
        dev.hook().capturing.store(true, Ordering::SeqCst);
        let sizes = [MIB, 3 * MIB, 512, 20 * MIB, 2 * MIB + 5, 64 * MIB];
        let mut graph: Vec<(u64, u64)> = sizes
            .iter()
            .map(|&n| (pools.malloc((1, 1), n, s).unwrap().ptr, n))
            .collect();
        // record_stream reaches the pool's block.
        pools.record_stream(graph[0].0, st[1]).unwrap();
        assert!(pools.record_stream(0xdead000, st[1]).is_err());
        // Frees during capture: a pool block and a main block, both queued.
        let (p, _) = graph.remove(1);
        pools.free(p, &main_free).unwrap();
        pools.free(before[3].ptr, &main_free).unwrap();
        assert_eq!(pools.counts(), (1, 2));
        graph.push((pools.malloc((1, 1), 5 * MIB, s).unwrap().ptr, 5 * MIB));
        // Main allocations on other streams during capture, and empty_cache is
        // not called (the C ABI skips it while capturing).
        let side = main.malloc(7 * MIB, st[2]).unwrap();
        pools.end((1, 1)).unwrap(); // PyTorch ends the pool before cudaStreamEndCapture
        dev.hook().capturing.store(false, Ordering::SeqCst);
        assert_eq!(
            *dev.hook().violations.lock().unwrap(),
            vec![],
            "{policy}: forbidden calls during capture"
        );

        // After capture: the queue is applied, and heavy main-allocator use
        // never hands out pool memory (replays keep using the same addresses).
        assert!(pools.flush_with(&main_free).is_empty());
        assert_eq!(pools.counts(), (1, 0));
        main.free(side.ptr).unwrap();
        main.empty_cache().unwrap();
        for round in 0..3 {
            let live: Vec<_> = (1..40)
                .map(|i| {
                    main.malloc(i * 1536 * 1024 + round, st[(i % 3) as usize])
                        .unwrap()
                })
                .collect();
            for a in &live {
                for &g in &graph {
                    assert!(
                        !overlaps((a.ptr, a.requested), g),
                        "{policy}: main reused pool memory"
                    );
                }
                pools.free(a.ptr, &main_free).unwrap();
            }
            main.empty_cache().unwrap();
        }

        // A second graph shares the pool; both are released; the pool goes
        // once its last live block (a graph output the user kept) is freed.
        pools.begin((1, 1), make).unwrap();
        assert!(pools
            .begin((1, 1), make)
            .unwrap_err()
            .message()
            .contains("already being captured"));
        pools.end((1, 1)).unwrap();
        assert!(pools
            .end((1, 1))
            .unwrap_err()
            .message()
            .contains("no capture"));
        pools.release((1, 1), &main_free).unwrap();
        pools.release((1, 1), &main_free).unwrap();
        assert!(pools
            .release((1, 1), &main_free)
            .unwrap_err()
            .message()
            .contains("released already"));
        assert_eq!(pools.counts().0, 1, "{policy}: live outputs keep the pool");
        for (p, _) in graph {
            pools.free(p, &main_free).unwrap();
        }
        assert_eq!(pools.counts().0, 0, "{policy}: the pool is gone");
        assert!(pools
            .release((1, 1), &main_free)
            .unwrap_err()
            .message()
            .contains("released already"));
        assert!(pools
            .end((4, 2))
            .unwrap_err()
            .message()
            .contains("unknown pool (4, 2)"));
        assert!(pools
            .malloc((4, 2), 8, s)
            .unwrap_err()
            .message()
            .contains("unknown pool"));
        // Everything the pool had is back on the device.
        for a in &before[4..] {
            main.free(a.ptr).unwrap();
        }
        main.empty_cache().unwrap();
        main.validate().unwrap();
        drop(main);
        let info = dev.mem_info().unwrap();
        assert_eq!(info.free, info.total, "{policy}: memory left on the device");
    }

    #[test]
    fn capture_makes_no_forbidden_call_and_release_returns_the_pool() {
        for policy in [
            Policy::Expandable,
            Policy::Caching,
            Policy::TorchEs,
            Policy::Native,
        ] {
            capture_scenario(policy);
        }
    }

    /// A graph's freed blocks stay mapped at their captured addresses while
    /// the graph may replay: with the device full and the pool's free memory
    /// in two separate ranges, a request larger than either cannot be met by
    /// moving those pages (the unmap is refused), and they stay accessible.
    #[test]
    fn pinned_pool_pages_never_move() {
        let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(64 * MIB)));
        let device: Arc<dyn Device> = dev.clone();
        // Exact mappings (no mapping ahead), so that the sizes below fill
        // the 64 MiB device exactly.
        let mut options = PolicyOptions::default();
        options.expandable.grow_granule = 0;
        let policy = Policy::Expandable;
        let main = build(policy, device.clone(), &options).unwrap();
        let main_free = |p: u64| main.free(p);
        let pools = GraphPools::new(LogLevel::Off);
        let make = pool_maker(&device, policy, &options);
        let s = device.create_stream().unwrap();
        pools.begin((0, 7), make).unwrap();
        let a = pools.malloc((0, 7), 24 * MIB, s).unwrap();
        let c = pools.malloc((0, 7), 8 * MIB, s).unwrap(); // the graph's output, kept
        let b = pools.malloc((0, 7), 24 * MIB, s).unwrap();
        pools.free(a.ptr, &main_free).unwrap();
        pools.free(b.ptr, &main_free).unwrap();
        pools.end((0, 7)).unwrap();
        assert!(pools.flush_with(&main_free).is_empty());
        let m = main.malloc(8 * MIB, s).unwrap(); // the device is full now
                                                  // A second graph captures into the same pool.
        pools.begin((0, 7), make).unwrap();
        let r = pools.malloc((0, 7), 40 * MIB, s);
        let model = dev.introspect().unwrap();
        for (what, x) in [("a", a), ("b", b), ("c", c)] {
            assert!(
                model.is_accessible(x.ptr, x.size),
                "{what}'s captured pages were moved ({r:?})"
            );
        }
        match r {
            Ok(big) => {
                assert_eq!(pools.refused(), 0);
                // Only an in-place reuse could have fit: it overlaps a or b.
                let g = (big.ptr, big.size);
                assert!(overlaps(g, (a.ptr, a.size)) || overlaps(g, (b.ptr, b.size)));
            }
            Err(e) => {
                assert!(
                    e.is_out_of_memory() || e.message().contains("CUDA graph pool"),
                    "{e}"
                );
                eprintln!(
                    "40 MiB in the pinned pool: {e} ({} refused)",
                    pools.refused()
                );
            }
        }
        pools.end((0, 7)).unwrap();
        // After both graphs are released, the pool's memory may go.
        pools.release((0, 7), &main_free).unwrap();
        assert_eq!(
            pools.bytes().1,
            56 * MIB as i64,
            "one graph is left: all stays"
        );
        pools.release((0, 7), &main_free).unwrap();
        // The freed blocks' pages went back; the live output's stay.
        assert_eq!(pools.bytes(), (8 * MIB as i64, 8 * MIB as i64));
        assert!(pools.empty_released().is_empty());
        assert_eq!(pools.counts().0, 1);
        pools.free(c.ptr, &main_free).unwrap();
        assert_eq!(pools.counts().0, 0);
        main.free(m.ptr).unwrap();
        main.empty_cache().unwrap();
        drop(main);
        let info = dev.mem_info().unwrap();
        assert_eq!(info.free, info.total);
    }
    /// Graph trees' checkpoint and restore (Note [Checkpointing
    /// PrivatePoolState]): a block freed after a checkpoint is held (never
    /// reused) until the checkpoint goes; a restore frees what is live and
    /// was not checkpointed, and hands back every checkpointed block.
    #[test]
    fn checkpoint_restore_frees_the_new_and_hands_back_the_old() {
        let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(GIB)));
        let device: Arc<dyn Device> = dev.clone();
        let options = PolicyOptions::default();
        let policy = Policy::Expandable;
        let main = build(policy, device.clone(), &options).unwrap();
        let main_free = |p: u64| main.free(p);
        let pools = GraphPools::new(LogLevel::Off);
        let make = pool_maker(&device, policy, &options);
        let s = device.create_stream().unwrap();
        let id = (0, 3);
        invalid(pools.checkpoint(id), "unknown pool");
        pools.begin(id, make).unwrap();
        let a = pools.malloc(id, 3 * MIB, s).unwrap();
        let b = pools.malloc(id, 512, s).unwrap();
        let c = pools.malloc(id, 5 * MIB, s).unwrap();
        pools.end(id).unwrap();
        let set = |v: &[u64]| v.iter().copied().collect::<HashSet<u64>>();
        assert!(pools.check_live(id, &set(&[a.ptr, b.ptr, c.ptr])).unwrap());
        assert!(!pools.check_live(id, &set(&[a.ptr, b.ptr])).unwrap());
        assert!(!pools
            .check_live(id, &set(&[a.ptr, b.ptr, c.ptr, 7]))
            .unwrap());
        let h = pools.checkpoint(id).unwrap();
        assert_ne!(h, 0);
        // After the checkpoint: b dies, d is born; d never takes b's address.
        pools.free(b.ptr, &main_free).unwrap();
        let d = pools.malloc(id, 512, s).unwrap();
        assert_ne!(d.ptr, b.ptr);
        assert!(pools.check_live(id, &set(&[a.ptr, c.ptr, d.ptr])).unwrap());
        let before = pools
            .pool_stats(id)
            .unwrap()
            .0
            .allocated_bytes
            .all()
            .current;
        let r = pools.restore(h, &main_free).unwrap();
        assert_eq!(set(&r.freed), set(&[a.ptr, c.ptr, d.ptr]));
        let back: Vec<(u64, u64)> = r.allocated.iter().map(|x| (x.ptr, x.requested)).collect();
        let mut want = vec![(a.ptr, a.requested), (b.ptr, 512), (c.ptr, c.requested)];
        want.sort();
        assert_eq!(back, want, "in address order");
        assert!(pools.check_live(id, &set(&[a.ptr, b.ptr, c.ptr])).unwrap());
        // d went back to the pool's allocator.
        let after = pools
            .pool_stats(id)
            .unwrap()
            .0
            .allocated_bytes
            .all()
            .current;
        assert_eq!(before - after, d.size as i64);
        // Restoring twice is the same state.
        let r2 = pools.restore(h, &main_free).unwrap();
        assert_eq!(set(&r2.freed), set(&[a.ptr, b.ptr, c.ptr]));
        // The tree raw-deletes what died (b), then drops the checkpoint.
        pools.free(b.ptr, &main_free).unwrap();
        let held = pools
            .pool_stats(id)
            .unwrap()
            .0
            .allocated_bytes
            .all()
            .current;
        pools.drop_checkpoint(h).unwrap();
        invalid(pools.drop_checkpoint(h), "unknown checkpoint");
        let freed = pools
            .pool_stats(id)
            .unwrap()
            .0
            .allocated_bytes
            .all()
            .current;
        assert_eq!(
            held - freed,
            b.size as i64,
            "b is released with its checkpoint"
        );
        invalid(pools.restore(h, &main_free), "unknown checkpoint");
        // Use counts: the capture's one, a MemPool's one.
        assert_eq!(pools.use_count(id).unwrap(), 1);
        pools.create_or_incref(id, make).unwrap();
        assert_eq!(pools.use_count(id).unwrap(), 2);
        pools.release(id, &main_free).unwrap();
        pools.release(id, &main_free).unwrap();
        invalid(pools.checkpoint(id), "released");
        for p in [a.ptr, c.ptr] {
            pools.free(p, &main_free).unwrap();
        }
        assert_eq!(pools.counts().0, 0, "the pool is gone");
        invalid(pools.use_count(id), "released already");
        // A MemPool-made pool: no capture, use count 1.
        pools.create_or_incref((0, 9), make).unwrap();
        assert!(!pools.capturing());
        assert_eq!(pools.use_count((0, 9)).unwrap(), 1);
        let m = pools.malloc((0, 9), MIB, s).unwrap();
        assert_eq!(pools.pool_stats((0, 9)).unwrap().1, 1);
        pools.free(m.ptr, &main_free).unwrap();
        pools.release((0, 9), &main_free).unwrap();
        assert_eq!(pools.counts().0, 0);
        drop(main);
        let info = dev.mem_info().unwrap();
        assert_eq!(info.free, info.total);
    }
}
