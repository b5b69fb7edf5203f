"""PyTorch features beyond malloc/free under vmmalloc on a real GPU (issue 28):
torch.compile's CUDA graph trees, NCCL with and without the register hook
(issue 43: vmmalloc serves it; world size 1, and 2 where PyTorch sees two
GPUs; NCCL's registrations counted from its NCCL_DEBUG_SUBSYS=REG log, none
left at exit) and ProcessGroupNCCL.register_mem_pool,
torch.cuda.MemPool (with vmmalloc's pools and with its own allocator) and a
torch.multiprocessing-style IPC round trip, through
the torch companion (python/vmmalloc/companion/).

Run it as ``python -m vmmalloc scripts/torch_complete_checks.py`` (VMMALLOC_CONF
picks the backend), or plainly (it calls vmmalloc.enable() itself before CUDA
is used). Each check prints one line ``CHECK name: ok``, ``CHECK name: FAIL
reason`` or ``CHECK name: SKIP reason`` (nccl-mem-pool where this PyTorch has
no register_mem_pool) as soon as it is done; the exit status is 1 if any failed, 3 (with
one line saying why) when it cannot run here (no CUDA device). NCCL checks run
in child processes, each with its own timeout (inside the GPU check's step:
$STEP_DEADLINE). About 80 s on an H200 (estimated: the NCCL checks with the
hook and register_mem_pool have not run on a GPU yet), most of it
torch.compile and the NCCL children (about 5 s per process).
"""

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common  # noqa: E402

failures = []


class Skip(Exception):
    """A check that cannot run with this PyTorch (printed as SKIP, never as ok)."""


def report(name, fn):
    """Runs one check; prints its CHECK line at once."""
    t = time.time()
    try:
        fn()
    except Skip as e:
        print(f"CHECK {name}: SKIP {e}", flush=True)
        return
    except Exception as e:  # a failed check is reported, the next one runs
        reason = f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
        print(f"CHECK {name}: FAIL {reason}", flush=True)
        traceback.print_exc(file=sys.stdout)
        failures.append(name)
        return
    print(f"CHECK {name}: ok ({time.time() - t:.1f} s)", flush=True)


def check_companion(torch, vmmalloc):
    backend = torch._C._cuda_getAllocatorBackend()
    assert backend == "vmmalloc", f"the current allocator is {backend!r}, not the torch companion"
    from vmmalloc import _companion

    lost = _companion.lost_features(True)
    assert not lost, "features missing in this PyTorch: " + "; ".join(lost)


