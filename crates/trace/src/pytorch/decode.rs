//! A pull parser for pickles (protocols 0–5), built for PyTorch memory
//! snapshots of any size.
//!
//! **Why not serde-pickle.** `serde_pickle` (vendored in vendor/serde-pickle,
//! still used to *write* snapshots) has no streaming interface: its
//! deserializer decodes the whole stream into its own value tree before
//! anything sees it, and it clones a memoized value at every reference
//! (`BINGET`). PyTorch's snapshots share every stack frame dict, and every
//! string written more than once, through the memo, so a 3.7 MB snapshot
//! became an 862 MB tree. This decoder runs the pickle machine itself and
//! lets its caller (a [`Sink`]) take containers apart as they fill:
//!
//! - **Values are small and shared.** A [`Val`] is 16 bytes and `Copy`;
//!   strings are interned (each distinct text stored once), containers live in
//!   an arena and are reference-counted, so a memo reference (`BINGET`) costs
//!   a count, never a copy.
//! - **Roles.** When a list or dict is created, the sink may give it a role
//!   from its parent's role and its key or position (the snapshot's
//!   `device_traces` lists, say). Items landing in a container with a role
//!   (`APPEND(S)`, `SETITEM(S)`) go to the sink instead of the container, and
//!   are released once it has converted them: an event dict is gone as soon
//!   as its batch of at most 1000 (Python's pickler batches by 1000) is
//!   appended.
//! - **Settling.** The memo keeps every memoized object alive. When the sink
//!   has converted a container it [`Vm::settle`]s it: the memo slot then holds
//!   a compact typed value (a frame id, a stack id, or "consumed") instead, and
//!   the container is freed once nothing else holds it. The memo itself costs
//!   4 bytes a slot.
//!
//! A parent is known at creation because Python's pickler writes a container's
//! items right after creating it: `EMPTY_LIST MEMOIZE MARK item… APPENDS` (or
//! `item APPEND` for a batch of one), likewise for dicts. The prediction is
//! checked when the container lands in its parent; the sink rejects a
//! container with a role that lands elsewhere (only a hand-made pickle can do
//! that), so a wrong guess is an error, never a wrong result.
//!
//! Semantics follow `serde_pickle` with `decode_strings`,
//! `replace_unresolved_globals` and `replace_recursive_structures`, the
//! options the reader used before, so every pickle reads as it did; opcodes
//! that need a Python runtime (persistent ids, extension registry, out-of-band
//! buffers) are errors, as they were. Malformed input (truncated, unknown
//! opcode, stack underflow, missing memo entry, invalid UTF-8) is a one-line
//! [`ErrorKind::Pickle`] naming the byte offset; nothing panics.

use std::io::Read;
use std::rc::Rc;

use num_bigint::{BigInt, Sign};
use rustc_hash::FxHashMap;
use serde_pickle::Value;

use super::limits::{Budget, Hit, ReadLimits};
use crate::error::{ErrorKind, Result, TraceError};

/// Pickle opcodes (names as in Python's `pickletools`).
#[allow(missing_docs)]
pub(crate) mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

/// A global (`GLOBAL`/`STACK_GLOBAL`) the decoder knows how to call, as
/// serde-pickle does; anything else is `Other` and reads as `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Global {
    Encode,
    Reconst,
    Set,
    Frozenset,
    List,
    Bytearray,
    Int,
    Other,
}

/// A decoded value: scalars inline, everything else by index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Val {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond `i64` ([`Vm::big`]).
    Big(u32),
    Float(f64),
    /// An interned string ([`Vm::str`]).
    Str(u32),
    /// A byte string ([`Vm::bytes`]).
    Bytes(u32),
    Global(Global),
    /// A container in the arena ([`Vm::obj`]).
    Obj(u32),
    /// A frame dict the sink converted (the sink's frame id).
    Frame(u32),
    /// A list of frames the sink converted (the sink's stack id).
    Stack(u32),
    /// A container the sink consumed and kept nothing of.
    Dropped,
}

/// What kind of container an [`Obj`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    List,
    Tuple,
    Dict,
    Set,
    FrozenSet,
}

const NO_MEMO: u32 = u32::MAX;
/// Bytes of one value in a vector.
const VAL_BYTES: u64 = std::mem::size_of::<Val>() as u64;

/// A container. Dict items are flat: key, value, key, value.
#[derive(Debug)]
pub(crate) struct Obj {
    pub kind: Kind,
    rc: u32,
    memo: u32,
    /// The role the sink gave it (0: none).
    pub role: u32,
    /// Items (pairs, for a dict) that landed in it, kept or handed to the sink.
    pub landed: u32,
    /// Whether it may be a dict key or set member: a tuple or frozenset of
    /// hashable values, decided once when it is made (its items never change).
    hashable: bool,
    pub items: Vec<Val>,
}

/// The role-less role.
pub(crate) const NO_ROLE: u32 = 0;

/// The caller of the decoder: gives containers roles and takes the items
/// that land in containers with one.
pub(crate) trait Sink {
    /// The role of a list or dict created with nothing on the stack (the top
    /// level); [`NO_ROLE`] for none.
    fn root_role(&mut self, kind: Kind) -> u32;
    /// The role of a list or dict created as the value of `key` in a dict with
    /// role `parent`, or as item `index` of a list with role `parent`.
    fn child_role(&mut self, vm: &Vm, parent: u32, key: Option<Val>, index: u32, kind: Kind)
        -> u32;
    /// An item lands in the container `target` (whose role is not
    /// [`NO_ROLE`]) as the value of `key` (dicts) or at `index` (lists). The
    /// decoder releases `item` and `key` afterwards; an error stops decoding.
    fn land(
        &mut self,
        vm: &mut Vm,
        target: u32,
        key: Option<Val>,
        index: u32,
        item: Val,
    ) -> Result<()>;
}

/// A sink that gives no roles: the decoder is then a plain unpickler.
#[cfg(test)]
pub(crate) struct Plain;

#[cfg(test)]
impl Sink for Plain {
    fn root_role(&mut self, _: Kind) -> u32 {
        NO_ROLE
    }
    fn child_role(&mut self, _: &Vm, _: u32, _: Option<Val>, _: u32, _: Kind) -> u32 {
        NO_ROLE
    }
    fn land(&mut self, _: &mut Vm, _: u32, _: Option<Val>, _: u32, _: Val) -> Result<()> {
        Ok(())
    }
}

/// The memo: a slot of 4 bytes per entry (a 3-bit tag and a 29-bit index;
/// values that do not pack are boxed).
#[derive(Default)]
struct Memo {
    dense: Vec<u32>,
    sparse: FxHashMap<u32, u32>,
    count: usize,
    boxed: Vec<Val>,
}

const TAG_SHIFT: u32 = 29;
const PAYLOAD: u32 = (1 << TAG_SHIFT) - 1;
const T_EMPTY: u32 = 0;
const T_OBJ: u32 = 1;
const T_STR: u32 = 2;
const T_FRAME: u32 = 3;
const T_STACK: u32 = 4;
const T_BOXED: u32 = 5;
const T_DROPPED: u32 = 6;
/// The memo's message when its 29-bit index runs out.
const TOO_MANY: &str = "more shared objects than this reader indexes (2^29)";
/// The dense memo grows to an explicit id only while it stays at least half
/// full: `id < 2 × entries + DENSE_SLACK`. Python numbers its memo 0, 1, 2, …;
/// ids far apart (crafted) go to the sparse map, which costs per entry.
const DENSE_SLACK: usize = 64;
/// What a memo error says when the budget refused the memory.
const OVER_BUDGET: &str = "over budget";

/// Bytes of a hash table of `cap` entries of `entry` bytes (hashbrown: a
/// power of two of buckets at most 7/8 full, one control byte each).
fn table_bytes(cap: usize, entry: u64) -> u64 {
    if cap == 0 {
        return 0;
    }
    let buckets = if cap < 8 {
        8
    } else {
        (cap.saturating_mul(8) / 7).next_power_of_two()
    };
    buckets as u64 * (entry + 1)
}

