#!/usr/bin/env python3
"""A short training loop with variable sequence lengths: the workload that
fragments a caching allocator (activation sizes change every step).

A small transformer encoder (embedding, N layers, LM head) trains on random
tokens; each step draws its sequence length uniformly from [--min-len,
--max-len] with a fixed token budget per batch, so tensor sizes vary every
step. Prints one line `RESULT {json}` with the allocator, peak reserved
memory, peak allocated memory, mean step time (after warm-up) and the final
loss, for gpu-check.sh to put side by side:

    python scripts/torch_train_varlen.py
    VMMALLOC_CONF=backend:expandable python -m vmmalloc scripts/torch_train_varlen.py

Exit status 0 on success, 1 on out-of-memory or a non-finite loss, 2 when
CUDA is not available. Under a pluggable allocator an out-of-memory is a NULL
pointer that PyTorch does not check: run it with VMMALLOC_CONF=...,on_oom:abort
so such a failure stops the program with vmmalloc's report instead of a later
illegal-address error.
"""

import argparse
import math
import sys
import time

from torch_common import MIB, allocator_label, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch")
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import torch.nn as nn

    if not torch.cuda.is_available():
        print("torch_train_varlen: CUDA is not available", file=sys.stderr)
        return 2
    label, vm = allocator_label()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(args.vocab, args.d_model)
            layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.head = nn.Linear(args.d_model, args.vocab)

        def forward(self, x):
            return self.head(self.enc(self.emb(x), is_causal=False))

    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss_v = [], float("nan")
    try:
        for step in range(args.steps):
            seq = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=gen))
            batch = max(1, args.tokens // seq)
            x = torch.randint(0, args.vocab, (batch, seq), generator=gen).cuda(non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.view(-1, args.vocab).float(), x.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
            loss_v = float(loss.item())
            del logits, loss, x
    except torch.cuda.OutOfMemoryError as e:
        print(f"torch_train_varlen: out of memory at step {step}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    if vm is not None:
        st = vm.memory_stats(0)
        peak_reserved, peak_allocated = st["reserved_bytes.all.peak"], st["allocated_bytes.all.peak"]
        extra = {k: st[k] for k in st if k.startswith("vmmalloc.driver_calls.")}
    else:
        peak_reserved = torch.cuda.max_memory_reserved(0)
        peak_allocated = torch.cuda.max_memory_allocated(0)
        extra = {"num_alloc_retries": torch.cuda.memory_stats(0).get("num_alloc_retries", 0)}
    result({
        "script": "torch_train_varlen",
        "allocator": label,
        "steps": args.steps,
        "peak_reserved_mib": round(peak_reserved / MIB, 1),
        "peak_allocated_mib": round(peak_allocated / MIB, 1),
        "step_ms_mean": round(1000 * sum(times) / max(1, len(times)), 2),
        "step_ms_max": round(1000 * max(times or [0.0]), 2),
        "final_loss": round(loss_v, 4),
        **extra,
    })
    return 0 if math.isfinite(loss_v) else 1


if __name__ == "__main__":
    sys.exit(main())
