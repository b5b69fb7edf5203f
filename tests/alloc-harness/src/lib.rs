//! Test helpers shared by every policy's tests: a crate of its own, never
//! shipped (`publish = false`), so the allocator library carries no test
//! scaffolding.
//!
//! - [`Harness`]: drives any [`Allocator`] over any [`Device`] with [`Op`]s,
//!   keeping a shadow model of live allocations (no overlap, alignment, size,
//!   stream), calling `validate()` after every step, queueing stream work on
//!   model devices so stream-safety bugs surface as unmap failures, and — on
//!   devices with memory — filling each block with a pattern derived from its
//!   id and verifying it at free and after every reclaim (data integrity).
//! - [`RandomOps`]: a seeded generator of operation sequences (no dependency
//!   on a random-number crate, so it can live in the library).
//! - [`pattern_fill`] / [`pattern_check`]: the integrity pattern itself.

#![warn(missing_docs)]

use std::collections::BTreeMap;
use vmmalloc_alloc::{AllocError, Allocation, Allocator, OomReport};
use vmmalloc_device::{Device, Stream};

/// SplitMix64: a tiny, good-enough seeded generator.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    /// A value in `[0, n)` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// A size between `lo` and `hi` (inclusive), log-uniform.
    pub fn log_size(&mut self, lo: u64, hi: u64) -> u64 {
        let (lo, hi) = (lo.max(1), hi.max(lo.max(1)));
        let bits_lo = 63 - lo.leading_zeros();
        let bits_hi = 63 - hi.leading_zeros();
        let b = bits_lo + self.below(u64::from(bits_hi - bits_lo) + 1) as u32;
        let base = 1u64 << b;
        let v = base + self.below(base);
        v.clamp(lo, hi)
    }
}

/// The SplitMix64 finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Byte `offset` of the integrity pattern of block `id`.
fn pattern_word(id: u64, word: u64) -> u64 {
    mix(id.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ word)
}

/// The pattern bytes of block `id` at `[offset, offset + len)`.
pub fn pattern_bytes(id: u64, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let o = offset + i;
            (pattern_word(id, o / 8) >> ((o % 8) * 8)) as u8
        })
        .collect()
}

/// The sampled ranges of a block of `len` bytes that carry the pattern: the
/// whole block when small, else a 256-byte chunk every 64 KiB and the last
/// 256 bytes (so every page of every block is touched).
pub fn pattern_ranges(len: u64) -> Vec<(u64, u64)> {
    const FULL: u64 = 256 << 10;
    const STRIDE: u64 = 64 << 10;
    const CHUNK: u64 = 256;
    if len <= FULL {
        return vec![(0, len)];
    }
    let mut v: Vec<(u64, u64)> = (0..len / STRIDE).map(|i| (i * STRIDE, CHUNK)).collect();
    v.push((len - CHUNK, CHUNK));
    v
}

/// Writes block `id`'s pattern into `[ptr, ptr + len)` on the device.
pub fn pattern_fill(dev: &dyn Device, id: u64, ptr: u64, len: u64) -> Result<(), String> {
    for (o, n) in pattern_ranges(len) {
        dev.copy_to_device(ptr + o, &pattern_bytes(id, o, n as usize))
            .map_err(|e| format!("filling block {id} at {ptr:#x}+{o:#x}: {e}"))?;
    }
    Ok(())
}

/// Checks block `id`'s pattern in `[ptr, ptr + len)`.
pub fn pattern_check(dev: &dyn Device, id: u64, ptr: u64, len: u64) -> Result<(), String> {
    for (o, n) in pattern_ranges(len) {
        let mut buf = vec![0u8; n as usize];
        dev.copy_from_device(ptr + o, &mut buf)
            .map_err(|e| format!("reading block {id} at {ptr:#x}+{o:#x}: {e}"))?;
        if buf != pattern_bytes(id, o, n as usize) {
            let at = buf
                .iter()
                .zip(pattern_bytes(id, o, n as usize))
                .position(|(a, b)| *a != b)
                .unwrap_or(0);
            return Err(format!(
                "block {id} at {ptr:#x}: data lost at byte {:#x} (of {len:#x})",
                o + at as u64
            ));
        }
    }
    Ok(())
}

/// One step of a workload. Slots and streams are taken modulo the number of
/// live allocations / streams, so any value is valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on stream `stream`.
    Malloc {
        /// Bytes.
        size: u64,
        /// Stream index.
        stream: usize,
    },
    /// Free the live allocation at `slot`.
    Free {
        /// Live-allocation index.
        slot: usize,
    },
    /// `record_stream` the allocation at `slot` on stream `stream`, and queue
    /// work there that uses it (on model devices).
    RecordStream {
        /// Live-allocation index.
        slot: usize,
        /// Stream index.
        stream: usize,
    },
    /// Queue work on the allocation's own stream that uses it (model devices).
    Submit {
        /// Live-allocation index.
        slot: usize,
    },
    /// Let every queued item on a stream finish (model devices).
    Complete {
        /// Stream index.
        stream: usize,
    },
    /// `empty_cache()`.
    EmptyCache,
}

