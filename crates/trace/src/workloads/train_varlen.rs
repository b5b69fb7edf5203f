//! `train-varlen`: transformer training steps whose padded sequence length
//! changes from batch to batch (a long-tailed, log-normal draw), the pattern
//! that strands free memory in a caching allocator.
//!
//! Per run: the weights, gradients and the two Adam moments of every layer
//! (one allocation per tensor) are allocated first and live throughout.
//! Per step, with `T = batch · len` tokens:
//!
//! - stream 1 (data loader) allocates the next batch's token ids and labels
//!   while the current step runs (prefetch); they are freed when their step ends;
//! - forward, per layer: layer-norm output, QKV (`T·3h`), attention scores and
//!   probabilities (`batch·heads·len²` each; the scores are freed after the
//!   softmax), attention context and projection, second layer-norm, MLP up
//!   projection and activation (`T·ffn`), layer output (`T·h`); all kept for
//!   backward, or freed at the end of the layer with `checkpointing` (only the
//!   layer outputs stay, and backward recomputes each layer first);
//! - head: final norm, logits (`T·vocab`, bf16) and log-probabilities (fp32);
//! - backward, layers in reverse: a gradient buffer per saved activation (two
//!   for the attention probabilities), freeing the activations as it goes;
//!   stream 2 (communication) gets a gradient bucket of `bucket_mb` as layers
//!   finish (DDP-style all-reduce staging), each freed two buckets later;
//! - optimizer: one temporary per layer (the foreach Adam denominator).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::VecDeque;

use super::{define_params, lognormal_clamped, out_of_range, Buf, Recorder, MIB};
use crate::error::Result;
use crate::model::Trace;

const COMPUTE: u64 = 0;
const DATA: u64 = 1;
const COMM: u64 = 2;

define_params! {
    /// Parameters of `train-varlen` (defaults: a 1.3 B-parameter GPT-style model,
    /// fp32 weights and Adam state, bf16 activations; peak live about 35–50 GB).
    TrainVarlenParams for "train-varlen" {
        /// Random seed.
        seed: u64 = 0,
        /// Training steps (forward, backward, optimizer step each).
        steps: u32 [1, 10_000] = 12,
        /// Transformer layers.
        layers: u32 [1, 1_000] = 24,
        /// Hidden size (model width) in elements.
        hidden: u64 [1, 65_536] = 2048,
        /// Attention heads (the attention scores are batch x heads x len^2).
        heads: u64 [1, 1_024] = 16,
        /// MLP width as a multiple of the hidden size.
        ffn_mult: u64 [1, 64] = 4,
        /// Vocabulary size (the logits are batch x len x vocab).
        vocab: u64 [1, 1_048_576] = 50304,
        /// Sequences per batch.
        batch: u64 [1, 4_096] = 4,
        /// Median padded sequence length of a batch (log-normal).
        len_median: f64 [1.0, 1_048_576.0] = 512.0,
        /// Log-space standard deviation of the sequence length (the long tail).
        len_sigma: f64 [0.0, 10.0] = 0.7,
        /// Shortest sequence length.
        len_min: u64 [1, 1_048_576] = 64,
        /// Longest sequence length (the log-normal draw is clamped to it).
        len_max: u64 [1, 1_048_576] = 2048,
        /// Activation checkpointing: keep only layer outputs, recompute each layer in backward.
        checkpointing: bool = false,
        /// Bytes per activation element (2 = bf16).
        act_bytes: u64 [1, 16] = 2,
        /// Bytes per weight, gradient and optimizer-state element (4 = fp32).
        param_bytes: u64 [1, 16] = 4,
        /// Gradient bucket size in MiB on the communication stream (0: no buckets).
        bucket_mb: u64 [0, 65_536] = 25,
    }
}

