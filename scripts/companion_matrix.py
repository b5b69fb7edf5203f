"""Compiles the torch companion (python/vmmalloc/companion/vmmalloc_torch.cpp)
against the C++ headers of each PyTorch minor version it supports (issue 35):
every override must reach a virtual method of that version's allocator
interface, with no method left out. What a version's interface does not have
at all is listed by ``vmmalloc._companion.NOT_IN_VERSION`` (and named by
``python -m vmmalloc --check``); a version older than 2.5 is refused by name.

Headers come from the PyTorch wheels (``pip download torch==V --no-deps``,
about 0.9 GB each: only ``torch/include`` and ``torch/version.py`` are kept,
about 60 MB, in ``--cache``); compiling needs no GPU and links nothing
(``-c``). ``--installed`` also builds and links against the PyTorch installed
here, as ``vmmalloc.enable()`` does.

``--runtime`` (issue 40) also runs the companion's tests (python/tests/
test_companion.py, test_companion_conf.py, test_check.py, test_torch.py on
the host backend, no GPU)
under each version: the same wheel is installed, with only the nvidia CUDA
library wheels its own Requires-Dist names (``--no-deps``: no triton, no
Python packages), into a virtual environment over this Python's site-packages
(pytest, and the CUDA runtime headers the companion compiles with), kept in
``--cache``/../torch-runtime/V for the next run; the installed PyTorch's run
uses this Python. VMMALLOC_LIBRARY names the libvmmalloc.so to test
(default target/debug/libvmmalloc.so). Each version's passed/failed/skipped
counts go in the table.

Usage:
    python scripts/companion_matrix.py                      # every supported version
    python scripts/companion_matrix.py --versions 2.5.1 2.15.0 --installed
    python scripts/companion_matrix.py --markdown docs/companion-matrix.md
    python scripts/companion_matrix.py --versions 2.5.1 --installed --runtime 2.5.1   # CI
    python scripts/companion_matrix.py --prepare --runtime 2.5.1   # CI, first: downloads only

``--prepare`` only makes the run-time environments of the ``--runtime``
versions (wheel, headers, nvidia libraries, virtual environment) and exits:
CI runs it in the background while Rust builds, so that the downloads cost no
time of their own (issue 42 item 7); the later run finds them made.

Exit status 0 when every version compiled with nothing left out, 1 otherwise.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from vmmalloc import _companion  # noqa: E402

# The newest patch release of each supported minor version (2026-12-05).
VERSIONS = ("2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0",
            "2.14.1", "2.15.0")


def default_cache():
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vmmalloc" / "torch-headers"


def download(specs, dest, any_python=False):
    """``pip download --no-deps`` of `specs` into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", *specs, "--no-deps", "-q", "-d", str(dest)]
    if any_python:
        # No wheel for this Python: any CPython's will do for headers.
        cmd += ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux1_x86_64",
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(specs)} failed: {(r.stdout + r.stderr)[-800:]}")


def torch_wheel(version, dest):
    """Downloads `version`'s wheel into `dest` (this Python's, else any
    CPython's); returns its path."""
    try:
        download([f"torch=={version}"], dest)
    except RuntimeError:
        download([f"torch=={version}"], dest, any_python=True)
    return next(Path(dest).glob(f"torch-{version}*.whl"))


def headers(version, cache, wheel=None):
    """The torch package directory holding `version`'s include/ (downloaded,
    or taken from `wheel`, and trimmed into `cache` once)."""
    dest = cache / version
    if (dest / "done").is_file():
        return dest / "torch"
    with tempfile.TemporaryDirectory(prefix="vmmalloc-wheel-") as tmp:
        wheel = wheel or torch_wheel(version, tmp)
        part = cache / (version + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("torch/include/") or name == "torch/version.py":
                    z.extract(name, part)
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)
        (dest / "done").touch()
    return dest / "torch"


def abi_of(version):
    """The C++ ABI of the PyPI wheels: the old one before 2.7."""
    return 1 if _companion.version_tuple(version) >= (2, 7) else 0


def check(version, root, abi, link):
    """Compiles against `root`; returns (methods left out, seconds)."""
    t = time.time()
    with tempfile.TemporaryDirectory(prefix="vmmalloc-matrix-") as tmp:
        out = Path(tmp) / ("companion.so" if link else "companion.o")
        lost = _companion.compile_leaving_out(
            lambda d: _companion.compile_command_for(root, version, abi, _companion.SOURCE, out, disabled=d,
                                                     link=link))
    return lost, time.time() - t


def runtime_env(version, cache):
    """The python of a virtual environment with `version` installed for the
    run-time tests (made once, kept beside the header cache); the wheel it
    is made from also gives the headers. Returns (python, seconds spent)."""
    t = time.time()
    env = cache.parent / "torch-runtime" / version
    py = env / "bin" / "python"
    if (env / "done").is_file():
        return py, time.time() - t
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    shutil.rmtree(env, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vmmalloc-runtime-") as tmp:
        wheel = torch_wheel(version, tmp)
        headers(version, cache, wheel)
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        # The CUDA libraries libtorch links (nvidia-*-cu12 ...): the only
        # dependencies `import torch` needs beyond what this Python has.
        nvidia = []
        for line in lines:
            if line.startswith("Requires-Dist: nvidia-"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate():
                    nvidia.append(f"{req.name}{req.specifier}")
        if nvidia:
            download(nvidia, tmp)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env)], check=True)
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                            *map(str, sorted(Path(tmp).glob("*.whl")))], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"installing torch=={version} failed: {(r.stdout + r.stderr)[-800:]}")
    (env / "done").touch()
    return py, time.time() - t