impl Memo {
    fn pack(&mut self, v: Val, budget: &Budget) -> std::result::Result<u32, &'static str> {
        let (tag, i) = match v {
            Val::Obj(i) => (T_OBJ, i),
            Val::Str(i) => (T_STR, i),
            Val::Frame(i) => (T_FRAME, i),
            Val::Stack(i) => (T_STACK, i),
            Val::Dropped => (T_DROPPED, 0),
            other => {
                let i = u32::try_from(self.boxed.len()).map_err(|_| TOO_MANY)?;
                if self.boxed.len() == self.boxed.capacity() {
                    let add = self.boxed.capacity().max(16);
                    if !budget.charge((add * std::mem::size_of::<Val>()) as u64) {
                        return Err(OVER_BUDGET);
                    }
                    self.boxed.reserve_exact(add);
                }
                self.boxed.push(other);
                (T_BOXED, i)
            }
        };
        if i > PAYLOAD {
            return Err(TOO_MANY);
        }
        Ok(tag << TAG_SHIFT | i)
    }

    fn unpack(&self, s: u32) -> Option<Val> {
        let i = s & PAYLOAD;
        Some(match s >> TAG_SHIFT {
            T_OBJ => Val::Obj(i),
            T_STR => Val::Str(i),
            T_FRAME => Val::Frame(i),
            T_STACK => Val::Stack(i),
            T_BOXED => self.boxed[i as usize],
            T_DROPPED => Val::Dropped,
            _ => return None,
        })
    }

    fn get(&self, id: u32) -> Option<Val> {
        let s = match self.dense.get(id as usize) {
            Some(&s) => s,
            None => *self.sparse.get(&id)?,
        };
        self.unpack(s)
    }

    /// Stores `v` under `id`, charging `budget` for what the memo grows by;
    /// returns the value it replaces. Errors: [`OVER_BUDGET`] (nothing
    /// stored) or a message.
    #[inline]
    fn set(
        &mut self,
        id: u32,
        v: Val,
        budget: &Budget,
    ) -> std::result::Result<Option<Val>, &'static str> {
        let s = self.pack(v, budget)?;
        let i = id as usize;
        let old = if i < self.dense.len() {
            std::mem::replace(&mut self.dense[i], s)
        } else if self.sparse.is_empty() && i < self.count.saturating_mul(2) + DENSE_SLACK {
            let cap = self.dense.capacity();
            if i >= cap {
                let new_cap = (cap * 2).max(i + 1).max(256);
                if !budget.charge(((new_cap - cap) * 4) as u64) {
                    return Err(OVER_BUDGET);
                }
                self.dense.reserve_exact(new_cap - self.dense.len());
            }
            self.dense.resize(i, T_EMPTY);
            self.dense.push(s);
            T_EMPTY
        } else {
            if self.sparse.len() == self.sparse.capacity() && !self.sparse.contains_key(&id) {
                // Growing: the new table (over-estimated) exists beside the old.
                let before = table_bytes(self.sparse.capacity(), 8);
                let transient = table_bytes((self.sparse.capacity() + 1) * 2, 8);
                if !budget.charge(transient) {
                    return Err(OVER_BUDGET);
                }
                self.sparse.reserve(1);
                let after = table_bytes(self.sparse.capacity(), 8);
                budget.uncharge((transient + before).saturating_sub(after));
            }
            self.sparse.insert(id, s).unwrap_or(T_EMPTY)
        };
        let old = self.unpack(old);
        if old.is_none() {
            self.count += 1;
        }
        Ok(old)
    }
}

/// Interned strings: each distinct text once.
#[derive(Default)]
struct Strings {
    list: Vec<Rc<str>>,
    index: FxHashMap<Rc<str>, u32>,
}

/// What interning a new string costs beyond its text: the `Rc` header, its
/// slot in the list and its entry in the index, both of which double as they
/// grow (charged generously).
const STRING_OVERHEAD: u64 = 128;

impl Strings {
    fn insert(&mut self, s: &str) -> u32 {
        let rc: Rc<str> = Rc::from(s);
        let i = self.list.len() as u32;
        self.list.push(rc.clone());
        self.index.insert(rc, i);
        i
    }
}

/// The pickle machine's state: stack, marks, memo, and the tables values index.
pub(crate) struct Vm {
    stack: Vec<Val>,
    marks: Vec<usize>,
    memo: Memo,
    objs: Vec<Obj>,
    free: Vec<u32>,
    strings: Strings,
    bigs: Vec<BigInt>,
    bytes: Vec<Box<[u8]>>,
    scratch: Vec<Val>,
    /// The containers [`Vm::release`] is freeing (each at most once, so it
    /// never outgrows `objs`).
    freeing: Vec<u32>,
    /// Byte offset of the opcode being run (for errors).
    at: u64,
    /// What the reader holds and does, against its limits.
    pub budget: Budget,
}

/// A charge the budget refused (the budget records which limit). Small, so
/// the hot paths return it in a register; [`run`] turns whatever error
/// follows into the limit's own.
#[derive(Debug)]
pub(crate) struct Over;

impl From<Over> for TraceError {
    #[cold]
    fn from(_: Over) -> TraceError {
        ErrorKind::Pickle("over the reader's budget".into()).into()
    }
}

/// Bytes the machine holds whatever the input (buffers made up front).
const FIXED_BYTES: u64 = (BUF + 256 * 16 + 16 * 8) as u64;

/// Bytes per container slot: the slot, and its share of the free list and of
/// the freeing list (both kept as large as the arena).
const OBJ_SLOT_BYTES: u64 = std::mem::size_of::<Obj>() as u64 + 8;

impl Vm {
    /// A machine with `names` pre-interned (their ids are 0, 1, 2, …).
    pub fn new(limits: ReadLimits, names: &[&str]) -> Result<Vm> {
        let budget = Budget::new(limits);
        budget.charge(FIXED_BYTES);
        let mut vm = Vm {
            stack: Vec::with_capacity(256),
            marks: Vec::with_capacity(16),
            memo: Memo::default(),
            objs: Vec::new(),
            free: Vec::new(),
            strings: Strings::default(),
            bigs: Vec::new(),
            bytes: Vec::new(),
            scratch: Vec::new(),
            freeing: Vec::new(),
            at: 0,
            budget,
        };
        for n in names {
            vm.intern(n)?;
        }
        Ok(vm)
    }

    /// Charges `n` bytes, or fails (nothing charged).
    #[inline]
    pub fn charge(&self, n: u64) -> std::result::Result<(), Over> {
        if self.budget.charge(n) {
            Ok(())
        } else {
            Err(Over)
        }
    }

    /// Takes `n` steps, or fails.
    #[inline]
    pub fn spend(&self, n: u64) -> std::result::Result<(), Over> {
        if self.budget.spend(n) {
            Ok(())
        } else {
            Err(Over)
        }
    }

    /// The error of the limit hit.
    #[cold]
    pub fn limit_err(&self) -> TraceError {
        self.budget
            .error(self.at)
            .unwrap_or_else(|| self.pickle_err("over the reader's budget"))
    }

    /// Interns `s` (charged if new); its id is stable for the whole decode.
    pub fn intern(&mut self, s: &str) -> std::result::Result<u32, Over> {
        if let Some(&i) = self.strings.index.get(s) {
            return Ok(i);
        }
        self.charge(s.len() as u64 + STRING_OVERHEAD)?;
        Ok(self.strings.insert(s))
    }

    /// Keeps a byte string (charged).
    fn keep_bytes(&mut self, b: Vec<u8>) -> std::result::Result<Val, Over> {
        self.charge(b.len() as u64 + 48)?;
        let i = u32::try_from(self.bytes.len()).map_err(|_| self.over_memory())?;
        self.bytes.push(b.into_boxed_slice());
        Ok(Val::Bytes(i))
    }

    /// The string `id`.
    pub fn str(&self, id: u32) -> &str {
        &self.strings.list[id as usize]
    }

    /// The big integer `id`.
    pub fn big(&self, id: u32) -> &BigInt {
        &self.bigs[id as usize]
    }

    /// The byte string `id`.
    pub fn bytes(&self, id: u32) -> &[u8] {
        &self.bytes[id as usize]
    }

    /// The container `id`.
    pub fn obj(&self, id: u32) -> &Obj {
        &self.objs[id as usize]
    }

    /// The items of `v` if it is a container of one of `kinds`.
    pub fn items(&self, v: Val, kinds: &[Kind]) -> Option<&[Val]> {
        match v {
            Val::Obj(i) => {
                let o = &self.objs[i as usize];
                kinds.contains(&o.kind).then_some(&o.items[..])
            }
            _ => None,
        }
    }

    fn pickle_err(&self, msg: impl std::fmt::Display) -> TraceError {
        ErrorKind::Pickle(format!("{msg} (at byte {})", self.at)).into()
    }

    /// More of something than a 32-bit index counts: only more memory than
    /// the budget allows can hold that many.
    #[cold]
    fn over_memory(&self) -> Over {
        self.budget.hit_limit(Hit::Memory);
        Over
    }

    /// Moves the stack's items from `m` up into a new vector (charged).
    fn take_items(&mut self, m: usize) -> std::result::Result<Vec<Val>, Over> {
        let n = self.stack.len().saturating_sub(m);
        self.charge(n as u64 * VAL_BYTES)?;
        Ok(self.stack.split_off(m))
    }

