"""vmmalloc for PyTorch: a GPU memory allocator on the CUDA virtual-memory API.

Quick start::

    import vmmalloc
    vmmalloc.enable()            # before the first CUDA tensor; VMMALLOC_CONF configures it
    import torch; x = torch.empty(1 << 30, device="cuda")

or, without touching the script: ``python -m vmmalloc train.py --args``.

``enable()`` needs PyTorch; everything else here talks to libvmmalloc.so
through ctypes and works without it. After ``enable()``, torch.cuda's memory
functions (``memory_allocated``, ``memory_stats``, ``memory_summary``,
``memory._snapshot`` ...) answer from vmmalloc, and an out-of-memory raises
``torch.cuda.OutOfMemoryError`` (or ``RuntimeError`` without the torch
companion) whose message starts with "CUDA out of memory.".
"""

import os
import warnings

from . import _companion, _torch
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
    pool_memory_stats,
    reset_peak_memory_stats,
    validate,
    version,
)
from ._check import check
from ._sleep import get_tag, pause, pause_pool, region, resume, resume_pool, set_tag, tag_stats
from ._ipc import ipc_close, ipc_export, ipc_export_torch, ipc_import
from . import _lib
from ._growable import GrowableTensor, growable, on_memory_pressure
from ._region import get_region, regions
from ._share import share_info, share_set_cap, share_set_total

__all__ = [
    "VmmallocError",
    "check",
    "check_config",
    "configure",
    "dump_snapshot",
    "empty_cache",
    "enable",
    "find_library",
    "growable",
    "GrowableTensor",
    "on_memory_pressure",
    "is_enabled",
    "oom_exception",
    "last_error",
    "library_path",
    "memory_stats",
    "memory_summary",
    "pool_memory_stats",
    "reset_peak_memory_stats",
    "validate",
    "version",
    # Sleep and wake (_sleep.py)
    "get_tag",
    "pause",
    "pause_pool",
    "region",
    "resume",
    "resume_pool",
    "set_tag",
    "tag_stats",
    # Region mode (_region.py)
    "get_region",
    "regions",
    # IPC without PyTorch (_ipc.py)
    "ipc_close",
    "ipc_export",
    "ipc_export_torch",
    "ipc_import",
    # A budget shared by processes on one GPU (_share.py)
    "share_info",
    "share_set_cap",
    "share_set_total",
]

__version__ = "0.1.0"

# PyTorch's hook setters on the allocator object (torch/csrc/cuda/Module.cpp)
# and the library functions they take.
HOOKS = _torch.HOOKS + _torch.GRAPH_HOOKS

_allocator = None
_enabled_conf = None
# What an out-of-memory raises in Python, and why (see oom_exception()).
_oom = (None, None)


def oom_exception():
    """(exception type name, reason) an out-of-memory raises since enable():
    ``torch.cuda.OutOfMemoryError`` with the torch companion, else
    ``RuntimeError``; (None, None) before enable()."""
    return _oom


def _no_gpu_warning(torch, conf):
    """The warning for ``device:cuda`` (the default) on a machine where
    PyTorch sees no CUDA GPU, or None. The device is the library's reading of
    the configuration (``conf``, else the one in effect), never Python's."""
    try:
        device = _lib.config(conf)["device"]
    except VmmallocError:
        return None  # a bad configuration is reported where it is used
    available = getattr(getattr(torch, "cuda", None), "is_available", None)
    if available is None or available():
        return None
    from ._check import CPU_HINT
    if device == "host":
        # device:host backs vmmalloc's own memory with CPU memory; PyTorch's
        # CUDA tensors still go to a GPU (and fail: "Found no NVIDIA driver").
        return ("vmmalloc: enabled with device:host, but PyTorch sees no CUDA device here "
                "(torch.cuda.is_available() is False): device:host gives vmmalloc's own allocations CPU "
                "memory, it does not make tensors with device=\"cuda\" run on the CPU, so a script that "
                f"makes them fails in PyTorch (\"Found no NVIDIA driver\"). {CPU_HINT[0].upper()}{CPU_HINT[1:]}.")
    if device != "cuda":
        return None
    return ("vmmalloc: enabled with device:cuda, but PyTorch sees no CUDA GPU (torch.cuda.is_available() is "
            "False), so no tensor will be allocated through vmmalloc. On a GPU machine check the driver "
            f"with `python -m vmmalloc --check`; {CPU_HINT}.")


_VMMALLOC_BACKENDS = ("expandable", "caching", "torch-es", "native")


