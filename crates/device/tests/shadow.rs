//! Random sequences of VMM calls on `sim` against a tiny independent shadow
//! model (in the spirit of rlsf's `ShadowAllocator`): every call must succeed
//! or fail exactly as the shadow predicts, and after every step the device's
//! own invariants hold and its live objects, free memory and accessibility
//! equal the shadow's.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, DeviceError, Introspect, PhysHandle, Rule, Stream, MIB};

const G: u64 = 2 * MIB;
const CAPACITY: u64 = 16 * G;

/// What a call should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Ok,
    Rule(Rule),
    Oom,
}

/// Records `got` in `seen` and compares it with `want`.
fn check(
    seen: &mut BTreeSet<String>,
    what: String,
    want: Expect,
    got: Expect,
) -> Result<(), String> {
    seen.insert(format!("{got:?}"));
    if want == got {
        Ok(())
    } else {
        Err(format!(
            "{what}: shadow expects {want:?}, device gave {got:?}"
        ))
    }
}

fn outcome<T>(r: &Result<T, DeviceError>) -> Expect {
    match r {
        Ok(_) => Expect::Ok,
        Err(e) if e.is_out_of_memory() => Expect::Oom,
        Err(e) => e
            .broken_rule()
            .map_or_else(|| panic!("unexpected error {e}"), Expect::Rule),
    }
}

/// A range picked relative to a reservation seen so far (live or freed).
#[derive(Debug, Clone, Copy)]
struct Where {
    res: usize,
    /// Offset in granules (may run past the end).
    offset: u64,
    /// Add half a granule to the address (misaligned).
    skew: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(u64),
    /// Free a reservation seen so far; `delta` granules added to its size.
    FreeReservation(usize, i64),
    Create(u64),
    Release(usize),
    /// Map a handle seen so far; `size` in granules, `None` = the handle's size.
    Map(Where, usize, Option<u64>),
    SetAccess(Where, u64),
    Unmap(Where, u64),
    /// Unmap exactly one of the shadow's mappings (so unmaps often succeed or
    /// meet queued work).
    UnmapExisting(usize),
    /// Queue work on the stream that uses the range.
    Submit(Where, u64),
    Sync,
}

fn place() -> impl Strategy<Value = Where> {
    (0usize..8, 0u64..6, prop::bool::weighted(0.05)).prop_map(|(res, offset, skew)| Where {
        res,
        offset,
        skew,
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1u64..6).prop_map(Op::Reserve),
        1 => (0usize..8, prop_oneof![4 => Just(0i64), 1 => Just(-1i64), 1 => Just(1i64)])
            .prop_map(|(i, d)| Op::FreeReservation(i, d)),
        3 => (1u64..5).prop_map(Op::Create),
        2 => (0usize..12).prop_map(Op::Release),
        5 => (place(), 0usize..12, prop::option::weighted(0.15, 1u64..4)).prop_map(|(w, h, s)| Op::Map(w, h, s)),
        3 => (place(), 1u64..4).prop_map(|(w, n)| Op::SetAccess(w, n)),
        3 => (place(), 1u64..4).prop_map(|(w, n)| Op::Unmap(w, n)),
        2 => (0usize..8).prop_map(Op::UnmapExisting),
        2 => (place(), 1u64..3).prop_map(|(w, n)| Op::Submit(w, n)),
        1 => Just(Op::Sync),
    ]
}

#[derive(Debug, Clone, Copy)]
struct ShadowMap {
    size: u64,
    alloc: u64,
    accessible: bool,
}

/// The shadow: the driver's rules, written as plainly as possible.
#[derive(Debug, Default)]
struct Shadow {
    reservations: BTreeMap<u64, u64>,
    reservations_seen: Vec<(u64, u64)>,
    handles: HashMap<PhysHandle, u64>,
    handles_seen: Vec<PhysHandle>,
    /// allocation -> (size, handles + mappings)
    allocs: HashMap<u64, (u64, u32)>,
    next_alloc: u64,
    maps: BTreeMap<u64, ShadowMap>,
    pending: Vec<(u64, u64)>,
    used: u64,
    /// Every outcome seen (to show the generator reaches every rule).
    seen: BTreeSet<String>,
}

