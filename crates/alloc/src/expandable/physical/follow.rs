//! The segment follower (issue 43): an [`Observer`] that keeps the runs of
//! mapped, accessible pages of every table (segment or growable region) and
//! tells a [`SegmentSink`] each run that appears and each that is about to
//! change or go — what NCCL user-buffer registration needs. ProcessGroupNCCL's
//! register hook calls `ncclCommRegister(addr, size)` for each
//! `SEGMENT_ALLOC` trace entry and `ncclCommDeregister` for the handle
//! registered at exactly that address at its `SEGMENT_FREE`
//! (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp,
//! `cacheAllocatorRegisterHook` / `cacheAllocatorDeregisterHook`;
//! NCCLUtils.cpp `NCCLComm::deregisterSegment` refuses an address it did not
//! register), and `register_mem_pool` / `initNCCLComm` register the segments
//! `snapshot()` reports. So a run here is exactly one segment as the
//! snapshot readers report it (a contiguous run of mapped pages of one
//! table), and:
//!
//! - a run is **added** after its pages were mapped and made accessible
//!   (`cuMemSetAccess` succeeded): a new run, or the union of the new pages
//!   with the runs they touch, which are removed first;
//! - every run that overlaps an unmap is **removed before** `cuMemUnmap` is
//!   called (`before`), and what is left of it is added again after (all of
//!   it, if the unmap failed). Unpinning, spill and its return, pause and
//!   resume, IPC re-backing and empty_cache all unmap through the one
//!   `raw_unmap`, so every move is "remove, move, add": no registration is
//!   ever left over memory that is unmapped or remapped.
//!
//! A run that stays partly mapped while it is removed and added again (a
//! join, a split) may be in use by work in flight — a collective reading it
//! under the old registration, on this GPU or a peer's. So the physical
//! layer synchronizes the device before such a change (`joins`, `splits`;
//! `calls.rs`), as PyTorch's own segment free does (`cudaFree` waits for the
//! device), and NCCL never sees a live registration go while it is used —
//! except during a graph capture, which a synchronize would invalidate: then
//! the change is made without one (counted in `unsynced`; work captured has
//! not run yet, but work on streams outside the capture may be in flight).
//!
//! Cost: nothing unless following (the observer is attached on first use
//! and checks one flag); while following, per driver map or unmap at most
//! two removals and one addition (a map joining two runs) or one removal and
//! two additions (an unmap splitting one) — never on a cache hit, so the
//! registrations a busy allocator makes are bounded by its driver calls.

use super::observe::{Observer, Owner, PhysEvent};
use crate::{SegmentChange, SegmentSink};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use vmmalloc_device::{Call, Stream};

/// Whose a table's memory is: reported with each change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tag {
    /// The stream of the segment or region.
    pub stream: Stream,
    /// Its private pool (`(0, 0)`: the default pool).
    pub pool: (u64, u64),
}

impl Tag {
    /// A growable region's tag: its stream, the default pool.
    pub fn region(stream: Stream) -> Tag {
        Tag {
            stream,
            pool: (0, 0),
        }
    }
}

/// One known run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// One past its last byte.
    end: u64,
    /// The table it lies in.
    owner: Owner,
}

/// What the follower knows, shared between the observer (inside the
/// physical layer) and the allocator (which starts and stops following and
/// checks it in `validate()`); both touch it only under the allocator's lock.
#[derive(Default)]
pub(crate) struct FollowState {
    /// Where changes go; `None`: not following (nothing is kept).
    sink: Option<Arc<dyn SegmentSink>>,
    /// Known runs by first byte.
    runs: BTreeMap<u64, Run>,
    /// The tag of each table.
    tags: HashMap<Owner, Tag>,
    /// Runs removed before the unmap in flight, to add back what is left.
    held: Vec<(u64, Run)>,
    /// Changes sent: added, removed.
    added: u64,
    removed: u64,
    /// Device synchronizes made before a join or a split (kept across
    /// starts: `validate()` accounts for every device-wide synchronize).
    pub syncs: u64,
    /// Joins and splits made without one, during a graph capture.
    pub unsynced: u64,
}

impl std::fmt::Debug for FollowState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FollowState")
            .field("following", &self.sink.is_some())
            .field("runs", &self.runs)
            .field("added", &self.added)
            .field("removed", &self.removed)
            .finish()
    }
}

impl FollowState {
    /// Whether changes are being sent.
    pub fn following(&self) -> bool {
        self.sink.is_some()
    }

