"""The companion's part of a tensor's allocation and free, beside PyTorch's
pluggable allocator's, on a machine without a GPU (issue 35, item 5): median
nanoseconds per cache-hit pair, measured side by side in one process over
libvmmalloc's host backend:

- ``companion``: what the torch companion's ``allocate`` / ``raw_deleter``
  do (libvmmalloc called directly; the device rides in the DataPtr's context);
- ``pluggable``: what ``CUDAPluggableAllocator::malloc`` / ``raw_delete`` do
  (std::function calls and a pointer map under a mutex), over the same
  libvmmalloc.

Both leave out PyTorch's ``GetDevice`` / ``getCurrentCUDAStream``, the same
either way and impossible without a GPU. Usage: ``python
scripts/bench_hot_path.py [--pairs N] [--rounds R] [--runs K]`` after ``cargo
build --release -p vmmalloc-capi`` (target/release's libvmmalloc.so unless
VMMALLOC_LIBRARY is set). Prints one JSON line per run. On a GPU,
scripts/torch_hot_path.py measures ``torch.empty`` + free against PyTorch's
own allocators.
"""

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=int, default=1 << 20)
    args = ap.parse_args()
    os.environ.setdefault("VMMALLOC_LIBRARY", str(ROOT / "target" / "release" / "libvmmalloc.so"))
    # The bench entry points are test-only: the companion built with the test harness.
    os.environ.setdefault("VMMALLOC_COMPANION_SOURCE", str(ROOT / "python" / "tests" / "companion_test_harness.cpp"))
    sys.path.insert(0, str(ROOT / "python"))
    import torch  # noqa: F401
    import vmmalloc
    from vmmalloc import _companion

    vmmalloc.enable("device:host,capacity_gb:1,log:off,backend:expandable")
    bench = _companion._loaded.vmmalloc_companion_bench_hot_path_for_tests
    bench.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                      ctypes.POINTER(ctypes.c_double)]
    for _ in range(args.runs):
        ours, theirs = ctypes.c_double(), ctypes.c_double()
        assert bench(args.size, args.pairs, args.rounds, ctypes.byref(ours), ctypes.byref(theirs)) == 0, \
            vmmalloc.last_error()
        print(json.dumps({"pairs": args.pairs, "rounds": args.rounds, "size": args.size,
                          "companion_ns": round(ours.value, 1), "pluggable_ns": round(theirs.value, 1),
                          "ratio": round(theirs.value / ours.value, 2),
                          "library": os.environ["VMMALLOC_LIBRARY"]}), flush=True)


if __name__ == "__main__":
    main()
