"""The torch companion: vmmalloc's C++ subclass of PyTorch's
``CUDAPluggableAllocator`` (source: ``companion/vmmalloc_torch.cpp``), built
against the installed PyTorch and made its current CUDA allocator by enable().

The plain pluggable allocator implements malloc/free and eight hooks and
raises for the rest (torch/csrc/cuda/CUDAPluggableAllocator.cpp). The
companion answers the rest from libvmmalloc's C ABI: CUDA graph trees
(``torch.compile(mode="reduce-overhead")``: pool live-allocation checks,
checkpoint and restore), ``torch.cuda.MemPool`` (pool use counts),
``snapshot()`` (NCCL's ``initNCCLComm``), ``getDeviceStats``,
``resetPeakStats``, out-of-memory observers, ``getMemoryFraction``. It also
throws ``c10::OutOfMemoryError``, so that an out-of-memory reaches Python as
``torch.cuda.OutOfMemoryError`` (torch/csrc/Exceptions.h ``CATCH_CORE_ERRORS``).

Subclassing PyTorch's classes and throwing c10 types is only safe from code
compiled against the very PyTorch that is loaded (class layout, std::string
ABI), so the companion is built per PyTorch version, C++ ABI and source,
cached, and checked by version when loaded. A method this PyTorch's interface
lacks (the compiler says it overrides nothing) is left out and reported as a
feature lost. Without the companion (no C++ compiler, no headers,
``VMMALLOC_COMPANION=0``) enable() installs the plain pluggable allocator and
says which features that loses (``FEATURES``).
"""

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from . import _lib

ENV = "VMMALLOC_COMPANION"
CACHE_ENV = "VMMALLOC_CACHE"
# The companion's sources: vmmalloc_torch.cpp, one translation unit that
# #includes the parts beside it (abi.h, history.h, allocator.h,
# entry_points.h). The tests build python/tests/companion_test_harness.cpp
# instead ($VMMALLOC_COMPANION_SOURCE, set by python/tests/conftest.py): it
# #includes vmmalloc_torch.cpp and adds the test-only entry points, which the
# shipped companion does not carry.
COMPANION_DIR = Path(__file__).resolve().parent / "companion"
SOURCE = Path(os.environ.get("VMMALLOC_COMPANION_SOURCE") or COMPANION_DIR / "vmmalloc_torch.cpp")


def source_files(source=None):
    """The files a companion build of `source` (default SOURCE) reads:
    `source` and every part in COMPANION_DIR, and, for a source outside it
    (a patched copy, the test harness), the parts beside that source."""
    source = Path(source or SOURCE)
    dirs = [COMPANION_DIR] if source.parent == COMPANION_DIR else [source.parent, COMPANION_DIR]
    files = [source]
    for d in dirs:
        files += sorted(f for f in d.glob("*") if f.suffix in (".h", ".cpp") and f not in files
                        and (d == COMPANION_DIR or f.suffix == ".h"))
    return files


def source_text(source=None):
    """The text of source_files(source), concatenated."""
    return "\n".join(f.read_text() for f in source_files(source))

