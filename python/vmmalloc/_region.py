"""Region mode: vmmalloc for chosen allocations, PyTorch's allocator for the
rest (docs/pytorch.md, "Region mode").

    with vmmalloc.region("kv_cache"):
        cache = torch.empty(n, device="cuda")   # vmmalloc memory, tagged "kv_cache"
    x = torch.empty(m, device="cuda")           # PyTorch's own allocator
    vmmalloc.pause("kv_cache")                  # sleep, as in replace mode
    vmmalloc.resume("kv_cache")

When vmmalloc is not PyTorch's current allocator (no ``enable()``), a region
is a ``torch.cuda.MemPool`` whose allocator is libvmmalloc
(``CUDAPluggableAllocator(lib, "vmmalloc_region_malloc", "vmmalloc_free")``),
entered with ``torch.cuda.use_mem_pool`` while the thread's vmmalloc tag is
the region's name: the same route vLLM's CuMemAllocator and SGLang's
torch_memory_saver take, after CUDA was initialised or not. PyTorch's caching
allocator asks the pool's allocator for whole segments
(c10/cuda/CUDACachingAllocator.cpp ``allocPrimitive``) and keeps its blocks
inside them; vmmalloc sees segments, tagged, and pauses and resumes them.

Which mode ``region(tag)`` takes (``pool=None``): replace mode's tag when
vmmalloc is enabled; a pool when torch is imported and CUDA is available;
else the tag only (allocations through the C ABI carry it). ``pool=True`` or
``False`` forces it.

The pool-mode caveats and what is done about each:

- **expandable segments** cannot be combined with a pool that has a custom
  allocator (pytorch#147851; PyTorch raised since pytorch#148378; newer
  code uses plain segments for such pools: the ``active_user_pool`` test
  quoted in pytorch#185818). When
  ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) turns them on, a
  region turns them off while it is entered and back on at its exit, as
  vLLM's CuMemAllocator does (vllm#40812): PyTorch's allocator keeps them
  outside regions.
- **lifetime** (pytorch#146431; addressed by pytorch#171962): a pool's segments
  outliving its allocator were freed with ``cudaFree`` or through a dead
  allocator. The allocator and every region's pool are kept for the life of
  the process (module globals, never dropped).
- **empty_cache** (pytorch#145168): ``torch.cuda.empty_cache()`` outside the
  pool does not return a pool's cached segments. ``Region.empty_cache()``
  calls it inside ``use_mem_pool`` (pytorch#133602: then it releases that
  pool's cached blocks), then ``vmmalloc.empty_cache()``.
- **frees before queued work finished**: vLLM synchronises before unmapping
  in its free callback. PyTorch frees a pool's segment only once its own
  events say the blocks are idle (``release_cached_blocks`` after
  ``synchronize_and_free_events``), and vmmalloc's free is stream-ordered: it
  records an event on the allocation's stream and unmaps only after it
  completed (DESIGN.md, driver rules). No synchronisation is added.
- **CUDA graphs captured into a region** (``torch.cuda.graph(g,
  pool=region.pool.id)`` or a capture inside the ``with``): the graph keeps
  the pool (``use_mem_pool``'s note); pausing the region keeps its addresses,
  so after ``resume`` the graph replays; replaying it while paused is the
  caller's error (the memory is unmapped), as with vLLM.
- **NCCL user-buffer registration** (``ProcessGroupNCCL.register_mem_pool``):
  registered memory must not be unmapped or remapped. ``Region.register_nccl()``
  refuses unless the configuration has ``unpin:false`` and ``spill:false``
  (both move pages under live blocks, at any time), and refuses a paused
  region (its memory is unmapped). ``pause`` of a registered region first
  deregisters the pool from each backend (``deregister_mem_pool``), before
  anything is unmapped, and remembers them; ``resume`` registers it again
  with each once the memory is mapped (a backend that fails is named in a
  ``VmmallocError``, the others stay registered). A pause that fails
  registers the pool again where its memory stayed mapped.
  ``deregister_nccl()`` of a paused region forgets the remembered backends.
- **a paused region's cached blocks**: PyTorch would hand out the pool's
  cached free blocks without asking vmmalloc, in unmapped memory; so
  entering a paused region raises, and so does pausing a region a thread is
  inside.
- **threads**: ``use_mem_pool`` and vmmalloc's tag are per thread; work that
  PyTorch runs on its own threads (autograd's backward on another device
  thread) is not routed to the region (``use_mem_pool``'s note).
"""

import contextlib
import os
import re
import threading

from . import _lib, _sleep

REGION_MALLOC = "vmmalloc_region_malloc"
FREE = "vmmalloc_free"