    /// A new container holding `items`, which the caller has charged.
    #[inline]
    fn new_obj(
        &mut self,
        kind: Kind,
        role: u32,
        items: Vec<Val>,
    ) -> std::result::Result<u32, Over> {
        let landed = if kind == Kind::Dict {
            items.len() / 2
        } else {
            items.len()
        } as u32;
        let hashable = match kind {
            Kind::Tuple | Kind::FrozenSet => items.iter().all(|&v| self.hashable(v)),
            _ => false,
        };
        let o = Obj {
            kind,
            rc: 1,
            memo: NO_MEMO,
            role,
            landed,
            hashable,
            items,
        };
        match self.free.pop() {
            Some(i) => {
                let slot = &mut self.objs[i as usize];
                let mut old = std::mem::replace(slot, o);
                if slot.items.is_empty() && old.items.capacity() > 0 {
                    old.items.clear();
                    slot.items = old.items;
                } else {
                    self.budget
                        .uncharge(old.items.capacity() as u64 * VAL_BYTES);
                }
                Ok(i)
            }
            None => {
                let i = u32::try_from(self.objs.len()).map_err(|_| self.over_memory())?;
                if self.objs.len() == self.objs.capacity() {
                    let add = self.objs.capacity().max(64);
                    if !self.budget.charge(add as u64 * OBJ_SLOT_BYTES) {
                        // Nothing is kept of `o` but its items, charged.
                        self.budget.uncharge(o.items.capacity() as u64 * VAL_BYTES);
                        return Err(Over);
                    }
                    self.objs.reserve_exact(add);
                    let cap = self.objs.capacity();
                    self.free.reserve_exact(cap - self.free.len());
                    self.freeing.reserve_exact(cap - self.freeing.len());
                }
                self.objs.push(o);
                Ok(i)
            }
        }
    }

    fn retain(&mut self, v: Val) {
        if let Val::Obj(i) = v {
            let o = &mut self.objs[i as usize];
            o.rc = o.rc.saturating_add(1);
        }
    }

    /// Drops one reference to `v`; a container nothing holds any more is freed
    /// (iteratively: nesting depth cannot overflow the call stack; each
    /// container joins the work list once, when its count reaches 0).
    pub fn release(&mut self, v: Val) {
        let Val::Obj(i) = v else { return };
        if !self.unref(i) {
            return;
        }
        let mut work = std::mem::take(&mut self.freeing);
        work.push(i);
        while let Some(i) = work.pop() {
            let mut items = std::mem::take(&mut self.objs[i as usize].items);
            for it in items.drain(..) {
                if let Val::Obj(c) = it {
                    if self.unref(c) {
                        work.push(c);
                    }
                }
            }
            // Keep small buffers for reuse; give big ones back.
            if items.capacity() <= 64 {
                self.objs[i as usize].items = items;
            } else {
                self.budget.uncharge(items.capacity() as u64 * VAL_BYTES);
            }
            self.free.push(i);
        }
        self.freeing = work;
    }

    /// Drops one count of container `i`; true when that was its last.
    fn unref(&mut self, i: u32) -> bool {
        let o = &mut self.objs[i as usize];
        if o.rc == 0 {
            return false;
        }
        o.rc -= 1;
        o.rc == 0
    }

    /// The sink has converted the container `v`: its memo slot (if it has
    /// one) now holds `typed` instead, so the container is freed once nothing
    /// else holds it. Anything but a container is left alone.
    pub fn settle(&mut self, v: Val, typed: Val) {
        let Val::Obj(i) = v else { return };
        let m = self.objs[i as usize].memo;
        if m == NO_MEMO || self.memo.get(m) != Some(v) {
            return;
        }
        self.objs[i as usize].memo = NO_MEMO;
        if let Ok(Some(old)) = self.memo.set(m, typed, &self.budget) {
            self.release(old);
        }
    }

    #[inline(always)]
    fn push(&mut self, v: Val) {
        self.stack.push(v);
    }

    /// Pops and releases the stack's items from `m` up.
    fn release_from(&mut self, m: usize) {
        while self.stack.len() > m {
            if let Some(v) = self.stack.pop() {
                self.release(v);
            }
        }
    }

