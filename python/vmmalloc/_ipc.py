"""IPC without PyTorch: share a vmmalloc allocation with another process
(docs/pytorch.md, "IPC").

    # producer (vmmalloc current, VMMALLOC_CONF as usual)
    handle = vmmalloc.ipc_export(ptr)          # bytes: send them any way you like
    # consumer (another process running vmmalloc with the same device backend)
    ptr = vmmalloc.ipc_import(handle)          # the same memory, mapped here
    ...
    vmmalloc.ipc_close(ptr)                    # unmaps it (never vmmalloc_free)

The producer must keep the allocation alive while consumers use it; freeing
it ends the export (later imports fail, naming why). A handle of another
format or vmmalloc version raises VmmallocError naming both formats.
``VMMALLOC_IPC_TRANSPORT=socket`` makes the consumer take the descriptors
over the producer's Unix socket instead of ``pidfd_getfd``.

PyTorch's own formats, both ways (docs/pytorch.md, "IPC"):

    handle, offset = vmmalloc.ipc_export_torch(ptr, "2.15")
    # PyTorch 2.15's expandable-segments handle ('e', version 3) when the
    # allocation's chunks fit it, else vmmalloc's (offset 0);
    # VMMALLOC_IPC_FORMAT=auto|torch|vmmalloc chooses.
    base = vmmalloc.ipc_import(torch_handle)   # PyTorch's 'e' (versions 2, 3)
                                               # or 'c' (cudaIpc, device:cuda)
"""

import ctypes

from . import _lib
from ._lib import VmmallocError

_DECLARED = "_vmmalloc_ipc_declared"


def _load():
    lib = _lib.load()
    if not getattr(lib, _DECLARED, False):
        c = ctypes
        _lib.declare(lib, [
            ("vmmalloc_ipc_export", c.c_int, [c.c_void_p, c.c_void_p, c.c_size_t, c.POINTER(c.c_size_t)]),
            ("vmmalloc_ipc_import", c.c_int, [c.c_char_p, c.c_size_t, c.POINTER(c.c_void_p)]),
            ("vmmalloc_ipc_import_device", c.c_int, [c.c_char_p, c.c_size_t, c.c_int, c.POINTER(c.c_void_p)]),
            ("vmmalloc_ipc_close", c.c_int, [c.c_void_p]),
        ])
        # Newer entry points (issue 35), absent from an older libvmmalloc.
        _lib.declare(lib, [f for f in [
            ("vmmalloc_ipc_export_torch", c.c_int,
             [c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_size_t, c.POINTER(c.c_size_t),
              c.POINTER(c.c_size_t)]),
            ("vmmalloc_ipc_close_on", c.c_int, [c.c_void_p, c.c_void_p]),
        ] if hasattr(lib, f[0])])
        setattr(lib, _DECLARED, True)
    return lib


def _ptr(ptr):
    if not isinstance(ptr, int) or ptr <= 0:
        raise TypeError(f"a device pointer is a positive int, not {ptr!r}")
    return ctypes.c_void_p(ptr)


def ipc_export(ptr):
    """The IPC handle (bytes) of live vmmalloc allocation ``ptr`` (the exact
    pointer the allocator returned, e.g. ``tensor.untyped_storage().data_ptr()``).
    Exporting the same pointer again returns the same handle."""
    lib = _load()
    n = ctypes.c_size_t(0)
    _lib._check(lib.vmmalloc_ipc_export(_ptr(ptr), None, 0, ctypes.byref(n)), "vmmalloc_ipc_export")
    buf = ctypes.create_string_buffer(n.value)
    _lib._check(lib.vmmalloc_ipc_export(_ptr(ptr), buf, n.value, ctypes.byref(n)), "vmmalloc_ipc_export")
    return buf.raw[: n.value]


