//! The snapshot reader's own budget: memory and work bounded by the input's
//! size, whatever the pickle (docs/trace-format.md, "Limits").
//!
//! A pickle is a program: a few hundred bytes can ask for gigabytes (a memo
//! index of 2^32, a list memoized and referenced by a list of itself, twenty
//! times over) or for hours (one huge tuple used as a key again and again).
//! The reader therefore counts what it holds and what it does, and stops with
//! one [`ErrorKind::Limit`] naming the limit as soon as either would pass its
//! bound:
//!
//! - **memory**: the bytes the reader holds (its stack, memo, containers,
//!   strings, and the events, segments and stacks it keeps), charged *before*
//!   they are allocated, never more than `memory_base + memory_per_input_byte
//!   × bytes read so far`;
//! - **work**: the steps that are not paid for by input bytes (a dict's
//!   fields looked up, a list copied, a value expanded), never more than
//!   `work_base + work_per_input_byte × bytes read so far`;
//! - **whole values**: `allocator_settings`, the one value the reader keeps
//!   whole (as text), expands to at most `whole_value_bytes` and nests at
//!   most `whole_value_depth` deep (a foreign dict's keys, kept only for a
//!   message, are cut at 4 KiB instead).
//!
//! The counters are deterministic (they depend on the input alone), so tests
//! assert them exactly: [`ReadStats::peak_held`] never exceeds
//! [`ReadLimits::memory_bound`] of the bytes read.

use std::cell::Cell;
use std::rc::Rc;

use crate::error::{ErrorKind, TraceError};

/// The reader's limits. [`Default`] is what every command uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadLimits {
    /// Bytes the reader may hold whatever the input (default 48 MiB).
    pub memory_base: u64,
    /// Further bytes it may hold per input byte read (default 1.5).
    pub memory_per_input_byte: f64,
    /// Steps it may take whatever the input (default 2^27).
    pub work_base: u64,
    /// Further steps per input byte read (default 64).
    pub work_per_input_byte: u64,
    /// Bytes a value kept whole may expand to (default 16 MiB).
    pub whole_value_bytes: u64,
    /// Depth a value kept whole may nest to (default 1,000).
    pub whole_value_depth: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            memory_base: 48 << 20,
            memory_per_input_byte: 1.5,
            work_base: 1 << 27,
            work_per_input_byte: 64,
            whole_value_bytes: 16 << 20,
            whole_value_depth: 1_000,
        }
    }
}

impl ReadLimits {
    /// The most bytes the reader may hold once it has read `input` bytes.
    pub fn memory_bound(&self, input: u64) -> u64 {
        self.memory_base
            .saturating_add((input as f64 * self.memory_per_input_byte) as u64)
    }

    /// The most steps the reader may take once it has read `input` bytes.
    pub fn work_bound(&self, input: u64) -> u64 {
        self.work_base
            .saturating_add(input.saturating_mul(self.work_per_input_byte))
    }
}

/// What one read cost, by the reader's own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Input bytes read.
    pub input_bytes: u64,
    /// The most bytes the reader held at once.
    pub peak_held: u64,
    /// Steps taken (see [`ReadLimits::work_base`]).
    pub work: u64,
}

/// Which limit a read hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hit {
    Memory,
    Work,
    WholeBytes,
    WholeDepth,
}

/// The counters of one read. Interior mutability: parts of the reader that
/// only look at the pickle machine still count their steps.
pub(crate) struct Budget {
    limits: ReadLimits,
    held: Cell<u64>,
    peak: Cell<u64>,
    work: Cell<u64>,
    /// Input bytes read (shared with the reader's buffer, which brings it up
    /// to date each time it reads more).
    read: Rc<Cell<u64>>,
    /// The memory and work bounds at some earlier `read` (never above the
    /// bounds now: they only grow); recomputed when a count passes them.
    memory_bound: Cell<u64>,
    work_bound: Cell<u64>,
    hit: Cell<Option<(Hit, u64)>>,
}

impl Budget {
    pub fn new(limits: ReadLimits) -> Budget {
        Budget {
            limits: limits.clone(),
            held: Cell::new(0),
            peak: Cell::new(0),
            work: Cell::new(0),
            read: Rc::new(Cell::new(0)),
            memory_bound: Cell::new(limits.memory_bound(0)),
            work_bound: Cell::new(limits.work_bound(0)),
            hit: Cell::new(None),
        }
    }

