"""``python -m vmmalloc --check`` / ``vmmalloc.check()``: can this machine and
this PyTorch use vmmalloc, and with which limits?

It reports the package and library versions, the CUDA driver and each GPU
with the capabilities vmmalloc needs (queried through ctypes from the same
driver library the allocator loads: ``$VMMALLOC_CUDA_LIBRARY`` or
``libcuda.so.1``), PyTorch and which of its integrations vmmalloc can use,
whether CUDA is already initialised in this process, whether
``VMMALLOC_CONF`` parses, then one verdict line. It needs neither a GPU nor
PyTorch (it says what is missing), creates no CUDA context, and does not
enable anything.

Driver queries (cuda.h): ``cuDriverGetVersion`` (callable before cuInit),
``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGet``, ``cuDeviceGetName``,
``cuDeviceGetAttribute`` with ``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``
(102: cuMemCreate/cuMemMap work on the device) and
``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`` (103:
cuMemExportToShareableHandle to a file descriptor, what IPC sharing of
allocations uses), and ``cuDeviceCanAccessPeer`` for each pair of devices.
None of them needs a context.
"""

import ctypes
import os

from . import _lib

CUDA_LIBRARY_ENV = "VMMALLOC_CUDA_LIBRARY"  # vmm-sys/src/driver.rs LIBRARY_ENV
CUDA_LIBRARY_DEFAULT = "libcuda.so.1"
ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (cuda.h)
ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED (cuda.h)
CUDA_ERROR_NO_DEVICE = 100  # cuda.h

USABLE = "usable"
LIMITED = "usable with limits"
NOT_USABLE = "not usable"

# What a machine without a GPU can run instead: said by --check's verdict and
# by enable()'s warnings (one text).
CPU_HINT = ("without a GPU, run the simulator (`vmmalloc compare` / `replay` / `advise` on a trace) or "
            "the host-backend example (`python examples/rl_colocate.py --host`, real CPU memory "
            "through the C ABI); PyTorch's own tensors with device=\"cuda\" need a GPU whatever "
            "VMMALLOC_CONF says")


class Report:
    """What check() found: ``lines`` (the text, one finding a line),
    ``problems`` (each makes vmmalloc not usable), ``limits`` (each a
    feature that will not work) and ``verdict``."""

    def __init__(self):
        self.lines = []
        self.problems = []
        self.limits = []
        self.gpus = []  # dicts: ordinal, name, vmm, posix_fd, peers

    @property
    def verdict(self):
        """``usable``, ``usable with limits`` or ``not usable``."""
        if self.problems:
            return NOT_USABLE
        return LIMITED if self.limits else USABLE

    def verdict_line(self):
        """The last line: the verdict and why."""
        if self.problems:
            return f"verdict: {NOT_USABLE}: " + "; ".join(self.problems)
        if self.limits:
            return f"verdict: {LIMITED}: " + "; ".join(self.limits)
        return f"verdict: {USABLE}"

    def __str__(self):
        return "\n".join(self.lines + [self.verdict_line()]) + "\n"


def _driver_version_string(v):
    return f"{v // 1000}.{(v % 1000) // 10}"


def _check_library(r, package_version):
    try:
        path = _lib.library_path()
        lib_version = _lib.version()
    except (FileNotFoundError, OSError, _lib.VmmallocError) as e:
        r.lines.append(f"library: not usable ({str(e).splitlines()[0]})")
        r.problems.append("libvmmalloc.so is missing (reinstall with `pip install ./python`)")
        return False
    r.lines.append(f"library: {path} (version {lib_version})")
    try:
        _lib.check_version(package_version)
    except _lib.VmmallocError as e:
        r.problems.append(str(e))
        return False
    return True


def _check_conf(r):
    conf = os.environ.get("VMMALLOC_CONF")
    shown = "(unset: defaults)" if conf is None else repr(conf)
    try:
        _lib.check_config()
    except _lib.VmmallocError as e:
        r.lines.append(f"VMMALLOC_CONF: {shown}: invalid: {e}")
        r.problems.append(f"VMMALLOC_CONF does not parse ({e})")
        return
    r.lines.append(f"VMMALLOC_CONF: {shown}: parses")


