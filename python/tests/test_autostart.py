"""The VMMALLOC_CONF start-up hook (issue 24, vmmalloc/_autostart.py) with the
real PyTorch wheel on the host backend, in fresh interpreters.

How the hook gets into each interpreter here: from a checkout, PYTHONPATH
starts with python/vmmalloc/_site (its sitecustomize.py is what the installed
.pth line does); with ``run.sh --installed`` (.ci/run, after ``pip install
./python`` into a venv) the installed ``vmmalloc-autostart.pth`` does it, and
nothing is added to PYTHONPATH.

"vmmalloc is the current allocator" without a GPU means what PyTorch itself
reports: ``torch._C._cuda_getAllocator()`` is the allocator object enable()
installed (``_autostart.is_current()``) and ``torch.cuda.get_allocator_backend()``
is ``"vmmalloc"`` with the torch companion, ``"pluggable"`` without it (it
is ``"native"`` for PyTorch's own); neither needs CUDA.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import INSTALLED, PACKAGE_PARENT, require_torch

# vmmalloc current: the torch companion's allocator, or PyTorch's plain
# pluggable one where the companion could not be built.
BACKEND = r"(vmmalloc|pluggable)"

torch = require_torch()

HOST = "device:host,capacity_gb:1,log:off"
SITE = PACKAGE_PARENT / "vmmalloc" / "_site"

# What a child prints about itself (one line).
REPORT = '''
def report(label):
    import os, sys, torch, vmmalloc
    from vmmalloc import _autostart
    print(label, "status=%s current=%s backend=%s" % (_autostart.state["status"], _autostart.is_current(),
          torch.cuda.get_allocator_backend()), flush=True)
'''


@pytest.fixture(scope="module")
def cache(companion_cache):
    # The session's torch companion builds for the module's interpreters (conftest.py).
    return companion_cache


def hook_env(cache, conf=HOST, **extra):
    """The environment of a job's process: VMMALLOC_CONF (None: unset) and the hook's way in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VMMALLOC_CONF", "VMMALLOC_STRICT", "PYTORCH_CUDA_ALLOC_CONF", "PYTHONPATH")}
    paths = [str(PACKAGE_PARENT)] if INSTALLED else [str(SITE), str(PACKAGE_PARENT)]
    env.update(PYTHONPATH=os.pathsep.join(paths), VMMALLOC_CACHE=str(cache), PYTHONWARNINGS="ignore")
    if conf is not None:
        env["VMMALLOC_CONF"] = conf
    env.update(extra)
    return env


def py(code, env, cwd, timeout=600, args=()):
    code = REPORT + textwrap.dedent(code[len(REPORT):]) if code.startswith(REPORT) else textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


# device:host where PyTorch sees no GPU: enable() says once that PyTorch's own
# CUDA tensors still need one (issue 45). These tests run there on purpose.
HOST_WITHOUT_GPU = "vmmalloc: enabled with device:host, but PyTorch sees no CUDA device"


def hook_lines(stderr):
    return [line for line in stderr.splitlines()
            if line.startswith("vmmalloc:") and not line.startswith(HOST_WITHOUT_GPU)]


def test_installed_package_has_the_pth():
    if not INSTALLED:
        pytest.skip("checks the installed package (run.sh --installed)")
    pth = PACKAGE_PARENT / "vmmalloc-autostart.pth"
    assert pth.is_file(), f"pip install ./python did not install {pth}"
    assert (PACKAGE_PARENT / "_vmmalloc_autostart.py").is_file()
    assert pth.read_text().strip() == ("import os; 'VMMALLOC_CONF' in os.environ and "
                                       "__import__('_vmmalloc_autostart').install()")


