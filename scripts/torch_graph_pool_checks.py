"""CUDA-graph pools under vmmalloc on a real GPU (issue 32).

1. ``compile``: ``torch.compile(mode="reduce-overhead")`` on a model with
   several input shapes and a path divergence (a shape-dependent tail), run
   once under PyTorch's default allocator and once under vmmalloc
   (``backend:expandable``), each in a child process: CUDA graphs were
   recorded in both (``CUDAGraph.capture_begin`` counted, no
   ``cudagraph_skips``: a silent fallback to eager fails), peak
   ``memory_reserved()`` under vmmalloc at most 1.05x PyTorch's, and the
   outputs equal.
2. ``pause``: a captured graph's pool paused in place (``vmmalloc.pause_pool``,
   contents kept), its memory filled by another tensor and freed, resumed:
   the graph's output tensor (in the pool) holds bitwise what it held before
   the pause *before* any replay (the restore with ``keep=True``), and a
   replay gives it again; ``cuMemGetInfo``'s free rises by at least 90 % of
   the pool's size while paused (other processes and the driver move it a
   little). Pause and wake times are reported (report-only) beside the time
   to capture the graph again.

Run plainly: ``python scripts/torch_graph_pool_checks.py`` (it starts its own
children). Prints ``CHECK name: ok`` or ``CHECK name: FAIL reason`` lines;
exit 1 if any failed, 3 when it cannot run here (no CUDA device).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common  # noqa: E402

SHAPES = (8, 24, 64, 24, 8, 64)
WIDTH = 2048


def child_compile(alloc):
    """Runs the compiled model; prints one JSON line with the peak and outputs."""
    import torch

    if alloc == "vmmalloc":
        import vmmalloc

        vmmalloc.enable("backend:expandable")
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()).cuda()
    tail_a = torch.nn.Linear(WIDTH, WIDTH).cuda()
    tail_b = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(),
                                 torch.nn.Linear(4 * WIDTH, WIDTH)).cuda()

    def model(x):
        h = head(x)
        # A path divergence: cudagraph trees record a second branch.
        return tail_a(h) if x.shape[0] > 16 else tail_b(h)

    # Every CUDA graph cudagraph trees records goes through capture_begin.
    captures = [0]
    real_begin = torch.cuda.CUDAGraph.capture_begin

    def counted_begin(self, *a, **k):
        captures[0] += 1
        return real_begin(self, *a, **k)

    torch.cuda.CUDAGraph.capture_begin = counted_begin
    compiled = torch.compile(model, mode="reduce-overhead")
    outs = []
    with torch.no_grad():
        for step in range(3):
            for n in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(n * 7 + step)
                x = torch.randn(n, WIDTH, device="cuda", generator=g)
                y = compiled(x)
                outs.append(float(y.double().sum()))
                del y
    torch.cuda.synchronize()
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]  # a Counter: 0 when never counted
    print(json.dumps({"peak_reserved": torch.cuda.max_memory_reserved(), "outs": outs,
                      "captures": captures[0], "cudagraph_skips": int(skips)}))


def child_pause():
    """Captures a graph, pauses its pool, lets another tensor use the memory,
    resumes and replays; prints one JSON line with the figures."""
    import torch
    import vmmalloc

    vmmalloc.enable("backend:expandable")
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                              torch.nn.Linear(4 * WIDTH, WIDTH)).cuda()
    static_in = torch.randn(256, WIDTH, device="cuda")

    def capture():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(2):
                net(static_in)  # warm-up, as torch.cuda.graph's docs ask
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g):
            out = net(static_in)
        return g, out

    g, out = capture()
    g.replay()
    torch.cuda.synchronize()
    before = out.clone()
    pool_bytes = vmmalloc.pool_memory_stats(g)["reserved_bytes.all.current"]
    free0, _ = torch.cuda.mem_get_info()
    t = time.perf_counter()
    released = vmmalloc.pause_pool(g, keep=True)
    pause_s = time.perf_counter() - t
    free1, _ = torch.cuda.mem_get_info()
    # Replaying while the pool is paused would run kernels on unmapped
    # memory: it raises instead (issue 40 item 4).
    try:
        g.replay()
    except vmmalloc.VmmallocError:
        replay_refused = True
    else:
        torch.cuda.synchronize()
        replay_refused = False
    # Another tensor uses the memory, then goes.
    filler = torch.full((max(released // 4, 1),), 7.0, device="cuda")
    torch.cuda.synchronize()
    del filler
    torch.cuda.empty_cache()
    t = time.perf_counter()
    vmmalloc.resume_pool(g)
    wake_s = time.perf_counter() - t
    torch.cuda.synchronize()
    # keep=True: the pool's contents are back before any replay recomputes
    # them (the replay reads static_in and the weights, outside the pool).
    restored = bool(torch.equal(out, before))
    g.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out, before))
    t = time.perf_counter()
    g2, _ = capture()
    torch.cuda.synchronize()
    recapture_s = time.perf_counter() - t
    del g2
    print(json.dumps({"pool_bytes": pool_bytes, "released": released, "free_gain": free1 - free0,
                      "restored": restored, "same": same, "replay_refused": replay_refused, "pause_s": pause_s, "wake_s": wake_s,
                      "recapture_s": recapture_s}))


def run_child(*args):
    return torch_common.run_child(__file__, *args)


failures = []


def report(name, fn):
    t = time.time()
    try:
        detail = fn()
    except Exception as e:  # a failed check is reported, the next one runs
        print(f"CHECK {name}: FAIL {type(e).__name__}: {e}".replace("\n", " ")[:600], flush=True)
        failures.append(name)
        return
    print(f"CHECK {name}: ok ({time.time() - t:.1f} s) {detail}", flush=True)


def check_compile():
    native = run_child("--child", "compile", "pytorch")
    ours = run_child("--child", "compile", "vmmalloc")
    torch_common.result({"script": "torch_graph_pool_checks", "check": "graph-pools-compile",
                         "allocator": "vmmalloc:expandable", "peak_reserved": ours["peak_reserved"],
                         "pytorch_peak_reserved": native["peak_reserved"], "captures": ours["captures"],
                         "pytorch_captures": native["captures"]})
    for who, r in (("PyTorch", native), ("vmmalloc", ours)):
        assert r["captures"] > 0, f"no CUDA graph was recorded under {who} (cudagraph trees fell back to eager)"
        assert r["cudagraph_skips"] == 0, f"cudagraph_skips = {r['cudagraph_skips']} under {who}"
    ratio = ours["peak_reserved"] / max(native["peak_reserved"], 1)
    diffs = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(native["outs"], ours["outs"])]
    assert len(native["outs"]) == len(ours["outs"]), "different numbers of outputs"
    assert max(diffs) < 1e-6, f"outputs differ (max relative {max(diffs):.2e})"
    assert ratio <= 1.05, (f"peak reserved {ours['peak_reserved']} under vmmalloc, "
                           f"{native['peak_reserved']} under PyTorch: {ratio:.3f}x > 1.05x")
    return (f"{ours['captures']} CUDA graphs recorded ({native['captures']} under PyTorch); peak reserved "
            f"{ratio:.3f}x PyTorch's ({ours['peak_reserved']} / {native['peak_reserved']} B)")


def check_pause():
    r = run_child("--child", "pause")
    torch_common.result({"script": "torch_graph_pool_checks", "check": "graph-pools-pause",
                         "allocator": "vmmalloc:expandable", **r})
    assert r["restored"], "after resume (keep=True), before any replay, the pool's output differs"
    assert r["same"], "the replay after resume differs from the one before the pause"
    assert r["replay_refused"], "replay() of a graph whose pool is paused did not raise"
    assert r["released"] >= r["pool_bytes"] > 0, r
    assert r["free_gain"] >= 0.9 * r["pool_bytes"], f"free rose by {r['free_gain']}, pool {r['pool_bytes']}"
    return (f"contents restored, replay equal; pool {r['pool_bytes']} B, free +{r['free_gain']} B; "
            f"report-only: pause {r['pause_s'] * 1e3:.1f} ms, "
            f"wake {r['wake_s'] * 1e3:.1f} ms against recapture {r['recapture_s'] * 1e3:.1f} ms")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        if sys.argv[2] == "compile":
            child_compile(sys.argv[3])
        else:
            child_pause()
        return 0
    import torch

    if not torch.cuda.is_available():
        print("torch_graph_pool_checks: cannot run: no CUDA device")
        return 3
    report("graph-pools-compile", check_compile)
    report("graph-pools-pause", check_pause)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
