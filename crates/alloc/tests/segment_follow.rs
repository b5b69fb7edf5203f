//! The segment follower (issue 43, NCCL user-buffer registration) against a
//! strict fake NCCL: every [`SegmentChange`] the expandable allocator sends
//! (`Allocator::as_segment_follow`) is applied to a registry that refuses
//! what PyTorch and NCCL refuse, the device refuses to unmap registered
//! memory, and after every step the registry equals the follower's runs and
//! the segments the snapshot reports (the pickle PyTorch's tools read), so
//! that `register_mem_pool` (which registers the snapshot's segments) and
//! the `SEGMENT_ALLOC` / `SEGMENT_FREE` hooks (which register and deregister
//! by address) agree.
//!
//! Scenarios: sizes from 1 KiB to 300 MiB with empty_cache and a follow
//! begun over mapped memory; targeted reclaim and the memory fraction;
//! unpinning and spill; pause and resume of tags; private pools (graph
//! capture, pause); growable regions; IPC re-backing; failed driver calls;
//! stopping and restarting; the bound on changes per driver call; and a
//! property test of random sequences. `sim` where bytes do not matter,
//! `host` where they do.

use parking_lot::Mutex;
mod common;

use common::size;
use proptest::prelude::*;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use vmmalloc_alloc::expandable::{ExpandableAllocator, ExpandableConfig, UnpinMode};
use vmmalloc_alloc::pickle_snapshot::{snapshot_value, DeviceDump};
use vmmalloc_alloc::pools::PoolId;
use vmmalloc_alloc::{
    AllocError, Allocation, Allocator, BlockState, SegmentChange, SegmentSink, Snapshot, Stream,
};
use vmmalloc_alloc_harness::{
    pattern_check, pattern_fill, tagged, Harness, Op, OpMix, Outcome, RandomOps,
};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Call, Device, DeviceResult, PhysHandle, GIB, MIB};

// --- The fake NCCL -----------------------------------------------------------

/// One registrable segment as the tests compare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Seg {
    /// First byte.
    addr: u64,
    /// Bytes.
    bytes: u64,
    /// The stream of the segment (or region) it lies in.
    stream: Stream,
    /// Its private pool (`(0, 0)`: the default pool).
    pool: PoolId,
}

impl Seg {
    /// One past the last byte.
    fn end(&self) -> u64 {
        self.addr + self.bytes
    }
}

impl From<&SegmentChange> for Seg {
    fn from(c: &SegmentChange) -> Seg {
        Seg {
            addr: c.addr,
            bytes: c.bytes,
            stream: c.stream,
            pool: c.pool,
        }
    }
}

/// What the fake NCCL knows: its registrations, what the device made
/// accessible, the rule breaks it saw and every change it was sent.
#[derive(Debug, Default)]
struct Registry {
    /// Live registrations by address (`registeredSegmentHandles_`).
    regs: BTreeMap<u64, Seg>,
    /// Mapped and accessible ranges of the device (first byte -> one past
    /// the last), merged: `cuMemSetAccess` adds, `cuMemUnmap` takes away.
    accessible: BTreeMap<u64, u64>,
    /// Rule breaks seen (the test fails at its next check).
    violations: Vec<String>,
    /// Every change the allocator sent, in order.
    log: Vec<SegmentChange>,
}

/// Adds `[a, b)` to the merged range set `set`.
fn add_range(set: &mut BTreeMap<u64, u64>, a: u64, b: u64) {
    // Disjoint and sorted: walking down from the last range starting at or
    // before `b`, the ends fall too, so the touching ones come first.
    let touching: Vec<(u64, u64)> = set
        .range(..=b)
        .rev()
        .take_while(|(_, &e)| e >= a)
        .map(|(&s, &e)| (s, e))
        .collect();
    let (mut start, mut end) = (a, b);
    for (s, e) in touching {
        set.remove(&s);
        start = start.min(s);
        end = end.max(e);
    }
    set.insert(start, end);
}

/// Takes `[a, b)` out of the merged range set `set`.
fn remove_range(set: &mut BTreeMap<u64, u64>, a: u64, b: u64) {
    let hit: Vec<(u64, u64)> = set
        .range(..b)
        .rev()
        .take_while(|(_, &e)| e > a)
        .map(|(&s, &e)| (s, e))
        .collect();
    for (s, e) in hit {
        set.remove(&s);
        if s < a {
            set.insert(s, a);
        }
        if e > b {
            set.insert(b, e);
        }
    }
}

/// Whether the merged range set `set` holds all of `[a, b)`.
fn covers(set: &BTreeMap<u64, u64>, a: u64, b: u64) -> bool {
    set.range(..=a).next_back().is_some_and(|(_, &e)| e >= b)
}

impl Registry {
    /// Notes a rule break.
    fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    /// The registration overlapping `[a, b)`, if any (registrations are
    /// disjoint: only the last one starting before `b` can).
    fn overlapping(&self, a: u64, b: u64) -> Option<Seg> {
        self.regs
            .range(..b)
            .next_back()
            .map(|(_, s)| *s)
            .filter(|s| s.end() > a)
    }

    /// `ncclCommRegister` through `NCCLComm::registerSegment`.
    fn register(&mut self, s: Seg, via: &str) {
        if self.regs.contains_key(&s.addr) {
            return self.violation(format!(
                "{via}: registerSegment: Segment with ptr {:#x} has already been registered \
                 ({:x?})",
                s.addr, self.regs[&s.addr]
            ));
        }
        if s.bytes == 0 {
            return self.violation(format!("{via}: ncclCommRegister of no bytes: {s:x?}"));
        }
        if let Some(o) = self.overlapping(s.addr, s.end()) {
            return self.violation(format!(
                "{via}: ncclCommRegister of {s:x?} overlaps registered {o:x?}"
            ));
        }
        if !covers(&self.accessible, s.addr, s.end()) {
            return self.violation(format!(
                "{via}: ncclCommRegister of {s:x?}: not all of it is mapped and accessible"
            ));
        }
        self.regs.insert(s.addr, s);
    }

    /// `ncclCommDeregister` through `NCCLComm::deregisterSegment`.
    fn deregister(&mut self, addr: u64, bytes: u64, via: &str) {
        match self.regs.remove(&addr) {
            None => self.violation(format!(
                "{via}: deregisterSegment: Segment with ptr {addr:#x} is not registered"
            )),
            Some(r) if r.bytes != bytes => self.violation(format!(
                "{via}: deregistering {addr:#x} as {bytes:#x} bytes, registered as {r:x?}"
            )),
            Some(_) => {}
        }
    }
}

/// A fake NCCL communicator that registers and deregisters exactly as
/// ProcessGroupNCCL's allocator hooks make it, and fails the test (a
/// violation, reported at the next [`Fx::check`]) wherever the real one
/// would fail or go wrong:
///
/// - `NCCLComm::registerSegment` (torch/csrc/distributed/c10d/NCCLUtils.cpp)
///   `TORCH_CHECK(registeredSegmentHandles_.count(ptr) == 0, "Segment with
///   ptr ", ptr, " has already been registered ...")`: registering an
///   address twice fails; PyTorch relies on the segments having "disjoint
///   addr ranges", so an overlap is refused too;
/// - `NCCLComm::deregisterSegment`: `TORCH_CHECK(
///   registeredSegmentHandles_.count(ptr) == 1, "Segment with ptr ", ptr,
///   " is not registered ...")`: deregistering an address not registered
///   fails; the hook deregisters the handle registered at exactly that
///   address, so the size must be the registered one;
/// - NCCL (`ncclCommRegister`, user buffer registration): the buffer must
///   be mapped device memory when registered, and registered memory must
///   stay mapped until it is deregistered: [`Strict`] refuses an unmap of
///   any registered byte.
///
/// The allocator calls the sink under its lock, so errors cannot be thrown
/// back: they are kept and checked after every step.
#[derive(Debug, Default)]
struct FakeNccl(Mutex<Registry>);

