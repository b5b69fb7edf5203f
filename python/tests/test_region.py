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
    r.deregister_nccl()
    assert torch.backend.registered == []
    assert vmmalloc.pause("py-nccl") > 0
    vmmalloc.resume("py-nccl")
    _, torch = torch_pool(HOST + ",unpin:false,spill:true")
    with pytest.raises(vmmalloc.VmmallocError, match="spill:true may move pages"):
        vmmalloc.get_region("py-nccl").register_nccl()
    assert torch.backend.registered == []


# ---------------------------------------------------------------------------
# A region registered with NCCL pauses and resumes (issue 43)
# ---------------------------------------------------------------------------

NCCL_HOST = HOST + ",unpin:false,spill:false"


class StrictBackend:
    """A ProcessGroupNCCL backend as strict as NCCL: ``register_mem_pool``
    registers the pool's segments (its snapshot), which must be mapped (the
    region not paused) and not registered already; ``deregister_mem_pool``
    deregisters exactly those, which must be registered and still mapped (not
    freed, not paused: NCCL's handles must be gone before their memory is).
    Every call is recorded in ``events``."""

    def __init__(self, name, events, fail_register=0, fail_deregister=0):
        self.name, self.events = name, events
        self.fail_register, self.fail_deregister = fail_register, fail_deregister
        self.segments = {}  # id(pool) -> the pool's segments it registered

    def __repr__(self):
        return f"<backend {self.name}>"

    @staticmethod
    def _region(pool):
        return next(r for r in vmmalloc.regions() if r.pool is pool)

    def register_mem_pool(self, pool):
        if self.fail_register:
            self.fail_register -= 1
            raise RuntimeError(f"NCCL error in {self.name}: ncclCommRegister failed")
        assert id(pool) not in self.segments, f"{self.name}: registered twice"
        assert not self._region(pool).stats()["paused"], f"{self.name}: registering unmapped memory"
        self.segments[id(pool)] = set(pool.segments)
        self.events.append(("register", self.name))

    def deregister_mem_pool(self, pool):
        if self.fail_deregister:
            self.fail_deregister -= 1
            raise RuntimeError(f"NCCL error in {self.name}: ncclCommDeregister failed")
        assert id(pool) in self.segments, f"{self.name}: deregistering a pool not registered"
        assert not self._region(pool).stats()["paused"], f"{self.name}: deregistering after the unmap"
        freed = self.segments[id(pool)] - set(pool.segments)
        assert not freed, f"{self.name}: registered segments freed (unmapped) before the deregistration"
        del self.segments[id(pool)]
        self.events.append(("deregister", self.name))

    def holds(self, pool):
        return id(pool) in self.segments


class Group:
    """A process group whose ``_get_backend`` answers ``backend``."""

    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device):
        return self.backend


class LibSpy:
    """The library as ``_sleep`` sees it, recording pause and resume in
    ``events``; ``fail`` makes the next pause or resume raise it (as a
    ctypes call that raised), ``refuse`` makes it answer -1."""

    def __init__(self, lib, events):
        self.lib, self.events = lib, events
        self.fail = self.refuse = None

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def _call(self, what, f, *args):
        self.events.append((what, args[0].decode()))
        if self.fail:
            e, self.fail = self.fail, None
            raise e
        if self.refuse:
            self.refuse = None
            return -1
        return f(*args)

    def vmmalloc_pause(self, tags, backup):
        return self._call("pause", self.lib.vmmalloc_pause, tags, backup)

    def vmmalloc_resume(self, tags):
        return self._call("resume", self.lib.vmmalloc_resume, tags)


@pytest.fixture
def nccl(lib, torch_pool, monkeypatch):
    """A host library that keeps pages in place, the stand-in torch, the event
    list and the library spy."""
    from vmmalloc import _sleep

    a, torch = torch_pool(NCCL_HOST)
    events = []
    spy = LibSpy(_sleep._load(), events)
    monkeypatch.setattr(_sleep, "_load", lambda: spy)
    return a, torch, events, spy


def registered_region(torch, tag, backends):
    """A region with a 12 MiB tensor and a cached free 30 MiB segment,
    registered with each of ``backends``."""
    with vmmalloc.region(tag) as r:
        t = torch.empty(12 * MIB)
        torch.empty(30 * MIB).free()  # cached in the pool, registered with it
    for b in backends:
        r.register_nccl(Group(b))
    return r, t


