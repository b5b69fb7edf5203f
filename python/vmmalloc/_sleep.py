"""Sleep and wake: tag allocations, give their GPU memory back, get it back
at the same addresses (docs/guide.md, "Sleep and wake").

    with vmmalloc.region("kv_cache"):
        cache = torch.empty(n, device="cuda")   # tagged "kv_cache"
    freed = vmmalloc.pause("kv_cache")             # bytes given back to the driver
    ...                                            # another model uses the memory
    vmmalloc.resume("kv_cache")                    # same addresses, contents lost
    vmmalloc.pause("weights", backup=True)         # contents copied to host memory
    vmmalloc.resume("weights")                     # ... and copied back

Tags are per thread. Only the ``expandable`` backend can sleep.

A CUDA graph's (or ``torch.cuda.MemPool``'s) private pool pauses in place,
without recapture: the graph replays at the same addresses once resumed.

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model(static_in)
    vmmalloc.pause_pool(g, keep=True)   # contents to host; memory given back
    ...                                 # the trainer uses the memory
    vmmalloc.resume_pool(g)             # mapped again, contents copied back
    g.replay()                          # bitwise the output it gave before

While a pool is paused (through pause_pool), ``torch.cuda.CUDAGraph.replay``
of a graph on that pool (and so CUDA graph trees' replays, which call it)
raises VmmallocError instead of running kernels on unmapped memory. What
cannot be guarded: a kernel launched by hand on a tensor of the paused pool
(any torch op on it), and a pool paused through the C ABI directly.
"""

import ctypes
import json
import sys
import threading

from . import _lib

_DECLARED = "_vmmalloc_sleep_declared"


def _load():
    lib = _lib.load()
    if not getattr(lib, _DECLARED, False):
        c = ctypes
        _lib.declare(lib, [
            ("vmmalloc_set_tag", c.c_int, [c.c_char_p]),
            ("vmmalloc_get_tag", c.c_void_p, []),
            ("vmmalloc_pause", c.c_int64, [c.c_char_p, c.c_int]),
            ("vmmalloc_resume", c.c_int64, [c.c_char_p]),
            ("vmmalloc_tag_stats_json", c.c_void_p, [c.c_int]),
            ("vmmalloc_pool_pause", c.c_int64, [c.c_int, c.c_uint64, c.c_uint64, c.c_int]),
            ("vmmalloc_pool_resume", c.c_int64, [c.c_int, c.c_uint64, c.c_uint64]),
        ])
        setattr(lib, _DECLARED, True)
    return lib


def _encode(tag):
    if not isinstance(tag, str):
        raise TypeError(f"a tag is a str, not {type(tag).__name__}")
    try:
        return tag.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _lib.VmmallocError(f"tag {tag!r} is not valid UTF-8: {e}") from None


def set_tag(tag):
    """Sets this thread's tag ("" = the default): its later allocations carry it.
    Raises VmmallocError (tag unchanged) for a tag over 64 bytes or holding
    ',' or a control character."""
    _lib._check(_load().vmmalloc_set_tag(_encode(tag)), "vmmalloc_set_tag")


def get_tag():
    """This thread's tag ("" by default)."""
    return _lib._take_string(_load().vmmalloc_get_tag(), "vmmalloc_get_tag")


def region(tag, device=None, pool=None):
    """``with vmmalloc.region("kv_cache"):`` tags the allocations this thread
    makes inside the block; the previous tag is restored on exit. When
    vmmalloc is not PyTorch's current allocator and torch sees a GPU, the
    block also routes them to vmmalloc through a ``torch.cuda.MemPool``
    (region mode, see ``_region``)."""
    from . import _region

    return _region.region(tag, device=device, pool=pool)


def _tag_list(tags):
    return b",".join(_encode(t) for t in tags)


def pause(*tags, backup=False):
    """Gives the GPU memory of the blocks tagged ``tags`` (none: every
    non-default tag) back to the driver, keeping their addresses; with
    ``backup=True`` their contents are copied to host memory first. Returns
    the bytes given back. Raises VmmallocError (unknown or already paused
    tag, graph capture underway, driver failure). A region pool registered
    with NCCL is deregistered first and registered again by resume (or at
    once, if its memory stays mapped); see ``_region.before_pause``."""
    from . import _region

    _region.before_pause(tags)
    return _then(lambda: _load().vmmalloc_pause(_tag_list(tags), 1 if backup else 0),
                 "vmmalloc_pause", _region.after_pause, tags)


def resume(*tags):
    """Maps GPU memory again under the paused blocks of ``tags`` (none: every
    paused tag), at the same addresses, and restores backups. On failure (out
    of memory included) the tags stay paused and VmmallocError is raised.
    Returns the bytes mapped. A region pool whose pause deregistered it from
    NCCL is registered again once mapped (``_region.after_resume``)."""
    from . import _region

    return _then(lambda: _load().vmmalloc_resume(_tag_list(tags)), "vmmalloc_resume",
                 _region.after_resume, tags)