    /// Makes room for `n` values in `scratch` (charged).
    fn room_in_scratch(&self, scratch: &mut Vec<Val>, n: usize) -> std::result::Result<(), Over> {
        let cap = scratch.capacity();
        if n > cap {
            let new_cap = n.max(cap * 2);
            self.charge((new_cap - cap) as u64 * VAL_BYTES)?;
            scratch.reserve_exact(new_cap);
        }
        Ok(())
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Val> {
        if self.stack.len() <= self.floor() {
            return Err(self.pickle_err("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn pop_mark(&mut self) -> Result<usize> {
        self.marks
            .pop()
            .ok_or_else(|| self.pickle_err("no MARK to pop to"))
    }

    /// The stack's top above the last mark (the target of APPEND/SETITEM).
    fn top(&self) -> Result<Val> {
        if self.stack.len() <= self.floor() {
            return Err(self.pickle_err("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked above"))
    }

    fn type_of(&self, v: Val) -> &'static str {
        type_name(self, v)
    }

    /// The role a new list or dict gets (see the module docs).
    fn creation_role<S: Sink>(&self, sink: &mut S, kind: Kind) -> u32 {
        let p = self.stack.len();
        if p == 0 && self.marks.is_empty() {
            return sink.root_role(kind);
        }
        let floor = self.floor();
        // A: a member of the batch of the container just below the last mark.
        if let Some(&m) = self.marks.last() {
            if m >= 1 {
                if let Val::Obj(c) = self.stack[m - 1] {
                    let o = &self.objs[c as usize];
                    let n = p - m;
                    match o.kind {
                        Kind::Dict if n % 2 == 1 => {
                            return if o.role == NO_ROLE {
                                NO_ROLE
                            } else {
                                sink.child_role(self, o.role, Some(self.stack[p - 1]), 0, kind)
                            };
                        }
                        Kind::List => {
                            return if o.role == NO_ROLE {
                                NO_ROLE
                            } else {
                                let index = o.landed.saturating_add(n as u32);
                                sink.child_role(self, o.role, None, index, kind)
                            };
                        }
                        _ => {}
                    }
                }
            }
        }
        // B: the single item of a batch (`item APPEND`, `key value SETITEM`).
        if p > floor {
            if let Val::Obj(c) = self.stack[p - 1] {
                let o = &self.objs[c as usize];
                if o.kind == Kind::List && o.role != NO_ROLE {
                    return sink.child_role(self, o.role, None, o.landed, kind);
                }
            }
        }
        if p >= floor + 2 {
            if let Val::Obj(c) = self.stack[p - 2] {
                let o = &self.objs[c as usize];
                if o.kind == Kind::Dict && o.role != NO_ROLE {
                    return sink.child_role(self, o.role, Some(self.stack[p - 1]), 0, kind);
                }
            }
        }
        NO_ROLE
    }

    /// Whether `v` may be a dict key or set member (Python's hashable types,
    /// as serde-pickle checks them).
    ///
    /// Constant time: a container's answer is kept from when it was made, so
    /// one huge tuple used as a key many times is never walked again.
    fn hashable(&self, v: Val) -> bool {
        match v {
            Val::Obj(i) => self.objs[i as usize].hashable,
            Val::Frame(_) | Val::Stack(_) | Val::Dropped => false,
            _ => true,
        }
    }

    /// Makes room for `n` more items in container `t` (charged), growing as a
    /// vector does (doubling).
    fn grow_items(&mut self, t: u32, n: usize) -> std::result::Result<(), Over> {
        let items = &self.objs[t as usize].items;
        let (len, cap) = (items.len(), items.capacity());
        if len + n > cap {
            let new_cap = (cap * 2).max(len + n).max(4);
            self.charge((new_cap - cap) as u64 * VAL_BYTES)?;
            self.objs[t as usize].items.reserve_exact(new_cap - len);
        }
        Ok(())
    }

    /// Items land in the container `target`: kept, or handed to the sink.
    fn land<S: Sink>(
        &mut self,
        sink: &mut S,
        target: Val,
        items: &[Val],
        pairs: bool,
    ) -> Result<()> {
        let Val::Obj(t) = target else {
            return Err(self.pickle_err(format!(
                "{} into {}",
                if pairs { "SETITEM" } else { "APPEND" },
                self.type_of(target)
            )));
        };
        let kind = self.objs[t as usize].kind;
        let ok = if pairs {
            kind == Kind::Dict
        } else {
            matches!(kind, Kind::List | Kind::Set)
        };
        if !ok {
            return Err(self.pickle_err(format!(
                "{} into {}",
                if pairs { "SETITEM" } else { "APPEND" },
                self.type_of(target)
            )));
        }
        if pairs && items.len() % 2 == 1 {
            return Err(self.pickle_err("SETITEMS with a key and no value"));
        }
        if self.objs[t as usize].role == NO_ROLE {
            // Kept: room for the whole batch at once.
            self.grow_items(t, items.len())?;
        }
        let step = if pairs { 2 } else { 1 };
        for chunk in items.chunks(step) {
            let (key, item) = if pairs {
                (Some(chunk[0]), chunk[1])
            } else {
                (None, chunk[0])
            };
            if (pairs || kind == Kind::Set) && !self.hashable(chunk[0]) {
                return Err(self.pickle_err(format!(
                    "unhashable {} ({})",
                    if pairs { "dict key" } else { "set member" },
                    self.type_of(chunk[0])
                )));
            }
            let role = self.objs[t as usize].role;
            let index = self.objs[t as usize].landed;
            self.objs[t as usize].landed = index.saturating_add(1);
            if role == NO_ROLE {
                if let Val::Obj(c) = item {
                    if self.objs[c as usize].role != NO_ROLE {
                        return Err(ErrorKind::Schema(format!(
                            "a list read as part of the snapshot lands inside another value (at byte {}); \
                             this reader follows the layout Python's pickle writes",
                            self.at
                        ))
                        .into());
                    }
                }
                self.objs[t as usize].items.extend_from_slice(chunk);
            } else {
                sink.land(self, t, key, index, item)?;
                // The sink keeps what it converts: a charge it was refused
                // ends the read here.
                if self.budget.exhausted() {
                    return Err(Over.into());
                }
                self.release(item);
                if let Some(k) = key {
                    self.release(k);
                }
            }
        }
        Ok(())
    }
}

/// Python's name for the type of `v`, as error messages say it.
pub(crate) fn type_name(vm: &Vm, v: Val) -> &'static str {
    match v {
        Val::None | Val::Global(_) => "None",
        Val::Bool(_) => "a bool",
        Val::Int(_) | Val::Big(_) => "an integer",
        Val::Float(_) => "a float",
        Val::Bytes(_) => "bytes",
        Val::Str(_) => "a string",
        Val::Frame(_) | Val::Dropped => "a dict",
        Val::Stack(_) => "a list",
        Val::Obj(i) => match vm.obj(i).kind {
            Kind::List => "a list",
            Kind::Tuple => "a tuple",
            Kind::Dict => "a dict",
            Kind::Set | Kind::FrozenSet => "a set",
        },
    }
}

/// Reads bytes from any `Read` through a buffer of its own, counting the offset.
struct Src<R> {
    r: R,
    /// Bytes read from `r` in all (the budget's count, kept up to date).
    read: Rc<std::cell::Cell<u64>>,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// Bytes before `buf[0]`.
    base: u64,
}

const BUF: usize = 1 << 18;

impl<R: Read> Src<R> {
    fn new(r: R, read: Rc<std::cell::Cell<u64>>) -> Src<R> {
        Src {
            r,
            read,
            buf: vec![0; BUF].into_boxed_slice(),
            pos: 0,
            end: 0,
            base: 0,
        }
    }

    fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// Reads more; false at the end of the input.
    fn fill(&mut self) -> Result<bool> {
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.base += self.pos as u64;
            self.end -= self.pos;
            self.pos = 0;
        }
        loop {
            match self.r.read(&mut self.buf[self.end..]) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.end += n;
                    self.read.set(self.base + self.end as u64);
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(TraceError::from(e)),
            }
        }
    }

    #[inline]
    fn byte(&mut self) -> Result<Option<u8>> {
        if self.pos == self.end && !self.fill()? {
            return Ok(None);
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(Some(b))
    }

    /// The next `n` bytes (`n` at most the buffer's size), or `None` at the end.
    #[inline]
    fn take(&mut self, n: usize) -> Result<Option<&[u8]>> {
        debug_assert!(n <= BUF);
        while self.end - self.pos < n {
            if !self.fill()? {
                return Ok(None);
            }
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(Some(s))
    }

    /// The next `n` bytes of any length, read as they arrive (a corrupt
    /// length allocates no more than the input holds).
    fn take_vec(&mut self, n: u64) -> Result<Option<Vec<u8>>> {
        if n <= BUF as u64 {
            return Ok(self.take(n as usize)?.map(<[u8]>::to_vec));
        }
        let mut out = Vec::with_capacity(BUF);
        let have = (self.end - self.pos).min(n as usize);
        out.extend_from_slice(&self.buf[self.pos..self.pos + have]);
        self.pos += have;
        let rest = n - have as u64;
        let got = (&mut self.r)
            .take(rest)
            .read_to_end(&mut out)
            .map_err(TraceError::from)?;
        self.base += got as u64;
        self.read.set(self.base + self.end as u64);
        Ok((got as u64 == rest).then_some(out))
    }

    /// A text line without its `\n` (and `\r`), or `None` at the end.
    fn line(&mut self) -> Result<Option<Vec<u8>>> {
        let mut out = Vec::new();
        loop {
            match self.byte()? {
                None => return Ok(None),
                Some(b'\n') => {
                    if out.last() == Some(&b'\r') {
                        out.pop();
                    }
                    return Ok(Some(out));
                }
                Some(b) => out.push(b),
            }
            if out.len() > 1 << 20 {
                return Ok(None);
            }
        }
    }
}

fn name_of(opcode: u8) -> String {
    use op::*;
    let n = match opcode {
        MARK => "MARK",
        STOP => "STOP",
        POP => "POP",
        POP_MARK => "POP_MARK",
        DUP => "DUP",
        FLOAT => "FLOAT",
        INT => "INT",
        BININT => "BININT",
        BININT1 => "BININT1",
        LONG => "LONG",
        BININT2 => "BININT2",
        NONE => "NONE",
        PERSID => "PERSID",
        BINPERSID => "BINPERSID",
        REDUCE => "REDUCE",
        STRING => "STRING",
        BINSTRING => "BINSTRING",
        SHORT_BINSTRING => "SHORT_BINSTRING",
        UNICODE => "UNICODE",
        BINUNICODE => "BINUNICODE",
        APPEND => "APPEND",
        BUILD => "BUILD",
        GLOBAL => "GLOBAL",
        DICT => "DICT",
        EMPTY_DICT => "EMPTY_DICT",
        APPENDS => "APPENDS",
        GET => "GET",
        BINGET => "BINGET",
        INST => "INST",
        LONG_BINGET => "LONG_BINGET",
        LIST => "LIST",
        EMPTY_LIST => "EMPTY_LIST",
        OBJ => "OBJ",
        PUT => "PUT",
        BINPUT => "BINPUT",
        LONG_BINPUT => "LONG_BINPUT",
        SETITEM => "SETITEM",
        TUPLE => "TUPLE",
        EMPTY_TUPLE => "EMPTY_TUPLE",
        SETITEMS => "SETITEMS",
        BINFLOAT => "BINFLOAT",
        PROTO => "PROTO",
        NEWOBJ => "NEWOBJ",
        EXT1 => "EXT1",
        EXT2 => "EXT2",
        EXT4 => "EXT4",
        TUPLE1 => "TUPLE1",
        TUPLE2 => "TUPLE2",
        TUPLE3 => "TUPLE3",
        NEWTRUE => "NEWTRUE",
        NEWFALSE => "NEWFALSE",
        LONG1 => "LONG1",
        LONG4 => "LONG4",
        BINBYTES => "BINBYTES",
        SHORT_BINBYTES => "SHORT_BINBYTES",
        SHORT_BINUNICODE => "SHORT_BINUNICODE",
        BINUNICODE8 => "BINUNICODE8",
        BINBYTES8 => "BINBYTES8",
        EMPTY_SET => "EMPTY_SET",
        ADDITEMS => "ADDITEMS",
        FROZENSET => "FROZENSET",
        NEWOBJ_EX => "NEWOBJ_EX",
        STACK_GLOBAL => "STACK_GLOBAL",
        MEMOIZE => "MEMOIZE",
        FRAME => "FRAME",
        BYTEARRAY8 => "BYTEARRAY8",
        NEXT_BUFFER => "NEXT_BUFFER",
        READONLY_BUFFER => "READONLY_BUFFER",
        other => return format!("opcode {other:#04x}"),
    };
    n.to_string()
}

/// Two's-complement little-endian bytes (LONG1/LONG4) as an integer value.
#[inline]
fn long_val(vm: &mut Vm, bytes: &[u8]) -> Result<Val> {
    if bytes.len() <= 8 {
        if bytes.is_empty() {
            return Ok(Val::Int(0));
        }
        let mut b = [0u8; 8];
        b[..bytes.len()].copy_from_slice(bytes);
        let shift = 64 - 8 * bytes.len() as u32;
        return Ok(Val::Int(
            i64::from_le_bytes(b)
                .wrapping_shl(shift)
                .wrapping_shr(shift),
        ));
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut v = BigInt::from_bytes_le(Sign::Plus, bytes);
    if negative {
        v -= BigInt::from(1) << (bytes.len() * 8);
    }
    big_val(vm, v)
}

fn big_val(vm: &mut Vm, v: BigInt) -> Result<Val> {
    match i64::try_from(&v) {
        Ok(i) => Ok(Val::Int(i)),
        Err(_) => {
            vm.charge(v.bits() / 8 + 64)?;
            let i = u32::try_from(vm.bigs.len())
                .map_err(|_| vm.pickle_err("more than 2^32 big integers"))?;
            vm.bigs.push(v);
            Ok(Val::Big(i))
        }
    }
}

/// Python 2 `STRING` escapes, as serde-pickle decodes them.
fn unescape_string(vm: &Vm, line: &[u8]) -> Result<Vec<u8>> {
    let s = if line.len() >= 2
        && line[0] == line[line.len() - 1]
        && (line[0] == b'"' || line[0] == b'\'')
    {
        &line[1..line.len() - 1]
    } else {
        line
    };
    let bad = || vm.pickle_err("invalid STRING literal");
    let mut out = Vec::with_capacity(s.len());
    let mut it = s.iter();
    while let Some(&b) = it.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        match it.next() {
            Some(b'\\') => out.push(b'\\'),
            Some(b'a') => out.push(7),
            Some(b'b') => out.push(8),
            Some(b't') => out.push(9),
            Some(b'n') => out.push(10),
            Some(b'v') => out.push(11),
            Some(b'f') => out.push(12),
            Some(b'r') => out.push(13),
            Some(b'x') => {
                let hex = |c: Option<&u8>| c.and_then(|&c| (c as char).to_digit(16));
                match (hex(it.next()), hex(it.next())) {
                    (Some(a), Some(b)) => out.push((16 * a + b) as u8),
                    _ => return Err(bad()),
                }
            }
            _ => return Err(bad()),
        }
    }
    Ok(out)
}

/// Python's `raw-unicode-escape` (`UNICODE`), as serde-pickle decodes it.
fn unescape_unicode(vm: &Vm, s: &[u8]) -> Result<String> {
    let bad = || vm.pickle_err("invalid UNICODE literal");
    let mut out = String::with_capacity(s.len());
    let mut it = s.iter();
    while let Some(&b) = it.next() {
        if b != b'\\' {
            out.push(b as char);
            continue;
        }
        let n = match it.next() {
            Some(b'u') => 4,
            Some(b'U') => 8,
            _ => return Err(bad()),
        };
        let mut acc = 0u32;
        for _ in 0..n {
            let d = it
                .next()
                .and_then(|&c| (c as char).to_digit(16))
                .ok_or_else(bad)?;
            acc = acc.checked_mul(16).ok_or_else(bad)? + d;
        }
        out.push(char::from_u32(acc).ok_or_else(bad)?);
    }
    Ok(out)
}

/// Decodes one pickle from `r`, handing containers with roles to `sink`;
/// returns the machine and the pickle's value. Bytes after `STOP` are an error.
#[cfg(test)]
pub(crate) fn decode<R: Read, S: Sink>(r: R, sink: &mut S) -> Result<(Vm, Val)> {
    let mut vm = Vm::new(ReadLimits::default(), &[])?;
    let v = run(&mut vm, r, sink)?;
    Ok((vm, v))
}

/// Decodes one pickle from `r` on `vm`, handing containers with roles to
/// `sink`; returns the pickle's value. Bytes after `STOP` are an error, and
/// so is a limit hit (whatever the sink made of it).
pub(crate) fn run<R: Read, S: Sink>(vm: &mut Vm, r: R, sink: &mut S) -> Result<Val> {
    let src = Src::new(r, vm.budget.read_counter());
    let r = run_src(vm, src, sink);
    match r {
        Err(_) | Ok(_) if vm.budget.exhausted() => Err(vm.limit_err()),
        r => r,
    }
}

fn run_src<R: Read, S: Sink>(vm: &mut Vm, mut src: Src<R>, sink: &mut S) -> Result<Val> {
    loop {
        vm.at = src.offset();
        reserve_stack_slot(vm)?;
        let Some(code) = src.byte()? else {
            return Err(vm.pickle_err("truncated: the input ends before the STOP opcode"));
        };
        if let Some(top) = step(vm, &mut src, sink, code)? {
            return Ok(top);
        }
    }
}

/// Every opcode pushes at most one value: room for it is charged here.
#[inline(always)]
fn reserve_stack_slot(vm: &mut Vm) -> Result<()> {
    if vm.stack.len() == vm.stack.capacity() {
        let add = vm.stack.capacity().max(256);
        vm.charge(add as u64 * VAL_BYTES)?;
        vm.stack.reserve_exact(add);
    }
    Ok(())
}

/// The error for an input that ends inside the operand of `code`.
#[cold]
#[inline(never)]
fn truncated(vm: &Vm, code: u8) -> TraceError {
    vm.pickle_err(format!(
        "truncated: the input ends inside {}",
        name_of(code)
    ))
}

/// The next `n` bytes of `code`'s operand.
#[inline(always)]
fn operand<'s, R: Read>(vm: &Vm, src: &'s mut Src<R>, code: u8, n: usize) -> Result<&'s [u8]> {
    match src.take(n)? {
        Some(b) => Ok(b),
        None => Err(truncated(vm, code)),
    }
}

/// A little-endian operand of `N` bytes.
#[inline(always)]
fn operand_le<const N: usize, R: Read>(vm: &Vm, src: &mut Src<R>, code: u8) -> Result<[u8; N]> {
    Ok(operand(vm, src, code, N)?.try_into().expect("N bytes"))
}

/// An operand of `n` bytes too long for the reader's buffer.
#[inline(always)]
fn operand_vec<R: Read>(vm: &Vm, src: &mut Src<R>, code: u8, n: u64) -> Result<Vec<u8>> {
    match src.take_vec(n)? {
        Some(b) => Ok(b),
        None => Err(truncated(vm, code)),
    }
}

/// The newline-terminated operand of a text opcode (protocol 0).
#[inline(always)]
fn operand_line<R: Read>(vm: &Vm, src: &mut Src<R>, code: u8) -> Result<Vec<u8>> {
    match src.line()? {
        Some(l) => Ok(l),
        None => Err(truncated(vm, code)),
    }
}

/// The decimal memo index of a text `PUT`/`GET` (`what`).
fn text_index<R: Read>(vm: &Vm, src: &mut Src<R>, code: u8, what: &str) -> Result<u32> {
    let l = operand_line(vm, src, code)?;
    std::str::from_utf8(&l)
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .ok_or_else(|| vm.pickle_err(format!("invalid {what} index")))
}

/// `b` as an interned string value (`code`'s operand).
#[inline(always)]
fn utf8_val(vm: &mut Vm, b: &[u8], code: u8) -> Result<Val> {
    match std::str::from_utf8(b) {
        Ok(s) => Ok(Val::Str(vm.intern(s)?)),
        Err(_) => Err(vm.pickle_err(format!("{} is not valid UTF-8", name_of(code)))),
    }
}

/// Executes one opcode; the value the pickle returns at `STOP`.
#[inline(always)]
fn step<R: Read, S: Sink>(
    vm: &mut Vm,
    src: &mut Src<R>,
    sink: &mut S,
    code: u8,
) -> Result<Option<Val>> {
    use op::*;
    match code {
        PROTO => {
            operand(vm, src, code, 1)?;
        }
        FRAME => {
            operand(vm, src, code, 8)?;
        }
        STOP => return stop(vm, src).map(Some),
        MARK | POP | POP_MARK | DUP => stack_op(vm, code)?,
        PUT | BINPUT | LONG_BINPUT | MEMOIZE => memo_put(vm, src, code)?,
        GET | BINGET | LONG_BINGET => memo_get(vm, src, code)?,
        NONE | NEWTRUE | NEWFALSE | INT | LONG | FLOAT | BINFLOAT | BININT | BININT1 | BININT2
        | LONG1 | LONG4 => {
            let v = scalar(vm, src, code)?;
            vm.push(v);
        }
        SHORT_BINUNICODE | SHORT_BINSTRING | BINUNICODE | BINUNICODE8 | BINSTRING
        | SHORT_BINBYTES | BINBYTES | BINBYTES8 | BYTEARRAY8 | STRING | UNICODE => {
            let v = string(vm, src, code)?;
            vm.push(v);
        }
        EMPTY_TUPLE | TUPLE1 | TUPLE2 | TUPLE3 | TUPLE | LIST | FROZENSET | DICT | EMPTY_LIST
        | EMPTY_DICT | EMPTY_SET => {
            let o = container(vm, sink, code)?;
            vm.push(Val::Obj(o));
        }
        APPEND | SETITEM => add_one(vm, sink, code)?,
        APPENDS | SETITEMS | ADDITEMS => add_marked(vm, sink, code)?,
        GLOBAL | STACK_GLOBAL | REDUCE | BUILD | NEWOBJ | NEWOBJ_EX | INST | OBJ => {
            object(vm, src, code)?
        }
        other => {
            return Err(vm.pickle_err(format!(
                "unsupported {} (a snapshot holds plain values only)",
                name_of(other)
            )))
        }
    }
    Ok(None)
}

/// `STOP`: the value on top, and nothing may follow.
#[inline(always)]
fn stop<R: Read>(vm: &mut Vm, src: &mut Src<R>) -> Result<Val> {
    let v = vm.pop()?;
    if src.byte()?.is_some() {
        vm.at = src.offset() - 1;
        return Err(vm.pickle_err("trailing bytes after the STOP opcode"));
    }
    Ok(v)
}

/// `MARK`, `POP`, `POP_MARK`, `DUP`.
#[inline(always)]
fn stack_op(vm: &mut Vm, code: u8) -> Result<()> {
    use op::*;
    match code {
        MARK => {
            if vm.marks.len() == vm.marks.capacity() {
                let add = vm.marks.capacity().max(16);
                vm.charge(add as u64 * 8)?;
                vm.marks.reserve_exact(add);
            }
            vm.marks.push(vm.stack.len())
        }
        POP => {
            if vm.marks.last() == Some(&vm.stack.len()) {
                vm.marks.pop();
            } else {
                let v = vm.pop()?;
                vm.release(v);
            }
        }
        POP_MARK => {
            let m = vm.pop_mark()?;
            vm.release_from(m);
        }
        _ => {
            let v = vm.top()?;
            vm.retain(v);
            vm.push(v);
        }
    }
    Ok(())
}

/// `PUT`, `BINPUT`, `LONG_BINPUT`, `MEMOIZE`: the top value into the memo.
#[inline(always)]
fn memo_put<R: Read>(vm: &mut Vm, src: &mut Src<R>, code: u8) -> Result<()> {
    use op::*;
    let id = match code {
        PUT => text_index(vm, src, code, "PUT")?,
        BINPUT => operand(vm, src, code, 1)?[0] as u32,
        LONG_BINPUT => u32::from_le_bytes(operand_le(vm, src, code)?),
        _ => u32::try_from(vm.memo.count).map_err(|_| vm.pickle_err("memo beyond 2^32 entries"))?,
    };
    let v = vm.top()?;
    vm.retain(v);
    if let Val::Obj(i) = v {
        let o = &mut vm.objs[i as usize];
        if o.memo == NO_MEMO {
            o.memo = id;
        }
    }
    match vm.memo.set(id, v, &vm.budget) {
        Ok(Some(old)) => vm.release(old),
        Ok(None) => {}
        Err(_) if vm.budget.exhausted() => return Err(vm.limit_err()),
        Err(m) => return Err(vm.pickle_err(m)),
    }
    Ok(())
}

/// `GET`, `BINGET`, `LONG_BINGET`: a memo entry onto the stack.
#[inline(always)]
fn memo_get<R: Read>(vm: &mut Vm, src: &mut Src<R>, code: u8) -> Result<()> {
    use op::*;
    let id = match code {
        GET => text_index(vm, src, code, "GET")?,
        BINGET => operand(vm, src, code, 1)?[0] as u32,
        _ => u32::from_le_bytes(operand_le(vm, src, code)?),
    };
    let v = vm
        .memo
        .get(id)
        .ok_or_else(|| vm.pickle_err(format!("memo entry {id} is missing")))?;
    vm.retain(v);
    vm.push(v);
    Ok(())
}

/// The value of a `None`, bool, int or float opcode.
#[inline(always)]
fn scalar<R: Read>(vm: &mut Vm, src: &mut Src<R>, code: u8) -> Result<Val> {
    use op::*;
    Ok(match code {
        NONE => Val::None,
        NEWTRUE => Val::Bool(true),
        NEWFALSE => Val::Bool(false),
        INT => {
            let l = operand_line(vm, src, code)?;
            match &l[..] {
                b"00" => Val::Bool(false),
                b"01" => Val::Bool(true),
                _ => Val::Int(
                    std::str::from_utf8(&l)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| vm.pickle_err("invalid INT literal"))?,
                ),
            }
        }
        LONG => {
            let mut l = operand_line(vm, src, code)?;
            if l.last() == Some(&b'L') {
                l.pop();
            }
            let b =
                BigInt::parse_bytes(&l, 10).ok_or_else(|| vm.pickle_err("invalid LONG literal"))?;
            big_val(vm, b)?
        }
        FLOAT => {
            let l = operand_line(vm, src, code)?;
            let f = std::str::from_utf8(&l)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| vm.pickle_err("invalid FLOAT literal"))?;
            Val::Float(f)
        }
        BINFLOAT => Val::Float(f64::from_be_bytes(operand_le(vm, src, code)?)),
        BININT => Val::Int(i32::from_le_bytes(operand_le(vm, src, code)?).into()),
        BININT1 => Val::Int(operand(vm, src, code, 1)?[0].into()),
        BININT2 => Val::Int(u16::from_le_bytes(operand_le(vm, src, code)?).into()),
        LONG1 => {
            let n = operand(vm, src, code, 1)?[0] as usize;
            let b = operand(vm, src, code, n)?.to_vec();
            long_val(vm, &b)?
        }
        _ => {
            let n = i32::from_le_bytes(operand_le(vm, src, code)?);
            let n = u64::try_from(n).map_err(|_| vm.pickle_err("LONG4 of negative length"))?;
            let b = operand_vec(vm, src, code, n)?;
            long_val(vm, &b)?
        }
    })
}

