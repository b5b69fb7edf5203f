//! `expandable`: ours — one address arena per device, physical chunks sized
//! to the work, a chunk pool, and targeted reclaim instead of PyTorch's
//! global flush.
//!
//! # Shape
//!
//! - One virtual **arena** per allocator (`physical/arena.rs`): a single reservation of
//!   `arena_size` bytes (default 4 × device memory) cut into slices of the
//!   device memory size. Another arena is reserved when slices run out, so
//!   the allocator never fails for lack of address space while pages are free.
//! - One **segment** per (stream, pool) (`segment.rs`), each owning a slice.
//!   Pools: small (requests ≤ 1 MiB) and large. A segment grows by mapping
//!   physical **chunks** (one `cuMemCreate` handle of one or more pages, up to
//!   `max_chunk`) where its blocks need them (`pages.rs`); which pages are
//!   mapped, and by which handle, is its chunk table (`physical/chunks.rs`, a bit
//!   vector beside a map of chunks), held by the physical layer.
//! - The **ladder of sources** (`ladder.rs`): the memory for those chunks
//!   comes from the pool, then new handles within the limit, then released
//!   spare pooled handles, a targeted reclaim, unpinning and (`spill:true`)
//!   host memory, in that order; the mode (`Need`) passed down
//!   says how far down a request may go.
//! - **Blocks** (`blocks.rs`) split and merge at 512 B inside a segment; best fit
//!   by `(size, addr)` among the free blocks of the request's (stream, pool).
//! - A **chunk pool** (`physical/pool.rs`): chunks unmapped from free space keep their
//!   handle and are mapped again without `release`/`create`; handles go back
//!   to the driver above `release_threshold` or on `empty_cache`.
//! - The **physical layer** (`physical/`, `Physical`): every handle and
//!   where it is — the segments' chunk tables, the growable regions, the
//!   arenas, the pool, the budget (memory fraction), unready chunks, spill's
//!   host handles and the chunks IPC export pins — behind a narrow
//!   interface: a new handle, map this handle at this page of this segment,
//!   unmap these whole chunks, room in the budget, where an unmapped handle
//!   goes, may a chunk move, export the handles under this range. It alone
//!   makes the driver's memory calls (`physical/calls.rs`), including
//!   unpinning's and spill's moves of one chunk (`physical/moves.rs`) and
//!   the drain at drop; every call is an event to its observers, the
//!   driver-call counter first (`physical/observe.rs`). The block layer
//!   (everything else here) decides what to map, keeps its own counters
//!   ([`Inner::with_seg_pages`]) and reaches streams, events and copies
//!   through the layer's narrow view.
//! - **Targeted reclaim** (`reclaim.rs`): when `create` fails with out-of-memory
//!   (or the memory-fraction limit is reached) only as many whole free chunks
//!   as the request lacks are unmapped, least recently freed first, after
//!   waiting for the streams that last used them — never a device-wide sync.
//! - **Unpinning** (`unpin.rs`): a free chunk a new block covers only in
//!   part is reused as it is (pinned); when an allocation still lacks pages
//!   after reclaim, the live pages of such chunks move to chunks of their
//!   own at the same addresses (`physical/moves.rs`) and the free pages come back.
//! - **Mapping ahead** (`alloc.rs`, `grow_to`): a block that extends its
//!   segment's tail maps on to the next `grow_granule` (20 MiB) boundary
//!   while mapped + pooled memory is under 4/5 of the limit.
//! - **Splits** (`pages.rs`, off by default): with `split_threshold` below
//!   1, once live bytes pass that fraction of the limit, a free chunk a new
//!   block would cover only in part (leaving more than `split_slack`
//!   uncovered) is unmapped and re-backed by exact chunks ahead of need; a
//!   request's page shared with another block gets a chunk of its own
//!   (where the rest of its run is longer than `split_slack`), and large
//!   blocks of whole pages start on a page boundary ("Edge pages" in
//!   `pages.rs`).
//! - **Stream safety** (`events.rs`): a freed block is reused at once on its own
//!   stream; blocks used on other streams (`record_stream`) wait for events.
//!
//! # Locking
//!
//! One lock guards all state; every public method takes it once. It is a
//! compare-and-swap flag released by a plain store (`lock.rs`): one atomic
//! operation per call instead of `parking_lot`'s two. Device calls are made
//! under the lock; they happen only in slow paths. See `docs/expandable.md`.
//!
//! # Cost
//!
//! A cache hit costs one lock, one free-index (`free_index.rs`) lookup +
//! removal (+ insertion of the split remainder), one hash-map insertion, and
//! no device call. `free` is one hash-map removal, at most two neighbour
//! merges and one free-index insertion. Mapping new memory costs one
//! `cuMemCreate` and one `cuMemMap` per chunk and one `set_access` per run;
//! the stats are updated once per run.

