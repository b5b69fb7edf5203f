"""A budget shared by the processes on one GPU (docs/share.md).

With ``VMMALLOC_CONF=share:NAME`` every process of group NAME charges one
budget before it creates GPU memory, so together they never hold more than
its total. From inside a member:

    vmmalloc.share_info()                    # {"name", "total", "used", "revision", "me", "members": [...]}
    vmmalloc.share_set_cap(8 << 30)          # this process's cap: give back above it
    vmmalloc.share_set_cap(None)             # no cap
    vmmalloc.share_set_cap(4 << 30, revision=r)   # refused (VmmallocError "stale") unless still at r
    vmmalloc.share_set_total(40 << 30)

From outside, ``vmmalloc share NAME [--cap PID=SIZE] [--total SIZE]``.
"""

import ctypes
import json

from . import _lib

_DECLARED = "_vmmalloc_share_declared"
_NO_CAP = (1 << 64) - 1


def _load():
    lib = _lib.load()
    if not getattr(lib, _DECLARED, False):
        c = ctypes
        _lib.declare(lib, [
            ("vmmalloc_share_info_json", c.c_void_p, [c.c_int]),
            ("vmmalloc_share_set_cap", c.c_int64, [c.c_int, c.c_uint64, c.c_int64]),
            ("vmmalloc_share_set_total", c.c_int64, [c.c_int, c.c_uint64, c.c_int64]),
        ])
        setattr(lib, _DECLARED, True)
    return lib


def _bytes(v, what, none_ok):
    if v is None and none_ok:
        return _NO_CAP
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} is an int of bytes{' or None' if none_ok else ''}, not {type(v).__name__}")
    if v < 0 or v >= _NO_CAP:
        raise ValueError(f"{what} must be from 0 to 2**64 - 2 bytes, not {v}")
    return v


def _revision(r):
    if r is None:
        return -1
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"revision is a revision number (int >= 0) or None, not {r!r}")
    return r


def share_info(device=0):
    """The shared budget of ``device`` as a dict: ``name``, ``path``,
    ``total``, ``used``, ``revision``, ``me`` (this pid), ``reaped``, and
    ``members``, each ``{"pid", "used", "cap" (None: no cap), "cap_rev",
    "state" ("active" | "deferred"), "cached", "want"}``. Raises
    VmmallocError when this process is not a member (no ``share:NAME``)."""
    return json.loads(_lib._take_string(_load().vmmalloc_share_info_json(device), "vmmalloc_share_info_json"))


def share_set_cap(cap, device=0, revision=None):
    """Sets this process's cap to ``cap`` bytes (None: no cap; 0: nothing,
    as ``vmmalloc share NAME --cap PID=0``). Above it, the
    allocator gives back its cached memory at once, then calls the pressure
    callback (``on_memory_pressure``); live tensors are never revoked (the
    member reads "deferred" until it frees them). With ``revision``, refused
    (VmmallocError naming "stale") unless the group is still at it. Returns
    the new revision."""
    r = _load().vmmalloc_share_set_cap(device, _bytes(cap, "cap", True), _revision(revision))
    if r < 0:
        raise _lib.VmmallocError(_lib.last_error() or "vmmalloc_share_set_cap failed")
    return r


def share_set_total(total, device=0, revision=None):
    """Sets the group's total (refused below what the members hold).
    ``revision`` as for ``share_set_cap``. Returns the new revision."""
    r = _load().vmmalloc_share_set_total(device, _bytes(total, "total", False), _revision(revision))
    if r < 0:
        raise _lib.VmmallocError(_lib.last_error() or "vmmalloc_share_set_total failed")
    return r
