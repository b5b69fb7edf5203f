"""Shared fixtures: the library under test (VMMALLOC_LIBRARY, set by run.sh)
and a fresh, configured allocator state per test.

With ``VMMALLOC_TEST_INSTALLED=1`` (``run.sh --installed``, as .ci/run does
after ``pip install ./python`` into a fresh venv) the tests import the
installed package and its own libvmmalloc.so instead of python/vmmalloc and
target/debug, and fail if that is not what they got."""

import ctypes
import os
import sys
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parent.parent
REPO = PYTHON_DIR.parent
INSTALLED = os.environ.get("VMMALLOC_TEST_INSTALLED") == "1"
# The companion the tests build (here and in their subprocesses): the shipped
# one plus its test-only entry points (companion_test_harness.cpp).
os.environ["VMMALLOC_COMPANION_SOURCE"] = str(Path(__file__).resolve().parent / "companion_test_harness.cpp")
if not INSTALLED and str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

import vmmalloc  # noqa: E402
from vmmalloc import _lib  # noqa: E402

# The directory holding the package under test, for subprocesses' PYTHONPATH.
PACKAGE_PARENT = Path(vmmalloc.__file__).resolve().parent.parent
if INSTALLED:
    if PACKAGE_PARENT == PYTHON_DIR:
        raise RuntimeError(f"VMMALLOC_TEST_INSTALLED=1 but vmmalloc was imported from the checkout ({PYTHON_DIR})")
    if os.environ.get("VMMALLOC_LIBRARY"):
        raise RuntimeError("VMMALLOC_TEST_INSTALLED=1 tests the installed library: unset VMMALLOC_LIBRARY")


def require_torch():
    """For a test module that needs the real torch: skips the module when
    torch is not installed, or fails it under VMMALLOC_REQUIRE_TORCH=1 (CI,
    where the torch tests must not be skipped). Returns the torch module."""
    try:
        import torch
    except ImportError as e:
        why = f"torch is not installed ({e})"
        if os.environ.get("VMMALLOC_REQUIRE_TORCH") == "1":
            raise RuntimeError(f"VMMALLOC_REQUIRE_TORCH=1 but {why}")
        pytest.skip(why, allow_module_level=True)
    return torch


@pytest.fixture(scope="session")
def companion_cache(tmp_path_factory):
    """Where the tests' interpreters keep the torch companions they build
    ($VMMALLOC_CACHE): one directory for the whole session, since a build is
    keyed by PyTorch version, C++ ABI and the hash of its sources
    (_companion.companion_path), so every module's build of the same harness
    is one build. $VMMALLOC_TEST_COMPANION_CACHE names a directory kept
    between sessions instead: .ci/run shares it between the checkout's run
    and the installed package's, whose companion sources are the same."""
    shared = os.environ.get("VMMALLOC_TEST_COMPANION_CACHE")
    if shared:
        Path(shared).mkdir(parents=True, exist_ok=True)
        return Path(shared)
    return tmp_path_factory.mktemp("companion-cache")


BACKENDS = ["expandable", "caching", "torch-es", "native"]
MIB = 1 << 20


@pytest.fixture(scope="session")
def lib():
    if not INSTALLED and not os.environ.get("VMMALLOC_LIBRARY"):
        debug = REPO / "target" / "debug" / "libvmmalloc.so"
        if debug.is_file():
            os.environ["VMMALLOC_LIBRARY"] = str(debug)
    return _lib.load()


class Alloc:
    """Thin helpers over the raw C functions."""

    def __init__(self, lib):
        self.lib = lib

    def malloc(self, size, device=0, stream=None):
        # vmmalloc_try_malloc, not vmmalloc_malloc: that one throws a C++
        # exception on failure (on_oom:raise), which ctypes cannot catch.
        out = ctypes.c_void_p()
        self.lib.vmmalloc_try_malloc(size, device, stream, ctypes.byref(out))
        return out.value

    def free(self, ptr, size=0, device=0, stream=None):
        self.lib.vmmalloc_free(ptr, size, device, stream)

    def write(self, ptr, data):
        ctypes.memmove(ptr, data, len(data))

    def read(self, ptr, n):
        return ctypes.string_at(ptr, n)


@pytest.fixture
def fresh(lib):
    """fresh(conf) -> Alloc: resets the library and configures it."""

    def make(conf):
        lib.vmmalloc_reset_for_tests()
        vmmalloc.configure(conf)
        return Alloc(lib)

    yield make
    lib.vmmalloc_reset_for_tests()


@pytest.fixture(params=BACKENDS)
def backend(request, fresh):
    """Each backend over a 1 GiB host device; skipped while its policy is a placeholder."""
    name = request.param
    a = fresh(f"device:host,capacity_gb:1,log:off,backend:{name}")
    p = a.malloc(4096)
    if not p:
        err = vmmalloc.last_error() or ""
        if "not implemented" in err and not os.environ.get("VMMALLOC_TEST_REQUIRE_ALL_BACKENDS"):
            pytest.skip(f"backend {name} is not implemented yet ({err})")
        pytest.fail(f"backend {name}: first malloc failed: {err}")
    a.free(p, 4096)
    return name