def _torch_version(version):
    """(major, minor) of ``version`` ("2.15", "2.15.0+cu132", (2, 15)), or of
    the installed torch when None."""
    if version is None:
        try:
            import torch
        except ImportError as e:
            raise TypeError("ipc_export_torch: no torch installed; name the PyTorch version") from e
        version = torch.__version__
    if isinstance(version, str):
        parts = version.split("+")[0].split(".")
        try:
            return int(parts[0]), int(parts[1])
        except (IndexError, ValueError) as e:
            raise ValueError(f"not a PyTorch version: {version!r}") from e
    major, minor = version
    return int(major), int(minor)


def ipc_export_torch(ptr, torch_version=None):
    """``(handle, offset)`` a producer inside PyTorch ``torch_version``
    (default: the installed one) shares for live allocation ``ptr``: PyTorch's
    own expandable-segments handle of that version (``'e'``; version 3 for
    2.13-2.15, 2 for 2.11-2.12), which a stock PyTorch consumer imports, at
    every size: where the chunks under the allocation differ in size they are
    re-backed once with equal handles (PyTorch's header has one
    segment_size), and where that cannot be done VmmallocError says why. For
    other versions vmmalloc's handle with offset 0. ``VMMALLOC_IPC_FORMAT``
    (``auto``, ``torch``, ``vmmalloc``) chooses (docs/pytorch.md, "IPC").
    ``offset`` is the pointer's offset in the shared range (PyTorch's
    ``ShareableHandle::offset``)."""
    lib = _load()
    if not hasattr(lib, "vmmalloc_ipc_export_torch"):
        raise VmmallocError(f"{_lib.library_path()} lacks vmmalloc_ipc_export_torch (rebuild it)")
    major, minor = _torch_version(torch_version)
    n, off = ctypes.c_size_t(0), ctypes.c_size_t(0)
    call = "vmmalloc_ipc_export_torch"
    _lib._check(lib.vmmalloc_ipc_export_torch(_ptr(ptr), major, minor, None, 0, ctypes.byref(n),
                                              ctypes.byref(off)), call)
    buf = ctypes.create_string_buffer(n.value)
    _lib._check(lib.vmmalloc_ipc_export_torch(_ptr(ptr), major, minor, buf, n.value, ctypes.byref(n),
                                              ctypes.byref(off)), call)
    return buf.raw[: n.value], off.value


def ipc_import(handle, device=None):
    """Maps the memory ``handle`` names; returns the pointer (an int).
    Release it with ipc_close.

    ``handle`` is a vmmalloc handle (ipc_export in another process) or
    PyTorch's own expandable-segments handle (the bytes of
    ``storage._share_cuda_()[1]``; the pointer is then the start of the
    shared range: add PyTorch's offset, ``_share_cuda_()[3]``). ``device``:
    the ordinal to map on (default: the producer's for a vmmalloc handle, 0
    for a PyTorch one)."""
    if not isinstance(handle, (bytes, bytearray)):
        raise TypeError(f"an IPC handle is bytes, not {type(handle).__name__}")
    out = ctypes.c_void_p()
    data = bytes(handle)
    dev = -1 if device is None else int(device)
    _lib._check(
        _load().vmmalloc_ipc_import_device(data, len(data), dev, ctypes.byref(out)),
        "vmmalloc_ipc_import_device",
    )
    return out.value


def ipc_close(ptr, stream=None):
    """Unmaps what ipc_import mapped at ``ptr`` once the work queued on
    ``stream`` (a CUstream as an int; None: the legacy default stream) is
    done: an event there, not a device-wide synchronize."""
    lib = _load()
    if stream is not None and hasattr(lib, "vmmalloc_ipc_close_on"):
        _lib._check(lib.vmmalloc_ipc_close_on(_ptr(ptr), ctypes.c_void_p(int(stream))),
                    "vmmalloc_ipc_close_on")
        return
    _lib._check(lib.vmmalloc_ipc_close(_ptr(ptr)), "vmmalloc_ipc_close")
