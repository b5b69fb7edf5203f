//! `serve-kv`: LLM serving with a contiguous KV cache per request, as servers
//! without paged attention keep it (e.g. Hugging Face `generate` with a static
//! or growing cache): requests arrive at random (Poisson), are prefilled, then
//! decode one token per iteration; when a request's cache is full it is
//! **re-allocated** larger by a chunk of 16–64 tokens (drawn per request) and
//! the old one freed. One allocation holds all layers' keys and values.
//!
//! Per run: the model's weights (one allocation per tensor; by default a
//! Llama-3-8B shape in bf16, about 16 GB) are allocated first and live
//! throughout. Per iteration:
//!
//! - admission: while fewer than `max_running` requests run, the next queued
//!   request is prefilled: its token ids arrive on stream 1 (copy), its cache
//!   is allocated for the prompt, and prefill activations (`prompt·hidden`,
//!   `prompt·ffn`) and last-token logits come and go;
//! - decode: hidden states and MLP activations for the running batch, fp32
//!   logits (`batch·vocab`), the sampled ids copied out on stream 1 (freed an
//!   iteration later); each request grows by one token (re-allocating its cache
//!   when full), and finished requests free their cache.
//!
//! At the end the server drains: every remaining cache is freed.
//!
//! With `growable=1` each cache is a growable region instead (`reserve` +
//! `resize` events): the same growth in the same chunks, in place, with no
//! copy on a policy that has regions (vAttention, ASPLOS'25).

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{align_up, define_params, lognormal_clamped, out_of_range, poisson, Buf, Recorder};
use crate::error::Result;
use crate::model::Trace;

const COMPUTE: u64 = 0;
const COPY: u64 = 1;

define_params! {
    /// Parameters of `serve-kv` (defaults: a Llama-3-8B-shaped model with grouped-query
    /// attention, 128 KiB of KV cache per token; peak live about 25–35 GB).
    ServeKvParams for "serve-kv" {
        /// Random seed.
        seed: u64 = 0,
        /// Decode iterations.
        steps: u32 [1, 1_000_000] = 2000,
        /// Mean number of new requests per iteration (Poisson arrivals).
        arrival_rate: f64 [0.0, 1_000.0] = 0.2,
        /// Most requests decoded at once (the batch size limit).
        max_running: u32 [1, 4_096] = 64,
        /// Median prompt length in tokens (log-normal).
        prompt_median: f64 [1.0, 1_048_576.0] = 600.0,
        /// Log-space standard deviation of the prompt length.
        prompt_sigma: f64 [0.0, 10.0] = 0.8,
        /// Longest prompt in tokens.
        prompt_max: u64 [1, 1_048_576] = 8192,
        /// Median number of generated tokens (log-normal).
        output_median: f64 [1.0, 1_048_576.0] = 200.0,
        /// Log-space standard deviation of the number of generated tokens.
        output_sigma: f64 [0.0, 10.0] = 0.9,
        /// Most generated tokens per request.
        output_max: u64 [1, 1_048_576] = 4096,
        /// Transformer layers.
        layers: u64 [1, 1_000] = 32,
        /// Hidden size in elements.
        hidden: u64 [1, 65_536] = 4096,
        /// MLP width in elements.
        ffn: u64 [1, 1_048_576] = 14336,
        /// Key/value heads (grouped-query attention).
        kv_heads: u64 [1, 1_024] = 8,
        /// Elements per attention head.
        head_dim: u64 [1, 4_096] = 128,
        /// Vocabulary size (the logits are batch x vocab, fp32).
        vocab: u64 [1, 1_048_576] = 128256,
        /// Smallest cache growth chunk in tokens (each request draws one in [chunk_min, chunk_max]).
        chunk_min: u64 [1, 1_048_576] = 16,
        /// Largest cache growth chunk in tokens.
        chunk_max: u64 [1, 1_048_576] = 64,
        /// Bytes per weight, activation and cache element (2 = bf16).
        dtype_bytes: u64 [1, 16] = 2,
        /// 1: each request's cache is a growable region (reserved for the
        /// longest context, `prompt_max + output_max` tokens) that grows in
        /// place by the same chunks, the vAttention way; policies without
        /// regions reallocate and copy as with 0 (docs/expandable.md).
        growable: u64 [0, 1] = 0,
    }
}

