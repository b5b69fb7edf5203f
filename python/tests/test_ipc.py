"""IPC through the Python wrappers (vmmalloc.ipc_export / ipc_import /
ipc_close, vmmalloc.ipc_export_torch): the producer is this process,
each consumer a fresh Python process on device:host. PyTorch's own
expandable-segments format is checked both ways: what vmmalloc writes is
read by a reader written here from PyTorch's ExpandableSegment::fromShared
(no vmmalloc in that process), and handles built here the way stock PyTorch
2.11 and 2.15 write them are imported by vmmalloc."""

import ctypes
import os
import struct
import subprocess
import sys

import pytest

import vmmalloc
from conftest import MIB, PACKAGE_PARENT
from vmmalloc import ipc_export_torch

HOST = "device:host,capacity_gb:1,log:off,backend:expandable"

CONSUMER = r"""
import ctypes, sys
import vmmalloc
vmmalloc.configure(sys.argv[1])
handle = bytes.fromhex(sys.argv[2])
n = int(sys.argv[3])
try:
    p = vmmalloc.ipc_import(handle)
except vmmalloc.VmmallocError as e:
    print("ERROR", e)
    sys.exit(0)
got = ctypes.string_at(p, n)
want = bytes((i * 7 + 1) % 256 for i in range(n))
assert got == want, "the producer's bytes differ"
ctypes.memmove(p, bytes((i * 5 + 3) % 256 for i in range(n)), n)
vmmalloc.ipc_close(p)
print("OK")
"""