impl SegmentSink for FakeNccl {
    /// ProcessGroupNCCL's hooks: `SEGMENT_ALLOC` registers, `SEGMENT_FREE`
    /// deregisters the handle registered at that address.
    fn change(&self, c: &SegmentChange) {
        let mut r = self.0.lock();
        r.log.push(*c);
        if c.registered {
            r.register(Seg::from(c), "SEGMENT_ALLOC hook");
        } else {
            r.deregister(c.addr, c.bytes, "SEGMENT_FREE hook");
        }
    }
}

impl FakeNccl {
    /// The registrations, by address.
    fn registered(&self) -> Vec<Seg> {
        self.0.lock().regs.values().copied().collect()
    }

    /// The rule breaks seen so far.
    fn violations(&self) -> Vec<String> {
        self.0.lock().violations.clone()
    }

    /// Changes received so far.
    fn log_len(&self) -> usize {
        self.0.lock().log.len()
    }

    /// The changes received from index `from` on.
    fn log_since(&self, from: usize) -> Vec<SegmentChange> {
        self.0.lock().log[from..].to_vec()
    }

    /// `register_mem_pool` / `initNCCLComm`: registers segments a snapshot
    /// reported (not changes the allocator sent).
    fn register_snapshot(&self, segs: &[Seg]) {
        let mut r = self.0.lock();
        for s in segs {
            r.register(*s, "register_mem_pool (snapshot)");
        }
    }

    /// The communicator is destroyed: every registration goes.
    fn deregister_all(&self) {
        let mut r = self.0.lock();
        let all: Vec<Seg> = r.regs.values().copied().collect();
        for s in all {
            r.deregister(s.addr, s.bytes, "comm destroyed");
        }
    }
}

/// A device that refuses (as a violation) to unmap memory the fake NCCL
/// has registered, and tells it what is mapped and accessible. Every
/// other call goes to `inner` unchanged. A violation is kept rather than
/// panicked: the allocator runs under a lock that catches panics (and would
/// turn the refusal into `AllocError::Failed` or, at drop, a log line), so
/// [`Fx::check`] reports it after the step, and [`Fx::finish`] after the
/// teardown.
struct Strict<D> {
    /// The device underneath.
    inner: D,
    /// The fake NCCL whose registrations it guards.
    nccl: Arc<FakeNccl>,
}

impl<D: Device> Device for Strict<D> {
    vmmalloc_device::forward_device_calls!(inner: caps, reserve, free_reservation, create,
        release, mem_info, alloc, free, export_fd, import_fd, copy_to_device, copy_from_device,
        copy_device, alloc_host_buffer, create_stream, synchronize_stream, synchronize,
        create_event, record_event, query_event, synchronize_event, destroy_event,
        is_capturing, create_on_host, ipc_open, ipc_close, introspect);

    /// A new mapping is inaccessible until `set_access`: nothing to note.
    fn map(&self, addr: u64, size: u64, handle: PhysHandle) -> DeviceResult<()> {
        self.inner.map(addr, size, handle)
    }

    /// Notes the range accessible once the driver said yes.
    fn set_access(&self, addr: u64, size: u64) -> DeviceResult<()> {
        let r = self.inner.set_access(addr, size);
        if r.is_ok() {
            add_range(&mut self.nccl.0.lock().accessible, addr, addr + size);
        }
        r
    }

    /// Refuses (a violation) an unmap of registered memory, then unmaps;
    /// what was unmapped is no longer accessible.
    fn unmap(&self, addr: u64, size: u64) -> DeviceResult<()> {
        {
            let mut g = self.nccl.0.lock();
            if let Some(s) = g.overlapping(addr, addr + size) {
                g.violation(format!(
                    "cuMemUnmap of [{addr:#x}, {:#x}) while {s:x?} is registered with NCCL",
                    addr + size
                ));
            }
        }
        let r = self.inner.unmap(addr, size);
        if r.is_ok() {
            remove_range(&mut self.nccl.0.lock().accessible, addr, addr + size);
        }
        r
    }
}

// --- The segments the snapshot reports ------------------------------------------

/// The segments of `snap` by PyTorch's run rule for expandable segments
/// (what `pickle_snapshot` writes): each contiguous run of blocks with
/// memory behind them (not `unmapped`, not `paused`) is one segment.
fn snapshot_runs(snap: &Snapshot) -> Vec<Seg> {
    let mut out = Vec::new();
    for s in &snap.segments {
        assert!(s.is_expandable, "expandable reports expandable segments");
        let mut run: Option<Seg> = None;
        for b in &s.blocks {
            let memory = !matches!(b.state, BlockState::Unmapped | BlockState::Paused);
            match (&mut run, memory) {
                (Some(r), true) => {
                    assert_eq!(r.end(), b.address, "blocks cover their segment");
                    r.bytes += b.size;
                }
                (None, true) => {
                    run = Some(Seg {
                        addr: b.address,
                        bytes: b.size,
                        stream: s.stream,
                        pool: s.pool,
                    })
                }
                (_, false) => out.extend(run.take()),
            }
        }
        out.extend(run);
    }
    out.sort();
    out
}

/// Field `k` of pickled dictionary `d`.
fn field<'a>(d: &'a serde_pickle::Value, k: &str) -> &'a serde_pickle::Value {
    match d {
        serde_pickle::Value::Dict(m) => m
            .get(&serde_pickle::HashableValue::String(k.into()))
            .unwrap_or_else(|| panic!("no {k:?} in the pickled segment")),
        v => panic!("not a dict: {v:?}"),
    }
}

/// A pickled non-negative integer.
fn uint(v: &serde_pickle::Value) -> u64 {
    match v {
        serde_pickle::Value::I64(x) => u64::try_from(*x).expect("non-negative"),
        v => panic!("not an int: {v:?}"),
    }
}

/// The segments of `snap` as the snapshot pickle PyTorch's tools read
/// writes them (`pickle_snapshot::snapshot_value`): address, total_size,
/// stream, segment_pool_id.
fn pickle_runs(snap: &Snapshot) -> Vec<Seg> {
    let dump = DeviceDump {
        snapshot: snap,
        trace: None,
        frames: None,
    };
    let v = snapshot_value(&[dump], &[]).expect("the snapshot pickles");
    let serde_pickle::Value::List(segs) = field(&v, "segments") else {
        panic!("segments is not a list")
    };
    let mut out: Vec<Seg> = segs
        .iter()
        .map(|s| {
            let serde_pickle::Value::Tuple(pool) = field(s, "segment_pool_id") else {
                panic!("segment_pool_id is not a tuple")
            };
            Seg {
                addr: uint(field(s, "address")),
                bytes: uint(field(s, "total_size")),
                stream: Stream(uint(field(s, "stream"))),
                pool: (uint(&pool[0]), uint(&pool[1])),
            }
        })
        .collect();
    out.sort();
    out
}

/// `Err` naming the first difference between `a` and `b`.
fn same(what: &str, a: &[Seg], b: &[Seg]) -> Result<(), String> {
    if a == b {
        return Ok(());
    }
    let first = a
        .iter()
        .zip(b)
        .find(|(x, y)| x != y)
        .map(|(x, y)| format!("{x:x?} vs {y:x?}"))
        .unwrap_or_else(|| format!("{} vs {} segments", a.len(), b.len()));
    Err(format!("{what} differ: {first}\n  {a:x?}\n  {b:x?}"))
}

// --- The fixture ------------------------------------------------------------------

/// An expandable allocator over a [`Strict`] device, with its fake NCCL.
struct Fx<D: Device + 'static> {
    /// The fake NCCL the allocator's changes go to.
    nccl: Arc<FakeNccl>,
    /// The strict device.
    dev: Arc<Strict<D>>,
    /// The allocator.
    a: ExpandableAllocator<Arc<Strict<D>>>,
    /// Whether the fake NCCL follows the allocator now.
    following: Cell<bool>,
}

