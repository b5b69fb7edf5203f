"""Growable tensors and the memory-pressure callback (ctypes over libvmmalloc.so).

``vmmalloc.growable(max_bytes, dtype, device)`` reserves ``max_bytes`` of
address space once; ``resize(n)`` maps or unmaps whole physical chunks at the
end, so the data in the first part stays where it is and the address never
moves (docs/expandable.md, "Growable regions"). The object exposes
``__cuda_array_interface__`` (version 3) for its current size, and
``tensor()`` returns a ``torch.Tensor`` view of it without a copy. A view
taken before a shrink must not be used past the new end: take a new view
after each resize.

``vmmalloc.on_memory_pressure(fn)`` registers ``fn(size, device) -> bytes
freed``; it is called, without the allocator's lock, when an allocation or a
growth fails with out-of-memory, and the operation is retried once if it
freed something. Never recursive, never during CUDA graph capture. A callback
that raises counts as having freed nothing: the allocation fails as it would
have, and the exception is attached to the error raised by ``resize``.
"""

import ctypes
import threading
import warnings

from ._lib import VmmallocError, declare, last_error, load

# Python/NumPy typestr per dtype name (the __cuda_array_interface__ spec,
# numba.readthedocs.io "CUDA Array Interface (Version 3)"). bfloat16 has no
# typestr: it is exposed as int16 and viewed as bfloat16 by tensor().
_TYPESTR = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<i2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1", "uint8": "|u1", "bool": "|b1",
}
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}

_declared = False
_decl_lock = threading.Lock()


def _lib():
    global _declared
    lib = load()
    if not _declared:
        with _decl_lock:
            c_int, c_size_t, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
            size_p = ctypes.POINTER(c_size_t)
            declare(lib, [
                ("vmmalloc_growable_create", c_void_p, [c_int, c_size_t]),
                ("vmmalloc_growable_resize", c_int, [c_void_p, c_size_t]),
                ("vmmalloc_growable_destroy", c_int, [c_void_p]),
                ("vmmalloc_growable_info", c_int, [c_void_p, size_p, size_p, size_p]),
                ("vmmalloc_set_pressure_callback", c_int, [PRESSURE_FN]),
            ])
            _declared = True
    return lib