def _check_driver(r):
    name = os.environ.get(CUDA_LIBRARY_ENV) or CUDA_LIBRARY_DEFAULT
    try:
        cu = ctypes.CDLL(name)
    except OSError as e:
        # dlopen's message already starts with the library's name.
        why = str(e) if str(e).startswith(name) else f"{name}: {e}"
        r.lines.append(f"CUDA driver: not found ({why})")
        r.problems.append(f"no CUDA driver (vmmalloc serves CUDA tensors; install the NVIDIA driver; {CPU_HINT})")
        return
    c_int = ctypes.c_int
    v = c_int()
    rc = cu.cuDriverGetVersion(ctypes.byref(v))
    version = _driver_version_string(v.value) if rc == 0 else f"unknown (cuDriverGetVersion: error {rc})"
    rc = cu.cuInit(0)
    n = c_int()
    if rc == 0:
        rc = cu.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0 or n.value == 0:
        why = "no CUDA device" if rc in (0, CUDA_ERROR_NO_DEVICE) else f"cuInit/cuDeviceGetCount: error {rc}"
        r.lines.append(f"CUDA driver: {version} ({name}), {why}")
        r.problems.append(f"{why} (vmmalloc needs a GPU; {CPU_HINT})")
        return
    r.lines.append(f"CUDA driver: {version} ({name}), {n.value} device(s)")
    devs = []
    for i in range(n.value):
        d = c_int()
        if cu.cuDeviceGet(ctypes.byref(d), i) != 0:
            r.lines.append(f"  GPU {i}: cuDeviceGet failed")
            continue
        devs.append((i, d.value))
    for i, d in devs:
        buf = ctypes.create_string_buffer(256)
        gpu_name = buf.value.decode(errors="replace") if cu.cuDeviceGetName(buf, 256, d) == 0 else "?"

        def attr(a, d=d):
            out = c_int()
            return bool(out.value) if cu.cuDeviceGetAttribute(ctypes.byref(out), a, d) == 0 else None

        vmm, fd = attr(ATTR_VMM), attr(ATTR_POSIX_FD)
        peers = []
        for j, e in devs:
            can = c_int()
            if j != i and cu.cuDeviceCanAccessPeer(ctypes.byref(can), d, e) == 0 and can.value:
                peers.append(j)
        yn = {True: "yes", False: "no", None: "unknown"}
        peer_text = ", ".join(map(str, peers)) if peers else ("none" if len(devs) > 1 else "n/a (one GPU)")
        r.lines.append(f"  GPU {i}: {gpu_name}: VMM {yn[vmm]}, POSIX fd handles {yn[fd]}, peer access to: {peer_text}")
        r.gpus.append({"ordinal": i, "name": gpu_name, "vmm": vmm, "posix_fd": fd, "peers": peers})
        if not vmm:
            r.limits.append(f"GPU {i} has no virtual memory management: only backend:native works on it")
        elif not fd:
            r.limits.append(f"GPU {i} cannot export POSIX fd handles: no IPC sharing of its memory")
        if len(devs) > 1 and len(peers) < len(devs) - 1:
            r.limits.append(f"GPU {i} cannot access every other GPU's memory (peer access)")
    if devs and not any(g["vmm"] for g in r.gpus):
        r.problems.append("no GPU supports virtual memory management (needs CUDA 10.2+ and a supported GPU)")


