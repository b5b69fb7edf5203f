#!/usr/bin/env python3
"""RL colocation with vmmalloc regions: a trainer and an inference engine take
turns on one GPU, each region paused while the other phase runs.

    python examples/rl_colocate.py                # a GPU if PyTorch sees one, else the host backend
    python examples/rl_colocate.py --host         # the host backend (no GPU, no PyTorch needed)
    python examples/rl_colocate.py --rounds 3 --scale 2

Regions (vmmalloc.region, docs/pytorch.md "Region mode"):

- ``train``: the policy's weights and the optimizer's state (Adam's two
  moments), paused *with* a backup while inference runs: they must survive;
- ``infer_weights``: the inference engine's copy of the weights, refreshed
  from the trainer each round, paused with a backup while training runs;
- ``kv_cache``: the inference engine's KV cache, paused *without* a backup
  (its contents are per-batch scratch): the memory just goes back.

On a GPU PyTorch's own allocator stays current (no ``enable()``): only
allocations inside ``with vmmalloc.region(...)`` come from vmmalloc, through a
``torch.cuda.MemPool``; everything else (activations, temporaries) is
PyTorch's. On the host backend (no GPU) the same regions hold real CPU memory
through libvmmalloc's C ABI, allocated the way a MemPool asks for it
(``vmmalloc_region_malloc``), with a capacity too small for both phases at
once, so the pauses are what makes it fit.

Each phase prints the device memory it holds: on a GPU what the driver says
is in use (``torch.cuda.mem_get_info``) and PyTorch's own reserved bytes; on
both, vmmalloc's mapped bytes per region. The weights are checked after every
resume (same values, same addresses). Exit status 0 when every check passed.
"""

import argparse
import ctypes
import os
import sys

try:
    import vmmalloc
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import vmmalloc

MIB = 1 << 20
TAGS = ("train", "infer_weights", "kv_cache")


def mapped(tag, device=0):
    for t in vmmalloc.tag_stats(device):
        if t["tag"] == tag:
            return t["mapped_bytes"]
    return 0


def report(phase, extra=""):
    parts = ", ".join(f"{t} {mapped(t) / MIB:.0f} MiB" for t in TAGS)
    held = vmmalloc.memory_stats(0)["reserved_bytes.all.current"]
    print(f"phase {phase:<14} vmmalloc holds {held / MIB:6.0f} MiB ({parts}){extra}", flush=True)


def check(cond, what):
    if not cond:
        print(f"FAIL {what}", file=sys.stderr, flush=True)
        sys.exit(1)


# ---------------------------------------------------------------------------
# On a GPU: real tensors, PyTorch's allocator current, regions as MemPools
# ---------------------------------------------------------------------------


def run_gpu(torch, rounds, scale):
    n_w = int(64 * MIB * scale) // 4  # fp32 elements: 64 MiB x scale of weights
    kv_bytes = int(1024 * MIB * scale)

    def gpu_extra():
        free, total = torch.cuda.mem_get_info()
        return (f"; GPU in use {(total - free) / MIB:.0f} MiB, PyTorch's own allocator "
                f"{torch.cuda.memory_reserved() / MIB:.0f} MiB")

    torch.manual_seed(0)
    with vmmalloc.region("train"):
        w = torch.randn(n_w, device="cuda")
        m = torch.zeros_like(w)
        v = torch.zeros_like(w)
    with vmmalloc.region("infer_weights"):
        w_infer = torch.empty_like(w)
    with vmmalloc.region("kv_cache"):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    vmmalloc.pause("kv_cache")
    vmmalloc.pause("infer_weights", backup=True)
    report("setup", gpu_extra())
    ptrs = (w.data_ptr(), m.data_ptr(), v.data_ptr())
    for r in range(rounds):
        # Training: the trainer's region is resident, the inference regions are paused.
        if r:  # paused during the last round's inference
            vmmalloc.resume("train")
            check(w.sum().item() == expected, f"round {r}: weights changed while paused")
        check((w.data_ptr(), m.data_ptr(), v.data_ptr()) == ptrs, "trainer tensors moved")
        grad = torch.randn_like(w)  # PyTorch's own allocator: outside any region
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        w.sub_(1e-3 * m / (v.sqrt() + 1e-8))
        del grad
        report(f"train {r}", gpu_extra())
        # Weight sync: the inference weights come back and take the trainer's values.
        vmmalloc.resume("infer_weights")
        w_infer.copy_(w)
        expected = w.sum().item()
        torch.cuda.synchronize()
        vmmalloc.pause("train", backup=True)
        # Inference: the KV cache comes back (contents not needed), the trainer is paused.
        vmmalloc.resume("kv_cache")
        kv.fill_(r + 1)
        out = (w_infer[:1024] * 2).sum()
        check(kv[:MIB].sum().item() == (r + 1) * MIB, f"round {r}: KV cache not writable")
        check(abs(out.item() - 2 * w_infer[:1024].sum().item()) < 1e-2, "inference weights unreadable")
        report(f"infer {r}", gpu_extra())
        torch.cuda.synchronize()
        vmmalloc.pause("kv_cache")
        vmmalloc.pause("infer_weights", backup=True)
    vmmalloc.resume("train")
    check(w.sum().item() == expected, "final weights differ from the last sync")
    report("done", gpu_extra())