/// `ExpandableConfig::default()` without mapping ahead: each block maps
/// what it needs, as the other expandable tests count layouts.
fn exact() -> ExpandableConfig {
    ExpandableConfig {
        grow_granule: 0,
        ..ExpandableConfig::default()
    }
}

/// A `sim` device of `capacity` bytes.
fn sim(capacity: u64) -> Arc<SimDevice> {
    Arc::new(SimDevice::with_capacity(capacity))
}

/// A `host` device (real bytes) of `capacity` bytes.
fn host(capacity: u64) -> Arc<HostDevice> {
    Arc::new(HostDevice::new(HostConfig::with_capacity(capacity)).expect("host device"))
}

impl<D: Device + 'static> Fx<D> {
    /// An allocator with options `cfg` over `inner`, not following yet.
    fn new(inner: D, cfg: ExpandableConfig) -> Self {
        let nccl = Arc::new(FakeNccl::default());
        let dev = Arc::new(Strict {
            inner,
            nccl: nccl.clone(),
        });
        let a = ExpandableAllocator::new(dev.clone(), cfg).expect("valid options");
        Fx {
            nccl,
            dev,
            a,
            following: Cell::new(false),
        }
    }

    /// Starts following, then registers the segments a snapshot reports
    /// (`register_mem_pool`): the allocator sends nothing for memory mapped
    /// already. Returns those segments.
    fn follow(&self) -> Vec<Seg> {
        let before = self.nccl.log_len();
        let sink: Arc<dyn SegmentSink> = self.nccl.clone();
        let f = self.a.as_segment_follow().expect("expandable follows");
        f.follow_segments(Some(sink)).unwrap();
        assert_eq!(f.segment_changes(), (0, 0), "a fresh count");
        assert_eq!(
            self.nccl.log_len(),
            before,
            "nothing sent for mapped memory"
        );
        let seeded = pickle_runs(&self.a.snapshot());
        self.nccl.register_snapshot(&seeded);
        self.following.set(true);
        self.check("follow");
        seeded
    }

    /// Stops following; the communicator goes (deregistering everything).
    fn unfollow(&self) {
        self.check("before stopping");
        let f = self.a.as_segment_follow().unwrap();
        f.follow_segments(None).unwrap();
        assert!(
            f.followed_segments().is_empty(),
            "nothing known once stopped"
        );
        self.nccl.deregister_all();
        self.following.set(false);
        self.check("stopped");
    }

    /// The follower's changes: (added, removed).
    fn changes(&self) -> (u64, u64) {
        self.a.as_segment_follow().unwrap().segment_changes()
    }

    /// Checks everything (see [`Fx::try_check`]); panics naming `step`.
    #[track_caller]
    fn check(&self, step: &str) {
        if let Err(e) = self.try_check() {
            panic!("after {step}: {e}");
        }
    }

    /// No rule broken, `validate()` Ok, and while following: the fake
    /// NCCL's registrations = the follower's runs = the segments of the
    /// snapshot = the segments of its pickle, each accessible on the device.
    fn try_check(&self) -> Result<(), String> {
        let v = self.nccl.violations();
        if !v.is_empty() {
            return Err(format!("the fake NCCL refused: {v:#?}"));
        }
        self.a.validate().map_err(|e| format!("validate: {e}"))?;
        if let Some(f) = self.a.failure() {
            return Err(format!("the allocator failed: {f}"));
        }
        let followed = self.a.as_segment_follow().unwrap().followed_segments();
        if followed.iter().any(|c| !c.registered) {
            return Err(format!(
                "followed segments must be additions: {followed:x?}"
            ));
        }
        let followed: Vec<Seg> = followed.iter().map(Seg::from).collect();
        let registered = self.nccl.registered();
        if !self.following.get() {
            return match (followed.is_empty(), registered.is_empty()) {
                (true, true) => Ok(()),
                _ => Err(format!(
                    "not following, yet followed {followed:x?} / registered {registered:x?}"
                )),
            };
        }
        let snap = self.a.snapshot();
        let runs = snapshot_runs(&snap);
        let pickled = pickle_runs(&snap);
        same("registered and followed segments", &registered, &followed)?;
        same("registered and snapshot segments", &registered, &runs)?;
        same("snapshot and pickled segments", &runs, &pickled)?;
        let model = self.dev.introspect().expect("a model device");
        for s in &registered {
            if !model.is_accessible(s.addr, s.bytes) {
                return Err(format!("registered {s:x?} is not accessible on the device"));
            }
        }
        Ok(())
    }

    /// Drops the allocator: its teardown deregisters everything before
    /// unmapping it; nothing is left registered, no rule broken.
    fn finish(self) {
        let Fx { nccl, dev, a, .. } = self;
        drop(a);
        let v = nccl.violations();
        assert!(v.is_empty(), "at teardown the fake NCCL refused: {v:#?}");
        assert!(
            nccl.registered().is_empty(),
            "left registered after teardown: {:x?}",
            nccl.registered()
        );
        assert!(
            dev.introspect().unwrap().live().is_empty(),
            "the device holds {:?}",
            dev.introspect().unwrap().live()
        );
    }
}

/// Every change sent from log index `from` on that lies in `[p, p + n)`.
fn changes_in(nccl: &FakeNccl, from: usize, p: u64, n: u64) -> Vec<SegmentChange> {
    nccl.log_since(from)
        .into_iter()
        .filter(|c| c.addr < p + n && p < c.addr + c.bytes)
        .collect()
}

// --- Scenarios ---------------------------------------------------------------------

/// Sizes from 1 KiB to 300 MiB on two streams (host: real bytes), some
/// freed and allocated again, empty_cache. Following begins over mapped
/// memory: those segments come from the snapshot, and their removals find
/// them registered though the allocator never sent an addition for them.
#[test]
fn sizes_frees_and_empty_cache_from_a_follow_begun_over_mapped_memory() {
    let fx = Fx::new(host(2 * GIB), ExpandableConfig::default());
    let other = fx.dev.create_stream().unwrap();
    let sizes = [
        1024,
        4096 + 1,
        3 * MIB,
        20 * MIB + 1,
        46 * MIB,
        100 * MIB,
        300 * MIB,
    ];
    let mut live: Vec<(u64, Allocation)> = Vec::new();
    let mut id = 0;
    for &n in &sizes[..4] {
        let b = fx.a.malloc(n, Stream::DEFAULT).unwrap();
        pattern_fill(&*fx.dev, id, b.ptr, n).unwrap();
        live.push((id, b));
        id += 1;
    }
    let seeded = fx.follow();
    assert!(!seeded.is_empty(), "memory was mapped before following");
    for (i, &n) in sizes.iter().enumerate() {
        let s = if i % 2 == 0 { Stream::DEFAULT } else { other };
        let b = fx.a.malloc(n, s).unwrap();
        pattern_fill(&*fx.dev, id, b.ptr, n).unwrap();
        live.push((id, b));
        id += 1;
        fx.check(&format!("malloc({n}) on {s}"));
    }
    // Every other block freed, then allocated again at other sizes.
    let mut i = 0;
    live.retain(|(_, b)| {
        i += 1;
        if i % 2 == 0 {
            fx.a.free(b.ptr).unwrap();
            fx.check(&format!("free({:#x})", b.ptr));
        }
        i % 2 == 1
    });
    for (k, &n) in [5 * MIB, 150 * MIB, 2048, 60 * MIB].iter().enumerate() {
        let s = if k % 2 == 0 { other } else { Stream::DEFAULT };
        let b = fx.a.malloc(n, s).unwrap();
        pattern_fill(&*fx.dev, id, b.ptr, n).unwrap();
        live.push((id, b));
        id += 1;
        fx.check(&format!("malloc({n}) again"));
    }
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache with blocks live");
    for (k, b) in &live {
        pattern_check(&*fx.dev, *k, b.ptr, b.requested).unwrap();
    }
    for (_, b) in live.drain(..) {
        fx.a.free(b.ptr).unwrap();
        fx.check("free");
    }
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache of everything");
    assert!(
        fx.nccl.registered().is_empty(),
        "nothing mapped, nothing registered"
    );
    // Some seeded segment was removed without the allocator ever adding it.
    let log = fx.nccl.log_since(0);
    let removed_seeded = seeded.iter().any(|s| {
        log.iter().any(|c| !c.registered && c.addr == s.addr)
            && !log
                .iter()
                .any(|c| c.registered && c.addr == s.addr && c.bytes == s.bytes)
    });
    assert!(removed_seeded, "a seeded run was removed: {seeded:x?}");
    let (added, removed) = fx.changes();
    assert!(added > 0 && removed > 0, "{added} added, {removed} removed");
    fx.finish();
}