mod alloc;
mod blocks;
mod config;
mod counters;
mod events;
mod free_index;
mod growable;
mod ipc;
mod ladder;
mod lock;
mod pages;
mod pause;
mod physical;
mod private_pools;
mod reclaim;
mod report;
mod segment;
mod share;
mod sleep;
mod snapshot;
mod spill;
pub mod tags;
mod teardown;
mod threads;
mod unpin;
mod validate;

pub use blocks::{MIN_BLOCK, SMALL_SIZE};
pub use config::{
    ExpandableConfig, UnpinMode, DEFAULT_GROW_GRANULE, DEFAULT_MAX_CHUNK, DEFAULT_SPLIT_SLACK,
    DEFAULT_SPLIT_THRESHOLD,
};
pub use growable::GrowableInfo;
pub use share::{build_shared, join_and_serve, AllocatorGiveBack};
pub use sleep::{tag_summary, TagStats};
// The driver-call events and their counter, shared with the caching
// replica's driver calls (`caching/calls.rs`): one counting mechanism.
pub(crate) use physical::observe;

use crate::pools::{PoolBlock, PoolId, PoolStats, PrivatePools, Restored};
use crate::{AllocResult, Allocation, Allocator, Snapshot, Stats, Stream};
use blocks::{LiveMap, Slab};
use counters::Counters;
use events::Events;
use lock::Lock;
use physical::Layout;
use segment::{Segment, StreamEntry};
use vmmalloc_device::Device;

/// Blocks (live or free) the block storage and the live map have room for
/// before they first grow: a training step holds a few hundred to a few
/// thousand tensors, and growing a hash map rehashes every entry
/// (`cargo bench -p vmmalloc-trace --bench replay`). 4096 entries cost
/// about 300 KiB.
const INITIAL_BLOCKS: usize = 4096;

/// Every piece of allocator state, guarded by one mutex.
pub(crate) struct Inner {
    /// Sizes derived from the options and the device.
    layout: Layout,
    /// Live bytes above which partly covered free chunks are split.
    split_above: u64,
    /// `split_threshold` (kept to recompute `split_above` when the fraction changes).
    split_threshold: f64,
    /// When partly live chunks are unpinned as memory runs short (`unpin.rs`).
    unpin: UnpinMode,
    /// The host threads that call, for [`UnpinMode::Auto`] (`threads.rs`).
    threads: threads::Threads,
    /// All blocks.
    slab: Slab,
    /// Allocated blocks by address.
    live: LiveMap,
    /// Streams seen, with their pools.
    streams: Vec<StreamEntry>,
    /// Segments; `None` = retired slot.
    segments: Vec<Option<Segment>>,
    /// Retired segment slots to reuse.
    vacant_segments: Vec<u32>,
    /// The physical layer: chunk tables (segments and growable regions),
    /// arenas, chunk pool, budget, observers, unready chunks, spill, export
    /// marks (`physical/`). The only owner of device memory.
    phys: physical::Physical,
    /// Event pool and blocks waiting for events.
    events: Events,
    /// Counts frees; orders reclaim and stream waits.
    tick: u64,
    /// Counters other than the nine stat families.
    stats: Stats,
    /// The stat families (`allocation`, `allocated_bytes`, ...), kept compact.
    counters: Counters,
    /// Paused tags and their backups ([`sleep`]).
    sleep: sleep::SleepState,
    /// Host buffers of restored backups, kept for the next pause ([`pause`]).
    spares: pause::Spares,
    /// Private pools (CUDA graphs, MemPools) and the frees deferred by
    /// captures ([`private_pools`]).
    pools: private_pools::PoolTable,
}

