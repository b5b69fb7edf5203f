#!/usr/bin/env python3
"""Two processes on one GPU under one shared budget (issue 33; docs/share.md):

    python scripts/torch_share_checks.py          # GPU: PyTorch tensors under vmmalloc
    python scripts/torch_share_checks.py --host   # dry run anywhere: device:host, the C ABI
    ... --no-cli                                  # the cap lowered from inside A, not by the CLI

Two members of one group (``VMMALLOC_CONF=...,share:NAME``, each a process
of its own, driven over stdin/stdout): A fills 6 units of an 8-unit total
(a unit is 1 GiB on a GPU, 64 MiB on the host), frees half of it (vmmalloc
keeps the pages cached: A still holds them), B's 4 units are refused with
an out-of-memory that names the group; A's cap is then lowered to 3 units
from outside to 3.5 units (``vmmalloc share NAME --cap PID=SIZE``; from
inside A when no CLI is found), A gives back (one poll, 100 ms, plus the give-back), and B's
4 units succeed: one shrinks while the other grows. A cannot grow above its
cap; every byte of both is intact; the group never holds more than its total
(sampled every few ms throughout with ``vmmalloc share NAME --json``: at least
20 samples and no failed sample, else FAIL; SKIP without a CLI).

The CLI: $VMMALLOC_CLI (the GPU check sets it to the bundle's), else the
bundle's bin/, a cargo build or PATH.

Prints ``CHECK <name>: ok|FAIL|SKIP ...`` lines and one ``RESULT {json}``
(give-back and grow times, report-only); exit 1 if a check failed, 3 when it
cannot run here (no GPU), 0 otherwise.
"""

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common  # noqa: E402

HOST = "--host" in sys.argv
MIB, GIB = 1 << 20, 1 << 30
UNIT = 64 * MIB if HOST else GIB
# The group's device as `vmmalloc share --device` names it.
DEVICE = "host0" if HOST else "gpu0"
FAILED = []


def report(name, status, detail=""):
    if status == "FAIL":
        FAILED.append(name)
    print(f"CHECK {name}: {status} {detail}".rstrip(), flush=True)


# ---------------------------------------------------------------------------
# A member (this script again, with --member)


class Buffers:
    """The member's allocations: torch tensors (GPU) or C ABI memory (host)."""

    def __init__(self):
        import vmmalloc

        self.vm = vmmalloc
        self.live = {}
        self.next = 0
        if HOST:
            import ctypes

            self.ctypes = ctypes
            self.lib = vmmalloc._lib.load()
            self.lib.vmmalloc_try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_void_p]
            self.lib.vmmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def alloc(self, n):
        key = self.next
        self.next += 1
        if HOST:
            out = self.ctypes.c_void_p()
            if self.lib.vmmalloc_try_malloc(n, 0, None, self.ctypes.byref(out)) != 0:
                raise MemoryError(self.vm.last_error())
            self.ctypes.memset(out.value, key % 251, n)
            self.live[key] = (out.value, n)
        else:
            import torch

            try:
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError as e:
                raise MemoryError(str(e)) from e
            t.fill_(key % 251)
            self.live[key] = t
        return key

    def free(self, key):
        obj = self.live.pop(key)
        if HOST:
            self.lib.vmmalloc_free(self.ctypes.c_void_p(obj[0]), obj[1], 0, None)

    def intact(self):
        for key, obj in self.live.items():
            if HOST:
                ptr, n = obj
                good = self.ctypes.string_at(ptr, n) == bytes([key % 251]) * n
            else:
                import torch

                good = torch_common.verify(torch, obj, key % 251)
            if not good:
                return False
        return True


def member():
    import vmmalloc

    if HOST:
        vmmalloc.configure(os.environ["VMMALLOC_CONF"])
    else:
        vmmalloc.enable()
        import torch

        torch.empty(1, device="cuda")
    bufs = Buffers()
    say = lambda obj: print("@@ " + json.dumps(obj), flush=True)  # noqa: E731
    say({"ready": os.getpid()})
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "total":
                vmmalloc.share_set_total(int(args[0]))
                say({"ok": True})
            elif cmd == "cap":
                vmmalloc.share_set_cap(int(args[0]))
                say({"ok": True})
            elif cmd == "alloc":
                try:
                    say({"ok": bufs.alloc(int(args[0]))})
                except MemoryError as e:
                    say({"oom": str(e)})
            elif cmd == "free":
                for k in args:
                    bufs.free(int(k))
                if not HOST:
                    import torch

                    torch.cuda.synchronize()
                say({"ok": True})
            elif cmd == "intact":
                say({"ok": bufs.intact()})
            elif cmd == "info":
                say({"ok": vmmalloc.share_info()})
            elif cmd == "quit":
                say({"ok": True})
                return
            else:
                say({"error": f"unknown command {cmd}"})
        except Exception as e:  # the driver reports it as a failed check
            say({"error": f"{cmd}: {type(e).__name__}: {e}"})