/// Targeted reclaim (the fragmentation scenario: a full device, every
/// other 8 MiB block freed, one 256 MiB request that moves 32 free chunks),
/// then a lower memory fraction and allocations on another stream that
/// take free chunks of the first one's segment.
#[test]
fn targeted_reclaim_and_the_memory_fraction() {
    let fx = Fx::new(sim(GIB), exact());
    fx.follow();
    let s = fx.dev.create_stream().unwrap();
    let blocks: Vec<_> = (0..128).map(|_| fx.a.malloc(8 * MIB, s).unwrap()).collect();
    fx.check("filling the device");
    let model = fx.dev.introspect().unwrap();
    for b in &blocks {
        model.streams().submit(s, b.ptr, b.size).unwrap();
    }
    for b in blocks.iter().step_by(2) {
        fx.a.free(b.ptr).unwrap();
    }
    fx.check("every other block freed");
    let from = fx.nccl.log_len();
    let big = fx.a.malloc(256 * MIB, s).expect("enough pages are free");
    assert_eq!(fx.a.stats().reclaims, 1);
    fx.check("the reclaim");
    assert!(
        fx.nccl.log_since(from).iter().any(|c| !c.registered),
        "the reclaim unmapped registered memory, deregistering it first"
    );
    // A lower limit, then a request on another stream: free chunks of the
    // first segment move to the new one.
    model.streams().complete_all();
    fx.a.set_memory_fraction(0.9).unwrap();
    fx.check("fraction 0.9");
    let other = fx.dev.create_stream().unwrap();
    let reclaims = fx.a.stats().reclaims;
    let mut extra = Vec::new();
    for n in [40 * MIB, 8 * MIB, 30 * MIB] {
        match fx.a.malloc(n, other) {
            Ok(b) => extra.push(b),
            Err(e) => assert!(e.is_out_of_memory(), "{e}"),
        }
        fx.check(&format!("malloc({n}) on another stream under 0.9"));
    }
    assert!(
        fx.a.stats().reclaims > reclaims,
        "the other stream reclaimed"
    );
    for b in blocks.iter().skip(1).step_by(2).chain(&extra).chain([&big]) {
        fx.a.free(b.ptr).unwrap();
    }
    fx.check("all freed");
    fx.a.set_memory_fraction(0.2).unwrap();
    fx.check("fraction 0.2");
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    fx.a.set_memory_fraction(1.0).unwrap();
    fx.finish();
}

/// Unpinning: a chunk that a 16 MiB block holds in part is re-backed by an
/// exact chunk at the same address and the rest given back; every
/// registration over it goes first and comes back after.
#[test]
fn unpinning_deregisters_before_it_moves_a_chunk() {
    let fx = Fx::new(sim(GIB), exact());
    fx.follow();
    let s = fx.dev.create_stream().unwrap();
    let live: Vec<_> = (0..6).map(|_| fx.a.malloc(128 * MIB, s).unwrap()).collect();
    let big = fx.a.malloc(128 * MIB, s).unwrap();
    fx.a.free(big.ptr).unwrap();
    let small = fx.a.malloc(16 * MIB, s).unwrap();
    fx.check("pinned");
    let from = fx.nccl.log_len();
    let other = fx.dev.create_stream().unwrap();
    let y = fx.a.malloc(200 * MIB, other).unwrap();
    assert_eq!(fx.a.stats().chunk_unpins, 1);
    fx.check("the unpin");
    let around = changes_in(&fx.nccl, from, small.ptr, small.size);
    assert!(
        around.first().is_some_and(|c| !c.registered)
            && around.last().is_some_and(|c| c.registered),
        "the run under the moved block went and came back: {around:x?}"
    );
    for b in live.iter().chain([&small, &y]) {
        fx.a.free(b.ptr).unwrap();
        fx.check("free");
    }
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    fx.finish();
}

/// Unpinning with real bytes (host, `unpin: always`), several rounds, and
/// spill: a small memory fraction sends chunks to host memory, a larger one
/// and empty_cache bring them back; registrations follow each move.
#[test]
fn unpinning_with_bytes_and_spill_there_and_back() {
    let fx = Fx::new(
        host(512 * MIB),
        ExpandableConfig {
            unpin: UnpinMode::Always,
            ..exact()
        },
    );
    fx.follow();
    let s = fx.dev.create_stream().unwrap();
    let other = fx.dev.create_stream().unwrap();
    let mut live = Vec::new();
    for i in 0..3u64 {
        let b = fx.a.malloc(96 * MIB, s).unwrap();
        let hole = fx.a.malloc(64 * MIB, s).unwrap();
        fx.a.free(hole.ptr).unwrap();
        let pin = fx.a.malloc(8 * MIB, s).unwrap();
        pattern_fill(&*fx.dev, i, pin.ptr, pin.requested).unwrap();
        live.push((i, pin));
        live.push((100 + i, b));
        pattern_fill(&*fx.dev, 100 + i, b.ptr, b.requested).unwrap();
        fx.check("pinned");
    }
    let y = fx.a.malloc(150 * MIB, other).unwrap();
    assert!(fx.a.stats().chunk_unpins > 0, "{:?}", fx.a.stats());
    fx.check("unpins");
    for (k, b) in &live {
        pattern_check(&*fx.dev, *k, b.ptr, b.requested).unwrap();
    }
    for (_, b) in live {
        fx.a.free(b.ptr).unwrap();
    }
    fx.a.free(y.ptr).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    fx.finish();

    // Spill: 128 MiB device, limit 50% (64 MiB), ten 8 MiB blocks.
    let fx = Fx::new(
        host(128 * MIB),
        ExpandableConfig {
            spill: true,
            max_chunk: Some(8 * MIB),
            ..ExpandableConfig::default()
        },
    );
    fx.a.set_memory_fraction(0.5).unwrap();
    fx.follow();
    let blocks: Vec<_> = (0..10)
        .map(|i| {
            let b = fx.a.malloc(8 * MIB - 4096, Stream::DEFAULT).unwrap();
            pattern_fill(&*fx.dev, i, b.ptr, b.requested).unwrap();
            fx.check("malloc under the limit");
            b
        })
        .collect();
    let st = fx.a.stats();
    assert!(st.spilled_bytes > 0 && st.num_spills > 0, "spilled: {st:?}");
    fx.a.free(blocks[0].ptr).unwrap();
    fx.a.free(blocks[5].ptr).unwrap();
    fx.check("frees");
    fx.a.set_memory_fraction(1.0).unwrap();
    let from = fx.nccl.log_len();
    fx.a.empty_cache().unwrap();
    fx.check("migration back");
    let st = fx.a.stats();
    assert_eq!(st.spilled_bytes, 0, "all back on the device");
    assert!(st.spill_migrations > 0);
    assert!(
        fx.nccl.log_since(from).iter().any(|c| !c.registered),
        "migrating moved registered memory"
    );
    for (i, b) in blocks.iter().enumerate() {
        if i != 0 && i != 5 {
            pattern_check(&*fx.dev, i as u64, b.ptr, b.requested).unwrap();
            fx.a.free(b.ptr).unwrap();
        }
    }
    fx.check("all freed");
    fx.finish();
}

