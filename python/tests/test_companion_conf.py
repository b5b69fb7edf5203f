"""VMMALLOC_CONF keys that reach PyTorch's own functions through the torch
companion (issue 40 item 4): record_history:True starts the recording that
torch.cuda.memory._snapshot() reads, as _record_memory_history() does;
and torch.accelerator's memory functions (2.9+), which PyTorch routes to its
own, never-initialised caching allocator, answer from vmmalloc.
Built against the real PyTorch wheel on the `host` backend (no GPU), as
test_companion.py is."""

import pytest

from conftest import require_torch

require_torch()

from test_companion import run, since  # noqa: E402


@pytest.fixture(scope="module")
def cache(companion_cache):
    """The session's companion builds (conftest.py)."""
    return companion_cache


# PyTorch's _record_memory_history initialises CUDA first, which needs a GPU;
# the harness's entry point does the rest of it (the same recorders and
# options). Patched before enable(), so enable()'s call goes through it.
PRELUDE = '''
import ctypes, sys, warnings
import torch, vmmalloc
from vmmalloc import _companion
calls = []

def record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                          clear_history=False, **kw):
    calls.append((enabled, context, stacks, max_entries, clear_history, kw))
    err = ctypes.create_string_buffer(2000)
    enc = lambda s: None if s is None else s.encode()
    rc = _companion._loaded.vmmalloc_companion_record_memory_history_for_tests(
        enc(enabled), enc(context), enc(stacks), ctypes.c_size_t(max_entries), int(clear_history), err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode())

torch.cuda.memory._record_memory_history = record_memory_history
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vmmalloc.enable(CONF)
comp = _companion._loaded
comp.vmmalloc_companion_alloc_for_tests.restype = ctypes.c_void_p
comp.vmmalloc_companion_alloc_for_tests.argtypes = [ctypes.c_size_t, ctypes.c_int]
comp.vmmalloc_companion_free_for_tests.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
'''


