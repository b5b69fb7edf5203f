"""What the GPU check's PyTorch workloads share (scripts/torch_*.py).

- ``allocator_label()``: which allocator serves this process: ``pytorch``
  (PyTorch's default caching allocator), ``pytorch-es`` (the same with
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), or
  ``vmmalloc:BACKEND`` under the plug-in (``python -m vmmalloc``).
- ``empty()``: ``torch.empty`` that raises ``OutOfMemory`` under any of them.
  PyTorch raises ``torch.cuda.OutOfMemoryError``; vmmalloc raises the same
  with its torch companion, ``RuntimeError("CUDA out of memory. ...")``
  without it, and with ``on_oom:null`` hands PyTorch a NULL pointer that
  PyTorch does not check (so the data pointer is checked too).
- ``peak_reserved()``: the reserved-memory peak as the serving allocator
  counts it.
- ``result()``: prints the one ``RESULT {json}`` line that
  scripts/gpu-check-pytorch.sh collects, at once (flushed), so that a step
  that later runs out of time still reports what it measured.
- ``run_child()``: runs a script again as a child (``script args...``) and
  returns the JSON object its last stdout line holds (the check scripts run
  each allocator in a process of its own).
- ``child_timeout()``: a child's timeout, cut so that it ends before the GPU
  check's step does ($STEP_DEADLINE, epoch seconds, set by gpu-check.sh).
- ``why_no_gpu()``: why a GPU check cannot run here (no PyTorch, no GPU
  visible), or None.
- ``find_cli()``: the vmmalloc CLI ($VMMALLOC_CLI, the bundle's bin/, a
  cargo build, or PATH), or None; a $VMMALLOC_CLI that is not an executable
  raises (the GPU check sets it: a wrong one is a broken check, not a skip).
- ``verify()``: checks that a uint8 tensor holds one value everywhere without
  a temporary the size of the tensor (``torch.sum(t, dtype=torch.int64)``
  materialises an int64 copy eight times as large: issue 25, defect 1).
"""

import json
import os
import shutil
import subprocess
import sys
import time

MIB = 1 << 20
GIB = 1 << 30
# verify() compares slices of this many bytes: a 16 MiB bool temporary at most.
VERIFY_SLICE = 16 * MIB


class OutOfMemory(Exception):
    """An allocation failed for lack of memory, under any allocator."""


def allocator_label():
    """``(label, vmmalloc module or None)`` for the allocator serving this process."""
    try:
        import vmmalloc
    except ImportError:
        vmmalloc = None
    if vmmalloc is not None and vmmalloc.is_enabled():
        backend = "expandable"
        for item in os.environ.get("VMMALLOC_CONF", "").split(","):
            k, _, v = item.partition(":")
            if k.strip() == "backend":
                backend = v.strip()
        # Through the companion (PyTorch's allocator interface in C++, its
        # own hot path), or PyTorch's pluggable allocator over the C ABI.
        path = "" if vmmalloc._companion.installed() else " (pluggable)"
        return f"vmmalloc:{backend}{path}", vmmalloc
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "")
    if "expandable_segments:True" in conf:
        return "pytorch-es", None
    return "pytorch", None


def is_oom(torch, e):
    """True when ``e`` is an out-of-memory error of any allocator."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and str(e).startswith("CUDA out of memory.")


def empty(torch, nbytes):
    """``torch.empty(nbytes, uint8)`` on the GPU; raises OutOfMemory."""
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(torch, e):
            raise
        raise OutOfMemory(str(e).splitlines()[0]) from None
    if nbytes > 0 and t.data_ptr() == 0:
        raise OutOfMemory(f"NULL data pointer for {nbytes} bytes")
    return t


def verify(torch, t, value):
    """True when every byte of the flat uint8 tensor ``t`` equals ``value``."""
    for piece in t.split(VERIFY_SLICE):
        if bool((piece != value).any()):
            return False
    return True


def peak_reserved(torch, vm):
    """Peak reserved bytes of device 0 under the serving allocator."""
    if vm is not None:
        return int(vm.memory_stats(0)["reserved_bytes.all.peak"])
    return int(torch.cuda.max_memory_reserved(0))


def cap_memory(torch, limit_gb):
    """Caps device 0 at ``limit_gb`` GiB (set_per_process_memory_fraction);
    returns the limit in bytes, or None when the GPU is not larger."""
    total = torch.cuda.get_device_properties(0).total_memory
    limit = int(limit_gb * GIB)
    if limit >= total:
        return None
    torch.cuda.set_per_process_memory_fraction(limit / total, 0)
    return limit


def result(fields):
    """Prints ``RESULT {json}`` at once."""
    print("RESULT " + json.dumps(fields), flush=True)
    sys.stdout.flush()


def why_no_gpu():
    """Why a GPU check cannot run here: no PyTorch, or no GPU visible to it;
    None when it can."""
    try:
        import torch
    except ImportError as e:
        return f"no PyTorch ({e})"
    if not torch.cuda.is_available():
        return "no GPU visible to PyTorch (use --host for the dry run)"
    return None


def find_cli():
    """The vmmalloc CLI: $VMMALLOC_CLI, the bundle's bin/, a cargo build, or
    PATH; None when there is none."""
    here = os.path.dirname(os.path.abspath(__file__))
    named = os.environ.get("VMMALLOC_CLI")
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise RuntimeError(f"VMMALLOC_CLI={named} is not an executable")
    for p in (os.path.join(here, "..", "bin", "vmmalloc"),
              os.path.join(here, "..", "target", "release", "vmmalloc"),
              os.path.join(here, "..", "target", "debug", "vmmalloc"), shutil.which("vmmalloc")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def child_timeout(seconds):
    """``seconds``, or less: what is left before $STEP_DEADLINE minus 5 s
    (a tenth of it when under 50 s; at least 1 s), so that a child times out
    with a reason before the GPU check kills the whole step."""
    deadline = os.environ.get("STEP_DEADLINE")
    if deadline:
        try:
            left = float(deadline) - time.time()
        except ValueError:
            return seconds
        left -= 5 if left >= 50 else max(1.0, left / 10)
        return max(1.0, min(seconds, left))
    return seconds


def run_child(script, *args, timeout=120):
    """Runs ``python script args...``; returns the JSON of its last stdout
    line. Raises RuntimeError with the end of its output if it fails or
    times out (``timeout``, cut by child_timeout())."""
    limit = child_timeout(timeout)
    try:
        r = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True,
                           timeout=limit)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"child {args} timed out after {limit:.0f} s") from None
    if r.returncode != 0:
        raise RuntimeError(f"child {args} failed ({r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