/// Spill's migration back when the reclaim that makes room for one host
/// chunk unmaps another host chunk of the same segment (free, freed
/// first): the migration skips the chunk that is gone instead of unmapping
/// an unmapped range (found by the random sequences below: `empty_cache`
/// failed with "range is not fully mapped").
#[test]
fn spill_migration_skips_a_host_chunk_an_earlier_one_reclaimed() {
    let fx = Fx::new(
        sim(64 * MIB),
        ExpandableConfig {
            spill: true,
            max_chunk: Some(8 * MIB),
            ..exact()
        },
    );
    fx.follow();
    let s = Stream::DEFAULT;
    let x1 = fx.a.malloc(32 * MIB, s).unwrap();
    let x2 = fx.a.malloc(32 * MIB, s).unwrap();
    // The device is full: three host chunks, one per block.
    let y = fx.a.malloc(8 * MIB, s).unwrap();
    let z = fx.a.malloc(8 * MIB, s).unwrap();
    let w = fx.a.malloc(8 * MIB, s).unwrap();
    assert_eq!(fx.a.stats().spilled_bytes, 24 * MIB);
    fx.check("spilled");
    // z's host chunk is freed first, so the reclaim for y's takes it.
    fx.a.free(z.ptr).unwrap();
    fx.a.free(x2.ptr).unwrap();
    fx.check("frees");
    fx.a.empty_cache()
        .expect("the migration skips the reclaimed chunk");
    fx.check("empty_cache");
    assert!(fx.a.stats().spilled_bytes < 24 * MIB, "something came back");
    fx.a.empty_cache().unwrap();
    fx.check("a second empty_cache");
    for b in [x1, y, w] {
        fx.a.free(b.ptr).unwrap();
    }
    fx.a.empty_cache().unwrap();
    fx.check("all freed");
    assert_eq!(fx.a.stats().spilled_bytes, 0);
    fx.finish();
}

/// Pause and resume of a tag, with and without backup, while another
/// allocation reuses the memory in between: paused blocks hold no memory
/// (the snapshot reports them as no segment) and nothing of theirs stays
/// registered; resume registers them again.
#[test]
fn pause_and_resume_with_and_without_backup() {
    let tag = "segment-follow-w".to_string();
    let fx = Fx::new(host(256 * MIB), ExpandableConfig::default());
    let keep = fx.a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    let w = tagged(&fx.a, &tag, &[24 * MIB, 3 * MIB + 4096, 1000]);
    for (i, b) in w.iter().enumerate() {
        pattern_fill(&*fx.dev, i as u64, b.ptr, b.requested).unwrap();
    }
    fx.follow();
    let sleep = fx.a.as_sleep().unwrap();
    for backup in [true, false] {
        sleep.pause(std::slice::from_ref(&tag), backup).unwrap();
        fx.check(&format!("pause (backup {backup})"));
        for b in &w {
            assert!(
                fx.nccl
                    .registered()
                    .iter()
                    .all(|s| s.end() <= b.ptr || b.ptr + b.size <= s.addr),
                "a paused block is registered"
            );
        }
        // The freed memory serves others meanwhile.
        let x = fx.a.malloc(150 * MIB, Stream::DEFAULT).unwrap();
        fx.check("malloc while paused");
        fx.a.free(x.ptr).unwrap();
        fx.a.empty_cache().unwrap();
        fx.check("empty_cache while paused");
        sleep.resume(std::slice::from_ref(&tag)).unwrap();
        fx.check(&format!("resume (backup {backup})"));
        if backup {
            for (i, b) in w.iter().enumerate() {
                pattern_check(&*fx.dev, i as u64, b.ptr, b.requested).unwrap();
            }
        }
    }
    for b in w.iter().chain([&keep]) {
        fx.a.free(b.ptr).unwrap();
        fx.check("free");
    }
    fx.finish();
}

