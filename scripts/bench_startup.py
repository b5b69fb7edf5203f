#!/usr/bin/env python3
"""What the VMMALLOC_CONF start-up hook costs every Python process: the
wall time of ``python -c pass`` without and with the package installed
(its ``vmmalloc-autostart.pth`` in a site directory), and with it installed
and ``VMMALLOC_CONF`` set (the hook is loaded and waits for ``import torch``,
which never comes). Medians over interleaved runs, side by side.

    python3 scripts/bench_startup.py [--runs 41] [--python PYTHON]

"Installed" is the layout ``pip install ./python`` makes (the package, the
top-level ``_vmmalloc_autostart.py`` and the .pth in site-packages), built
in a user site directory (``PYTHONUSERBASE``), which ``site`` processes the
same way (``addsitedir``: .pth lines run); "not installed" is an empty user
site directory, so both pay the same directory scan. Nothing is timed in a
test: this is a measurement to quote (docs/pytorch.md).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(ROOT, "python")


def user_site(python, base):
    env = dict(os.environ, PYTHONUSERBASE=base)
    env.pop("PYTHONNOUSERSITE", None)
    out = subprocess.run([python, "-c", "import site; print(site.ENABLE_USER_SITE, site.getusersitepackages())"],
                         env=env, capture_output=True, text=True, check=True)
    enabled, path = out.stdout.split(maxsplit=1)
    if enabled != "True":
        raise SystemExit(f"bench_startup: {python} has no user site directory (a virtual environment without "
                         f"--system-site-packages?): run it with another --python")
    return path.strip()


def install_into(site_dir):
    """The files `pip install ./python` puts in site-packages (the library aside: the hook never loads it)."""
    os.makedirs(site_dir, exist_ok=True)
    shutil.copytree(os.path.join(PYTHON_DIR, "vmmalloc"), os.path.join(site_dir, "vmmalloc"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("_vmmalloc_autostart.py", "vmmalloc-autostart.pth"):
        shutil.copy(os.path.join(PYTHON_DIR, name), os.path.join(site_dir, name))


def timed(python, env):
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=41)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vmmalloc-startup-") as tmp:
        without_base, with_base = os.path.join(tmp, "without"), os.path.join(tmp, "with")
        os.makedirs(user_site(args.python, without_base), exist_ok=True)
        install_into(user_site(args.python, with_base))
        base = {k: v for k, v in os.environ.items()
                if k not in ("VMMALLOC_CONF", "PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE")}
        envs = {
            "not installed": dict(base, PYTHONUSERBASE=without_base),
            "installed": dict(base, PYTHONUSERBASE=with_base),
            "installed, VMMALLOC_CONF set": dict(base, PYTHONUSERBASE=with_base, VMMALLOC_CONF=""),
        }
        # The installed layout really runs the hook (and only when asked), or the figures mean nothing.
        probe = "import sys; print('vmmalloc._autostart' in sys.modules, 'vmmalloc' in sys.modules)"
        seen = {name: subprocess.run([args.python, "-c", probe], env=env, capture_output=True, text=True,
                                     check=True).stdout.split() for name, env in envs.items()}
        print(f"hook loaded (and the vmmalloc package imported): "
              + "; ".join(f"{name}: {s[0]} ({s[1]})" for name, s in seen.items()))
        if seen["installed, VMMALLOC_CONF set"] != ["True", "False"] or seen["installed"] != ["False", "False"]:
            print("bench_startup: the installed layout does not behave as the .pth should", file=sys.stderr)
            return 1
        for env in envs.values():  # warm the page cache and the bytecode caches
            timed(args.python, env)
        times = {name: [] for name in envs}
        for _ in range(args.runs):
            for name, env in envs.items():
                times[name].append(timed(args.python, env))
    print(f"python -c pass, median of {args.runs} interleaved runs ({args.python}):")
    for name, ts in times.items():
        print(f"  {name:<30} {statistics.median(ts) * 1e3:8.1f} ms   (min {min(ts) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
