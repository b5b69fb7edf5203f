#!/usr/bin/env python3
"""Fragmentation that kills PyTorch's caching allocator, and survives vmmalloc.

Under a memory limit L (torch.cuda.set_per_process_memory_fraction), the
program fills ~90% of L with 4 MiB tensors. PyTorch's caching allocator puts
five of them in each 20 MiB segment. It then frees four of every five, so
~72% of L is free but every segment still holds one live tensor: no segment
can be released, and no free range is larger than 16 MiB. Then it asks for
large tensors (40-60% of L).

- PyTorch's default allocator (and vmmalloc's `caching` replica): out of
  memory, although most of the memory is free.
- PyTorch with `expandable_segments:True` (and vmmalloc's `torch-es`
  replica): out of memory too. Each 20 MiB page still holds one live 4 MiB
  tensor, so no page can be unmapped (measured on an H200, 2026-12-04).
- vmmalloc `expandable` (and `native`): the free pages are unmapped and
  mapped again behind the large tensor; the program completes.

Every surviving 4 MiB tensor and every large one is filled with a known value
and checked afterwards on the GPU, slice by slice (torch_common.verify: no
temporary larger than 16 MiB), so a page mapped in the wrong place or reused
while live is caught.

Run it plainly (the default allocator) or under vmmalloc:

    python scripts/torch_fragmentation.py --expect oom
    VMMALLOC_CONF=backend:expandable python -m vmmalloc scripts/torch_fragmentation.py --expect ok

Prints one line `RESULT {json}` (allocator, outcome ok|oom, limit, peak
reserved, seconds) and exits 0 when the outcome is the expected one, 1
otherwise, 2 when it cannot run (no CUDA).

vmmalloc raises on out-of-memory (torch.cuda.OutOfMemoryError, or
RuntimeError "CUDA out of memory. ..." without its torch companion); with
on_oom:null it returns a NULL data pointer PyTorch does not check, so every
allocation here is also followed by a data_ptr() check.
"""

import argparse
import sys
import time

from torch_common import MIB, OutOfMemory, allocator_label, cap_memory, empty, peak_reserved, result, verify

CHUNK = 4 * MIB


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-gb", type=float, default=8.0, help="memory limit L in GiB (default 8)")
    ap.add_argument("--expect", choices=["ok", "oom", "any"], default="any")
    ap.add_argument("--rounds", type=float, nargs="+", default=[0.5, 0.6, 0.4],
                    help="large requests, as fractions of L")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("torch_fragmentation: CUDA is not available", file=sys.stderr)
        return 2
    label, vm = allocator_label()
    limit = cap_memory(torch, args.limit_gb)
    if limit is None:
        print(f"torch_fragmentation: --limit-gb {args.limit_gb} is not below the GPU's memory", file=sys.stderr)
        return 2
    t0 = time.time()
    outcome, detail = "ok", ""
    kept, bigs = [], []
    try:
        # 1. Fill ~90% of L with 4 MiB tensors.
        chunks = []
        for i in range(int(0.9 * limit) // CHUNK):
            t = empty(torch, CHUNK)
            t.fill_(i % 251 + 1)
            chunks.append((t, i % 251 + 1))
        # 2. Keep one in five: every caching segment keeps a live tensor.
        kept = [c for i, c in enumerate(chunks) if i % 5 == 0]
        del chunks
        torch.cuda.synchronize()
        # 3. Large requests that fit in the free memory, not in any free range.
        for r, frac in enumerate(args.rounds):
            n = int(frac * limit) // MIB * MIB
            big = empty(torch, n)
            big.fill_(200 + r)
            torch.cuda.synchronize()
            if not verify(torch, big, 200 + r):
                raise SystemExit(f"large tensor {r} ({n} bytes) lost its contents")
            bigs.append(n)
            del big
        # 4. The survivors are intact.
        for t, v in kept:
            if not verify(torch, t, v):
                raise SystemExit(f"a kept 4 MiB tensor lost its contents (value {v})")
    except OutOfMemory as e:
        outcome, detail = "oom", str(e)
    torch.cuda.synchronize()
    peak = peak_reserved(torch, vm)
    result({
        "script": "torch_fragmentation",
        "allocator": label,
        "outcome": outcome,
        "detail": detail,
        "limit_bytes": limit,
        "kept_tensors": len(kept),
        "large_done": bigs,
        "peak_reserved_bytes": peak,
        "seconds": round(time.time() - t0, 2),
    })
    if args.expect != "any" and outcome != args.expect:
        print(f"torch_fragmentation: expected {args.expect}, got {outcome} ({label})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
