#!/usr/bin/env python3
"""Unpinning and host threads with real kernels (docs/expandable.md,
"Unpinning and threads").

Run it under vmmalloc with the default `unpin:auto`:

    python -m vmmalloc scripts/torch_unpin_threads.py

Memory is capped with torch.cuda.set_per_process_memory_fraction (2.5 GiB by
default) so that the large requests below can only be served by unpinning: a
512 MiB tensor is freed and an 8 MiB one carved from its chunk (pinning the
chunk's other 504 MiB) beside 1 GiB of live data.

Checks, each printed as `CHECK name: ok` or `CHECK name: FAIL reason` as soon
as it is done:

- `turns`: a training step's threads. The main thread runs the forward pass
  and waits in backward(); autograd's device thread runs the backward pass,
  where a custom Function allocates a tensor only unpinning can serve. Three
  steps: unpinning runs in each (vmmalloc.chunk_unpins grows), is never
  declined, the backward ran on another thread, and every byte of the live
  tensors and of the gradient is intact.
- `solo`: the writer check's layout on the main thread alone: the large
  request is served by unpinning (so the next check needs it).
- `writer`: a prefetch-like thread on its own stream copies pinned host
  batches into its live device buffers with non_blocking=True in a loop and
  compares every byte on the device (torch.equal with a reference) after each
  copy, while the main thread asks for the large tensor again and again.
  `unpin:auto` declines (out of memory, vmmalloc.unpin_refusals grows,
  vmmalloc.chunk_unpins does not), and no byte the writer or the main thread
  wrote is lost.

`turns` runs first: after `writer`, the writer thread's stream counts against
unpinning for the next 4096 allocator calls, by design.

Exits 0 when every check passed, 1 when one failed, 3 when it cannot run here
(no CUDA), 2 when it is run wrongly (not under `python -m vmmalloc`, or unpin
not auto). Takes a few seconds.
"""

import argparse
import os
import sys
import threading
import time

MIB = 1 << 20
GIB = 1 << 30

failures = []


def report(name, problem):
    """Prints the CHECK line at once; `problem` None means ok."""
    if problem is None:
        print(f"CHECK {name}: ok", flush=True)
    else:
        failures.append(name)
        print(f"CHECK {name}: FAIL {problem}", flush=True)


def is_oom(torch, e):
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e)


def stats(vm):
    s = vm.memory_stats(0)
    return s.get("vmmalloc.chunk_unpins", 0), s.get("vmmalloc.unpin_refusals", 0)


class Checker:
    """Compares whole tensors with a 1 MiB reference of one byte value, slice
    by slice (torch.equal reads every byte and allocates nothing large)."""

    def __init__(self, torch):
        self.torch = torch
        self.refs = {}

    def same(self, t, value):
        torch = self.torch
        ref = self.refs.get(value)
        if ref is None:
            ref = torch.full((MIB,), value, dtype=torch.uint8, device="cuda")
            self.refs[value] = ref
        flat = t.view(-1)
        for i in range(0, flat.numel(), MIB):
            part = flat[i:i + MIB]
            if not torch.equal(part, ref[:part.numel()]):
                return f"byte value {value} lost in [{i}, {i + part.numel()})"
        return None


def pinned_layout(torch, big=512 * MIB, small=8 * MIB, live=1024 * MIB):
    """On the current stream: a `big` tensor, `live` bytes after it, the big
    one freed and a `small` one carved from its chunk. Returns (small, live)."""
    x = torch.empty(big, dtype=torch.uint8, device="cuda")
    z = torch.empty(live, dtype=torch.uint8, device="cuda")
    z.fill_(0x5A)
    del x
    y = torch.empty(small, dtype=torch.uint8, device="cuda")
    y.fill_(0xA5)
    return y, z


