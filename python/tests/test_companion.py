"""The torch companion (python/vmmalloc/companion/vmmalloc_torch.cpp) built
against the real PyTorch wheel, installed by enable(), and its entry points
driven through torch._C on the `host` backend (no GPU): CUDA graph trees'
live-allocation checks and checkpoint/restore, snapshot(), statistics; pool
use counts and per-pool stats through the C ABI; the fallback and the NCCL
register hook's refusal. Skipped only where torch is missing, never in CI
(VMMALLOC_REQUIRE_TORCH=1, see test_torch.py)."""

import json
import os
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
# b dies after the checkpoint (its memory stays held: never handed out again).
lib.vmmalloc_free(b, 0, 0, None)
assert check(0, pool, {a, c})
d = pool_malloc(pool, 512)
assert d != b
lib.vmmalloc_free(d, 0, 0, None)
held = pool_stats(pool)["allocated_bytes.all.current"]
# The restore hands back a, b, c (a and c were live: freed and handed back).
torch._C._cuda_setCheckpointPoolState(0, state, [], [])
assert check(0, pool, {a, b, c})
# b is dead for the tree: raw_delete reaches the pool through the
# pluggable bookkeeping the restore filled.
torch._C._cuda_cudaCachingAllocator_raw_delete(b)
assert check(0, pool, {a, c})
assert pool_stats(pool)["allocated_bytes.all.current"] == held, "b is held by the checkpoint"
del state
gc.collect()
assert pool_stats(pool)["allocated_bytes.all.current"] < held, "dropping the checkpoint releases b"
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
# The main allocator's figures do not include the pool's.
assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
# MemPool.snapshot(): only the pool's segments, owned by it.
snap = torch._C._cuda_memorySnapshot(pool)
assert snap["segments"] and all(s["segment_pool_id"] == pool for s in snap["segments"]), snap["segments"]
live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
assert [b["address"] for b in live] == [x]
lib.vmmalloc_free(x, 0, 0, None)
assert lib.vmmalloc_pool_release(0, *pool) == 0       # ~MemPool
assert lib.vmmalloc_pool_use_count(0, *pool) == -1 and "released already" in vmmalloc.last_error()
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
