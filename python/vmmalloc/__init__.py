"""vmmalloc for PyTorch: a GPU memory allocator on the CUDA virtual-memory API.

Quick start::

    import vmmalloc
    vmmalloc.enable()            # before the first CUDA tensor; VMMALLOC_CONF configures it
    import torch; x = torch.empty(1 << 30, device="cuda")

or, without touching the script: ``python -m vmmalloc train.py --args``.

``enable()`` needs PyTorch; everything else here talks to libvmmalloc.so
through ctypes and works without it (PyTorch's own memory_stats(),
memory_summary() and _dump_snapshot() raise under a pluggable allocator, so use
these instead).
"""

import warnings

from ._lib import (
    VmmallocError,
    check_config,
    configure,
    dump_snapshot,
    empty_cache,
    find_library,
    last_error,
    library_path,
    load,
    memory_stats,
    memory_summary,
    reset_peak_memory_stats,
    validate,
    version,
)
from . import _lib

__all__ = [
    "VmmallocError",
    "check_config",
    "configure",
    "dump_snapshot",
    "empty_cache",
    "enable",
    "find_library",
    "is_enabled",
    "last_error",
    "library_path",
    "memory_stats",
    "memory_summary",
    "reset_peak_memory_stats",
    "validate",
    "version",
]

__version__ = "0.1.0"

# PyTorch's hook setters on the allocator object (torch/csrc/cuda/Module.cpp)
# and the library functions they take.
HOOKS = (
    ("set_init_fn", "vmmalloc_init"),
    ("set_reset_fn", "vmmalloc_empty_cache"),
    ("set_memory_fraction_fn", "vmmalloc_set_memory_fraction"),
    ("set_record_stream_fn", "vmmalloc_record_stream"),
)

_allocator = None
_enabled_conf = None


def is_enabled():
    """Whether enable() installed vmmalloc as PyTorch's CUDA allocator."""
    return _allocator is not None


def enable(conf=None):
    """Makes vmmalloc PyTorch's CUDA allocator. Call it before CUDA is used.

    ``conf`` (VMMALLOC_CONF syntax, e.g. ``"backend:expandable,log:info"``)
    replaces the environment variable; ``None`` reads ``VMMALLOC_CONF``. A bad
    configuration raises VmmallocError naming the key. Calling it again with
    the same ``conf`` does nothing. Returns the
    ``torch.cuda.memory.CUDAPluggableAllocator``.
    """
    global _allocator, _enabled_conf
    try:
        import torch
    except ImportError as e:
        raise VmmallocError("vmmalloc.enable() needs PyTorch (import torch failed: %s)" % e) from e
    if _allocator is not None:
        if conf is not None and conf != _enabled_conf:
            raise VmmallocError(
                f"vmmalloc is already enabled with conf={_enabled_conf!r}; it cannot be reconfigured to {conf!r}")
        return _allocator
    if torch.cuda.is_initialized():
        raise VmmallocError(
            "CUDA is already initialised, so PyTorch's allocator cannot be replaced any more: call "
            "vmmalloc.enable() before the first CUDA tensor or torch.cuda call, or start the program "
            "with `python -m vmmalloc script.py`")
    path = library_path()
    load(path)
    if conf is not None:
        configure(conf)
    check_config()
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    pluggable = CUDAPluggableAllocator(path, "vmmalloc_malloc", "vmmalloc_free")
    native = pluggable.allocator()
    for setter, fn in HOOKS:
        set_fn = getattr(native, setter, None)
        if set_fn is None:
            warnings.warn(f"this PyTorch has no CUDAPluggableAllocator.{setter}; {fn} is not hooked up")
            continue
        set_fn(_lib.function_pointer(fn))
    try:
        change_current_allocator(pluggable)
    except RuntimeError as e:
        raise VmmallocError(
            f"PyTorch refused the allocator ({e}); its CUDA allocator was already used: call "
            "vmmalloc.enable() before the first CUDA tensor") from e
    _allocator, _enabled_conf = pluggable, conf
    return pluggable