/// What an operation did.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// It succeeded (or did nothing, e.g. a free with nothing live).
    Done,
    /// A malloc failed with out-of-memory.
    Oom(Box<OomReport>),
    /// A call failed with a device error (only when
    /// [`Harness::tolerate_device_errors`] is set).
    DeviceError(String),
}

/// A live allocation in the shadow model.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// Block id (pattern seed).
    pub id: u64,
    /// The allocation.
    pub alloc: Allocation,
}

/// Drives an allocator with [`Op`]s and checks it against a shadow model.
pub struct Harness<'a> {
    alloc: &'a dyn Allocator,
    dev: &'a dyn Device,
    /// The streams ops refer to (index 0 = the default stream).
    pub streams: Vec<Stream>,
    /// Live allocations, in allocation order.
    pub live: Vec<Live>,
    next_id: u64,
    integrity: bool,
    /// Accept device errors from operations (fault injection): they are
    /// reported as [`Outcome::DeviceError`] instead of failing the run.
    pub tolerate_device_errors: bool,
    /// Out-of-memory errors seen.
    pub ooms: u64,
    /// Operations applied.
    pub steps: u64,
    /// Check that a new allocation's whole block (`size`) is accessible, not
    /// only its `requested` bytes (default true; `native` hands out exactly
    /// the driver allocation, which may be shorter than its 512 B-rounded size).
    pub check_whole_block: bool,
    /// Compare the stats with PyTorch's semantics: `allocated_bytes` falls at
    /// `free()`, while `requested_bytes` falls only once the block is really
    /// freed (after the streams that used it), as in `CUDACachingAllocator.cpp`
    /// `free()` / `free_block()`. Default false: `requested_bytes` is checked
    /// against the live allocations (the expandable allocator's semantics).
    pub pytorch_stats: bool,
}

impl<'a> Harness<'a> {
    /// A harness over `alloc` (which draws from `dev`) with `streams` streams
    /// (the default stream plus `streams - 1` new ones).
    pub fn new(
        alloc: &'a dyn Allocator,
        dev: &'a dyn Device,
        streams: usize,
    ) -> Result<Self, String> {
        let mut s = vec![Stream::DEFAULT];
        for _ in 1..streams.max(1) {
            s.push(
                dev.create_stream()
                    .map_err(|e| format!("create_stream: {e}"))?,
            );
        }
        Ok(Harness {
            alloc,
            dev,
            streams: s,
            live: Vec::new(),
            next_id: 1,
            integrity: dev.caps().has_memory,
            tolerate_device_errors: false,
            ooms: 0,
            steps: 0,
            check_whole_block: true,
            pytorch_stats: false,
        })
    }

    fn device_error(&self, what: &str, e: AllocError) -> Result<Outcome, String> {
        match e {
            AllocError::Device(d) if self.tolerate_device_errors => {
                Ok(Outcome::DeviceError(format!("{what}: {d}")))
            }
            e => Err(format!("{what}: unexpected error: {e}")),
        }
    }

    /// Checks a new allocation against the shadow model.
    fn check_new(&self, a: &Allocation, size: u64, stream: Stream) -> Result<(), String> {
        if !a.ptr.is_multiple_of(512) || a.size < size || a.requested != size || a.stream != stream
        {
            return Err(format!("malloc({size}) on {stream} returned {a:?}"));
        }
        for l in &self.live {
            let (p, e) = (l.alloc.ptr, l.alloc.ptr + l.alloc.size);
            if a.ptr < e && p < a.ptr + a.size {
                return Err(format!("new allocation {a:?} overlaps live {:?}", l.alloc));
            }
        }
        let len = if self.check_whole_block {
            a.size
        } else {
            a.requested
        };
        if let Some(m) = self.dev.introspect() {
            if !m.is_accessible(a.ptr, len) {
                return Err(format!("new allocation {a:?} is not accessible"));
            }
        }
        Ok(())
    }

    /// Verifies the pattern of every live block (devices with memory).
    pub fn verify_all(&self) -> Result<(), String> {
        if self.integrity {
            for l in &self.live {
                pattern_check(self.dev, l.id, l.alloc.ptr, l.alloc.requested)?;
            }
        }
        Ok(())
    }