RUNTIME_TESTS = ("python/tests/test_companion.py", "python/tests/test_companion_conf.py", "python/tests/test_check.py",
                 "python/tests/test_torch.py")


def run_tests(python):
    """Runs RUNTIME_TESTS under `python`; returns ((passed, failed,
    skipped), seconds, the output's tail)."""
    t = time.time()
    env = dict(os.environ, VMMALLOC_REQUIRE_TORCH="1")
    env.setdefault("VMMALLOC_LIBRARY", str(ROOT / "target" / "debug" / "libvmmalloc.so"))
    r = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *RUNTIME_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    counts = []
    for word in ("passed", "failed", "skipped"):
        m = re.findall(rf"(\d+) {word}", out.splitlines()[-1] if out.strip() else "")
        counts.append(int(m[-1]) if m else 0)
    errors = re.findall(r"(\d+) errors?", out.splitlines()[-1] if out.strip() else "")
    if errors or (r.returncode != 0 and counts[1] == 0):
        counts[1] += int(errors[-1]) if errors else 1
    return tuple(counts), time.time() - t, out[-3000:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="*", default=list(VERSIONS))
    ap.add_argument("--installed", action="store_true", help="also build and link against the installed PyTorch")
    ap.add_argument("--cache", type=Path, default=default_cache())
    ap.add_argument("--markdown", type=Path, help="write the table there")
    ap.add_argument("--runtime", nargs="*", metavar="VERSION",
                    help="also run the companion's tests under each version (or only those named; "
                         "see the module docs)")
    ap.add_argument("--prepare", action="store_true",
                    help="only make the run-time environments of the --runtime versions, then exit")
    args = ap.parse_args()
    if args.prepare:
        for version in args.runtime or []:
            _companion.check_supported(version)
            _, secs = runtime_env(version, args.cache)
            print(f"{version}: run-time environment ready ({secs:.0f} s)", flush=True)
        return 0
    rows, failed = [], False
    runtime = {}  # label -> "N passed, N failed, N skipped (S s)"
    jobs = [(v, None) for v in args.versions]
    if args.installed:
        import torch

        jobs.append((torch.__version__, Path(torch.__file__).resolve().parent))
    for version, root in jobs:
        link = root is not None
        label = f"{version} (installed)" if link else version
        python = sys.executable if link else None
        wanted = args.runtime is not None and (not args.runtime or version in args.runtime)
        try:
            _companion.check_supported(version)
            if wanted and not link:
                python, secs = runtime_env(version, args.cache)
                print(f"{label}: run-time environment ready ({secs:.0f} s)", flush=True)
            if root is None:
                root = headers(version, args.cache)
            abi = int(bool(getattr(__import__("torch")._C, "_GLIBCXX_USE_CXX11_ABI", True))) if link else abi_of(version)
            lost, secs = check(version, root, abi, link)
            absent = ", ".join(f"{m} (from {v})" for m, v in _companion.absent_in(version)) or "none"
            if lost:
                failed = True
                rows.append((label, f"FAIL: left out {', '.join(lost)}", absent))
            else:
                rows.append((label, f"ok ({secs:.0f} s{', linked' if link else ''})", absent))
        except Exception as e:  # one line per version, the next still runs
            failed = True
            rows.append((label, f"FAIL: {str(e).strip().splitlines()[-1][:300]}", "-"))
        print(f"{rows[-1][0]}: {rows[-1][1]}; not in this version: {rows[-1][2]}", flush=True)
        if wanted:
            if python is None:
                runtime[label] = "not run (no environment)"
                failed = True
                continue
            (passed, fails, skipped), secs, tail = run_tests(python)
            runtime[label] = f"{passed} passed, {fails} failed, {skipped} skipped ({secs:.0f} s)"
            print(f"{label}: run-time tests: {runtime[label]}", flush=True)
            if fails or not passed:
                failed = True
                print(tail, flush=True)
    features = {label: "; ".join(f"{f} (from {v})" for f, v in _companion.absent_features(label.split()[0]))
                or "none" for label, _, _ in rows}
    if args.runtime is not None:
        table = ["| PyTorch | companion build | run-time tests | allocator methods this version does not have |"
                 " what vmmalloc offers that this version does not have |", "|---|---|---|---|---|"]
        table += [f"| {a} | {b} | {runtime.get(a, '-')} | {c} | {features[a]} |" for a, b, c in rows]
    else:
        table = ["| PyTorch | companion build | allocator methods this version does not have |"
                 " what vmmalloc offers that this version does not have |", "|---|---|---|---|"]
        table += [f"| {a} | {b} | {c} | {features[a]} |" for a, b, c in rows]
    if args.markdown:
        args.markdown.write_text("# The torch companion against each PyTorch version\n\n"
                                 f"Written by `python scripts/companion_matrix.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d')}: the companion compiled "
                                 "against each version's headers (`-c`; `linked`: built and linked against "
                                 "the installed PyTorch), every override reaching a virtual method. A "
                                 "method a version does not have is a feature that version does not "
                                 "offer at all; the last column is what `python -m vmmalloc --check` and "
                                 "`vmmalloc.enable()` name for that version (all three from "
                                 "`vmmalloc._companion.NOT_IN_VERSION`). `--runtime`: the companion's "
                                 "tests run under that version (host backend, no GPU).\n\n"
                                 + "\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