impl Inner {
    /// The segment with index `i` (a live segment by construction).
    #[inline]
    fn seg(&self, i: u32) -> &Segment {
        match &self.segments[i as usize] {
            Some(s) => s,
            None => unreachable!("segment {i} is retired but still referenced"),
        }
    }

    /// The segment with index `i`, mutably.
    #[inline]
    fn seg_mut(&mut self, i: u32) -> &mut Segment {
        match &mut self.segments[i as usize] {
            Some(s) => s,
            None => unreachable!("segment {i} is retired but still referenced"),
        }
    }

    /// The chunk table of segment `i` (the physical layer's).
    #[inline]
    fn table(&self, i: u32) -> &physical::ChunkTable {
        self.phys.table(i)
    }

    /// Segment `i`'s contribution to `inactive_split_bytes` and
    /// `inactive_split` ([`Segment::inactive_split`]).
    #[inline]
    fn inactive_split(&self, i: u32) -> (i64, i64) {
        self.seg(i)
            .inactive_split(self.table(i).mapped_pages(), self.layout.page)
    }

    /// The indices of segment `s`'s blocks, in address order (follows the
    /// links; `validate` walks them itself, checking for cycles).
    fn block_indices<'a>(&'a self, s: &Segment) -> impl Iterator<Item = u32> + 'a {
        let first = (s.first != blocks::NIL).then_some(s.first);
        std::iter::successors(first, move |&i| {
            let n = self.slab[i].next;
            (n != blocks::NIL).then_some(n)
        })
    }

    /// Segment `s`'s blocks, in address order.
    fn blocks_in<'a>(&'a self, s: &Segment) -> impl Iterator<Item = &'a blocks::Block> + 'a {
        self.block_indices(s).map(move |i| &self.slab[i])
    }

    /// All counters, in PyTorch's shape.
    fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        self.counters.fill(&mut s);
        self.phys.fill_stats(&mut s);
        s
    }

    /// Device pages mapped in all segments and regions (host-located,
    /// spilled pages do not count: they are not device memory).
    fn mapped_pages(&self) -> u64 {
        self.phys.device_pages()
    }
}

/// Our allocator: page-level reclaim, page pool, one address arena per device.
///
/// Generic over the device (`Arc<dyn Device>` when built by
/// [`crate::build`], `Arc<SimDevice>` in tests). Thread-safe: one lock guards
/// the state.
pub struct ExpandableAllocator<D: Device> {
    device: D,
    inner: Lock<Inner>,
    /// The mapping log ([`crate::MappingLog::log_mappings`]), attached to the
    /// physical layer the first time it is turned on.
    mappings: std::sync::OnceLock<std::sync::Arc<physical::mappings::MappingLog>>,
}