def _dtype_name(dtype):
    """'float32' for torch.float32, 'float32', numpy.float32 ..."""
    name = str(dtype)
    for prefix in ("torch.", "<class 'numpy.", "numpy."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.rstrip("'>")
    if name not in _TYPESTR:
        raise VmmallocError(f"growable: unsupported dtype {dtype!r}; supported: {', '.join(_TYPESTR)}")
    return name


class GrowableTensor:
    """A 1-D device buffer of up to ``max_bytes`` that grows and shrinks in
    place (see the module's doc). ``len()``/``numel`` is its current length in
    elements; ``resize(n)`` sets it."""

    def __init__(self, max_bytes, dtype="float32", device=0):
        self.dtype = _dtype_name(dtype)
        self.itemsize = _ITEMSIZE[self.dtype]
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise VmmallocError(f"growable: max_bytes must be a positive int, not {max_bytes!r}")
        self.device = int(device)
        self.max_bytes = max_bytes
        self.numel = 0
        ptr = _lib().vmmalloc_growable_create(self.device, max_bytes)
        if not ptr:
            raise VmmallocError(last_error() or "vmmalloc_growable_create failed")
        self.ptr = ptr

    @property
    def max_numel(self):
        """The most elements it can hold."""
        return self.max_bytes // self.itemsize

    @property
    def nbytes(self):
        return self.numel * self.itemsize

    def __len__(self):
        return self.numel

    def _live(self):
        if self.ptr is None:
            raise VmmallocError("growable: the region was destroyed")

    def resize(self, n):
        """Makes it ``n`` elements long (0 ≤ n ≤ max_numel). Growing maps
        memory (may call the pressure callback); shrinking waits for the
        default stream. On failure the old length stays and VmmallocError is
        raised (``MemoryError`` is its ``__cause__`` on out-of-memory)."""
        self._live()
        if not isinstance(n, int) or n < 0:
            raise VmmallocError(f"growable: resize({n!r}): the length must be an int ≥ 0")
        if n > self.max_numel:
            raise VmmallocError(
                f"growable: resize({n}) is beyond max_bytes ({self.max_bytes} bytes = {self.max_numel} "
                f"{self.dtype} elements)")
        _tls.error = None
        rc = _lib().vmmalloc_growable_resize(self.ptr, n * self.itemsize)
        if rc != 0:
            msg = last_error() or "vmmalloc_growable_resize failed"
            cause = getattr(_tls, "error", None) or (MemoryError(msg) if rc == 1 else None)
            _tls.error = None
            raise VmmallocError(msg) from cause
        self.numel = n
        return self

    def info(self):
        """{'size', 'max_bytes', 'mapped'} in bytes, from the library."""
        self._live()
        s, m, x = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        if _lib().vmmalloc_growable_info(self.ptr, ctypes.byref(s), ctypes.byref(m), ctypes.byref(x)) != 0:
            raise VmmallocError(last_error() or "vmmalloc_growable_info failed")
        return {"size": s.value, "max_bytes": m.value, "mapped": x.value}

    @property
    def __cuda_array_interface__(self):
        self._live()
        return {
            "shape": (self.numel,),
            "typestr": _TYPESTR[self.dtype],
            # An empty array may have a null pointer (spec); ours is always the region.
            "data": (self.ptr if self.numel else 0, False),
            "version": 3,
            "strides": None,
            # Work is ordered on the default stream (the spec's "stream": 1 = legacy default).
            "stream": 1,
        }

    def tensor(self):
        """A ``torch.Tensor`` on ``cuda:<device>`` viewing the current length, no copy."""
        import torch

        t = torch.as_tensor(self, device=f"cuda:{self.device}")
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t

    def destroy(self):
        """Unmaps and unreserves the region. Raises on a second call."""
        self._live()
        if _lib().vmmalloc_growable_destroy(self.ptr) != 0:
            raise VmmallocError(last_error() or "vmmalloc_growable_destroy failed")
        self.ptr, self.numel = None, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.ptr is not None:
            self.destroy()

    def __del__(self):
        if getattr(self, "ptr", None) is not None:
            try:
                self.destroy()
            except Exception:  # interpreter shutdown, library gone: nothing to do
                pass

    def __repr__(self):
        return (f"GrowableTensor(ptr={self.ptr and hex(self.ptr)}, numel={self.numel}, dtype={self.dtype}, "
                f"max_bytes={self.max_bytes}, device={self.device})")


def growable(max_bytes, dtype="float32", device=0):
    """A :class:`GrowableTensor` of up to ``max_bytes`` (length 0 at first)."""
    return GrowableTensor(max_bytes, dtype=dtype, device=device)


PRESSURE_FN = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
_callback = None  # the ctypes thunk: kept alive while registered
_tls = threading.local()  # .error: the exception the callback raised on this thread's last call


def on_memory_pressure(fn):
    """Registers ``fn(size, device) -> bytes freed`` (None clears it); returns
    ``fn``, so it works as a decorator. See the module's doc for the rules."""
    global _callback
    if fn is None:
        _lib().vmmalloc_set_pressure_callback(PRESSURE_FN())
        _callback = None
        return None
    if not callable(fn):
        raise VmmallocError(f"on_memory_pressure: {fn!r} is not callable")

    def thunk(size, device):
        try:
            freed = fn(size, device)
            return max(0, int(freed or 0))
        except BaseException as e:  # never let an exception cross the C ABI
            _tls.error = e
            warnings.warn(f"vmmalloc: the memory-pressure callback raised {e!r}; counted as freeing nothing")
            return 0

    c = PRESSURE_FN(thunk)
    _lib().vmmalloc_set_pressure_callback(c)
    _callback = c
    return fn