/// Private pools: a graph capture into a pool, a MemPool, pause and resume
/// of a pool, its release and empty_cache. Every change over a pool's
/// memory carries the pool's id (PyTorch's hooks register a pool's
/// segments with it); main-pool memory carries `(0, 0)`.
#[test]
fn private_pools_carry_their_id() {
    let fx = Fx::new(sim(GIB), exact());
    fx.follow();
    let pools = fx.a.pools().expect("expandable has pools");
    let s = fx.dev.create_stream().unwrap();
    let graph: PoolId = (0, 7);
    let from = fx.nccl.log_len();
    pools.begin_allocate_to_pool(graph).unwrap();
    fx.dev.inner.begin_capture(s).unwrap();
    let x = pools.pool_malloc(graph, 24 * MIB, s).unwrap();
    let kept = pools.pool_malloc(graph, 8 * MIB, s).unwrap();
    let y = pools.pool_malloc(graph, 24 * MIB, s).unwrap();
    fx.a.free(x.ptr).unwrap();
    fx.a.free(y.ptr).unwrap();
    fx.check("inside the capture");
    pools.end_allocate_to_pool(graph).unwrap();
    fx.dev
        .inner
        .end_capture(s)
        .expect("nothing forbidden during the capture");
    fx.check("after the capture");
    let sent = fx.nccl.log_since(from);
    assert!(!sent.is_empty(), "the pool's memory was registered");
    assert!(
        sent.iter().all(|c| c.pool == graph && c.stream == s),
        "every change over the graph pool carries it: {sent:x?}"
    );
    // A MemPool next to it, and main-pool memory.
    let mem: PoolId = (1, 3);
    pools.create_or_incref_pool(mem).unwrap();
    let from = fx.nccl.log_len();
    let m: Vec<_> = (0..3)
        .map(|_| pools.pool_malloc(mem, 10 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    fx.check("MemPool allocations");
    assert!(fx
        .nccl
        .log_since(from)
        .iter()
        .all(|c| c.pool == mem && c.stream == Stream::DEFAULT));
    let from = fx.nccl.log_len();
    let main = fx.a.malloc(30 * MIB, Stream::DEFAULT).unwrap();
    fx.check("main allocation");
    assert!(fx.nccl.log_since(from).iter().all(|c| c.pool == (0, 0)));
    // Pause the MemPool (no backup), then resume it.
    pools.pause_pool(mem, false).unwrap();
    fx.check("pause_pool");
    assert!(fx.nccl.registered().iter().all(|r| r.pool != mem));
    pools.resume_pool(mem).unwrap();
    fx.check("resume_pool");
    assert!(fx.nccl.registered().iter().any(|r| r.pool == mem));
    // The graph is destroyed: its free pages go at empty_cache.
    pools.release_pool(graph).unwrap();
    let from = fx.nccl.log_len();
    fx.a.empty_cache().unwrap();
    fx.check("release_pool + empty_cache");
    let gone: Vec<_> = fx
        .nccl
        .log_since(from)
        .into_iter()
        .filter(|c| c.pool == graph)
        .collect();
    assert!(
        gone.iter().any(|c| !c.registered),
        "the graph pool's free pages were deregistered: {gone:x?}"
    );
    for b in m.iter().chain([&kept, &main]) {
        fx.a.free(b.ptr).unwrap();
        fx.check("free");
    }
    pools.release_pool(mem).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache at the end");
    assert!(fx.nccl.registered().is_empty());
    fx.finish();
}

/// Growable regions: grown page by page (each growth joins the region's
/// run), shrunk (the run is cut), grown again, destroyed, beside blocks.
#[test]
fn growable_regions_grow_and_shrink() {
    let fx = Fx::new(sim(GIB), ExpandableConfig::default());
    let s = fx.dev.create_stream().unwrap();
    let g = fx.a.as_growable().expect("expandable has growable regions");
    let p = g.growable_create(512 * MIB, s).unwrap();
    g.growable_resize(p, 10 * MIB).unwrap();
    fx.follow();
    let b = fx.a.malloc(20 * MIB, Stream::DEFAULT).unwrap();
    for step in 1..=40u64 {
        g.growable_resize(p, 10 * MIB + step * 2 * MIB).unwrap();
        fx.check(&format!("grow step {step}"));
    }
    let runs: Vec<_> = fx
        .nccl
        .registered()
        .into_iter()
        .filter(|r| r.addr == p)
        .collect();
    assert_eq!(runs.len(), 1, "the region is one segment");
    assert_eq!(
        (runs[0].bytes, runs[0].stream, runs[0].pool),
        (90 * MIB, s, (0, 0))
    );
    g.growable_resize(p, 30 * MIB + 1).unwrap();
    fx.check("shrink");
    g.growable_resize(p, 0).unwrap();
    fx.check("shrink to nothing");
    g.growable_resize(p, 300 * MIB).unwrap();
    fx.check("grow again");
    fx.a.free(b.ptr).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    g.growable_destroy(p).unwrap();
    fx.check("destroy");
    fx.finish();
}

/// IPC re-backing in PyTorch's layout: after fragmentation the chunks under
/// a block are re-backed with equal handles at the same addresses (with
/// room beside them, and without: through host memory); the registrations
/// over them go first and come back.
#[test]
fn ipc_rebacking_moves_registered_chunks() {
    let fx = Fx::new(host(2 * GIB), ExpandableConfig::default());
    fx.follow();
    let s = Stream::DEFAULT;
    let sizes = [3 * MIB, 46 * MIB, 7 * MIB + 5, 130 * MIB, MIB, 64 * MIB];
    let mut live: Vec<(u64, Allocation)> = Vec::new();
    for (i, &n) in sizes.iter().chain(&sizes).enumerate() {
        let b = fx.a.malloc(n + i as u64 * 4096, s).unwrap();
        pattern_fill(&*fx.dev, i as u64, b.ptr, b.requested).unwrap();
        live.push((i as u64, b));
    }
    let mut i = 0;
    live.retain(|(_, b)| {
        i += 1;
        if i % 2 == 0 {
            fx.a.free(b.ptr).unwrap();
        }
        i % 2 == 1
    });
    for (k, &n) in [40 * MIB, 100 * MIB, 2 * MIB + 7].iter().enumerate() {
        let b = fx.a.malloc(n, s).unwrap();
        pattern_fill(&*fx.dev, 50 + k as u64, b.ptr, b.requested).unwrap();
        live.push((50 + k as u64, b));
    }
    fx.check("fragmented");
    let x = fx.a.as_export().unwrap();
    for (_, b) in &live {
        match x.export_equal(b.ptr) {
            Ok(_) => {}
            Err(AllocError::Ipc(m)) if m.contains("already exported") => {}
            Err(e) => panic!("{e}"),
        }
        fx.check(&format!("export_equal({:#x})", b.ptr));
        for (k, b) in &live {
            pattern_check(&*fx.dev, *k, b.ptr, b.requested).unwrap();
        }
    }
    assert!(fx.a.stats().ipc_rebacks > 0, "something was re-backed");
    for (_, b) in &live {
        fx.a.free(b.ptr).unwrap();
    }
    fx.check("freed");
    fx.finish();

    // No room beside the old chunks: through host memory.
    let fx = Fx::new(
        host(256 * MIB),
        ExpandableConfig {
            max_chunk: Some(32 * MIB),
            ..ExpandableConfig::default()
        },
    );
    fx.follow();
    let b = fx.a.malloc(200 * MIB + 5, s).unwrap();
    let rest = fx.a.malloc(40 * MIB, s).unwrap();
    pattern_fill(&*fx.dev, 3, b.ptr, b.requested).unwrap();
    let from = fx.nccl.log_len();
    let r = fx.a.as_export().unwrap().export_equal(b.ptr).unwrap();
    assert!(r.rebacked_bytes >= 200 * MIB);
    fx.check("re-backed through host memory");
    pattern_check(&*fx.dev, 3, b.ptr, b.requested).unwrap();
    assert!(!changes_in(&fx.nccl, from, b.ptr, b.size).is_empty());
    fx.a.free(b.ptr).unwrap();
    fx.a.free(rest.ptr).unwrap();
    fx.check("freed");
    fx.finish();
}

/// A script that maps, unmaps and moves memory: growth on three streams,
/// record_stream, reclaim after a stream wait, an out-of-memory, and
/// empty_cache (the fault-injection script of the expandable tests).
fn fault_script() -> Vec<Op> {
    use Op::*;
    let m = |size, stream| Malloc { size, stream };
    vec![
        m(6 * MIB, 0),
        m(100, 0),
        m(10 * MIB, 1),
        RecordStream { slot: 0, stream: 1 },
        Free { slot: 0 },
        m(2 * MIB, 0),
        Complete { stream: 1 },
        m(1000, 0),
        m(20 * MIB, 1),
        m(16 * MIB, 0),
        Submit { slot: 3 },
        Free { slot: 3 },
        Free { slot: 3 },
        m(30 * MIB, 2),
        m(60 * MIB, 2),
        RecordStream { slot: 1, stream: 2 },
        Free { slot: 1 },
        EmptyCache,
        Free { slot: 0 },
        EmptyCache,
        m(3 * MIB, 1),
    ]
}

/// Runs [`fault_script`] on a 64 MiB `sim` with `plan` from the start,
/// checking after every step; returns the calls of each kind seen.
fn faulty_run(plan: FaultPlan, cfg: ExpandableConfig) -> Result<Vec<(Call, u64)>, String> {
    let inner = FaultInjecting::with_plan(sim(64 * MIB), FaultPlan::None);
    let fx = Fx::new(inner, cfg);
    fx.follow();
    {
        let mut h = Harness::new(&fx.a, &*fx.dev, 3)?;
        h.tolerate_device_errors = true;
        fx.dev.inner.hook().set_plan(plan);
        for (i, op) in fault_script().iter().enumerate() {
            let out = h.apply(op).map_err(|e| format!("step {i} {op:?}: {e}"))?;
            h.check()
                .and_then(|()| fx.try_check())
                .map_err(|e| format!("after step {i} {op:?} ({out:?}): {e}"))?;
        }
        fx.dev.inner.hook().set_plan(FaultPlan::None);
        h.finish()?;
        fx.try_check()?;
    }
    let seen = [
        Call::Create,
        Call::Map,
        Call::SetAccess,
        Call::Unmap,
        Call::Release,
    ]
    .map(|c| (c, fx.dev.inner.hook().seen(c)))
    .to_vec();
    fx.finish();
    Ok(seen)
}

/// A failed map, set_access, unmap, create or release at every position of
/// the script (driver error, then out-of-memory): the failed operation
/// rolls back or goes another way, and the registrations still match the
/// mapping (a failed unmap adds back the run it removed first).
#[test]
fn every_failed_driver_call_keeps_the_registrations_right() {
    for cfg in [
        exact(),
        ExpandableConfig {
            max_chunk: Some(8 * MIB),
            ..exact()
        },
    ] {
        let clean = faulty_run(FaultPlan::None, cfg.clone()).unwrap();
        let mut runs = 0;
        for (call, seen) in clean {
            for n in 1..=seen {
                for kind in [FaultKind::Driver(999), FaultKind::OutOfMemory] {
                    let plan = FaultPlan::Nth { call, n, kind };
                    faulty_run(plan, cfg.clone())
                        .unwrap_or_else(|e| panic!("{call} #{n} fails ({kind:?}): {e}"));
                    runs += 1;
                }
            }
        }
        assert!(runs > 40, "only {runs} runs");
    }
}

/// One failed unmap inside empty_cache: the run removed before it is added
/// back whole, the memory stays mapped, and the next empty_cache removes it.
#[test]
fn a_failed_unmap_adds_the_run_back() {
    let inner = FaultInjecting::with_plan(sim(GIB), FaultPlan::None);
    let fx = Fx::new(inner, exact());
    let x = fx.a.malloc(64 * MIB, Stream::DEFAULT).unwrap();
    let y = fx.a.malloc(32 * MIB, Stream::DEFAULT).unwrap();
    fx.follow();
    fx.a.free(x.ptr).unwrap();
    let hook = fx.dev.inner.hook();
    hook.set_plan(FaultPlan::Nth {
        call: Call::Unmap,
        n: hook.seen(Call::Unmap) + 1,
        kind: FaultKind::Driver(999),
    });
    let from = fx.nccl.log_len();
    let _ = fx.a.empty_cache();
    assert_eq!(hook.injected(), 1);
    fx.check("a failed unmap");
    let sent = fx.nccl.log_since(from);
    assert!(
        sent.len() >= 2
            && !sent[0].registered
            && sent[1].registered
            && sent[0].addr == sent[1].addr,
        "removed, then added back: {sent:x?}"
    );
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache again");
    fx.a.free(y.ptr).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("all given back");
    assert!(fx.nccl.registered().is_empty());
    fx.finish();
}

/// A double fault (`cuMemSetAccess` fails, then the rollback's `cuMemUnmap`
/// too) leaves pages mapped without access ("unready") until access is
/// granted. Nothing is registered over them: the registrations are the
/// accessible runs. The snapshot reports those pages as mapped (`inactive`),
/// so a snapshot taken in this state names a segment that includes them:
/// the one state where the snapshot's segments and the registrations differ
/// (`validate()` does not compare the follower while pages are unready).
/// The next allocation grants access and they agree again.
#[test]
fn a_double_fault_registers_only_accessible_memory() {
    let inner = FaultInjecting::with_plan(sim(GIB), FaultPlan::None);
    let fx = Fx::new(inner, exact());
    fx.follow();
    let keep = fx.a.malloc(8 * MIB, Stream::DEFAULT).unwrap();
    fx.check("one block");
    fx.dev.inner.hook().set_plan(FaultPlan::Random {
        calls: vec![Call::SetAccess, Call::Unmap],
        p: 1.0,
        seed: 1,
        kind: FaultKind::Driver(999),
    });
    assert!(fx.a.malloc(4 * MIB, Stream::DEFAULT).is_err());
    fx.dev.inner.hook().set_plan(FaultPlan::None);
    // What holds while pages are unready.
    assert!(
        fx.nccl.violations().is_empty(),
        "{:#?}",
        fx.nccl.violations()
    );
    fx.a.validate().unwrap();
    let registered = fx.nccl.registered();
    let followed: Vec<Seg> =
        fx.a.as_segment_follow()
            .unwrap()
            .followed_segments()
            .iter()
            .map(Seg::from)
            .collect();
    same("registered and followed segments", &registered, &followed).unwrap();
    let model = fx.dev.introspect().unwrap();
    let page = fx.a.page_size();
    let runs = snapshot_runs(&fx.a.snapshot());
    assert_ne!(runs, registered, "the snapshot counts the unready pages");
    for r in &runs {
        let mut p = r.addr;
        while p < r.end() {
            let in_reg = registered.iter().any(|s| s.addr <= p && p < s.end());
            assert_eq!(
                in_reg,
                model.is_accessible(p, page),
                "page {p:#x} of snapshot segment {r:x?}: registered iff accessible"
            );
            p += page;
        }
    }
    // Access is granted to them by the next allocation: all agree again.
    let x = fx.a.malloc(4 * MIB, Stream::DEFAULT).unwrap();
    fx.check("access granted");
    fx.a.free(x.ptr).unwrap();
    fx.a.free(keep.ptr).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    fx.finish();
}

/// The fake NCCL and the strict device refuse what they must: a second
/// registration at an address, an overlap, memory not accessible, a
/// deregistration of an unknown address or with another size, an unmap of
/// registered memory (so that the tests above can pass only if the
/// follower is right).
#[test]
fn the_fake_nccl_refuses_what_nccl_refuses() {
    let nccl = Arc::new(FakeNccl::default());
    let dev = Strict {
        inner: sim(GIB),
        nccl: nccl.clone(),
    };
    let base = dev.reserve(64 * MIB, 0).unwrap();
    let h = dev.create(16 * MIB).unwrap();
    dev.map(base, 16 * MIB, h).unwrap();
    let seg = |addr, bytes| Seg {
        addr,
        bytes,
        stream: Stream::DEFAULT,
        pool: (0, 0),
    };
    let refusals = |n: usize| {
        let v = nccl.violations();
        assert_eq!(v.len(), n, "{v:#?}");
    };
    // Mapped but not accessible yet.
    nccl.register_snapshot(&[seg(base, 16 * MIB)]);
    refusals(1);
    dev.set_access(base, 16 * MIB).unwrap();
    nccl.register_snapshot(&[seg(base, 8 * MIB)]);
    refusals(1);
    nccl.register_snapshot(&[seg(base, 8 * MIB)]); // the same address again
    refusals(2);
    nccl.register_snapshot(&[seg(base + 4 * MIB, 8 * MIB)]); // overlaps
    refusals(3);
    nccl.register_snapshot(&[seg(base + 8 * MIB, 16 * MIB)]); // runs past the mapping
    refusals(4);
    let change = |registered, addr, bytes| SegmentChange {
        registered,
        addr,
        bytes,
        stream: Stream::DEFAULT,
        pool: (0, 0),
    };
    nccl.change(&change(false, base + 2 * MIB, 2 * MIB)); // not registered
    refusals(5);
    dev.unmap(base, 16 * MIB).unwrap(); // registered memory unmapped
    refusals(6);
    nccl.change(&change(false, base, 4 * MIB)); // another size
    refusals(7);
    assert!(nccl.registered().is_empty());
    // Unmapped: no access any more.
    nccl.change(&change(true, base, 8 * MIB));
    refusals(8);
    dev.release(h).unwrap();
    dev.free_reservation(base, 64 * MIB).unwrap();
}

/// Stopping: no change is sent while stopped, whatever is mapped or
/// unmapped; restarting takes what is mapped then (from the snapshot) as
/// registered, and from there on every change is right again.
#[test]
fn stop_and_restart() {
    let fx = Fx::new(sim(GIB), exact());
    fx.follow();
    let s = fx.dev.create_stream().unwrap();
    let a1 = fx.a.malloc(64 * MIB, s).unwrap();
    let a2 = fx.a.malloc(5 * MIB, Stream::DEFAULT).unwrap();
    fx.check("following");
    assert!(fx.changes().0 > 0);
    fx.unfollow();
    let quiet = fx.nccl.log_len();
    let b1 = fx.a.malloc(100 * MIB, s).unwrap();
    fx.a.free(a1.ptr).unwrap();
    fx.a.empty_cache().unwrap();
    let b2 = fx.a.malloc(7 * MIB, s).unwrap();
    fx.check("stopped");
    assert_eq!(fx.nccl.log_len(), quiet, "nothing sent while stopped");
    let seeded = fx.follow();
    assert_eq!(fx.changes(), (0, 0), "counted afresh");
    assert!(seeded.iter().any(|r| r.addr <= b1.ptr && b1.ptr < r.end()));
    for b in [b1, a2, b2] {
        fx.a.free(b.ptr).unwrap();
        fx.check("free");
    }
    fx.a.empty_cache().unwrap();
    fx.check("empty_cache");
    assert!(fx.nccl.registered().is_empty());
    // A second stop and start with nothing mapped.
    fx.unfollow();
    fx.follow();
    let c = fx.a.malloc(MIB, s).unwrap();
    fx.check("after the second restart");
    fx.a.free(c.ptr).unwrap();
    fx.finish();
}

/// The bound of `follow.rs`: at most three changes per driver map or unmap
/// over a mixed workload (reclaim, empty_cache, record_stream, three
/// streams), and none at all over cache hits.
#[test]
fn changes_are_bounded_by_driver_calls_and_cache_hits_send_none() {
    let fx = Fx::new(sim(512 * MIB), ExpandableConfig::default());
    fx.follow();
    let maps_unmaps = |fx: &Fx<Arc<SimDevice>>| {
        let c = fx.a.stats().driver_calls;
        c.get(Call::Map) + c.get(Call::Unmap)
    };
    let calls0 = maps_unmaps(&fx);
    let ops = RandomOps::new(43, OpMix::default()).take(600);
    {
        let mut h = Harness::new(&fx.a, &*fx.dev, 3).unwrap();
        for (i, op) in ops.iter().enumerate() {
            h.apply(op).unwrap();
            if i % 10 == 0 {
                h.check().unwrap();
                fx.check(&format!("step {i} {op:?}"));
            }
        }
        h.finish().unwrap();
    }
    fx.a.empty_cache().unwrap();
    fx.check("the workload");
    let (added, removed) = fx.changes();
    let calls = maps_unmaps(&fx) - calls0;
    let ratio = (added + removed) as f64 / calls as f64;
    eprintln!(
        "segment changes: {added} added + {removed} removed = {} for {calls} driver maps + \
         unmaps: {ratio:.2} per call",
        added + removed
    );
    assert!(calls > 50, "the workload maps and unmaps: {calls}");
    assert!(
        added + removed <= 3 * calls,
        "{} changes for {calls} maps and unmaps",
        added + removed
    );
    // Cache hits: same-size malloc / free after a warm-up.
    let warm: Vec<_> = [MIB, 300, 20 * MIB]
        .iter()
        .map(|&n| fx.a.malloc(n, Stream::DEFAULT).unwrap())
        .collect();
    for b in &warm {
        fx.a.free(b.ptr).unwrap();
    }
    let (before, calls_before) = (fx.changes(), maps_unmaps(&fx));
    for _ in 0..500 {
        for n in [MIB, 300, 20 * MIB] {
            let b = fx.a.malloc(n, Stream::DEFAULT).unwrap();
            fx.a.free(b.ptr).unwrap();
        }
    }
    assert_eq!(
        maps_unmaps(&fx),
        calls_before,
        "cache hits make no driver call"
    );
    assert_eq!(fx.changes(), before, "cache hits send no change");
    fx.check("cache hits");
    fx.finish();
}

// --- Random sequences ---------------------------------------------------------------

/// One step of a random sequence.
#[derive(Debug, Clone)]
enum Step {
    /// A harness op (malloc, free, record_stream, queued work, empty_cache).
    Op(Op),
    /// `set_memory_fraction`.
    Fraction(f64),
    /// Stop following, or start again.
    Toggle,
}

/// A random step.
fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => (size(64 * MIB), 0..3usize)
            .prop_map(|(size, stream)| Step::Op(Op::Malloc { size, stream })),
        6 => any::<usize>().prop_map(|slot| Step::Op(Op::Free { slot })),
        1 => (any::<usize>(), 0..3usize)
            .prop_map(|(slot, stream)| Step::Op(Op::RecordStream { slot, stream })),
        1 => any::<usize>().prop_map(|slot| Step::Op(Op::Submit { slot })),
        2 => (0..3usize).prop_map(|stream| Step::Op(Op::Complete { stream })),
        2 => Just(Step::Op(Op::EmptyCache)),
        2 => prop_oneof![Just(0.25), Just(0.5), Just(0.8), Just(1.0)].prop_map(Step::Fraction),
        1 => Just(Step::Toggle),
    ]
}