impl<D: Device> ExpandableAllocator<D> {
    /// Creates the allocator over `device`. Makes no device call: the arena is
    /// reserved by the first allocation. Fails with
    /// [`crate::AllocError::InvalidOption`] when an option does not fit the device.
    pub fn new(device: D, config: ExpandableConfig) -> AllocResult<Self> {
        let layout = config.resolve(device.caps())?;
        let stats = Stats {
            max_split_size: i64::MAX,
            ..Stats::default()
        };
        Ok(ExpandableAllocator {
            device,
            mappings: std::sync::OnceLock::new(),
            inner: Lock::new(Inner {
                layout,
                split_above: layout.split_above(config.memory_fraction, config.split_threshold),
                split_threshold: config.split_threshold,
                unpin: config.unpin,
                threads: Default::default(),
                slab: Slab::with_capacity(INITIAL_BLOCKS),
                live: LiveMap::with_capacity_and_hasher(INITIAL_BLOCKS, Default::default()),
                streams: Vec::new(),
                segments: Vec::new(),
                vacant_segments: Vec::new(),
                phys: physical::Physical::new(
                    &layout,
                    config.memory_fraction,
                    config.release_threshold,
                    config.spill,
                ),
                events: Events::default(),
                tick: 0,
                stats,
                counters: Counters::default(),
                sleep: sleep::SleepState::default(),
                spares: Default::default(),
                pools: Default::default(),
            }),
        })
    }

    /// The device this allocator draws from.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Runs `f` under the lock. A panic in it fails the allocator (see
    /// `lock.rs`): this call and every later one return
    /// [`crate::AllocError::Failed`] naming the panic.
    #[inline]
    fn call<T>(
        &self,
        op: &str,
        f: impl FnOnce(&mut Inner, &D) -> AllocResult<T>,
    ) -> AllocResult<T> {
        match self.inner.run(op, |inner| f(inner, &self.device)) {
            Ok(r) => r,
            Err(why) => Err(crate::AllocError::Failed(why.to_string())),
        }
    }

    /// [`Self::call`], telling `f` whether the lock was contended (the
    /// evidence of overlapping calls that `unpin:auto` reads, `threads.rs`).
    #[inline]
    fn call_noting_wait<T>(
        &self,
        op: &str,
        f: impl FnOnce(&mut Inner, &D, bool) -> AllocResult<T>,
    ) -> AllocResult<T> {
        match self
            .inner
            .run_noting_wait(op, |inner, waited| f(inner, &self.device, waited))
        {
            Ok(r) => r,
            Err(why) => Err(crate::AllocError::Failed(why.to_string())),
        }
    }

    /// Reads the state under the lock; once the allocator has failed, reads
    /// the state as the panic left it (statistics and snapshots stay
    /// available to explain the failure; nothing is handed out).
    fn read<T>(&self, op: &str, f: impl Fn(&Inner) -> T) -> T {
        match self.inner.run(op, |inner| f(inner)) {
            Ok(v) => v,
            Err(_) => f(self
                .inner
                .frozen()
                .expect("a lock that refuses a guard has failed")),
        }
    }

    /// Bytes of one physical page.
    pub fn page_size(&self) -> u64 {
        self.read("page_size", |i| i.layout.page)
    }

    /// Bytes of the largest physical chunk (one `cuMemCreate` handle).
    pub fn max_chunk(&self) -> u64 {
        self.read("max_chunk", |i| i.layout.max_chunk_pages * i.layout.page)
    }

    /// Bytes of address space per segment.
    pub fn segment_slice(&self) -> u64 {
        self.read("segment_slice", |i| i.layout.slice)
    }

    /// Reserves a growable region of up to `max_bytes` for work on `stream`
    /// and returns its address, which never changes; maps nothing
    /// (docs/expandable.md, "Growable regions").
    pub fn growable_create(&self, max_bytes: u64, stream: Stream) -> AllocResult<u64> {
        self.call("growable_create", |i, d| {
            i.growable_create(d, max_bytes, stream)
        })
    }

    /// Makes growable region `ptr` `bytes` long, mapping or unmapping whole
    /// chunks at its end (a shrink first waits for the region's stream). On
    /// error the region keeps its old size.
    pub fn growable_resize(&self, ptr: u64, bytes: u64) -> AllocResult<()> {
        self.call("growable_resize", |i, d| i.growable_resize(d, ptr, bytes))
    }

