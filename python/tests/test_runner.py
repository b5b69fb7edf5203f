"""vmmalloc.enable() and `python -m vmmalloc`, against a stand-in torch
module that records what PyTorch would be asked to do (the real thing runs
in scripts/gpu-check.sh on a GPU machine)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vmmalloc
from vmmalloc import __main__ as runner
from conftest import PACKAGE_PARENT

FAKE_TORCH = textwrap.dedent('''
    """A stand-in for the parts of torch that vmmalloc.enable() touches."""
    import json, os
    calls = []
    def _log(*a):
        calls.append(a)
        with open(os.environ["FAKE_TORCH_LOG"], "a") as f:
            f.write(json.dumps(a) + "\\n")

    class _Native:
        def set_init_fn(self, p): _log("set_init_fn", p)
        def set_reset_fn(self, p): _log("set_reset_fn", p)
        def set_memory_fraction_fn(self, p): _log("set_memory_fraction_fn", p)
        def set_record_stream_fn(self, p): _log("set_record_stream_fn", p)
        def set_begin_allocate_to_pool(self, p): _log("set_begin_allocate_to_pool", p)
        def set_end_allocate_to_pool_fn(self, p): _log("set_end_allocate_to_pool_fn", p)
        def set_release_pool(self, p): _log("set_release_pool", p)

    class _Memory:
        class CUDAPluggableAllocator:
            def __init__(self, path, alloc, free):
                _log("CUDAPluggableAllocator", path, alloc, free)
                self._a = _Native()
            def allocator(self):
                return self._a
        @staticmethod
        def change_current_allocator(a):
            if os.environ.get("FAKE_TORCH_REFUSE"):
                raise RuntimeError("Can't swap an already initialized allocator")
            _log("change_current_allocator")

    def _torch_own(device=None):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    class cuda:
        memory = _Memory
        memory_allocated = staticmethod(_torch_own)
        @staticmethod
        def is_initialized():
            return bool(os.environ.get("FAKE_TORCH_CUDA_INITIALIZED"))
        @staticmethod
        def current_device():
            return 0
        @staticmethod
        def is_available():
            return not os.environ.get("FAKE_TORCH_NO_GPU")
        @staticmethod
        def _get_device_index(device, optional=False):
            return int(device)
''')


@pytest.fixture
def fake_torch(tmp_path):
    """A directory holding the stand-in `torch` package, for PYTHONPATH."""
    pkg = tmp_path / "fake" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TORCH + textwrap.dedent('''
        # `from torch.cuda.memory import ...` needs the submodules registered.
        import sys, types
        _m = types.ModuleType("torch.cuda.memory")
        _m.CUDAPluggableAllocator = _Memory.CUDAPluggableAllocator
        _m.change_current_allocator = _Memory.change_current_allocator
        _m.memory_allocated = _torch_own
        cuda.memory = _m
        sys.modules["torch.cuda"] = cuda
        sys.modules["torch.cuda.memory"] = _m
    '''))
    return tmp_path / "fake"


def run_py(args, fake, tmp_path, **env_extra):
    log = tmp_path / "torch.log"
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(fake), str(PACKAGE_PARENT)]), FAKE_TORCH_LOG=str(log))
    env.update(env_extra)
    out = subprocess.run([sys.executable] + args, env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    calls = [l for l in log.read_text().splitlines()] if log.exists() else []
    return out, calls


def test_runner_enables_then_runs_script_as_main(lib, fake_torch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import sys, vmmalloc
        assert __name__ == "__main__"
        assert vmmalloc.is_enabled()
        print("ARGV", sys.argv)
        lib = vmmalloc.load()
        p = lib.vmmalloc_malloc(4096, 0, None)
        assert p, vmmalloc.last_error()
        import torch
        st = vmmalloc.memory_stats(0)
        assert torch.cuda.memory_allocated() == torch.cuda.memory.memory_allocated(0) == st["allocated_bytes.all.current"] > 0
        assert torch.cuda.memory.max_memory_reserved(0) == st["reserved_bytes.all.peak"]
        assert torch.cuda.memory._snapshot()["segments"]
        lib.vmmalloc_free(p, 4096, 0, None)
        assert torch.cuda.memory_allocated(0) == 0
        print("STATS", vmmalloc.memory_stats(0)["allocation.all.allocated"])
    '''))
    out, calls = run_py(["-m", "vmmalloc", "--summary", "--snapshot", "at-exit.pickle", "train.py", "--lr", "3"],
                        fake_torch, tmp_path, VMMALLOC_CONF="device:host,backend:native,capacity_gb:1")
    assert out.returncode == 0, out.stderr
    assert "ARGV ['train.py', '--lr', '3']" in out.stdout
    assert "STATS 1" in out.stdout
    # --summary and --snapshot act at exit.
    assert "vmmalloc CUDA memory summary, device ID 0" in out.stderr
    import pickle
    with open(tmp_path / "at-exit.pickle", "rb") as f:
        assert pickle.load(f)["allocator_settings"]["backend"] == "native"
    import json
    calls = [json.loads(c) for c in calls]
    assert calls[0][0] == "CUDAPluggableAllocator"
    assert Path(calls[0][1]).name == "libvmmalloc.so"
    assert calls[0][2:] == ["vmmalloc_malloc", "vmmalloc_free"]
    hooks = {c[0]: c[1] for c in calls[1:8]}
    assert set(hooks) == {"set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_record_stream_fn",
                          "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"}
    assert all(isinstance(p, int) and p > 0 for p in hooks.values())
    assert len(set(hooks.values())) == 7
    # Without a real torch there is no companion: RuntimeError, said once,
    # on one clean line (the runner prints enable()'s warnings as lines).
    assert out.stderr.count("\nvmmalloc: out-of-memory raises RuntimeError") == 1, out.stderr
    assert "UserWarning" not in out.stderr, out.stderr
    assert calls[-1] == ["change_current_allocator"]


def test_hook_pointers_are_the_exports(lib):
    import ctypes
    for _, fn in vmmalloc.HOOKS:
        assert vmmalloc._lib.function_pointer(fn) == ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value


def test_enable_refuses_when_cuda_is_initialised(lib, fake_torch, tmp_path):
    out, calls = run_py(["-c", "import vmmalloc; vmmalloc.enable('device:host')"], fake_torch, tmp_path,
                        FAKE_TORCH_CUDA_INITIALIZED="1")
    assert out.returncode != 0
    assert "CUDA is already initialised" in out.stderr
    assert calls == []


def test_enable_reports_a_refused_swap(lib, fake_torch, tmp_path):
    out, _ = run_py(["-c", "import vmmalloc; vmmalloc.enable('device:host')"], fake_torch, tmp_path,
                    FAKE_TORCH_REFUSE="1")
    assert out.returncode != 0
    assert "already used" in out.stderr


def test_runner_rejects_a_bad_config_before_the_script(lib, fake_torch, tmp_path):
    script = tmp_path / "never.py"
    script.write_text("print('RAN')\n")
    out, calls = run_py(["-m", "vmmalloc", "--conf", "device:host,colour:blue", "never.py"], fake_torch, tmp_path)
    assert out.returncode == 2
    assert "unknown key `colour`" in out.stderr
    assert "RAN" not in out.stdout
    assert calls == []


def test_runner_without_torch_says_so(lib, tmp_path):
    # A `torch` that fails to import hides an installed one (CI installs torch).
    hidden = tmp_path / "no-torch" / "torch"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named torch (hidden by the test)')\n")
    (tmp_path / "s.py").write_text("print('RAN')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hidden.parent), str(PACKAGE_PARENT)]))
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "s.py"], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert "needs PyTorch" in out.stderr
    assert "RAN" not in out.stdout


def test_runner_argument_parsing():
    assert runner.parse(["--conf", "a:b", "x.py", "--conf", "y"]) == (
        {"conf": "a:b", "summary": False, "snapshot": None, "version": False, "help": False, "check": False},
        "script", "x.py", ["--conf", "y"])
    assert runner.parse(["--check"])[0]["check"] is True
    opts, kind, target, args = runner.parse(["--summary", "--snapshot=s.pickle", "-m", "pkg.mod", "-v"])
    assert (opts["summary"], opts["snapshot"], kind, target, args) == (True, "s.pickle", "module", "pkg.mod", ["-v"])
    for bad in ([], ["--conf"], ["--bogus", "x.py"], ["-m"]):
        with pytest.raises(ValueError):
            runner.parse(bad)


def test_runner_version_and_help(lib, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT))
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "--version"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "0.1.0", out.stderr
    out = subprocess.run([sys.executable, "-m", "vmmalloc"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no script" in out.stderr
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "--help"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "python -m vmmalloc [options]" in out.stdout, out.stderr
    assert "``" not in out.stdout, out.stdout


# ---------------------------------------------------------------------------
# Issue 15: the plug-in's messages
# ---------------------------------------------------------------------------


def test_config_errors_print_once_labelled_by_origin(lib, fake_torch, tmp_path):
    (tmp_path / "never.py").write_text("print('RAN')\n")
    out, calls = run_py(["-m", "vmmalloc", "--conf", "device:host,colour:blue", "never.py"], fake_torch, tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("unknown key `colour`") == 1, out.stderr
    assert "--conf: unknown key `colour`" in out.stderr, out.stderr
    assert "VMMALLOC_CONF" not in out.stderr, out.stderr
    out, calls = run_py(["-m", "vmmalloc", "never.py"], fake_torch, tmp_path,
                        VMMALLOC_CONF="device:host,colour:blue")
    assert out.returncode == 2
    assert out.stderr.count("unknown key `colour`") == 1, out.stderr
    assert "VMMALLOC_CONF: unknown key `colour`" in out.stderr, out.stderr
    assert "RAN" not in out.stdout and calls == []


def test_a_missing_script_or_module_is_a_clear_error(lib, fake_torch, tmp_path):
    for args, says in ((["nosuch.py"], "no such script: nosuch.py"),
                       (["-m", "no_such_module_here"], "no module named 'no_such_module_here'")):
        out, calls = run_py(["-m", "vmmalloc"] + args, fake_torch, tmp_path, VMMALLOC_CONF="device:host")
        assert out.returncode == 2, out.stderr
        assert says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert calls == [], "nothing was enabled"


def test_the_runner_prints_the_no_gpu_warning_as_one_line(lib, fake_torch, tmp_path):
    # `python -m vmmalloc` says it as the VMMALLOC_CONF path does: one clean
    # line, not a `UserWarning` with its source line (issue 36).
    script = tmp_path / "noop.py"
    script.write_text("print('RAN')\n")
    out, _ = run_py(["-m", "vmmalloc", str(script)], fake_torch, tmp_path, FAKE_TORCH_NO_GPU="1",
                    VMMALLOC_CONF="", PYTORCH_CUDA_ALLOC_CONF="")
    assert out.returncode == 0 and "RAN" in out.stdout, out.stderr
    lines = [l for l in out.stderr.splitlines() if "no CUDA GPU" in l or "warnings.warn" in l]
    assert len(lines) == 1 and lines[0].startswith("vmmalloc: enabled with device:cuda"), out.stderr
    assert "UserWarning" not in out.stderr, out.stderr


def test_device_cuda_without_a_gpu_says_so(lib, fake_torch, tmp_path):
    code = "import vmmalloc; vmmalloc.enable(); print('ENABLED', vmmalloc.is_enabled())"
    env = {"VMMALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": ""}
    out, _ = run_py(["-c", code], fake_torch, tmp_path, FAKE_TORCH_NO_GPU="1", **env)
    assert out.returncode == 0, out.stderr
    assert "ENABLED True" in out.stdout
    assert "sees no CUDA GPU" in out.stderr and "torch.cuda.is_available() is False" in out.stderr, out.stderr
    # With a GPU, or another device, nothing is said.
    out, _ = run_py(["-c", code], fake_torch, tmp_path, **env)
    assert out.returncode == 0 and "no CUDA GPU" not in out.stderr, out.stderr
    out, _ = run_py(["-c", code.replace("enable()", "enable('device:host')")], fake_torch, tmp_path,
                    FAKE_TORCH_NO_GPU="1", **env)
    assert out.returncode == 0 and "no CUDA GPU" not in out.stderr, out.stderr
    # device:host without a GPU: PyTorch's CUDA tensors still need one, and
    # the warning says what runs on a CPU instead (issue 45).
    assert "enabled with device:host" in out.stderr and 'device="cuda"' in out.stderr, out.stderr
    assert "rl_colocate.py --host" in out.stderr and "simulator" in out.stderr, out.stderr
    out, _ = run_py(["-c", code.replace("enable()", "enable('device:host')")], fake_torch, tmp_path, **env)
    assert out.returncode == 0 and "device:host" not in out.stderr, out.stderr
    # The library reads the configuration, not Python: `=` works and the
    # last value of a key wins (issue 36).
    for conf in ("device=host", "device:cuda,device:host"):
        out, _ = run_py(["-c", code], fake_torch, tmp_path, FAKE_TORCH_NO_GPU="1",
                        VMMALLOC_CONF=conf, PYTORCH_CUDA_ALLOC_CONF="")
        assert out.returncode == 0 and "no CUDA GPU" not in out.stderr, (conf, out.stderr)
    out, _ = run_py(["-c", code], fake_torch, tmp_path, FAKE_TORCH_NO_GPU="1",
                    VMMALLOC_CONF="device:host,device=cuda", PYTORCH_CUDA_ALLOC_CONF="")
    assert "sees no CUDA GPU" in out.stderr, out.stderr


def test_pytorch_cuda_alloc_conf_is_not_ignored_silently(lib, fake_torch, tmp_path):
    from vmmalloc import _pytorch_conf_warning as warn
    assert warn({}) is None and warn({"PYTORCH_CUDA_ALLOC_CONF": " "}) is None
    w = warn({"PYTORCH_CUDA_ALLOC_CONF": "backend:caching"})
    assert "is ignored" in w and w.endswith("VMMALLOC_CONF=backend:caching"), w
    # PyTorch's `native` backend is its caching allocator, not vmmalloc's native.
    assert warn({"PYTORCH_CUDA_ALLOC_CONF": "backend:native,max_split_size_mb:128"}).endswith(
        "VMMALLOC_CONF=backend:caching,max_split_size_mb:128")
    assert warn({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).endswith(
        "VMMALLOC_CONF=backend:caching,expandable_segments:True")
    assert "To ask" not in warn({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    # The library reads the line: a `[...]` list stays one value (issue 36).
    assert warn({"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2],max_split_size_mb:64"}).endswith(
        "VMMALLOC_CONF=roundup_power2_divisions:[256:1,512:2],max_split_size_mb:64")
    out, _ = run_py(["-c", "import vmmalloc; vmmalloc.enable('device:host')"], fake_torch, tmp_path,
                    PYTORCH_CUDA_ALLOC_CONF="backend:caching")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("PYTORCH_CUDA_ALLOC_CONF='backend:caching' is ignored") == 1, out.stderr