# What the companion adds to the plain pluggable allocator, by the C++ method
# that provides it: (method, feature). A feature is lost when its method is
# missing from the companion (left out at build time) or the companion is not
# installed.
FEATURES = (
    ("checkPoolLiveAllocations", "torch.compile(mode='reduce-overhead') (CUDA graph trees: checkPoolLiveAllocations)"),
    ("getCheckpointState", "CUDA graph trees' checkpoints (getCheckpointState)"),
    ("setCheckpointPoolState", "CUDA graph trees' path divergence (setCheckpointPoolState)"),
    ("beginAllocateToPool", "torch.cuda.MemPool and use_mem_pool while vmmalloc is the allocator "
                            "(beginAllocateToPool; the MemPool's own use by createOrIncrefPool from 2.8, "
                            "ensureExistsAndIncrefPool on 2.6 and 2.7)"),
    ("createOrIncrefPool", "torch.cuda.MemPool(allocator=...) routed to its allocator (createOrIncrefPool)"),
    ("setUseOnOOM", "torch.cuda.MemPool(use_on_oom=True) (setUseOnOOM)"),
    ("setNoSplit", "torch.cuda.MemPool(no_split=True) (setNoSplit)"),
    ("getPoolUseCount", "torch.cuda.MemPool.use_count() (getPoolUseCount)"),
    ("snapshot", "snapshot() for NCCL's initNCCLComm / register_mem_pool and MemPool.snapshot()"),
    ("getDeviceStats", "torch._C._cuda_memoryStats (getDeviceStats; torch.cuda.memory_stats is answered anyway)"),
    ("resetPeakStats", "torch._C._cuda_resetPeakMemoryStats (resetPeakStats)"),
    ("resetAccumulatedStats", "torch.cuda.reset_accumulated_memory_stats (resetAccumulatedStats)"),
    ("attachOutOfMemoryObserver", "out-of-memory observers (attachOutOfMemoryObserver)"),
    ("getMemoryFraction", "torch.cuda.get_per_process_memory_fraction (getMemoryFraction)"),
    ("shareIpcHandle", "CUDA tensors through torch.multiprocessing (shareIpcHandle / getIpcDevPtr over "
                       "libvmmalloc's vmmalloc_ipc_* functions)"),
    ("throw_oom", "torch.cuda.OutOfMemoryError on out-of-memory (RuntimeError without the companion)"),
    ("recordHistory", "torch.cuda.memory._record_memory_history: trace entries and stack frames in "
                      "_snapshot()/_dump_snapshot() (recordHistory, isHistoryEnabled)"),
    ("getContextForPointer", "torch.cuda.memory._allocation_traceback (getContextForPointer)"),
    ("cacheInfo", "torch.backends.cudnn.benchmark = True (cacheInfo)"),
    ("recordAnnotation", "record_function annotations in snapshots (recordAnnotation)"),
    ("pushCompileContext", "torch.compile contexts in trace entries (pushCompileContext)"),
    ("setUserMetadata", "torch.cuda.memory._set_memory_metadata (setUserMetadata)"),
    ("annotateMemory", "torch.cuda.memory._annotate_memory (annotateMemory)"),
)

# Methods the companion implements that older PyTorch interfaces do not have
# (c10/cuda/CUDACachingAllocator.h of each version; scripts/companion_matrix.py
# checks every minor version): method -> (major, minor) of the first version
# with it. Under an older PyTorch the feature does not exist there at all (the
# Python function is missing too). This is the one table of what each
# version offers: ``python -m vmmalloc --check``, the warning of enable()
# (absent_features) and docs/companion-matrix.md (scripts/companion_matrix.py)
# are all written from it. Before 2.8 a MemPool has no allocator of its own
# (createOrIncrefPool takes it from 2.8): plain MemPools and use_mem_pool work
# there through beginAllocateToPool (and ensureExistsAndIncrefPool on 2.6-2.7).
NOT_IN_VERSION = {
    "getMemoryFraction": (2, 6),
    "getPoolUseCount": (2, 6),
    "createOrIncrefPool": (2, 8),
    "setUseOnOOM": (2, 8),
    "pushCompileContext": (2, 8),
    "setUserMetadata": (2, 10),
    "setNoSplit": (2, 10),
    "getContextForPointer": (2, 12),
    "annotateMemory": (2, 14),
}


def absent_in(version):
    """[(method, first version string)] of NOT_IN_VERSION this PyTorch
    version predates."""
    v = version_tuple(version)
    return [(m, f"{a}.{b}") for m, (a, b) in NOT_IN_VERSION.items() if v < (a, b)]


def absent_features(version):
    """[(feature, first version string)]: the FEATURES this PyTorch version
    does not offer at all (NOT_IN_VERSION); what --check and enable() say."""
    absent = dict(absent_in(version))
    return [(f, absent[m]) for m, f in FEATURES if m in absent]


def absent_warning(version):
    """The one line enable() warns with under a PyTorch that lacks FEATURES
    (None for one that has them all)."""
    absent = absent_features(version)
    if not absent:
        return None
    return (f"vmmalloc: PyTorch {version} does not have: "
            + "; ".join(f"{f} (from PyTorch {v})" for f, v in absent))


_loaded = None  # the companion CDLL, kept for the life of the process
_load_error = None  # why it could not be built or loaded (tried once per process)
_installed = False


