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
- vmmalloc `expandable` (and `torch-es`, `native`): the free pages are
  unmapped and mapped again behind the large tensor; the program completes.

Every surviving 4 MiB tensor and every large one is filled with a known value
and checked afterwards (a checksum on the GPU), so a page mapped in the wrong
place or reused while live is caught.

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
import json
import os
import sys
import time

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 4 * MIB


class OutOfMemory(Exception):
    pass


def allocator_label():
    try:
        import vmmalloc
    except ImportError:
        return "pytorch", None
    if vmmalloc.is_enabled():
        conf = os.environ.get("VMMALLOC_CONF", "")
        backend = "expandable"
        for item in conf.split(","):
            k, _, v = item.partition(":")
            if k.strip() == "backend":
                backend = v.strip()
        return f"vmmalloc:{backend}", vmmalloc
    return "pytorch", None


def empty(torch, nbytes):
    """torch.empty that raises OutOfMemory under either allocator."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        raise OutOfMemory(str(e).splitlines()[0]) from None
    except RuntimeError as e:
        # vmmalloc without its torch companion raises RuntimeError with the same text.
        if not str(e).startswith("CUDA out of memory."):
            raise
        raise OutOfMemory(str(e).splitlines()[0]) from None
    if nbytes > 0 and t.data_ptr() == 0:
        # A pluggable allocator's failure: vmmalloc logged the report on stderr.
        raise OutOfMemory(f"NULL data pointer for {nbytes} bytes")
    return t


def checksum(torch, t):
    return int(torch.sum(t, dtype=torch.int64).item())


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
    total = torch.cuda.get_device_properties(0).total_memory
    limit = int(args.limit_gb * GIB)
    if limit >= total:
        print(f"torch_fragmentation: --limit-gb {args.limit_gb} is not below the GPU's memory", file=sys.stderr)
        return 2
    torch.cuda.set_per_process_memory_fraction(limit / total, 0)
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
            if checksum(torch, big) != n * (200 + r):
                raise SystemExit(f"large tensor {r} ({n} bytes) lost its contents")
            bigs.append(n)
            del big
        # 4. The survivors are intact.
        for t, v in kept:
            if checksum(torch, t) != CHUNK * v:
                raise SystemExit(f"a kept 4 MiB tensor lost its contents (value {v})")
    except OutOfMemory as e:
        outcome, detail = "oom", str(e)
    torch.cuda.synchronize()
    if vm is not None:
        peak = vm.memory_stats(0)["reserved_bytes.all.peak"]
    else:
        peak = torch.cuda.max_memory_reserved(0)
    result = {
        "script": "torch_fragmentation",
        "allocator": label,
        "outcome": outcome,
        "detail": detail,
        "limit_bytes": limit,
        "kept_tensors": len(kept),
        "large_done": bigs,
        "peak_reserved_bytes": peak,
        "seconds": round(time.time() - t0, 2),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if args.expect != "any" and outcome != args.expect:
        print(f"torch_fragmentation: expected {args.expect}, got {outcome} ({label})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