@pytest.mark.parametrize("n", [1, 2])
def test_a_registered_region_is_deregistered_before_pause_and_registered_again_after_resume(nccl, n):
    a, torch, events, spy = nccl
    backends = [StrictBackend(f"pg{i}", events) for i in range(n)]
    r, _ = registered_region(torch, "py-nccl-rt", backends)
    assert r._nccl == backends and events == [("register", b.name) for b in backends]
    events.clear()
    assert r.pause() >= 12 * MIB
    # Every deregistration came before the pause (and before empty_cache freed the cached segment:
    # the strict backend checked its registered segments were all still there).
    assert events == [("deregister", b.name) for b in backends] + [("pause", "py-nccl-rt")]
    assert r.paused() and r._nccl == [] and r._nccl_paused == backends
    assert not any(b.holds(r.pool) for b in backends) and r.pool.cached == []
    events.clear()
    assert r.resume() >= 12 * MIB
    assert events == [("resume", "py-nccl-rt")] + [("register", b.name) for b in backends]
    assert not r.paused() and r._nccl == backends and r._nccl_paused == []
    assert all(b.holds(r.pool) for b in backends)
    # Again, through vmmalloc.pause/resume with no tags (every tag).
    events.clear()
    vmmalloc.pause()
    assert events == [("deregister", b.name) for b in backends] + [("pause", "")]
    events.clear()
    vmmalloc.resume()
    assert events == [("resume", "")] + [("register", b.name) for b in backends]
    assert r._nccl == backends and all(b.holds(r.pool) for b in backends)
    r.deregister_nccl()
    assert r._nccl == [] and not any(b.holds(r.pool) for b in backends)
    vmmalloc.validate(0)


def test_pausing_one_tag_leaves_another_regions_registration_alone(nccl):
    a, torch, events, spy = nccl
    pa, pb = StrictBackend("pa", events), StrictBackend("pb", events)
    ra, _ = registered_region(torch, "py-nccl-a", [pa])
    rb, _ = registered_region(torch, "py-nccl-b", [pb])
    events.clear()
    vmmalloc.pause("py-nccl-a")
    assert events == [("deregister", "pa"), ("pause", "py-nccl-a")]
    assert rb._nccl == [pb] and pb.holds(rb.pool) and not rb.paused()
    events.clear()
    vmmalloc.resume("py-nccl-a")
    assert events == [("resume", "py-nccl-a"), ("register", "pa")]
    assert ra._nccl == [pa] and rb._nccl == [pb]


def test_pause_refused_inside_the_region_leaves_the_registrations_alone(nccl):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events), StrictBackend("pg1", events)]
    r, _ = registered_region(torch, "py-nccl-in", backends)
    events.clear()
    with vmmalloc.region("py-nccl-in"):
        with pytest.raises(vmmalloc.VmmallocError, match="while a thread is inside"):
            r.pause()
        with pytest.raises(vmmalloc.VmmallocError, match="while a thread is inside"):
            vmmalloc.pause()
    assert events == [] and r._nccl == backends and r._nccl_paused == []
    assert all(b.holds(r.pool) for b in backends) and not r.paused()


@pytest.mark.parametrize("how", ["unknown tag", "answers -1", "raises"])
def test_a_failed_pause_registers_the_backends_again(nccl, how):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events), StrictBackend("pg1", events)]
    r, _ = registered_region(torch, "py-nccl-pf", backends)
    events.clear()
    tags = ("py-nccl-pf",)
    if how == "unknown tag":  # the library's own refusal: nothing paused
        tags, match = ("py-nccl-pf", "py-never-tagged"), "unknown tag"
    elif how == "answers -1":
        spy.refuse, match = True, "vmmalloc_pause failed"
    else:
        spy.fail, match = OSError("the call itself failed"), "the call itself failed"
    with pytest.raises((vmmalloc.VmmallocError, OSError), match=match):
        vmmalloc.pause(*tags)
    assert events == ([("deregister", b.name) for b in backends] + [("pause", ",".join(tags))]
                      + [("register", b.name) for b in backends])
    assert not r.paused() and r._nccl == backends and r._nccl_paused == []
    assert all(b.holds(r.pool) for b in backends)
    # It pauses once the failure is gone.
    assert r.pause() > 0 and r._nccl == [] and r._nccl_paused == backends
    r.resume()
    assert r._nccl == backends