/// The value of a string or bytes opcode.
#[inline(always)]
fn string<R: Read>(vm: &mut Vm, src: &mut Src<R>, code: u8) -> Result<Val> {
    use op::*;
    match code {
        SHORT_BINUNICODE | SHORT_BINSTRING => {
            let n = operand(vm, src, code, 1)?[0] as usize;
            let b = operand(vm, src, code, n)?;
            utf8_val(vm, b, code)
        }
        BINUNICODE | BINUNICODE8 | BINSTRING => {
            let n = match code {
                BINUNICODE => u32::from_le_bytes(operand_le(vm, src, code)?) as u64,
                BINSTRING => {
                    let n = i32::from_le_bytes(operand_le(vm, src, code)?);
                    u64::try_from(n).map_err(|_| vm.pickle_err("BINSTRING of negative length"))?
                }
                _ => u64::from_le_bytes(operand_le(vm, src, code)?),
            };
            if n <= BUF as u64 {
                let b = operand(vm, src, code, n as usize)?;
                utf8_val(vm, b, code)
            } else {
                let b = operand_vec(vm, src, code, n)?;
                utf8_val(vm, &b, code)
            }
        }
        SHORT_BINBYTES | BINBYTES | BINBYTES8 | BYTEARRAY8 => {
            let n = match code {
                SHORT_BINBYTES => operand(vm, src, code, 1)?[0] as u64,
                BINBYTES => u32::from_le_bytes(operand_le(vm, src, code)?) as u64,
                _ => u64::from_le_bytes(operand_le(vm, src, code)?),
            };
            let b = operand_vec(vm, src, code, n)?;
            Ok(vm.keep_bytes(b)?)
        }
        STRING => {
            let l = operand_line(vm, src, code)?;
            let b = unescape_string(vm, &l)?;
            utf8_val(vm, &b, code)
        }
        _ => {
            let l = operand_line(vm, src, code)?;
            let s = unescape_unicode(vm, &l)?;
            Ok(Val::Str(vm.intern(&s)?))
        }
    }
}

