"""Region mode (issue 24, vmmalloc/_region.py) on the host backend: the C ABI
entry point a MemPool calls, and the Python package's region logic over a
stand-in for the parts of torch it uses.

The stand-in models what PyTorch does with a ``MemPool`` whose allocator is
pluggable (c10/cuda/CUDACachingAllocator.cpp): inside ``use_mem_pool`` it asks
the allocator for whole segments of PyTorch's sizes (2 MiB for requests up to
1 MiB, 20 MiB below 10 MiB, else the request rounded to 2 MiB), by calling the
named C function of the library (as CUDAPluggableAllocator does, through
dlopen/dlsym; here ctypes); a NULL answer makes it release the pool's cached
segments and retry once (``allocPrimitive`` returns cudaErrorMemoryAllocation,
then ``release_cached_blocks``); a freed tensor's segment stays cached in the
pool; ``empty_cache`` releases a pool's cached segments only inside
``use_mem_pool`` (pytorch#133602, #145168). One tensor per segment (no
splitting), which changes nothing region mode relies on.
"""

import contextlib
import ctypes
import gc
import itertools
import threading
import weakref

import pytest

import vmmalloc
from vmmalloc import _region
from conftest import MIB

HOST = "device:host,capacity_gb:1,log:off,backend:expandable"