    fn slot(&self, slot: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| slot % self.live.len())
    }

    /// Applies one operation (without validating).
    pub fn apply(&mut self, op: &Op) -> Result<Outcome, String> {
        self.steps += 1;
        let model = self.dev.introspect();
        match *op {
            Op::Malloc { size, stream } => {
                let s = self.streams[stream % self.streams.len()];
                let moved = |st: vmmalloc_alloc::Stats| {
                    (
                        st.reclaims,
                        st.chunk_splits,
                        st.chunk_unpins,
                        st.unpin_device_syncs,
                    )
                };
                let before = moved(self.alloc.stats());
                let result = self.alloc.malloc(size, s);
                if result.is_err() && moved(self.alloc.stats()) != before {
                    // Pages moved before the request failed: the live
                    // blocks must still hold their bytes.
                    self.verify_all()?;
                }
                match result {
                    Ok(a) => {
                        self.check_new(&a, size, s)?;
                        let id = self.next_id;
                        self.next_id += 1;
                        if self.integrity {
                            pattern_fill(self.dev, id, a.ptr, a.requested)?;
                        }
                        self.live.push(Live { id, alloc: a });
                        if moved(self.alloc.stats()) != before {
                            // Pages moved: every surviving block must still hold its bytes.
                            self.verify_all()?;
                        }
                        Ok(Outcome::Done)
                    }
                    Err(AllocError::OutOfMemory(r)) => {
                        self.ooms += 1;
                        Ok(Outcome::Oom(r))
                    }
                    Err(e) => self.device_error(&format!("malloc({size}) on {s}"), e),
                }
            }
            Op::Free { slot } => {
                let Some(i) = self.slot(slot) else {
                    return Ok(Outcome::Done);
                };
                let l = self.live[i];
                if self.integrity {
                    pattern_check(self.dev, l.id, l.alloc.ptr, l.alloc.requested)?;
                }
                match self.alloc.free(l.alloc.ptr) {
                    Ok(()) => {
                        self.live.remove(i);
                        if self.alloc.free(l.alloc.ptr).is_ok() {
                            return Err(format!("double free of {:#x} was accepted", l.alloc.ptr));
                        }
                        Ok(Outcome::Done)
                    }
                    Err(e) => self.device_error(&format!("free({:#x})", l.alloc.ptr), e),
                }
            }
            Op::RecordStream { slot, stream } => {
                let Some(i) = self.slot(slot) else {
                    return Ok(Outcome::Done);
                };
                let l = self.live[i];
                let s = self.streams[stream % self.streams.len()];
                match self.alloc.record_stream(l.alloc.ptr, s) {
                    Ok(()) => {
                        if let Some(m) = model {
                            m.streams()
                                .submit(s, l.alloc.ptr, l.alloc.size)
                                .map_err(|e| format!("submit: {e}"))?;
                        }
                        Ok(Outcome::Done)
                    }
                    Err(e) => self.device_error("record_stream", e),
                }
            }
            Op::Submit { slot } => {
                let Some(i) = self.slot(slot) else {
                    return Ok(Outcome::Done);
                };
                let l = self.live[i];
                if let Some(m) = model {
                    m.streams()
                        .submit(l.alloc.stream, l.alloc.ptr, l.alloc.size)
                        .map_err(|e| format!("submit: {e}"))?;
                }
                Ok(Outcome::Done)
            }
            Op::Complete { stream } => {
                if let Some(m) = model {
                    let s = self.streams[stream % self.streams.len()];
                    m.streams()
                        .complete(s)
                        .map_err(|e| format!("complete: {e}"))?;
                }
                Ok(Outcome::Done)
            }
            Op::EmptyCache => match self.alloc.empty_cache() {
                Ok(()) => {
                    self.verify_all()?;
                    Ok(Outcome::Done)
                }
                Err(e) => self.device_error("empty_cache", e),
            },
        }
    }

    /// `validate()`, the device model's own check, and the shadow model.
    pub fn check(&self) -> Result<(), String> {
        self.alloc
            .validate()
            .map_err(|e| format!("validate: {e}"))?;
        if let Some(m) = self.dev.introspect() {
            m.check().map_err(|e| format!("device model: {e}"))?;
        }
        let mut by_addr: BTreeMap<u64, u64> = BTreeMap::new();
        for l in &self.live {
            by_addr.insert(l.alloc.ptr, l.alloc.size);
        }
        let mut end = 0;
        for (&p, &s) in &by_addr {
            if p < end {
                return Err(format!("live allocations overlap at {p:#x}"));
            }
            end = p + s;
        }
        let st = self.alloc.stats();
        if self.pytorch_stats {
            let want: u64 = self.live.iter().map(|l| l.alloc.size).sum();
            if st.allocated_bytes.all().current != want as i64
                || st.allocation.all().current != self.live.len() as i64
            {
                return Err(format!(
                    "stats count {} allocations / {} allocated bytes, the shadow {} / {want}",
                    st.allocation.all().current,
                    st.allocated_bytes.all().current,
                    self.live.len()
                ));
            }
            return Ok(());
        }
        let want: u64 = self.live.iter().map(|l| l.alloc.requested).sum();
        if st.requested_bytes.all().current != want as i64
            || st.allocation.all().current != self.live.len() as i64
        {
            return Err(format!(
                "stats count {} allocations / {} requested bytes, the shadow {} / {want}",
                st.allocation.all().current,
                st.requested_bytes.all().current,
                self.live.len()
            ));
        }
        Ok(())
    }

    /// Applies every op, checking after each; returns the outcomes.
    pub fn run(&mut self, ops: &[Op]) -> Result<Vec<Outcome>, String> {
        let mut out = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let o = self
                .apply(op)
                .map_err(|e| format!("step {i} ({op:?}): {e}"))?;
            self.check()
                .map_err(|e| format!("after step {i} ({op:?}): {e}"))?;
            out.push(o);
        }
        Ok(out)
    }

    /// Frees every live allocation (verifying each) and completes all streams.
    pub fn finish(&mut self) -> Result<(), String> {
        while !self.live.is_empty() {
            match self.apply(&Op::Free { slot: 0 })? {
                Outcome::Done => {}
                o => return Err(format!("final free failed: {o:?}")),
            }
        }
        if let Some(m) = self.dev.introspect() {
            m.streams().complete_all();
        }
        self.check()
    }
}

