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

from conftest import PACKAGE_PARENT, REPO, require_torch

require_torch()

from vmmalloc import _companion  # noqa: E402

# The PyTorch these tests run against: the newest (installed) and, in CI, the
# oldest supported (scripts/companion_matrix.py --runtime, issue 40).
TORCH = _companion.version_tuple(__import__("torch").__version__)


def since(major, minor, what):
    """Skips a test of `what`, which PyTorch offers only from major.minor
    (the Python API itself is missing before: nothing to test there)."""
    return pytest.mark.skipif(TORCH < (major, minor),
                              reason=f"{what}: not in PyTorch {TORCH[0]}.{TORCH[1]} (from {major}.{minor})")


@pytest.fixture(scope="module")
def cache(companion_cache):
    """The session's companion builds (conftest.py; one takes ten seconds or more)."""
    return companion_cache


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
    # and, on an older PyTorch, the one naming what that version lacks
    warnings.filterwarnings("ignore", message="vmmalloc: PyTorch .* does not have")
    vmmalloc.enable("device:host,capacity_gb:1,log:off,backend:expandable")
lib = vmmalloc.load()
TORCH = _companion.version_tuple(torch.__version__)

def snapshot(pool=(0, 0)):
    """torch._C._cuda_memorySnapshot(pool); before 2.6 it takes no pool:
    the whole snapshot, filtered as the native one filters by pool."""
    try:
        return torch._C._cuda_memorySnapshot(pool)
    except TypeError:
        snap = torch._C._cuda_memorySnapshot()
        if tuple(pool) != (0, 0):
            snap["segments"] = [s for s in snap["segments"] if tuple(s["segment_pool_id"]) == tuple(pool)]
        return snap
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

    # A copy of the sources with one override PyTorch has no virtual for (the
    # copy's parts are included before the package's: quoted includes).
    for part in _companion.source_files(_companion.COMPANION_DIR / "vmmalloc_torch.cpp"):
        (tmp_path / part.name).write_bytes(part.read_bytes())
    src, adaptor = tmp_path / "vmmalloc_torch.cpp", tmp_path / "allocator.h"
    text = adaptor.read_text()
    marker = "  std::string name() VMM_OVERRIDE"
    assert marker in text
    adaptor.write_text(text.replace(marker, "#ifndef VMM_NO_noSuchHook\n  void noSuchHook() VMM_OVERRIDE {}\n"
                                            "#endif\n" + marker))
    monkeypatch.setattr(_companion, "SOURCE", src)
    path = _companion.build(torch, tmp_path / "companion.so")
    assert _companion.lost_methods(path) == ["noSuchHook"]