struct Request {
    prompt: u64,
    output: u64,
    chunk: u64,
}

struct Running {
    cache: Buf,
    /// Tokens the cache holds room for.
    capacity: u64,
    /// Tokens in the cache.
    len: u64,
    /// Tokens still to generate.
    remaining: u64,
    chunk: u64,
}

/// Generates the trace (named `serve-kv`).
pub fn generate(p: &ServeKvParams) -> Result<Trace> {
    validate(p)?;
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut r = Recorder::new();
    let d = p.dtype_bytes;
    let (h, f) = (p.hidden, p.ffn);
    let kv_dim = p.kv_heads * p.head_dim;
    // K and V for every layer.
    let kv_per_token = 2 * p.layers * kv_dim * d;
    // The longest context a request can reach (a growable cache's maximum;
    // the chunk rounding can add up to `chunk_max` tokens).
    let max_context = p.prompt_max + p.output_max + p.chunk_max;

    // Weights: per layer q, k, v, o, gate, up, down, two norms; then embedding,
    // final norm, output head.
    for _layer in 0..p.layers {
        for e in [
            h * h,
            h * kv_dim,
            h * kv_dim,
            h * h,
            h * f,
            h * f,
            f * h,
            h,
            h,
        ] {
            let b = r.alloc(e * d, COMPUTE);
            r.keep(b);
        }
    }
    for e in [p.vocab * h, h, p.vocab * h] {
        let b = r.alloc(e * d, COMPUTE);
        r.keep(b);
    }

    let mut queue: VecDeque<Request> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut sampled_prev: Option<Buf> = None;
    for _step in 0..p.steps {
        // The queue is the generator's own live state: counted too.
        let held = r.len() + queue.len();
        super::check_events(held, ServeKvParams::WORKLOAD, "steps", p.steps)?;
        for _ in 0..poisson(&mut rng, p.arrival_rate) {
            queue.push_back(Request {
                prompt: lognormal_clamped(
                    &mut rng,
                    p.prompt_median,
                    p.prompt_sigma,
                    1,
                    p.prompt_max,
                ),
                output: lognormal_clamped(
                    &mut rng,
                    p.output_median,
                    p.output_sigma,
                    1,
                    p.output_max,
                ),
                chunk: rng.gen_range(p.chunk_min..=p.chunk_max),
            });
        }
        // Admission and prefill.
        while running.len() < p.max_running as usize {
            let Some(req) = queue.pop_front() else { break };
            let ids = r.alloc(req.prompt * 8, COPY);
            let capacity = align_up(req.prompt, req.chunk);
            let cache = if p.growable == 1 {
                let mut c = r.reserve(max_context * kv_per_token, COMPUTE);
                r.resize(&mut c, capacity * kv_per_token);
                c
            } else {
                r.alloc(capacity * kv_per_token, COMPUTE)
            };
            let hs = r.alloc(req.prompt * h * d, COMPUTE);
            let mlp = r.alloc(req.prompt * f * d, COMPUTE);
            r.free(mlp);
            let logits = r.alloc(p.vocab * 4, COMPUTE);
            r.free(hs);
            r.free(logits);
            r.free(ids);
            running.push(Running {
                cache,
                capacity,
                len: req.prompt,
                remaining: req.output,
                chunk: req.chunk,
            });
        }
        if running.is_empty() {
            continue;
        }
        // One decode iteration for the running batch.
        let b = running.len() as u64;
        let hs = r.alloc(b * h * d, COMPUTE);
        let mlp = r.alloc(b * f * d, COMPUTE);
        r.free(mlp);
        let logits = r.alloc(b * p.vocab * 4, COMPUTE);
        let sampled = r.alloc(b * 8, COPY);
        r.free(logits);
        r.free(hs);
        if let Some(s) = sampled_prev.replace(sampled) {
            r.free(s);
        }
        let mut still = Vec::with_capacity(running.len());
        for mut q in running.drain(..) {
            q.len += 1;
            q.remaining -= 1;
            if q.len > q.capacity {
                // Grow: allocate the larger cache, copy, free the old one.
                q.capacity += q.chunk;
                if p.growable == 1 {
                    // In place: the region maps the chunk at its end.
                    r.resize(&mut q.cache, q.capacity * kv_per_token);
                } else {
                    let bigger = r.alloc(q.capacity * kv_per_token, COMPUTE);
                    let old = std::mem::replace(&mut q.cache, bigger);
                    r.free(old);
                }
            }
            if q.remaining == 0 {
                r.free(q.cache);
            } else {
                still.push(q);
            }
        }
        running = still;
    }
    for q in running {
        r.free(q.cache);
    }
    if let Some(s) = sampled_prev {
        r.free(s);
    }
    r.finish(ServeKvParams::WORKLOAD)
}

