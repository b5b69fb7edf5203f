"""PyTorch's memory debugging tools under vmmalloc on a real GPU (issue 34).

1. ``history``: ``torch.cuda.memory._record_memory_history(stacks="python")``
   under vmmalloc during a small training loop of varying batch sizes; an
   out-of-memory is forced (``set_per_process_memory_fraction``) and the
   out-of-memory observer dumps the snapshot (``_dump_snapshot``), as
   PyTorch's docs show. Checked: the trace has alloc / free / segment_map /
   oom entries with the training function's frames; ``torch.cuda._memory_viz``'s
   ``segsum`` and ``trace``, which parse the snapshot, print a summary of it
   (``segment_plot``/``trace_plot`` only embed the pickle in HTML: not run).
   ``history-replay``: ``vmmalloc replay`` of the file ($VMMALLOC_CLI, the
   bundle's CLI under the GPU check; SKIP without one) reports the run's
   peak of requested bytes (``requested_bytes.all.peak`` since recording
   began) as its "peak live (trace)".
2. ``cudnn``: a convolution net trained a few steps with
   ``torch.backends.cudnn.benchmark = True`` (cudnn sizes its workspace with
   ``cacheInfo``) under vmmalloc and under PyTorch's default allocator: both
   run, and the losses agree to 1e-3 relative (benchmark mode picks
   algorithms by timing and by the workspace ``cacheInfo`` offers, so the
   two runs need not be bitwise equal).
3. ``cost``: median microseconds of ``torch.empty`` + free (1 MiB, cache
   hits) with recording off and on (``stacks="python"``), under vmmalloc and
   under PyTorch's default allocator, side by side in one run each.
   Report-only: its RESULT line carries the figures, nothing is judged.

Run plainly: ``python scripts/torch_history_checks.py`` (it starts its own
children). Prints ``CHECK name: ok`` or ``CHECK name: FAIL reason`` lines;
exit 1 if any failed, 3 when it cannot run here (no CUDA device).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common  # noqa: E402


def child_history(out_dir):
    import torch
    import vmmalloc

    vmmalloc.enable("backend:expandable")
    torch.manual_seed(0)
    width = 1024
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    dump = os.path.join(out_dir, "oom.pickle")

    def on_oom(device, alloc, device_alloc, device_free):
        torch.cuda.memory._dump_snapshot(dump)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")

    def training_step(batch):
        x = torch.randn(batch, width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for batch in (64, 512, 128, 1024, 256, 96, 768):
        training_step(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    oom = False
    try:
        torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        oom = True
    print(json.dumps({"oom": oom, "dump": dump, "peak": peak,
                      "enabled": torch._C._cuda_isHistoryEnabled()}))


def child_cudnn(alloc):
    import torch

    if alloc == "vmmalloc":
        import vmmalloc

        vmmalloc.enable("backend:expandable")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    losses = []
    for step, size in enumerate((64, 96, 64, 128)):
        g = torch.Generator(device="cuda").manual_seed(step)
        x = torch.randn(32, 3, size, size, device="cuda", generator=g)
        y = torch.randint(0, 10, (32,), device="cuda", generator=g)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    print(json.dumps({"losses": losses}))


def child_cost(alloc):
    import statistics

    import torch

    if alloc == "vmmalloc":
        import vmmalloc

        vmmalloc.enable("backend:expandable")
    torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def median_us(n=2000, rounds=7):
        meds = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(n):
                x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
                del x
            meds.append((time.perf_counter() - t) / n * 1e6)
        return statistics.median(meds)

    off = median_us()
    torch.cuda.memory._record_memory_history(max_entries=10000, stacks="python")
    on = median_us()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"off_us": off, "on_us": on}))


def run_child(*args):
    return torch_common.run_child(__file__, *args)


def check_history():
    import pickle

    from torch.cuda import _memory_viz

    out_dir = tempfile.mkdtemp(prefix="vmmalloc-history-")
    r = run_child("history", out_dir)
    if not r["oom"] or not os.path.isfile(r["dump"]):
        raise RuntimeError(f"no out-of-memory or no dump: {r}")
    with open(r["dump"], "rb") as f:
        snap = pickle.load(f)
    trace = [e for t in snap["device_traces"] for e in t]
    actions = {e["action"] for e in trace}
    for needed in ("alloc", "free_requested", "free_completed", "oom"):
        if needed not in actions:
            raise RuntimeError(f"no {needed} entry: {sorted(actions)}")
    if not actions & {"segment_map", "segment_alloc"}:
        raise RuntimeError(f"no segment entry: {sorted(actions)}")
    named = [e for e in trace if e["action"] == "alloc"
             and any(f["name"] == "training_step" for f in e.get("frames", []))]
    if not named:
        raise RuntimeError("no alloc entry carries the training_step frame")
    # segsum and trace parse the snapshot (segment_plot / trace_plot would
    # only embed the pickle in HTML).
    for fn in (_memory_viz.segsum, _memory_viz.trace):
        text = fn(snap)
        if not text or len(text.splitlines()) < 2:
            raise RuntimeError(f"_memory_viz.{fn.__name__} printed nothing: {text!r:.200}")
    HISTORY["dump"], HISTORY["peak"] = r["dump"], r["peak"]
    return f"{len(trace)} entries; actions {sorted(actions)}; segsum and trace parse the dump"


def check_replay():
    if "dump" not in HISTORY:
        raise RuntimeError("no dump: the history check failed")
    exe = torch_common.find_cli()
    if exe is None:
        raise Skip("no vmmalloc CLI (set VMMALLOC_CLI)")
    rep = subprocess.run([exe, "replay", HISTORY["dump"], "--policy", "expandable"], capture_output=True,
                         text=True, timeout=torch_common.child_timeout(120))
    if rep.returncode != 0:
        raise RuntimeError(f"vmmalloc replay failed: {(rep.stdout + rep.stderr)[-800:]}")
    m = re.search(r"peak live \(trace\)\s+.*\((\d+) bytes\)", rep.stdout)
    if not m:
        raise RuntimeError(f"no peak in: {rep.stdout[-800:]}")
    if int(m.group(1)) != HISTORY["peak"]:
        raise RuntimeError(f"replay peak {m.group(1)} != run's peak {HISTORY['peak']}")
    return f"replay peak {int(m.group(1))} bytes = run's ({exe})"


def check_cudnn():
    ours = run_child("cudnn", "vmmalloc")
    theirs = run_child("cudnn", "pytorch")
    a, b = ours["losses"], theirs["losses"]
    if len(a) != len(b) or any(abs(x - y) > 1e-3 * max(abs(y), 1e-6) for x, y in zip(a, b)):
        raise RuntimeError(f"losses differ beyond 1e-3 relative: {a} vs {b}")
    return f"losses {a} (PyTorch's: {b})"


def check_cost():
    ours = run_child("cost", "vmmalloc")
    theirs = run_child("cost", "pytorch")
    torch_common.result({"script": "torch_history_checks", "check": "history-cost",
                         "allocator": "vmmalloc:expandable", "vmmalloc": ours, "pytorch": theirs})
    return (f"report-only: torch.empty+free median us: vmmalloc off {ours['off_us']:.2f} on {ours['on_us']:.2f}; "
            f"PyTorch off {theirs['off_us']:.2f} on {theirs['on_us']:.2f}")


class Skip(Exception):
    """A check that cannot run here (printed as SKIP, never as ok)."""


# What the history check hands the replay check.
HISTORY = {}


def check(name, fn, failures):
    t = time.time()
    try:
        detail = fn()
    except Skip as e:
        print(f"CHECK {name}: SKIP {e}", flush=True)
        return
    except Exception as e:  # reported, the next check still runs
        failures.append(name)
        print(f"CHECK {name}: FAIL {type(e).__name__}: {e}".replace("\n", " ")[:600], flush=True)
        return
    print(f"CHECK {name}: ok ({time.time() - t:.1f} s) {detail}", flush=True)


def main():
    if len(sys.argv) > 1:
        {"history": child_history, "cudnn": child_cudnn, "cost": child_cost}[sys.argv[1]](*sys.argv[2:])
        return 0
    try:
        import torch
    except ImportError:
        print("torch_history_checks: cannot run: no PyTorch")
        return 3
    if not torch.cuda.is_available():
        print("torch_history_checks: cannot run: no CUDA device")
        return 3
    failures = []
    check("history", check_history, failures)
    check("history-replay", check_replay, failures)
    check("cudnn", check_cudnn, failures)
    check("cost", check_cost, failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
