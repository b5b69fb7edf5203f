//! `rl-colocate`: reinforcement-learning post-training with the trainer and
//! the inference engine sharing one GPU (verl, OpenRLHF's "hybrid engine").
//!
//! Each iteration has two phases:
//!
//! - **generate**: the inference engine's weights (tag `weights`) and its
//!   preallocated KV cache (tag `kv_cache`, vLLM's `gpu_memory_utilization`
//!   block) serve `gen_steps` decode steps, each with short-lived
//!   activations and logits;
//! - **train**: the trainer's weights, fp32 master weights and Adam moments
//!   (tag `trainer`, 2 + 12 bytes per parameter) run `micro_batches`
//!   forward/backward passes (activations per layer, freed in reverse) and
//!   bf16 gradients (2 bytes per parameter), then the optimizer step; the
//!   new weights are copied into the inference engine (a transfer buffer).
//!
//! With sleep (vLLM's `sleep(level=1)` / `wake_up`), the phase not running
//! is paused: `weights` with a host backup, `kv_cache` dropped, `trainer`
//! with a host backup (verl offloads it to the CPU). Without sleep both
//! engines stay resident. [`generate`] gives the plain trace (no pauses),
//! which every policy replays; [`phase_needs`] replays the tagged plan on a
//! simulated device per policy and reports the device memory each phase
//! needs with and without sleep (only `expandable` can sleep).
//!
//! Sizes: 2 bytes per parameter for bf16 weights and gradients, 12 for the
//! fp32 master copy and Adam's two moments (the mixed-precision Adam budget,
//! Rajbhandari et al., "ZeRO", SC 2020, §3.1: 16 bytes per parameter in all).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

use super::{define_params, lognormal_clamped, out_of_range, Recorder, MIB};
use crate::error::Result;
use crate::model::Trace;
use vmmalloc_alloc::{AllocError, PolicySpec, Stream};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, GIB};

define_params! {
    /// Parameters of `rl-colocate` (defaults: a 2B-parameter policy model
    /// whose trainer needs about 36 GiB and inference engine about 24 GiB).
    RlColocateParams for "rl-colocate" {
        /// Random seed.
        seed: u64 = 0,
        /// Training iterations (each one generate phase and one train phase).
        iterations: u32 [1, 10_000] = 3,
        /// Model parameters in millions.
        params_m: u64 [1, 1_000_000] = 2000,
        /// Transformer layers (one weight tensor group per layer).
        layers: u32 [1, 1_000] = 24,
        /// KV cache preallocated by the inference engine, in MiB.
        kv_cache_mb: u64 [1, 16_777_216] = 16384,
        /// Decode steps per generate phase.
        gen_steps: u32 [0, 10_000] = 40,
        /// Micro-batches per train phase.
        micro_batches: u32 [1, 256] = 4,
        /// Median activation bytes per layer and micro-batch, in MiB.
        act_mb: u64 [1, 1_048_576] = 160,
    }
}

/// One step of the tagged plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RlOp {
    /// A phase begins (`generate`, `train`, or `setup`).
    Phase(&'static str),
    /// Allocation `id` of `size` bytes with `tag`.
    Alloc {
        /// Allocation id (index into the plan's allocations).
        id: usize,
        /// Requested bytes.
        size: u64,
        /// The tag (`""` = default).
        tag: &'static str,
    },
    /// Frees allocation `id`.
    Free(usize),
    /// Pauses tags; `backup` keeps their contents in host memory.
    Pause(&'static [&'static str], bool),
    /// Resumes tags.
    Resume(&'static [&'static str]),
}

fn validate(p: &RlColocateParams) -> Result<()> {
    let w = RlColocateParams::WORKLOAD;
    for (k, v) in [
        ("iterations", u64::from(p.iterations)),
        ("params_m", p.params_m),
        ("layers", p.layers.into()),
        ("kv_cache_mb", p.kv_cache_mb),
        ("micro_batches", p.micro_batches.into()),
        ("act_mb", p.act_mb),
    ] {
        if v == 0 {
            return Err(out_of_range(w, k, v, "must be at least 1"));
        }
    }
    if p.params_m > 1_000_000 {
        return Err(out_of_range(
            w,
            "params_m",
            p.params_m,
            "at most 1000000 (1T)",
        ));
    }
    Ok(())
}