    /// Unmaps and unreserves growable region `ptr`.
    pub fn growable_destroy(&self, ptr: u64) -> AllocResult<()> {
        self.call("growable_destroy", |i, d| i.growable_destroy(d, ptr))
    }

    /// Spill's quiet point (docs/expandable.md, "Spill and pressure"):
    /// releases host-located chunks in free space and moves those under
    /// live blocks back to device memory while the limit has room (waiting
    /// only for the owning streams). `empty_cache` runs it too.
    pub fn migrate_spilled(&self) -> AllocResult<()> {
        self.call("migrate_spilled", |i, d| {
            i.migrate_spilled(d).map_err(crate::AllocError::Device)
        })
    }

    /// Size, maximum and mapping of growable region `ptr`.
    pub fn growable_info(&self, ptr: u64) -> AllocResult<GrowableInfo> {
        self.call("growable_info", |i, _| i.growable_info(ptr))
    }
}

impl<D: Device> Allocator for ExpandableAllocator<D> {
    fn name(&self) -> &'static str {
        "expandable"
    }

    fn malloc(&self, size: u64, stream: Stream) -> AllocResult<Allocation> {
        self.call_noting_wait("malloc", |i, d, waited| {
            if waited {
                i.threads.overlapped(true);
            }
            i.threads.call(Some(stream));
            i.malloc(d, size, stream)
        })
    }

    fn free(&self, ptr: u64) -> AllocResult<()> {
        self.call_noting_wait("free", |i, d, waited| {
            if waited {
                i.threads.overlapped(false);
            }
            i.threads.call(None);
            i.free(d, ptr)
        })
    }

    fn record_stream(&self, ptr: u64, stream: Stream) -> AllocResult<()> {
        self.call("record_stream", |i, _| i.record_stream(ptr, stream))
    }

    fn empty_cache(&self) -> AllocResult<()> {
        self.call("empty_cache", |i, d| i.empty_cache(d))
    }

    fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()> {
        self.call("set_memory_fraction", |i, d| {
            i.set_memory_fraction(d, fraction)
        })
    }

    /// Once the allocator has failed: the statistics as the panic left them.
    fn stats(&self) -> Stats {
        self.read("stats", Inner::stats)
    }

    /// Does nothing once the allocator has failed.
    fn reset_peak_stats(&self) {
        let _ = self.inner.run("reset_peak_stats", |g| {
            g.stats.reset_peak();
            g.counters.reset_peak();
        });
    }

    /// Once the allocator has failed: the state as the panic left it.
    fn snapshot(&self) -> Snapshot {
        let ordinal = self.device.caps().ordinal;
        self.read("snapshot", |i| i.snapshot(ordinal))
    }

    /// Once the allocator has failed: the failure.
    fn validate(&self) -> Result<(), String> {
        match self.inner.run("validate", |i| i.validate(&self.device)) {
            Ok(r) => r,
            Err(why) => Err(format!("the allocator failed: {why}")),
        }
    }

    /// Set by a panic under the lock (`lock.rs`).
    fn failure(&self) -> Option<&str> {
        self.inner.failure()
    }

    fn as_growable(&self) -> Option<&dyn crate::growable::Growable> {
        Some(self)
    }

    fn as_sleep(&self) -> Option<&dyn crate::Sleep> {
        Some(self)
    }

    fn as_export(&self) -> Option<&dyn crate::Export> {
        Some(self)
    }

    fn as_mapping_log(&self) -> Option<&dyn crate::MappingLog> {
        Some(self)
    }

    fn as_segment_follow(&self) -> Option<&dyn crate::SegmentFollow> {
        Some(self)
    }

    fn pools(&self) -> Option<&dyn PrivatePools> {
        Some(self)
    }
}

/// Sleep and wake (`sleep.rs`, `pause.rs`).
impl<D: Device> crate::Sleep for ExpandableAllocator<D> {
    fn pause(&self, tags: &[String], backup: bool) -> AllocResult<u64> {
        self.call("pause", |i, d| i.pause(d, tags, backup))
    }

