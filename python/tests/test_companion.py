"""The torch companion (python/vmmalloc/companion/vmmalloc_torch.cpp) built
against the real PyTorch wheel, installed by enable(), and its entry points
driven through torch._C on the `host` backend (no GPU): CUDA graph trees'
live-allocation checks and checkpoint/restore, snapshot(), statistics; pool
use counts and per-pool stats through the C ABI; the fallback and the NCCL
register hook's refusal. Skipped only where torch is missing, never in CI
(VMMALLOC_REQUIRE_TORCH=1, see test_torch.py)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import PACKAGE_PARENT, require_torch

require_torch()

from vmmalloc import _companion  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One companion build for the module (it takes half a minute)."""
    return tmp_path_factory.mktemp("companion-cache")


def run(code, tmp_path, cache, **env_extra):
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), VMMALLOC_CACHE=str(cache))
    env.pop("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", None)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)


# Allocates into a graph pool as a capture does (the shim's begin/end hooks
# call these), through the C ABI.
PRELUDE = '''
import ctypes, gc, json, warnings
import torch, vmmalloc
from vmmalloc import _companion
with warnings.catch_warnings():
    warnings.simplefilter("error")  # the companion builds and installs: no warning
    # but the one for device:host without a GPU, where these tests run (issue 45)
    warnings.filterwarnings("ignore", message="vmmalloc: enabled with device:host")
    vmmalloc.enable("device:host,capacity_gb:1,log:off,backend:expandable")
lib = vmmalloc.load()
U64 = ctypes.c_uint64
lib.vmmalloc_pool_try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, U64, U64,
                                         ctypes.POINTER(ctypes.c_void_p)]
for f in ("vmmalloc_pool_begin", "vmmalloc_pool_end", "vmmalloc_pool_release",
          "vmmalloc_pool_create_or_incref", "vmmalloc_pool_use_count"):
    getattr(lib, f).argtypes = [ctypes.c_int, U64, U64]
lib.vmmalloc_pool_stats_json.argtypes = [ctypes.c_int, U64, U64]
lib.vmmalloc_pool_stats_json.restype = ctypes.c_void_p

def pool_malloc(pool, n):
    out = ctypes.c_void_p()
    assert lib.vmmalloc_pool_try_malloc(n, 0, None, pool[0], pool[1], ctypes.byref(out)) == 0, vmmalloc.last_error()
    return out.value

def pool_stats(pool):
    p = lib.vmmalloc_pool_stats_json(0, *pool)
    assert p, vmmalloc.last_error()
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib.vmmalloc_free_string(p)
'''


def test_companion_builds_against_the_real_wheel_with_every_method(tmp_path):
    import torch

    path = _companion.build(torch, tmp_path / "companion.so")
    assert path.is_file()
    # Every override reaches a virtual method of this PyTorch's interface.
    assert _companion.lost_methods(path) == []


def test_a_method_this_pytorch_lacks_is_left_out_and_reported(tmp_path, monkeypatch):
    import torch

    # A copy of the source with one override PyTorch has no virtual for.
    src = tmp_path / "vmmalloc_torch.cpp"
    text = _companion.SOURCE.read_text()
    marker = "  std::string name() VMM_OVERRIDE"
    assert marker in text
    src.write_text(text.replace(marker, "#ifndef VMM_NO_noSuchHook\n  void noSuchHook() VMM_OVERRIDE {}\n"
                                        "#endif\n" + marker))
    monkeypatch.setattr(_companion, "SOURCE", src)
    path = _companion.build(torch, tmp_path / "companion.so")
    assert _companion.lost_methods(path) == ["noSuchHook"]