def segment_size(n):
    if n <= MIB:
        return 2 * MIB
    if n < 10 * MIB:
        return 20 * MIB
    return -(-n // (2 * MIB)) * (2 * MIB)


class OutOfMemoryError(RuntimeError):
    pass


class Pluggable:
    """CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)."""

    def __init__(self, path, alloc, free):
        lib = ctypes.CDLL(path)
        self.alloc_fn = getattr(lib, alloc)
        self.alloc_fn.restype = ctypes.c_void_p
        self.alloc_fn.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.free_fn = getattr(lib, free)
        self.free_fn.restype = None
        self.free_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.names = (alloc, free)

    def allocator(self):
        return self


class MemPool:
    _ids = itertools.count(1)

    def __init__(self, allocator):
        self.allocator = allocator
        self.id = (0, next(self._ids))
        self.segments = {}  # ptr -> size
        self.cached = []  # free segments PyTorch keeps

    def malloc(self, n):
        size = segment_size(n)
        for p in self.cached:
            if self.segments[p] >= size:
                self.cached.remove(p)
                return p
        p = self.allocator.alloc_fn(size, 0, None)
        if not p:
            self.release_cached()
            p = self.allocator.alloc_fn(size, 0, None)
            if not p:
                raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes ({vmmalloc.last_error()})")
        self.segments[p] = size
        return p

    def release_cached(self):
        for p in self.cached:
            self.allocator.free_fn(p, self.segments.pop(p), 0, None)
        self.cached = []


class Tensor:
    def __init__(self, ptr, nbytes, pool):
        self.ptr, self.nbytes, self.pool = ptr, nbytes, pool

    def data_ptr(self):
        return self.ptr

    def free(self):
        if self.pool is not None:
            self.pool.cached.append(self.ptr)


class FakeBackend:
    def __init__(self):
        self.registered = []

    def register_mem_pool(self, pool):
        self.registered.append(pool)

    def deregister_mem_pool(self, pool):
        self.registered.remove(pool)


class FakeTorch:
    """The parts of torch that region mode uses (see the module's doc)."""

    def __init__(self):
        fake = self
        self.settings = []
        self.pool_calls = []
        self._tls = threading.local()
        self.native = 0
        self.backend = FakeBackend()

        class cuda:
            MemPool = globals()["MemPool"]

            @staticmethod
            def is_available():
                return True

            @staticmethod
            def current_device():
                return 0

            @staticmethod
            def _get_device_index(device, optional=False):
                return int(device)

            @staticmethod
            @contextlib.contextmanager
            def use_mem_pool(pool, device=None):
                fake.pool_calls.append((pool.id, device))
                stack = fake._stack()
                stack.append(pool)
                try:
                    yield
                finally:
                    stack.pop()

            @staticmethod
            def empty_cache():
                stack = fake._stack()
                if stack:
                    stack[-1].release_cached()

            class memory:
                CUDAPluggableAllocator = Pluggable

                @staticmethod
                def _set_allocator_settings(text):
                    fake.settings.append(text)

        class distributed:
            class group:
                WORLD = object()

        self.cuda = cuda
        self.distributed = distributed
        self.device = lambda kind, index: (kind, index)
        distributed.group.WORLD = type("PG", (), {"_get_backend": lambda _s, dev: fake.backend})()

    def _stack(self):
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def empty(self, nbytes):
        """torch.empty(nbytes, dtype=uint8, device="cuda")."""
        stack = self._stack()
        if stack:
            return Tensor(stack[-1].malloc(nbytes), nbytes, stack[-1])
        self.native += nbytes
        return Tensor(None, nbytes, None)


@pytest.fixture
def torch_pool(monkeypatch, fresh):
    """A configured host library and the stand-in torch, with region state reset."""

    def make(conf=HOST):
        a = fresh(conf)
        fake = FakeTorch()
        monkeypatch.setattr(_region, "_torch", lambda: fake)
        monkeypatch.setattr(_region, "_allocator", None)
        monkeypatch.setattr(_region, "_regions", {})
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        return a, fake

    return make


def tag_of(tag):
    return next((t for t in vmmalloc.tag_stats(0) if t["tag"] == tag), None)


# ---------------------------------------------------------------------------
# The C ABI: vmmalloc_region_malloc
# ---------------------------------------------------------------------------


def _region_malloc(lib):
    f = lib.vmmalloc_region_malloc
    f.restype = ctypes.c_void_p
    f.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return f


def test_region_malloc_is_tagged_and_returns_null_instead_of_throwing(lib, fresh):
    # on_oom:raise (the default) makes vmmalloc_malloc throw a C++ exception, which would abort this
    # process through ctypes; vmmalloc_region_malloc must answer NULL, PyTorch's pool protocol.
    a = fresh("device:host,capacity_gb:0.0625,log:off,backend:expandable")
    region_malloc = _region_malloc(lib)
    vmmalloc.set_tag("py-region-abi")
    try:
        p = region_malloc(20 * MIB, 0, None)
        assert p, vmmalloc.last_error()
        assert region_malloc(0, 0, None) is None
        assert region_malloc(60 * MIB, 0, None) is None
        assert "out of memory" in vmmalloc.last_error()
    finally:
        vmmalloc.set_tag("")
    t = tag_of("py-region-abi")
    assert t["live_bytes"] >= 20 * MIB and t["blocks"] == 1, t
    a.write(p, b"\x5a" * 4096)
    assert vmmalloc.pause("py-region-abi", backup=True) >= 20 * MIB
    assert vmmalloc.resume("py-region-abi") >= 20 * MIB
    assert a.read(p, 4096) == b"\x5a" * 4096
    a.free(p)
    vmmalloc.validate(0)


# ---------------------------------------------------------------------------
# The Python package's region mode over the stand-in torch
# ---------------------------------------------------------------------------


def test_inside_the_region_vmmalloc_serves_tagged_outside_pytorch(lib, torch_pool):
    a, torch = torch_pool()
    assert _region.pool_mode_available()
    with vmmalloc.region("py-kv") as r:
        assert isinstance(r, _region.Region) and r.tag == "py-kv" and r.device == 0
        assert vmmalloc.get_tag() == "py-kv"
        kv = torch.empty(3 * MIB)
    assert vmmalloc.get_tag() == ""
    outside = torch.empty(5 * MIB)
    assert outside.ptr is None and torch.native == 5 * MIB
    # The pool's allocator is libvmmalloc's region entry point.
    assert r.pool.allocator.names == ("vmmalloc_region_malloc", "vmmalloc_free")
    assert torch.pool_calls == [(r.pool.id, 0)]
    t = tag_of("py-kv")
    assert t["live_bytes"] == 20 * MIB and t["blocks"] == 1, t  # PyTorch's 20 MiB segment for 3 MiB
    assert r.stats() == t
    assert vmmalloc.memory_stats(0)["allocated_bytes.all.current"] == 20 * MIB
    a.write(kv.ptr, b"k" * 1000)
    vmmalloc.validate(0)


def test_pause_resume_restores_contents_and_gives_back_cached_segments(lib, torch_pool):
    a, torch = torch_pool()
    with vmmalloc.region("py-weights") as r:
        w = torch.empty(12 * MIB)
        scratch = torch.empty(30 * MIB)
    a.write(w.ptr, bytes(range(256)) * 64)
    scratch.free()  # PyTorch caches the segment in the pool; vmmalloc still holds it
    assert tag_of("py-weights")["live_bytes"] == 12 * MIB + 30 * MIB
    freed = vmmalloc.pause("py-weights", backup=True)
    # The cached segment went back through vmmalloc_free first: only the weights were backed up.
    t = tag_of("py-weights")
    assert t["paused"] and t["live_bytes"] == 12 * MIB and t["backup_bytes"] == 12 * MIB, t
    assert r.pool.cached == [] and freed >= 12 * MIB
    vmmalloc.validate(0)
    # PyTorch would hand out cached blocks in unmapped memory: entering a paused region is refused.
    with pytest.raises(vmmalloc.VmmallocError, match="'py-weights' is paused"):
        with vmmalloc.region("py-weights"):
            pass
    assert vmmalloc.get_tag() == ""
    assert r.resume() >= 12 * MIB
    assert a.read(w.ptr, 256 * 64) == bytes(range(256)) * 64
    with vmmalloc.region("py-weights"):
        # Pausing a region a thread is inside is refused too.
        with pytest.raises(vmmalloc.VmmallocError, match="while a thread is inside"):
            r.pause()
        more = torch.empty(MIB)
    assert more.ptr and tag_of("py-weights")["live_bytes"] == 14 * MIB
    vmmalloc.validate(0)


def test_two_regions_pause_while_the_other_runs(lib, torch_pool):
    # The RL colocation pattern in small (examples/rl_colocate.py is the full one): a 96 MiB host
    # "GPU" holds either phase, never both.
    a, torch = torch_pool("device:host,capacity_gb:0.09375,log:off,backend:expandable")
    train, infer = vmmalloc.get_region("py-train"), vmmalloc.get_region("py-infer")
    with vmmalloc.region("py-train"):
        weights = torch.empty(50 * MIB)
    a.write(weights.ptr, b"w" * 4096)
    train.pause(backup=True)
    with vmmalloc.region("py-infer"):
        kv = torch.empty(60 * MIB)
    a.write(kv.ptr, b"i" * 4096)
    infer.pause()
    train.resume()
    assert a.read(weights.ptr, 4096) == b"w" * 4096
    train.pause(backup=True)
    infer.resume()
    assert vmmalloc.memory_stats(0)["vmmalloc.paused_bytes"] >= 50 * MIB
    vmmalloc.validate(0)


def test_region_pool_oom_follows_pytorchs_release_and_retry(lib, torch_pool):
    a, torch = torch_pool("device:host,capacity_gb:0.0625,log:off,backend:expandable")
    with vmmalloc.region("py-oom"):
        x = torch.empty(30 * MIB)
        x.free()  # cached in the pool
        # 40 MiB does not fit beside the cached 30: NULL, PyTorch releases its cache, the retry succeeds.
        y = torch.empty(40 * MIB)
        assert y.ptr
        with pytest.raises(OutOfMemoryError, match=r"\(vmmalloc_region_malloc\(size=41943040.*out of memory"):
            torch.empty(40 * MIB)


def test_expandable_segments_are_off_inside_a_region_only(lib, torch_pool, monkeypatch):
    _, torch = torch_pool()
    with vmmalloc.region("py-es"):
        pass
    assert torch.settings == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    with vmmalloc.region("py-es"):
        assert torch.settings == ["expandable_segments:False"]
    assert torch.settings == ["expandable_segments:False", "expandable_segments:True"]
    assert _region._expandable_requested({"PYTORCH_ALLOC_CONF": "expandable_segments:true"})
    assert not _region._expandable_requested({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})


def test_pools_and_the_allocator_live_as_long_as_the_process(lib, torch_pool):
    _, torch = torch_pool()
    with vmmalloc.region("py-life") as r:
        torch.empty(MIB)
    pool, alloc = weakref.ref(r.pool), weakref.ref(_region._allocator)
    del r
    gc.collect()
    assert pool() is not None and alloc() is not None  # pytorch#146431
    assert vmmalloc.get_region("py-life").pool is pool()
    assert [x.tag for x in vmmalloc.regions()] == ["py-life"]


def test_nccl_registration_needs_pages_that_stay_put(lib, torch_pool):
    _, torch = torch_pool()
    r = vmmalloc.get_region("py-nccl")
    with pytest.raises(vmmalloc.VmmallocError, match="unpin:(auto|true)"):
        r.register_nccl()
    _, torch = torch_pool(HOST + ",unpin:false")
    r = vmmalloc.get_region("py-nccl")
    with vmmalloc.region("py-nccl"):
        torch.empty(MIB)
    r.register_nccl()
    assert torch.backend.registered == [r.pool]
    with pytest.raises(vmmalloc.VmmallocError, match="registered with NCCL"):
        vmmalloc.pause("py-nccl")
    r.deregister_nccl()
    assert torch.backend.registered == []
    assert vmmalloc.pause("py-nccl") > 0
    vmmalloc.resume("py-nccl")


def test_bad_tags_and_modes(lib, torch_pool):
    _, torch = torch_pool()
    with pytest.raises(vmmalloc.VmmallocError, match="64"):
        with vmmalloc.region("t" * 65):
            pass
    with pytest.raises(TypeError):
        vmmalloc.get_region(b"bytes")
    assert vmmalloc.get_tag() == ""
    # pool=False: the tag alone, whatever torch says.
    with vmmalloc.region("py-tag-only", pool=False) as t:
        assert t == "py-tag-only"
    assert torch.pool_calls == []


def test_real_torch_without_a_gpu_keeps_the_tag_mode(lib, fresh, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the pool mode applies")
    fresh(HOST)
    monkeypatch.setattr(_region, "_regions", {})
    assert not _region.pool_mode_available()
    with vmmalloc.region("py-cpu") as t:
        assert t == "py-cpu" and vmmalloc.get_tag() == "py-cpu"
    with pytest.raises(vmmalloc.VmmallocError, match="needs PyTorch imported and a CUDA device"):
        vmmalloc.region("py-cpu", pool=True)
    assert vmmalloc.regions() == []


def test_the_rl_colocation_example_runs_on_the_host_backend(lib, tmp_path):
    import os
    import subprocess
    import sys

    from conftest import PACKAGE_PARENT, REPO

    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    env.pop("VMMALLOC_CONF", None)
    out = subprocess.run([sys.executable, str(REPO / "examples" / "rl_colocate.py"), "--host", "--rounds", "2"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("rl_colocate: ok"), out.stdout
    phases = {line.split()[1] + line.split()[2]: line for line in out.stdout.splitlines() if line.startswith("phase")}
    # Each phase holds its own regions only: training 96 MiB, inference 32 + 128 MiB, in a 224 MiB "GPU".
    assert "holds     96 MiB (train 96 MiB, infer_weights 0 MiB, kv_cache 0 MiB)" in phases["train1"], phases
    assert "holds    160 MiB (train 0 MiB, infer_weights 32 MiB, kv_cache 128 MiB)" in phases["infer1"], phases


def test_pausing_everything_leaves_paused_regions_alone(lib, torch_pool, monkeypatch):
    a, torch = torch_pool()
    with vmmalloc.region("py-a") as ra:
        x = torch.empty(MIB)
    with vmmalloc.region("py-b"):
        y = torch.empty(MIB)
    a.write(x.ptr, b"a" * 64)
    assert vmmalloc.pause("py-a", backup=True) > 0
    emptied = []
    monkeypatch.setattr(ra, "empty_cache", lambda: emptied.append("py-a"))
    # pause() of every tag: py-a is paused already; its pool's cache is not touched (its memory is unmapped).
    try:
        vmmalloc.pause()
    except vmmalloc.VmmallocError as e:  # the library may refuse a paused tag among "all"; nothing changes then
        assert "paused" in str(e), e
        vmmalloc.pause("py-b")
    assert emptied == []
    assert tag_of("py-b")["paused"]
    vmmalloc.resume()
    assert a.read(x.ptr, 64) == b"a" * 64 and y.ptr
    vmmalloc.validate(0)