def _then(call, name, after, tags):
    """Runs the library ``call`` (named ``name``; a negative answer is its
    error), then ``after(tags)``, or ``after(tags, error)`` (which re-raises
    it) when it failed. Returns what ``call`` returned."""
    try:
        n = call()
        if n < 0:
            raise _lib.VmmallocError(_lib.last_error() or f"{name} failed")
    except BaseException as e:
        after(tags, e)  # raises e
        raise
    after(tags)
    return n


def tag_stats(device=0):
    """Per-tag memory of a device: a list of dicts (tag, paused, blocks,
    live_bytes, mapped_bytes, paused_bytes, backup_bytes)."""
    return json.loads(_lib._take_string(_load().vmmalloc_tag_stats_json(device), "vmmalloc_tag_stats_json"))


def _pool_id(pool):
    """(hi, lo) of a pool given as a ``torch.cuda.CUDAGraph`` (its
    ``pool()``), a ``torch.cuda.MemPool`` (its ``id``), or a pair of ints."""
    if hasattr(pool, "pool") and callable(pool.pool):
        pool = pool.pool()
    elif hasattr(pool, "id") and not isinstance(pool, (tuple, list)):
        pool = pool.id
    try:
        hi, lo = pool
        hi, lo = int(hi), int(lo)
    except (TypeError, ValueError):
        raise TypeError(
            f"a pool is a torch.cuda.CUDAGraph, a torch.cuda.MemPool or a (hi, lo) pair of ints, "
            f"not {type(pool).__name__}") from None
    if not (0 <= hi < 1 << 64 and 0 <= lo < 1 << 64) or (hi, lo) == (0, 0):
        raise _lib.VmmallocError(f"pool ({hi}, {lo}) is not a private pool id")
    return hi, lo


def _device(device):
    if device is None:
        return 0
    index = getattr(device, "index", device)
    return 0 if index is None else int(index)


# (device, hi, lo) of the pools pause_pool paused and resume_pool has not
# resumed yet: what the replay guard checks (a set lookup per replay).
_paused_pools = set()
_paused_lock = threading.Lock()


def _guard_replay():
    """Wraps torch.cuda.CUDAGraph.replay (once) so that a graph whose pool
    is paused raises instead of replaying on unmapped memory (issue 40)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(getattr(torch, "cuda", None), "CUDAGraph"):
        return
    cls = torch.cuda.CUDAGraph
    if getattr(cls.replay, "_vmmalloc_guard", False):
        return
    replay = cls.replay

    def guarded_replay(self, *args, **kwargs):
        if _paused_pools:
            hi, lo = (int(x) for x in self.pool())
            paused = [d for d, h, lw in list(_paused_pools) if (h, lw) == (hi, lo)]
            if paused:
                raise _lib.VmmallocError(
                    f"vmmalloc: this CUDA graph's pool ({hi}, {lo}) is paused (device {paused[0]}); "
                    f"call vmmalloc.resume_pool(graph) before replay(): its kernels would run on "
                    f"unmapped memory")
        return replay(self, *args, **kwargs)

    guarded_replay._vmmalloc_guard = True
    guarded_replay.__doc__ = replay.__doc__
    cls.replay = guarded_replay


def pause_pool(pool, keep=True, device=None):
    """Pauses a CUDA graph's or MemPool's private pool in place: waits for
    the device, copies the pool's live blocks to host memory (``keep=True``;
    with ``keep=False`` their contents are lost, for graphs whose every
    replay writes before it reads), unmaps its pages and gives the physical
    memory back. Every address stays reserved. Returns the bytes given back.
    Raises VmmallocError (unknown pool, paused already, a capture underway,
    a backend without pools; nothing changed)."""
    hi, lo = _pool_id(pool)
    _guard_replay()
    n = _load().vmmalloc_pool_pause(_device(device), hi, lo, 1 if keep else 0)
    if n < 0:
        raise _lib.VmmallocError(_lib.last_error() or "vmmalloc_pool_pause failed")
    with _paused_lock:
        _paused_pools.add((_device(device), hi, lo))
    return n


def resume_pool(pool, device=None):
    """Maps memory again under a paused pool, at the same addresses, and
    copies its kept contents back. On failure (out of memory included)
    nothing stays mapped, the pool stays paused and VmmallocError is raised;
    a retry once memory is free succeeds. Returns the bytes mapped."""
    hi, lo = _pool_id(pool)
    n = _load().vmmalloc_pool_resume(_device(device), hi, lo)
    if n < 0:
        raise _lib.VmmallocError(_lib.last_error() or "vmmalloc_pool_resume failed")
    with _paused_lock:
        _paused_pools.discard((_device(device), hi, lo))
    return n
