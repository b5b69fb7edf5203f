#!/usr/bin/env python3
"""The allocator's hot path as PyTorch code sees it: ``torch.empty`` + free.

A working set of live tensors (``--live``, default 64) is kept; each
iteration frees one at random and allocates a new one of a size drawn from
512 B to 3 MiB (log-uniform, the sizes a training step's small activations
and gradients have), so every request is served from the allocator's cache
after the first round. Timed in batches of ``--batch`` pairs; the median of
the batches' per-pair time is the figure (the machine is shared and noisy:
medians, not means).

    python scripts/torch_hot_path.py
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/torch_hot_path.py
    VMMALLOC_CONF=backend:expandable python -m vmmalloc scripts/torch_hot_path.py

Prints one line ``RESULT {json}`` (allocator, pairs, median and min µs per
pair). Exit status 0, 2 when CUDA is not available.
"""

import argparse
import math
import random
import statistics
import sys
import time

from torch_common import allocator_label, result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--live", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("torch_hot_path: CUDA is not available", file=sys.stderr)
        return 2
    label, _vm = allocator_label()
    rng = random.Random(args.seed)
    lo, hi = math.log(512), math.log(3 << 20)
    sizes = [int(math.exp(rng.uniform(lo, hi))) for _ in range(4096)]
    slots = [rng.randrange(args.live) for _ in range(4096)]
    live = [torch.empty(sizes[i], dtype=torch.uint8, device="cuda") for i in range(args.live)]
    empty = torch.empty
    u8 = torch.uint8
    # One untimed round: every size class is cached afterwards.
    for i in range(4096):
        live[slots[i]] = empty(sizes[i], dtype=u8, device="cuda")
    torch.cuda.synchronize()
    per_pair = []
    n = 0
    while n < args.pairs:
        k = min(args.batch, args.pairs - n)
        t0 = time.perf_counter()
        for j in range(k):
            i = (n + j) & 4095
            live[slots[i]] = empty(sizes[i], dtype=u8, device="cuda")
        per_pair.append((time.perf_counter() - t0) / k * 1e6)
        n += k
    torch.cuda.synchronize()
    result({
        "script": "torch_hot_path",
        "allocator": label,
        "pairs": args.pairs,
        "us_per_pair_median": round(statistics.median(per_pair), 3),
        "us_per_pair_min": round(min(per_pair), 3),
        "batches": len(per_pair),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