def check_turns(torch, vm, checker, request):
    main_thread = threading.get_ident()
    seen = {}

    class NeedsUnpinning(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["thread"] = threading.get_ident()
            try:
                t = torch.empty(request, dtype=torch.uint8, device="cuda")
            except Exception as e:  # noqa: BLE001 (reported below)
                seen["error"] = str(e).splitlines()[0]
                return g * 2
            t.fill_(0x3C)
            seen["bytes"] = checker.same(t, 0x3C)
            del t
            return g * 2

    for step in range(3):
        before = stats(vm)
        y, z = pinned_layout(torch)
        x = torch.ones(256 * 1024, device="cuda", requires_grad=True)  # 1 MiB
        seen.clear()
        NeedsUnpinning.apply(x).sum().backward()
        torch.cuda.synchronize()
        after = stats(vm)
        problem = None
        if seen.get("thread") in (None, main_thread):
            problem = "the backward pass did not run on autograd's device thread"
        elif "error" in seen:
            problem = f"the backward allocation failed: {seen['error']} (refusals {before[1]} -> {after[1]})"
        elif after[0] <= before[0]:
            problem = "no chunk was unpinned (the cap left room: the check proves nothing)"
        elif after[1] != before[1]:
            problem = f"unpinning was declined {after[1] - before[1]} time(s)"
        else:
            problem = (seen.get("bytes") or checker.same(y, 0xA5) or checker.same(z, 0x5A)
                       or (None if bool((x.grad == 2).all()) else "the gradient is wrong"))
        if problem:
            return f"step {step}: {problem}"
        del y, z, x
        torch.cuda.empty_cache()
    return None


def check_solo(torch, vm, checker, request):
    before = stats(vm)
    y, z = pinned_layout(torch)
    try:
        r = torch.empty(request, dtype=torch.uint8, device="cuda")
    except Exception as e:  # noqa: BLE001
        if is_oom(torch, e):
            return f"out of memory on one thread: {str(e).splitlines()[0]}"
        raise
    r.fill_(0x11)
    after = stats(vm)
    problem = None
    if after[0] <= before[0]:
        problem = "no chunk was unpinned (the cap left room: the writer check would prove nothing)"
    problem = problem or checker.same(r, 0x11) or checker.same(y, 0xA5) or checker.same(z, 0x5A)
    del r, y, z
    torch.cuda.empty_cache()
    return problem


def check_writer(torch, vm, checker, request, seconds):
    stop = threading.Event()
    ready = threading.Event()
    result = {"gens": 0, "error": None}

    def writer():
        try:
            s = torch.cuda.Stream()
            batch = 64 * MIB
            with torch.cuda.stream(s):
                host = [torch.empty(batch, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                for i, h in enumerate(host):
                    h.copy_(torch.randint(0, 256, (batch,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
                refs = [h.to("cuda", non_blocking=False) for h in host]
                # Its buffers sit in a chunk they cover only in part (pinned).
                a = torch.empty(4 * batch, dtype=torch.uint8, device="cuda")
                del a
                bufs = [torch.empty(batch, dtype=torch.uint8, device="cuda") for _ in range(2)]
                s.synchronize()
                ready.set()
                gen = 0
                while not stop.is_set() or gen < 3:
                    k = gen % 2
                    for j, b in enumerate(bufs):
                        b.copy_(host[(k + j) % 2], non_blocking=True)
                    s.synchronize()
                    for j, b in enumerate(bufs):
                        if not torch.equal(b, refs[(k + j) % 2]):
                            result["error"] = f"generation {gen}: buffer {j} lost bytes"
                            return
                    gen += 1
                    result["gens"] = gen
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            result["error"] = f"writer raised {type(e).__name__}: {str(e).splitlines()[0]}"
        finally:
            ready.set()

    t = threading.Thread(target=writer, name="writer")
    t.start()
    ready.wait()
    if result["error"]:
        t.join()
        return result["error"]
    before = stats(vm)
    y, z = pinned_layout(torch)
    attempts, served = 0, 0
    message = ""
    deadline = time.time() + seconds
    while time.time() < deadline or attempts < 10:
        attempts += 1
        try:
            r = torch.empty(request, dtype=torch.uint8, device="cuda")
            served += 1
            del r
        except Exception as e:  # noqa: BLE001
            if not is_oom(torch, e):
                stop.set()
                t.join()
                raise
            message = str(e)
        time.sleep(0.01)
    stop.set()
    t.join()
    after = stats(vm)
    problem = result["error"]
    if problem is None and served:
        problem = f"{served} of {attempts} requests were served beside the writer (unpins {before[0]} -> {after[0]})"
    if problem is None and after[0] != before[0]:
        problem = f"{after[0] - before[0]} chunk(s) unpinned beside the writer"
    if problem is None and after[1] - before[1] < attempts:
        problem = f"{after[1] - before[1]} refusals counted for {attempts} declined requests"
    if problem is None and "did not run (unpin:auto)" not in message:
        problem = "the out-of-memory report does not say why unpinning did not run"
    problem = problem or checker.same(y, 0xA5) or checker.same(z, 0x5A)
    if problem is None:
        print(f"  writer: {result['gens']} generations of 2 x 64 MiB checked; {attempts} requests declined", flush=True)
    del y, z
    torch.cuda.empty_cache()
    return problem


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-gb", type=float, default=2.5, help="memory cap in GiB (default 2.5)")
    ap.add_argument("--request-mb", type=int, default=1152, help="the large request in MiB (default 1152)")
    ap.add_argument("--writer-seconds", type=float, default=3.0)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("torch_unpin_threads: cannot run: CUDA is not available", flush=True)
        return 3
    try:
        import vmmalloc
    except ImportError:
        vmmalloc = None
    if vmmalloc is None or not vmmalloc.is_enabled():
        print("torch_unpin_threads: run it under `python -m vmmalloc`", file=sys.stderr)
        return 2
    conf = os.environ.get("VMMALLOC_CONF", "")
    if any(k.strip() == "unpin" and v.strip() != "auto" for k, _, v in (i.partition(":") for i in conf.split(","))):
        print(f"torch_unpin_threads: checks the default unpin:auto; VMMALLOC_CONF={conf}", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(args.cap_gb * GIB)
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    checker = Checker(torch)
    request = args.request_mb * MIB
    t0 = time.time()
    for name, fn in (("turns", lambda: check_turns(torch, vmmalloc, checker, request)),
                     ("solo", lambda: check_solo(torch, vmmalloc, checker, request)),
                     ("writer", lambda: check_writer(torch, vmmalloc, checker, request, args.writer_seconds))):
        try:
            problem = fn()
        except Exception as e:  # noqa: BLE001
            problem = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        report(name, problem)
    unpins, refusals = stats(vmmalloc)
    print(f"torch_unpin_threads: {time.time() - t0:.1f} s; vmmalloc.chunk_unpins={unpins} "
          f"vmmalloc.unpin_refusals={refusals}; cap {args.cap_gb} GiB", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