/// Generates the trace (named `train-varlen`).
pub fn generate(p: &TrainVarlenParams) -> Result<Trace> {
    validate(p)?;
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let mut r = Recorder::new();
    let h = p.hidden;
    let f = p.ffn_mult * h;
    let pb = p.param_bytes;
    // Per layer: qkv weight and bias, projection weight and bias, two norms
    // (weight and bias), MLP up weight and bias, MLP down weight and bias.
    let layer_params: [u64; 12] = [h * 3 * h, 3 * h, h * h, h, h, h, h, h, h * f, f, f * h, h];
    let layer_bytes: u64 = layer_params.iter().sum::<u64>() * pb;
    // Token embedding (tied with the output head) and the final norm.
    let model_params: [u64; 3] = [p.vocab * h, h, h];

    // Weights, then gradients, then the two Adam moments: live throughout.
    for _copy in 0..4 {
        for _layer in 0..p.layers {
            for e in layer_params {
                let b = r.alloc(e * pb, COMPUTE);
                r.keep(b);
            }
        }
        for e in model_params {
            let b = r.alloc(e * pb, COMPUTE);
            r.keep(b);
        }
    }

    let sample_len = |rng: &mut ChaCha8Rng| {
        lognormal_clamped(rng, p.len_median, p.len_sigma, p.len_min, p.len_max)
    };
    let load_batch = |r: &mut Recorder, len: u64| {
        let t = p.batch * len;
        (r.alloc(t * 8, DATA), r.alloc(t * 8, DATA), len)
    };
    let first_len = sample_len(&mut rng);
    let mut next = Some(load_batch(&mut r, first_len));
    let bucket_bytes = p.bucket_mb * MIB;

    for step in 0..p.steps {
        super::check_events(r.len(), TrainVarlenParams::WORKLOAD, "steps", p.steps)?;
        let Some((ids, labels, len)) = next.take() else {
            break;
        };
        let shape = Shape {
            t: p.batch * len,
            scores: p.batch * p.heads * len * len * p.act_bytes,
            h,
            f,
            a: p.act_bytes,
        };

        // Forward.
        let mut xs: Vec<Buf> = vec![r.alloc(shape.t * h * shape.a, COMPUTE)]; // embedding output
        let mut saved: Vec<Vec<Buf>> = Vec::with_capacity(p.layers as usize);
        for layer in 0..p.layers {
            if layer == 0 && step + 1 < p.steps {
                let l = sample_len(&mut rng);
                next = Some(load_batch(&mut r, l));
            }
            let internals = forward_layer(&mut r, &shape);
            xs.push(r.alloc(shape.t * h * shape.a, COMPUTE)); // layer output (residual sum)
            if p.checkpointing {
                for b in internals {
                    r.free(b);
                }
                saved.push(Vec::new());
            } else {
                saved.push(internals);
            }
        }
        let t = shape.t;
        let lnf = r.alloc(t * h * shape.a, COMPUTE);
        let logits = r.alloc(t * p.vocab * shape.a, COMPUTE);
        let logp = r.alloc(t * p.vocab * 4, COMPUTE);
        let loss = r.alloc(4, COMPUTE);

        // Backward through the head.
        let dlogp = r.alloc(t * p.vocab * 4, COMPUTE);
        r.free(logp);
        let dlogits = r.alloc(t * p.vocab * shape.a, COMPUTE);
        r.free(dlogp);
        r.free(logits);
        let dlnf = r.alloc(t * h * shape.a, COMPUTE);
        r.free(dlogits);
        r.free(lnf);
        let mut g = r.alloc(t * h * shape.a, COMPUTE);
        r.free(dlnf);
        r.free(loss);

        // Backward through the layers.
        let mut buckets: VecDeque<Buf> = VecDeque::new();
        let mut pending_grad = 0u64;
        while let Some(internals) = saved.pop() {
            let internals = if p.checkpointing {
                forward_layer(&mut r, &shape)
            } else {
                internals
            };
            g = backward_layer(&mut r, internals, g, &shape);
            if let Some(out) = xs.pop() {
                r.free(out);
            }
            pending_grad += layer_bytes;
            if bucket_bytes > 0 && pending_grad >= bucket_bytes {
                buckets.push_back(r.alloc(pending_grad.min(bucket_bytes * 4), COMM));
                pending_grad = 0;
                if buckets.len() > 2 {
                    if let Some(b) = buckets.pop_front() {
                        r.free(b);
                    }
                }
            }
        }
        for x in xs.drain(..) {
            r.free(x);
        }
        r.free(g);
        if bucket_bytes > 0 && pending_grad > 0 {
            buckets.push_back(r.alloc(pending_grad, COMM));
        }
        for b in buckets.drain(..) {
            r.free(b);
        }

        // Optimizer step: a temporary per layer, then the embedding's.
        for _layer in 0..p.layers {
            let tmp = r.alloc(layer_bytes, COMPUTE);
            r.free(tmp);
        }
        let tmp = r.alloc(p.vocab * h * pb, COMPUTE);
        r.free(tmp);

        r.free(ids);
        r.free(labels);
    }
    if let Some((ids, labels, _)) = next {
        r.free(ids);
        r.free(labels);
    }
    r.finish(TrainVarlenParams::WORKLOAD)
}

/// Sizes of one step's tensors.
struct Shape {
    /// Tokens in the batch.
    t: u64,
    /// Bytes of one attention score tensor (batch·heads·len²·act_bytes).
    scores: u64,
    h: u64,
    f: u64,
    a: u64,
}

/// Position of the attention probabilities in [`forward_layer`]'s result.
const PROBS: usize = 2;