# ---------------------------------------------------------------------------
# The driver


class Member:
    def __init__(self, env):
        args = [sys.executable]
        if not HOST:
            args += ["-m", "vmmalloc"]
        args += [os.path.abspath(__file__), "--member"] + (["--host"] if HOST else [])
        self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = queue.Queue()
        self.tail = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.answer(timeout=torch_common.child_timeout(60))["ready"]

    def _read(self):
        for line in self.proc.stdout:
            i = line.find("@@ ")
            if i >= 0:
                self.lines.put(json.loads(line[i + 3:]))
            else:
                self.tail = (self.tail + [line.rstrip()])[-20:]
        self.lines.put(None)

    def answer(self, timeout=60):
        timeout = torch_common.child_timeout(timeout)
        try:
            a = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"member {self.proc.pid} did not answer in {timeout:.0f} s") from None
        if a is None:
            raise RuntimeError(f"member {self.proc.pid} exited: " + " | ".join(self.tail))
        if "error" in a:
            raise RuntimeError(a["error"])
        return a

    def ask(self, *words, timeout=60):
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def stop(self):
        try:
            self.ask("quit", timeout=10)
        except Exception:
            pass
        self.proc.kill()
        self.proc.wait()


class Sampler(threading.Thread):
    """Reads the group (``read()``: its JSON; raises when it cannot) every
    few ms until stopped; counts the samples and the failed reads (the first
    one's reason kept) and keeps any sample above the total."""

    def __init__(self, read):
        super().__init__(daemon=True)
        self.read = read
        self.stopped = threading.Event()
        self.samples = 0
        self.errors = 0
        self.first_error = None
        self.over = []

    def run(self):
        while not self.stopped.is_set():
            try:
                info = self.read()
                used, total = info["used"], info["total"]
            except Exception as e:  # counted and reported: a silent stop would pass with 0 samples
                self.errors += 1
                if self.first_error is None:
                    self.first_error = f"{type(e).__name__}: {e}"[:200]
                time.sleep(0.05)
                continue
            self.samples += 1
            if used > total:
                self.over.append((used, total))
            time.sleep(0.005)

    def verdict(self):
        """(status, detail) of never_above_total."""
        detail = f"{self.samples} samples, {self.errors} failed"
        if self.over:
            return "FAIL", f"{detail}; over the total: {self.over[:3]}"
        if self.errors:
            return "FAIL", f"{detail}; first failure: {self.first_error}"
        if self.samples < 20:
            return "FAIL", f"{detail}: too few samples to say"
        return "ok", detail


def group_info(cli, name, env):
    r = subprocess.run([cli, "share", name, "--device", DEVICE, "--json"], capture_output=True, text=True,
                       timeout=30, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"vmmalloc share exit {r.returncode}: {(r.stdout + r.stderr).strip()[-150:]}")
    return json.loads(r.stdout)