    /// Starts following with `sink`, taking `runs` (`(owner, first byte,
    /// bytes)`) as already known and `tags` as the tables' tags; sends
    /// nothing for them.
    pub fn start(
        &mut self,
        sink: Arc<dyn SegmentSink>,
        runs: Vec<(Owner, u64, u64)>,
        tags: HashMap<Owner, Tag>,
    ) {
        self.sink = Some(sink);
        self.runs = runs
            .into_iter()
            .map(|(owner, addr, bytes)| {
                (
                    addr,
                    Run {
                        end: addr + bytes,
                        owner,
                    },
                )
            })
            .collect();
        self.tags = tags;
        self.held.clear();
        self.added = 0;
        self.removed = 0;
    }

    /// Stops following: forgets every run, sends nothing.
    pub fn stop(&mut self) {
        self.sink = None;
        self.runs.clear();
        self.tags.clear();
        self.held.clear();
    }

    /// Notes the tag of a table opened while following.
    pub fn tag(&mut self, owner: Owner, tag: Tag) {
        if self.following() {
            self.tags.insert(owner, tag);
        }
    }

    /// Forgets a table that is gone.
    pub fn untag(&mut self, owner: Owner) {
        self.tags.remove(&owner);
    }

    /// The known runs as additions, by address.
    pub fn known(&self) -> Vec<SegmentChange> {
        self.runs
            .iter()
            .map(|(&a, r)| self.change(true, a, r))
            .collect()
    }

    /// Changes sent: (added, removed).
    pub fn counts(&self) -> (u64, u64) {
        (self.added, self.removed)
    }

    /// Checks the known runs against `expected` (`(owner, first byte,
    /// bytes)`, the tables' mapped, accessible runs by address).
    pub fn check(&self, expected: &[(Owner, u64, u64)]) -> Result<(), String> {
        if !self.following() {
            return Ok(());
        }
        if !self.held.is_empty() {
            return Err(format!(
                "segment follower: {} runs held between operations",
                self.held.len()
            ));
        }
        let known: Vec<(Owner, u64, u64)> = self
            .runs
            .iter()
            .map(|(&a, r)| (r.owner, a, r.end - a))
            .collect();
        if known != expected {
            let first = known
                .iter()
                .zip(expected)
                .find(|(k, e)| k != e)
                .map(|(k, e)| format!("known {k:x?}, mapped {e:x?}"))
                .unwrap_or_else(|| {
                    format!("{} runs known, {} mapped", known.len(), expected.len())
                });
            return Err(format!(
                "segment follower: the registered runs differ from the mapped ones ({first})"
            ));
        }
        Ok(())
    }

    /// Whether making `[a, b)` of `owner` accessible would join known runs,
    /// which are then removed and added again as one: memory that stays
    /// mapped, and that work in flight (a collective) may still use under
    /// the old registration.
    pub fn joins(&self, owner: Owner, a: u64, b: u64) -> bool {
        self.following()
            && !self.inside_one_run(owner, a, b)
            && self.runs_at(owner, a, b, true).next().is_some()
    }

    /// Whether `[a, b)` lies inside one known run of `owner` (access given
    /// again there changes nothing).
    fn inside_one_run(&self, owner: Owner, a: u64, b: u64) -> bool {
        self.runs
            .range(..=a)
            .next_back()
            .is_some_and(|(_, r)| r.owner == owner && r.end >= b)
    }

    /// Whether unmapping `[a, b)` of `owner` would leave part of a known run
    /// mapped (removed before the unmap, its rest added again after).
    pub fn splits(&self, owner: Owner, a: u64, b: u64) -> bool {
        self.following()
            && self
                .runs_at(owner, a, b, false)
                .any(|(s, r)| s < a || r.end > b)
    }

