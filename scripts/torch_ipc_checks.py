#!/usr/bin/env python3
"""IPC under vmmalloc (issue 28, item 3), on a real GPU:

    python scripts/torch_ipc_checks.py            # GPU (VMMALLOC_CONF may add keys; device:cuda)
    python scripts/torch_ipc_checks.py --host     # dry run on any machine: device:host, C ABI only

Prints one line per check as soon as it is done,
``CHECK <name>: ok [details]`` | ``CHECK <name>: FAIL <reason>`` | ``CHECK <name>: SKIP <reason>``,
and exits 1 if any check failed, 3 when it cannot run here (no GPU), 0
otherwise. Under ~40 s on an H200.

Checks (GPU mode):

- ``driver_export_without_posix_type``: the real driver's answer to
  cuMemExportToShareableHandle on a handle created without
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (the fake libcuda answers
  CUDA_ERROR_INVALID_VALUE; docs/fake-cuda.md), and success with it.
- ``posix_fd_create_cost``: median cuMemCreate + cuMemRelease time with and
  without the POSIX fd handle type (2 MiB - 1 GiB, interleaved), the
  measurement behind ``ipc:auto``. Report-only (a timing on a shared box
  fails nothing): the detail says where the type costs more than 10 % (+5 us).
- ``capi_*``: the C ABI directly (vmmalloc.ipc_export / ipc_import /
  ipc_close), vmmalloc current in both processes: producer here -> consumer
  child (pidfd, and forced socket), a write seen by the producer; consumer
  here <- producer child; an import after the producer freed the memory fails.
- ``torch_mp_*``: a CUDA tensor sent through a torch.multiprocessing (spawn)
  Pipe both ways, written by the receiver, the write seen by the sender.
  SKIP while PyTorch's pluggable allocator lacks shareIpcHandle (until the
  torch companion wires it).
- ``torch_stock_{default,expandable}_{vmmalloc_to_stock,stock_to_vmmalloc}``:
  a CUDA tensor through a torch.multiprocessing Pipe between this vmmalloc
  process and a stock PyTorch process (checked stock: vmmalloc not imported,
  allocator backend ``native``; PyTorch's default allocator, then expandable
  segments), both ways, bytes checked on each side: PyTorch's own handles
  written by the companion and read by it. With the companion installed, a
  "not supported" error is a FAIL (without it, a SKIP).
- PyTorch's expandable-segment handles carry a pid and descriptors that the
  consumer takes with ``pidfd_getfd``: Yama ``ptrace_scope`` >= 1 refuses it
  from a child to its parent, a container's default seccomp profile refuses
  it everywhere. Both directions are probed first (``pidfd_probe``); a check
  that needs a refused direction is a SKIP that names the environment (EPERM
  is the box, not vmmalloc).
- ``torch_stock_2gib_vmmalloc_to_stock``: a 2 GiB tensor to the stock
  PyTorch process (expandable round), bitwise both ways; the detail gives
  the bytes re-backed with equal handles for PyTorch's format (issue 40,
  item 2) and the send time, the re-backing included.
- ``torch_native_handle``: a handle from PyTorch's own allocator
  (expandable_segments:True, ``storage._share_cuda_()``) imported by
  vmmalloc.ipc_import in a vmmalloc process: the bytes read, a write seen by
  the PyTorch producer.
"""

import ctypes
import multiprocessing
import os
import statistics
import sys
import time
import traceback

import torch_common

MIB = 1 << 20
PIECE = 256 * MIB  # fill / holds on the GPU work in pieces of this many bytes
HOST = "--host" in sys.argv
FAILED = []


def report(name, status, detail=""):
    line = f"CHECK {name}: {status}" + (f" {detail}" if detail else "")
    print(line, flush=True)
    if status == "FAIL":
        FAILED.append(name)


# ---------------------------------------------------------------------------
# pidfd_getfd, both directions (PyTorch's expandable-segment handles need it)

SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438  # the same number on every Linux architecture
GETFD = """
import ctypes, os
def getfd(pid, fd):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = libc.syscall(434, ctypes.c_int(pid), ctypes.c_uint(0))
    if pidfd < 0:
        return ctypes.get_errno()
    got = libc.syscall(438, ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    err = ctypes.get_errno() if got < 0 else 0
    os.close(pidfd)
    if got >= 0:
        os.close(got)
    return err
"""


def _getfd(pid, fd):
    scope = {}
    exec(GETFD, scope)
    return scope["getfd"](pid, fd)


def pidfd_probe():
    """{direction: None (allowed) or why refused} for "parent_from_child" (a
    parent takes a child's descriptor) and "child_from_parent"."""
    import errno
    import subprocess

    out = {}
    child = subprocess.Popen([sys.executable, "-c", "import os, sys; r, w = os.pipe(); print(r, flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        fd = int(child.stdout.readline())
        out["parent_from_child"] = _getfd(child.pid, fd)
    finally:
        child.stdin.close()
        child.wait(10)
    r, w = os.pipe()
    try:
        code = GETFD + "import sys; print(getfd(int(sys.argv[1]), int(sys.argv[2])))"
        got = subprocess.run([sys.executable, "-c", code, str(os.getpid()), str(r)], capture_output=True,
                             text=True, timeout=30)
        out["child_from_parent"] = int(got.stdout.strip() or -1)
    finally:
        os.close(r)
        os.close(w)
    try:
        yama = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        yama = "absent"
    seccomp = "?"
    for line in open("/proc/self/status"):
        if line.startswith("Seccomp:"):
            seccomp = {"0": "off", "1": "strict", "2": "filter"}.get(line.split()[1], line.split()[1])
    why = {}
    for k, err in out.items():
        if err == 0:
            why[k] = None
        else:
            name = errno.errorcode.get(err, str(err))
            why[k] = (f"pidfd_getfd {k.replace('_', ' ')} refused here ({name}; Yama ptrace_scope={yama}, "
                      f"seccomp {seccomp}): the environment, not vmmalloc")
    return why


def run_check(name, fn):
    t = time.monotonic()
    try:
        r = fn()
    except Exception as e:  # a check that raises fails, with the reason
        report(name, "FAIL", f"{type(e).__name__}: {e}".replace("\n", " "))
        traceback.print_exc(file=sys.stderr)
        return
    status, detail = r if isinstance(r, tuple) else ("ok", r or "")
    report(name, status, f"{detail} ({time.monotonic() - t:.1f}s)".strip())


# ---------------------------------------------------------------------------
# Memory access: torch tensors on the GPU, ctypes on device:host


def pattern(n, gen):
    """Byte i is (i + 31 * gen) % 251 (the GPU path computes the same with torch)."""
    k = (31 * gen) % 251
    cycle = bytes(range(251))
    cycle = cycle[k:] + cycle[:k]
    return (cycle * (n // 251 + 1))[:n]


class _CAI:
    """A raw device pointer as __cuda_array_interface__ (uint8, n bytes)."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def fill(ptr, n, gen):
    if HOST:
        ctypes.memmove(ptr, pattern(n, gen), n)
        return
    import torch

    t = torch.as_tensor(_CAI(ptr, n), device="cuda")
    for off in range(0, n, PIECE):  # pieces: arange of 2 GiB would take 16 GiB
        m = min(PIECE, n - off)
        t[off:off + m].copy_(((torch.arange(off, off + m, device="cuda") + gen * 31) % 251).to(torch.uint8))
    torch.cuda.synchronize()


def holds(ptr, n, gen):
    if HOST:
        return ctypes.string_at(ptr, n) == pattern(n, gen)
    import torch

    t = torch.as_tensor(_CAI(ptr, n), device="cuda")
    ok = True
    for off in range(0, n, PIECE):
        m = min(PIECE, n - off)
        want = ((torch.arange(off, off + m, device="cuda") + gen * 31) % 251).to(torch.uint8)
        ok = ok and bool(torch.equal(t[off:off + m], want))
    torch.cuda.synchronize()
    return ok


class Buffers:
    """Producer-side allocations: torch tensors (GPU) or raw vmmalloc memory (host)."""

    def __init__(self, vm):
        self.vm = vm
        self.keep = {}

    def alloc(self, n):
        if HOST:
            out = ctypes.c_void_p()
            rc = self.vm._lib.load().vmmalloc_try_malloc(n, 0, None, ctypes.byref(out))
            if rc != 0:
                raise RuntimeError(self.vm.last_error())
            ptr = out.value
            self.keep[ptr] = n
        else:
            import torch

            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            ptr = t.untyped_storage().data_ptr()
            self.keep[ptr] = t
        return ptr

    def free(self, ptr):
        obj = self.keep.pop(ptr)
        if HOST:
            self.vm._lib.load().vmmalloc_free(ctypes.c_void_p(ptr), obj, 0, None)
        else:
            del obj  # the pluggable allocator frees at once


def setup_vmmalloc():
    import vmmalloc

    if HOST:
        vmmalloc.configure("device:host,capacity_gb:2,log:error")
        lib = vmmalloc._lib.load()
        lib.vmmalloc_try_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.vmmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    else:
        vmmalloc.enable()
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")
    return vmmalloc


# ---------------------------------------------------------------------------
# The other process


def worker(conn):
    """A vmmalloc process (the C ABI and torch.multiprocessing ops)."""
    serve(conn, stock=False)


def stock_worker(conn):
    """A stock PyTorch process: no vmmalloc, PyTorch's own allocator as
    PYTORCH_CUDA_ALLOC_CONF (inherited from the parent at spawn) makes it;
    only the torch_* ops."""
    serve(conn, stock=True)


def serve(conn, stock):
    try:
        ident = None
        if stock:
            import torch

            torch.cuda.init()
            torch.empty(1, device="cuda")
            vm = bufs = None
            ident = {"vmmalloc_imported": "vmmalloc" in sys.modules,
                     "backend": torch.cuda.get_allocator_backend(),
                     "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
        else:
            vm = setup_vmmalloc()
            bufs = Buffers(vm)
        conn.send(("ready", ident))
    except Exception as e:
        conn.send(("error", f"worker setup: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        op = msg[0]
        try:
            if op == "quit":
                conn.send(("ok", None))
                return
            if op == "import":  # (handle, n, transport): check gen 1, write gen 2
                _, handle, n, transport = msg
                os.environ.pop("VMMALLOC_IPC_TRANSPORT", None)
                if transport:
                    os.environ["VMMALLOC_IPC_TRANSPORT"] = transport
                try:
                    p = vm.ipc_import(handle)
                except vm.VmmallocError as e:
                    conn.send(("import_error", str(e)))
                    continue
                good = holds(p, n, 1)
                fill(p, n, 2)
                vm.ipc_close(p)
                conn.send(("ok", good))
            elif op == "export":  # (n,): allocate gen 1, export
                ptr = bufs.alloc(msg[1])
                fill(ptr, msg[1], 1)
                conn.send(("ok", (ptr, vm.ipc_export(ptr))))
            elif op == "holds":  # (ptr, n, gen), then free
                _, ptr, n, gen = msg
                good = holds(ptr, n, gen)
                bufs.free(ptr)
                conn.send(("ok", good))
            elif op == "torch_recv":  # (tensor,): check gen 1, write gen 2
                t = msg[1]
                good = holds(t.data_ptr(), t.numel(), 1)
                fill(t.data_ptr(), t.numel(), 2)
                del t
                conn.send(("ok", good))
            elif op == "torch_send":  # (n,): send a tensor of gen 1, await its check
                import torch

                t = torch.empty(msg[1], dtype=torch.uint8, device="cuda")
                fill(t.data_ptr(), msg[1], 1)
                try:
                    conn.send(("ok", t))
                except Exception as e:
                    conn.send(("send_error", f"{type(e).__name__}: {e}"))
                    continue
                conn.recv()  # the parent wrote gen 2
                conn.send(("ok", holds(t.data_ptr(), msg[1], 2)))
            else:
                conn.send(("error", f"unknown op {op}"))
        except Exception as e:
            conn.send(("error", f"{op}: {type(e).__name__}: {e}"))


def native_worker(conn):
    """PyTorch's own allocator with expandable segments: shares a tensor of
    gen-1 bytes (its IPC handle, offset, size), then reports whether it holds
    gen-2 bytes once the parent wrote them."""
    try:
        import torch

        n = 4 * MIB + 4096
        torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")  # the tensor below starts inside the range
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        fill(t.data_ptr(), n, 1)
        share = t.untyped_storage()._share_cuda_()
        conn.send(("ok", (bytes(share[1]), int(share[3]), n)))
        conn.recv()
        conn.send(("ok", holds(t.data_ptr(), n, 2)))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


class Child:
    def __init__(self, ctx, target, env=None):
        self.conn, theirs = ctx.Pipe()
        # env: values to set in the child's environment; None removes the
        # variable (VMMALLOC_CONF's mere presence starts vmmalloc in a child).
        old = {k: os.environ.get(k) for k in (env or {})}
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            self.proc = ctx.Process(target=target, args=(theirs,), daemon=True)
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def ask(self, msg=None, timeout=30):
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the child did not answer within {timeout}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"child: {value}")
        return status, value

    def stop(self):
        try:
            self.conn.send(("quit",))
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------
# Driver-level checks (ctypes on libcuda, no vmmalloc)


class Prop(ctypes.Structure):
    # CUmemAllocationProp (cuda.h; 32 bytes, checked by vmm-sys's layout test).
    _fields_ = [
        ("type", ctypes.c_uint),
        ("requestedHandleTypes", ctypes.c_uint),
        ("loc_type", ctypes.c_uint),
        ("loc_id", ctypes.c_int),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


def driver():
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for rc in (
        cu.cuInit(0),
        cu.cuDeviceGet(ctypes.byref(dev), 0),
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
        cu.cuCtxSetCurrent(ctx),
    ):
        if rc != 0:
            raise RuntimeError(f"driver setup failed with code {rc}")
    return cu, dev.value


def err_name(cu, rc):
    s = ctypes.c_char_p()
    cu.cuGetErrorName(rc, ctypes.byref(s))
    return s.value.decode() if s.value else str(rc)


def prop(dev, posix):
    # CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_LOCATION_TYPE_DEVICE = 1,
    # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1.
    return Prop(type=1, requestedHandleTypes=1 if posix else 0, loc_type=1, loc_id=dev)


def check_export_without_type():
    cu, dev = driver()
    cu.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_ulonglong]
    cu.cuMemRelease.argtypes = [ctypes.c_ulonglong]
    cu.cuMemCreate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong]
    out = {}
    for posix in (False, True):
        p = prop(dev, posix)
        h = ctypes.c_ulonglong()
        rc = cu.cuMemCreate(ctypes.byref(h), 2 * MIB, ctypes.byref(p), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemCreate: {err_name(cu, rc)}")
        fd = ctypes.c_int(-1)
        out[posix] = cu.cuMemExportToShareableHandle(ctypes.byref(fd), h.value, 1, 0)
        if fd.value >= 0 and out[posix] == 0:
            os.close(fd.value)
        cu.cuMemRelease(h.value)
    detail = f"without the type: {err_name(cu, out[False])} ({out[False]}); with it: {err_name(cu, out[True])}"
    if out[False] == 0 or out[True] != 0:
        return "FAIL", detail
    return "ok", detail


def check_create_cost():
    cu, dev = driver()
    cu.cuMemRelease.argtypes = [ctypes.c_ulonglong]
    cu.cuMemCreate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong]
    props = {False: prop(dev, False), True: prop(dev, True)}
    lines, worse = [], []
    for size, reps in ((2 * MIB, 200), (20 * MIB, 100), (64 * MIB, 80), (256 * MIB, 40), (1024 * MIB, 16)):
        create = {False: [], True: []}
        release = {False: [], True: []}
        h = ctypes.c_ulonglong()
        for i in range(reps):
            for posix in ((False, True) if i % 2 else (True, False)):
                t0 = time.perf_counter()
                rc = cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(props[posix]), 0)
                t1 = time.perf_counter()
                rc2 = cu.cuMemRelease(h.value) if rc == 0 else rc
                t2 = time.perf_counter()
                if rc or rc2:
                    raise RuntimeError(f"cuMemCreate/Release: {err_name(cu, rc or rc2)}")
                create[posix].append((t1 - t0) * 1e6)
                release[posix].append((t2 - t1) * 1e6)
        med = lambda v: statistics.median(v[2:])  # noqa: E731
        c0, c1, r0, r1 = med(create[False]), med(create[True]), med(release[False]), med(release[True])
        lines.append(
            f"{size // MIB} MiB x{reps}: create {c0:.1f} vs {c1:.1f} us, release {r0:.1f} vs {r1:.1f} us (none vs posix-fd)"
        )
        if c1 + r1 > 1.10 * (c0 + r0) + 5:
            worse.append(f"{size // MIB} MiB")
    detail = "; ".join(lines)
    torch_common.result({"script": "torch_ipc_checks", "check": "posix_fd_create_cost", "detail": detail,
                         "costlier_at": worse})
    where = f"the type costs >10% (+5 us) at {', '.join(worse)}" if worse else "the type costs <=10% (+5 us)"
    return "ok", f"report-only: {where}: {detail}"


# ---------------------------------------------------------------------------


def main():
    if not HOST:
        why = torch_common.why_no_gpu()
        if why:
            print(f"torch_ipc_checks: cannot run: {why}", flush=True)
            return 3
        run_check("driver_export_without_posix_type", check_export_without_type)
        run_check("posix_fd_create_cost", check_create_cost)
    if HOST:
        ctx = multiprocessing.get_context("spawn")
    else:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
    vm = setup_vmmalloc()
    bufs = Buffers(vm)
    child = Child(ctx, worker)
    try:
        child.ask(timeout=60)  # ready
        n_small, n_big = 3000, 48 * MIB + 4096

        def producer_here(transport):
            def go():
                details = []
                bufs.alloc(1000)  # the next block starts inside its chunk
                for n in (n_small, n_big):
                    ptr = bufs.alloc(n)
                    fill(ptr, n, 1)
                    h = vm.ipc_export(ptr)
                    status, good = child.ask(("import", h, n, transport))
                    if status != "ok":
                        return "FAIL", f"import of {n} bytes: {good}"
                    if not good:
                        return "FAIL", f"the consumer did not see the producer's {n} bytes"
                    if not holds(ptr, n, 2):
                        return "FAIL", f"the consumer's write of {n} bytes is not seen by the producer"
                    bufs.free(ptr)
                    status, msg = child.ask(("import", h, n, transport))
                    if status != "import_error" or "freed" not in msg:
                        return "FAIL", f"import after free: {status} {msg}"
                    details.append(f"{n} B")
                return "ok", ", ".join(details) + "; freed memory refused"

            return go

        run_check("capi_producer_to_consumer", producer_here(None))
        run_check("capi_producer_to_consumer_socket", producer_here("socket"))

        def consumer_here():
            _, (ptr, h) = child.ask(("export", n_big))
            p = vm.ipc_import(h)
            good = holds(p, n_big, 1)
            fill(p, n_big, 2)
            vm.ipc_close(p)
            _, seen = child.ask(("holds", ptr, n_big, 2))
            if not good:
                return "FAIL", "the producer's bytes differ here"
            if not seen:
                return "FAIL", "our write is not seen by the producer"
            try:
                vm.ipc_import(h)
                return "FAIL", "import after the producer freed the memory succeeded"
            except vm.VmmallocError as e:
                if "freed" not in str(e):
                    return "FAIL", f"import after free: {e}"
            return "ok", f"{n_big} B both ways"

        run_check("capi_consumer_to_producer", consumer_here)
        if HOST:
            for name in ("torch_mp_parent_to_child", "torch_mp_child_to_parent", "torch_native_handle",
                         "torch_stock_*"):
                report(name, "SKIP", "--host dry run (needs PyTorch on a GPU)")
            return 1 if FAILED else 0

        import torch

        def torch_to(get_child, who):
            """A tensor of gen-1 bytes sent to the child, which checks them and
            writes gen 2, seen here."""

            def go():
                c = get_child()
                t = torch.empty(n_big, dtype=torch.uint8, device="cuda")
                fill(t.data_ptr(), n_big, 1)
                try:
                    c.conn.send(("torch_recv", t))
                except Exception as e:
                    if "support" in str(e):
                        return not_supported(str(e))
                    raise
                _, good = c.ask()
                if not good:
                    return "FAIL", f"{who} did not see the tensor's bytes"
                if not holds(t.data_ptr(), n_big, 2):
                    return "FAIL", f"{who}'s write is not seen here"
                return "ok", f"{n_big} B to {who}, both ways"

            return go

        def torch_from(get_child, who):
            """A tensor of gen-1 bytes sent by the child, checked here and
            written with gen 2, which the child sees."""

            def go():
                c = get_child()
                status, t = c.ask(("torch_send", n_big))
                if status == "send_error":
                    if "support" in t:
                        return not_supported(t)
                    return "FAIL", t
                good = holds(t.data_ptr(), n_big, 1)
                fill(t.data_ptr(), n_big, 2)
                del t
                torch.cuda.synchronize()
                c.conn.send(("written",))
                _, seen = c.ask()
                if not good:
                    return "FAIL", f"{who}'s tensor bytes differ here"
                if not seen:
                    return "FAIL", f"our write is not seen by {who}"
                return "ok", f"{n_big} B from {who}, both ways"

            return go

        def not_supported(e):
            # With the companion, sharing is supported: a refusal is a failure.
            if vm._companion.installed():
                return "FAIL", f"the torch companion is installed, yet: {e}"
            return "SKIP", f"the pluggable allocator cannot share (needs the torch companion): {e}"

        def big_to_stock(get_child, who):
            """Issue 40, item 2: a 2 GiB tensor (a flattened weight bucket)
            sent to a stock PyTorch process, read there bitwise, written
            back; the export re-backs its chunks with equal handles once
            (PyTorch's 'e' format), timed here."""

            def go():
                c = get_child()
                n = 2 << 30
                t = torch.empty(n, dtype=torch.uint8, device="cuda")
                fill(t.data_ptr(), n, 1)
                before = vm.memory_stats(0)
                t0 = time.monotonic()
                try:
                    c.conn.send(("torch_recv", t))  # pickling exports it
                except Exception as e:
                    return "FAIL", f"sending 2 GiB: {type(e).__name__}: {e}"
                sent = time.monotonic() - t0
                after = vm.memory_stats(0)
                _, good = c.ask(timeout=torch_common.child_timeout(120))
                if not good:
                    return "FAIL", f"{who} did not see the 2 GiB tensor's bytes"
                if not holds(t.data_ptr(), n, 2):
                    return "FAIL", f"{who}'s write to the 2 GiB tensor is not seen here"
                key = "vmmalloc.ipc_rebacked_bytes"
                moved = after.get(key, 0) - before.get(key, 0)
                rebacks = after.get("vmmalloc.ipc_rebacks", 0) - before.get("vmmalloc.ipc_rebacks", 0)
                return "ok", (f"2 GiB to {who}, bitwise both ways; re-backed {moved >> 20} MiB "
                              f"({rebacks} re-backing), send incl. export {sent * 1e3:.1f} ms "
                              f"({sent * 1e3 / 2:.1f} ms/GiB)")

            return go

        torch_to_child = torch_to(lambda: child, "the vmmalloc child")
        torch_from_child = torch_from(lambda: child, "the vmmalloc child")

        run_check("torch_mp_parent_to_child", torch_to_child)
        run_check("torch_mp_child_to_parent", torch_from_child)

        def native():
            nat = Child(ctx, native_worker, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
            try:
                _, (h, offset, n) = nat.ask(timeout=60)
                try:
                    base = vm.ipc_import(h)
                except vm.VmmallocError as e:
                    return "FAIL", f"{e}; handle {len(h)} bytes: {h[:32].hex()}"
                good = holds(base + offset, n, 1)
                fill(base + offset, n, 2)
                vm.ipc_close(base)
                _, seen = nat.ask(("check",))
            finally:
                nat.proc.join(10)
            if not good:
                return "FAIL", f"PyTorch's bytes differ here (handle {h[:2].hex()}..., offset {offset})"
            if not seen:
                return "FAIL", "our write is not seen by the PyTorch producer"
            return "ok", f"PyTorch {torch.__version__} expandable-segments handle version {h[0]}: {n} B at offset {offset}, both ways"

        refused = pidfd_probe()
        print(f"pidfd_getfd here: {refused}", flush=True)

        def needs(direction, fn):
            """fn, or a SKIP naming the environment when `direction` is refused."""
            return (lambda: ("SKIP", refused[direction])) if refused.get(direction) else fn

        # The PyTorch producer is the child: the parent takes its descriptors.
        run_check("torch_native_handle", needs("parent_from_child", native))

        # A stock PyTorch process (no vmmalloc) on either side of a
        # torch.multiprocessing Pipe, with PyTorch's default allocator (its
        # cudaIpc handles) and with expandable segments ('e' handles): the
        # companion writes PyTorch's own handle for the stock consumer and
        # reads both kinds from a stock producer (issue 35, item 2).
        for conf, label in (("", "default"), ("expandable_segments:True", "expandable")):
            env = {"PYTORCH_CUDA_ALLOC_CONF": conf or None, "VMMALLOC_CONF": None}
            stock = None

            def start(conf=conf):
                nonlocal stock
                if stock is None:
                    stock = Child(ctx, stock_worker, env=env)
                    _, ident = stock.ask(timeout=torch_common.child_timeout(60))
                    if ident["vmmalloc_imported"] or ident["backend"] != "native" or ident["conf"] != conf:
                        raise RuntimeError(f"the consumer is not stock PyTorch: {ident}")
                return stock

            who = f"a stock PyTorch process ({label} allocator)"
            to_stock = torch_to(start, who)
            from_stock = torch_from(start, who)

            if label == "expandable":
                # 'e' handles: the consumer takes the producer's descriptors.
                to_stock = needs("child_from_parent", to_stock)
                from_stock = needs("parent_from_child", from_stock)
            try:
                run_check(f"torch_stock_{label}_vmmalloc_to_stock", to_stock)
                run_check(f"torch_stock_{label}_stock_to_vmmalloc", from_stock)
                if label == "expandable":
                    run_check("torch_stock_2gib_vmmalloc_to_stock",
                              needs("child_from_parent", big_to_stock(start, who)))
            finally:
                if stock is not None:
                    stock.stop()
    finally:
        child.stop()
    return 1 if FAILED else 0


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    if rc != 3:  # else the last line printed is why it cannot run
        print(f"torch_ipc_checks: {'FAILED ' + ', '.join(FAILED) if FAILED else 'no failure'} in "
              f"{time.monotonic() - t0:.1f}s", flush=True)
    sys.exit(rc)