/// A tuple, list, set, frozenset or dict built by one opcode.
#[inline(always)]
fn container<S: Sink>(vm: &mut Vm, sink: &mut S, code: u8) -> Result<u32> {
    use op::*;
    Ok(match code {
        EMPTY_TUPLE => vm.new_obj(Kind::Tuple, NO_ROLE, Vec::new())?,
        TUPLE1 | TUPLE2 | TUPLE3 => {
            let n = (code - TUPLE1 + 1) as usize;
            if vm.stack.len() < vm.floor() + n {
                return Err(vm.pickle_err("stack underflow"));
            }
            let items = vm.take_items(vm.stack.len() - n)?;
            vm.new_obj(Kind::Tuple, NO_ROLE, items)?
        }
        TUPLE | LIST | FROZENSET => {
            let m = vm.pop_mark()?;
            let items = vm.take_items(m)?;
            let kind = match code {
                TUPLE => Kind::Tuple,
                LIST => Kind::List,
                _ => Kind::FrozenSet,
            };
            if kind == Kind::FrozenSet {
                if let Some(&bad) = items.iter().find(|&&v| !vm.hashable(v)) {
                    return Err(
                        vm.pickle_err(format!("unhashable set member ({})", vm.type_of(bad)))
                    );
                }
            }
            vm.new_obj(kind, NO_ROLE, items)?
        }
        DICT => {
            let m = vm.pop_mark()?;
            let items = vm.take_items(m)?;
            if items.len() % 2 == 1 {
                return Err(vm.pickle_err("DICT with a key and no value"));
            }
            if let Some(&bad) = items.iter().step_by(2).find(|&&k| !vm.hashable(k)) {
                return Err(vm.pickle_err(format!("unhashable dict key ({})", vm.type_of(bad))));
            }
            vm.new_obj(Kind::Dict, NO_ROLE, items)?
        }
        _ => {
            let kind = match code {
                EMPTY_LIST => Kind::List,
                EMPTY_DICT => Kind::Dict,
                _ => Kind::Set,
            };
            let role = if kind == Kind::Set {
                NO_ROLE
            } else {
                vm.creation_role(sink, kind)
            };
            vm.new_obj(kind, role, Vec::new())?
        }
    })
}