def main():
    why = None if HOST else torch_common.why_no_gpu()
    if why:
        print(f"torch_share_checks: cannot run: {why}", flush=True)
        return 3
    name = f"gpucheck-{os.getpid()}"
    share_dir = tempfile.mkdtemp(prefix="vmmalloc-share-")
    conf = f"backend:expandable,share:{name},log:error"
    if HOST:
        conf = f"device:host,capacity_gb:2,{conf}"
    env = dict(os.environ, VMMALLOC_CONF=conf, VMMALLOC_SHARE_DIR=share_dir)
    cli = None if "--no-cli" in sys.argv else torch_common.find_cli()
    figures = {"unit_bytes": UNIT, "cap_changed_by": "cli" if cli else "member"}
    a = b = sampler = None
    try:
        a = Member(env)
        a.ask("total", 8 * UNIT)
        held = [a.ask("alloc", UNIT)["ok"] for _ in range(6)]
        b = Member(env)
        info = b.ask("info")["ok"]
        report("group", "ok" if len(info["members"]) == 2 and info["total"] == 8 * UNIT else "FAIL",
               f"{len(info['members'])} members, total {info['total'] / GIB:.2f} GiB, used {info['used'] / GIB:.2f} GiB")
        if cli:
            sampler = Sampler(lambda: group_info(cli, name, env))
            sampler.start()
        r = b.ask("alloc", 4 * UNIT)
        report("over_total_refused", "ok" if "oom" in r and name in r["oom"] else "FAIL",
               (r.get("oom") or f"allocated: {r}")[:300])
        a.ask("free", *held[3:])
        del held[3:]
        # A keeps 3 units live; its cap leaves half a unit for the pages
        # its chunks hold beyond them (mapped ahead of the tail, or shared
        # with a live block: docs/share.md, give-back).
        cap = 7 * UNIT // 2
        t0 = time.monotonic()
        if cli:
            rc = subprocess.run([cli, "share", name, "--device", DEVICE, "--cap", f"{a.pid}={cap}"],
                                capture_output=True, text=True, timeout=30, env=env)
            if rc.returncode != 0:
                report("cap_lowered", "FAIL", (rc.stdout + rc.stderr)[-300:])
                return 1
        else:
            a.ask("cap", cap)
        gave_back = None
        deadline = t0 + 10
        while time.monotonic() < deadline:
            me = [m for m in b.ask("info")["ok"]["members"] if m["pid"] == a.pid][0]
            if me["used"] <= cap:
                gave_back = time.monotonic() - t0
                break
            time.sleep(0.01)
        report("shrinks", "ok" if gave_back is not None else "FAIL",
               f"A gave back to its 3.5-unit cap in {gave_back * 1000:.0f} ms" if gave_back is not None
               else "A still above its cap after 10 s")
        figures["give_back_ms"] = None if gave_back is None else round(gave_back * 1000, 1)
        t1 = time.monotonic()
        grown, tries = None, 0
        while time.monotonic() < t1 + 10:
            tries += 1
            r = b.ask("alloc", 4 * UNIT)
            if "ok" in r:
                grown = time.monotonic() - t1
                break
            time.sleep(0.02)
        figures["grow_tries"] = tries
        report("grows", "ok" if grown is not None else "FAIL",
               f"B's 4 units allocated and filled {grown * 1000:.0f} ms after A gave back ({tries} tries)" if grown is not None
               else f"B still refused: {r.get('oom', '')[:300]}")
        figures["grow_ms"] = None if grown is None else round(grown * 1000, 1)
        r = a.ask("alloc", UNIT)
        report("capped_member_cannot_grow", "ok" if "oom" in r else "FAIL",
               (r.get("oom") or "A allocated above its cap")[:200])
        ok_a, ok_b = a.ask("intact")["ok"], b.ask("intact")["ok"]
        report("bytes_intact", "ok" if ok_a and ok_b else "FAIL", f"A {ok_a}, B {ok_b}")
        if sampler:
            sampler.stopped.set()
            sampler.join(30)
            report("never_above_total", *sampler.verdict())
            figures["samples"] = sampler.samples
        else:
            info = b.ask("info")["ok"]
            if info["used"] > info["total"]:
                report("never_above_total", "FAIL", f"at the end: used {info['used']} > total {info['total']}")
            else:
                report("never_above_total", "SKIP", "no vmmalloc CLI to sample with (at the end: within the total)")
    except Exception as e:
        report("driver", "FAIL", f"{type(e).__name__}: {e}")
    finally:
        if sampler:
            sampler.stopped.set()
        for m in (a, b):
            if m:
                m.stop()
        shutil.rmtree(share_dir, ignore_errors=True)
    torch_common.result({"script": "torch_share_checks", "allocator": "vmmalloc:expandable share", **figures})
    return 1 if FAILED else 0


if __name__ == "__main__":
    if "--member" in sys.argv:
        member()
        sys.exit(0)
    t = time.monotonic()
    rc = main()
    if rc != 3:  # else the last line printed is why it cannot run
        print(f"torch_share_checks: {'FAILED ' + ', '.join(FAILED) if FAILED else 'no failure'} in "
              f"{time.monotonic() - t:.1f}s", flush=True)
    sys.exit(rc)
