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

Usage:
    python scripts/companion_matrix.py                      # every supported version
    python scripts/companion_matrix.py --versions 2.5.1 2.15.0 --installed
    python scripts/companion_matrix.py --markdown docs/companion-matrix.md

Exit status 0 when every version compiled with nothing left out, 1 otherwise.
"""

import argparse
import os
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


def headers(version, cache):
    """The torch package directory holding `version`'s include/ (downloaded
    and trimmed into `cache` once)."""
    dest = cache / version
    if (dest / "done").is_file():
        return dest / "torch"
    with tempfile.TemporaryDirectory(prefix="vmmalloc-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"torch=={version}", "--no-deps", "-q", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            # No wheel for this Python: any CPython's will do for headers.
            cmd += ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux1_x86_64",
                    "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64"]
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pip download torch=={version} failed: {(r.stdout + r.stderr)[-800:]}")
        wheel = next(Path(tmp).glob("torch-*.whl"))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="*", default=list(VERSIONS))
    ap.add_argument("--installed", action="store_true", help="also build and link against the installed PyTorch")
    ap.add_argument("--cache", type=Path, default=default_cache())
    ap.add_argument("--markdown", type=Path, help="write the table there")
    args = ap.parse_args()
    rows, failed = [], False
    jobs = [(v, None) for v in args.versions]
    if args.installed:
        import torch

        jobs.append((torch.__version__, Path(torch.__file__).resolve().parent))
    for version, root in jobs:
        link = root is not None
        label = f"{version} (installed)" if link else version
        try:
            _companion.check_supported(version)
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
    table = ["| PyTorch | companion build | allocator methods this version does not have |",
             "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    if args.markdown:
        args.markdown.write_text("# The torch companion against each PyTorch version\n\n"
                                 "Written by `python scripts/companion_matrix.py --markdown "
                                 f"{args.markdown}` on {time.strftime('%Y-%m-%d')}: the companion compiled "
                                 "against each version's headers (`-c`; `linked`: built and linked against "
                                 "the installed PyTorch), every override reaching a virtual method. A "
                                 "method a version does not have is a feature that version does not "
                                 "offer at all (`python -m vmmalloc --check` names it).\n\n"
                                 + "\n".join(table) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