/// One layer's forward; returns the activations saved for backward (the
/// attention scores are freed after the softmax).
fn forward_layer(r: &mut Recorder, s: &Shape) -> Vec<Buf> {
    let th = s.t * s.h * s.a;
    let ln1 = r.alloc(th, COMPUTE);
    let qkv = r.alloc(3 * th, COMPUTE);
    let scores = r.alloc(s.scores, COMPUTE);
    let probs = r.alloc(s.scores, COMPUTE);
    r.free(scores);
    let ctx = r.alloc(th, COMPUTE);
    let attn = r.alloc(th, COMPUTE);
    let ln2 = r.alloc(th, COMPUTE);
    let fc1 = r.alloc(s.t * s.f * s.a, COMPUTE);
    let act = r.alloc(s.t * s.f * s.a, COMPUTE);
    vec![ln1, qkv, probs, ctx, attn, ln2, fc1, act]
}

/// One layer's backward: a gradient per saved activation (in reverse), each
/// activation freed once used; returns the gradient of the layer's input.
fn backward_layer(r: &mut Recorder, internals: Vec<Buf>, g_out: Buf, s: &Shape) -> Buf {
    let mut prev: Option<Buf> = None;
    for (i, saved) in internals.into_iter().enumerate().rev() {
        let mut grad = r.alloc(saved.size(), COMPUTE);
        if i == PROBS {
            // Softmax backward: gradient of the scores from that of the probabilities.
            let dscores = r.alloc(s.scores, COMPUTE);
            r.free(grad);
            grad = dscores;
        }
        if let Some(p) = prev.take() {
            r.free(p);
        }
        r.free(saved);
        prev = Some(grad);
    }
    let g_in = r.alloc(s.t * s.h * s.a, COMPUTE);
    if let Some(p) = prev {
        r.free(p);
    }
    r.free(g_out);
    g_in
}

fn validate(p: &TrainVarlenParams) -> Result<()> {
    let w = TrainVarlenParams::WORKLOAD;
    let positive: [(&str, u64); 9] = [
        ("steps", p.steps.into()),
        ("layers", p.layers.into()),
        ("hidden", p.hidden),
        ("heads", p.heads),
        ("ffn_mult", p.ffn_mult),
        ("vocab", p.vocab),
        ("batch", p.batch),
        ("act_bytes", p.act_bytes),
        ("param_bytes", p.param_bytes),
    ];
    for (k, v) in positive {
        if v == 0 {
            return Err(out_of_range(w, k, v, "must be at least 1"));
        }
    }
    if p.len_min == 0 {
        return Err(out_of_range(w, "len_min", p.len_min, "must be at least 1"));
    }
    if p.len_max < p.len_min {
        return Err(out_of_range(
            w,
            "len_max",
            p.len_max,
            "must be at least len_min",
        ));
    }
    if p.len_median <= 0.0 {
        return Err(out_of_range(
            w,
            "len_median",
            p.len_median,
            "must be positive",
        ));
    }
    if p.len_sigma < 0.0 {
        return Err(out_of_range(
            w,
            "len_sigma",
            p.len_sigma,
            "must not be negative",
        ));
    }
    // Keep every tensor within the model's size limit (and u64 products from
    // overflowing); the error names the tensor and the parameter at fault.
    let d = TrainVarlenParams::default();
    let (h, len, b) = (p.hidden as u128, p.len_max as u128, p.batch as u128);
    let batch = ("batch", p.batch, d.batch);
    let len_max = ("len_max", p.len_max, d.len_max);
    let hidden = ("hidden", p.hidden, d.hidden);
    let act = ("act_bytes", p.act_bytes, d.act_bytes);
    let pbytes = ("param_bytes", p.param_bytes, d.param_bytes);
    let vocab = ("vocab", p.vocab, d.vocab);
    let ffn = ("ffn_mult", p.ffn_mult, d.ffn_mult);
    super::check_tensors(
        w,
        &[
            (
                "the attention scores (batch x heads x len_max^2 x act_bytes)",
                b * p.heads as u128 * len * len * p.act_bytes as u128,
                &[batch, ("heads", p.heads, d.heads), len_max, act],
            ),
            (
                "the logits (batch x len_max x vocab x 4)",
                b * len * p.vocab as u128 * 4,
                &[batch, len_max, vocab],
            ),
            (
                "the MLP activations (batch x len_max x hidden x ffn_mult x act_bytes)",
                b * len * h * p.ffn_mult as u128 * p.act_bytes as u128,
                &[batch, len_max, hidden, ffn, act],
            ),
            (
                "the MLP weights and optimizer state (12 x hidden^2 x ffn_mult x param_bytes)",
                h * h * p.ffn_mult as u128 * p.param_bytes as u128 * 12,
                &[hidden, ffn, pbytes],
            ),
            (
                "the embedding (vocab x hidden x param_bytes)",
                p.vocab as u128 * h * p.param_bytes as u128,
                &[vocab, hidden, pbytes],
            ),
            (
                "the gradient buckets (4 x bucket_mb MiB)",
                p.bucket_mb as u128 * MIB as u128 * 4,
                &[("bucket_mb", p.bucket_mb, d.bucket_mb)],
            ),
        ],
    )
}