def _pytorch_conf_warning(env=None):
    """The warning for a set ``PYTORCH_CUDA_ALLOC_CONF``, which vmmalloc does
    not read (it replaces the allocator that reads it), with the
    ``VMMALLOC_CONF`` line that asks for the same thing where there is one;
    None if it is unset."""
    env = os.environ if env is None else env
    text = env.get("PYTORCH_CUDA_ALLOC_CONF", "").strip()
    if not text:
        return None
    # The library reads the line (one reader of both variables, issue 36).
    line = _lib.pytorch_conf_line(text)
    hint = f" To ask vmmalloc for the same, set VMMALLOC_CONF={line}" if line else ""
    return (f"vmmalloc: PYTORCH_CUDA_ALLOC_CONF={text!r} is ignored: vmmalloc replaces PyTorch's CUDA allocator, "
            f"which reads it, and is configured by VMMALLOC_CONF (same key:value syntax; backend: "
            f"{', '.join(_VMMALLOC_BACKENDS)}; PyTorch's backend:native is vmmalloc's backend:caching).{hint}")


def is_enabled():
    """Whether enable() installed vmmalloc as PyTorch's CUDA allocator."""
    return _allocator is not None


def enable(conf=None):
    """Makes vmmalloc PyTorch's CUDA allocator. Call it before CUDA is used.

    ``conf`` (VMMALLOC_CONF syntax, e.g. ``"backend:expandable,log:info"``)
    replaces the environment variable; ``None`` reads ``VMMALLOC_CONF``. A bad
    configuration raises VmmallocError naming the key. Calling it again with
    the same ``conf`` does nothing. Returns the allocator object installed.

    It installs the torch companion (``_companion``: a C++ subclass of
    PyTorch's CUDAPluggableAllocator answering CUDA graph trees, MemPools,
    snapshot() and statistics from vmmalloc, built once per PyTorch version),
    or, where it cannot be built or loaded, the plain pluggable allocator with
    every hook this PyTorch has (init, empty_cache, memory fraction,
    record_stream, and the CUDA graph pool hooks), warning which features that
    loses. It serves NCCL's register hook
    (``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK``, ``register_mem_pool``)
    through the companion, and turns the hook off (with a warning) without
    the companion or with ``nccl_register:False``; it
    makes torch.cuda's memory functions answer from vmmalloc, and registers the
    torch companion (built once per PyTorch version, see ``_companion``) so that
    out-of-memory raises ``torch.cuda.OutOfMemoryError``; without it, a
    ``RuntimeError`` (said once, as a warning).

    It also warns when ``PYTORCH_CUDA_ALLOC_CONF`` is set (vmmalloc does not
    read it; the warning gives the ``VMMALLOC_CONF`` line that asks for the
    same) and when PyTorch sees no GPU (``torch.cuda.is_available()``
    False): with ``device:cuda`` nothing will be allocated through vmmalloc,
    and with ``device:host`` PyTorch's own CUDA tensors still need a GPU;
    both say what runs without one.
    """
    global _allocator, _enabled_conf, _oom
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
    _lib.check_version(__version__)
    if conf is not None:
        configure(conf)
    check_config()
    try:
        allocator, _ = _torch.install_allocator(torch, path, warnings.warn)
    except RuntimeError as e:
        raise VmmallocError(
            f"PyTorch refused the allocator ({e}); its CUDA allocator was already used: call "
            "vmmalloc.enable() before the first CUDA tensor") from e
    _allocator, _enabled_conf = allocator, conf
    _torch.nccl_register_hook(warnings.warn, served=_companion.installed(), conf=conf)
    for message in (_pytorch_conf_warning(), _no_gpu_warning(torch, conf)):
        if message:
            warnings.warn(message, stacklevel=2)
    _torch.patch_memory_functions(torch, companion_snapshots=_companion.snapshots_supported())
    _torch.patch_accelerator_functions(torch)  # torch.accelerator.memory_stats & co. (2.9+)
    _oom = _companion.install(torch)
    _torch.start_conf_history(torch, warn=warnings.warn)  # record_history:True reaches torch.cuda.memory._snapshot()
    if _oom[0] != "torch.cuda.OutOfMemoryError":
        warnings.warn(f"vmmalloc: out-of-memory raises RuntimeError, not torch.cuda.OutOfMemoryError "
                      f"(the torch companion is unavailable: {_oom[1]}); its message starts with "
                      f"'CUDA out of memory.' either way")
    return allocator