def check_compile(torch, vmmalloc):
    """reduce-overhead (CUDA graph trees) over several input shapes and a
    path divergence, outputs equal to eager's."""
    import torch._inductor.config as inductor_config

    # checkPoolLiveAllocations runs under this (PyTorch's default).
    inductor_config.triton.slow_path_cudagraph_asserts = True
    calls = {"restore": 0, "checkpoint": 0, "live": 0}
    for attr, key in (("_cuda_setCheckpointPoolState", "restore"), ("_cuda_getCheckpointState", "checkpoint"),
                      ("_cuda_checkPoolLiveAllocations", "live")):
        real = getattr(torch._C, attr)

        def counted(*a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(*a, **k)

        setattr(torch._C, attr, counted)
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(64, 128, device="cuda")
    lin2 = torch.nn.Linear(128, 64, device="cuda")

    def head(x):
        return torch.relu(lin1(x))

    def tail_a(h):
        return lin2(h).sin()

    def tail_b(h):
        return (lin2(h) * 2).cos()

    c_head = torch.compile(head, mode="reduce-overhead", dynamic=False)
    c_a = torch.compile(tail_a, mode="reduce-overhead", dynamic=False)
    c_b = torch.compile(tail_b, mode="reduce-overhead", dynamic=False)
    with torch.no_grad():
        for rows in (8, 32, 96):
            for it in range(4):
                x = torch.randn(rows, 64, device="cuda")
                # head -> tail_a, then head -> tail_b: the tree diverges after head.
                for tail, c_tail in ((tail_a, c_a), (tail_b, c_b)):
                    torch.compiler.cudagraph_mark_step_begin()
                    got = c_tail(c_head(x)).clone()
                    want = tail(head(x))
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"rows={rows} iteration {it}: {m}")
    # A training step (forward and backward graphs share a pool).
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()
    c_model = torch.compile(model, mode="reduce-overhead", dynamic=False)
    for rows in (16, 48):
        for _ in range(4):
            x = torch.randn(rows, 64, device="cuda")
            model.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            out = c_model(x).sum()
            out.backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            for g, p in zip(got, model.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    assert calls["checkpoint"] > 0, f"no checkpoint was taken ({calls})"
    assert calls["restore"] > 0, f"no path divergence reached setCheckpointPoolState ({calls})"
    assert calls["live"] > 0, f"checkPoolLiveAllocations was never called ({calls})"
    print(f"    graph-tree calls: {calls}", flush=True)


def check_oom_observer(torch, vmmalloc):
    """attachOutOfMemoryObserver: called when an allocation raises
    torch.cuda.OutOfMemoryError, with the device and its total memory."""
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("a 1 PiB tensor was allocated")
    assert len(seen) == 1, seen
    device, _allocated, total, _free = seen[0]
    assert device == 0 and total == torch.cuda.get_device_properties(0).total_memory, seen


def check_empty_cache_hole(torch, vmmalloc):
    """Issue 40 item 1: 2 MiB, 1 GiB, 2 MiB; the 1 GiB freed and
    empty_cache(): the driver's free memory (cuMemGetInfo) rises by at least
    1 GiB - 40 MiB (PyTorch's expandable segments keep one 20 MiB page per
    live block; vmmalloc kept 1040 MiB before)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    del big
    torch.cuda.empty_cache()
    free1, _ = torch.cuda.mem_get_info()
    gain = free1 - free0
    reserved = torch.cuda.memory_reserved()
    del a, b
    torch.cuda.empty_cache()
    assert gain >= (1 << 30) - (40 << 20), f"empty_cache returned {gain >> 20} MiB of the 1 GiB hole"
    print(f"RESULT empty-cache-hole: free +{gain >> 20} MiB, reserved after {reserved >> 20} MiB")


def check_accelerator_stats(torch, vmmalloc):
    """Issue 40 item 4: PyTorch's device-generic memory API (2.9+) reads
    at::getDeviceAllocator(kCUDA), which the companion registers: the C++
    entry itself (not only enable()'s Python routing) sees a 64 MiB tensor
    and the private pools' map (2.13+)."""
    get = getattr(torch._C, "_accelerator_getDeviceStats", None)
    if get is None:
        print("RESULT accelerator-stats: this PyTorch has no torch.accelerator memory API (before 2.9)")
        return
    assert torch._C._accelerator_isAllocatorInitialized()
    before = get(0)["allocated_bytes"]["all"]["current"]
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    after = get(0)["allocated_bytes"]["all"]["current"]
    del t
    assert after - before == 64 << 20, (before, after)
    assert torch.accelerator.memory_allocated(0) == torch.cuda.memory_allocated(0)


def check_mempool(torch, vmmalloc):
    pool = torch.cuda.MemPool()
    assert pool.use_count() == 1, pool.use_count()
    with torch.cuda.use_mem_pool(pool):
        assert pool.use_count() == 2, pool.use_count()
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    assert pool.use_count() == 1, pool.use_count()
    y = torch.empty(1 << 20, device="cuda")  # outside: the main allocator
    st = vmmalloc.pool_memory_stats(pool.id)
    assert st["allocated_bytes.all.current"] >= 4 << 20, st
    assert st["vmmalloc.live_blocks"] == 1, st
    segs = pool.snapshot()
    live = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    assert [b["address"] for b in live] == [x.data_ptr()], (live, x.data_ptr(), y.data_ptr())
    assert x[12345].item() == 12345.0
    del x
    torch.cuda.synchronize()
    assert vmmalloc.pool_memory_stats(pool.id)["allocated_bytes.all.current"] == 0
    pid = pool.id
    del pool
    import gc

    gc.collect()
    try:
        vmmalloc.pool_memory_stats(pid)
    except vmmalloc.VmmallocError:
        pass  # the pool went with the MemPool
    else:
        raise AssertionError("the pool outlived its MemPool")


# MemPool(allocator=X)'s X: cuMemAlloc / cuMemFree through the driver
# (libcuda.so.1, PyTorch's context current on the calling thread), counting
# its calls; CUDAPluggableAllocator's alloc/free signatures.
X_ALLOCATOR_SOURCE = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
typedef int (*mem_alloc_fn)(unsigned long long*, size_t);
typedef int (*mem_free_fn)(unsigned long long);
static mem_alloc_fn mem_alloc;
static mem_free_fn mem_free;
extern "C" {
long x_raw_alloc = 0, x_raw_delete = 0, x_live = 0, x_bytes = 0;
static int x_load() {
  if (mem_alloc && mem_free) return 1;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) return 0;
  mem_alloc = (mem_alloc_fn)dlsym(h, "cuMemAlloc_v2");
  mem_free = (mem_free_fn)dlsym(h, "cuMemFree_v2");
  return mem_alloc && mem_free;
}
void* x_alloc(ssize_t size, int device, void* stream) {
  unsigned long long p = 0;
  if (!x_load() || mem_alloc(&p, (size_t)size) != 0) return 0;
  x_raw_alloc++;
  x_live++;
  x_bytes += size;
  return (void*)p;
}
void x_free(void* p, ssize_t size, int device, void* stream) {
  if (x_load()) mem_free((unsigned long long)p);
  x_raw_delete++;
  x_live--;
}
}
"""


def check_mempool_allocator(torch, vmmalloc):
    """torch.cuda.MemPool(allocator=X) (vLLM's sleep mode) under the
    companion: X gets PyTorch's segment-sized raw_alloc calls (20 x 1000 B +
    4 x 3 MiB: 2 calls, a 2 MiB and a 20 MiB segment, as PyTorch's own
    allocator asks; vmmalloc before issue 40: 24), the blocks are cached in
    the pool (no call for a second round, none at empty_cache while the
    MemPool lives), the segments are in memory_stats() and pool.snapshot(),
    use counts are PyTorch's (1, 2 inside use_mem_pool, 1 after), and the
    segments go back to X with the MemPool. A vLLM-like second pool (KV
    cache, 2 x 128 MiB) adds 2 handles."""
    import ctypes
    import gc
    import shutil

    tmp = tempfile.mkdtemp(prefix="vmmalloc-x-")
    src, so = os.path.join(tmp, "x.cpp"), os.path.join(tmp, "x.so")
    with open(src, "w") as f:
        f.write(X_ALLOCATOR_SOURCE)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "g++"
    subprocess.run([cxx, "-shared", "-fPIC", "-O1", src, "-o", so, "-ldl"], check=True)
    x_lib = ctypes.CDLL(so)
    counts = {n: ctypes.c_long.in_dll(x_lib, "x_" + n) for n in ("raw_alloc", "raw_delete", "live", "bytes")}

    def now():
        return {n: c.value for n, c in counts.items()}

    x = torch.cuda.memory.CUDAPluggableAllocator(so, "x_alloc", "x_free")
    mib = 1 << 20
    st0 = torch.cuda.memory_stats()
    pool = torch.cuda.MemPool(x.allocator())
    assert pool.use_count() == 1, pool.use_count()
    with torch.cuda.use_mem_pool(pool):
        inside = pool.use_count()
        small = [torch.full((1000,), i, dtype=torch.uint8, device="cuda") for i in range(20)]
        large = [torch.full((3 * mib,), 100 + i, dtype=torch.uint8, device="cuda") for i in range(4)]
    after = pool.use_count()
    assert (inside, after) == (2, 1), f"use counts {inside} inside, {after} after (PyTorch: 2, 1)"
    c = now()
    assert c["raw_alloc"] == 2 and c["bytes"] == 22 * mib, f"X got {c} (PyTorch: 2 calls, 22 MiB)"
    st = torch.cuda.memory_stats()
    segs = st["segment.all.current"] - st0["segment.all.current"]
    reserved = st["reserved_bytes.all.current"] - st0["reserved_bytes.all.current"]
    assert (segs, reserved) == (2, 22 * mib), (segs, reserved)
    snap = pool.snapshot()
    sizes = sorted(s["total_size"] for s in snap)
    assert sizes == [2 * mib, 20 * mib], sizes
    assert all(int(t.sum().item()) == 1000 * i for i, t in enumerate(small))
    assert all(int(t[-1].item()) == 100 + i for i, t in enumerate(large))
    del small, large
    with torch.cuda.use_mem_pool(pool):
        again = [torch.empty(3 * mib, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del again
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    c2 = now()
    assert c2["raw_alloc"] == 2 and c2["raw_delete"] == 0, f"cached segments: X got {c2}"
    kv_pool = torch.cuda.MemPool(x.allocator())
    with torch.cuda.use_mem_pool(kv_pool):
        kv = [torch.zeros(128 * mib, dtype=torch.uint8, device="cuda") for _ in range(2)]
    handles = now()["raw_alloc"]
    assert handles == 4, f"{handles} handles (PyTorch: 4)"
    del kv, pool, kv_pool
    gc.collect()
    torch.cuda.synchronize()
    end = now()
    assert end["live"] == 0 and end["raw_delete"] == end["raw_alloc"], f"segments left with X: {end}"
    torch_common.result({"check": "mempool-allocator", "raw_alloc_24_tensors": c["raw_alloc"],
                         "raw_alloc_24_tensors_pytorch": 2, "raw_alloc_24_tensors_before": 24,
                         "handles_weights_and_kv": handles, "handles_pytorch": 4,
                         "use_count_inside": inside, "use_count_after": after})


# The NCCL child: VMM_NCCL_MODE plain (no register hook), hook
# (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1: every segment registered
# with NCCL through the allocator trace trackers vmmalloc serves) or pool
# (the hook variable unset: ProcessGroupNCCL.register_mem_pool of a
# torch.cuda.MemPool, which attaches the same trackers for that pool's
# segments). RANK / WORLD_SIZE / LOCAL_RANK (the device) from the parent. In
# hook and pool mode it prints one FOLLOW {json} line: libvmmalloc's segment
# changes on its device (vmmalloc_segment_changes: registrations and
# deregistrations handed to the trackers) and the snapshot's segments when
# following began and at the end, after every tensor was freed and the cache
# emptied. Following takes the segments mapped when it begins as known, so
# added - removed == end - start means no registration is left beyond the
# segments still mapped (with nothing left mapped: none at all).
NCCL_CHILD = r"""
import ctypes, gc, json, os, sys
import torch, torch.distributed as dist
import vmmalloc
assert vmmalloc.is_enabled(), "run under python -m vmmalloc"
mode = os.environ.get("VMM_NCCL_MODE", "plain")
hook = os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
print("hook variable:", hook, flush=True)
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
dev = int(os.environ.get("LOCAL_RANK", "0"))
mib = 1 << 20
torch.cuda.set_device(dev)
lib = vmmalloc.load()
lib.vmmalloc_segment_changes.restype = ctypes.c_int
lib.vmmalloc_segment_changes.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                         ctypes.POINTER(ctypes.c_uint64)]