def cache_dir():
    """Where built companions are kept ($VMMALLOC_CACHE or ~/.cache/vmmalloc)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vmmalloc"


def _abi(torch):
    return int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))


def companion_path(torch):
    """The cached companion for this PyTorch version, C++ ABI and source."""
    tag = re.sub(r"[^A-Za-z0-9_.+-]", "_", torch.__version__)
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.read_bytes())
    digest = h.hexdigest()[:10]
    return cache_dir() / f"libvmmalloc_torch-{tag}-abi{_abi(torch)}-{digest}.so"


def cuda_include_dirs():
    """Directories with the CUDA runtime headers PyTorch's headers include
    (cuda_runtime_api.h), in search order: $CUDA_HOME/include, the CUDA
    toolkit, the nvidia wheels' (whose cu13/include lacks crt/), and triton's
    bundled copy (which has crt/)."""
    dirs = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        dirs.append(Path(home) / "include")
    dirs.append(Path("/usr/local/cuda/include"))
    try:
        import nvidia

        for root in map(Path, nvidia.__path__):
            dirs += sorted(root.glob("cu*/include")) + [root / "cuda_runtime" / "include"]
    except ImportError:
        pass
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            dirs.append(Path(spec.origin).parent / "backends" / "nvidia" / "include")
    except (ImportError, ValueError):
        pass
    out = []
    for d in dirs:
        if (d / "cuda_runtime_api.h").is_file() and d not in out:
            out.append(d)
    return out


def compile_command(torch, source, output, shared=True, disabled=()):
    """The C++ compiler command building `source` against this PyTorch
    (``disabled``: companion methods to leave out, ``-DVMM_NO_<name>``)."""
    root = Path(torch.__file__).resolve().parent
    return compile_command_for(root, torch.__version__, _abi(torch), source, output, shared=shared,
                               disabled=disabled)


def compile_command_for(root, version, abi, source, output, shared=True, disabled=(), link=True):
    """The compiler command building `source` against the PyTorch whose
    package directory is `root` (its ``include/`` and ``lib/``), version
    `version`, C++ ABI `abi`. ``link=False`` compiles to an object file only
    (the version matrix, scripts/companion_matrix.py, has headers only)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) found")
    root = Path(root)
    include, libdir = root / "include", root / "lib"
    if not (include / "c10" / "util" / "Exception.h").is_file():
        raise RuntimeError(f"this PyTorch ships no C++ headers ({include})")
    cuda = cuda_include_dirs()
    if not cuda:
        raise RuntimeError("no CUDA runtime headers (cuda_runtime_api.h) found: set CUDA_HOME, or install "
                           "the nvidia CUDA runtime wheel PyTorch uses")
    version = str(version).replace("\\", "").replace('"', "")
    cmd = [cxx, "-std=c++20", "-O1", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}",
           f'-DVMMALLOC_TORCH_VERSION="{version}"', f"-I{include}",
           f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{COMPANION_DIR}"]
    cmd += [f"-I{d}" for d in cuda]
    cmd += [f"-DVMM_NO_{name}" for name in disabled]
    if not link:
        return cmd + ["-c", "-o", str(output), str(source)]
    cmd += ["-o", str(output), str(source), f"-L{libdir}", "-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10",
            f"-Wl,-rpath,{libdir}"]
    if shared:
        cmd.insert(1, "-shared")
    return cmd


# The oldest PyTorch the companion supports: 2.5 (the first with the
# allocator interface it subclasses in this shape: ShareableHandle,
# getCheckpointState/setCheckpointPoolState with a device, MemPool).
OLDEST = (2, 5)


def version_tuple(version):
    """(major, minor) of a version string such as "2.5.1+cu124"."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if not m:
        raise ValueError(f"not a PyTorch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_supported(version):
    """Raises RuntimeError, naming the version, for a PyTorch older than OLDEST."""
    if version_tuple(version) < OLDEST:
        raise RuntimeError(f"the torch companion needs PyTorch {OLDEST[0]}.{OLDEST[1]} or newer; this is "
                           f"PyTorch {version} (vmmalloc runs as its plain pluggable allocator)")


def compile_leaving_out(command_for):
    """Runs ``command_for(disabled)`` until it compiles, leaving out each
    method the compiler says overrides nothing. Returns the methods left out;
    raises RuntimeError with the compiler's words on any other error."""
    disabled = []
    for _ in range(4):
        out = subprocess.run(command_for(disabled), capture_output=True, text=True,
                             env=dict(os.environ, LC_ALL="C"))
        if out.returncode == 0:
            return disabled
        more = [m for m in _not_overriding(out.stderr) if m not in disabled]
        if not more:
            raise RuntimeError(f"building the torch companion failed:\n{out.stderr.strip()[-2000:]}")
        disabled += more
    raise RuntimeError(f"building the torch companion failed:\n{out.stderr.strip()[-2000:]}")