    /// The known runs of `owner` overlapping `[a, b)`, or touching it when
    /// `touching`, from the highest address down. Runs are disjoint and
    /// sorted: the candidates start below `b` (at `b` when touching) and end
    /// after `a`.
    fn runs_at(
        &self,
        owner: Owner,
        a: u64,
        b: u64,
        touching: bool,
    ) -> impl Iterator<Item = (u64, Run)> + '_ {
        self.runs
            .range(..=b)
            .rev()
            .take_while(move |(_, r)| r.end >= a)
            .filter(move |(&s, r)| {
                r.owner == owner
                    && if touching {
                        s <= b && r.end >= a
                    } else {
                        s < b && r.end > a
                    }
            })
            .map(|(&s, r)| (s, *r))
    }

    fn change(&self, registered: bool, addr: u64, r: &Run) -> SegmentChange {
        let tag = self.tags.get(&r.owner).copied().unwrap_or_default();
        SegmentChange {
            registered,
            addr,
            bytes: r.end - addr,
            stream: tag.stream,
            pool: tag.pool,
        }
    }

    fn send(&mut self, registered: bool, addr: u64, r: &Run) {
        let c = self.change(registered, addr, r);
        if registered {
            self.added += 1;
        } else {
            self.removed += 1;
        }
        if let Some(s) = &self.sink {
            s.change(&c);
        }
    }

    /// Removes (and reports) every run of `owner` overlapping `[a, b)`, or
    /// touching it when `touching`; returns them.
    fn take_runs(&mut self, owner: Owner, a: u64, b: u64, touching: bool) -> Vec<(u64, Run)> {
        let mut found: Vec<(u64, Run)> = self.runs_at(owner, a, b, touching).collect();
        found.reverse(); // ascending
        for (s, r) in &found {
            self.runs.remove(s);
            self.send(false, *s, r);
        }
        found
    }

    fn add(&mut self, addr: u64, r: Run) {
        self.runs.insert(addr, r);
        self.send(true, addr, &r);
    }

    /// `[a, b)` of `owner` became accessible: join it with the runs it
    /// touches.
    fn accessible(&mut self, owner: Owner, a: u64, b: u64) {
        // Already known as one run (access given again): nothing changes.
        if self.inside_one_run(owner, a, b) {
            return;
        }
        let joined = self.take_runs(owner, a, b, true);
        let start = joined.iter().map(|j| j.0).fold(a, u64::min);
        let end = joined.iter().map(|j| j.1.end).fold(b, u64::max);
        self.add(start, Run { end, owner });
    }

    /// `[a, b)` of `owner` is about to be unmapped.
    fn unmapping(&mut self, owner: Owner, a: u64, b: u64) {
        let taken = self.take_runs(owner, a, b, false);
        self.held.extend(taken);
    }

    /// The unmap of `[a, b)` returned: add back what is left of the runs
    /// removed before it (all of them if it failed).
    fn unmapped(&mut self, a: u64, b: u64, ok: bool) {
        for (s, r) in std::mem::take(&mut self.held) {
            if !ok {
                self.add(s, r);
                continue;
            }
            if s < a {
                self.add(s, Run { end: a, ..r });
            }
            if r.end > b {
                self.add(b, r);
            }
        }
    }
}

/// The observer half, attached to the physical layer on first use.
#[derive(Debug)]
pub(crate) struct Follower(pub Arc<parking_lot::Mutex<FollowState>>);

impl Observer for Follower {
    fn before(&mut self, ev: &PhysEvent) {
        if ev.call == Call::Unmap && ev.owner.is_table() {
            let mut st = self.0.lock();
            if st.following() {
                st.unmapping(ev.owner, ev.addr, ev.addr + ev.bytes);
            }
        }
    }