_lock = threading.Lock()
# The CUDAPluggableAllocator of every pool, and every Region: kept for the life
# of the process (pytorch#146431), never dropped.
_allocator = None
_regions = {}


def _torch():
    import sys

    return sys.modules.get("torch")


def _expandable_requested(env=None):
    """Whether PyTorch's allocator settings turn expandable segments on."""
    env = os.environ if env is None else env
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        m = re.search(r"(?:^|,)\s*expandable_segments\s*:\s*([^,\s]+)", env.get(key, ""))
        if m and m.group(1).lower() == "true":
            return True
    return False


def _vmmalloc_enabled():
    import vmmalloc

    return vmmalloc.is_enabled()


def pool_mode_available():
    """Whether ``region()`` would use a MemPool now: vmmalloc is not the
    current allocator, torch is imported and sees a CUDA device."""
    torch = _torch()
    if torch is None or _vmmalloc_enabled():
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def allocator():
    """The process's ``CUDAPluggableAllocator`` over libvmmalloc for regions
    (created once, never dropped)."""
    global _allocator
    with _lock:
        if _allocator is None:
            torch = _torch()
            if torch is None:
                raise _lib.VmmallocError("vmmalloc region pools need PyTorch: import torch first")
            import vmmalloc

            path = _lib.library_path()
            _lib.load(path)
            _lib.check_version(vmmalloc.__version__)
            _lib.check_config()
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, REGION_MALLOC, FREE)
        return _allocator


class Region:
    """One tag's MemPool on one device. Get it with :func:`get_region`;
    enter it with ``vmmalloc.region(tag)``."""

    def __init__(self, tag, device, pool):
        self.tag = tag
        self.device = device
        self.pool = pool
        self._inside = 0  # threads inside `with region(tag)` now
        self._nccl = []  # backends this region's pool is registered with now
        self._nccl_paused = []  # backends deregistered by pause, registered again by resume

    def __repr__(self):
        return f"Region(tag={self.tag!r}, device={self.device}, pool_id={getattr(self.pool, 'id', None)})"

    def stats(self):
        """This tag's vmmalloc figures on the region's device (a dict: tag,
        paused, blocks, live_bytes, mapped_bytes, paused_bytes, backup_bytes),
        zeros before its first allocation."""
        for t in _sleep.tag_stats(self.device):
            if t["tag"] == self.tag:
                return t
        return {"tag": self.tag, "paused": False, "blocks": 0, "live_bytes": 0, "mapped_bytes": 0,
                "paused_bytes": 0, "backup_bytes": 0}

    def paused(self):
        return bool(self.stats()["paused"])

    def empty_cache(self):
        """Returns the pool's cached free segments to vmmalloc (PyTorch's
        ``empty_cache`` inside the pool, pytorch#133602 / #145168), then
        vmmalloc's cached pages to the driver."""
        torch = _torch()
        with torch.cuda.use_mem_pool(self.pool, self.device):
            torch.cuda.empty_cache()
        _lib.empty_cache()

    def pause(self, backup=False):
        """``vmmalloc.pause(tag)``: given back, addresses kept (see
        :func:`before_pause` for what pool mode does first: a pool registered
        with NCCL is deregistered, and registered again by :meth:`resume`).
        Returns the bytes given back."""
        return _sleep.pause(self.tag, backup=backup)

    def _before_pause(self):
        if self._inside:
            raise _lib.VmmallocError(
                f"region {self.tag!r} cannot be paused while a thread is inside `with vmmalloc.region("
                f"{self.tag!r})`: PyTorch would keep allocating from its unmapped memory")

    def _deregister_for_pause(self):
        """Deregisters the pool from every NCCL backend it is registered with,
        before its memory is unmapped, and remembers them for resume. If a
        deregistration fails, those done are registered again and
        VmmallocError is raised (the registrations as they were)."""
        backends, done = list(self._nccl), []
        try:
            for b in backends:
                b.deregister_mem_pool(self.pool)
                done.append(b)
        except Exception as e:
            self._nccl = [b for b in backends if not any(b is d for d in done)]
            self._nccl_paused = done
            failed = self._register_again()
            raise _lib.VmmallocError(
                f"region {self.tag!r}: deregistering its pool from NCCL backend {backends[len(done)]!r} "
                f"(deregister_mem_pool) before the pause failed: {e}; nothing was paused"
                + _failed_text(self, failed)) from e
        self._nccl = []
        self._nccl_paused.extend(backends)

    def _register_again(self):
        """Registers the pool again with every backend :meth:`pause`
        deregistered, if its memory is mapped (not paused); else keeps them
        for resume. Returns the [(backend, exception)] that failed: they are
        forgotten (the pool is not registered with them)."""
        if not self._nccl_paused or self.paused():
            return []
        failed = []
        backends, self._nccl_paused = self._nccl_paused, []
        for b in backends:
            try:
                b.register_mem_pool(self.pool)
            except Exception as e:
                failed.append((b, e))
            else:
                self._nccl.append(b)
        return failed

    def resume(self):
        """``vmmalloc.resume(tag)``: the same addresses, mapped again (and the
        pool registered again with the NCCL backends its pause deregistered it
        from, see :func:`after_resume`)."""
        return _sleep.resume(self.tag)

    def register_nccl(self, group=None):
        """Registers the region's pool with NCCL (user-buffer registration,
        ``ProcessGroupNCCL.register_mem_pool``) for ``group`` (the default
        group if None). Refused while the region is paused (its memory is
        unmapped), and unless the configuration keeps pages in place
        (``unpin:false``, ``spill:false``). Pausing the region deregisters
        the pool; resuming registers it again."""
        if self.paused():
            raise _lib.VmmallocError(
                f"region {self.tag!r} is paused: its memory is unmapped and NCCL cannot register it; resume "
                f"it before register_nccl() (a registration made before the pause is restored by resume)")
        settings = _settings()
        # unpin is true/always/auto (auto moves pages too, in one thread),
        # spill true/false: anything but false may move pages.
        moving = [(k, str(settings[k]).lower()) for k in ("unpin", "spill")
                  if k in settings and str(settings[k]).lower() not in ("false", "0")]
        if moving:
            raise _lib.VmmallocError(
                f"region {self.tag!r}: NCCL-registered memory must stay where it is, but "
                f"{', '.join(k + ':' + v for k, v in moving)} may move pages under live blocks: set "
                f"{','.join(k + ':false' for k, _ in moving)} in VMMALLOC_CONF")
        torch = _torch()
        dist = getattr(torch, "distributed", None)
        if dist is None:
            import importlib

            dist = importlib.import_module("torch.distributed")
        pg = group if group is not None else dist.group.WORLD
        backend = pg._get_backend(torch.device("cuda", self.device))
        backend.register_mem_pool(self.pool)
        self._nccl.append(backend)

    def deregister_nccl(self):
        """Undoes :meth:`register_nccl` (every group). On a paused region it
        forgets the backends the pause deregistered the pool from, so that
        resume does not register it again."""
        self._nccl_paused = []
        while self._nccl:
            self._nccl[-1].deregister_mem_pool(self.pool)
            self._nccl.pop()