    fn resume(&self, tags: &[String]) -> AllocResult<u64> {
        self.call("resume", |i, d| i.resume(d, tags))
    }

    /// Once the allocator has failed: the tags as the panic left them.
    fn tag_stats(&self) -> Vec<TagStats> {
        self.read("tag_stats", Inner::tag_stats)
    }
}

/// IPC export (`ipc.rs`, `physical/reback.rs`).
impl<D: Device> crate::Export for ExpandableAllocator<D> {
    fn export(&self, ptr: u64) -> AllocResult<crate::ipc::ExportedRange> {
        self.call("export", |i, _| i.export_block(ptr))
    }

    fn export_equal(&self, ptr: u64) -> AllocResult<crate::ipc::ExportedRange> {
        self.call("export_equal", |i, d| i.export_block_equal(d, ptr))
    }

    fn unexport(&self, ptr: u64) -> AllocResult<()> {
        self.call("unexport", |i, _| i.unexport_block(ptr))
    }
}

/// Following the registrable segments for NCCL (`physical/follow.rs`).
impl<D: Device> crate::SegmentFollow for ExpandableAllocator<D> {
    fn follow_segments(
        &self,
        sink: Option<std::sync::Arc<dyn crate::SegmentSink>>,
    ) -> AllocResult<()> {
        self.call("follow_segments", |i, _| {
            match sink {
                Some(sink) => {
                    let tags: Vec<_> = (0..i.segments.len())
                        .map(|slot| {
                            i.segments[slot]
                                .as_ref()
                                .map(|s| i.owner_tag(s.owner))
                                .unwrap_or_default()
                        })
                        .collect();
                    i.phys.start_follow(sink, |slot| {
                        tags.get(slot as usize).copied().unwrap_or_default()
                    });
                }
                None => i.phys.stop_follow(),
            }
            Ok(())
        })
    }

    fn followed_segments(&self) -> Vec<crate::SegmentChange> {
        self.read("followed_segments", |i| i.phys.followed())
    }

    fn segment_changes(&self) -> (u64, u64) {
        self.read("segment_changes", |i| i.phys.follow_counts())
    }
}

/// The physical layer's mapping log (`physical/mappings.rs`).
impl<D: Device> crate::MappingLog for ExpandableAllocator<D> {
    fn log_mappings(&self, on: bool) {
        use physical::mappings::{MappingLog, MappingObserver};
        let log = self.mappings.get_or_init(|| {
            let log = std::sync::Arc::new(MappingLog::default());
            let observer = MappingObserver(std::sync::Arc::clone(&log));
            // A failed allocator (a panic under its lock) makes no more
            // calls: nothing to observe, nothing lost.
            let _ = self
                .inner
                .run("log_mappings", |i| i.phys.attach(Box::new(observer)));
            log
        });
        log.set_on(on);
    }

    fn take_mappings(&self, out: &mut Vec<crate::MappingChange>) {
        let Some(log) = self.mappings.get() else {
            return;
        };
        if log.is_empty() {
            return;
        }
        // Under the allocator's lock: nothing is mapped meanwhile, and the
        // tables the records name still say whose stream they are.
        let _ = self.inner.run("take_mappings", |i| {
            for r in log.take() {
                let stream = match r.owner {
                    physical::observe::Owner::Segment(slot) => i
                        .segments
                        .get(slot as usize)
                        .and_then(Option::as_ref)
                        .map_or(Stream(0), |s| i.streams[s.owner as usize].stream),
                    physical::observe::Owner::Region(base) => {
                        i.phys.region(base).map_or(Stream(0), |g| g.stream)
                    }
                    _ => Stream(0),
                };
                out.push(crate::MappingChange {
                    mapped: r.mapped,
                    addr: r.addr,
                    bytes: r.bytes,
                    stream,
                });
            }
        });
    }
}