def test_enable_installs_the_companion(lib, tmp_path, cache):
    out = run(PRELUDE + '''
assert torch._C._cuda_getAllocatorBackend() == "vmmalloc"
assert _companion.installed() and _companion.lost_features(True) == []
# c10's registered CUDA allocator (at::getDeviceAllocator, torch.accelerator) is the companion too.
assert _companion._loaded.vmmalloc_companion_registered_cuda_allocator_for_tests() == 1
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
snap = snapshot((0, 0))
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
snap = snapshot(pool)
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
# The thread-filtered begin (no CUDA stream needed) from 2.8; before, the
# all-streams one (use_mem_pool's) and the end that takes the pool.
begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None) or torch._C._cuda_beginAllocateToPool
end = getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool
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
# 2.13+: the graph pool's own reserved bytes, as PyTorch keys them (the id
# tuple; memory_stats() flattens it to "0_2"); none before 2.13.
mine = pool_stats(pool)["reserved_bytes.all.current"]
if TORCH >= (2, 13):
    assert stats()["reserved_bytes_by_private_pools"][pool]["all"]["current"] == mine > 0, stats()
    assert torch.cuda.memory_stats(0)["reserved_bytes_by_private_pools.0_2.all.current"] == mine
else:
    assert "reserved_bytes_by_private_pools" not in stats()
end(0, pool)
release(0, pool)
if TORCH >= (2, 13):
    # Released and given back: the entry stays, current 0, until a reset.
    torch._C._cuda_emptyCache()
    e = stats()["reserved_bytes_by_private_pools"][pool]["all"]
    assert e["current"] == 0 and e["allocated"] == e["freed"] >= mine, e
    torch._C._cuda_resetAccumulatedMemoryStats(0)
    e = stats()["reserved_bytes_by_private_pools"][pool]["all"]
    assert e["allocated"] == e["freed"] == 0 and e["peak"] >= mine, e
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


def test_capture_and_mempool_use_counts_are_this_pytorchs(lib, tmp_path, cache):
    # Issue 40: a begin adds one use in every version
    # (c10/cuda/CUDACachingAllocator.cpp beginAllocateToPool: a new
    # PrivatePool starts at 1, an existing one use_count++), CUDAGraph::reset's
    # releasePool drops it. Before 2.8 the companion added a second one, so a
    # released graph's pool was never freed: a 64 MiB capture on a 100 MiB
    # device, graph released, and the next 64 MiB ran out of memory.
    out = run(HOOKS.replace("capacity_gb:1", "capacity_gb:0.09765625") + '''
import inspect
comp = _companion._loaded
err = ctypes.create_string_buffer(1000)
comp.vmmalloc_companion_mempool_ctor_for_tests.argtypes = [ctypes.c_int, U64, U64, ctypes.c_char_p,
                                                            ctypes.c_size_t]
comp.vmmalloc_companion_test_pool_use_count.argtypes = [U64, U64]
def uc(pool):
    return lib.vmmalloc_pool_use_count(0, *pool)
graph = (1, 0)                          # CUDAGraph's own pool (graph_pool_handle(false))
begin(0, graph)                         # CUDAGraph::capture_begin
assert uc(graph) == 1, uc(graph)
# A nested begin is refused with nothing changed. (PyTorch's use_count++
# comes before its "already recording" check, and a capture_begin that threw
# never releases it: that leak is not copied.)
try:
    begin(0, graph)
    raise SystemExit("a nested begin did not raise")
except RuntimeError as e:
    assert "already recording" in str(e), e
assert uc(graph) == 1, uc(graph)
x = malloc(64 * MiB, 0, None)           # the capture's tensor
lib.vmmalloc_free(x, 0, 0, None)
end(0, graph)                           # capture_end
release(0, graph)                       # the graph released (CUDAGraph::reset)
assert uc(graph) in (0, -1), uc(graph)  # no user left (-1: already gone)
y = malloc(64 * MiB, 0, None)           # the released pool's memory serves it
lib.vmmalloc_free(y, 0, 0, None)

# torch.cuda.MemPool: its constructor's call (none before 2.6), then
# use_mem_pool (torch/cuda/memory.py: releasePool at its exit from 2.6),
# then ~MemPool's releasePool (from 2.6).
mine = 1 if TORCH >= (2, 6) else 0
releases = "_cuda_releasePool" in inspect.getsource(torch.cuda.use_mem_pool)
assert releases == (TORCH >= (2, 6)), inspect.getsource(torch.cuda.use_mem_pool)
pool = (0, 99)                          # not an id MemPool() hands out below
assert comp.vmmalloc_companion_mempool_ctor_for_tests(0, *pool, err, len(err)) == 0, err.value
assert uc(pool) == (1 if mine else -1), uc(pool)
begin(0, pool)
assert uc(pool) == mine + 1, uc(pool)
end(0, pool)
if releases:
    release(0, pool)
assert uc(pool) == 1, uc(pool)          # 2.5: use_mem_pool's use (kept); 2.6+: the MemPool's own
if TORCH >= (2, 6):
    assert comp.vmmalloc_companion_test_pool_use_count(*pool) == 1   # MemPool.use_count()
    release(0, pool)                    # ~MemPool
    assert uc(pool) in (0, -1), uc(pool)
else:
    # 2.5's MemPool needs no GPU: the real one, as the issue measured it.
    real = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(real, device=0):
        pass
    assert uc(real.id) == 1, uc(real.id)
print("USE COUNTS OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USE COUNTS OK" in out.stdout


def test_snapshot_settings_and_oom_observers(lib, tmp_path, cache):
    out = run(HOOKS.replace("capacity_gb:1", "capacity_gb:0.25") + '''
settings = snapshot((0, 0))["allocator_settings"]
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
# Issue 40: while the pool is paused, replay() of a graph on it raises
# (CUDAGraph needs a GPU to construct: a stand-in with its pool(), through the
# class's replay as cudagraph trees call it); once resumed it replays.
class Graph:
    def pool(self):
        return pool
vmmalloc.pause_pool(pool, keep=True)
try:
    torch.cuda.CUDAGraph.replay(Graph())
    raise SystemExit("replay of a paused pool's graph did not raise")
except vmmalloc.VmmallocError as e:
    assert "pool (0, 8) is paused" in str(e) and "resume_pool" in str(e), e
class Other:
    def pool(self):
        return (0, 9)
for g in (Other(), Graph()):   # another pool, then this one resumed: PyTorch's own replay runs
    if isinstance(g, Graph):
        vmmalloc.resume_pool(pool)
    try:
        torch.cuda.CUDAGraph.replay(g)
    except vmmalloc.VmmallocError as e:
        raise SystemExit(f"guard refused a graph it should pass: {e}")
    except (TypeError, AttributeError):
        pass                   # PyTorch's replay: the stand-in is not a graph
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
snap = snapshot(pool)
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


def test_nccl_register_hook_is_served_or_refused_with_the_variable_named(lib, tmp_path, cache):
    code = '''
import os, sys, warnings, vmmalloc
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    vmmalloc.enable(sys.argv[1] if len(sys.argv) > 1 else "device:host,capacity_gb:1,log:off")
print("VALUE", os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"])
print("\\n".join(str(x.message) for x in w))
'''
    # Served by the companion: the variable stays.
    out = run(code, tmp_path, cache, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VALUE 1" in out.stdout and "is turned off" not in out.stdout, out.stdout
    # nccl_register:False: the old behaviour, said.
    out = run(code.replace("sys.argv[1] if len(sys.argv) > 1 else ", "").replace(
        '"device:host,capacity_gb:1,log:off"', '"device:host,capacity_gb:1,log:off,nccl_register:False"'),
        tmp_path, cache, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VALUE 0" in out.stdout
    assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 is turned off (set to 0): nccl_register:False" \
        in out.stdout, out.stdout
    # Without the companion (the plain pluggable allocator has no trackers).
    out = run(code, tmp_path, cache, TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK="1", VMMALLOC_COMPANION="0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VALUE 0" in out.stdout and "the torch companion is not installed" in out.stdout, out.stdout


# The fake NCCL of the companion's test harness (companion_test_harness.cpp)
# behind ProcessGroupNCCL's tracker: every step is checked to leave the
# registrations equal to the snapshot's segments, and no register or
# deregister refused (issue 43).
NCCL = HOOKS + '''
comp = _companion._loaded
U64P = ctypes.POINTER(ctypes.c_uint64)
comp.vmmalloc_companion_fake_nccl_check_for_tests.argtypes = [U64P, U64P, ctypes.c_char_p, ctypes.c_size_t]
comp.vmmalloc_companion_fake_nccl_pool_for_tests.argtypes = [U64, U64, ctypes.c_int]
def check(step):
    regs, deregs = ctypes.c_uint64(), ctypes.c_uint64()
    err = ctypes.create_string_buffer(4096)
    rc = comp.vmmalloc_companion_fake_nccl_check_for_tests(ctypes.byref(regs), ctypes.byref(deregs), err, 4096)
    assert rc == 0, f"{step}: {err.value.decode()}"
    return regs.value, deregs.value
def free(p):
    lib.vmmalloc_free(p, 0, 0, None)
'''


def test_nccl_registrations_follow_every_map_and_unmap(lib, tmp_path, cache):
    out = run(NCCL.replace("capacity_gb:1", "capacity_gb:0.5,spill:True") + '''
early = [malloc(3 * MiB, 0, None), malloc(40 * MiB, 0, None)]
# initNCCLComm: the segments mapped now are registered from the snapshot.
assert comp.vmmalloc_companion_fake_nccl_attach_for_tests(1) == 0
check("attach")
live = [malloc(n, 0, None) for n in (1000, 2 * MiB, 7 * MiB, 64 * MiB, 100 * MiB)]
check("allocate")
for p in live[1::2] + early[:1]:
    free(p)
check("free")
vmmalloc.empty_cache()
r1, d1 = check("empty_cache")
assert d1 > 0, (r1, d1)
# Fragment, then a large request that must reclaim, unpin or spill.
small = [malloc(6 * MiB, 0, None) for _ in range(40)]
for p in small[::2]:
    free(p)
check("fragment")
big = malloc(200 * MiB, 0, None)
check("large request in fragmented memory")
free(big)
for p in small[1::2]:
    free(p)
vmmalloc.empty_cache()
check("empty again")
# Pause and resume a tag (sleep mode), with and without a backup.
vmmalloc.set_tag("weights")
w = [malloc(30 * MiB, 0, None), malloc(5 * MiB, 0, None)]
vmmalloc.set_tag("")
check("tagged")
for backup in (True, False):
    vmmalloc.pause("weights", backup=backup)
    check(f"paused (backup={backup})")
    vmmalloc.resume("weights")
    check(f"resumed (backup={backup})")
# A graph pool: its segments carry its id; releasing it deregisters them.
pool = (0, 9)
begin(0, pool)
g = [malloc(8 * MiB, 0, None), malloc(20 * MiB, 0, None)]
end(0, pool)
check("graph pool")
for p in g:
    free(p)
release(0, pool)
vmmalloc.empty_cache()
for p in w + live[0::2] + early[1:]:
    free(p)
vmmalloc.empty_cache()
regs, deregs = check("all freed")
added, removed = ctypes.c_uint64(), ctypes.c_uint64()
assert lib.vmmalloc_segment_changes(0, ctypes.byref(added), ctypes.byref(removed)) == 0
print("COUNTS", regs, deregs, added.value, removed.value)
assert regs > 10 and deregs > 10, (regs, deregs)
print("NCCL FOLLOW OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NCCL FOLLOW OK" in out.stdout


FAKE_CUDA = REPO / "target" / "debug" / "libcuda.so"  # the checkout's, also when the package tested is installed


def test_a_tracker_that_throws_is_reported_and_the_allocation_goes_on(lib, tmp_path, cache):
    # A register hook whose ncclCommRegister fails throws from the tracker;
    # libvmmalloc runs it under its lock through a C callback, so the
    # companion must report it on stderr and let the allocation go on.
    out = run(HOOKS + '''
comp = _companion._loaded
comp.vmmalloc_companion_throwing_tracker_seen_for_tests.restype = ctypes.c_uint64
assert comp.vmmalloc_companion_attach_throwing_tracker_for_tests() == 0
p = malloc(8 * MiB, 0, None)
assert p, "the allocation failed"
seen = comp.vmmalloc_companion_throwing_tracker_seen_for_tests()
assert seen >= 1, seen
lib.vmmalloc_free(p, 0, 0, None)
vmmalloc.empty_cache()
assert comp.vmmalloc_companion_throwing_tracker_seen_for_tests() > seen
print("THROWING OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "THROWING OK" in out.stdout
    assert "an allocator trace tracker failed on segment_alloc" in out.stderr, out.stderr
    assert "ncclCommRegister refused (test)" in out.stderr, out.stderr


def test_nccl_registrations_follow_on_two_devices_of_the_fake_driver(lib, tmp_path, cache):
    # The real cuda backend over the fake libcuda (tests/fake-cuda, built by
    # cargo test --workspace), two devices: each device's segments are
    # followed apart, every change naming its device.
    if not FAKE_CUDA.is_file():
        if os.environ.get("VMMALLOC_REQUIRE_TORCH") == "1":
            pytest.fail(f"{FAKE_CUDA} is not built")
        pytest.skip(f"{FAKE_CUDA} is not built (cargo build -p fake-cuda)")
    out = run(NCCL.replace('"device:host,capacity_gb:1,log:off,backend:expandable"',
                           '"device:cuda,log:off,backend:expandable"').replace(
                               'message="vmmalloc: enabled with device:host"',
                               'message="vmmalloc: enabled with device:cuda"') + '''
a0 = malloc(10 * MiB, 0, None)
a1 = malloc(30 * MiB, 1, None)
assert comp.vmmalloc_companion_fake_nccl_attach_for_tests(1) == 0
check("attach")
b = [malloc(n, d, None) for d in (0, 1) for n in (1 * MiB, 50 * MiB, 3 * MiB)]
check("allocate on both")
for p, d in zip(b, (0, 0, 0, 1, 1, 1)):
    if p % 2 == 0:
        lib.vmmalloc_free(p, 0, d, None)
lib.vmmalloc_free(a1, 0, 1, None)
vmmalloc.empty_cache()
check("freed and emptied")
added, removed = ctypes.c_uint64(), ctypes.c_uint64()
for d in (0, 1):
    assert lib.vmmalloc_segment_changes(d, ctypes.byref(added), ctypes.byref(removed)) == 0
    assert added.value > 0 and removed.value > 0, (d, added.value, removed.value)
print("TWO DEVICES OK")
''', tmp_path, cache, VMMALLOC_CUDA_LIBRARY=str(FAKE_CUDA), FAKE_CUDA_DEVICES="2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TWO DEVICES OK" in out.stdout


@since(2, 8, "trace entries carrying their pool (register_mem_pool without the hook variable)")
def test_register_mem_pool_registers_only_that_pools_segments(lib, tmp_path, cache):
    out = run(NCCL + '''
other = malloc(16 * MiB, 0, None)
pool = (0, 11)
begin(0, pool)
a = malloc(8 * MiB, 0, None)
end(0, pool)
# The hook variable off: only registered pools; register_mem_pool registers
# the pool's snapshot segments, later entries of the pool come through the hook.
assert comp.vmmalloc_companion_fake_nccl_attach_for_tests(0) == 0
assert comp.vmmalloc_companion_fake_nccl_pool_for_tests(*pool, 1) == 0
r0, _ = check("registered the pool")
assert r0 >= 1
begin(0, pool)
b = malloc(40 * MiB, 0, None)
end(0, pool)
check("the pool grew")
c = malloc(50 * MiB, 0, None)   # the default pool: not registered
check("default pool allocation")
free(b)
begin(0, pool)
vmmalloc.empty_cache()
end(0, pool)
check("the pool shrank")
assert comp.vmmalloc_companion_fake_nccl_pool_for_tests(*pool, 0) == 0
check("deregistered the pool")
print("MEMPOOL OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MEMPOOL OK" in out.stdout


def test_check_lists_the_companion_features(lib, tmp_path, cache):
    out = run('''
import vmmalloc
print(vmmalloc.check())
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch companion" in out.stdout
    assert "checkPoolLiveAllocations" in out.stdout


def test_check_and_enable_say_what_this_pytorch_lacks_from_one_table(lib, tmp_path, cache):
    # Issue 40: --check, enable()'s warning and docs/companion-matrix.md all
    # come from _companion.NOT_IN_VERSION (2.5: MemPool(allocator=...) is not
    # routed there, so --check must not say it is).
    out = run('''
import warnings, torch, vmmalloc
from vmmalloc import _companion
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    vmmalloc.enable("device:host,capacity_gb:1,log:off,backend:expandable")
said = [str(w.message) for w in caught if "does not have" in str(w.message)]
expected = _companion.absent_warning(torch.__version__)
assert said == ([expected] if expected else []), said
report = str(vmmalloc.check())
for feature, first in _companion.absent_features(torch.__version__):
    assert f"{feature}: not in PyTorch {torch.__version__} (its allocator interface has it from {first})" in report, feature
routed = "torch.cuda.MemPool(allocator=...) routed to its allocator (createOrIncrefPool): "
line = next(l for l in report.splitlines() if routed in l)
assert ("not in PyTorch" in line) == (_companion.version_tuple(torch.__version__) < (2, 8)), line
print("TABLE OK", len(_companion.absent_features(torch.__version__)))
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TABLE OK" in out.stdout


def test_raw_delete_and_memory_fraction_refuse_what_pytorch_refuses(lib, tmp_path, cache):
    # Issue 40: PyTorch's raw_delete of a pointer that is not a live
    # allocation raises "invalid device pointer: <ptr>" (CUDACachingAllocator.cpp
    # free); its setMemoryFraction refuses a fraction outside [0, 1] or NaN
    # ("invalid fraction:<f>. Please set within [0, 1]."). Both changed nothing.
    out = run(PRELUDE + '''
raw_delete = torch._C._cuda_cudaCachingAllocator_raw_delete
out = ctypes.c_void_p()
assert lib.vmmalloc_try_malloc(1 << 20, 0, None, ctypes.byref(out)) == 0
p = out.value
raw_delete(p)                                   # a live allocation: freed
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
for bad in (p, p + 4096, 0x1234000):            # freed already, inside nothing, never allocated
    try:
        raw_delete(bad)
        raise SystemExit(f"raw_delete({hex(bad)}) did not raise")
    except RuntimeError as e:
        assert f"invalid device pointer: {hex(bad)}" in str(e), e
raw_delete(0)                                   # NULL: nothing, as PyTorch
set_fraction = torch._C._cuda_setMemoryFraction
set_fraction(0.5, 0)
for bad, text in ((1.5, "1.5"), (-0.25, "-0.25"), (float("nan"), "nan")):
    try:
        set_fraction(bad, 0)
        raise SystemExit(f"fraction {bad} accepted")
    except RuntimeError as e:
        assert f"invalid fraction:{text}. Please set within [0, 1]." in str(e), e
if hasattr(torch._C, "_cuda_getMemoryFraction"):   # 2.6+
    assert torch._C._cuda_getMemoryFraction(0) == 0.5
print("REFUSED OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED OK" in out.stdout


def test_reset_accumulated_memory_stats_zeroes_what_pytorchs_does(lib, tmp_path, cache):
    # Issue 40: PyTorch's resetAccumulatedStats (CUDACachingAllocator.cpp)
    # zeroes every stat's allocated/freed, oversize_*'s, num_alloc_retries,
    # num_ooms, num_sync_all_streams, num_device_alloc/free; current and
    # peak stay. The pluggable allocator raised ("does not yet support").
    out = run(PRELUDE.replace("capacity_gb:1", "capacity_gb:0.25") + '''
out = ctypes.c_void_p()
ptrs = []
for n in (3 << 20, 700, 5 << 20):
    assert lib.vmmalloc_try_malloc(n, 0, None, ctypes.byref(out)) == 0
    ptrs.append(out.value)
lib.vmmalloc_free(ptrs.pop(), 0, 0, None)
assert lib.vmmalloc_try_malloc(1 << 40, 0, None, ctypes.byref(out)) != 0   # one out-of-memory
before = torch._C._cuda_memoryStats(0)
assert before["allocation"]["all"]["allocated"] == 3 and before["num_ooms"] == 1, before
torch.cuda.reset_accumulated_memory_stats(0)
for after in (torch._C._cuda_memoryStats(0), torch.cuda.memory_stats_as_nested_dict(0)):
    for key in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for kind in ("all", "small_pool", "large_pool"):
            a, b = after[key][kind], before[key][kind]
            assert a["allocated"] == 0 and a["freed"] == 0, (key, kind, a)
            assert (a["current"], a["peak"]) == (b["current"], b["peak"]), (key, kind, a, b)
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"):
        assert after[key] == 0, (key, after[key])
# Counting goes on from zero.
lib.vmmalloc_free(ptrs.pop(), 0, 0, None)
st = torch.cuda.memory_stats(0)
assert st["allocation.all.allocated"] == 0 and st["allocation.all.freed"] == 1, st
assert st["allocation.all.current"] == 1
# PyTorch's own keys, as this version names them (num_oom_rejections from 2.12).
native = torch._C._cuda_memoryStats(0)
assert ("num_oom_rejections" in native) == ("num_oom_rejections" in st) == (TORCH >= (2, 12)), sorted(native)
assert st.get("num_oom_rejections", 0) == native.get("num_oom_rejections", 0) == 0
print("ACCUMULATED OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ACCUMULATED OK" in out.stdout


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
# _allocation_traceback (getContextForPointer, from 2.12)
if TORCH >= (2, 12):
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


def test_empty_cache_and_checkpoint_restore_entries_carry_the_callers_frames(lib, tmp_path, cache):
    # As the native allocator: emptyCache gathers a context at ALL for the
    # segment_unmap/segment_free entries it causes; setCheckpointPoolState one
    # at STATE for the blocks it allocates again (its frees gather their own
    # at ALL, else carry the block's).
    out = run(HISTORY + '''
record()
a = alloc(64 * MiB)
free(a, 64 * MiB)

def give_back():
    torch._C._cuda_emptyCache()

n = len(torch.cuda.memory._snapshot()["device_traces"][0])
give_back()
trace = torch.cuda.memory._snapshot()["device_traces"][0][n:]
gone = [e for e in trace if e["action"] in ("segment_unmap", "segment_free")]
assert gone, [e["action"] for e in trace]
assert all("give_back" in names(e["frames"]) for e in gone), gone

pool = (0, 9)
assert lib.vmmalloc_pool_begin(0, *pool) == 0
def record_graph():
    return pool_malloc(pool, 1 << 20), pool_malloc(pool, 512), pool_malloc(pool, 5 << 20)
x, y, z = record_graph()
assert lib.vmmalloc_pool_end(0, *pool) == 0
state = torch._C._cuda_getCheckpointState(0, pool)
lib.vmmalloc_free(y, 0, 0, None)

def restore():
    torch._C._cuda_setCheckpointPoolState(0, state, [], [])

n = len(torch.cuda.memory._snapshot()["device_traces"][0])
restore()
trace = torch.cuda.memory._snapshot()["device_traces"][0][n:]
allocs = [e for e in trace if e["action"] == "alloc"]
assert sorted(e["addr"] for e in allocs) == sorted([x, y, z]), [(e["action"], e["addr"]) for e in trace]
assert all("restore" in names(e["frames"]) for e in allocs), allocs
frees = [e for e in trace if e["action"] == "free_requested"]
assert frees and all("restore" in names(e["frames"]) for e in frees), frees
# Below ALL a free carries its block's context, not the call's.
record(context="alloc", clear=1)
p = alloc(MiB)
def drop():
    free(p, MiB)
drop()
e = [e for e in torch.cuda.memory._snapshot()["device_traces"][0] if e["action"] == "free_requested"]
assert e and "drop" not in names(e[0]["frames"]) and "<module>" in names(e[0]["frames"]), e
print("FRAMES OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FRAMES OK" in out.stdout


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
    assert "recordHistory" not in absent and absent["createOrIncrefPool"] == "2.8"
    # What --check, enable() and docs/companion-matrix.md say comes from that table (issue 40).
    features = dict(_companion.absent_features("2.5.1"))
    assert features["torch.cuda.MemPool(allocator=...) routed to its allocator (createOrIncrefPool)"] == "2.8"
    assert not any(f.startswith("torch.cuda.MemPool and use_mem_pool") for f in features)
    warning = _companion.absent_warning("2.5.1")
    assert warning.startswith("vmmalloc: PyTorch 2.5.1 does not have: ") and len(features) == 9, warning
    assert "MemPool(allocator=...) routed to its allocator (createOrIncrefPool) (from PyTorch 2.8)" in warning
    assert len(_companion.absent_features("2.9.1")) == 4 and _companion.absent_warning("2.15.0") is None
    assert dict(_companion.absent_in("2.12.1")) == {"annotateMemory": "2.14"}
    # Every method of the table is one the companion implements under a version guard.
    source = _companion.source_text()
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


@since(2, 8, "torch.cuda.MemPool(allocator=...)")
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


# torch.cuda.MemPool(allocator=X) without a GPU: MemPool() itself needs one,
# so a companion entry makes the pool as its constructor does (2.8+:
# createOrIncrefPool(device, id, X)) with X a counting host allocator, and
# ~MemPool's releasePool + emptyCache(id); use_mem_pool's own torch._C calls
# open and close the span; allocations take the companion's path.
MEMPOOL_X = PRELUDE + '''
import contextlib, inspect
comp = _companion._loaded
comp.vmmalloc_companion_alloc_for_tests.restype = ctypes.c_void_p
comp.vmmalloc_companion_alloc_for_tests.argtypes = [ctypes.c_size_t, ctypes.c_int]
comp.vmmalloc_companion_free_for_tests.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for f in ("vmmalloc_companion_test_pool_create", "vmmalloc_companion_test_pool_destroy"):
    getattr(comp, f).argtypes = [U64, U64, ctypes.c_char_p, ctypes.c_size_t]
comp.vmmalloc_companion_test_pool_use_count.argtypes = [U64, U64]
comp.vmmalloc_companion_test_pool_counts.argtypes = [U64, U64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
err = ctypes.create_string_buffer(1000)
MiB = 1 << 20

class Pool:
    """torch.cuda.MemPool(allocator=X), X counting the calls it gets."""
    def __init__(self, id):
        self.id = id
        assert comp.vmmalloc_companion_test_pool_create(*id, err, len(err)) == 0, err.value
    def use_count(self):
        return comp.vmmalloc_companion_test_pool_use_count(*self.id)
    def counts(self, fail=-1):
        out = (ctypes.c_int64 * 4)()
        assert comp.vmmalloc_companion_test_pool_counts(*self.id, fail, out) == 0
        return dict(raw_alloc=out[0], raw_delete=out[1], live=out[2], bytes=out[3])
    def destroy(self):  # ~MemPool
        assert comp.vmmalloc_companion_test_pool_destroy(*self.id, err, len(err)) == 0, err.value

# torch.cuda.use_mem_pool's calls (torch/cuda/memory.py), checked against its source.
src = inspect.getsource(torch.cuda.use_mem_pool)
assert all(c in src for c in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
                              "_cuda_releasePool")), src

@contextlib.contextmanager
def use_mem_pool(pool):
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool.id)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(0, pool.id)
        torch._C._cuda_releasePool(0, pool.id)

def alloc(n):
    p = comp.vmmalloc_companion_alloc_for_tests(n, 0)
    assert p, f"{n} B not allocated"
    return p

def free(p):
    comp.vmmalloc_companion_free_for_tests(p, 0, 0)

def cur(st, key, kind="all"):
    return st[key][kind]["current"]
'''


@since(2, 8, "torch.cuda.MemPool(allocator=...)")
def test_mempool_allocator_gets_pytorchs_segments_and_they_count(lib, tmp_path, cache):
    # The case: 20 x 1000 B + 4 x 3 MiB in a MemPool(allocator=X).
    # PyTorch's DeviceCachingAllocator (c10/cuda/CUDACachingAllocator.cpp)
    # asks X for 2 segments: 1000 B rounds to 1024 B, small (<= 1 MiB), from
    # one kSmallBuffer (2 MiB) segment; 3 MiB is large and below 10 MiB: one
    # kLargeBuffer (20 MiB) segment, split while more than 1 MiB remains. It
    # counts them in memory_stats, lists them in MemPool.snapshot(), keeps
    # them cached through empty_cache while the MemPool lives, and gives them
    # back with raw_delete at ~MemPool. (vmmalloc before: 24 raw_alloc calls,
    # none of it in the stats or the snapshot.)
    out = run(MEMPOOL_X + '''
st0 = torch._C._cuda_memoryStats(0)
pool = Pool((0, 4001))
assert pool.use_count() == 1
with use_mem_pool(pool):
    assert pool.use_count() == 2, pool.use_count()          # PyTorch: 2
    small = [alloc(1000) for _ in range(20)]
    large = [alloc(3 * MiB) for _ in range(4)]
assert pool.use_count() == 1, pool.use_count()              # PyTorch: 1
c = pool.counts()
assert c["raw_alloc"] == 2 and c["bytes"] == 22 * MiB and c["raw_delete"] == 0, c
print("CALLS", c["raw_alloc"])
st = torch._C._cuda_memoryStats(0)
for key, want in {"segment": (2, 1, 1), "reserved_bytes": (22 * MiB, 2 * MiB, 20 * MiB),
                  "allocation": (24, 20, 4), "active": (24, 20, 4),
                  "allocated_bytes": (20 * 1024 + 12 * MiB, 20 * 1024, 12 * MiB),
                  "active_bytes": (20 * 1024 + 12 * MiB, 20 * 1024, 12 * MiB),
                  "requested_bytes": (20 * 1000 + 12 * MiB, 20 * 1000, 12 * MiB),
                  "inactive_split": (2, 1, 1),
                  "inactive_split_bytes": (2 * MiB - 20 * 1024 + 8 * MiB, 2 * MiB - 20 * 1024, 8 * MiB)}.items():
    got = tuple(cur(st, key, k) - cur(st0, key, k) for k in ("all", "small_pool", "large_pool"))
    assert got == want, (key, got, want)
assert st["reserved_bytes"]["all"]["peak"] == cur(st0, "reserved_bytes") + 22 * MiB, st["reserved_bytes"]
assert st["num_device_alloc"] - st0["num_device_alloc"] == 2, st["num_device_alloc"]
# torch.cuda.memory_stats() as enable() answers it (vmmalloc._torch) has the same figures.
flat = torch.cuda.memory_stats(0)
for key in ("segment", "reserved_bytes", "allocation", "allocated_bytes", "requested_bytes", "inactive_split_bytes"):
    for kind in ("all", "small_pool", "large_pool"):
        for field in ("current", "peak", "allocated", "freed"):
            assert flat[f"{key}.{kind}.{field}"] == st[key][kind][field], (key, kind, field, flat, st[key])
assert flat["num_device_alloc"] == st["num_device_alloc"]
assert torch.cuda.memory_reserved(0) == cur(st0, "reserved_bytes") + 22 * MiB
# 2.13+: the pool's own reserved bytes (DeviceStats::reserved_bytes_by_private_pools),
# keyed by its id; memory_stats() flattens the id as PyTorch does ("4001" after "0_").
if TORCH >= (2, 13):
    mine = st["reserved_bytes_by_private_pools"][pool.id]
    assert tuple(mine[k]["current"] for k in ("all", "small_pool", "large_pool")) == (22 * MiB, 2 * MiB, 20 * MiB), mine
    assert mine["all"]["peak"] == mine["all"]["allocated"] == 22 * MiB and mine["all"]["freed"] == 0, mine
    assert flat["reserved_bytes_by_private_pools.0_4001.all.current"] == 22 * MiB, sorted(k for k in flat if "private" in k)
    assert torch.cuda.memory_stats_as_nested_dict(0)["reserved_bytes_by_private_pools"][pool.id]["large_pool"]["current"] == 20 * MiB
else:
    assert "reserved_bytes_by_private_pools" not in st
    assert not [k for k in torch.cuda.memory_stats(0) if k.startswith("reserved_bytes_by_private_pools")]
# MemPool.snapshot(): the pool's two segments, their blocks.
segs = torch._C._cuda_memorySnapshot(pool.id)["segments"]
assert sorted((s["segment_type"], s["total_size"]) for s in segs) == [("large", 20 * MiB), ("small", 2 * MiB)], segs
assert all(s["segment_pool_id"] == pool.id and not s["is_expandable"] for s in segs), segs
live = [b["address"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
assert sorted(live) == sorted(small + large), live
assert sorted(len(s["blocks"]) for s in segs) == [5, 21], [len(s["blocks"]) for s in segs]
by_type = {s["segment_type"]: s for s in segs}
assert by_type["small"]["requested_size"] == 20 * 1000 and by_type["large"]["allocated_size"] == 12 * MiB
# The whole device's snapshot lists them too.
all_segs = torch._C._cuda_memorySnapshot((0, 0))["segments"]
assert sum(s["segment_pool_id"] == pool.id for s in all_segs) == 2
# Freed blocks stay in the pool and serve the next allocations: no new call.
for p in small + large:
    free(p)
st = torch._C._cuda_memoryStats(0)
assert cur(st, "allocated_bytes") == cur(st0, "allocated_bytes") and cur(st, "reserved_bytes") == cur(st0, "reserved_bytes") + 22 * MiB
assert cur(st, "inactive_split") == cur(st0, "inactive_split"), st["inactive_split"]
with use_mem_pool(pool):
    again = [alloc(3 * MiB) for _ in range(4)] + [alloc(1000) for _ in range(20)]
assert pool.counts()["raw_alloc"] == 2, pool.counts()
for p in again:
    free(p)
# torch.cuda.empty_cache() while the MemPool lives: PyTorch keeps its segments.
torch._C._cuda_emptyCache()
assert pool.counts()["raw_delete"] == 0, pool.counts()
torch._C._cuda_resetPeakMemoryStats(0)
st = torch._C._cuda_memoryStats(0)
assert st["reserved_bytes"]["all"]["peak"] == st["reserved_bytes"]["all"]["current"], st["reserved_bytes"]
torch.cuda.reset_peak_memory_stats(0)                        # vmmalloc._torch's
assert torch.cuda.max_memory_reserved(0) == torch.cuda.memory_reserved(0) == cur(st0, "reserved_bytes") + 22 * MiB
pool.destroy()                                               # ~MemPool
c = pool.counts()
assert c["raw_delete"] == 2 and c["live"] == 0, c
assert pool.use_count() == -1                                # forgotten, as PyTorch erases it
st = torch._C._cuda_memoryStats(0)
assert cur(st, "reserved_bytes") == cur(st0, "reserved_bytes") and cur(st, "segment") == cur(st0, "segment")
assert st["num_device_free"] - st0["num_device_free"] == 2
assert not torch._C._cuda_memorySnapshot(pool.id)["segments"]
if TORCH >= (2, 13):
    # Gone: current 0, the totals kept until a reset (the native map's entry stays).
    mine = st["reserved_bytes_by_private_pools"][pool.id]["all"]
    assert (mine["current"], mine["peak"], mine["allocated"], mine["freed"]) == (0, 22 * MiB, 22 * MiB, 22 * MiB), mine
    torch._C._cuda_resetPeakMemoryStats(0)
    torch._C._cuda_resetAccumulatedMemoryStats(0)
    mine = torch._C._cuda_memoryStats(0)["reserved_bytes_by_private_pools"][pool.id]["all"]
    assert (mine["current"], mine["peak"], mine["allocated"], mine["freed"]) == (0, 0, 0, 0), mine
print("MEMPOOL X OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MEMPOOL X OK" in out.stdout and "CALLS 2" in out.stdout


@since(2, 8, "torch.cuda.MemPool(allocator=...)")
def test_mempool_allocator_use_counts_are_pytorchs(lib, tmp_path, cache):
    # PyTorch 2.8+: createOrIncrefPool 1; beginAllocateToPool increfs (2
    # inside use_mem_pool), its exit's releasePool decrefs (1 after); the
    # pool is only forgotten once ~MemPool released it and its last segment
    # went back. A second use_mem_pool allocates from X again, from the
    # pool's cache; outside it vmmalloc serves. A failing X raises
    # torch.cuda.OutOfMemoryError's kind of error, counted in num_ooms.
    out = run(MEMPOOL_X + '''
pool = Pool((0, 4002))
with use_mem_pool(pool):
    x = alloc(4 * MiB)
assert pool.use_count() == 1, pool.use_count()
with use_mem_pool(pool):
    assert pool.use_count() == 2, pool.use_count()
    y = alloc(4 * MiB)                                       # the same 20 MiB segment
assert pool.use_count() == 1 and pool.counts()["raw_alloc"] == 1, pool.counts()
z = alloc(4 * MiB)                                           # outside: vmmalloc's
assert pool.counts()["raw_alloc"] == 1
assert z not in [b["address"] for s in torch._C._cuda_memorySnapshot(pool.id)["segments"] for b in s["blocks"]]
free(z)
# Nested spans of one pool are refused as PyTorch refuses them.
torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool.id)
try:
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool.id)
except RuntimeError as e:
    assert "already recording" in str(e), e
else:
    raise AssertionError("a second span of the same pool was accepted")
torch._C._cuda_endAllocateToPool(0, pool.id)
torch._C._cuda_releasePool(0, pool.id)
torch._C._cuda_releasePool(0, pool.id)                        # the refused begin's incref, as PyTorch
assert pool.use_count() == 1, pool.use_count()
# X out of memory: the allocation fails, num_ooms counts it, nothing leaks.
ooms = torch._C._cuda_memoryStats(0)["num_ooms"]
pool.counts(fail=1)
with use_mem_pool(pool):
    assert not comp.vmmalloc_companion_alloc_for_tests(64 * MiB, 0)
pool.counts(fail=0)
assert torch._C._cuda_memoryStats(0)["num_ooms"] == ooms + 1
# A tensor outliving its MemPool keeps its segment and the pool.
pool.destroy()
assert pool.use_count() == 0 and pool.counts()["live"] == 1, (pool.use_count(), pool.counts())
free(x)
free(y)
assert pool.counts()["raw_delete"] == 0                      # cached until the cache is emptied
torch._C._cuda_emptyCache()
assert pool.counts()["raw_delete"] == 1 and pool.use_count() == -1, pool.counts()
print("USE COUNTS OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USE COUNTS OK" in out.stdout


@since(2, 8, "torch.cuda.MemPool(allocator=...)")
def test_vllm_sleep_mode_sequence_makes_no_more_handles_than_pytorch(lib, tmp_path, cache):
    # vLLM's CuMemAllocator (vllm/device_allocator/cumem.py): use_memory_pool(tag)
    # makes a MemPool(allocator=X) per call and keeps it; each raw_alloc X
    # gets creates one cuMem handle (python_malloc_callback); sleep() unmaps
    # and releases every handle itself, then gc.collect() and
    # torch.cuda.empty_cache(); wake_up() creates and maps each again. So the
    # handle count is the number of raw_alloc calls, before and after sleep.
    # PyTorch's allocator for the same sequence (get_allocation_size and
    # should_split): weights: 64 MiB -> one 64 MiB segment, 4 x 4 MiB ->
    # one 20 MiB segment, 4 x 4 KiB + 4 x 8 KiB -> one 2 MiB segment;
    # kv_cache: 2 x 128 MiB -> two segments: 5 handles.
    out = run(MEMPOOL_X + '''
PYTORCH_HANDLES = 5
layers = [s for _ in range(4) for s in (4 * MiB, 4096, 8192)]
sequence = {"weights": [64 * MiB] + layers, "kv_cache": [128 * MiB, 128 * MiB]}
pools, live = {}, {}
for i, (tag, sizes) in enumerate(sequence.items()):
    pools[tag] = Pool((0, 4100 + i))                         # use_memory_pool(tag)
    with use_mem_pool(pools[tag]):
        live[tag] = [alloc(n) for n in sizes]
    assert pools[tag].use_count() == 1
handles = sum(p.counts()["raw_alloc"] for p in pools.values())
# sleep(): X releases its handles (no call through PyTorch), then empty_cache
# gives nothing back: the pools have users (PyTorch keeps them the same way).
torch._C._cuda_emptyCache()
assert all(p.counts()["raw_delete"] == 0 for p in pools.values())
# wake_up(): X maps the same handles again; the model runs, allocating outside the pools.
t = alloc(8 * MiB)
free(t)
assert sum(p.counts()["raw_alloc"] for p in pools.values()) == handles
tensors = sum(len(s) for s in sequence.values())
print(f"HANDLES vmmalloc {handles} PyTorch {PYTORCH_HANDLES} one-per-tensor {tensors}")
assert handles <= PYTORCH_HANDLES, handles
assert handles == PYTORCH_HANDLES
print("VLLM OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "VLLM OK" in out.stdout
    print(out.stdout)


@since(2, 8, "torch.cuda.MemPool(allocator=...)")
def test_mempool_allocator_events_are_in_the_memory_history(lib, tmp_path, cache):
    # record_trace's entries for a MemPool(allocator=X)'s pool: segment_alloc
    # (the segment X gave), alloc, free_requested / free_completed, and
    # segment_free when ~MemPool gives the segment back, each with the pool's
    # id and the Python frames of the call that caused it.
    out = run(MEMPOOL_X + '''
_rec = comp.vmmalloc_companion_record_memory_history_for_tests
_rec.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                 ctypes.c_char_p, ctypes.c_size_t]
assert _rec(b"all", b"all", b"python", 100000, 0, err, len(err)) == 0, err.value
pool = Pool((0, 4200))

def load_weights():
    with use_mem_pool(pool):
        return alloc(3 * MiB)

def drop_weights(p):
    free(p)

w = load_weights()
drop_weights(w)
pool.destroy()
trace = torch.cuda.memory._snapshot()["device_traces"][0]
# The entries carry the pool's id where this PyTorch's snapshot writes it
# (its memory_snapshot.cpp; 2.9 does not, though TraceEntry keeps it): else
# the pool's entries are those at its one segment's address.
if any("pool_id" in e for e in trace):
    mine = [e for e in trace if tuple(e.get("pool_id", ())) == pool.id]
else:
    mine = [e for e in trace if e.get("addr") == w]
acts = [(e["action"], e["size"]) for e in mine]
assert acts == [("segment_alloc", 20 * MiB), ("alloc", 3 * MiB), ("free_requested", 3 * MiB),
                ("free_completed", 3 * MiB), ("segment_free", 20 * MiB)], acts
assert all(e["addr"] == w for e in mine), mine              # the pool's one segment, its first block
assert "load_weights" in [f["name"] for f in mine[1]["frames"]], mine[1]["frames"]
assert "drop_weights" in [f["name"] for f in mine[2]["frames"]], mine[2]["frames"]
print("POOL HISTORY OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "POOL HISTORY OK" in out.stdout


@since(2, 8, "torch.cuda.MemPool(use_on_oom=True)")
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