/// The mix of a random workload.
#[derive(Debug, Clone)]
pub struct OpMix {
    /// Smallest request.
    pub min_size: u64,
    /// Largest request.
    pub max_size: u64,
    /// Number of streams ops name.
    pub streams: usize,
    /// Relative weights: malloc, free, record_stream, submit, complete, empty_cache.
    pub weights: [u32; 6],
}

impl Default for OpMix {
    fn default() -> Self {
        OpMix {
            min_size: 1,
            max_size: 64 << 20,
            streams: 3,
            weights: [40, 30, 5, 10, 10, 1],
        }
    }
}

/// A seeded generator of [`Op`] sequences.
#[derive(Debug, Clone)]
pub struct RandomOps {
    rng: SplitMix,
    mix: OpMix,
}

impl RandomOps {
    /// A generator with a seed and a mix.
    pub fn new(seed: u64, mix: OpMix) -> Self {
        RandomOps {
            rng: SplitMix(seed),
            mix,
        }
    }

    /// The next op.
    pub fn next_op(&mut self) -> Op {
        let total: u64 = self.mix.weights.iter().map(|w| u64::from(*w)).sum();
        let mut r = self.rng.below(total.max(1));
        let mut kind = 0;
        for (i, w) in self.mix.weights.iter().enumerate() {
            if r < u64::from(*w) {
                kind = i;
                break;
            }
            r -= u64::from(*w);
        }
        let slot = self.rng.next_u64() as usize;
        let stream = self.rng.below(self.mix.streams as u64) as usize;
        match kind {
            0 => Op::Malloc {
                size: self.rng.log_size(self.mix.min_size, self.mix.max_size),
                stream,
            },
            1 => Op::Free { slot },
            2 => Op::RecordStream { slot, stream },
            3 => Op::Submit { slot },
            4 => Op::Complete { stream },
            _ => Op::EmptyCache,
        }
    }

    /// `n` ops.
    pub fn take(&mut self, n: usize) -> Vec<Op> {
        (0..n).map(|_| self.next_op()).collect()
    }
}

/// Allocates `sizes` on the default stream with this thread's tag set to
/// `tag` (sleep and wake), then restores the default tag. Panics on failure
/// (a test helper).
pub fn tagged<A: Allocator + ?Sized>(a: &A, tag: &str, sizes: &[u64]) -> Vec<Allocation> {
    vmmalloc_alloc::set_thread_tag(tag).unwrap();
    let out = sizes
        .iter()
        .map(|&s| a.malloc(s, Stream::DEFAULT).unwrap())
        .collect();
    vmmalloc_alloc::set_thread_tag("").unwrap();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_ranges_cover_every_64k_and_the_end() {
        assert_eq!(pattern_ranges(100), vec![(0, 100)]);
        let r = pattern_ranges(4 << 20);
        assert_eq!(r.len(), 65);
        assert_eq!(*r.last().unwrap(), ((4 << 20) - 256, 256));
        assert_ne!(pattern_bytes(1, 0, 64), pattern_bytes(2, 0, 64));
        assert_ne!(pattern_bytes(1, 0, 64), pattern_bytes(1, 64, 64));
    }

    #[test]
    fn log_sizes_stay_in_range_and_spread() {
        let mut r = SplitMix(7);
        let v: Vec<u64> = (0..1000).map(|_| r.log_size(1, 1 << 30)).collect();
        assert!(v.iter().all(|&s| (1..=1 << 30).contains(&s)));
        assert!(v.iter().any(|&s| s < 1024) && v.iter().any(|&s| s > 1 << 24));
    }
}