def _check_torch(r):
    try:
        import torch
    except ImportError as e:
        r.lines.append(f"PyTorch: not installed ({e})")
        r.problems.append("PyTorch is not installed (vmmalloc.enable() needs it)")
        return
    r.lines.append(f"PyTorch: {torch.__version__}")
    from . import _torch

    memory = getattr(torch.cuda, "memory", None)
    cls = getattr(torch._C, "_CUDAPluggableAllocator", None)
    if memory is None or cls is None or not hasattr(memory, "CUDAPluggableAllocator") \
            or not hasattr(memory, "change_current_allocator"):
        r.lines.append("  pluggable allocator: missing (torch.cuda.memory.CUDAPluggableAllocator, PyTorch >= 2.0)")
        r.problems.append(f"PyTorch {torch.__version__} has no CUDAPluggableAllocator")
        return
    r.lines.append("  pluggable allocator: yes")
    # The setters are pybind methods of the allocator class (torch/csrc/cuda/Module.cpp).
    missing = [s for s, _ in _torch.HOOKS if not hasattr(cls, s)]
    r.lines.append("  allocator hooks (init, empty_cache, memory fraction, record_stream): "
                   + ("yes" if not missing else "missing " + ", ".join(missing)))
    if missing:
        r.limits.append("hooks missing: " + ", ".join(missing))
    gmissing = [s for s, _ in _torch.GRAPH_HOOKS if not hasattr(cls, s)]
    r.lines.append("  CUDA graph pool hooks: " + ("yes" if not gmissing else "missing " + ", ".join(gmissing)))
    if gmissing:
        r.limits.append("no CUDA graph pool hooks in this PyTorch: CUDA graphs will fail")
    from . import _companion

    features = "; ".join(f"{f}" for _, f in _companion.FEATURES)
    if os.environ.get(_companion.ENV, "1") == "0":
        r.lines.append(f"  torch companion: off (${_companion.ENV}=0): the plain pluggable allocator, without: {features}")
        r.limits.append("torch companion off: no CUDA graph trees (torch.compile reduce-overhead), MemPools, "
                        "snapshot() for NCCL; out-of-memory raises RuntimeError")
    else:
        path = _companion.companion_path(torch)
        if path.is_file():
            lost = _companion.lost_methods(path)
            r.lines.append(f"  torch companion: built ({path})")
            if lost:
                r.limits.append("this PyTorch's allocator interface lacks " + ", ".join(lost))
        else:
            r.lines.append(f"  torch companion: not built yet; enable() builds it into {path} (needs a C++ "
                           "compiler and the CUDA runtime headers; without it vmmalloc runs as the plain "
                           "pluggable allocator)")
            lost = []
        absent = dict(_companion.absent_in(torch.__version__))
        for method, feature in _companion.FEATURES:
            if method in absent:
                state = f"not in PyTorch {torch.__version__} (its allocator interface has it from {absent[method]})"
            elif method in lost:
                state = "no (method missing in this PyTorch)"
            else:
                state = "yes, with the companion"
            r.lines.append(f"    {feature}: {state}")
        try:
            _companion.check_supported(torch.__version__)
        except RuntimeError as e:
            r.limits.append(str(e))
    if os.environ.get(_torch.NCCL_HOOK_ENV, "").strip().lower() in ("1", "true", "yes", "on", "y"):
        if os.environ.get(_companion.ENV, "1") == "0":
            r.lines.append(f"  {_torch.NCCL_HOOK_ENV} is set: enable() turns it off (the torch companion is off, "
                           "and the plain pluggable allocator passes no segment entries to NCCL)")
            r.limits.append(f"{_torch.NCCL_HOOK_ENV} is turned off without the torch companion")
        else:
            r.lines.append(f"  {_torch.NCCL_HOOK_ENV} is set: served by the torch companion (a segment entry "
                           "for each run of mapped memory, deregistered before it is unmapped or moved; "
                           "nccl_register:False turns it off)")
    answered = [n for n in _torch.PATCHED if hasattr(memory, n)]
    r.lines.append("  torch.cuda memory functions answered by vmmalloc: " + ", ".join(answered))
    if torch.cuda.is_initialized():
        r.lines.append("  CUDA initialised in this process: yes (too late for enable(): start the program with "
                       "`python -m vmmalloc script.py`)")
        r.problems.append("CUDA is already initialised in this process: enable() must run before it")
    else:
        r.lines.append("  CUDA initialised in this process: no (enable() can still replace the allocator)")


def check(package_version=None):
    """Runs every check and returns a Report (``str()`` of it is the text
    ``python -m vmmalloc --check`` prints). Enables nothing and creates no
    CUDA context; it does load libvmmalloc.so and the driver library."""
    if package_version is None:
        import vmmalloc

        package_version = vmmalloc.__version__
    r = Report()
    r.lines.append(f"vmmalloc: Python package {package_version}")
    # Before anything else touches torch or the driver.
    _check_torch(r)
    if _check_library(r, package_version):
        _check_conf(r)
    _check_driver(r)
    return r