/// The tagged plan: every allocation, free, pause and resume, in order.
pub fn plan(p: &RlColocateParams) -> Result<Vec<RlOp>> {
    validate(p)?;
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut ops = Vec::new();
    let mut next = 0usize;
    let mut alloc = |ops: &mut Vec<RlOp>, size: u64, tag: &'static str| {
        let id = next;
        next += 1;
        ops.push(RlOp::Alloc {
            id,
            size: size.max(1),
            tag,
        });
        id
    };
    let params = p.params_m * 1_000_000;
    let per_layer = |bytes_per_param: u64| params * bytes_per_param / u64::from(p.layers);
    ops.push(RlOp::Phase("setup"));
    // Trainer state: bf16 weights, fp32 master weights + Adam m and v.
    let mut trainer = Vec::new();
    for _ in 0..p.layers {
        trainer.push(alloc(&mut ops, per_layer(2), "trainer"));
        trainer.push(alloc(&mut ops, per_layer(4), "trainer"));
        trainer.push(alloc(&mut ops, per_layer(4), "trainer"));
        trainer.push(alloc(&mut ops, per_layer(4), "trainer"));
    }
    ops.push(RlOp::Pause(&["trainer"], true));
    // Inference engine: its own bf16 weights and the KV cache.
    for _ in 0..p.layers {
        alloc(&mut ops, per_layer(2), "weights");
    }
    alloc(&mut ops, p.kv_cache_mb * MIB, "kv_cache");
    for it in 0..p.iterations {
        super::check_events(
            ops.len(),
            RlColocateParams::WORKLOAD,
            "iterations",
            p.iterations,
        )?;
        ops.push(RlOp::Phase("generate"));
        if it > 0 {
            ops.push(RlOp::Resume(&["weights", "kv_cache"]));
        }
        for _ in 0..p.gen_steps {
            // Per decode step: hidden states, logits, sampling buffers.
            let a = alloc(
                &mut ops,
                lognormal_clamped(&mut rng, 96.0, 0.5, 8, 512) * MIB,
                "",
            );
            let b = alloc(&mut ops, rng.gen_range(32..=256) * MIB, "");
            ops.push(RlOp::Free(b));
            ops.push(RlOp::Free(a));
        }
        ops.push(RlOp::Pause(&["weights"], true));
        ops.push(RlOp::Pause(&["kv_cache"], false));
        ops.push(RlOp::Phase("train"));
        ops.push(RlOp::Resume(&["trainer"]));
        let mut grads = Vec::new();
        for mb in 0..p.micro_batches {
            let acts: Vec<usize> = (0..p.layers)
                .map(|_| {
                    let s = lognormal_clamped(&mut rng, p.act_mb as f64, 0.3, 1, 8 * p.act_mb);
                    alloc(&mut ops, s * MIB, "")
                })
                .collect();
            for a in acts.into_iter().rev() {
                if mb == 0 {
                    // Gradients appear in the first backward pass and accumulate.
                    grads.push(alloc(&mut ops, per_layer(2), "trainer"));
                }
                ops.push(RlOp::Free(a));
            }
        }
        // Optimizer step, then the weight transfer to the inference engine.
        for g in grads {
            ops.push(RlOp::Free(g));
        }
        let xfer = alloc(&mut ops, per_layer(2), "");
        ops.push(RlOp::Free(xfer));
        ops.push(RlOp::Pause(&["trainer"], true));
    }
    Ok(ops)
}

/// Generates the plain trace (named `rl-colocate`): the plan's allocations
/// and frees, without pauses (both engines resident), on one stream.
pub fn generate(p: &RlColocateParams) -> Result<Trace> {
    let ops = plan(p)?;
    let mut r = Recorder::new();
    let mut bufs = Vec::new();
    for op in ops {
        match op {
            RlOp::Alloc { id, size, .. } => {
                debug_assert_eq!(id, bufs.len());
                bufs.push(Some(r.alloc(size, 0)));
            }
            RlOp::Free(id) => {
                if let Some(b) = bufs[id].take() {
                    r.free(b);
                }
            }
            _ => {}
        }
    }
    for b in bufs.into_iter().flatten() {
        r.keep(b);
    }
    r.finish(RlColocateParams::WORKLOAD)
}