/// `APPEND`, `SETITEM`: one item (or key and value) into the container below.
#[inline(always)]
fn add_one<S: Sink>(vm: &mut Vm, sink: &mut S, code: u8) -> Result<()> {
    use op::*;
    let n = if code == APPEND { 1 } else { 2 };
    if vm.stack.len() < vm.floor() + n + 1 {
        return Err(vm.pickle_err("stack underflow"));
    }
    let mut items = std::mem::take(&mut vm.scratch);
    items.clear();
    if let Err(e) = vm.room_in_scratch(&mut items, n) {
        vm.scratch = items;
        return Err(e.into());
    }
    let from = vm.stack.len() - n;
    items.extend_from_slice(&vm.stack[from..]);
    vm.stack.truncate(from);
    let target = vm.top()?;
    if code == APPEND && matches!(target, Val::Obj(t) if vm.obj(t).kind == Kind::Set) {
        vm.scratch = items;
        return Err(vm.pickle_err("APPEND into a set"));
    }
    let r = vm.land(sink, target, &items, code == SETITEM);
    vm.scratch = items;
    r
}

/// `APPENDS`, `SETITEMS`, `ADDITEMS`: the items above the mark into the
/// container below it.
#[inline(always)]
fn add_marked<S: Sink>(vm: &mut Vm, sink: &mut S, code: u8) -> Result<()> {
    use op::*;
    let m = vm.pop_mark()?;
    let mut items = std::mem::take(&mut vm.scratch);
    items.clear();
    if let Err(e) = vm.room_in_scratch(&mut items, vm.stack.len() - m) {
        vm.scratch = items;
        return Err(e.into());
    }
    items.extend_from_slice(&vm.stack[m..]);
    vm.stack.truncate(m);
    let target = vm.top()?;
    if code == ADDITEMS && !matches!(target, Val::Obj(t) if vm.obj(t).kind == Kind::Set) {
        return Err(vm.pickle_err(format!("ADDITEMS into {}", vm.type_of(target))));
    }
    if code == APPENDS && matches!(target, Val::Obj(t) if vm.obj(t).kind == Kind::Set) {
        return Err(vm.pickle_err("APPENDS into a set"));
    }
    let r = vm.land(sink, target, &items, code == SETITEMS);
    vm.scratch = items;
    r
}

/// The object opcodes (`GLOBAL`, `REDUCE`, `BUILD`, `NEWOBJ`, …): nothing
/// named is ever called; objects read as empty dicts, globals as markers.
fn object<R: Read>(vm: &mut Vm, src: &mut Src<R>, code: u8) -> Result<()> {
    use op::*;
    match code {
        GLOBAL => {
            let module = operand_line(vm, src, code)?;
            let name = operand_line(vm, src, code)?;
            vm.push(Val::Global(global(&module, &name)));
        }
        STACK_GLOBAL => {
            let name = vm.pop()?;
            let module = vm.pop()?;
            let (Val::Str(n), Val::Str(m)) = (name, module) else {
                return Err(vm.pickle_err("STACK_GLOBAL of something other than two strings"));
            };
            let g = global(vm.str(m).as_bytes(), vm.str(n).as_bytes());
            vm.push(Val::Global(g));
        }
        REDUCE => {
            let args = vm.pop()?;
            let callable = vm.pop()?;
            let v = reduce(vm, callable, args)?;
            vm.release(args);
            vm.release(callable);
            vm.push(v);
        }
        BUILD => {
            let state = vm.pop()?;
            let standin = vm.pop()?;
            vm.release(standin);
            vm.push(state);
        }
        NEWOBJ => {
            let args = vm.pop()?;
            let class = vm.pop()?;
            vm.release(args);
            vm.release(class);
            let o = vm.new_obj(Kind::Dict, NO_ROLE, Vec::new())?;
            vm.push(Val::Obj(o));
        }
        NEWOBJ_EX => {
            for _ in 0..3 {
                let v = vm.pop()?;
                vm.release(v);
            }
            let o = vm.new_obj(Kind::Dict, NO_ROLE, Vec::new())?;
            vm.push(Val::Obj(o));
        }
        _ => {
            if code == INST {
                operand_line(vm, src, code)?;
                operand_line(vm, src, code)?;
            }
            let m = vm.pop_mark()?;
            vm.release_from(m);
            if code == OBJ {
                let class = vm.pop()?;
                vm.release(class);
            }
            let o = vm.new_obj(Kind::Dict, NO_ROLE, Vec::new())?;
            vm.push(Val::Obj(o));
        }
    }
    Ok(())
}

fn global(module: &[u8], name: &[u8]) -> Global {
    match (module, name) {
        (b"_codecs", b"encode") => Global::Encode,
        (b"copy_reg" | b"copyreg", b"_reconstructor") => Global::Reconst,
        (b"__builtin__" | b"builtins", b"set") => Global::Set,
        (b"__builtin__" | b"builtins", b"frozenset") => Global::Frozenset,
        (b"__builtin__" | b"builtins", b"list") => Global::List,
        (b"__builtin__" | b"builtins", b"bytearray") => Global::Bytearray,
        (b"__builtin__" | b"builtins", b"int") => Global::Int,
        _ => Global::Other,
    }
}

/// `REDUCE` of the globals serde-pickle knows (`set([...])`, `_codecs.encode`
/// for protocol 2 bytes, …); anything else is an opaque object (`None`):
/// nothing named in a pickle is ever called.
fn reduce(vm: &mut Vm, callable: Val, args: Val) -> Result<Val> {
    // The arguments used: the first, the second-to-last and the last.
    let (first, second_last, last) = match vm.items(args, &[Kind::Tuple]) {
        Some(items) => (
            items.first().copied(),
            items.len().checked_sub(2).map(|i| items[i]),
            items.last().copied(),
        ),
        None => {
            return Err(vm.pickle_err(format!(
                "REDUCE with {} for arguments, expected a tuple",
                vm.type_of(args)
            )))
        }
    };
    let Val::Global(g) = callable else {
        return Err(vm.pickle_err(format!("REDUCE of {}", vm.type_of(callable))));
    };
    let bad = |vm: &Vm, what: &str| vm.pickle_err(format!("invalid {what}() argument"));
    // A copy of the list `last` as a new container of `kind` (charged: a
    // list shared through the memo can be copied at every reference).
    let copy_list = |vm: &mut Vm, kind: Kind| -> Result<Option<Val>> {
        let Some(n) = last
            .and_then(|l| vm.items(l, &[Kind::List]))
            .map(<[Val]>::len)
        else {
            return Ok(None);
        };
        vm.spend(n as u64)?;
        vm.charge(n as u64 * VAL_BYTES)?;
        let l = vm
            .items(last.unwrap_or(Val::None), &[Kind::List])
            .unwrap_or(&[])
            .to_vec();
        for &v in &l {
            vm.retain(v);
        }
        Ok(Some(Val::Obj(vm.new_obj(kind, NO_ROLE, l)?)))
    };
    // Text as bytes, one byte per character (charged and counted).
    let text_bytes = |vm: &mut Vm, s: u32| -> Result<Val> {
        let n = vm.str(s).len() as u64;
        vm.spend(n)?;
        vm.charge(n)?;
        let b: Vec<u8> = vm.str(s).chars().map(|c| c as u32 as u8).collect();
        vm.budget.uncharge(n);
        Ok(vm.keep_bytes(b)?)
    };
    Ok(match g {
        Global::Set => copy_list(vm, Kind::Set)?.ok_or_else(|| bad(vm, "set"))?,
        Global::Frozenset => copy_list(vm, Kind::FrozenSet)?.ok_or_else(|| bad(vm, "frozenset"))?,
        Global::List => copy_list(vm, Kind::List)?.ok_or_else(|| bad(vm, "list"))?,
        Global::Int => match last {
            Some(v @ Val::Big(_)) | Some(v @ Val::Int(_)) => v,
            _ => return Err(bad(vm, "int")),
        },
        Global::Bytearray => match first {
            Some(v @ Val::Bytes(_)) => v,
            Some(Val::Str(s)) => text_bytes(vm, s)?,
            _ => return Err(bad(vm, "bytearray")),
        },
        Global::Encode => match (second_last, last) {
            (Some(Val::Str(s)), Some(Val::Str(_))) => text_bytes(vm, s)?,
            _ => return Err(bad(vm, "encode")),
        },
        Global::Reconst => Val::Obj(vm.new_obj(Kind::Dict, NO_ROLE, Vec::new())?),
        Global::Other => Val::Global(Global::Other),
    })
}