def _failed_text(region, failed):
    """The sentence naming the NCCL backends that ``region``'s pool could not
    be registered with again ("" for none)."""
    if not failed:
        return ""
    return (f"; registering region {region.tag!r}'s pool again with NCCL failed for "
            + ", ".join(f"backend {b!r} ({e})" for b, e in failed)
            + " (not registered there now: call register_nccl() again)")


def _chosen(tags, regions=None):
    regions = list(_regions.values()) if regions is None else regions
    return [r for r in regions if not tags or r.tag in tags]


def before_pause(tags):
    """What ``vmmalloc.pause(*tags)`` does first for the region pools among
    ``tags`` (all of them for none): refuses one a thread is inside, then
    deregisters each one registered with NCCL from its backends (remembered
    for resume; see :func:`after_pause`, :func:`after_resume`), then returns
    each one's cached free segments (:meth:`Region.empty_cache`), so that
    they are given back rather than backed up or kept. A failure registers
    again what was deregistered and raises."""
    # A region already paused is left alone (the library refuses to pause it again, or skips it for
    # no tags); its pool's cached segments must not be freed while their memory is unmapped.
    chosen = [r for r in _chosen(tags) if not r.paused()]
    for r in chosen:
        r._before_pause()
    deregistered = []
    try:
        # Before empty_cache: the pool's cached segments are registered too, and freeing one unmaps it.
        for r in chosen:
            if r._nccl:
                r._deregister_for_pause()
                deregistered.append(r)
        for r in chosen:
            r.empty_cache()
    except BaseException as e:
        failed = [(r, r._register_again()) for r in deregistered]
        text = "".join(_failed_text(r, f) for r, f in failed)
        if text:
            raise _lib.VmmallocError(f"{e}{text}") from e
        raise


def after_pause(tags, error=None):
    """What ``vmmalloc.pause(*tags)`` does last, ``error`` its failure (an
    exception) or None: registers the pools that :func:`before_pause`
    deregistered from NCCL again where their memory is still mapped (the
    pause failed, or did not cover the tag: the default tag), then raises
    ``error``, or a VmmallocError naming the backends where that failed."""
    _register_mapped_again(tags, error, "vmmalloc.pause: the paused memory is given back")