# g++: "error: 'bool X::f(...)' marked 'override', but does not override";
# clang: "error: 'f' marked 'override' but does not override any member functions".
# Quotes are ASCII under LC_ALL=C (which build() sets), typographic otherwise.
_Q = "['\u2018\u2019]"
_NOT_OVERRIDING = re.compile(rf"{_Q}(?:[^'\u2018\u2019]*::)?(\w+)\([^'\u2018\u2019]*{_Q}\s+marked {_Q}override"
                             rf"|{_Q}(\w+){_Q} marked {_Q}override")


def _not_overriding(stderr):
    return sorted({a or b for a, b in _NOT_OVERRIDING.findall(stderr)})


def lost_path(path):
    """The file listing the methods left out of the companion at `path`."""
    return Path(str(path) + ".lost.json")


def build(torch, path=None):
    """Builds the companion for the installed PyTorch (half a minute);
    returns its path. Methods this PyTorch's allocator interface lacks are
    left out (see lost_methods())."""
    check_supported(torch.__version__)
    path = Path(path) if path else companion_path(torch)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    disabled = compile_leaving_out(lambda d: compile_command(torch, SOURCE, tmp, disabled=d))
    lost_path(path).write_text(json.dumps(disabled))
    os.replace(tmp, path)  # atomic: concurrent builders never see half a file
    return path


def lost_methods(path):
    """The companion methods left out of the build at `path` (this
    PyTorch's interface has no such virtual method)."""
    try:
        return json.loads(lost_path(path).read_text())
    except (OSError, ValueError):
        return []


def load(torch):
    """Builds (if needed) and loads the companion; returns the CDLL.
    Raises RuntimeError saying why it cannot."""
    global _loaded, _load_error
    if _loaded is not None:
        return _loaded
    if os.environ.get(ENV, "1") == "0":
        raise RuntimeError(f"${ENV}=0")
    if _load_error is not None:
        raise RuntimeError(_load_error)
    try:
        _loaded = _load(torch)
    except Exception as e:
        _load_error = str(e)
        raise
    return _loaded


def _load(torch):
    path = companion_path(torch)
    if not path.is_file():
        # One builder at a time (torchrun starts every rank at once); the
        # others wait for it and load its result.
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.is_file():
                build(torch, path)
    lib = ctypes.CDLL(str(path))
    lib.vmmalloc_companion_torch_version.restype = ctypes.c_char_p
    built_for = lib.vmmalloc_companion_torch_version().decode()
    if built_for != torch.__version__:
        raise RuntimeError(f"companion {path} was built for PyTorch {built_for}, this is {torch.__version__}")
    lib.vmmalloc_companion_install.restype = ctypes.c_int
    lib.vmmalloc_companion_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.path = path
    return lib


def lost_features(installed):
    """The FEATURES lost: all of them without the companion allocator
    (``installed`` False), else those whose methods were left out."""
    if not installed:
        return [f for m, f in FEATURES if m != "throw_oom" or _loaded is None]
    missing = set(lost_methods(_loaded.path)) if _loaded is not None else set()
    if _loaded is not None and not _loaded.vmmalloc_companion_has_ipc():
        missing.add("shareIpcHandle")  # this libvmmalloc has no vmmalloc_ipc_* functions
    if _loaded is not None and not _loaded.vmmalloc_companion_has_history():
        missing.update(("recordHistory", "cacheInfo"))  # no vmmalloc_record_history / cache_info
    return [f for m, f in FEATURES if m in missing]


