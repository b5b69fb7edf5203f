"""vmmalloc.growable and vmmalloc.on_memory_pressure over ctypes, on the
host backend (real bytes behind the pointers) and the sim backend."""

import ctypes
import warnings

import pytest

import vmmalloc
from conftest import MIB

HOST = "device:host,capacity_gb:1,log:off,backend:expandable"
SIM = "device:sim,capacity_gb:1,log:off,backend:expandable,on_oom:null"


def test_grows_and_shrinks_in_place_keeping_its_bytes(lib, fresh):
    fresh(HOST)
    g = vmmalloc.growable(64 * MIB, dtype="float32")
    assert len(g) == 0 and g.info()["mapped"] == 0
    ptr = g.ptr
    g.resize(1000)
    ctypes.memmove(g.ptr, b"\x7f" * 4000, 4000)
    for n in [5 * MIB, 10, 16 * MIB, 1000]:
        g.resize(n)
        assert g.ptr == ptr, "the address never moves"
        cai = g.__cuda_array_interface__
        assert cai["shape"] == (n,) and cai["typestr"] == "<f4" and cai["data"] == (ptr, False)
        assert g.info()["size"] == 4 * n
        assert ctypes.string_at(g.ptr, min(n, 1000) * 4) == b"\x7f" * (min(n, 1000) * 4)
    vmmalloc.validate(0)
    assert vmmalloc.memory_stats(0)["requested_bytes.all.current"] == 4000
    g.destroy()
    assert vmmalloc.memory_stats(0)["allocation.all.current"] == 0


def test_bad_input_raises_and_changes_nothing(lib, fresh):
    fresh(HOST)
    g = vmmalloc.growable(MIB, dtype="float16")
    g.resize(10)
    with pytest.raises(vmmalloc.VmmallocError, match="beyond max_bytes"):
        g.resize(MIB // 2 + 1)
    with pytest.raises(vmmalloc.VmmallocError):
        g.resize(-1)
    assert len(g) == 10 and g.info()["size"] == 20
    with pytest.raises(vmmalloc.VmmallocError, match="unsupported dtype"):
        vmmalloc.growable(MIB, dtype="complex128")
    with pytest.raises(vmmalloc.VmmallocError, match="positive"):
        vmmalloc.growable(0)
    g.destroy()
    with pytest.raises(vmmalloc.VmmallocError, match="destroyed"):
        g.destroy()
    fresh("device:host,capacity_gb:1,log:off,backend:caching")
    with pytest.raises(vmmalloc.VmmallocError, match="no growable regions"):
        vmmalloc.growable(MIB)


def _fill(alloc, n, size):
    ptrs = []
    for _ in range(n):
        p = alloc.malloc(size)
        if not p:
            break
        ptrs.append(p)
    return ptrs


def test_pressure_callback_frees_then_growth_is_retried(lib, fresh):
    a = fresh(SIM)
    cache = _fill(a, 100, 64 * MIB)
    calls = []

    @vmmalloc.on_memory_pressure
    def drop(size, device):
        calls.append((size, device))
        freed = 0
        while cache and freed < size:
            a.free(cache.pop(), 64 * MIB)
            freed += 64 * MIB
        return freed

    try:
        g = vmmalloc.growable(512 * MIB, dtype="uint8")
        g.resize(300 * MIB)
        assert calls == [(300 * MIB, 0)]
        vmmalloc.validate(0)
        g.destroy()
    finally:
        vmmalloc.on_memory_pressure(None)


def test_a_callback_that_raises_or_frees_nothing_fails_cleanly(lib, fresh):
    a = fresh(SIM)
    _fill(a, 100, 64 * MIB)
    g = vmmalloc.growable(512 * MIB)

    def boom(size, device):
        raise KeyError("no cache to drop")

    vmmalloc.on_memory_pressure(boom)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with pytest.raises(vmmalloc.VmmallocError, match="out of memory") as e:
                g.resize(100 * MIB)
        assert isinstance(e.value.__cause__, KeyError)
        assert any("raised" in str(x.message) for x in w)
        assert len(g) == 0 and g.info()["mapped"] == 0
        vmmalloc.on_memory_pressure(lambda size, device: 0)
        with pytest.raises(vmmalloc.VmmallocError) as e:
            g.resize(100 * MIB)
        assert isinstance(e.value.__cause__, MemoryError)
        vmmalloc.validate(0)
    finally:
        vmmalloc.on_memory_pressure(None)
    with pytest.raises(vmmalloc.VmmallocError):
        vmmalloc.on_memory_pressure(42)


def test_tensor_view_needs_cuda(lib, fresh):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the zero-copy torch view is checked by scripts/gpu-check.sh")
    fresh("log:off,backend:expandable")
    g = vmmalloc.growable(64 * MIB, dtype=torch.bfloat16)
    g.resize(1000)
    t = g.tensor()
    assert t.dtype == torch.bfloat16 and t.data_ptr() == g.ptr and t.numel() == 1000
    g.destroy()


def test_spill_is_reported_in_stats_and_one_log_line(lib):
    """spill:true past device memory: the allocations succeed, memory_stats
    counts the spilled bytes, and each spill logs one line (run in a child
    process to read its stderr)."""
    import os
    import subprocess
    import sys
    from conftest import PACKAGE_PARENT

    code = (
        "import ctypes, vmmalloc\n"
        "vmmalloc.configure('device:sim,capacity_gb:1,backend:expandable,on_oom:null,spill:true')\n"
        "lib = vmmalloc.load()\n"
        "out = ctypes.c_void_p()\n"
        "rcs = [lib.vmmalloc_try_malloc(64 << 20, 0, None, ctypes.byref(out)) for _ in range(19)]\n"
        "assert rcs == [0] * 19, rcs\n"
        "st = vmmalloc.memory_stats(0)\n"
        "print('spilled', st['vmmalloc.spilled_bytes'], st['vmmalloc.num_spills'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    spilled, spills = map(int, r.stdout.split()[1:3])
    assert spilled >= 192 * MIB and spills >= 1
    lines = [line for line in r.stderr.splitlines() if "spilled to host memory" in line]
    assert len(lines) == spills, r.stderr