def test_a_failed_deregistration_pauses_nothing_and_registers_the_others_again(nccl):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events), StrictBackend("pg1", events, fail_deregister=1)]
    r, _ = registered_region(torch, "py-nccl-df", backends)
    events.clear()
    with pytest.raises(vmmalloc.VmmallocError,
                       match=r"from NCCL backend <backend pg1> .* ncclCommDeregister failed; nothing was paused"):
        r.pause()
    assert events == [("deregister", "pg0"), ("register", "pg0")]
    assert not r.paused() and r.pool.cached  # the cached segment was not freed either
    assert sorted(b.name for b in r._nccl) == ["pg0", "pg1"] and r._nccl_paused == []
    assert all(b.holds(r.pool) for b in backends)


def test_resume_names_a_backend_that_fails_and_registers_the_others(nccl):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events), StrictBackend("pg1", events), StrictBackend("pg2", events)]
    r, t = registered_region(torch, "py-nccl-rf", backends)
    a.write(t.ptr, b"r" * 4096)
    r.pause(backup=True)
    backends[1].fail_register = 1
    events.clear()
    with pytest.raises(vmmalloc.VmmallocError) as e:
        r.resume()
    msg = str(e.value)
    assert msg.startswith("vmmalloc.resume: the memory is mapped again"), msg
    assert "<backend pg1> (NCCL error in pg1: ncclCommRegister failed)" in msg, msg
    assert "pg0" not in msg and "pg2" not in msg, msg
    # The memory is resumed either way; the others are registered; pg1 is forgotten.
    assert not r.paused() and a.read(t.ptr, 4096) == b"r" * 4096
    assert events == [("resume", "py-nccl-rf"), ("register", "pg0"), ("register", "pg2")]
    assert r._nccl == [backends[0], backends[2]] and r._nccl_paused == []
    assert not backends[1].holds(r.pool)
    # The region stays consistent: it pauses and resumes with the two, and pg1 can register again.
    events.clear()
    r.pause()
    r.resume()
    assert events == [("deregister", "pg0"), ("deregister", "pg2"), ("pause", "py-nccl-rf"),
                      ("resume", "py-nccl-rf"), ("register", "pg0"), ("register", "pg2")]
    r.register_nccl(Group(backends[1]))
    assert r._nccl == [backends[0], backends[2], backends[1]] and all(b.holds(r.pool) for b in backends)


def test_a_failed_resume_keeps_the_backends_for_the_next(nccl):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events)]
    r, _ = registered_region(torch, "py-nccl-rr", backends)
    r.pause()
    spy.refuse = True
    events.clear()
    with pytest.raises(vmmalloc.VmmallocError, match="vmmalloc_resume failed"):
        r.resume()
    assert events == [("resume", "py-nccl-rr")]  # still paused: nothing registered
    assert r.paused() and r._nccl == [] and r._nccl_paused == backends
    r.resume()
    assert r._nccl == backends and backends[0].holds(r.pool)


def test_deregister_nccl_while_paused_forgets_the_backends(nccl):
    a, torch, events, spy = nccl
    backends = [StrictBackend("pg0", events), StrictBackend("pg1", events)]
    r, _ = registered_region(torch, "py-nccl-dp", backends)
    r.pause()
    events.clear()
    r.deregister_nccl()  # nothing to deregister: the pause did
    assert events == [] and r._nccl == [] and r._nccl_paused == []
    r.resume()
    assert events == [("resume", "py-nccl-dp")]
    assert not any(b.holds(r.pool) for b in backends)


def test_register_nccl_while_paused_is_refused(nccl):
    a, torch, events, spy = nccl
    b = StrictBackend("pg0", events)
    with vmmalloc.region("py-nccl-rp") as r:
        torch.empty(MIB)
    r.pause()
    with pytest.raises(vmmalloc.VmmallocError, match="'py-nccl-rp' is paused: its memory is unmapped and NCCL"):
        r.register_nccl(Group(b))
    assert r._nccl == [] and r._nccl_paused == [] and not b.holds(r.pool)
    r.resume()
    r.register_nccl(Group(b))
    assert r._nccl == [b] and b.holds(r.pool)


def test_a_backup_pause_of_a_registered_region_keeps_the_contents(nccl):
    a, torch, events, spy = nccl
    b = StrictBackend("pg0", events)
    r, t = registered_region(torch, "py-nccl-bk", [b])
    data = bytes(range(256)) * 64
    a.write(t.ptr, data)
    assert vmmalloc.pause("py-nccl-bk", backup=True) >= 12 * MIB
    assert r.stats()["backup_bytes"] == 12 * MIB and not b.holds(r.pool)
    assert vmmalloc.resume("py-nccl-bk") >= 12 * MIB
    assert a.read(t.ptr, len(data)) == data and b.holds(r.pool) and r._nccl == [b]
    vmmalloc.validate(0)


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
