"""The build backend (python/setup.py): without cargo, building fails with one
line saying what to install. (.ci/run tests the successful path: a fresh venv,
`pip install ./python`, and every test against the installed package.)"""

import os
import subprocess
import sys

import pytest

from conftest import PYTHON_DIR


def test_build_without_cargo_says_what_to_install(tmp_path):
    # PATH without any directory holding cargo; the python running pip stays reachable.
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "cargo"))]
    env = dict(os.environ, PATH=os.pathsep.join(dirs))
    env.pop("CARGO", None)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheels"),
                          str(PYTHON_DIR)], env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    if "Could not find a version that satisfies" in text or "No matching distribution" in text:
        pytest.skip("pip cannot fetch the build requirements (setuptools-rust) here")
    assert out.returncode != 0, text
    lines = [line.strip() for line in text.splitlines() if "needs the Rust toolchain" in line]
    assert lines == ["vmmalloc: building libvmmalloc.so needs the Rust toolchain (cargo), which is not on PATH: "
                     "install it with `curl https://sh.rustup.rs -sSf | sh` (https://rustup.rs) or your "
                     "distribution's cargo package, then rerun pip"], text
    assert not list((tmp_path / "wheels").glob("*.whl"))


def test_package_and_cargo_workspace_share_one_version():
    # pyproject.toml reads vmmalloc.__version__; the library returns the workspace
    # version (CARGO_PKG_VERSION): enable() refuses a mismatch, so bump both together.
    import re

    import vmmalloc
    from conftest import REPO

    cargo = (REPO / "Cargo.toml").read_text()
    workspace = re.search(r'^\[workspace\.package\]\nversion = "([^"]+)"', cargo, re.M)
    assert workspace, "no [workspace.package] version in Cargo.toml"
    assert workspace.group(1) == vmmalloc.__version__
    assert 'version = { attr = "vmmalloc.__version__" }' in (PYTHON_DIR / "pyproject.toml").read_text()