/// The parameters of a workload spec `rl-colocate[:key=value,...]`; `None`
/// when the spec names another workload.
pub fn params_from_spec(spec: &str) -> Option<Result<RlColocateParams>> {
    let spec = spec.trim();
    let (name, overrides) = spec.split_once(':').unwrap_or((spec, ""));
    if name != RlColocateParams::WORKLOAD {
        return None;
    }
    // The same overrides, split as `workload_by_name` splits them (an item
    // that is not `key=value` is an error, never skipped).
    let mut p = RlColocateParams::default();
    let set = |p: &mut RlColocateParams| -> Result<()> {
        for (k, v) in super::parse_overrides(RlColocateParams::WORKLOAD, overrides)? {
            p.set(k, v)?;
        }
        Ok(())
    };
    Some(set(&mut p).map(|()| p))
}

/// The device memory one phase needs under one policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseNeed {
    /// `generate` or `train`.
    pub phase: &'static str,
    /// Peak device memory the policy held in this phase (all iterations)
    /// with both engines resident.
    pub without_sleep: u64,
    /// The same with the idle engine paused; `Err` says why the policy
    /// cannot (only `expandable` can sleep).
    pub with_sleep: std::result::Result<u64, String>,
}

/// Replays the plan with `spec` on a simulated device of `capacity` bytes
/// (`sleep`: with pauses and resumes) and returns, per phase, the peak device
/// memory in use (`cuMemGetInfo`'s total − free on the sim).
fn run_plan(
    ops: &[RlOp],
    spec: &PolicySpec,
    capacity: u64,
    sleep: bool,
) -> std::result::Result<Vec<(&'static str, u64)>, String> {
    let dev: Arc<dyn Device> = Arc::new(SimDevice::with_capacity(capacity));
    let a = vmmalloc_alloc::build(spec.policy, dev.clone(), &spec.options)
        .map_err(|e| e.to_string())?;
    let used = || dev.mem_info().map(|m| m.total - m.free).unwrap_or(0);
    let mut ptrs: Vec<Option<u64>> = Vec::new();
    let mut phases: Vec<(&'static str, u64)> = Vec::new();
    let mut phase = "setup";
    let result = (|| {
        for op in ops {
            match op {
                RlOp::Phase(p) => phase = p,
                RlOp::Alloc { size, tag, .. } => {
                    vmmalloc_alloc::set_thread_tag(tag).map_err(|e| e.to_string())?;
                    let r = a.malloc(*size, Stream::DEFAULT);
                    vmmalloc_alloc::set_thread_tag("").map_err(|e| e.to_string())?;
                    ptrs.push(Some(r.map_err(|e| e.to_string())?.ptr));
                }
                RlOp::Free(id) => {
                    if let Some(p) = ptrs[*id].take() {
                        a.free(p).map_err(|e| e.to_string())?;
                    }
                }
                RlOp::Pause(tags, backup) if sleep => {
                    let t: Vec<String> = tags.iter().map(|s| s.to_string()).collect();
                    // The sim holds no bytes: a backup is host memory, not
                    // device memory, so the figures do not depend on it.
                    let _ = backup;
                    vmmalloc_alloc::sleep_of(&*a)
                        .and_then(|s| s.pause(&t, false))
                        .map_err(sleep_err)?;
                }
                RlOp::Resume(tags) if sleep => {
                    let t: Vec<String> = tags.iter().map(|s| s.to_string()).collect();
                    vmmalloc_alloc::sleep_of(&*a)
                        .and_then(|s| s.resume(&t))
                        .map_err(sleep_err)?;
                }
                RlOp::Pause(..) | RlOp::Resume(..) => {}
            }
            let u = used();
            match phases.iter_mut().find(|(p, _)| *p == phase) {
                Some(e) => e.1 = e.1.max(u),
                None => phases.push((phase, u)),
            }
        }
        Ok(())
    })();
    vmmalloc_alloc::set_thread_tag("").map_err(|e| e.to_string())?;
    result.map(|()| phases)
}

fn sleep_err(e: AllocError) -> String {
    match e {
        AllocError::Sleep(m) if m.contains("cannot") => "cannot sleep".to_string(),
        e => e.to_string(),
    }
}

/// The device memory each phase (`generate`, `train`) needs under `spec`,
/// with and without sleep, replayed on a simulated device large enough for
/// both engines (`capacity`, e.g. 141 GiB).
pub fn phase_needs(
    p: &RlColocateParams,
    spec: &PolicySpec,
    capacity: u64,
) -> Result<Vec<PhaseNeed>> {
    let ops = plan(p)?;
    let without = run_plan(&ops, spec, capacity, false);
    let with = run_plan(&ops, spec, capacity, true);
    let mut out = Vec::new();
    for phase in ["generate", "train"] {
        let pick = |r: &std::result::Result<Vec<(&'static str, u64)>, String>| {
            r.clone().and_then(|v| {
                v.iter()
                    .find(|(p, _)| *p == phase)
                    .map(|&(_, b)| b)
                    .ok_or_else(|| format!("no {phase} phase"))
            })
        };
        out.push(PhaseNeed {
            phase,
            without_sleep: pick(&without).unwrap_or(0),
            with_sleep: pick(&with),
        });
    }
    Ok(out)
}

/// A device large enough for both engines at the given parameters (for
/// [`phase_needs`]): 16 bytes per parameter for the trainer, 2 for the
/// inference weights, the KV cache, activations and slack, rounded up to GiB.
pub fn roomy_capacity(p: &RlColocateParams) -> u64 {
    // Saturating: absurd parameters give an absurd size for the caller to
    // refuse, never an overflow.
    let params = p.params_m.saturating_mul(1_000_000);
    let acts = u64::from(p.layers)
        .saturating_mul(p.act_mb)
        .saturating_mul(MIB * 8);
    params
        .saturating_mul(20)
        .saturating_add(p.kv_cache_mb.saturating_mul(MIB))
        .saturating_add(acts)
        .saturating_add(8 * GIB)
        .div_ceil(GIB)
        .saturating_mul(GIB)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmmalloc_alloc::Policy;

    fn small() -> RlColocateParams {
        RlColocateParams {
            iterations: 2,
            params_m: 200,
            layers: 4,
            kv_cache_mb: 1024,
            gen_steps: 4,
            micro_batches: 2,
            act_mb: 32,
            ..RlColocateParams::default()
        }
    }

    #[test]
    fn trace_is_deterministic_and_frees_what_it_allocates_once() {
        let p = small();
        let a = generate(&p).unwrap();
        let b = generate(&p).unwrap();
        assert_eq!(a.devices[0].events(), b.devices[0].events());
        assert!(a.num_events() > 20);
    }

    #[test]
    fn sleep_lowers_what_each_phase_needs_on_expandable_only() {
        let p = small();
        let cap = roomy_capacity(&p);
        let exp = phase_needs(&p, &PolicySpec::plain(Policy::Expandable), cap).unwrap();
        let params = p.params_m * 1_000_000;
        for n in &exp {
            let with = *n.with_sleep.as_ref().unwrap();
            assert!(with < n.without_sleep, "{n:?}");
        }
        // Generate with sleep holds no trainer state (14 bytes per parameter
        // less); train holds no inference weights nor KV cache.
        let gen = &exp[0];
        assert!(gen.without_sleep - gen.with_sleep.clone().unwrap() >= params * 14 * 95 / 100);
        let train = &exp[1];
        assert!(
            train.without_sleep - train.with_sleep.clone().unwrap()
                >= (params * 2 + p.kv_cache_mb * MIB) * 95 / 100
        );
        let caching = phase_needs(&p, &PolicySpec::plain(Policy::Caching), cap).unwrap();
        for n in &caching {
            assert_eq!(n.with_sleep, Err("cannot sleep".to_string()));
            assert!(n.without_sleep > 0);
        }
    }

    #[test]
    fn bad_parameters_name_the_key() {
        let mut p = small();
        p.layers = 0;
        assert!(plan(&p).unwrap_err().to_string().contains("layers"));
    }
}
