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
"""

import ctypes

from . import _lib

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


def ipc_close(ptr):
    """Unmaps what ipc_import mapped at ``ptr`` (after the device's queued work)."""
    _lib._check(_load().vmmalloc_ipc_close(_ptr(ptr)), "vmmalloc_ipc_close")