def changes():
    added, removed = ctypes.c_uint64(), ctypes.c_uint64()
    rc = lib.vmmalloc_segment_changes(dev, ctypes.byref(added), ctypes.byref(removed))
    assert rc == 0, vmmalloc.last_error()
    return added.value, removed.value


def segments():
    return sum(1 for s in torch.cuda.memory_snapshot() if s.get("device", dev) == dev)


# Following begins when ProcessGroupNCCL attaches its trackers: in its
# constructor with the hook variable, at register_mem_pool without it.
start = segments()
dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", dev))
x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
dist.all_reduce(x)
assert x[777].item() == 777.0 * world, x[777].item()
y = torch.full((1 << 18,), float(rank + 1), device="cuda")
dist.broadcast(y, src=0)
assert bool((y == 1.0).all()), "broadcast"
z = torch.full((1 << 18,), float(rank + 10), device="cuda")
outs = [torch.empty_like(z) for _ in range(world)]
dist.all_gather(outs, z)
for i, o in enumerate(outs):
    assert bool((o == float(i + 10)).all()), f"all_gather: rank {i}'s part"
if mode == "hook":
    # Memory that comes and goes while the group lives: new segments
    # (registered), a segment grown (its run deregistered and registered
    # again, larger), freed and emptied (deregistered before the unmap),
    # then mapped again (registered anew), each used by a collective.
    a = torch.ones(64 * mib // 4, device="cuda")
    dist.all_reduce(a)
    b = torch.ones(96 * mib // 4, device="cuda")
    dist.all_reduce(b)
    assert a[-1].item() == world and b[12345].item() == world, (a[-1].item(), b[12345].item())
    del a, b
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    c = torch.full((128 * mib // 4,), 2.0, device="cuda")
    dist.all_reduce(c)
    assert c[-1].item() == 2.0 * world, c[-1].item()
    del c
if mode == "pool":
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    assert hasattr(backend, "register_mem_pool") and hasattr(backend, "deregister_mem_pool"), type(backend)
    torch.cuda.synchronize()
    start = segments()
    pool = torch.cuda.MemPool()
    backend.register_mem_pool(pool)
    with torch.cuda.use_mem_pool(pool):
        p = torch.ones(32 * mib // 4, device="cuda")
        q = torch.full((48 * mib // 4,), 3.0, device="cuda")
    dist.all_reduce(p)
    dist.all_reduce(q)
    assert p[-1].item() == world and q[4321].item() == 3.0 * world, (p[-1].item(), q[4321].item())
    torch.cuda.synchronize()
    print("pool changes while registered:", changes(), flush=True)
    backend.deregister_mem_pool(pool)
    del p, q, pool
if mode != "plain":
    del x, y, z, outs, o
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    added, removed = changes()
    end = segments()
    print("FOLLOW " + json.dumps({"mode": mode, "rank": rank, "world_size": world, "device": dev, "hook": hook,
                                  "added": added, "removed": removed, "segments_start": start,
                                  "segments_end": end}), flush=True)
    assert added > 0, "no segment was handed to NCCL's trackers (is the register hook served?)"
    assert added - removed == end - start, (
        f"registrations left: {added} added - {removed} removed = {added - removed}, but {end} segments are "
        f"mapped now and {start} were when following began")
torch.cuda.synchronize()
dist.destroy_process_group()
print("NCCL OK", flush=True)
"""


IPC_CHILD = r"""
import pickle, sys
import torch, vmmalloc
from torch.multiprocessing.reductions import rebuild_cuda_tensor
assert vmmalloc.is_enabled(), "run under python -m vmmalloc"
t = rebuild_cuda_tensor(*pickle.load(sys.stdin.buffer))
assert t[123].item() == 123.0, t[123].item()
t[5] = -7.0
torch.cuda.synchronize()
print("IPC OK", flush=True)
"""


def check_ipc(torch, vmmalloc):
    """A tensor shared the way torch.multiprocessing shares it
    (reduce_tensor / rebuild_cuda_tensor: shareIpcHandle, getIpcDevPtr) with a
    child running vmmalloc, which reads it and writes into it."""
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    _, args = reduce_tensor(t)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(IPC_CHILD)
    try:
        out = subprocess.run([sys.executable, "-m", "vmmalloc", f.name], input=pickle.dumps(args),
                             capture_output=True, timeout=torch_common.child_timeout(120),
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        raise AssertionError("the child timed out")
    finally:
        os.unlink(f.name)
    text = (out.stdout + out.stderr).decode(errors="replace")
    assert out.returncode == 0 and b"IPC OK" in out.stdout, f"exit {out.returncode}: {text[-1500:]}"
    torch.cuda.synchronize()
    assert t[5].item() == -7.0, f"the child's write is not seen here ({t[5].item()})"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# NCCL's own log of the registrations it was asked for (NCCL_DEBUG=INFO,
# NCCL_DEBUG_SUBSYS=REG): "register comm %p buffer %p size %zi" in
# ncclRegister (src/register/register.cc) for every ncclCommRegister, or
# "Skipping registration for buffer ..." where NCCL declines it
# (NCCL_LOCAL_REGISTER=0, P2P through memcpy). Lenient about the wording
# across NCCL versions: any NCCL line that names registering a buffer or
# segment.
NCCL_REG_CALL = re.compile(r"\bregister(?:ing|ed)?\b.*\b(?:buffer|buff|segment|ptr)\b", re.I)
NCCL_REG_SKIPPED = re.compile(r"\bskip\w*\b.*\bregist", re.I)
NCCL_DEREG = re.compile(r"\bdereg", re.I)


def nccl_registrations(text):
    """``(registrations, skipped, deregistrations, problems)`` among NCCL's
    log lines in ``text``; problems: NCCL warnings about registration."""
    calls = skipped = deregs = 0
    problems = []
    for line in text.splitlines():
        if "NCCL" not in line:
            continue
        if " WARN " in line and re.search(r"regist", line, re.I):
            problems.append(line.strip()[:300])
        elif NCCL_DEREG.search(line):
            deregs += 1
        elif NCCL_REG_SKIPPED.search(line):
            skipped += 1
        elif NCCL_REG_CALL.search(line):
            calls += 1
    return calls, skipped, deregs, problems


def run_nccl(mode, world):
    """Runs the NCCL child in ``mode`` as ``world`` ranks at once (rank r on
    device r); returns ``[(rank, exit status, stdout + stderr, NCCL's log)]``.
    NCCL logs to a file of its own per rank (NCCL_DEBUG_FILE) in hook and
    pool mode."""
    with tempfile.TemporaryDirectory(prefix="vmmalloc-nccl-") as d:
        script = os.path.join(d, "child.py")
        with open(script, "w") as f:
            f.write(NCCL_CHILD)
        port = str(free_port())
        procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1", VMM_NCCL_MODE=mode)
            env.pop("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", None)
            if mode == "hook":
                env["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
            if mode != "plain":
                # PyTorch turns the hook off itself under its own expandable
                # segments (shouldAllCommunicatorsRegisterAllTensors).
                env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
                env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="REG",
                           NCCL_DEBUG_FILE=os.path.join(d, f"nccl.{rank}.%p.log"))
            out = open(os.path.join(d, f"out.{rank}"), "w+")
            procs.append((rank, out, subprocess.Popen([sys.executable, "-m", "vmmalloc", script], env=env,
                                                      stdout=out, stderr=subprocess.STDOUT, text=True)))
        limit = torch_common.child_timeout(120 if world == 1 else 180)
        deadline = time.time() + limit
        timed_out = False
        for _, _, proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        results = []
        for rank, out, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.seek(0)
            text = out.read()
            out.close()
            log = ""
            for name in sorted(os.listdir(d)):
                if name.startswith(f"nccl.{rank}."):
                    with open(os.path.join(d, name), errors="replace") as f:
                        log += f.read()
            results.append((rank, proc.returncode, text, log))
        if timed_out:
            raise AssertionError(f"{mode}, world size {world}: a rank timed out after {limit:.0f} s: "
                                 + " | ".join(f"rank {r}: {t[-600:]}" for r, _, t, _ in results))
        return results


def follow_line(text):
    """The child's FOLLOW {json}, or None."""
    for line in text.splitlines():
        if line.startswith("FOLLOW {"):
            return json.loads(line[len("FOLLOW "):])
    return None


def check_nccl_ranks(mode, world):
    """Runs ``mode`` (hook or pool) with ``world`` ranks and checks each:
    exit 0, "NCCL OK", the hook variable as set (vmmalloc leaves it on), no
    tracker refused by PyTorch's NCCLComm (vmmalloc's warning), at least one
    registration in NCCL's log and none refused, the changes balanced
    (FOLLOW). Returns one figure dict per rank."""
    ranks = []
    for rank, rc, text, log in run_nccl(mode, world):
        where = f"{mode}, world size {world}, rank {rank}"
        assert rc == 0 and "NCCL OK" in text, f"{where}: exit {rc}: {text[-1500:]}"
        want = "1" if mode == "hook" else "None"
        assert f"hook variable: {want}" in text, f"{where}: the hook variable is not {want}: {text[-800:]}"
        assert "is turned off" not in text, f"{where}: vmmalloc turned the register hook off: {text[-800:]}"
        for bad in ("an allocator trace tracker failed", "register hook is not served"):
            assert bad not in text, f"{where}: {bad}: " + next(l for l in text.splitlines() if bad in l)[:300]
        calls, skipped, deregs, problems = nccl_registrations(log + "\n" + text)
        assert not problems, f"{where}: NCCL refused a registration: {problems[0]}"
        assert calls + skipped > 0, (f"{where}: NCCL logged no registration (NCCL_DEBUG_SUBSYS=REG); its log ends: "
                                     f"{log[-600:]!r}")
        follow = follow_line(text)
        assert follow is not None, f"{where}: no FOLLOW line: {text[-800:]}"
        ranks.append({"rank": rank, "nccl_registrations": calls, "nccl_registrations_skipped": skipped,
                      "nccl_deregistrations": deregs, "segment_changes_added": follow["added"],
                      "segment_changes_removed": follow["removed"], "segments_start": follow["segments_start"],
                      "segments_end": follow["segments_end"]})
    return ranks


def check_nccl(torch, vmmalloc, hook):
    """Without the hook: all_reduce, broadcast and all_gather in one rank.
    With it (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, which vmmalloc
    now serves and leaves on): the same plus memory mapped, grown, emptied
    and mapped again under the process group, in world size 1 and, where
    PyTorch sees two GPUs, 2 (a process per GPU); NCCL's REG log must show
    registrations, and the registrations vmmalloc handed out must balance
    with the segments still mapped."""
    import torch.distributed as dist

    assert dist.is_available() and dist.is_nccl_available(), "this PyTorch has no NCCL"
    if not hook:
        [(_, rc, text, _)] = run_nccl("plain", 1)
        assert rc == 0 and "NCCL OK" in text, f"exit {rc}: {text[-1500:]}"
        return
    worlds = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    for world in worlds:
        ranks = check_nccl_ranks("hook", world)
        torch_common.result({"check": "nccl-register-hook", "world_size": world,
                             "nccl_registrations": sum(r["nccl_registrations"] for r in ranks),
                             "segment_changes_added": sum(r["segment_changes_added"] for r in ranks),
                             "segment_changes_removed": sum(r["segment_changes_removed"] for r in ranks),
                             "ranks": ranks})
    if worlds == [1]:
        print(f"nccl-register-hook: world size 2 not run ({torch.cuda.device_count()} GPU visible)", flush=True)


def check_nccl_mem_pool(torch, vmmalloc):
    """ProcessGroupNCCL.register_mem_pool / deregister_mem_pool of a
    torch.cuda.MemPool (hook variable unset): tensors allocated in the pool
    under use_mem_pool, all_reduce on them, NCCL's REG log showing the pool's
    registrations, the changes balanced at the end."""
    import torch.distributed as dist

    assert dist.is_available() and dist.is_nccl_available(), "this PyTorch has no NCCL"
    pg = getattr(torch._C._distributed_c10d, "ProcessGroupNCCL", None)
    missing = [n for n, ok in (("torch.cuda.MemPool", hasattr(torch.cuda, "MemPool")),
                               ("torch.cuda.use_mem_pool", hasattr(torch.cuda, "use_mem_pool")),
                               ("ProcessGroupNCCL.register_mem_pool", hasattr(pg, "register_mem_pool")))
               if not ok]
    if missing:
        raise Skip(f"this PyTorch has no {', '.join(missing)}")
    ranks = check_nccl_ranks("pool", 1)
    torch_common.result({"check": "nccl-mem-pool", "world_size": 1,
                         "nccl_registrations": ranks[0]["nccl_registrations"], "ranks": ranks})


def main():
    try:
        import torch
    except ImportError as e:
        print(f"torch_complete_checks: cannot run: no PyTorch ({e})")
        return 3
    if not torch.cuda.is_available():
        print("torch_complete_checks: cannot run: no CUDA device")
        return 3
    import vmmalloc

    if not vmmalloc.is_enabled():
        vmmalloc.enable()
    report("companion", lambda: check_companion(torch, vmmalloc))
    report("compile-reduce-overhead", lambda: check_compile(torch, vmmalloc))
    report("mempool", lambda: check_mempool(torch, vmmalloc))
    report("mempool-allocator", lambda: check_mempool_allocator(torch, vmmalloc))
    report("empty-cache-hole", lambda: check_empty_cache_hole(torch, vmmalloc))
    report("accelerator-stats", lambda: check_accelerator_stats(torch, vmmalloc))
    report("oom-observer", lambda: check_oom_observer(torch, vmmalloc))
    report("ipc", lambda: check_ipc(torch, vmmalloc))
    report("nccl", lambda: check_nccl(torch, vmmalloc, hook=False))
    report("nccl-register-hook", lambda: check_nccl(torch, vmmalloc, hook=True))
    report("nccl-mem-pool", lambda: check_nccl_mem_pool(torch, vmmalloc))
    print(f"torch_complete_checks: {len(failures)} failed" + (f": {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
