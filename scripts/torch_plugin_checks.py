#!/usr/bin/env python3
"""PyTorch-process checks of the plug-in (issue 11) on a real GPU, one per call:

    VMMALLOC_CONF=... python -m vmmalloc scripts/torch_plugin_checks.py CHECK

CHECK is one of:

- ``peer-copy``: non-contiguous tensors copied across two GPUs and back
  (memory from cuMemCreate needs cuMemSetAccess for the peer); needs 2 GPUs.
- ``graph-replay``: a CUDA graph captured under the plug-in (private pool)
  and replayed 100 times with new inputs; outputs match eager execution, the
  captured addresses never change, and the pool goes once the graph and its
  outputs are gone.
- ``oom-exception``: an impossible allocation raises
  ``torch.cuda.OutOfMemoryError`` whose text starts with "CUDA out of memory."
  and carries vmmalloc's report.
- ``memory-allocated``: ``torch.cuda.memory_allocated()`` and friends match
  vmmalloc's own statistics.

Exit status: 0 passed, 1 failed (the reason on stderr), 3 skipped (the reason
on stdout: the box lacks what the check needs).
"""

import sys

MIB = 1 << 20


def skip(why):
    print(f"SKIP {why}")
    sys.exit(3)


def check(cond, what):
    if not cond:
        print(f"FAIL {what}", file=sys.stderr)
        sys.exit(1)


def peer_copy(torch, vm):
    if torch.cuda.device_count() < 2:
        skip(f"needs 2 GPUs, this box has {torch.cuda.device_count()}")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(257, 513, generator=g)
    a = ref.to("cuda:0")
    views = {"transposed": (a.t(), ref.t()), "strided": (a[::3, 1::2], ref[::3, 1::2]),
             "narrowed": (a[5:200, 7:300], ref[5:200, 7:300])}
    for name, (src, cpu) in views.items():
        check(not src.is_contiguous(), f"{name} view is contiguous")
        b = src.to("cuda:1")  # device-to-device copy of a non-contiguous tensor
        check(torch.equal(b.cpu(), cpu), f"{name}: cuda:0 -> cuda:1 copy differs")
        dst = torch.empty(cpu.t().shape, device="cuda:1").t()  # a non-contiguous destination
        dst.copy_(src)
        check(torch.equal(dst.cpu(), cpu), f"{name}: copy_ into a non-contiguous cuda:1 tensor differs")
        back = torch.empty_like(src)
        back.copy_(dst)
        check(torch.equal(back.cpu(), cpu), f"{name}: cuda:1 -> cuda:0 copy differs")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for d in (0, 1):
        vm.validate(d)
    print("peer-copy: 3 views copied 0 -> 1 -> 0 exactly")