/// The options a random sequence runs under.
fn config(i: usize) -> ExpandableConfig {
    match i {
        0 => ExpandableConfig::default(),
        1 => exact(),
        2 => ExpandableConfig {
            max_chunk: Some(8 * MIB),
            split_threshold: 0.4,
            unpin: UnpinMode::Always,
            ..exact()
        },
        _ => ExpandableConfig {
            spill: true,
            max_chunk: Some(8 * MIB),
            ..ExpandableConfig::default()
        },
    }
}

/// Runs `steps` on a 256 MiB `sim` under `config(cfg)` with the strict
/// fake NCCL, checking after every step.
fn run_random(cfg: usize, steps: &[Step]) -> Result<(), TestCaseError> {
    let fx = Fx::new(sim(256 * MIB), config(cfg));
    fx.follow();
    {
        let mut h = Harness::new(&fx.a, &*fx.dev, 3).map_err(TestCaseError::fail)?;
        for (i, s) in steps.iter().enumerate() {
            match s {
                Step::Op(op) => {
                    let out = h
                        .apply(op)
                        .map_err(|e| TestCaseError::fail(format!("step {i} {s:?}: {e}")))?;
                    if let Outcome::DeviceError(e) = out {
                        return Err(TestCaseError::fail(format!("step {i}: {e}")));
                    }
                }
                // Lowering the limit below what is held gives back what it
                // can; either way the state must stay consistent.
                Step::Fraction(f) => {
                    let _ = fx.a.set_memory_fraction(*f);
                }
                Step::Toggle if fx.following.get() => fx.unfollow(),
                Step::Toggle => {
                    fx.follow();
                }
            }
            h.check()
                .and_then(|()| fx.try_check())
                .map_err(|e| TestCaseError::fail(format!("after step {i} {s:?}: {e}")))?;
        }
        h.finish().map_err(TestCaseError::fail)?;
        fx.try_check().map_err(TestCaseError::fail)?;
    }
    fx.finish();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random malloc / free / record_stream / empty_cache /
    /// set_memory_fraction / stop-start sequences under four option sets:
    /// the strict fake NCCL never refuses, and its registrations always
    /// equal the follower's runs and the snapshot's segments.
    #[test]
    fn random_sequences_keep_nccl_registrations_exact(
        cfg in 0..4usize,
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        run_random(cfg, &steps)?;
    }
}