    pub fn limits(&self) -> &ReadLimits {
        &self.limits
    }

    /// `n` input bytes have been read in all.
    #[cfg(test)]
    pub fn set_read(&self, n: u64) {
        self.read.set(n);
    }

    /// The count of input bytes read, for the reader's buffer to keep.
    pub fn read_counter(&self) -> Rc<Cell<u64>> {
        self.read.clone()
    }

    /// Records the first limit hit (later ones are consequences).
    pub fn hit_limit(&self, h: Hit) {
        if self.hit.get().is_none() {
            self.hit.set(Some((h, self.read.get())));
        }
    }

    /// Whether a limit was hit: the read is over, whatever code notices first.
    #[inline]
    pub fn exhausted(&self) -> bool {
        self.hit.get().is_some()
    }

    /// Takes `n` more bytes, if the bound allows; `false` (and the limit hit)
    /// if not, and then nothing is charged: the caller must not allocate.
    #[inline]
    pub fn charge(&self, n: u64) -> bool {
        let held = self.held.get().saturating_add(n);
        if held > self.memory_bound.get() {
            self.memory_bound
                .set(self.limits.memory_bound(self.read.get()));
            if held > self.memory_bound.get() {
                self.hit_limit(Hit::Memory);
                return false;
            }
        }
        self.held.set(held);
        if held > self.peak.get() {
            self.peak.set(held);
        }
        true
    }

    /// Gives back `n` bytes charged before.
    #[inline]
    pub fn uncharge(&self, n: u64) {
        self.held.set(self.held.get().saturating_sub(n));
    }

    /// Takes `n` more steps, if the bound allows; `false` (and the limit hit)
    /// if not: the caller stops what it is doing.
    #[inline]
    pub fn spend(&self, n: u64) -> bool {
        let w = self.work.get().saturating_add(n);
        self.work.set(w);
        if w > self.work_bound.get() {
            self.work_bound.set(self.limits.work_bound(self.read.get()));
            if w > self.work_bound.get() {
                self.hit_limit(Hit::Work);
                return false;
            }
        }
        true
    }

    /// The counters so far.
    pub fn stats(&self) -> ReadStats {
        ReadStats {
            input_bytes: self.read.get(),
            peak_held: self.peak.get(),
            work: self.work.get(),
        }
    }

    /// The error for the limit hit, if one was, found at input byte `at`.
    pub fn error(&self, at: u64) -> Option<TraceError> {
        let (hit, read) = self.hit.get()?;
        let l = &self.limits;
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
        let (limit, bound) = match hit {
            Hit::Memory => (
                "memory",
                format!(
                    "{} + {} x input = {}",
                    mib(l.memory_base),
                    l.memory_per_input_byte,
                    mib(l.memory_bound(read))
                ),
            ),
            Hit::Work => (
                "work",
                format!(
                    "{} + {} x input = {} steps",
                    l.work_base,
                    l.work_per_input_byte,
                    l.work_bound(read)
                ),
            ),
            Hit::WholeBytes => (
                "whole-value size",
                format!(
                    "allocator_settings expands past {}",
                    mib(l.whole_value_bytes)
                ),
            ),
            Hit::WholeDepth => (
                "whole-value depth",
                format!(
                    "allocator_settings nests deeper than {}",
                    l.whole_value_depth
                ),
            ),
        };
        Some(ErrorKind::Limit { limit, bound, at }.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_past_the_bound_is_refused_and_not_counted() {
        let b = Budget::new(ReadLimits {
            memory_base: 100,
            memory_per_input_byte: 2.0,
            ..ReadLimits::default()
        });
        assert!(b.charge(100));
        assert!(!b.charge(1));
        assert_eq!(b.stats().peak_held, 100);
        assert!(b.exhausted());
        let e = b.error(0).expect("a limit was hit").to_string();
        assert!(e.contains("memory limit"), "{e}");
        assert!(e.contains("at byte 0"), "{e}");
    }

    #[test]
    fn the_bound_grows_with_the_input() {
        let b = Budget::new(ReadLimits {
            memory_base: 100,
            memory_per_input_byte: 2.0,
            work_base: 10,
            work_per_input_byte: 3,
            ..ReadLimits::default()
        });
        b.set_read(50);
        assert!(b.charge(200));
        assert!(!b.exhausted());
        b.uncharge(200);
        assert!(b.spend(160));
        assert!(!b.spend(1));
        assert!(b.error(7).unwrap().to_string().contains("work limit"));
    }
}