def install_allocator(torch, library):
    """Makes the companion's allocator (over the libvmmalloc at `library`)
    PyTorch's current CUDA allocator. Returns (True, companion path) or
    (False, why not); raises nothing."""
    global _installed
    try:
        lib = load(torch)
    except Exception as e:  # any failure leaves the plain pluggable allocator
        return False, str(e)
    err = ctypes.create_string_buffer(4096)
    if lib.vmmalloc_companion_install(os.fsencode(library), err, len(err)) != 0:
        return False, err.value.decode(errors="replace")
    _installed = True
    return True, str(lib.path)


def snapshots_supported():
    """Whether the installed companion answers PyTorch's own snapshot
    functions: snapshot() and recordHistory() built in, over a libvmmalloc
    that records history (vmmalloc_record_history)."""
    if not _installed or _loaded is None:
        return False
    lost = set(lost_methods(_loaded.path))
    return not ({"snapshot", "recordHistory", "isHistoryEnabled"} & lost) and _loaded.vmmalloc_companion_has_history()


def installed():
    """Whether install_allocator() made the companion PyTorch's allocator."""
    return _installed


def install(torch):
    """Registers the companion's thrower with libvmmalloc (building the
    companion first if needed). Returns (exception type name, reason)."""
    try:
        lib = load(torch)
        thrower = ctypes.cast(lib.vmmalloc_companion_throw_oom, ctypes.c_void_p).value
        vm = _lib.load()
        vm.vmmalloc_set_oom_thrower.restype = None
        vm.vmmalloc_set_oom_thrower.argtypes = [ctypes.c_void_p]
        vm.vmmalloc_set_oom_thrower(thrower)
        return "torch.cuda.OutOfMemoryError", str(lib.path)
    except Exception as e:  # any failure leaves the std::runtime_error path
        return "RuntimeError", str(e)


# vmmalloc_device_stats' layout (crates/capi/src/torch_abi.rs): 9 stats x
# (all, small_pool, large_pool) x (current, peak, allocated, freed), then
# num_alloc_retries, num_ooms, oversize_allocations (4), oversize_segments
# (4), num_sync_all_streams, num_device_alloc, num_device_free, max_split_size.
_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
               "active_bytes", "inactive_split_bytes", "requested_bytes")
_STATS_LEN = 9 * 3 * 4 + 2 + 4 + 4 + 4
_COUNTS = (("num_ooms", 109), ("num_device_alloc", 119), ("num_device_free", 120))


def add_pool_figures(stats, device):
    """Adds to ``stats`` (a memory_stats() dict of libvmmalloc's figures for
    ``device``) the figures of the torch.cuda.MemPool(allocator=...) pools,
    whose blocks the companion keeps (PyTorch's memory_stats() counts every
    pool). Returns ``stats``; unchanged without the companion."""
    fn = getattr(_loaded, "vmmalloc_companion_pool_figures", None) if _installed else None
    if fn is None:
        return stats
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t]
    out = (ctypes.c_int64 * _STATS_LEN)()
    if fn(device, out, _STATS_LEN) != _STATS_LEN:
        return stats
    i = 0
    for name in _STAT_NAMES:
        for kind in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                key = f"{name}.{kind}.{field}"
                if out[i] and key in stats:
                    stats[key] += out[i]
                i += 1
    for key, i in _COUNTS:
        if out[i] and key in stats:
            stats[key] += out[i]
    return stats


def private_pool_figures(device):
    """PyTorch 2.13+'s ``reserved_bytes_by_private_pools`` of ``device`` as
    memory_stats() keys (``reserved_bytes_by_private_pools.0_1.all.current``
    ...), from the companion's getDeviceStats (libvmmalloc's private pools
    and those with their own allocator); None without the companion."""
    if not _installed:
        return None
    import torch

    nested = torch._C._cuda_memoryStats(device).get("reserved_bytes_by_private_pools")
    if nested is None:
        return None
    out = {}
    for pool, by_kind in nested.items():
        name = "_".join(str(x) for x in pool) if isinstance(pool, tuple) else str(pool)
        for kind, fields in by_kind.items():
            for field, value in fields.items():
                out[f"reserved_bytes_by_private_pools.{name}.{kind}.{field}"] = value
    return out


def reset_pool_peaks(device):
    """reset_peak_memory_stats()'s part for those pools (after libvmmalloc's)."""
    fn = getattr(_loaded, "vmmalloc_companion_reset_pool_peaks", None) if _installed else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int]
        fn(device)