def graph_replay(torch, vm):
    torch.manual_seed(0)
    w1 = torch.randn(512, 1024, device="cuda")
    w2 = torch.randn(1024, 256, device="cuda")
    static_x = torch.randn(64, 512, device="cuda")

    def f(x):
        h = torch.relu(x @ w1)  # intermediates allocated during capture
        return torch.tanh(h @ w2) + x[:, :256]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream, as PyTorch's docs do
            f(static_x)
    torch.cuda.current_stream().wait_stream(side)
    before = vm.memory_stats(0)["allocation.all.current"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = f(static_x)
    check(vm.memory_stats(0)["vmmalloc.graph_pools"] == 1, "no graph pool after capture")
    y_ptr = static_y.data_ptr()
    # Main-allocator churn between replays must not touch the pool's memory.
    for i in range(100):
        x = torch.randn(64, 512, device="cuda")
        static_x.copy_(x)
        junk = [torch.empty((i % 7 + 1) * MIB, dtype=torch.uint8, device="cuda").fill_(0xEE) for _ in range(4)]
        g.replay()
        del junk
        check(static_y.data_ptr() == y_ptr, f"replay {i}: output address changed")
        eager = f(x)
        check(torch.allclose(static_y, eager, atol=1e-4, rtol=1e-4),
              f"replay {i}: output differs from eager (max diff {(static_y - eager).abs().max().item()})")
    torch.cuda.synchronize()
    check(vm.memory_stats(0)["allocation.all.current"] >= before, "main allocator lost allocations")
    reserved = vm.memory_stats(0)["vmmalloc.graph_pool_reserved_bytes"]
    check(reserved > 0, "the graph's memory is not in its pool")
    del g  # releasePool; the output keeps the pool alive
    torch.cuda.synchronize()
    st = vm.memory_stats(0)
    check(st["vmmalloc.graph_pools"] == 1, "pool gone while its output is live")
    check(static_y.sum().item() == static_y.sum().item(), "output unreadable after release")
    del static_y
    torch.cuda.empty_cache()
    st = vm.memory_stats(0)
    # The pool goes with its last block; a block PyTorch keeps for the capture
    # stream (a cuBLAS workspace, say) keeps it, but its free memory is returned.
    check(st["vmmalloc.graph_pools"] == 0 or st["vmmalloc.graph_pool_reserved_bytes"] < reserved,
          f"pool memory not returned: {st['vmmalloc.graph_pool_reserved_bytes']} of {reserved} bytes reserved")
    vm.validate(0)
    print(f"graph-replay: 100 replays match eager, output address stable, pool released "
          f"({st['vmmalloc.graph_pools']} pool(s) left holding {st['vmmalloc.graph_pool_allocated_bytes']} bytes)")


def oom_exception(torch, vm):
    kind, why = vm.oom_exception()
    check(kind == "torch.cuda.OutOfMemoryError", f"the torch companion is unavailable: {why}")
    total = torch.cuda.get_device_properties(0).total_memory
    keep = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        text = str(e)
        check(text.startswith("CUDA out of memory."), f"message: {text[:200]}")
        check("vmmalloc" in text and "Tried to allocate" in text, f"message lacks our report: {text[:300]}")
    else:
        check(False, "an allocation of twice the device did not raise")
    # The process is fine afterwards.
    keep.fill_(7)
    check(int(keep.sum().item()) == 7 * MIB, "memory unusable after the exception")
    check(vm.memory_stats(0)["num_ooms"] >= 1, "num_ooms not counted")
    print("oom-exception: torch.cuda.OutOfMemoryError with vmmalloc's report")


def memory_allocated(torch, vm):
    sizes = [MIB, 3 * MIB + 5, 64 * MIB, 512]
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    st = vm.memory_stats(0)
    check(torch.cuda.memory_allocated() == st["allocated_bytes.all.current"] >= sum(sizes),
          f"memory_allocated {torch.cuda.memory_allocated()} vs {st['allocated_bytes.all.current']}")
    check(torch.cuda.memory_reserved() == st["reserved_bytes.all.current"], "memory_reserved differs")
    check(torch.cuda.max_memory_allocated() == st["allocated_bytes.all.peak"], "max_memory_allocated differs")
    check(torch.cuda.memory_stats()["allocation.all.current"] == st["allocation.all.current"], "memory_stats differs")
    check("vmmalloc" in torch.cuda.memory_summary(), "memory_summary is not vmmalloc's")
    check(torch.cuda.memory._snapshot()["segments"], "empty _snapshot")
    del ts
    torch.cuda.reset_peak_memory_stats()
    check(torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(), "reset_peak_memory_stats")
    print("memory-allocated: torch.cuda's memory functions match vmmalloc's stats")


def growable(torch, vm):
    """Issue 13: a growable tensor's torch view is zero-copy, keeps its address
    and its data across growth and shrink; the pressure callback frees a cache
    and an allocation that would fail succeeds on the retry."""
    g = vm.growable(1 << 30, dtype=torch.bfloat16)
    g.resize(1 << 20)
    t = g.tensor()
    check(t.data_ptr() == g.ptr and t.numel() == 1 << 20 and t.dtype == torch.bfloat16, "zero-copy view")
    t.copy_(torch.arange(1 << 20, device="cuda").to(torch.bfloat16))
    ref = t.clone()
    for n in [300 << 20 >> 1, 1 << 10, 400 << 20 >> 1, 1 << 20]:
        g.resize(n)
        v = g.tensor()
        check(v.data_ptr() == g.ptr, "the address never moves")
        k = min(n, 1 << 10)
        check(torch.equal(v[:k], ref[:k]), f"data kept at {n} elements")
    torch.cuda.synchronize()
    g.destroy()
    free, _ = torch.cuda.mem_get_info()
    cache = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(max(1, free // (256 << 20) - 1))]
    calls = []

    def drop(size, device):
        calls.append(size)
        n = 0
        while cache and n < size:
            cache.pop()
            n += 256 << 20
        torch.cuda.synchronize()
        return n

    vm.on_memory_pressure(drop)
    try:
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        check(len(calls) == 1, f"the pressure callback ran once ({calls})")
        del x
    finally:
        vm.on_memory_pressure(None)
    print("growable: zero-copy view, address and data kept; pressure callback rescued a 1 GiB allocation")


CHECKS = {"peer-copy": peer_copy, "graph-replay": graph_replay, "oom-exception": oom_exception,
          "memory-allocated": memory_allocated, "growable": growable}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: torch_plugin_checks.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        return 2
    import torch
    import vmmalloc

    if not torch.cuda.is_available():
        skip("no CUDA device")
    if not vmmalloc.is_enabled():
        print("FAIL run it under `python -m vmmalloc`", file=sys.stderr)
        return 1
    CHECKS[sys.argv[1]](torch, vmmalloc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