def test_conf_record_history_reaches_pytorchs_snapshot(lib, tmp_path, cache):
    out = run('CONF = "device:host,capacity_gb:1,log:off,backend:expandable,record_history:True,max_entries:5"'
              + PRELUDE + '''
# one call, as a bare _record_memory_history(max_entries=N) makes it
assert calls == [("all", "all", "all", 5, False, {})], calls
assert torch._C._cuda_isHistoryEnabled()

def make_activation():
    return comp.vmmalloc_companion_alloc_for_tests(1 << 20, 0)

p = make_activation()
trace = torch.cuda.memory._snapshot()["device_traces"][0]
allocs = [e for e in trace if e["action"] == "alloc" and e["addr"] == p]
assert len(allocs) == 1, trace
assert "make_activation" in [f["name"] for f in allocs[0]["frames"]], allocs
# max_entries bounds PyTorch's ring, as it bounds _record_memory_history's
for i in range(8):
    comp.vmmalloc_companion_free_for_tests(comp.vmmalloc_companion_alloc_for_tests(4096, 0), 4096, 0)
assert len(torch.cuda.memory._snapshot()["device_traces"][0]) == 5
print("CONF HISTORY OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CONF HISTORY OK" in out.stdout


def test_without_record_history_nothing_is_recorded(lib, tmp_path, cache):
    out = run('CONF = "device:host,capacity_gb:1,log:off,backend:expandable"' + PRELUDE + '''
assert calls == [] and not torch._C._cuda_isHistoryEnabled(), calls
comp.vmmalloc_companion_alloc_for_tests(1 << 20, 0)
assert all(t == [] for t in torch.cuda.memory._snapshot()["device_traces"])
print("NO HISTORY OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NO HISTORY OK" in out.stdout


# The keys PyTorch's torch.accelerator.memory_stats() has: the flattened
# dict of torch/csrc/DeviceAccelerator.cpp's _accelerator_getDeviceStats.
ACCEL_KEYS = (
    [f"{stat}.{pool}.{metric}"
     for stat in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes", "allocation",
                  "segment", "active", "inactive_split", "inactive_split_bytes")
     for pool in ("all", "small_pool", "large_pool")
     for metric in ("current", "peak", "allocated", "freed")]
    + [f"{stat}.{metric}" for stat in ("oversize_allocations", "oversize_segments")
       for metric in ("current", "peak", "allocated", "freed")]
    + ["num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams", "num_device_alloc",
       "num_device_free"])


@since(2, 9, "torch.accelerator.memory_stats")
def test_accelerator_memory_functions_answer_from_vmmalloc(lib, tmp_path, cache):
    out = run('CONF = "device:host,capacity_gb:1,log:off,backend:expandable"' + PRELUDE + f"ACCEL_KEYS = {ACCEL_KEYS!r}" + '''
import torch.accelerator.memory as am
MiB = 1 << 20
p = comp.vmmalloc_companion_alloc_for_tests(3 * MiB, 0)
st = torch.accelerator.memory_stats(0)
assert st, "empty: PyTorch's own allocator answered"
missing = [k for k in ACCEL_KEYS if k not in st]
assert not missing, missing
assert st["allocated_bytes.all.current"] == 3 * MiB == torch.cuda.memory_stats(0)["allocated_bytes.all.current"], st
assert list(st) == sorted(st), "sorted, as PyTorch sorts them"
assert torch.accelerator.memory_allocated(0) == 3 * MiB == am.memory_allocated(0)
assert torch.accelerator.max_memory_allocated(0) == 3 * MiB
assert torch.accelerator.memory_reserved(0) >= 3 * MiB
assert torch.accelerator.max_memory_reserved(0) >= torch.accelerator.memory_reserved(0)
comp.vmmalloc_companion_free_for_tests(p, 3 * MiB, 0)
assert torch.accelerator.memory_allocated(0) == 0 and torch.accelerator.max_memory_allocated(0) == 3 * MiB
torch.accelerator.reset_peak_memory_stats(0)
assert torch.accelerator.max_memory_allocated(0) == 0
torch.accelerator.reset_accumulated_memory_stats(0)
assert torch.accelerator.memory_stats(0)["allocated_bytes.all.allocated"] == 0
torch.accelerator.empty_cache()   # torch.cuda.empty_cache: nothing to do before CUDA initialises
print("ACCEL OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ACCEL OK" in out.stdout


def test_paused_pools_blocks_leave_the_snapshot_as_unmapped_pages_do(lib, tmp_path, cache):
    from test_companion import HOOKS
    out = run(HOOKS + '''
from torch.cuda import _memory_viz
pool = (0, 8)
begin(0, pool)
a = malloc(32 * MiB, 0, None)
end(0, pool)
b = malloc(3 * MiB, 0, None)   # the main allocator's, stays mapped

def seg_total(snap):
    return sum(s["total_size"] for s in snap["segments"])

def pool_blocks(snap):
    return [blk for s in snap["segments"] if tuple(s["segment_pool_id"]) == pool for blk in s["blocks"]]

snap = torch.cuda.memory._snapshot()
assert seg_total(snap) == reserved(), (seg_total(snap), reserved())
assert any(blk["state"] == "active_allocated" and blk["size"] >= 32 * MiB for blk in pool_blocks(snap))
vmmalloc.pause_pool(pool, keep=True)
snap = torch.cuda.memory._snapshot()
# PyTorch's invariant: the segments are the reserved (mapped) memory; a paused
# pool holds none, so none of its blocks is shown (as unmapped pages of an
# expandable segment are not), and the main allocator's block still is.
assert seg_total(snap) == reserved(), (seg_total(snap), reserved())
assert pool_blocks(snap) == [], pool_blocks(snap)
assert any(blk["state"] == "active_allocated" and blk["size"] >= 3 * MiB
           for s in snap["segments"] for blk in s["blocks"]), snap["segments"]
assert "segments:" in _memory_viz.segsum(snap)
assert "<html" in _memory_viz.segment_plot(snap).lower()
vmmalloc.resume_pool(pool)
snap = torch.cuda.memory._snapshot()
assert seg_total(snap) == reserved() and pool_blocks(snap), snap["segments"]
lib.vmmalloc_free(a, 0, 0, None)
lib.vmmalloc_free(b, 0, 0, None)
release(0, pool)
print("PAUSED SNAPSHOT OK")
''', tmp_path, cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PAUSED SNAPSHOT OK" in out.stdout
