#!/usr/bin/env python3
"""Sleep and wake (issue 12) under PyTorch on a real GPU:

    VMMALLOC_CONF=backend:expandable python -m vmmalloc scripts/torch_sleep_checks.py sleep

- tensors allocated in ``vmmalloc.region("weights")`` and ``region("kv_cache")``;
- a CUDA graph captured that reads the tagged tensors;
- ``pause("weights", backup=True)`` and ``pause("kv_cache")`` give back
  >= 95 % of the tagged bytes as ``torch.cuda.mem_get_info`` (cuMemGetInfo)
  sees them, and another tensor can use the memory;
- ``resume()``: the weights hold their values at the same addresses, the
  KV cache is mapped and writable, and the captured graph replays correctly.

Exit status: 0 passed, 1 failed (the reason on stderr), 3 skipped.
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


def sleep_check(torch, vm):
    torch.manual_seed(0)
    with vm.region("weights"):
        w1 = torch.randn(4096, 4096, device="cuda")  # 64 MiB
        w2 = torch.randn(4096, 1024, device="cuda")  # 16 MiB
    with vm.region("kv_cache"):
        kv = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    static_x = torch.randn(64, 4096, device="cuda")

    def f(x):
        return torch.relu(x @ w1) @ w2

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            f(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = f(static_x)
    g.replay()
    expected = f(static_x).clone()
    w1_sum, w2_sum = w1.sum().item(), w2.sum().item()
    ptrs = (w1.data_ptr(), w2.data_ptr(), kv.data_ptr())
    torch.cuda.synchronize()

    tags = {t["tag"]: t for t in vm.tag_stats(0)}
    tagged = tags["weights"]["mapped_bytes"] + tags["kv_cache"]["mapped_bytes"]
    free0, _ = torch.cuda.mem_get_info()
    n1 = vm.pause("weights", backup=True)
    n2 = vm.pause("kv_cache")
    free1, _ = torch.cuda.mem_get_info()
    gained = free1 - free0
    print(f"tagged {tagged / MIB:.0f} MiB, released {(n1 + n2) / MIB:.0f} MiB, cuMemGetInfo free +{gained / MIB:.0f} MiB")
    check(gained >= 0.95 * tagged, f"pause gave back {gained} of {tagged} tagged bytes")
    vm.validate(0)
    st = vm.memory_stats(0)
    check(st["vmmalloc.tags.weights.paused"] == 1, "weights not shown paused in memory_stats")
    check("paused" in vm.memory_summary(0), "memory_summary does not show paused memory")
    # Someone else uses the memory meanwhile.
    other = torch.full((256 * MIB,), 7, dtype=torch.uint8, device="cuda")
    check(other.sum().item() == 7 * 256 * MIB, "the other tensor is wrong")
    del other
    vm.resume()
    vm.validate(0)
    check((w1.data_ptr(), w2.data_ptr(), kv.data_ptr()) == ptrs, "addresses changed")
    check(w1.sum().item() == w1_sum and w2.sum().item() == w2_sum, "weights changed across pause/resume")
    kv.fill_(3)
    check(kv[:MIB].sum().item() == 3 * MIB, "the KV cache is not writable after resume")
    g.replay()
    torch.cuda.synchronize()
    check(torch.allclose(static_y, expected, atol=1e-3, rtol=1e-3),
          f"graph replay after resume differs (max diff {(static_y - expected).abs().max().item()})")
    print("sleep: >= 95% given back, weights restored in place, KV cache remapped, graph replays after resume")


CHECKS = {"sleep": sleep_check}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CHECKS:
        print(f"usage: torch_sleep_checks.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
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
