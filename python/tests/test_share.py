"""A budget shared by processes on one GPU through Python (docs/share.md):
share_info, share_set_cap, share_set_total over device:host, a stale
revision refused, a process without share:NAME told so, and a second
process (a real one) charging the same group."""

import os
import subprocess
import sys
import time

import pytest

import vmmalloc
from conftest import MIB, PACKAGE_PARENT, REPO


@pytest.fixture
def share_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VMMALLOC_SHARE_DIR", str(tmp_path))
    return tmp_path


def _me(g):
    return next(m for m in g["members"] if m["pid"] == os.getpid())


def test_a_member_lowers_its_cap_and_gives_back(lib, fresh, share_dir):
    name = f"py{os.getpid()}"
    a = fresh(f"device:host,capacity_gb:2,log:off,backend:expandable,share:{name}")
    g = vmmalloc.share_info()
    assert g["name"] == name and g["total"] == 2 << 30 and g["me"] == os.getpid()
    assert _me(g)["cap"] is None and _me(g)["used"] == 0
    p = a.malloc(256 * MIB)
    assert p, vmmalloc.last_error()
    a.free(p, 256 * MIB)
    assert _me(vmmalloc.share_info())["used"] >= 256 * MIB
    rev = vmmalloc.share_info()["revision"]
    assert vmmalloc.share_set_cap(64 * MIB, revision=rev) == rev + 1
    deadline = time.monotonic() + 10
    while _me(vmmalloc.share_info())["used"] > 64 * MIB:
        assert time.monotonic() < deadline, vmmalloc.share_info()
        time.sleep(0.005)
    m = _me(vmmalloc.share_info())
    assert (m["cap"], m["state"]) == (64 * MIB, "active")
    with pytest.raises(vmmalloc.VmmallocError, match="stale"):
        vmmalloc.share_set_cap(None, revision=rev)
    assert vmmalloc.share_set_cap(None) > rev
    assert _me(vmmalloc.share_info())["cap"] is None
    assert vmmalloc.share_set_total(1 << 30) > rev
    assert vmmalloc.share_info()["total"] == 1 << 30
    with pytest.raises(TypeError):
        vmmalloc.share_set_cap("8GiB")
    with pytest.raises(ValueError):
        vmmalloc.share_set_total(-1)


def test_without_share_the_calls_say_so(lib, fresh, share_dir):
    fresh("device:host,capacity_gb:1,log:off")
    with pytest.raises(vmmalloc.VmmallocError, match="share:NAME"):
        vmmalloc.share_info()
    with pytest.raises(vmmalloc.VmmallocError, match="not a member"):
        vmmalloc.share_set_cap(MIB)


CHILD = r"""
import ctypes, sys, vmmalloc
vmmalloc.configure(sys.argv[1])
lib = vmmalloc._lib.load()
out = ctypes.c_void_p()
rc = lib.vmmalloc_try_malloc(int(sys.argv[2]), 0, None, ctypes.byref(out))
print("rc", rc, flush=True)
sys.stdin.readline()
"""


def test_two_processes_charge_one_total(lib, fresh, share_dir):
    name = f"py2-{os.getpid()}"
    conf = f"device:host,capacity_gb:1,log:off,backend:expandable,share:{name}"
    a = fresh(conf)
    held = a.malloc(768 * MIB)
    assert held, vmmalloc.last_error()
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), VMMALLOC_LIBRARY=vmmalloc.library_path())
    child = subprocess.Popen([sys.executable, "-c", CHILD, conf, str(512 * MIB)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate("\n", timeout=60)
    finally:
        child.kill()
    # 768 MiB here + 512 MiB there > the 1 GiB total: the child is refused.
    assert "rc 1" in out, out
    a.free(held, 768 * MIB)
    assert len(vmmalloc.share_info()["members"]) == 1


def test_gpu_check_script_dry_run_on_the_host(lib):
    # scripts/torch_share_checks.py (the GPU check's `share` part) in its
    # --host mode: two member processes under one total, one shrinks from
    # outside (the CLI when built, else from inside) while the other grows;
    # keeps the script from rotting between GPU runs.
    script = REPO / "scripts" / "torch_share_checks.py"
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), VMMALLOC_LIBRARY=vmmalloc.library_path())
    env.pop("VMMALLOC_CONF", None)
    # The CLI the tests were given (run.sh: the one just built), else none:
    # an older build lying around may lack `share`.
    args = ["--host"] if os.environ.get("VMMALLOC_CLI") else ["--host", "--no-cli"]
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    for check in ("group", "over_total_refused", "shrinks", "grows", "capped_member_cannot_grow",
                  "bytes_intact", "never_above_total"):
        assert f"CHECK {check}: ok" in text, text
