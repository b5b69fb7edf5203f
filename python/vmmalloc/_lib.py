"""ctypes bindings to libvmmalloc.so (no PyTorch needed).

The library is looked up, in order:

1. ``$VMMALLOC_LIBRARY`` (a path to the .so; an error if it does not exist);
2. ``libvmmalloc.so`` inside this package (where ``pip install ./python``
   puts the library it builds, see python/setup.py);
3. ``<repo>/target/release/libvmmalloc.so`` when the package runs from a
   checkout of the repository (``python/vmmalloc`` inside it).
"""

import ctypes
import json
import os
import threading
from pathlib import Path

LIBRARY_ENV = "VMMALLOC_LIBRARY"
LIBRARY_NAME = "libvmmalloc.so"


class VmmallocError(RuntimeError):
    """A libvmmalloc call failed; the message is the library's last error."""


def candidates():
    """The paths tried, in order, as (description, path) pairs."""
    here = Path(__file__).resolve().parent
    out = []
    env = os.environ.get(LIBRARY_ENV)
    if env:
        out.append((f"${LIBRARY_ENV}", Path(env)))
    out.append(("next to the package", here / LIBRARY_NAME))
    repo = here.parent.parent
    if (repo / "Cargo.toml").is_file():  # running from a checkout (python/vmmalloc)
        out.append(("the repository's target/release", repo / "target" / "release" / LIBRARY_NAME))
    return out


def find_library():
    """The path of libvmmalloc.so, or FileNotFoundError listing what was tried."""
    tried = candidates()
    env = os.environ.get(LIBRARY_ENV)
    if env:
        # An explicit path that is wrong is an error, never a silent fallback.
        if Path(env).is_file():
            return str(Path(env).resolve())
        raise FileNotFoundError(f"${LIBRARY_ENV}={env} does not name a file")
    for _, p in tried:
        if p.is_file():
            return str(p.resolve())
    lines = "\n".join(f"  {what}: {p}" for what, p in tried)
    raise FileNotFoundError(
        f"{LIBRARY_NAME} not found; tried:\n{lines}\n"
        f"Install the package with `pip install ./python` (it builds the library), build it with "
        f"`cargo build --release -p vmmalloc-capi`, or set ${LIBRARY_ENV}."
    )


_lock = threading.Lock()
_lib = None
_path = None


def _declare(lib):
    c_int, c_size_t, c_void_p, c_char_p, c_double = (
        ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_double)
    sig = {
        # Throws a C++ exception on failure unless on_oom:null: never call it
        # through ctypes (use vmmalloc_try_malloc); PyTorch calls it from C++.
        "vmmalloc_malloc": (c_void_p, [c_size_t, c_int, c_void_p]),
        "vmmalloc_try_malloc": (c_int, [c_size_t, c_int, c_void_p, ctypes.POINTER(c_void_p)]),
        "vmmalloc_free": (None, [c_void_p, c_size_t, c_int, c_void_p]),
        "vmmalloc_init": (None, [c_int]),
        "vmmalloc_empty_cache": (None, []),
        "vmmalloc_set_memory_fraction": (None, [c_double, c_int]),
        "vmmalloc_record_stream": (None, [c_void_p, c_void_p]),
        # Owned strings come back as void* so they can be freed.
        "vmmalloc_memory_stats_json": (c_void_p, [c_int]),
        "vmmalloc_memory_summary": (c_void_p, [c_int]),
        "vmmalloc_dump_snapshot": (c_int, [c_char_p]),
        "vmmalloc_reset_peak_stats": (c_int, [c_int]),
        "vmmalloc_validate": (c_int, [c_int]),
        "vmmalloc_configure": (c_int, [c_char_p]),
        "vmmalloc_check_config": (c_int, []),
        "vmmalloc_config_json": (c_void_p, [c_char_p]),
        "vmmalloc_pytorch_conf_line": (c_void_p, [c_char_p]),
        "vmmalloc_last_error": (c_char_p, []),
        "vmmalloc_version": (c_char_p, []),
        "vmmalloc_free_string": (None, [c_void_p]),
        "vmmalloc_reset_for_tests": (None, []),
        "vmmalloc_pool_stats_json": (c_void_p, [c_int, ctypes.c_uint64, ctypes.c_uint64]),
    }
    declare(lib, [(name, res, args) for name, (res, args) in sig.items()])


def declare(lib, signatures):
    """Sets the result and argument types of each ``(name, result, args)``
    in ``signatures`` on ``lib`` (the other modules declare their entry
    points with it)."""
    for name, res, args in signatures:
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def load(path=None):
    """Loads (once) and returns the library as a ctypes.CDLL."""
    global _lib, _path
    with _lock:
        if _lib is None:
            p = path or find_library()
            lib = ctypes.CDLL(p)
            _declare(lib)
            _lib, _path = lib, p
        elif path is not None and os.path.realpath(path) != os.path.realpath(_path):
            raise VmmallocError(f"libvmmalloc is already loaded from {_path}, not {path}")
        return _lib