    fn observe(&mut self, ev: &PhysEvent) {
        if !ev.owner.is_table() {
            return;
        }
        match ev.call {
            Call::SetAccess if ev.ok => {
                let mut st = self.0.lock();
                if st.following() {
                    st.accessible(ev.owner, ev.addr, ev.addr + ev.bytes);
                }
            }
            Call::Unmap => {
                let mut st = self.0.lock();
                if !st.held.is_empty() {
                    st.unmapped(ev.addr, ev.addr + ev.bytes, ev.ok);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Log(parking_lot::Mutex<Vec<(bool, u64, u64)>>);
    impl SegmentSink for Log {
        fn change(&self, c: &SegmentChange) {
            self.0.lock().push((c.registered, c.addr, c.bytes));
        }
    }

    fn ev(call: Call, owner: Owner, a: u64, n: u64, ok: bool) -> PhysEvent {
        PhysEvent {
            ok,
            ..PhysEvent::new(call, owner).at(a, n)
        }
    }

    fn setup() -> (Arc<Log>, Follower) {
        let log = Arc::new(Log::default());
        let st = Arc::new(parking_lot::Mutex::new(FollowState::default()));
        st.lock().start(log.clone(), vec![], HashMap::new());
        (log, Follower(st))
    }

    const S: Owner = Owner::Segment(0);

    #[test]
    fn runs_join_on_access_and_split_around_an_unmap_removed_first() {
        let (log, mut f) = setup();
        f.observe(&ev(Call::SetAccess, S, 0x100, 0x100, true));
        f.observe(&ev(Call::SetAccess, S, 0x300, 0x100, true));
        // The gap: joins both neighbours into one run.
        f.observe(&ev(Call::SetAccess, S, 0x200, 0x100, true));
        assert_eq!(
            std::mem::take(&mut *log.0.lock()),
            vec![
                (true, 0x100, 0x100),
                (true, 0x300, 0x100),
                (false, 0x100, 0x100),
                (false, 0x300, 0x100),
                (true, 0x100, 0x300),
            ]
        );
        // Access given again inside a known run: nothing.
        f.observe(&ev(Call::SetAccess, S, 0x180, 0x80, true));
        assert!(log.0.lock().is_empty());
        // An unmap in the middle: removed before, the two sides after.
        f.before(&ev(Call::Unmap, S, 0x200, 0x100, false));
        assert_eq!(*log.0.lock(), vec![(false, 0x100, 0x300)]);
        f.observe(&ev(Call::Unmap, S, 0x200, 0x100, true));
        assert_eq!(
            log.0.lock()[1..],
            [(true, 0x100, 0x100), (true, 0x300, 0x100)]
        );
        let st = f.0.lock();
        st.check(&[(S, 0x100, 0x100), (S, 0x300, 0x100)]).unwrap();
        assert_eq!(st.counts(), (5, 3));
    }

    #[test]
    fn a_failed_unmap_adds_the_run_back_whole_and_other_tables_are_apart() {
        let (log, mut f) = setup();
        let r = Owner::Region(0x1000);
        f.observe(&ev(Call::SetAccess, S, 0x100, 0x100, true));
        // Touching in address space but another table: not joined.
        f.observe(&ev(Call::SetAccess, r, 0x200, 0x100, true));
        f.before(&ev(Call::Unmap, S, 0x100, 0x100, false));
        f.observe(&ev(Call::Unmap, S, 0x100, 0x100, false));
        assert_eq!(
            *log.0.lock(),
            vec![
                (true, 0x100, 0x100),
                (true, 0x200, 0x100),
                (false, 0x100, 0x100),
                (true, 0x100, 0x100),
            ]
        );
        f.0.lock()
            .check(&[(S, 0x100, 0x100), (r, 0x200, 0x100)])
            .unwrap();
        assert!(f.0.lock().check(&[(S, 0x100, 0x100)]).is_err());
    }

    /// A join or a split (a run removed while part of it stays mapped) is
    /// told apart from a new run or a whole run's unmap: the physical layer
    /// synchronizes the device first for the former only.
    #[test]
    fn joins_and_splits_are_told_apart_from_new_and_whole_runs() {
        let (_log, mut f) = setup();
        f.observe(&ev(Call::SetAccess, S, 0x100, 0x100, true));
        let st = f.0.lock();
        assert!(st.joins(S, 0x200, 0x300), "touching: joined");
        assert!(!st.joins(S, 0x280, 0x300), "apart: a new run");
        assert!(!st.joins(S, 0x100, 0x180), "inside: nothing changes");
        assert!(!st.joins(Owner::Segment(1), 0x200, 0x300), "another table");
        assert!(st.splits(S, 0x100, 0x180), "part of it stays");
        assert!(!st.splits(S, 0x100, 0x200), "all of it goes");
        assert!(!st.splits(S, 0x200, 0x300), "not overlapping");
        drop(st);
        f.0.lock().stop();
        assert!(!f.0.lock().joins(S, 0x200, 0x300), "not following");
    }

    #[test]
    fn nothing_is_kept_or_sent_unless_following() {
        let log = Arc::new(Log::default());
        let st = Arc::new(parking_lot::Mutex::new(FollowState::default()));
        let mut f = Follower(st.clone());
        f.observe(&ev(Call::SetAccess, S, 0x100, 0x100, true));
        f.before(&ev(Call::Unmap, S, 0x100, 0x100, false));
        f.observe(&ev(Call::Unmap, S, 0x100, 0x100, true));
        assert!(log.0.lock().is_empty());
        assert!(st.lock().known().is_empty());
        st.lock()
            .start(log.clone(), vec![(S, 0x100, 0x100)], HashMap::new());
        // A seeded run is removed like any other before its unmap.
        f.before(&ev(Call::Unmap, S, 0x100, 0x100, false));
        f.observe(&ev(Call::Unmap, S, 0x100, 0x100, true));
        assert_eq!(*log.0.lock(), vec![(false, 0x100, 0x100)]);
        st.lock().stop();
        assert!(st.lock().known().is_empty());
    }
}