/// A registered run that is joined (a segment grows next to it) or split
/// (part of it unmapped) is removed while part of it stays mapped, and work
/// in flight may still use that registration: the device is synchronized
/// first — but not during a graph capture, which a synchronize would
/// invalidate (the strict `sim` device refuses one then). Not following,
/// nothing is synchronized.
#[test]
fn joins_and_splits_synchronize_the_device_first_but_never_in_a_capture() {
    let grow = |follow: bool| {
        let fx = Fx::new(sim(GIB), ExpandableConfig::default());
        if follow {
            fx.follow();
        }
        let syncs = || fx.a.stats().driver_calls.get(Call::DeviceSync);
        let a = fx.a.malloc(8 * MIB, Stream(0)).unwrap();
        let before = syncs();
        // Grows the segment's mapped run: a join while following.
        let b = fx.a.malloc(40 * MIB, Stream(0)).unwrap();
        fx.check("grown");
        let grown = syncs() - before;
        fx.a.free(a.ptr).unwrap();
        fx.a.free(b.ptr).unwrap();
        fx.a.empty_cache().unwrap();
        fx.check("emptied");
        grown
    };
    assert_eq!(grow(false), 0, "not following: no synchronize");
    assert!(grow(true) >= 1, "following: a join synchronizes first");

    // During a capture into a graph pool: the pool's run grows without one.
    let fx = Fx::new(sim(GIB), ExpandableConfig::default());
    fx.follow();
    let pools = fx.a.pools().expect("expandable has pools");
    let s = fx.dev.create_stream().unwrap();
    let graph: PoolId = (0, 3);
    pools.begin_allocate_to_pool(graph).unwrap();
    fx.dev.inner.begin_capture(s).unwrap();
    let x = pools.pool_malloc(graph, 8 * MIB, s).unwrap();
    let before = fx.a.stats().driver_calls.get(Call::DeviceSync);
    let y = pools.pool_malloc(graph, 40 * MIB, s).unwrap();
    assert_eq!(
        fx.a.stats().driver_calls.get(Call::DeviceSync),
        before,
        "no synchronize during a capture"
    );
    fx.check("grown inside the capture");
    pools.end_allocate_to_pool(graph).unwrap();
    fx.dev.inner.end_capture(s).unwrap();
    fx.a.free(x.ptr).unwrap();
    fx.a.free(y.ptr).unwrap();
    pools.release_pool(graph).unwrap();
    fx.a.empty_cache().unwrap();
    fx.check("released");
}
