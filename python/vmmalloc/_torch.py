"""What enable() changes in torch: the pluggable allocator's hooks, and
torch.cuda's memory functions answering from vmmalloc.

Under a pluggable allocator PyTorch's own ``memory_stats()`` (hence
``memory_allocated()`` and the rest), ``reset_peak_memory_stats()``,
``memory._snapshot()`` raise: ``CUDAPluggableAllocator::getDeviceStats``,
``resetPeakStats`` and ``snapshot`` are ``TORCH_CHECK(false, "CUDAPluggableAllocator
does not yet support ...")`` (torch/csrc/cuda/CUDAPluggableAllocator.cpp). So
enable() replaces these functions, in ``torch.cuda`` and ``torch.cuda.memory``
alike, by ones that read vmmalloc's figures (same keys, same meanings).
"""

import os
import sys
import pickle
import tempfile
from collections import OrderedDict

from . import _lib

# PyTorch's hook setters on the pluggable allocator object (pybind methods in
# torch/csrc/cuda/Module.cpp, each taking a function address) and our
# functions. The graph hooks have C++ signatures (the begin hook receives a
# std::function filter), so they live in the library's C++ shim.
HOOKS = (
    ("set_init_fn", "vmmalloc_init"),
    ("set_reset_fn", "vmmalloc_empty_cache"),
    ("set_memory_fraction_fn", "vmmalloc_set_memory_fraction"),
    ("set_record_stream_fn", "vmmalloc_record_stream"),
)
GRAPH_HOOKS = (
    ("set_begin_allocate_to_pool", "vmmalloc_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "vmmalloc_end_allocate_to_pool"),
    ("set_release_pool", "vmmalloc_release_pool"),
)

# The functions enable() replaces, in torch.cuda.memory and torch.cuda.
PATCHED = (
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "memory_summary",
    "_snapshot",
    "_dump_snapshot",
)

# What the functions were before enable(), by (module name, function name).
originals = {}


def _device_index(device):
    import torch

    if device is None:
        return torch.cuda.current_device()
    return torch.cuda._get_device_index(device, optional=True)


def memory_stats(device=None):
    """torch.cuda.memory_stats(): PyTorch's keys (sorted, as PyTorch returns
    them) plus vmmalloc's, from vmmalloc."""
    from . import _companion

    index = _device_index(device)
    stats = _companion.add_pool_figures(_lib.memory_stats(index), index)  # MemPool(allocator=...)
    # From 2.12 PyTorch counts the allocations its out-of-memory preemption
    # (throw_on_cudamalloc_oom with a memory fraction) rejected
    # (c10/core/CachingDeviceAllocator.h num_oom_rejections); vmmalloc has no
    # such policy and rejects none (issue 40).
    # A stand-in torch module without __version__ (tests, a partial import)
    # gets no version-dependent keys.
    version = getattr(sys.modules.get("torch"), "__version__", None)
    if version and _companion.version_tuple(version) >= (2, 12):
        stats.setdefault("num_oom_rejections", 0)
    # From 2.13 the bytes reserved in each private pool
    # (DeviceStats::reserved_bytes_by_private_pools), flattened as PyTorch's
    # memory_stats() flattens them ((0, 1) -> "0_1"). With the companion
    # they come from its getDeviceStats, which adds the pools with their own
    # allocator to libvmmalloc's; before 2.13 PyTorch has no such key.
    if version and _companion.version_tuple(version) >= (2, 13):
        by_pool = _companion.private_pool_figures(index)
        if by_pool is not None:
            stats = {k: v for k, v in stats.items() if not k.startswith(_PRIVATE_POOLS)}
            stats.update(by_pool)
    else:
        stats = {k: v for k, v in stats.items() if not k.startswith(_PRIVATE_POOLS)}
    return OrderedDict(sorted(stats.items()))


_PRIVATE_POOLS = "reserved_bytes_by_private_pools."


def _pool_key(text):
    """``"0_1"`` -> ``(0, 1)``: the pool ids of memory_stats_as_nested_dict
    are tuples, as PyTorch's."""
    try:
        return tuple(int(x) for x in text.split("_"))
    except ValueError:
        return text


def memory_stats_as_nested_dict(device=None):
    """torch.cuda.memory_stats_as_nested_dict(), from vmmalloc."""
    nested = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        if key.startswith(_PRIVATE_POOLS) and len(path) > 1:
            path[1] = _pool_key(path[1])
        d = nested
        for p in path:
            d = d.setdefault(p, {})
        if isinstance(d, dict):
            d[last] = value
    return nested


def _stat(key, device):
    return memory_stats(device).get(key, 0)


def memory_allocated(device=None):
    """torch.cuda.memory_allocated(): bytes in live allocations."""
    return _stat("allocated_bytes.all.current", device)


def max_memory_allocated(device=None):
    """torch.cuda.max_memory_allocated(): peak of memory_allocated()."""
    return _stat("allocated_bytes.all.peak", device)


def memory_reserved(device=None):
    """torch.cuda.memory_reserved(): bytes the allocator holds on the device."""
    return _stat("reserved_bytes.all.current", device)


def max_memory_reserved(device=None):
    """torch.cuda.max_memory_reserved(): peak of memory_reserved()."""
    return _stat("reserved_bytes.all.peak", device)


def reset_peak_memory_stats(device=None):
    """torch.cuda.reset_peak_memory_stats()."""
    from . import _companion

    index = _device_index(device)
    _lib.reset_peak_memory_stats(index)
    _companion.reset_pool_peaks(index)


def memory_summary(device=None, abbreviated=False):
    """torch.cuda.memory_summary(): PyTorch's table plus vmmalloc's rows
    (``abbreviated`` is accepted; the table is always complete)."""
    return _lib.memory_summary(_device_index(device))


def _snapshot(device=None, augment_with_fx_traces=False):
    """torch.cuda.memory._snapshot(): every device's segments and history,
    in PyTorch's snapshot schema (``device`` is accepted, as PyTorch's is)."""
    fd, path = tempfile.mkstemp(suffix=".pickle", prefix="vmmalloc-snapshot-")
    os.close(fd)
    try:
        _lib.dump_snapshot(path)
        with open(path, "rb") as f:
            return pickle.load(f)
    finally:
        os.unlink(path)


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    """torch.cuda.memory._dump_snapshot(): the snapshot pickle, written by vmmalloc."""
    _lib.dump_snapshot(filename)


# PyTorch's own snapshot functions work under the torch companion (its
# snapshot() and recordHistory() answer them, with PyTorch's stack frames and
# trace entries), so enable() replaces these only without it.
SNAPSHOT_FUNCTIONS = ("_snapshot", "_dump_snapshot")


def patch_memory_functions(torch, companion_snapshots=False):
    """Makes torch.cuda's memory functions answer from vmmalloc (both
    ``torch.cuda.X`` and ``torch.cuda.memory.X``); with
    ``companion_snapshots`` (the torch companion answers snapshot() and
    recordHistory()) PyTorch's own ``_snapshot`` and ``_dump_snapshot`` stay.
    Returns the names patched."""
    ours = globals()
    done = []
    for module in (torch.cuda.memory, torch.cuda):
        for name in PATCHED:
            if companion_snapshots and name in SNAPSHOT_FUNCTIONS:
                continue
            if not hasattr(module, name) and module is torch.cuda:
                continue  # private names live in torch.cuda.memory only
            originals.setdefault((module.__name__, name), getattr(module, name, None))
            setattr(module, name, ours[name])
            done.append(f"{module.__name__}.{name}")
    return done


# torch.accelerator's memory functions (PyTorch 2.9+, torch/accelerator/memory.py)
# reach the allocator through torch._C._accelerator_*, i.e.
# at::getDeviceAllocator(CUDA) = c10::GetAllocator(CUDA): the allocator
# registered with c10::SetAllocator, which is PyTorch's own caching allocator
# (c10/cuda/CUDACachingAllocator.cpp registers it at start-up), not the one
# CUDAPluggableAllocator's changeCurrentAllocator installs (that one stores
# CUDACachingAllocator::allocator only). Under vmmalloc that native allocator
# is never initialised, so memory_stats() returns {} and every figure built on
# it 0, and empty_cache()/reset_*() do nothing. These answer from
# torch.cuda's functions instead (issue 40 item 4); memory_allocated,
# max_memory_allocated, memory_reserved and max_memory_reserved read
# memory_stats through the module, so they follow.
ACCELERATOR_PATCHED = {
    "memory_stats": "memory_stats",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
    "reset_accumulated_memory_stats": "reset_accumulated_memory_stats",
    "empty_cache": "empty_cache",
}


def patch_accelerator_functions(torch):
    """Makes torch.accelerator's memory functions (``torch.accelerator.X``
    and ``torch.accelerator.memory.X``) answer from ``torch.cuda.X`` when the
    accelerator is CUDA; nothing on a PyTorch without them (before 2.9).
    Returns the names patched."""
    accelerator = getattr(torch, "accelerator", None)
    memory = getattr(accelerator, "memory", None)
    if memory is None or not hasattr(memory, "memory_stats"):
        return []
    try:
        current = torch._C._accelerator_getAccelerator()
    except (AttributeError, RuntimeError):
        return []
    if current is None or current.type != "cuda":
        return []

    def route(cuda_name):
        def through_cuda(device_index=None, /):
            return getattr(torch.cuda, cuda_name)(device_index)
        through_cuda.__name__ = cuda_name
        through_cuda.__doc__ = f"torch.cuda.{cuda_name} (vmmalloc: torch.accelerator reads PyTorch's own allocator)"
        return through_cuda

    done = []
    for name, cuda_name in ACCELERATOR_PATCHED.items():
        if cuda_name == "empty_cache":  # takes no device, as torch.cuda.empty_cache
            def fn():
                return torch.cuda.empty_cache()
            fn.__doc__ = "torch.cuda.empty_cache (vmmalloc: torch.accelerator reads PyTorch's own allocator)"
        else:
            fn = route(cuda_name)
        for module in (memory, accelerator):
            if hasattr(module, name):
                originals.setdefault((module.__name__, name), getattr(module, name))
                setattr(module, name, fn)
                done.append(f"{module.__name__}.{name}")
    return done


def install_hooks(native, warn):
    """Installs every hook the pluggable allocator object has; warns (once
    each) about those this PyTorch lacks. Returns the setters used."""
    used = []
    for setter, fn in HOOKS + GRAPH_HOOKS:
        set_fn = getattr(native, setter, None)
        if set_fn is None:
            warn(f"this PyTorch has no CUDAPluggableAllocator.{setter}; {fn} is not hooked up"
                 + (" (CUDA graphs will fail)" if (setter, fn) in GRAPH_HOOKS else ""))
            continue
        set_fn(_lib.function_pointer(fn))
        used.append(setter)
    return used


# ProcessGroupNCCL's register hook (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):
# it attaches an allocator trace tracker and registers with NCCL the memory of
# each SEGMENT_ALLOC entry until its SEGMENT_FREE. The torch companion serves
# it (issue 43): libvmmalloc follows each run of mapped memory and the
# companion hands the trackers a SEGMENT_ALLOC when one appears and a
# SEGMENT_FREE before any of it is unmapped or moved. Without the companion
# (the plain pluggable allocator has no trackers) or with nccl_register:False
# the hook is turned off instead (collectives stay correct; NCCL copies
# through its own buffers instead of registered memory).
NCCL_HOOK_ENV = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


def start_conf_history(torch, conf=None, warn=None):
    """``record_history:True`` in the configuration (``conf``, else the one
    in effect: VMMALLOC_CONF) starts PyTorch's recording as
    ``torch.cuda.memory._record_memory_history(max_entries=N)`` does, N being
    the configuration's ``max_entries``, when the torch companion records
    history: its ring (with stack frames) is what ``torch.cuda.memory._snapshot()``
    reads, not vmmalloc's own (issue 40). PyTorch's other defaults
    (enabled/context/stacks "all") are kept, as a bare call keeps them
    (torch/cuda/memory.py, _record_memory_history_impl). Returns True when it
    started recording. PyTorch's call initialises CUDA; where that fails (no
    GPU) it warns (through ``warn``) and vmmalloc runs without the history."""
    from . import _companion, _lib

    settings = _lib.config(conf)
    if str(settings.get("record_history")) != "True" or not _companion.snapshots_supported():
        return False
    try:
        torch.cuda.memory._record_memory_history(max_entries=int(settings["max_entries"]))
    except RuntimeError as e:
        if warn is None:
            raise
        warn(f"vmmalloc: record_history:True could not start PyTorch's memory history ({e})")
        return False
    return True


def nccl_register_hook(warn, served, conf=None, env=None):
    """Leaves NCCL's register hook on where vmmalloc serves it (``served``:
    the torch companion is installed; ``nccl_register`` not False in
    ``conf``, else the configuration in effect), and otherwise turns it off
    if it was asked for (PyTorch reads the variable when a NCCL process
    group is created), with a warning naming the variable and why. Returns
    "off" (turned off), "served" (left on) or "" (not asked for)."""
    from . import _lib

    env = os.environ if env is None else env
    value = env.get(NCCL_HOOK_ENV, "")
    if value.strip().lower() not in ("1", "true", "yes", "on", "y"):
        return ""
    wanted = str(_lib.config(conf).get("nccl_register", "True")) != "False"
    if wanted and served:
        return "served"
    why = ("nccl_register:False is set in VMMALLOC_CONF" if not wanted else
           "the torch companion is not installed (the plain pluggable allocator cannot pass segment "
           "entries to NCCL's trace tracker)")
    env[NCCL_HOOK_ENV] = "0"
    warn(f"vmmalloc: {NCCL_HOOK_ENV}={value} is turned off (set to 0): {why}. NCCL collectives work "
         f"unchanged, without registered (zero-copy) buffers; see docs/pytorch.md, 'NCCL'.")
    return "off"


def install_allocator(torch, path, warn):
    """Makes vmmalloc PyTorch's CUDA allocator: the torch companion's
    CUDAPluggableAllocator subclass if it can be built and loaded (every
    feature of ``_companion.FEATURES``), else the plain pluggable allocator
    with every hook this PyTorch has, warning which features that loses.
    Returns (allocator object, the features lost). Raises RuntimeError from
    PyTorch when its allocator was already used."""
    from . import _companion

    ok, why = _companion.install_allocator(torch, path)
    if ok:
        lost = _companion.lost_features(True)
        if lost:
            warn("vmmalloc: this PyTorch's allocator interface lacks methods the torch companion implements; "
                 "not available: " + "; ".join(lost))
        absent = _companion.absent_warning(torch.__version__)  # an older PyTorch: issue 40
        if absent:
            warn(absent)
        return torch.cuda.memory._get_current_allocator(), lost
    if "already initialized" in why or "Can't swap" in why:
        raise RuntimeError(why)
    from torch.cuda.memory import CUDAPluggableAllocator, change_current_allocator

    pluggable = CUDAPluggableAllocator(path, "vmmalloc_malloc", "vmmalloc_free")
    install_hooks(pluggable.allocator(), warn)
    change_current_allocator(pluggable)
    lost = _companion.lost_features(False)
    warn(f"vmmalloc: the torch companion is unavailable ({why.splitlines()[0] if why else 'unknown'}), so "
         f"vmmalloc runs as PyTorch's plain pluggable allocator, without: " + "; ".join(lost))
    return pluggable, lost