def library_path():
    """The path the library was (or would be) loaded from."""
    return _path or find_library()


def last_error():
    """This thread's last libvmmalloc error, or None."""
    e = load().vmmalloc_last_error()
    return None if e is None else e.decode("utf-8", "replace")


def _check(rc, what):
    if rc != 0:
        raise VmmallocError(last_error() or f"{what} failed")


def _take_string(ptr, what):
    if not ptr:
        raise VmmallocError(last_error() or f"{what} failed")
    lib = load()
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        lib.vmmalloc_free_string(ptr)


def configure(conf):
    """Sets the configuration (VMMALLOC_CONF syntax) before the first allocation."""
    _check(load().vmmalloc_configure(conf.encode()), "vmmalloc_configure")


def check_config():
    """Raises VmmallocError naming the bad key if the configuration is invalid."""
    _check(load().vmmalloc_check_config(), "vmmalloc_check_config")


def config(conf=None):
    """The configuration as the library parses it, a dict of every setting
    (``{"backend": "expandable", "device": "host", ...}``): of ``conf``
    (VMMALLOC_CONF syntax), or of the configuration in effect when None.
    Python never parses the text itself: ``key=value`` and ``key:value``, the
    last value of a key, every rule is the library's. Raises VmmallocError
    naming the bad key."""
    arg = None if conf is None else conf.encode()
    return json.loads(_take_string(load().vmmalloc_config_json(arg), "vmmalloc_config_json"))


def pytorch_conf_line(text):
    """The VMMALLOC_CONF items that ask vmmalloc for what the
    PYTORCH_CUDA_ALLOC_CONF ``text`` asks PyTorch for ("" when nothing
    carries over), as the library reads both variables."""
    return _take_string(load().vmmalloc_pytorch_conf_line(text.encode()), "vmmalloc_pytorch_conf_line")


def memory_stats(device=0):
    """PyTorch's memory_stats() keys (plus vmmalloc.*) for a device, as a dict."""
    return json.loads(_take_string(load().vmmalloc_memory_stats_json(device), "vmmalloc_memory_stats_json"))


def memory_summary(device=0):
    """PyTorch's memory_summary() table, plus vmmalloc's rows."""
    return _take_string(load().vmmalloc_memory_summary(device), "vmmalloc_memory_summary")


def pool_memory_stats(pool, device=0):
    """A private pool's statistics (``torch.cuda.MemPool().id`` or a CUDA
    graph's pool, or a (hi, lo) pair): PyTorch's memory_stats() keys for the
    pool's memory alone (a share of the device's figures), plus
    ``vmmalloc.live_blocks``, ``vmmalloc.use_count``, ``vmmalloc.recording``,
    ``vmmalloc.paused`` and ``vmmalloc.backup_bytes``. Raises VmmallocError
    for an unknown pool."""
    from ._sleep import _pool_id

    hi, lo = _pool_id(pool)
    return json.loads(_take_string(load().vmmalloc_pool_stats_json(device, hi, lo), "vmmalloc_pool_stats_json"))


def dump_snapshot(path):
    """Writes a snapshot pickle in PyTorch's schema (torch.cuda.memory._dump_snapshot's)."""
    _check(load().vmmalloc_dump_snapshot(os.fsencode(path)), "vmmalloc_dump_snapshot")


def reset_peak_memory_stats(device=0):
    """Resets a device's peak statistics to their current values."""
    _check(load().vmmalloc_reset_peak_stats(device), "vmmalloc_reset_peak_stats")


def empty_cache():
    """Returns cached memory to the devices."""
    load().vmmalloc_empty_cache()
    e = last_error()
    if e:
        raise VmmallocError(e)


def validate(device=0):
    """Checks the allocator's invariants; raises VmmallocError on the first broken one."""
    _check(load().vmmalloc_validate(device), "vmmalloc_validate")


def version():
    """The library's version string."""
    return load().vmmalloc_version().decode()


def check_version(package_version):
    """Raises VmmallocError, naming both versions, unless the loaded library
    (``vmmalloc_version()``, the Cargo workspace version) is the version of
    the Python package (``vmmalloc.__version__``): a library built from other
    sources may export other functions or read its configuration differently."""
    lib_version = version()
    if lib_version != package_version:
        raise VmmallocError(
            f"{_path} is libvmmalloc {lib_version} but the vmmalloc Python package is {package_version}: "
            f"reinstall with `pip install ./python` from one checkout, or point ${LIBRARY_ENV} at a "
            f"libvmmalloc.so built from the same sources")


def function_pointer(name):
    """The address of an exported function, as PyTorch's set_*_fn hooks take it."""
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value
