//! `frag-adversary`: a size pattern that defeats best-fit caching.
//!
//! Each round:
//!
//! 1. the previous round's large blocks are freed (a caching allocator keeps
//!    their segments cached);
//! 2. `blocks` medium blocks (between `small_min_mb` and `small_max_mb`) are
//!    allocated: a best-fit cache carves them out of those cached segments, or
//!    packs them into 20 MiB segments;
//! 3. every other medium block is freed, leaving holes that each sit between
//!    two live blocks, so no segment can be released and no hole merges;
//! 4. large blocks (between `big_min_mb` and `big_max_mb`, all bigger than any
//!    hole) are requested, `big_ratio` times the bytes just freed: the cache
//!    cannot place them in the holes and needs new memory, while an allocator
//!    that remaps pages can reuse every hole's pages.
//!
//! Live medium blocks accumulate over the rounds; the last round's large
//! blocks stay live at the end. Sizes are multiples of `align_kb` (2 MiB by
//! default, like many activation tensors), so the pattern measures placement,
//! not rounding; set `align_kb=1` to add partial pages to the picture.
//! One stream (the pattern is synthetic, not a model of a multi-stream program).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{define_params, out_of_range, Buf, Recorder, MIB};
use crate::error::Result;
use crate::model::Trace;

define_params! {
    /// Parameters of `frag-adversary` (defaults: peak live about 25 GiB).
    FragAdversaryParams for "frag-adversary" {
        /// Random seed.
        seed: u64 = 0,
        /// Rounds of allocate, free every other, request larger.
        rounds: u32 [1, 1_000] = 4,
        /// Medium blocks allocated per round.
        blocks: u32 [1, 200_000] = 2000,
        /// Smallest medium block in MiB.
        small_min_mb: u64 [1, 65_536] = 2,
        /// Largest medium block in MiB (must be below big_min_mb).
        small_max_mb: u64 [1, 65_536] = 9,
        /// Smallest large block in MiB.
        big_min_mb: u64 [1, 1_048_576] = 12,
        /// Largest large block in MiB.
        big_max_mb: u64 [1, 1_048_576] = 64,
        /// Sizes are multiples of this many KiB (2048 = the 2 MiB page).
        align_kb: u64 [1, 1_048_576] = 2048,
        /// Bytes of large blocks requested per byte of holes left by a round.
        big_ratio: f64 [0.0, 10.0] = 1.0,
    }
}

/// Generates the trace (named `frag-adversary`).
pub fn generate(p: &FragAdversaryParams) -> Result<Trace> {
    validate(p)?;
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut r = Recorder::new();
    let align = p.align_kb * 1024;
    // A multiple of `align` in [lo, hi] (at least `align`).
    let draw = |rng: &mut ChaCha8Rng, lo_mb: u64, hi_mb: u64| {
        let x = rng.gen_range(lo_mb * MIB..=hi_mb * MIB);
        (x / align * align).max(align)
    };
    let mut bigs: Vec<Buf> = Vec::new();
    for _round in 0..p.rounds {
        super::check_events(r.len(), FragAdversaryParams::WORKLOAD, "rounds", p.rounds)?;
        for b in bigs.drain(..) {
            r.free(b);
        }
        let smalls: Vec<Buf> = (0..p.blocks)
            .map(|_| draw(&mut rng, p.small_min_mb, p.small_max_mb))
            .map(|s| r.alloc(s, 0))
            .collect();
        let mut freed = 0u64;
        for (i, b) in smalls.into_iter().enumerate() {
            if i % 2 == 1 {
                freed += b.size();
                r.free(b);
            } else {
                r.keep(b);
            }
        }
        let target = (freed as f64 * p.big_ratio) as u64;
        let mut got = 0u64;
        while got < target {
            let b = r.alloc(draw(&mut rng, p.big_min_mb, p.big_max_mb), 0);
            got += b.size();
            bigs.push(b);
        }
    }
    for b in bigs {
        r.keep(b);
    }
    r.finish(FragAdversaryParams::WORKLOAD)
}

fn validate(p: &FragAdversaryParams) -> Result<()> {
    let w = FragAdversaryParams::WORKLOAD;
    for (k, v) in [
        ("rounds", u64::from(p.rounds)),
        ("blocks", p.blocks.into()),
        ("small_min_mb", p.small_min_mb),
        ("align_kb", p.align_kb),
    ] {
        if v == 0 {
            return Err(out_of_range(w, k, v, "must be at least 1"));
        }
    }
    if p.small_max_mb < p.small_min_mb {
        return Err(out_of_range(
            w,
            "small_max_mb",
            p.small_max_mb,
            "must be at least small_min_mb",
        ));
    }
    if p.big_min_mb <= p.small_max_mb {
        return Err(out_of_range(
            w,
            "big_min_mb",
            p.big_min_mb,
            "must exceed small_max_mb (large blocks must not fit a hole)",
        ));
    }
    if p.big_max_mb < p.big_min_mb {
        return Err(out_of_range(
            w,
            "big_max_mb",
            p.big_max_mb,
            "must be at least big_min_mb",
        ));
    }
    if p.big_max_mb > 1 << 24 {
        return Err(out_of_range(
            w,
            "big_max_mb",
            p.big_max_mb,
            "must be at most 2^24 (16 TiB)",
        ));
    }
    if p.align_kb * 1024 > p.small_min_mb * MIB {
        return Err(out_of_range(
            w,
            "align_kb",
            p.align_kb,
            "must not exceed small_min_mb",
        ));
    }
    if !(0.0..=10.0).contains(&p.big_ratio) {
        return Err(out_of_range(
            w,
            "big_ratio",
            p.big_ratio,
            "must be in 0.0..=10.0",
        ));
    }
    Ok(())
}