# ---------------------------------------------------------------------------
# On the host backend: the library's C ABI, real CPU memory, a small capacity
# ---------------------------------------------------------------------------


class HostBuffer:
    """A region allocation through the C ABI (what a MemPool asks for)."""

    lib = None

    def __init__(self, nbytes):
        p = self.lib.vmmalloc_region_malloc(nbytes, 0, None)
        check(p, f"allocating {nbytes} bytes: {vmmalloc.last_error()}")
        self.ptr, self.nbytes = p, nbytes

    def fill(self, byte):
        ctypes.memset(self.ptr, byte, self.nbytes)

    def digest(self, n=1 << 16):
        return ctypes.string_at(self.ptr, min(n, self.nbytes))

    def copy_from(self, other):
        ctypes.memmove(self.ptr, other.ptr, min(self.nbytes, other.nbytes))


def run_host(rounds, scale):
    w_bytes = int(32 * MIB * scale)
    kv_bytes = int(128 * MIB * scale)
    # Training holds 3 x 32 MiB (+32 during the sync), inference 32 + 128: each fits, both (256) do not.
    capacity = 224 * MIB * scale
    if os.environ.get("VMMALLOC_CONF") is None:
        vmmalloc.configure(f"device:host,capacity_gb:{capacity / (1 << 30)},log:off,backend:expandable")
    lib = vmmalloc.load()
    lib.vmmalloc_region_malloc.restype = ctypes.c_void_p
    lib.vmmalloc_region_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    HostBuffer.lib = lib
    print(f"host backend: {capacity / MIB:.0f} MiB of 'device' memory; training needs "
          f"{4 * w_bytes / MIB:.0f} MiB at its peak, inference {(w_bytes + kv_bytes) / MIB:.0f} MiB, both "
          f"{(4 * w_bytes + kv_bytes) / MIB:.0f} MiB", flush=True)
    with vmmalloc.region("train", pool=False):
        w, m, v = HostBuffer(w_bytes), HostBuffer(w_bytes), HostBuffer(w_bytes)
    w.fill(1)
    m.fill(0)
    v.fill(0)
    with vmmalloc.region("infer_weights", pool=False):
        w_infer = HostBuffer(w_bytes)
    vmmalloc.pause("infer_weights", backup=True)
    with vmmalloc.region("kv_cache", pool=False):
        kv = HostBuffer(kv_bytes)
    vmmalloc.pause("kv_cache")
    report("setup")
    ptrs = (w.ptr, m.ptr, v.ptr)
    for r in range(rounds):
        if r:  # paused during the last round's inference
            vmmalloc.resume("train")
        check((w.ptr, m.ptr, v.ptr) == ptrs, "trainer buffers moved")
        check(w.digest() == bytes([r + 1]) * len(w.digest()), f"round {r}: weights changed while paused")
        w.fill(r + 2)  # "a training step"
        m.fill(r + 2)
        report(f"train {r}")
        vmmalloc.resume("infer_weights")
        w_infer.copy_from(w)
        vmmalloc.pause("train", backup=True)
        vmmalloc.resume("kv_cache")
        kv.fill(0xAB)
        check(kv.digest() == b"\xab" * len(kv.digest()), f"round {r}: KV cache not writable")
        check(w_infer.digest() == bytes([r + 2]) * len(w_infer.digest()), "inference weights not synced")
        report(f"infer {r}")
        vmmalloc.pause("kv_cache")
        vmmalloc.pause("infer_weights", backup=True)
    vmmalloc.resume("train")
    check(w.digest() == bytes([rounds + 1]) * len(w.digest()), "final weights differ")
    vmmalloc.validate(0)
    report("done")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", action="store_true", help="the host backend even where a GPU is")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every size")
    args = ap.parse_args()
    torch = None
    if not args.host:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}; PyTorch's allocator stays current "
              f"(vmmalloc enabled: {vmmalloc.is_enabled()})", flush=True)
        run_gpu(torch, args.rounds, args.scale)
    else:
        run_host(args.rounds, args.scale)
    print("rl_colocate: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
