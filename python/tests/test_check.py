"""``python -m vmmalloc --check`` / ``vmmalloc.check()``: without a driver,
over the fake libcuda (tests/fake-cuda, `cargo build -p fake-cuda`), with a bad
VMMALLOC_CONF, without PyTorch, after CUDA was initialised, and with a library
of another version."""

import os
import re
import subprocess
import sys

import pytest

import vmmalloc
from conftest import PACKAGE_PARENT, REPO

FAKE_CUDA = REPO / "target" / "debug" / "libcuda.so"


def run_check(tmp_path, extra_path=(), **env_extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, extra_path), str(PACKAGE_PARENT)]),
               VMMALLOC_CACHE=str(tmp_path / "cache"))
    env.pop("VMMALLOC_CONF", None)
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-m", "vmmalloc", "--check"], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("verdict: "), out.stdout + out.stderr
    return out, lines[-1]


def have_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def test_check_without_a_driver_says_so(lib, tmp_path):
    out, verdict = run_check(tmp_path, VMMALLOC_CUDA_LIBRARY=str(tmp_path / "no-libcuda.so"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CUDA driver: not found" in out.stdout
    missing = str(tmp_path / "no-libcuda.so")
    assert out.stdout.count(missing) == 1, out.stdout  # the library named once
    assert verdict.startswith("verdict: not usable: ") and "no CUDA driver" in verdict
    # What runs without a GPU (issue 45).
    assert "without a GPU, run the simulator" in verdict and "rl_colocate.py --host" in verdict, verdict
    assert f"library: {vmmalloc.library_path()} (version {vmmalloc.version()})" in out.stdout
    assert "VMMALLOC_CONF: (unset: defaults): parses" in out.stdout
    if have_torch():
        import torch

        assert f"PyTorch: {torch.__version__}" in out.stdout
        assert "CUDA initialised in this process: no" in out.stdout


def fake_cuda():
    if not FAKE_CUDA.is_file():
        if os.environ.get("VMMALLOC_REQUIRE_TORCH") == "1":  # CI: cargo test --workspace builds it
            pytest.fail(f"{FAKE_CUDA} is not built")
        pytest.skip(f"{FAKE_CUDA} is not built (cargo build -p fake-cuda)")
    return str(FAKE_CUDA)


@pytest.mark.skipif(not have_torch(), reason="torch is not installed")
def test_check_over_the_fake_driver(lib, tmp_path):
    out, verdict = run_check(tmp_path, VMMALLOC_CUDA_LIBRARY=fake_cuda(), FAKE_CUDA_DEVICES="2",
                             FAKE_CUDA_PEERS="none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^CUDA driver: \d+\.\d+ \(.*libcuda\.so\), 2 device\(s\)$", out.stdout, re.M), out.stdout
    for i in (0, 1):
        assert re.search(rf"^  GPU {i}: .+: VMM yes, POSIX fd handles yes, peer access to: none$", out.stdout,
                         re.M), out.stdout
    assert "CUDA graph pool hooks: yes" in out.stdout  # PyTorch >= 2.1 has them
    assert "memory functions answered by vmmalloc: memory_stats," in out.stdout
    assert verdict == ("verdict: usable with limits: GPU 0 cannot access every other GPU's memory (peer access); "
                       "GPU 1 cannot access every other GPU's memory (peer access)"), verdict

    out, verdict = run_check(tmp_path, VMMALLOC_CUDA_LIBRARY=fake_cuda(), FAKE_CUDA_DEVICES="2",
                             FAKE_CUDA_PEERS="all")
    assert "  GPU 0: " in out.stdout and "peer access to: 1" in out.stdout
    assert out.returncode == 0 and verdict == "verdict: usable", out.stdout + out.stderr


def test_check_names_a_bad_conf(lib, tmp_path):
    out, verdict = run_check(tmp_path, VMMALLOC_CUDA_LIBRARY=str(tmp_path / "none.so"), VMMALLOC_CONF="colour:red")
    assert out.returncode == 1
    assert "VMMALLOC_CONF: 'colour:red': invalid: " in out.stdout and "colour" in verdict, out.stdout


def test_check_without_torch_says_so(lib, tmp_path):
    hidden = tmp_path / "no-torch" / "torch"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named torch (hidden by the test)')\n")
    out, verdict = run_check(tmp_path, extra_path=[hidden.parent], VMMALLOC_CUDA_LIBRARY=str(tmp_path / "none.so"))
    assert "PyTorch: not installed (No module named torch (hidden by the test))" in out.stdout
    assert "PyTorch is not installed" in verdict and out.returncode == 1


def test_check_in_process_sees_cuda_initialised_and_version_mismatch(lib, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("VMMALLOC_CUDA_LIBRARY", "/nonexistent/libcuda.so")
    r = vmmalloc.check()
    assert "CUDA initialised in this process: yes" in str(r)
    assert any("already initialised" in p for p in r.problems), r.problems
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    r = vmmalloc.check(package_version="0.0.9")
    assert r.verdict == "not usable"
    assert any(f"libvmmalloc {vmmalloc.version()}" in p and "package is 0.0.9" in p for p in r.problems), r.problems
