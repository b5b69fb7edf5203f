"""The companion's part of an allocation with PyTorch's memory history off and
on (issue 34), on a machine without a GPU: median nanoseconds per cache-hit
``malloc + free`` pair through the path PyTorch's ``allocate`` / ``raw_delete``
take (the companion's ``companion_malloc`` / ``companion_free`` over
libvmmalloc, host backend), measured side by side in one process:

- ``off``: no recording (the hot path reads one atomic);
- ``events``: ``_record_memory_history(context=None)`` (trace entries, no stacks);
- ``python``: ``_record_memory_history(stacks="python")`` (PyTorch's
  ``CapturedTraceback`` gathered at each allocation and free);
- ``cpp``: ``stacks="all"`` (Python and C++ frames).

Usage: ``python scripts/bench_history.py [--pairs N] [--rounds R]`` after
``cargo build --release -p vmmalloc-capi`` (it uses target/release's
libvmmalloc.so unless VMMALLOC_LIBRARY is set). Prints one JSON line.
On a GPU, scripts/torch_history_checks.py (``cost``) measures the whole
``torch.empty`` + free beside PyTorch's own allocator.
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
    ap.add_argument("--pairs", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
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
    comp = _companion._loaded
    rec = comp.vmmalloc_companion_record_memory_history_for_tests
    rec.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                    ctypes.c_char_p, ctypes.c_size_t]
    bench = comp.vmmalloc_companion_bench_pairs_for_tests
    bench.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                      ctypes.POINTER(ctypes.c_double)]
    err = ctypes.create_string_buffer(1000)

    def record(enabled, context, stacks):
        enc = lambda s: None if s is None else s.encode()
        assert rec(enc(enabled), enc(context), enc(stacks), 100000, 1, err, len(err)) == 0, err.value

    def measure():
        out = ctypes.c_double()
        assert bench(args.size, 0, args.pairs, args.rounds, ctypes.byref(out)) == 0, vmmalloc.last_error()
        return round(out.value, 1)

    result = {"pairs": args.pairs, "rounds": args.rounds, "size": args.size,
              "library": os.environ["VMMALLOC_LIBRARY"]}
    result["off_ns"] = measure()
    record("all", None, "python")
    result["events_ns"] = measure()
    record("all", "all", "python")
    result["python_ns"] = measure()
    record("all", "all", "all")
    result["cpp_ns"] = measure()
    record(None, None, "python")
    result["off_again_ns"] = measure()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