def test_enable_installs_the_companion(lib, tmp_path, cache):
    out = run(PRELUDE + '''
assert torch._C._cuda_getAllocatorBackend() == "vmmalloc"
assert _companion.installed() and _companion.lost_features(True) == []
assert vmmalloc.oom_exception()[0] == "torch.cuda.OutOfMemoryError"
# getDeviceStats / resetPeakStats / snapshot() answered by vmmalloc.
out = ctypes.c_void_p()
assert lib.vmmalloc_try_malloc(3 << 20, 0, None, ctypes.byref(out)) == 0
st = torch._C._cuda_memoryStats(0)
assert st["allocated_bytes"]["all"]["current"] == 3 << 20, st["allocated_bytes"]
assert st["allocation"]["all"]["current"] == 1
lib.vmmalloc_free(out, 0, 0, None)
torch._C._cuda_resetPeakMemoryStats(0)
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"] == 0
assert lib.vmmalloc_try_malloc(7 << 20, 0, None, ctypes.byref(out)) == 0
snap = torch._C._cuda_memorySnapshot((0, 0))
blocks = [b for s in snap["segments"] for b in s["blocks"]]
live = [b for b in blocks if b["state"] == "active_allocated"]
assert [(b["address"], b["requested_size"]) for b in live] == [(out.value, 7 << 20)], live
for s in snap["segments"]:
    assert s["total_size"] == sum(b["size"] for b in s["blocks"])
print("COMPANION OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "COMPANION OK" in out.stdout


def test_graph_tree_checkpoint_and_restore_through_torch(lib, tmp_path, cache):
    # cudagraph_trees.py's calls, in its order: warm-up/recording into a
    # pool, checkPoolLiveAllocations, getCheckpointState after recording,
    # a tensor of the recording dies, setCheckpointPoolState on a path
    # divergence, raw deletes of what died, and the checkpoint dropped.
    out = run(PRELUDE + '''
pool = (0, 1)
assert lib.vmmalloc_pool_begin(0, *pool) == 0
a, b, c = pool_malloc(pool, 1 << 20), pool_malloc(pool, 512), pool_malloc(pool, 5 << 20)
assert lib.vmmalloc_pool_end(0, *pool) == 0
check = torch._C._cuda_checkPoolLiveAllocations
assert check(0, pool, {a, b, c})
assert not check(0, pool, {a, b})
assert not check(0, pool, {a, b, c, 64})
state = torch._C._cuda_getCheckpointState(0, pool)
# b dies after the checkpoint: the checkpoint holds nothing, so b's block
# is free in the pool (a snapshot shows it inactive) and is reused.
lib.vmmalloc_free(b, 0, 0, None)
assert check(0, pool, {a, c})
snap = torch._C._cuda_memorySnapshot(pool)
blocks = {}
for s in snap["segments"]:
    addr = s["address"]
    for blk in s["blocks"]:
        blocks[addr] = blk["state"]
        addr += blk["size"]
assert blocks.get(b) == "inactive", (hex(b), blocks)
d = pool_malloc(pool, 512)
assert d == b, "the freed block is reused"
lib.vmmalloc_free(d, 0, 0, None)
# The restore frees every block of the pool and allocates a, b, c again at
# their addresses (a and c: freed and allocated, as PyTorch reports them).
torch._C._cuda_setCheckpointPoolState(0, state, [], [])
assert check(0, pool, {a, b, c})
# b is dead for the tree: raw_delete reaches the pool through the
# pluggable bookkeeping the restore filled.
torch._C._cuda_cudaCachingAllocator_raw_delete(b)
assert check(0, pool, {a, c})
del state
gc.collect()
# Errors are PyTorch errors, not crashes.
try:
    torch._C._cuda_getCheckpointState(0, (5, 5))
    raise SystemExit("no error for an unknown pool")
except RuntimeError as e:
    assert "unknown pool (5, 5)" in str(e), e
try:
    check(0, (5, 5), set())
    raise SystemExit("no error for an unknown pool")
except RuntimeError as e:
    assert "unknown pool (5, 5)" in str(e), e
print("TREES OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TREES OK" in out.stdout


# The rows of issue 32's table, each through torch._C as PyTorch calls it
# (the shim's C++ hooks behind CUDAPluggableAllocator) and the C ABI.
HOOKS = PRELUDE + '''
MiB = 1 << 20
malloc = lib.vmmalloc_malloc            # PyTorch's alloc_fn (C++: throws on failure)
malloc.restype = ctypes.c_void_p
malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
def stats():
    return torch._C._cuda_memoryStats(0)
def allocated():
    return stats()["allocated_bytes"]["all"]["current"]
def reserved():
    return stats()["reserved_bytes"]["all"]["current"]
begin = torch._C._cuda_beginAllocateCurrentThreadToPool
end = torch._C._cuda_endAllocateToPool
release = torch._C._cuda_releasePool
'''


def test_frees_during_a_capture_are_reused_by_it(lib, tmp_path, cache):
    out = run(HOOKS + '''
pool = (0, 2)
begin(0, pool)
first = malloc(16 * MiB, 0, None)
lib.vmmalloc_free(first, 0, 0, None)
grown = reserved()
for i in range(50):
    t = malloc(16 * MiB, 0, None)
    assert t == first, (i, hex(t), hex(first))
    lib.vmmalloc_free(t, 0, 0, None)
assert reserved() == grown, (reserved(), grown)
assert pool_stats(pool)["reserved_bytes.all.current"] < 2 * 16 * MiB, pool_stats(pool)  # one temporary, not 50
end(0, pool)
release(0, pool)
print("REUSE OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REUSE OK" in out.stdout


def test_main_frees_during_a_pool_block_are_not_deferred(lib, tmp_path, cache):
    # 100 MiB device: 64 MiB in the main pool, freed inside use_mem_pool,
    # then 64 MiB into the pool fits only if the free was not deferred.
    out = run(HOOKS.replace("capacity_gb:1", "capacity_gb:0.1") + '''
x = malloc(64 * MiB, 0, None)
pool = (0, 3)
begin(0, pool)
lib.vmmalloc_free(x, 0, 0, None)
assert stats()["allocation"]["all"]["current"] == 0
y = malloc(64 * MiB, 0, None)
assert pool_stats(pool)["allocated_bytes.all.current"] == 64 * MiB
end(0, pool)
lib.vmmalloc_free(y, 0, 0, None)
release(0, pool)
print("MAIN OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MAIN OK" in out.stdout


def test_checkpoints_hold_nothing_and_pool_bytes_are_counted(lib, tmp_path, cache):
    # Ten recordings into one pool, each with a 64 MiB output the user then
    # drops, a checkpoint after each: the pool stays at 64 MiB, and
    # torch's figures include it.
    out = run(HOOKS + '''
pool = (0, 4)
states = []
first = None
for i in range(10):
    begin(0, pool)
    out = malloc(64 * MiB, 0, None)
    end(0, pool)
    if i:
        release(0, pool)                      # the tree's graphs share one use
    states.append(torch._C._cuda_getCheckpointState(0, pool))
    assert allocated() == 64 * MiB, allocated()
    first = first or reserved()               # 64 MiB mapped in 20 MiB steps (kLargeBuffer)
    assert reserved() == first < 2 * 64 * MiB, (i, reserved(), first)
    lib.vmmalloc_free(out, 0, 0, None)        # the user drops the output
assert pool_stats(pool)["reserved_bytes.all.current"] == first, pool_stats(pool)
assert lib.vmmalloc_pool_use_count(0, *pool) == 1
# Restoring any of them re-creates its block at its address.
torch._C._cuda_setCheckpointPoolState(0, states[3], [], [])
assert allocated() == 64 * MiB and reserved() == first
st = vmmalloc.memory_stats(0)
assert st["vmmalloc.graph_pools"] == 1 and st["vmmalloc.graph_pool_allocated_bytes"] == 64 * MiB, st
assert st["vmmalloc.graph_pool_checkpoints"] == 10, st
print("CHECKPOINTS OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CHECKPOINTS OK" in out.stdout


def test_nested_use_mem_pool_and_failed_begin_raise(lib, tmp_path, cache):
    out = run(HOOKS + '''
pool = (0, 5)
assert lib.vmmalloc_pool_create_or_incref(0, *pool) == 0      # MemPool()
begin(0, pool)                                               # use_mem_pool
try:
    begin(0, pool)                                           # nested: raises
    raise SystemExit("nested use_mem_pool did not raise")
except RuntimeError as e:
    assert "already recording" in str(e), e
assert lib.vmmalloc_pool_use_count(0, *pool) == 2
end(0, pool)
release(0, pool)
assert lib.vmmalloc_pool_use_count(0, *pool) == 1, "the MemPool keeps its use"
try:
    end(0, pool)
    raise SystemExit("end without a capture did not raise")
except RuntimeError as e:
    assert "not currently recording" in str(e), e
print("NESTED OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NESTED OK" in out.stdout
    # A backend without private pools refuses the capture instead of
    # sending its allocations to the main pool.
    out = run(HOOKS.replace("backend:expandable", "backend:caching") + '''
try:
    begin(0, (0, 6))
    raise SystemExit("begin on backend:caching did not raise")
except RuntimeError as e:
    assert "has no CUDA-graph private pools" in str(e), e
print("REFUSED OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED OK" in out.stdout


def test_snapshot_settings_and_oom_observers(lib, tmp_path, cache):
    out = run(HOOKS.replace("capacity_gb:1", "capacity_gb:0.25") + '''
settings = torch._C._cuda_memorySnapshot((0, 0))["allocator_settings"]
assert settings["garbage_collection_threshold"] == 0.0, settings
assert settings["max_split_size"] in (-1, (1 << 64) - 1), settings
assert settings["expandable_segments"] is True, settings
conf = settings.get("PYTORCH_CUDA_ALLOC_CONF", settings.get("last_allocator_settings"))
assert conf.startswith("vmmalloc ") and "backend:expandable" in conf and "device:host" in conf, settings
seen = []
# torch._C._cuda_attach_out_of_memory_observer initializes CUDA first (no
# driver here): the companion attaches the observer to itself as it would.
comp = _companion._loaded
OBS = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
observer = OBS(lambda *a: seen.append(a))
assert comp.vmmalloc_companion_attach_oom_observer_for_tests(observer) == 0
comp.vmmalloc_companion_malloc_for_tests.argtypes = [ctypes.c_size_t, ctypes.c_int]
assert comp.vmmalloc_companion_malloc_for_tests(300 * MiB, 0) == 1
assert len(seen) == 1, seen
device, size, cap, free = seen[0]
total = 256 * MiB
assert (device, size, cap) == (0, 300 * MiB, total), seen
assert 0 < free <= total, seen
print("SETTINGS OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SETTINGS OK" in out.stdout


def test_pause_and_resume_a_pool_in_place(lib, tmp_path, cache):
    out = run(HOOKS.replace("capacity_gb:1", "capacity_gb:0.1") + '''
pool = (0, 8)
begin(0, pool)
a = malloc(32 * MiB, 0, None)
end(0, pool)
ctypes.memset(a, 0x5A, 32 * MiB)
mapped = pool_stats(pool)["reserved_bytes.all.current"]    # 40 MiB: 20 MiB steps
assert mapped >= 32 * MiB
freed = vmmalloc.pause_pool(pool, keep=True)
assert freed == mapped, (freed, mapped)
assert reserved() == 0, reserved()
assert pool_stats(pool)["vmmalloc.paused"] is True
try:
    vmmalloc.pause_pool(pool)
    raise SystemExit("pausing twice did not raise")
except vmmalloc.VmmallocError as e:
    assert "paused" in str(e), e
# While paused, its memory is usable by others: 80 MiB fit.
other = malloc(80 * MiB, 0, None)
try:
    vmmalloc.resume_pool(pool)
    raise SystemExit("resume without memory did not raise")
except vmmalloc.VmmallocError as e:
    assert "out of memory" in str(e).lower(), e
assert pool_stats(pool)["vmmalloc.paused"] is True
lib.vmmalloc_free(other, 0, 0, None)
assert vmmalloc.resume_pool(pool) == mapped
assert ctypes.string_at(a, 32 * MiB) == b"\x5a" * (32 * MiB), "contents lost"
assert pool_stats(pool)["vmmalloc.paused"] is False
# keep=False: same addresses, contents not kept.
assert vmmalloc.pause_pool(pool, keep=False) == mapped
assert vmmalloc.resume_pool(pool) == mapped
try:
    vmmalloc.pause_pool((0, 99))
    raise SystemExit("unknown pool did not raise")
except vmmalloc.VmmallocError as e:
    assert "unknown pool (0, 99)" in str(e), e
lib.vmmalloc_free(a, 0, 0, None)
release(0, pool)
print("PAUSE OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PAUSE OK" in out.stdout


def test_mempool_use_counts_and_per_pool_stats(lib, tmp_path, cache):
    # torch.cuda.MemPool() needs a GPU to construct; its calls are
    # createOrIncrefPool (constructor), begin/end (use_mem_pool), getPoolUseCount
    # (use_count()), snapshot(pool) (MemPool.snapshot()) and releasePool (destructor).
    out = run(PRELUDE + '''
pool = (0, 7)
assert lib.vmmalloc_pool_use_count(0, *pool) == -1 and "unknown pool" in vmmalloc.last_error()
assert lib.vmmalloc_pool_create_or_incref(0, *pool) == 0
assert lib.vmmalloc_pool_use_count(0, *pool) == 1
assert lib.vmmalloc_pool_begin(0, *pool) == 0          # use_mem_pool
assert lib.vmmalloc_pool_use_count(0, *pool) == 2
x = pool_malloc(pool, 3 << 20)
assert lib.vmmalloc_pool_end(0, *pool) == 0
assert lib.vmmalloc_pool_release(0, *pool) == 0
assert lib.vmmalloc_pool_use_count(0, *pool) == 1
st = pool_stats(pool)
assert st["allocated_bytes.all.current"] == 3 << 20 and st["vmmalloc.live_blocks"] == 1, st
assert st["vmmalloc.use_count"] == 1
assert vmmalloc.pool_memory_stats(pool) == st
# The device's figures include the pool's, as PyTorch's do.
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 3 << 20
# MemPool.snapshot(): only the pool's segments, owned by it.
snap = torch._C._cuda_memorySnapshot(pool)
assert snap["segments"] and all(s["segment_pool_id"] == pool for s in snap["segments"]), snap["segments"]
live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
assert [b["address"] for b in live] == [x]
lib.vmmalloc_free(x, 0, 0, None)
assert lib.vmmalloc_pool_release(0, *pool) == 0       # ~MemPool
assert lib.vmmalloc_pool_release(0, *pool) == -1 and "no users left" in vmmalloc.last_error()
vmmalloc.empty_cache()                                 # the freeable pool's memory goes back
assert lib.vmmalloc_pool_use_count(0, *pool) == -1 and "gone" in vmmalloc.last_error()
assert torch._C._cuda_memoryStats(0)["reserved_bytes"]["all"]["current"] == 0
print("MEMPOOL OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MEMPOOL OK" in out.stdout


def test_fallback_says_what_is_lost(lib, tmp_path, cache):
    out = run('''
import warnings, torch, vmmalloc
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    vmmalloc.enable("device:host,capacity_gb:1,log:off")
print("BACKEND", torch._C._cuda_getAllocatorBackend())
for x in w:
    print("WARN", x.message)
''', tmp_path, cache, VMMALLOC_COMPANION="0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BACKEND pluggable" in out.stdout
    assert "the torch companion is unavailable ($VMMALLOC_COMPANION=0)" in out.stdout
    assert "torch.compile(mode='reduce-overhead')" in out.stdout and "torch.cuda.MemPool" in out.stdout


def test_nccl_register_hook_is_refused_with_the_variable_named(lib, tmp_path, cache):
    out = run('''
import os, warnings, vmmalloc
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    vmmalloc.enable("device:host,capacity_gb:1,log:off")
print("VALUE", os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"])
print("\\n".join(str(x.message) for x in w))
''', tmp_path, cache, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VALUE 0" in out.stdout
    assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 is turned off" in out.stdout


def test_check_lists_the_companion_features(lib, tmp_path, cache):
    out = run('''
import vmmalloc
print(vmmalloc.check())
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch companion" in out.stdout
    assert "checkPoolLiveAllocations" in out.stdout


# PyTorch's memory debugging tools through the companion: _record_memory_history
# (via a test entry that does what torch/csrc/cuda/memory_snapshot.cpp does,
# minus its lazy CUDA init), allocations on PyTorch's own allocation path
# (companion_malloc/companion_free), _snapshot/_dump_snapshot, _memory_viz,
# _allocation_traceback and the vmmalloc CLI's replay of the dump.
HISTORY = PRELUDE + '''
import pickle, re, subprocess, os
MiB = 1 << 20
comp = _companion._loaded
comp.vmmalloc_companion_alloc_for_tests.restype = ctypes.c_void_p
comp.vmmalloc_companion_alloc_for_tests.argtypes = [ctypes.c_size_t, ctypes.c_int]
comp.vmmalloc_companion_free_for_tests.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_rec = comp.vmmalloc_companion_record_memory_history_for_tests
_rec.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                 ctypes.c_char_p, ctypes.c_size_t]
_err = ctypes.create_string_buffer(2000)

def record(enabled="all", context="all", stacks="python", max_entries=(1 << 63) - 1, clear=0):
    enc = lambda s: None if s is None else s.encode()
    if _rec(enc(enabled), enc(context), enc(stacks), max_entries, clear, _err, len(_err)) != 0:
        raise RuntimeError(_err.value.decode())

def alloc(n):
    p = comp.vmmalloc_companion_alloc_for_tests(n, 0)
    assert p, vmmalloc.last_error()
    return p

def free(p, n):
    comp.vmmalloc_companion_free_for_tests(p, n, 0)

def names(frames):
    return [f["name"] for f in frames]
'''


def test_record_memory_history_gives_pytorch_traces_and_frames(lib, tmp_path, cache):
    out = run(HISTORY + '''
assert torch.cuda.memory._snapshot.__module__ == "torch.cuda.memory", "PyTorch's own _snapshot stays"
assert not torch._C._cuda_isHistoryEnabled()
before = alloc(3 * MiB)           # allocated before recording starts
record()
assert torch._C._cuda_isHistoryEnabled()

def make_activation():
    return alloc(64 * MiB)   # more than the cache holds: memory is mapped for it

def drop_scratch(p, n):
    free(p, n)

a = make_activation()
b = alloc(1000)
drop_scratch(b, 1000)
free(before, 3 * MiB)
assert comp.vmmalloc_companion_alloc_for_tests(5 << 30, 0) is None   # out of memory (1 GB device)
snap = torch.cuda.memory._snapshot()
trace = snap["device_traces"][0]
acts = [(e["action"], e.get("addr"), e["size"]) for e in trace]
# alloc of a, with the Python frames of the function that allocated it
ea = [e for e in trace if e["action"] == "alloc" and e["addr"] == a]
assert len(ea) == 1 and ea[0]["size"] == 64 * MiB, acts
assert "make_activation" in names(ea[0]["frames"]), ea[0]["frames"]
assert all(set(f) >= {"filename", "line", "name"} for f in ea[0]["frames"])
# context="all": the free carries the frames of the freeing call
fr = [e for e in trace if e["action"] == "free_requested" and e["addr"] == b]
assert len(fr) == 1 and "drop_scratch" in names(fr[0]["frames"]), fr
# a block allocated before recording is freed with its size
assert ("free_requested", before, 3 * MiB) in acts and ("free_completed", before, 3 * MiB) in acts, acts
# memory was mapped for a, with a's context, before a's alloc entry
i_alloc = trace.index(ea[0])
maps = [e for e in trace[:i_alloc] if e["action"] in ("segment_map", "segment_alloc")]
assert maps and any("make_activation" in names(m["frames"]) for m in maps), acts
# the out-of-memory, with the device's free bytes
oom = [e for e in trace if e["action"] == "oom"]
assert len(oom) == 1 and oom[0]["size"] == 5 << 30 and 0 < oom[0]["device_free"] <= 1 << 30, oom
# PyTorch's snapshot() records itself
assert trace[-1]["action"] == "snapshot", acts[-3:]
# times are microseconds since the epoch, in order
import time
ts = [e["time_us"] for e in trace]
assert ts == sorted(ts) and abs(ts[-1] / 1e6 - time.time()) < 600, ts[-3:]
# the live block's frames in the segments
blocks = {blk["address"]: blk for s in snap["segments"] for blk in s["blocks"]}
assert "make_activation" in names(blocks[a]["frames"]), blocks[a]
# _allocation_traceback (getContextForPointer)
tb = torch.cuda.memory._allocation_traceback(a)
assert tb and "make_activation" in names(tb), tb
assert torch.cuda.memory._allocation_traceback(a + 64) is None
# PyTorch's memory_viz reads it
from torch.cuda import _memory_viz
assert "segments:" in _memory_viz.segsum(snap)
assert "make_activation" in _memory_viz.trace(snap)
for plot in (_memory_viz.segment_plot, _memory_viz.trace_plot):
    html = plot(snap)
    assert "<html" in html.lower() and len(html) > 1000, plot
# _dump_snapshot writes the same thing as a pickle
path = "dump.pickle"
torch.cuda.memory._dump_snapshot(path)
with open(path, "rb") as f:
    dumped = pickle.load(f)
assert [e["action"] for e in dumped["device_traces"][0]][:-1] == [e["action"] for e in trace], "dump"
free(a, 64 * MiB)
# a ring bounded by max_entries keeps the newest
record(max_entries=4, clear=1)
ps = [alloc(4096 + i) for i in range(6)]
t = torch.cuda.memory._snapshot()["device_traces"][0]
assert len(t) == 4 and t[-1]["action"] == "snapshot" and t[-2]["addr"] == ps[-1], t
for i, p in enumerate(ps):
    free(p, 4096 + i)
# context=None: events, no frames; stacks="all" is accepted
record(context=None, clear=1)
p = alloc(MiB)
e = [e for e in torch.cuda.memory._snapshot()["device_traces"][0] if e["action"] == "alloc"]
assert e and all(not x.get("frames") for x in e), e  # PyTorch writes no frames without a context
free(p, MiB)
record(stacks="all", clear=1)
p = alloc(MiB)
e = [e for e in torch.cuda.memory._snapshot()["device_traces"][0] if e["action"] == "alloc"]
assert e and "<module>" in names(e[0]["frames"]), e
free(p, MiB)
# enabled=None stops and drops the ring
record(enabled=None)
assert not torch._C._cuda_isHistoryEnabled()
assert all(t == [] for t in torch.cuda.memory._snapshot()["device_traces"])
# bad options are refused as PyTorch refuses them
try:
    record(enabled="sometimes")
    raise SystemExit("accepted a bad option")
except RuntimeError as e:
    assert "expected state" in str(e), e
print("HISTORY OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "HISTORY OK" in out.stdout


def test_dumped_history_replays_with_the_runs_peak(lib, tmp_path, cache):
    from test_capi import cli

    exe = cli()
    if exe is None:
        pytest.skip("the vmmalloc CLI is not built (cargo build --bin vmmalloc)")
    out = run(HISTORY + '''
import random
random.seed(7)
live = {}
record()
peak = cur = 0
for i in range(300):
    if live and (random.random() < 0.45 or cur > 600 * MiB):
        p = random.choice(list(live))
        cur -= live[p]
        free(p, live.pop(p))
    else:
        n = random.choice([512, 4096, 1 << 20, 3 << 20, 17 << 20, 60 << 20])
        p = alloc(n)
        live[p] = n
        cur += n
        peak = max(peak, cur)
torch.cuda.memory._dump_snapshot("run.pickle")
print("PEAK", peak)
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    peak = int(re.search(r"PEAK (\d+)", out.stdout).group(1))
    rep = subprocess.run([exe, "replay", str(tmp_path / "run.pickle"), "--policy", "expandable",
                          "--capacity", "4GiB"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    m = re.search(r"peak live \(trace\)\s+.*\((\d+) bytes\)", rep.stdout)
    assert m, rep.stdout
    assert int(m.group(1)) == peak, (int(m.group(1)), peak, rep.stdout)


def test_cache_info_answers_cudnn(lib, tmp_path, cache):
    out = run(HISTORY + '''
ci = comp.vmmalloc_companion_cache_info_for_tests
ci.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
largest = ctypes.c_size_t(0)
assert ci(0, ctypes.byref(largest)) == 0
assert 512 * MiB < largest.value <= 1 << 30, largest.value   # a zero guess: the free bytes
p = alloc(64 * MiB)
free(p, 64 * MiB)
largest = ctypes.c_size_t(1)
assert ci(0, ctypes.byref(largest)) == 0
assert largest.value >= 64 * MiB, largest.value              # served from the cache
assert ci(99, ctypes.byref(largest)) == -1
print("CACHEINFO OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CACHEINFO OK" in out.stdout


def test_bench_entry_measures_the_companion_pair(lib, tmp_path, cache):
    # scripts/bench_history.py's measurement, small: a positive median per
    # pair with recording off and on, and nothing left allocated.
    out = run(HISTORY + '''
bench = comp.vmmalloc_companion_bench_pairs_for_tests
bench.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
ns = ctypes.c_double()
assert bench(1 << 20, 0, 50, 3, ctypes.byref(ns)) == 0 and ns.value > 0
record()
assert bench(1 << 20, 0, 50, 3, ctypes.byref(ns)) == 0 and ns.value > 0
assert sum(e["action"] == "alloc" for e in torch.cuda.memory._snapshot()["device_traces"][0]) == 150
assert bench(1 << 20, 0, 0, 3, ctypes.byref(ns)) == -1
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
print("BENCH OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BENCH OK" in out.stdout


def test_versions_older_than_the_oldest_supported_are_refused_by_name(tmp_path):
    class OldTorch:
        __version__ = "2.4.1+cu121"
        __file__ = "/nonexistent/torch/__init__.py"

    with pytest.raises(RuntimeError, match=r"needs PyTorch 2\.5 or newer; this is PyTorch 2\.4\.1"):
        _companion.build(OldTorch, tmp_path / "c.so")
    _companion.check_supported("2.5.0")
    _companion.check_supported("2.15.0+cu132")
    assert _companion.version_tuple("2.10.0a0+git") == (2, 10)
    with pytest.raises(ValueError):
        _companion.version_tuple("nightly")


def test_what_older_versions_lack_is_named():
    assert _companion.absent_in("2.15.0") == []
    absent = dict(_companion.absent_in("2.5.1"))
    assert absent["getMemoryFraction"] == "2.6" and absent["annotateMemory"] == "2.14"
    assert "recordHistory" not in absent and "createOrIncrefPool" not in absent
    assert dict(_companion.absent_in("2.12.1")) == {"annotateMemory": "2.14"}
    # Every method of the table is one the companion implements under a version guard.
    source = _companion.SOURCE.read_text()
    for method, (major, minor) in _companion.NOT_IN_VERSION.items():
        assert f"VMM_NO_{method})" in source and f"VMM_TORCH_AT_LEAST({major}, {minor})" in source, method


def test_hot_path_bench_entry_runs_both_paths(lib, tmp_path, cache):
    # scripts/bench_hot_path.py's measurement, small: both paths allocate and
    # free (nothing left allocated, no pointer left in PyTorch's map).
    out = run(HISTORY + '''
bench = comp.vmmalloc_companion_bench_hot_path_for_tests
bench.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                  ctypes.POINTER(ctypes.c_double)]
ours, theirs = ctypes.c_double(), ctypes.c_double()
assert bench(1 << 20, 100, 3, ctypes.byref(ours), ctypes.byref(theirs)) == 0
assert ours.value > 0 and theirs.value > 0
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
assert torch._C._cuda_memoryStats(0)["allocation"]["all"]["allocated"] >= 600
assert bench(1 << 20, 0, 3, ctypes.byref(ours), ctypes.byref(theirs)) == -1
print("HOT OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "HOT OK" in out.stdout


def test_mempool_with_its_own_allocator_is_routed_to_it(lib, tmp_path, cache):
    # torch.cuda.MemPool(allocator=...) (vLLM's sleep mode): allocations made
    # into the pool go to its allocator, vmmalloc serves the rest, frees find
    # their allocator, use counts and live checks answer for the pool. The
    # sequence PyTorch 2.11+ calls, through a companion test entry (MemPool's
    # constructor needs a GPU); no_split on one of vmmalloc's own pools.
    out = run(PRELUDE + '''
comp = _companion._loaded
err = ctypes.create_string_buffer(1000)
assert comp.vmmalloc_companion_mempool_allocator_for_tests(err, len(err)) == 0, err.value
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
print("MEMPOOL ALLOCATOR OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MEMPOOL ALLOCATOR OK" in out.stdout


def test_mempool_use_on_oom_lends_the_pools_free_blocks(lib, tmp_path, cache):
    # torch.cuda.MemPool(use_on_oom=True): an allocation outside the pool
    # that would run out of memory gets the pool's free block (PyTorch's
    # use_on_oom_pools), until ~MemPool turns it off; through a companion
    # test entry (MemPool's constructor needs a GPU).
    out = run(PRELUDE + '''
comp = _companion._loaded
err = ctypes.create_string_buffer(1000)
assert comp.vmmalloc_companion_use_on_oom_for_tests(err, len(err)) == 0, err.value
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
print("USE ON OOM OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USE ON OOM OK" in out.stdout