impl Shadow {
    fn addr(&self, w: Where) -> u64 {
        let base = if self.reservations_seen.is_empty() {
            0x10 * G
        } else {
            self.reservations_seen[w.res % self.reservations_seen.len()].0
        };
        base + w.offset * G + if w.skew { G / 2 } else { 0 }
    }

    fn handle(&self, i: usize) -> PhysHandle {
        if self.handles_seen.is_empty() {
            PhysHandle(0xdead)
        } else {
            self.handles_seen[i % self.handles_seen.len()]
        }
    }

    fn overlapping(&self, addr: u64, size: u64) -> Vec<(u64, ShadowMap)> {
        self.maps
            .iter()
            .filter(|(&s, m)| s < addr + size && addr < s + m.size)
            .map(|(&s, m)| (s, *m))
            .collect()
    }

    fn covered(&self, addr: u64, size: u64) -> bool {
        (0..size / G).all(|i| {
            let a = addr + i * G;
            self.maps.iter().any(|(&s, m)| s <= a && a < s + m.size)
        })
    }

    fn inside_one_reservation(&self, addr: u64, size: u64) -> bool {
        self.reservations
            .iter()
            .any(|(&s, &l)| s <= addr && addr + size <= s + l)
    }

    fn drop_ref(&mut self, alloc: u64) {
        let a = self.allocs.get_mut(&alloc).unwrap();
        a.1 -= 1;
        if a.1 == 0 {
            self.used -= a.0;
            self.allocs.remove(&alloc);
        }
    }

    fn aligned(x: u64) -> bool {
        x.is_multiple_of(G)
    }

    fn predict_map(&self, addr: u64, size: u64, h: PhysHandle) -> Expect {
        if !Self::aligned(addr) || !Self::aligned(size) {
            return Expect::Rule(Rule::Misaligned);
        }
        let Some(alloc) = self.handles.get(&h) else {
            return Expect::Rule(Rule::UnknownHandle);
        };
        if self.allocs[alloc].0 != size {
            return Expect::Rule(Rule::PartialHandleMap);
        }
        if !self.inside_one_reservation(addr, size) {
            return Expect::Rule(Rule::OutsideReservation);
        }
        if !self.overlapping(addr, size).is_empty() {
            return Expect::Rule(Rule::AlreadyMapped);
        }
        Expect::Ok
    }

    fn predict_unmap(&self, addr: u64, size: u64) -> Expect {
        if !Self::aligned(addr) {
            return Expect::Rule(Rule::Misaligned);
        }
        if !self.covered(addr, size) {
            return Expect::Rule(Rule::NotMapped);
        }
        if self
            .overlapping(addr, size)
            .iter()
            .any(|(s, m)| *s < addr || s + m.size > addr + size)
        {
            return Expect::Rule(Rule::PartialUnmap);
        }
        if self
            .pending
            .iter()
            .any(|&(a, l)| a < addr + size && addr < a + l)
        {
            return Expect::Rule(Rule::InUseByStream);
        }
        Expect::Ok
    }

    fn predict_set_access(&self, addr: u64, size: u64) -> Expect {
        if !Self::aligned(addr) {
            return Expect::Rule(Rule::Misaligned);
        }
        if !self.covered(addr, size) {
            return Expect::Rule(Rule::NotMapped);
        }
        Expect::Ok
    }

    fn predict_free_reservation(&self, addr: u64, size: u64) -> Expect {
        if self.reservations.get(&addr) != Some(&size) {
            return Expect::Rule(Rule::NotAReservation);
        }
        if !self.overlapping(addr, size).is_empty() {
            return Expect::Rule(Rule::ReservationInUse);
        }
        Expect::Ok
    }