def after_resume(tags, error=None):
    """What ``vmmalloc.resume(*tags)`` does once the memory is mapped again,
    ``error`` its failure (an exception) or None: registers the pool of
    each region among ``tags`` (all for none) that is resumed now again with
    the NCCL backends its pause deregistered it from; a region still paused
    keeps them. A backend that fails is forgotten and the others go on;
    then ``error`` is raised, or a VmmallocError naming the backends that
    failed (the memory stays resumed)."""
    _register_mapped_again(tags, error, "vmmalloc.resume: the memory is mapped again")


def _register_mapped_again(tags, error, done):
    """after_pause and after_resume: every region among ``tags`` with
    backends a pause deregistered and memory mapped now is registered again;
    then ``error`` is raised (with the failures named), or a VmmallocError
    that starts with ``done`` and names the failures."""
    text = ""
    for r in _chosen(tags, [r for r in list(_regions.values()) if r._nccl_paused]):
        text += _failed_text(r, r._register_again())
    if error is not None:
        if text:
            raise _lib.VmmallocError(f"{error}{text}") from error
        raise error
    if text:
        raise _lib.VmmallocError(f"{done}{text}")


def _settings():
    """The library's effective configuration (the snapshot's allocator_settings)."""
    import pickle
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".pickle", prefix="vmmalloc-settings-")
    os.close(fd)
    try:
        _lib.dump_snapshot(path)
        with open(path, "rb") as f:
            return pickle.load(f).get("allocator_settings", {})
    finally:
        os.unlink(path)


def get_region(tag, device=None):
    """The :class:`Region` (a MemPool over vmmalloc) of ``tag`` on ``device``
    (the current CUDA device if None), created on first use and kept for the
    life of the process."""
    torch = _torch()
    if torch is None:
        raise _lib.VmmallocError("vmmalloc region pools need PyTorch: import torch first")
    _sleep._encode(tag)
    if device is None:
        device = torch.cuda.current_device()
    elif not isinstance(device, int):
        device = torch.cuda._get_device_index(device, optional=True)
    key = (tag, device)
    region = _regions.get(key)
    if region is None:
        alloc = allocator()
        with _lock:
            region = _regions.get(key)
            if region is None:
                pool = torch.cuda.MemPool(alloc.allocator())
                region = _regions[key] = Region(tag, device, pool)
    return region


def regions():
    """Every region pool created in this process, as a list of :class:`Region`."""
    return list(_regions.values())


def _set_allocator_settings(torch, text):
    """PyTorch's allocator settings (``PYTORCH_CUDA_ALLOC_CONF`` syntax) at run
    time: ``torch._C._accelerator_setAllocatorSettings`` where it exists
    (``torch.cuda.memory._set_allocator_settings`` calls it, with a
    FutureWarning, in PyTorch 2.15), else the older function."""
    setter = getattr(getattr(torch, "_C", None), "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(text)


@contextlib.contextmanager
def _pool_region(tag, device):
    torch = _torch()
    region = get_region(tag, device)
    if region.paused():
        raise _lib.VmmallocError(
            f"region {tag!r} is paused: resume it before allocating in it (PyTorch's pool would hand out "
            f"cached blocks in its unmapped memory)")
    previous = _sleep.get_tag()
    _sleep.set_tag(tag)
    toggled = False
    try:
        if _expandable_requested():
            # pytorch#147851: not with a custom-allocator pool; off inside, back on at exit (vllm#40812).
            _set_allocator_settings(torch, "expandable_segments:False")
            toggled = True
        with _lock:
            region._inside += 1
        try:
            with torch.cuda.use_mem_pool(region.pool, region.device):
                yield region
        finally:
            with _lock:
                region._inside -= 1
    finally:
        if toggled:
            _set_allocator_settings(torch, "expandable_segments:True")
        _sleep.set_tag(previous)


@contextlib.contextmanager
def _tag_region(tag):
    previous = _sleep.get_tag()
    _sleep.set_tag(tag)
    try:
        yield tag
    finally:
        _sleep.set_tag(previous)


def region(tag, device=None, pool=None):
    """``with vmmalloc.region(tag):`` routes this thread's allocations inside
    the block to vmmalloc, tagged ``tag`` (see the module's doc for the
    modes). Yields the :class:`Region` in pool mode, else the tag."""
    if pool is None:
        pool = pool_mode_available()
    elif pool and not pool_mode_available():
        raise _lib.VmmallocError(
            "vmmalloc is PyTorch's current allocator (enable()): every allocation is vmmalloc's already; use "
            "region(tag) without pool=True" if _torch() is not None and _vmmalloc_enabled() else
            "region(pool=True) needs PyTorch imported and a CUDA device (torch.cuda.is_available())")
    if pool:
        return _pool_region(tag, device)
    return _tag_region(tag)
