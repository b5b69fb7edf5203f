"""IPC without PyTorch through the Python wrappers (vmmalloc.ipc_export /
ipc_import / ipc_close): the producer is this process, each consumer a
fresh Python process on device:host."""

import ctypes
import os
import subprocess
import sys

import pytest

import vmmalloc
from conftest import MIB, PACKAGE_PARENT

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
    with pytest.raises(vmmalloc.VmmallocError, match="v9.*vmmalloc IPC handle v1"):
        vmmalloc.ipc_import(newer)
    with pytest.raises(vmmalloc.VmmallocError, match="cudaIpcMemHandle_t"):
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