    /// Runs one op on the device and on the shadow; returns a description of a mismatch.
    fn step(&mut self, d: &SimDevice, op: &Op) -> Result<(), String> {
        match *op {
            Op::Reserve(n) => {
                let r = d.reserve(n * G, 0);
                check(
                    &mut self.seen,
                    format!("reserve {n}"),
                    Expect::Ok,
                    outcome(&r),
                )?;
                let a = r.unwrap();
                self.reservations.insert(a, n * G);
                self.reservations_seen.push((a, n * G));
            }
            Op::FreeReservation(i, delta) => {
                let Some(&(a, s)) = self
                    .reservations_seen
                    .get(i % self.reservations_seen.len().max(1))
                else {
                    return Ok(());
                };
                let size = s.saturating_add_signed(delta * G as i64);
                let want = self.predict_free_reservation(a, size);
                check(
                    &mut self.seen,
                    format!("free_reservation {a:#x}+{size:#x}"),
                    want,
                    outcome(&d.free_reservation(a, size)),
                )?;
                if want == Expect::Ok {
                    self.reservations.remove(&a);
                }
            }
            Op::Create(n) => {
                let want = if n * G > CAPACITY - self.used {
                    Expect::Oom
                } else {
                    Expect::Ok
                };
                let r = d.create(n * G);
                check(&mut self.seen, format!("create {n}"), want, outcome(&r))?;
                if let Ok(h) = r {
                    self.next_alloc += 1;
                    self.allocs.insert(self.next_alloc, (n * G, 1));
                    self.handles.insert(h, self.next_alloc);
                    self.handles_seen.push(h);
                    self.used += n * G;
                }
            }
            Op::Release(i) => {
                let h = self.handle(i);
                let want = if self.handles.contains_key(&h) {
                    Expect::Ok
                } else {
                    Expect::Rule(Rule::UnknownHandle)
                };
                check(
                    &mut self.seen,
                    format!("release {h:?}"),
                    want,
                    outcome(&d.release(h)),
                )?;
                if let Some(alloc) = self.handles.remove(&h) {
                    self.drop_ref(alloc);
                }
            }
            Op::Map(w, hi, size) => {
                let (addr, h) = (self.addr(w), self.handle(hi));
                let size = match (size, self.handles.get(&h)) {
                    (Some(n), _) => n * G,
                    (None, Some(a)) => self.allocs[a].0,
                    (None, None) => G,
                };
                let want = self.predict_map(addr, size, h);
                check(
                    &mut self.seen,
                    format!("map {addr:#x}+{size:#x} {h:?}"),
                    want,
                    outcome(&d.map(addr, size, h)),
                )?;
                if want == Expect::Ok {
                    let alloc = self.handles[&h];
                    self.allocs.get_mut(&alloc).unwrap().1 += 1;
                    self.maps.insert(
                        addr,
                        ShadowMap {
                            size,
                            alloc,
                            accessible: false,
                        },
                    );
                }
            }
            Op::SetAccess(w, n) => {
                let (addr, size) = (self.addr(w), n * G);
                let want = self.predict_set_access(addr, size);
                check(
                    &mut self.seen,
                    format!("set_access {addr:#x}+{size:#x}"),
                    want,
                    outcome(&d.set_access(addr, size)),
                )?;
                if want == Expect::Ok {
                    for (s, _) in self.overlapping(addr, size) {
                        self.maps.get_mut(&s).unwrap().accessible = true;
                    }
                }
            }
            Op::Unmap(w, n) => {
                let (addr, size) = (self.addr(w), n * G);
                let want = self.predict_unmap(addr, size);
                check(
                    &mut self.seen,
                    format!("unmap {addr:#x}+{size:#x}"),
                    want,
                    outcome(&d.unmap(addr, size)),
                )?;
                if want == Expect::Ok {
                    for (s, m) in self.overlapping(addr, size) {
                        self.maps.remove(&s);
                        self.drop_ref(m.alloc);
                    }
                }
            }
            Op::UnmapExisting(i) => {
                let Some((&addr, m)) = self.maps.iter().nth(i % self.maps.len().max(1)) else {
                    return Ok(());
                };
                let size = m.size;
                let want = self.predict_unmap(addr, size);
                check(
                    &mut self.seen,
                    format!("unmap {addr:#x}+{size:#x}"),
                    want,
                    outcome(&d.unmap(addr, size)),
                )?;
                if want == Expect::Ok {
                    let m = self.maps.remove(&addr).unwrap();
                    self.drop_ref(m.alloc);
                }
            }
            Op::Submit(w, n) => {
                let (addr, len) = (self.addr(w), n * G);
                d.streams()
                    .submit(Stream::DEFAULT, addr, len)
                    .map_err(|e| e.to_string())?;
                self.pending.push((addr, len));
            }
            Op::Sync => {
                d.synchronize_stream(Stream::DEFAULT)
                    .map_err(|e| e.to_string())?;
                self.pending.clear();
            }
        }
        self.compare(d)
    }