def consume(handle, n, transport=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PACKAGE_PARENT) + os.pathsep + env.get("PYTHONPATH", "")
    env["VMMALLOC_LIBRARY"] = vmmalloc.library_path()
    env.pop("VMMALLOC_IPC_TRANSPORT", None)
    if transport:
        env["VMMALLOC_IPC_TRANSPORT"] = transport
    out = subprocess.run(
        [sys.executable, "-c", CONSUMER, HOST, handle.hex(), str(n)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("transport", [None, "socket"])
def test_round_trip_write_seen_by_producer_then_freed(lib, fresh, transport):
    a = fresh(HOST)
    a.malloc(1000)
    for n in (3000, 5 * MIB + 123):
        p = a.malloc(n)
        a.write(p, bytes((i * 7 + 1) % 256 for i in range(n)))
        h = vmmalloc.ipc_export(p)
        assert vmmalloc.ipc_export(p) == h
        assert consume(h, n, transport) == "OK"
        assert a.read(p, n) == bytes((i * 5 + 3) % 256 for i in range(n))
        vmmalloc.validate(0)
        a.free(p)
        out = consume(h, n, transport)
        assert out.startswith("ERROR") and "freed" in out, out


def test_bad_handles_raise_naming_both_formats(lib, fresh):
    a = fresh(HOST)
    p = a.malloc(4096)
    h = vmmalloc.ipc_export(p)
    newer = h[:8] + bytes([9]) + h[9:]
    with pytest.raises(vmmalloc.VmmallocError, match="v9.*vmmalloc IPC handle v2"):
        vmmalloc.ipc_import(newer)
    # PyTorch's legacy cudaIpc handle: only the CUDA driver maps it.
    with pytest.raises(vmmalloc.VmmallocError, match="cudaMalloc IPC handle.*needs device:cuda"):
        vmmalloc.ipc_import(bytes([2]) + b"c" + bytes(64))
    with pytest.raises(vmmalloc.VmmallocError, match="not a live allocation"):
        vmmalloc.ipc_export(p + 512)
    with pytest.raises(TypeError):
        vmmalloc.ipc_import("not bytes")
    a.free(p)


def test_import_in_the_same_process_and_close(lib, fresh):
    a = fresh(HOST)
    p = a.malloc(2 * MIB)
    a.write(p, b"xyz")
    q = vmmalloc.ipc_import(vmmalloc.ipc_export(p))
    assert q != p and ctypes.string_at(q, 3) == b"xyz"
    ctypes.memmove(q, b"abc", 3)
    assert a.read(p, 3) == b"abc"
    vmmalloc.ipc_close(q)
    with pytest.raises(vmmalloc.VmmallocError, match="not a pointer vmmalloc_ipc_import returned"):
        vmmalloc.ipc_close(q)
    a.free(p)


def pattern(gen, n):
    # Byte i is (i * 31 + gen * 101) % 256: period 256, built from one period.
    cycle = bytes((i * 31 + gen * 101) % 256 for i in range(256))
    return (cycle * (n // 256 + 1))[:n]


def parse_like_pytorch(h):
    """PyTorch's ExpandableSegment::fromShared (c10/cuda/CUDACachingAllocator.cpp),
    written here from its layout: [version]['e'], a ShareHeader (version 2:
    pid_t pid, size_t segment_size, size_t num_handles = 24 bytes with the
    padding after pid; version 3, PyTorch 2.13+: the same and an int
    handle_type, 32 bytes), then one int descriptor per handle (handle_type
    POSIX_FD = 1)."""
    version, kind = h[0], h[1:2]
    assert kind == b"e"
    if version == 2:
        pid, segment_size, n = struct.unpack_from("<i4xQQ", h, 2)
        header = 24
    else:
        assert version == 3, version
        pid, segment_size, n, handle_type = struct.unpack_from("<i4xQQi4x", h, 2)
        assert handle_type == 1, handle_type
        header = 32
    assert struct.calcsize("<i4xQQ") == 24 and struct.calcsize("<i4xQQi4x") == 32
    assert len(h) == 2 + header + 4 * n, (len(h), n)
    fds = list(struct.unpack_from(f"<{n}i", h, 2 + header))
    return version, pid, segment_size, fds


def stock_handle(version, pid, segment_size, fds, junk=0xAB):
    """The bytes stock PyTorch of handle version ``version`` writes, with its
    uninitialized padding as ``junk``."""
    pad = bytes([junk]) * 4
    head = struct.pack("<i", pid) + pad + struct.pack("<QQ", segment_size, len(fds))
    if version == 3:
        head += struct.pack("<i", 1) + pad
    return bytes([version]) + b"e" + head + struct.pack(f"<{len(fds)}i", *fds)


# A consumer without vmmalloc: takes the producer's descriptors as PyTorch's
# fromShared does (pidfd_open + pidfd_getfd) and maps them in order. On
# device:host a chunk is a memfd, so mmap stands in for
# cuMemImportFromShareableHandle + cuMemMap.
RAW_CONSUMER = r"""
import ctypes, mmap, os, struct, sys
h = bytes.fromhex(sys.argv[1]); off = int(sys.argv[2]); n = int(sys.argv[3])
version = h[0]
header = 24 if version == 2 else 32
pid, seg, count = struct.unpack_from("<i4xQQ", h, 2)
fds = struct.unpack_from(f"<{count}i", h, 2 + header)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
pidfd = os.pidfd_open(pid)
maps = []
for fd in fds:
    mine = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd
    assert mine >= 0, os.strerror(ctypes.get_errno())
    maps.append(mmap.mmap(mine, seg))
    os.close(mine)
def read(at, k):
    out = b""
    while k:
        m, o = divmod(at, seg)
        take = min(k, seg - o)
        out += maps[m][o:o + take]
        at += take; k -= take
    return out
def write(at, data):
    while data:
        m, o = divmod(at, seg)
        take = min(len(data), seg - o)
        maps[m][o:o + take] = data[:take]
        at += take; data = data[take:]
def pattern(gen):  # byte i: (i * 31 + gen * 101) % 256, period 256
    cycle = bytes((i * 31 + gen * 101) % 256 for i in range(256))
    return (cycle * (n // 256 + 1))[:n]
assert read(off, n) == pattern(1), "the producer's bytes differ"
write(off, pattern(2))
print("OK")
"""

IMPORTER = r"""
import ctypes, sys
import vmmalloc
vmmalloc.configure(sys.argv[1])
h = bytes.fromhex(sys.argv[2]); off = int(sys.argv[3]); n = int(sys.argv[4])
base = vmmalloc.ipc_import(h)
assert ctypes.string_at(base + off, n) == bytes((i * 31 + 101) % 256 for i in range(n))
ctypes.memmove(base + off, bytes((i * 31 + 202) % 256 for i in range(n)), n)
vmmalloc.ipc_close(base, stream=0)
print("OK")
"""


def run_py(code, *args, with_vmmalloc=False):
    env = dict(os.environ)
    env.pop("VMMALLOC_IPC_TRANSPORT", None)
    env.pop("VMMALLOC_IPC_FORMAT", None)
    if with_vmmalloc:
        env["PYTHONPATH"] = str(PACKAGE_PARENT) + os.pathsep + env.get("PYTHONPATH", "")
        env["VMMALLOC_LIBRARY"] = vmmalloc.library_path()
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_stock_format_written_by_vmmalloc_reads_as_pytorch_reads_it(lib, fresh):
    a = fresh(HOST)
    a.malloc(1000)
    n = 3 * MIB + 100
    p = a.malloc(n)
    for torch_version, version in (("2.15.0+cu132", 3), ("2.11", 2), ((2, 13), 3), ("2.12.1", 2)):
        a.write(p, pattern(1, n))
        h, off = ipc_export_torch(p, torch_version)
        v, pid, seg, fds = parse_like_pytorch(h)
        assert v == version and pid == os.getpid()
        assert h[6:10] == bytes(4), "padding written as zeros"
        assert off + n <= seg * len(fds)
        assert run_py(RAW_CONSUMER, h.hex(), off, n) == "OK"
        assert a.read(p, n) == pattern(2, n)
    # A PyTorch whose layout vmmalloc has not verified: vmmalloc's own format.
    h, off = ipc_export_torch(p, "2.9.1")
    assert h.startswith(b"VMMIPC") and off == 0
    a.free(p)


def test_stock_handles_of_pytorch_2_11_and_2_15_are_imported(lib, fresh):
    a = fresh(HOST)
    n = 5 * MIB + 7
    p = a.malloc(n)
    h, off = ipc_export_torch(p, "2.15")
    _, pid, seg, fds = parse_like_pytorch(h)
    for version in (2, 3):
        a.write(p, pattern(1, n))
        stock = stock_handle(version, pid, seg, fds)
        assert run_py(IMPORTER, HOST, stock.hex(), off, n, with_vmmalloc=True) == "OK"
        assert a.read(p, n) == pattern(2, n)
    with pytest.raises(vmmalloc.VmmallocError, match="version 9.*unknown version"):
        vmmalloc.ipc_import(bytes([9]) + stock[1:])
    a.free(p)


def test_format_choice_is_named(lib, fresh, monkeypatch):
    a = fresh(HOST)
    p = a.malloc(4096)
    monkeypatch.setenv("VMMALLOC_IPC_FORMAT", "vmmalloc")
    h, off = ipc_export_torch(p, "2.15")
    assert h.startswith(b"VMMIPC") and off == 0
    monkeypatch.setenv("VMMALLOC_IPC_FORMAT", "torch")
    with pytest.raises(vmmalloc.VmmallocError, match="VMMALLOC_IPC_FORMAT=torch.*2.10"):
        ipc_export_torch(p, "2.10")
    monkeypatch.setenv("VMMALLOC_IPC_FORMAT", "nope")
    with pytest.raises(vmmalloc.VmmallocError, match="auto, torch, vmmalloc"):
        ipc_export_torch(p, "2.15")
    a.free(p)


def test_large_tensors_are_rebacked_for_pytorchs_format(lib, fresh):
    """Issue 40, item 2: a 300 MiB tensor on a 1 GiB device (largest chunk
    128 MiB) lies on chunks of different sizes; exported for PyTorch 2.15 it
    is re-backed with equal handles once and read by the reader without
    vmmalloc (RAW_CONSUMER, PyTorch's fromShared layout)."""
    a = fresh(HOST)
    a.malloc(1000)
    n = 300 * MIB + 4096
    p = a.malloc(n)
    a.write(p, pattern(1, n))
    h, off = ipc_export_torch(p, "2.15")
    v, pid, seg, fds = parse_like_pytorch(h)
    assert v == 3 and pid == os.getpid()
    assert off < seg and off + n <= seg * len(fds)
    assert run_py(RAW_CONSUMER, h.hex(), off, n) == "OK"
    assert a.read(p, n) == pattern(2, n)
    assert ipc_export_torch(p, "2.15") == (h, off), "the same handle again"
    stats = vmmalloc.memory_stats(0)
    assert stats["vmmalloc.ipc_rebacks"] == 1
    assert stats["vmmalloc.ipc_rebacked_bytes"] >= n
    a.free(p)
