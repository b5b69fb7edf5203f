"""vmmalloc.enable() against the real torch module (installed from PyPI; it
imports without a GPU). Skipped, with the reason, only where torch is not
installed, and never in CI: .ci/run installs torch and sets
VMMALLOC_REQUIRE_TORCH=1, which turns the skip into a failure."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import PACKAGE_PARENT, require_torch

require_torch()

import vmmalloc  # noqa: E402
from vmmalloc import _companion  # noqa: E402


def run(code, tmp_path, cache=None, **env_extra):
    """Runs `code` in a fresh interpreter; companions built into `cache` (the
    session's, conftest.py) or a directory of this test's own."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), VMMALLOC_CACHE=str(cache or tmp_path / "cache"))
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)


def test_enable_patches_the_real_torch(lib, tmp_path, companion_cache):
    out = run('''
        import ctypes, pickle, warnings
        import torch, vmmalloc
        from vmmalloc import _torch
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the companion builds: no RuntimeError warning
            # but the one for device:host without a GPU, where this runs (issue 45)
            warnings.filterwarnings("ignore", message="vmmalloc: enabled with device:host")
            # and, on an older PyTorch, the one naming what it lacks (issue 40)
            warnings.filterwarnings("ignore", message="vmmalloc: PyTorch .* does not have")
            vmmalloc.enable("device:host,capacity_gb:1,log:off,backend:expandable")
        assert not torch.cuda.is_initialized()
        assert vmmalloc.oom_exception()[0] == "torch.cuda.OutOfMemoryError", vmmalloc.oom_exception()
        for name in _torch.PATCHED:
            if name in _torch.SNAPSHOT_FUNCTIONS:
                # The companion answers PyTorch's own (test_companion.py's history tests).
                assert getattr(torch.cuda.memory, name).__module__ == "torch.cuda.memory", name
                continue
            assert getattr(torch.cuda.memory, name) is getattr(_torch, name), name
            if not name.startswith("_"):
                assert getattr(torch.cuda, name) is getattr(_torch, name), name
        # Allocate through the library (no GPU here for a tensor), read through torch.
        lib = vmmalloc.load()
        out = ctypes.c_void_p()
        assert lib.vmmalloc_try_malloc(3 << 20, 0, None, ctypes.byref(out)) == 0
        st = vmmalloc.memory_stats(0)
        assert torch.cuda.memory_allocated(0) == st["allocated_bytes.all.current"] >= 3 << 20
        assert torch.cuda.memory.memory_reserved(0) == st["reserved_bytes.all.current"] > 0
        assert torch.cuda.max_memory_allocated(0) == st["allocated_bytes.all.peak"]
        assert torch.cuda.max_memory_reserved(0) == st["reserved_bytes.all.peak"]
        assert torch.cuda.memory_stats(0)["allocation.all.current"] == 1
        assert torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["all"]["current"] == st["allocated_bytes.all.current"]
        assert "vmmalloc" in torch.cuda.memory_summary(0)
        snap = torch.cuda.memory._snapshot()
        assert sum(s["allocated_size"] for s in snap["segments"]) == st["allocated_bytes.all.current"]
        torch.cuda.memory._dump_snapshot("snap.pickle")
        with open("snap.pickle", "rb") as f:
            assert pickle.load(f)["segments"]
        lib.vmmalloc_free(out, 0, 0, None)
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0) == 0
        # device=None means the current device; with no GPU here, stand in for it.
        torch.cuda.current_device = lambda: 0
        assert torch.cuda.memory_allocated() == 0
        # The scripts that use the deprecated names keep working too.
        torch.cuda.reset_max_memory_allocated(0)
        print("PATCHED OK")
    ''', tmp_path, companion_cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PATCHED OK" in out.stdout


def test_enable_refuses_a_library_of_another_version(lib, tmp_path):
    # The real library (0.1.0) under a package that says it is another version.
    out = run('''
        import torch, vmmalloc
        assert vmmalloc.version() == vmmalloc.__version__
        vmmalloc.__version__ = "0.0.9"
        try:
            vmmalloc.enable("device:host,capacity_gb:1,log:off")
        except vmmalloc.VmmallocError as e:
            print("REFUSED", e)
        assert not vmmalloc.is_enabled()
    ''', tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert f"libvmmalloc {vmmalloc.version()}" in out.stdout and "package is 0.0.9" in out.stdout, out.stdout


def test_without_companion_oom_is_a_runtime_error_said_once(lib, tmp_path):
    out = run('''
        import vmmalloc
        vmmalloc.enable("device:host,capacity_gb:1,log:off")
        print("MODE", vmmalloc.oom_exception()[0])
    ''', tmp_path, VMMALLOC_COMPANION="0")
    assert out.returncode == 0, out.stderr
    assert "MODE RuntimeError" in out.stdout
    assert out.stderr.count("UserWarning: vmmalloc: out-of-memory raises RuntimeError") == 1


CHECKER = r"""
// Throws through libvmmalloc's shim with the companion registered and catches
// the exact type PyTorch translates to torch.cuda.OutOfMemoryError.
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <cstdio>
#include <string>
int main(int argc, char** argv) {
  void* vm = dlopen(argv[1], RTLD_NOW);
  void* comp = dlopen(argv[2], RTLD_NOW);
  if (!vm || !comp) { std::printf("dlopen: %s\n", dlerror()); return 1; }
  auto configure = (int (*)(const char*))dlsym(vm, "vmmalloc_configure");
  auto malloc_fn = (void* (*)(size_t, int, void*))dlsym(vm, "vmmalloc_malloc");
  auto set_thrower = (void (*)(void (*)(const char*)))dlsym(vm, "vmmalloc_set_oom_thrower");
  auto thrower = (void (*)(const char*))dlsym(comp, "vmmalloc_companion_throw_oom");
  set_thrower(thrower);
  if (configure("device:host,capacity_gb:0.0625,log:off") != 0) return 1;
  if (!malloc_fn(40 << 20, 0, nullptr)) return 1;
  try {
    malloc_fn(40 << 20, 0, nullptr);
  } catch (const c10::OutOfMemoryError& e) {
    std::printf("CAUGHT %s\n", e.msg().c_str());
    return e.msg().rfind("CUDA out of memory.", 0) == 0 ? 0 : 1;
  }
  std::printf("no exception\n");
  return 1;
}
"""


def test_companion_throws_c10_out_of_memory_error(lib, tmp_path):
    import torch

    companion = _companion.build(torch, tmp_path / "companion.so")
    src = tmp_path / "checker.cpp"
    src.write_text(CHECKER)
    exe = tmp_path / "checker"
    cmd = _companion.compile_command(torch, src, exe, shared=False) + ["-ldl"]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe), vmmalloc.library_path(), str(companion)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CAUGHT CUDA out of memory. vmmalloc: " in out.stdout
    assert "Tried to allocate 40.00 MiB" in out.stdout