def test_the_hook_imports_neither_torch_nor_the_package(lib, cache, tmp_path):
    out = py('''
        import sys
        hook = sys.modules.get("vmmalloc._autostart")
        print("HOOK", hook is not None and hook.state["installed"])
        print("LOADED", sorted(m for m in ("torch", "vmmalloc", "ctypes") if m in sys.modules))
        print("FINDER", [type(f).__name__ for f in sys.meta_path][:1])
    ''', hook_env(cache), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "HOOK True" in out.stdout, out.stdout + out.stderr
    # Neither torch nor the package (nor ctypes, which the package loads the library with).
    assert "LOADED []" in out.stdout, out.stdout
    assert "FINDER ['_TorchFinder']" in out.stdout, out.stdout
    assert hook_lines(out.stderr) == []


def test_without_the_variable_nothing_happens(lib, cache, tmp_path):
    out = py(REPORT + '''
        import sys
        print("HOOK", [m for m in ("vmmalloc._autostart", "_vmmalloc_autostart") if m in sys.modules])
        import torch
        print("BACKEND", torch.cuda.get_allocator_backend(), "vmmalloc" in sys.modules)
    ''', hook_env(cache, conf=None), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "HOOK []" in out.stdout, out.stdout
    assert "BACKEND native False" in out.stdout, out.stdout
    assert hook_lines(out.stderr) == []


def test_importing_torch_enables_vmmalloc(lib, cache, tmp_path):
    out = py(REPORT + '''
        import ctypes, sys
        import torch
        assert not torch.cuda.is_initialized()
        report("MAIN")
        import vmmalloc
        # The allocator answers: an allocation through the library shows in torch.cuda's figures.
        p = ctypes.c_void_p()
        assert vmmalloc.load().vmmalloc_try_malloc(1 << 20, 0, None, ctypes.byref(p)) == 0
        print("ALLOCATED", torch.cuda.memory_allocated(0))
    ''', hook_env(cache), tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"MAIN status=enabled current=True backend=" + BACKEND, out.stdout), out.stdout + out.stderr
    assert "ALLOCATED 1048576" in out.stdout, out.stdout
    assert hook_lines(out.stderr) == [], out.stderr


def test_an_empty_value_means_the_defaults(lib, cache, tmp_path):
    # device:cuda (the default) with no GPU: enabled, and enable()'s no-GPU warning, as one line.
    out = py(REPORT + "import torch; report('MAIN')", hook_env(cache, conf=""), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "MAIN status=enabled current=True" in out.stdout, out.stdout + out.stderr
    lines = hook_lines(out.stderr)
    assert len(lines) == 1 and "sees no CUDA GPU" in lines[0], out.stderr


def test_pytorch_cuda_alloc_conf_too_warns_once_with_the_equivalent(lib, cache, tmp_path):
    out = py(REPORT + "import torch; report('MAIN')",
             hook_env(cache, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True,max_split_size_mb:64"), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "MAIN status=enabled current=True" in out.stdout, out.stdout + out.stderr
    lines = hook_lines(out.stderr)
    assert len(lines) == 1, out.stderr
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,max_split_size_mb:64' is ignored" in lines[0]
    assert lines[0].endswith("VMMALLOC_CONF=backend:caching,expandable_segments:True,max_split_size_mb:64")


# CUDA initialised before the hook could act. The hook acts at the first `import torch`, before which
# PyTorch cannot have initialised CUDA; the way to be late is a hook installed after torch was imported
# and CUDA initialised (install() then enables at once). Without a GPU, CUDA's initialisation is what
# torch.cuda._lazy_init leaves behind: `torch.cuda._initialized = True` (torch/cuda/__init__.py), the
# flag torch.cuda.is_initialized() reads and enable() checks before swapping the allocator.
LATE = REPORT + '''
    import os, torch
    torch.cuda._initialized = True
    assert torch.cuda.is_initialized()
    os.environ["VMMALLOC_CONF"] = "%s"
    import vmmalloc._autostart as hook
    hook.install()
    report("LATE")
''' % HOST


def test_cuda_initialised_first_warns_and_keeps_pytorchs_allocator(lib, cache, tmp_path):
    out = py(LATE, hook_env(cache, conf=None), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "LATE status=fallback current=False backend=native" in out.stdout, out.stdout + out.stderr
    lines = hook_lines(out.stderr)
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("vmmalloc: warning: VMMALLOC_CONF is set but vmmalloc is not enabled: CUDA is "
                               "already initialised"), lines
    assert "PyTorch's own allocator stays (VMMALLOC_STRICT=1 makes this an error)" in lines[0]


def test_strict_makes_the_fallback_an_error(lib, cache, tmp_path):
    out = py(LATE, hook_env(cache, conf=None, VMMALLOC_STRICT="1"), tmp_path)
    assert out.returncode != 0
    assert "LATE" not in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith(
        "vmmalloc._autostart.StrictError: vmmalloc: VMMALLOC_CONF is set but vmmalloc cannot be PyTorch's "
        "allocator: CUDA is already initialised"), out.stderr


def test_a_library_that_cannot_be_loaded_falls_back(lib, cache, tmp_path):
    if INSTALLED:
        pytest.skip("VMMALLOC_LIBRARY must stay unset for the installed package's tests")
    out = py(REPORT + "import torch; report('MAIN')",
             hook_env(cache, VMMALLOC_LIBRARY=str(tmp_path / "missing.so")), tmp_path)
    assert out.returncode == 0, out.stderr
    assert "MAIN status=fallback current=False backend=native" in out.stdout, out.stdout + out.stderr
    lines = hook_lines(out.stderr)
    assert len(lines) == 1 and "libvmmalloc.so cannot be loaded" in lines[0] and "missing.so" in lines[0], lines


def test_python_m_vmmalloc_keeps_working_with_the_hook(lib, cache, tmp_path):
    (tmp_path / "s.py").write_text(REPORT + "import torch; report('SCRIPT')\n")
    env = hook_env(cache)
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "--conf", HOST + ",backend:native", "s.py"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    # enable() imported torch itself: the hook left it to --conf.
    assert re.search(r"SCRIPT status=deferred current=True backend=" + BACKEND, out.stdout), out.stdout + out.stderr


BAD = HOST + ",colour:blue"
BAD_LINE = "vmmalloc._lib.VmmallocError: vmmalloc: VMMALLOC_CONF: unknown key `colour`"


def _last_bad_line(stderr):
    lines = [line for line in stderr.splitlines() if line.startswith(BAD_LINE)]
    return lines


def test_a_bad_conf_is_an_error_at_import_torch(lib, cache, tmp_path):
    out = py("import torch; print('RAN')", hook_env(cache, conf=BAD), tmp_path)
    assert out.returncode != 0 and "RAN" not in out.stdout
    assert len(_last_bad_line(out.stderr)) == 1, out.stderr
    # A process that never imports torch is not concerned.
    out = py("print('RAN')", hook_env(cache, conf=BAD), tmp_path)
    assert out.returncode == 0 and "RAN" in out.stdout and out.stderr == ""


def torchrun():
    # The `torchrun` console script is `torch.distributed.run:main`; through this interpreter, so that a
    # venv's (run.sh --installed) is the one that starts the workers, not whatever `torchrun` PATH finds.
    return [sys.executable, "-m", "torch.distributed.run"]


RANK_SCRIPT = REPORT + '''
import os
report("RANK%s" % os.environ["RANK"])
'''


def test_torchrun_two_processes_each_enabled(lib, cache, tmp_path):
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    out = subprocess.run(torchrun() + ["--standalone", "--nproc_per_node=2", "rank.py"], env=hook_env(cache),
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert re.search(fr"RANK{rank} status=enabled current=True backend=" + BACKEND, out.stdout), out.stdout + out.stderr


def test_torchrun_bad_conf_same_error_in_every_child(lib, cache, tmp_path):
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    out = subprocess.run(torchrun() + ["--standalone", "--nproc_per_node=2", "rank.py"],
                         env=hook_env(cache, conf=BAD), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "RANK" not in out.stdout
    # torchrun itself imports torch: the launcher fails first, with the same line, before any child runs.
    # (Each child fails the same way when the launcher does not import torch: test below.)
    assert len(set(_last_bad_line(out.stderr))) == 1, out.stderr


SPAWN_PARENT = REPORT + '''
import sys, torch, torch.multiprocessing as mp

def child(i):
    report("CHILD%d" % i)

if __name__ == "__main__":
    report("PARENT")
    mp.spawn(child, nprocs=1)
'''


def test_a_spawned_child_is_enabled_too(lib, cache, tmp_path):
    (tmp_path / "spawn.py").write_text(SPAWN_PARENT)
    out = subprocess.run([sys.executable, "spawn.py"], env=hook_env(cache), cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"PARENT status=enabled current=True backend=" + BACKEND, out.stdout), out.stdout + out.stderr
    assert re.search(r"CHILD0 status=enabled current=True backend=" + BACKEND, out.stdout), out.stdout + out.stderr


# A launcher that does not import torch (srun, mpirun, a shell loop, multiprocessing without torch):
# every child meets the bad configuration at its own `import torch`, with the parent's message.
CHILDREN_BAD = '''
import multiprocessing as mp, sys

def child():
    import torch

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=child) for _ in range(2)]
    for p in procs: p.start()
    for p in procs: p.join()
    print("EXITCODES", [p.exitcode for p in procs])
    assert "torch" not in sys.modules
'''


def test_bad_conf_same_error_in_every_spawned_child(lib, cache, tmp_path):
    (tmp_path / "children.py").write_text(CHILDREN_BAD)
    env = hook_env(cache, conf=BAD)
    out = subprocess.run([sys.executable, "children.py"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "EXITCODES [1, 1]" in out.stdout, out.stdout + out.stderr
    lines = _last_bad_line(out.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], out.stderr
    parent = py("import torch", env, tmp_path)
    assert _last_bad_line(parent.stderr) == lines[:1], parent.stderr


def test_the_startup_bench_runs_and_sees_the_hook_only_when_asked(tmp_path):
    # The measurement itself is quoted in docs/pytorch.md; here it must only keep working.
    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_startup.py"), "--runs", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("not installed: False (False); installed: False (False); installed, VMMALLOC_CONF set: True (False)"
            in out.stdout), out.stdout
    assert "median of 1 interleaved runs" in out.stdout and out.stdout.count(" ms ") == 3, out.stdout


def test_the_self_check_reports_a_bad_conf_under_the_hook(lib, cache, tmp_path):
    # `python -m vmmalloc --check` imports torch: the hook must let the diagnosis report the key.
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "--check"], env=hook_env(cache, conf=BAD), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "verdict: not usable: VMMALLOC_CONF does not parse (VMMALLOC_CONF: unknown key `colour`" in out.stdout


def test_the_gpu_activation_checks_skip_cleanly_without_a_gpu(lib, tmp_path):
    # scripts/torch_activation_checks.py runs on the GPU box; here it must parse, find the package,
    # say in one line that it cannot run and why, and exit 3 (the GPU check's code for "did not
    # run": scripts/gpu-check-pytorch.sh shows SKIP for it, never PASS; issue 44).
    from conftest import REPO

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/torch_activation_checks.py runs for real")
    script = REPO / "scripts" / "torch_activation_checks.py"
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["torch_activation_checks: cannot run: no CUDA device"], out.stdout
    bad = subprocess.run([sys.executable, str(script), "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage:" in bad.stderr