impl<D: Device> PrivatePools for ExpandableAllocator<D> {
    fn create_or_incref_pool(&self, id: PoolId) -> AllocResult<()> {
        self.call("create_or_incref_pool", |i, _| i.create_or_incref_pool(id))
    }

    fn begin_allocate_to_pool(&self, id: PoolId) -> AllocResult<()> {
        self.call("begin_allocate_to_pool", |i, _| {
            i.begin_allocate_to_pool(id)
        })
    }

    fn end_allocate_to_pool(&self, id: PoolId) -> AllocResult<()> {
        self.call("end_allocate_to_pool", |i, _| i.end_allocate_to_pool(id))
    }

    fn set_use_on_oom(&self, id: PoolId, on: bool) -> AllocResult<()> {
        self.call("set_use_on_oom", |i, _| i.set_use_on_oom(id, on))
    }

    fn set_no_split(&self, id: PoolId) -> AllocResult<()> {
        self.call("set_no_split", |i, _| i.set_no_split(id))
    }

    fn release_pool(&self, id: PoolId) -> AllocResult<()> {
        self.call("release_pool", |i, _| i.release_pool(id))
    }

    fn pool_use_count(&self, id: PoolId) -> AllocResult<u32> {
        self.call("pool_use_count", |i, _| i.pool_use_count(id))
    }

    fn pool_malloc(&self, id: PoolId, size: u64, stream: Stream) -> AllocResult<Allocation> {
        self.call_noting_wait("pool_malloc", |i, d, waited| {
            if waited {
                i.threads.overlapped(true);
            }
            i.threads.call(Some(stream));
            i.pool_malloc(d, id, size, stream)
        })
    }

    fn pool_live_blocks(&self, id: PoolId) -> AllocResult<Vec<PoolBlock>> {
        self.call("pool_live_blocks", |i, _| i.pool_live_blocks(id))
    }

    fn restore_pool(&self, id: PoolId, blocks: &[PoolBlock]) -> AllocResult<Restored> {
        self.call("restore_pool", |i, d| i.restore_pool(d, id, blocks))
    }

    fn pool_stats(&self, id: PoolId) -> AllocResult<PoolStats> {
        self.call("pool_stats", |i, _| i.pool_stats(id))
    }

    fn pool_ids(&self) -> Vec<PoolId> {
        self.read("pool_ids", Inner::pool_ids)
    }

    fn pool_of(&self, ptr: u64) -> Option<PoolId> {
        self.read("pool_of", |i| i.pool_of(ptr))
    }

    fn pause_pool(&self, id: PoolId, keep: bool) -> AllocResult<u64> {
        self.call("pause_pool", |i, d| i.pause_pool(d, id, keep))
    }

    fn resume_pool(&self, id: PoolId) -> AllocResult<u64> {
        self.call("resume_pool", |i, d| i.resume_pool(d, id))
    }

    fn captures_underway(&self) -> u32 {
        self.read("captures_underway", |i| i.pools.captures)
    }

    fn deferred_frees(&self) -> u64 {
        self.read("deferred_frees", |i| i.pools.deferred.len() as u64)
    }
}

impl<D: Device> Drop for ExpandableAllocator<D> {
    /// Waits for the streams that own segments, unmaps every page, releases
    /// every handle, destroys events and frees the arenas. Errors are logged
    /// (each call is retried once), never raised. A failed allocator's state
    /// may be half-updated: its teardown is tried, and a panic in it is
    /// logged and leaks what was left (never a panic out of `drop`).
    fn drop(&mut self) {
        if self.inner.failure().is_none() {
            self.inner.get_mut().teardown(&self.device);
            return;
        }
        let (inner, device) = (self.inner.get_mut(), &self.device);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.teardown(device)));
        if let Err(p) = r {
            eprintln!(
                "vmmalloc: expandable: dropping a failed allocator: its teardown panicked too ({}); \
                 what it held is leaked",
                lock::panic_text(&*p)
            );
        }
    }
}