fn validate(p: &ServeKvParams) -> Result<()> {
    let w = ServeKvParams::WORKLOAD;
    let positive: [(&str, u64); 12] = [
        ("steps", p.steps.into()),
        ("max_running", p.max_running.into()),
        ("prompt_max", p.prompt_max),
        ("output_max", p.output_max),
        ("layers", p.layers),
        ("hidden", p.hidden),
        ("ffn", p.ffn),
        ("kv_heads", p.kv_heads),
        ("head_dim", p.head_dim),
        ("vocab", p.vocab),
        ("chunk_min", p.chunk_min),
        ("dtype_bytes", p.dtype_bytes),
    ];
    for (k, v) in positive {
        if v == 0 {
            return Err(out_of_range(w, k, v, "must be at least 1"));
        }
    }
    if p.growable > 1 {
        return Err(out_of_range(w, "growable", p.growable, "must be 0 or 1"));
    }
    if p.chunk_max < p.chunk_min {
        return Err(out_of_range(
            w,
            "chunk_max",
            p.chunk_max,
            "must be at least chunk_min",
        ));
    }
    if !(0.0..=1000.0).contains(&p.arrival_rate) {
        return Err(out_of_range(
            w,
            "arrival_rate",
            p.arrival_rate,
            "must be in 0..=1000",
        ));
    }
    for (k, v) in [
        ("prompt_median", p.prompt_median),
        ("output_median", p.output_median),
    ] {
        if v <= 0.0 {
            return Err(out_of_range(w, k, v, "must be positive"));
        }
    }
    for (k, v) in [
        ("prompt_sigma", p.prompt_sigma),
        ("output_sigma", p.output_sigma),
    ] {
        if v < 0.0 {
            return Err(out_of_range(w, k, v, "must not be negative"));
        }
    }
    // Every tensor within the model's size limit; the error names the
    // tensor and the parameter at fault.
    let d = ServeKvParams::default();
    let tokens = (p.prompt_max + p.output_max + p.chunk_max) as u128;
    let prompt_max = ("prompt_max", p.prompt_max, d.prompt_max);
    let hidden = ("hidden", p.hidden, d.hidden);
    let ffn = ("ffn", p.ffn, d.ffn);
    let dtype = ("dtype_bytes", p.dtype_bytes, d.dtype_bytes);
    super::check_tensors(
        w,
        &[
            (
                "a request's KV cache ((prompt_max + output_max + chunk_max) x 2 x layers x \
                 kv_heads x head_dim x dtype_bytes)",
                tokens
                    * 2
                    * p.layers as u128
                    * p.kv_heads as u128
                    * p.head_dim as u128
                    * p.dtype_bytes as u128,
                &[
                    prompt_max,
                    ("output_max", p.output_max, d.output_max),
                    ("chunk_max", p.chunk_max, d.chunk_max),
                    ("layers", p.layers, d.layers),
                    ("kv_heads", p.kv_heads, d.kv_heads),
                    ("head_dim", p.head_dim, d.head_dim),
                    dtype,
                ],
            ),
            (
                "the logits (vocab x max(hidden, max_running) x 4)",
                p.vocab as u128 * p.hidden.max(p.max_running.into()) as u128 * 4,
                &[
                    ("vocab", p.vocab, d.vocab),
                    hidden,
                    ("max_running", p.max_running.into(), d.max_running.into()),
                ],
            ),
            (
                "the prefill activations (prompt_max x max(ffn, hidden) x dtype_bytes)",
                p.prompt_max as u128 * p.ffn.max(p.hidden) as u128 * p.dtype_bytes as u128,
                &[prompt_max, ffn, hidden, dtype],
            ),
            (
                "the MLP weights (hidden x max(ffn, hidden) x dtype_bytes)",
                p.hidden as u128 * p.ffn.max(p.hidden) as u128 * p.dtype_bytes as u128,
                &[hidden, ffn, dtype],
            ),
        ],
    )
}