    /// The device's view equals the shadow's.
    fn compare(&self, d: &SimDevice) -> Result<(), String> {
        d.check()?;
        let live = d.live();
        let want = (
            self.reservations.len(),
            self.handles.len(),
            self.maps.len(),
            self.used,
        );
        let got = (
            live.reservations,
            live.handles,
            live.mappings,
            live.physical_bytes,
        );
        if want != got {
            return Err(format!(
                "live (reservations, handles, mappings, bytes): shadow {want:?}, device {got:?}"
            ));
        }
        let free = d.mem_info().map_err(|e| e.to_string())?.free;
        if free != CAPACITY - self.used {
            return Err(format!("free {free}, shadow {}", CAPACITY - self.used));
        }
        for (&s, m) in &self.maps {
            if d.is_accessible(s, m.size) != m.accessible {
                return Err(format!(
                    "mapping {s:#x}: accessible should be {}",
                    m.accessible
                ));
            }
        }
        for (&s, &l) in &self.reservations {
            for i in 0..l / G {
                let a = s + i * G;
                if !self.maps.iter().any(|(&ms, m)| ms <= a && a < ms + m.size)
                    && d.is_accessible(a, 1)
                {
                    return Err(format!("unmapped granule {a:#x} is accessible"));
                }
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn sim_matches_the_shadow_model(ops in prop::collection::vec(op(), 1..60)) {
        let d = SimDevice::with_capacity(CAPACITY);
        let mut shadow = Shadow::default();
        for (i, op) in ops.iter().enumerate() {
            if let Err(e) = shadow.step(&d, op) {
                prop_assert!(false, "step {i} {op:?}: {e}");
            }
        }
        // Tear everything down through the device; the shadow must agree it empties.
        d.synchronize().unwrap();
        shadow.pending.clear();
        let maps: Vec<(u64, u64)> = shadow.maps.iter().map(|(&s, m)| (s, m.size)).collect();
        for (s, l) in maps {
            d.unmap(s, l).unwrap();
            let m = shadow.maps.remove(&s).unwrap();
            shadow.drop_ref(m.alloc);
        }
        for h in shadow.handles.keys() {
            d.release(*h).unwrap();
        }
        for (&a, &l) in &shadow.reservations {
            d.free_reservation(a, l).unwrap();
        }
        prop_assert!(d.live().is_empty(), "{:?}", d.live());
        d.check().unwrap();
    }
}

/// The generator is strong enough: over a fixed set of sequences every rule a
/// VMM call can break is predicted and observed at least once.
#[test]
fn the_generator_reaches_every_rule() {
    let mut runner = TestRunner::deterministic();
    let strategy = prop::collection::vec(op(), 1..60);
    let mut seen = BTreeSet::new();
    for _ in 0..96 {
        let ops = strategy.new_tree(&mut runner).unwrap().current();
        let d = SimDevice::with_capacity(CAPACITY);
        let mut shadow = Shadow::default();
        for op in &ops {
            shadow.step(&d, op).unwrap();
        }
        seen.extend(shadow.seen);
    }
    let mut want: BTreeSet<String> = [
        Rule::Misaligned,
        Rule::UnknownHandle,
        Rule::PartialHandleMap,
        Rule::OutsideReservation,
        Rule::AlreadyMapped,
        Rule::NotMapped,
        Rule::PartialUnmap,
        Rule::InUseByStream,
        Rule::NotAReservation,
        Rule::ReservationInUse,
    ]
    .iter()
    .map(|r| format!("{:?}", Expect::Rule(*r)))
    .collect();
    want.insert(format!("{:?}", Expect::Ok));
    want.insert(format!("{:?}", Expect::Oom));
    let missing: Vec<_> = want.difference(&seen).collect();
    assert!(
        missing.is_empty(),
        "never reached: {missing:?} (seen {seen:?})"
    );
}