/// A value kept whole, or why not.
pub(crate) enum Whole {
    /// The value, and the bytes charged for it (the caller gives them back,
    /// [`Budget::uncharge`], when it drops the value).
    Value(Value, u64),
    /// It expands past the size allowed.
    TooBig,
    /// It nests past the depth allowed.
    TooDeep,
}

/// `v` as a serde-pickle value (what the reader used to see), for the few
/// small parts of a snapshot kept as generic values (`allocator_settings`,
/// the keys of a foreign dict). A container inside itself reads as `None`,
/// as serde-pickle's `replace_recursive_structures` has it.
///
/// Bounded: memoized containers can be referenced at every level, so a few
/// hundred bytes can expand to gigabytes. The expansion is estimated as it
/// goes (a value's size, plus its text), charged to the budget, and stops
/// at `cap` bytes or [`ReadLimits::whole_value_depth`] levels. Errors: a
/// budget limit hit.
pub(crate) fn to_value(vm: &Vm, v: Val, frames: &dyn Fn(Val) -> Value, cap: u64) -> Result<Whole> {
    /// Estimated bytes of one value beside its text (the value, and its
    /// slot in a vector or map).
    const NODE: u64 = 2 * std::mem::size_of::<Value>() as u64;
    struct Walk<'a> {
        vm: &'a Vm,
        frames: &'a dyn Fn(Val) -> Value,
        open: Vec<u32>,
        level: usize,
        bytes: u64,
        cap: u64,
        depth: usize,
        stop: Option<Whole>,
        unhashable: Option<String>,
    }
    impl Walk<'_> {
        /// `None` once the walk is stopped (`stop` says why) or a limit hit.
        fn go(&mut self, v: Val) -> Option<Value> {
            let vm = self.vm;
            let text = match v {
                Val::Str(s) => vm.str(s).len(),
                Val::Bytes(b) => vm.bytes(b).len(),
                Val::Big(i) => (vm.big(i).bits() / 8) as usize,
                _ => 0,
            } as u64;
            let cost = NODE + text;
            if self.bytes + cost > self.cap {
                self.stop = Some(Whole::TooBig);
                return None;
            }
            if !vm.budget.spend(1 + self.open.len() as u64 + text / 64) || !vm.budget.charge(cost) {
                return None;
            }
            self.bytes += cost;
            Some(match v {
                Val::None | Val::Global(_) => Value::None,
                Val::Bool(b) => Value::Bool(b),
                Val::Int(i) => Value::I64(i),
                Val::Big(i) => Value::Int(vm.big(i).clone()),
                Val::Float(f) => Value::F64(f),
                Val::Str(s) => Value::String(vm.str(s).to_string()),
                Val::Bytes(b) => Value::Bytes(vm.bytes(b).to_vec()),
                Val::Frame(_) | Val::Stack(_) | Val::Dropped => (self.frames)(v),
                Val::Obj(i) => {
                    let o = vm.obj(i);
                    // Only a mutable container can be inside itself (the
                    // others are made from what exists): only those are open.
                    let mutable = !matches!(o.kind, Kind::Tuple | Kind::FrozenSet);
                    if mutable && self.open.contains(&i) {
                        return Some(Value::None);
                    }
                    if self.level >= self.depth {
                        self.stop = Some(Whole::TooDeep);
                        return None;
                    }
                    if mutable {
                        self.open.push(i);
                    }
                    self.level += 1;
                    // Grown as the items come: what is reserved up front is small.
                    let mut items = Vec::with_capacity(o.items.len().min(16));
                    for &x in &o.items {
                        items.push(self.go(x)?);
                    }
                    self.level -= 1;
                    if mutable {
                        self.open.pop();
                    }
                    let mut bad = None;
                    let mut hash = |x: Value| match x.into_hashable() {
                        Ok(h) => Some(h),
                        Err(e) => {
                            bad.get_or_insert(e.to_string());
                            None
                        }
                    };
                    match o.kind {
                        Kind::List => Value::List(items),
                        Kind::Tuple => Value::Tuple(items),
                        Kind::Set | Kind::FrozenSet => {
                            // Members were checked hashable when they landed.
                            let set = items.into_iter().filter_map(hash).collect();
                            if let Some(e) = bad {
                                self.unhashable = Some(e);
                                return None;
                            }
                            if o.kind == Kind::Set {
                                Value::Set(set)
                            } else {
                                Value::FrozenSet(set)
                            }
                        }
                        Kind::Dict => {
                            let mut map = std::collections::BTreeMap::new();
                            let mut it = items.into_iter();
                            while let (Some(k), Some(x)) = (it.next(), it.next()) {
                                if let Some(k) = hash(k) {
                                    map.insert(k, x);
                                }
                            }
                            if let Some(e) = bad {
                                self.unhashable = Some(e);
                                return None;
                            }
                            Value::Dict(map)
                        }
                    }
                }
            })
        }
    }
    let mut w = Walk {
        vm,
        frames,
        open: Vec::new(),
        level: 0,
        bytes: 0,
        cap,
        depth: vm.budget.limits().whole_value_depth,
        stop: None,
        unhashable: None,
    };
    let r = w.go(v);
    match (r, w.stop) {
        (Some(v), _) => Ok(Whole::Value(v, w.bytes)),
        (None, stop) => {
            vm.budget.uncharge(w.bytes);
            if vm.budget.exhausted() {
                return Err(vm.limit_err());
            }
            if let Some(e) = w.unhashable {
                return Err(ErrorKind::Pickle(e).into());
            }
            Ok(stop.unwrap_or(Whole::TooBig))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_pickle::{DeOptions, HashableValue, SerOptions};

    fn plain(bytes: &[u8]) -> Result<Value> {
        let (vm, v) = decode(bytes, &mut Plain)?;
        match to_value(&vm, v, &|_| Value::None, u64::MAX)? {
            Whole::Value(v, _) => Ok(v),
            _ => panic!("too big"),
        }
    }

    fn serde(bytes: &[u8]) -> Value {
        serde_pickle::value_from_slice(
            bytes,
            DeOptions::new()
                .decode_strings()
                .replace_unresolved_globals()
                .replace_recursive_structures(),
        )
        .unwrap()
    }

    #[test]
    fn reads_what_serde_pickle_writes_as_serde_pickle_reads_it() {
        let v = Value::Dict(
            [
                (HashableValue::String("a".into()), Value::I64(-5)),
                (
                    HashableValue::String("b".into()),
                    Value::List(vec![
                        Value::F64(1.5),
                        Value::None,
                        Value::Bool(true),
                        Value::Bytes(vec![0, 1, 255]),
                        Value::Tuple(vec![Value::I64(1 << 40), Value::String("é".into())]),
                        Value::Int("-123456789012345678901234567890".parse().unwrap()),
                    ]),
                ),
                (
                    HashableValue::I64(7),
                    Value::FrozenSet([HashableValue::I64(1)].into_iter().collect()),
                ),
            ]
            .into_iter()
            .collect(),
        );
        for opts in [SerOptions::new(), SerOptions::new().proto_v2()] {
            let b = serde_pickle::value_to_vec(&v, opts).unwrap();
            assert_eq!(plain(&b).unwrap(), serde(&b));
            assert_eq!(plain(&b).unwrap(), v);
        }
    }

    #[test]
    fn long1_sign_extends() {
        // LONG1 of -1 (one byte 0xff), of 2^63 (nine bytes), of -2^63 (eight bytes).
        let b = b"\x80\x02\x8a\x01\xff.";
        assert_eq!(plain(b).unwrap(), Value::I64(-1));
        let b = b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.";
        assert_eq!(
            plain(b).unwrap(),
            Value::Int("9223372036854775808".parse().unwrap())
        );
        let b = b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.";
        assert_eq!(plain(b).unwrap(), Value::I64(i64::MIN));
        assert_eq!(plain(b"\x80\x02\x8a\x00.").unwrap(), Value::I64(0));
    }

    #[test]
    fn a_memo_reference_shares_and_settling_frees() {
        // [d, d] where d = {'k': 1}, memoized once, fetched once.
        let b = b"\x80\x04]\x94(}\x94\x8c\x01k\x94K\x01sh\x01e.";
        let (mut vm, v) = decode(&b[..], &mut Plain).unwrap();
        let items = vm.items(v, &[Kind::List]).unwrap().to_vec();
        assert_eq!(items.len(), 2);
        assert_eq!(items[0], items[1], "the same container, not a copy");
        let Val::Obj(d) = items[0] else { panic!() };
        // Held by the list twice and by the memo.
        assert_eq!(vm.obj(d).rc, 3);
        vm.settle(items[0], Val::Dropped);
        assert_eq!(vm.obj(d).rc, 2);
        // The list is memoized too: settled and released, it frees its items.
        vm.settle(v, Val::Dropped);
        vm.release(v);
        assert_eq!(vm.obj(d).rc, 0, "freed with its list");
        assert!(vm.free.contains(&d));
    }
}
