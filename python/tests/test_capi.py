"""libvmmalloc.so through ctypes, as vmmalloc's Python API uses it (no torch)."""

import ctypes
import json
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import vmmalloc
from conftest import INSTALLED, MIB, PACKAGE_PARENT, REPO

HOST = "device:host,capacity_gb:1,log:off"


def test_library_is_found_and_versioned(lib):
    assert Path(vmmalloc.library_path()).name == "libvmmalloc.so"
    assert vmmalloc.version() == "0.1.0"


def test_find_library_honours_env_and_never_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("VMMALLOC_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(FileNotFoundError, match="missing.so"):
        vmmalloc.find_library()
    monkeypatch.delenv("VMMALLOC_LIBRARY")
    tried = [str(p) for _, p in vmmalloc._lib.candidates()]
    inside = Path(vmmalloc.__file__).resolve().parent / "libvmmalloc.so"
    assert tried[0] == str(inside)  # the library pip installs comes first
    if INSTALLED:
        assert Path(vmmalloc.find_library()) == inside
        assert tried == [str(inside)]
    else:
        assert tried[-1] == str(REPO / "target" / "release" / "libvmmalloc.so")


def test_alloc_write_free_and_stats(lib, backend, fresh):
    a = fresh(f"{HOST},backend:{backend}")
    sizes = [1, 512, 4096, MIB + 1, 3 * MIB, 20 * MIB + 7]
    ptrs = []
    for i, s in enumerate(sizes):
        p = a.malloc(s)
        assert p, vmmalloc.last_error()
        a.write(p, bytes([i + 1]) * min(s, 65536))
        ptrs.append(p)
    for i, (p, s) in enumerate(zip(ptrs, sizes)):
        assert a.read(p, min(s, 65536)) == bytes([i + 1]) * min(s, 65536)
    st = vmmalloc.memory_stats(0)
    assert st["allocation.all.current"] == len(sizes)
    assert st["requested_bytes.all.current"] == sum(sizes)
    assert st["allocated_bytes.all.current"] >= sum(sizes)
    vmmalloc.validate(0)
    for p, s in zip(ptrs, sizes):
        a.free(p, s)
        assert vmmalloc.last_error() is None
    st = vmmalloc.memory_stats(0)
    assert st["allocation.all.current"] == 0
    assert st["requested_bytes.all.peak"] == sum(sizes)
    vmmalloc.reset_peak_memory_stats(0)
    assert vmmalloc.memory_stats(0)["requested_bytes.all.peak"] == 0
    vmmalloc.empty_cache()
    vmmalloc.validate(0)


def test_threads_share_the_allocator(lib, backend, fresh):
    a = fresh(f"{HOST},backend:{backend}")
    errors = []

    def work(t):
        try:
            for i in range(200):
                size = 1 + (i * 7919 + t * 104729) % (2 * MIB)
                p = a.malloc(size)
                assert p, vmmalloc.last_error()
                a.write(p, bytes([t]) * 64)
                assert a.read(p, 64) == bytes([t]) * 64
                a.free(p, size)
        except Exception as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert vmmalloc.memory_stats(0)["allocation.all.current"] == 0
    vmmalloc.validate(0)


def test_summary_has_pytorch_layout(lib, backend, fresh):
    a = fresh(f"{HOST},backend:{backend}")
    p = a.malloc(3 * MIB)
    text = vmmalloc.memory_summary(0)
    lines = text.splitlines()
    assert all(len(l) == 77 and l[0] == "|" and l[-1] == "|" for l in lines), text
    assert "vmmalloc CUDA memory summary, device ID 0" in text
    assert " Requested memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   " in text
    assert f"backend {backend} on host device" in text
    a.free(p, 3 * MIB)


def test_bad_input_is_reported_not_fatal(lib, fresh):
    a = fresh(f"{HOST},backend:native")
    keep = a.malloc(MIB)
    a.write(keep, b"\xab" * MIB)
    a.free(None)
    assert vmmalloc.last_error() is None
    a.free(keep + 16)
    assert "not a live allocation" in vmmalloc.last_error()
    p = a.malloc(64)
    a.free(p)
    a.free(p)
    assert "not a live allocation" in vmmalloc.last_error()
    assert not a.malloc(0)
    assert "size 0" in vmmalloc.last_error()
    assert not a.malloc(2**62)
    assert "out of memory" in vmmalloc.last_error()
    assert not a.malloc(64, device=5)
    assert "invalid device ordinal 5" in vmmalloc.last_error()
    with pytest.raises(vmmalloc.VmmallocError, match="invalid device ordinal -1"):
        vmmalloc.memory_stats(-1)
    with pytest.raises(vmmalloc.VmmallocError, match="no-such-dir"):
        vmmalloc.dump_snapshot("/no-such-dir/x.pickle")
    assert vmmalloc.memory_stats(0)["allocation.all.current"] == 1
    assert a.read(keep, MIB) == b"\xab" * MIB
    vmmalloc.validate(0)
    a.free(keep)


def test_bad_config_names_the_key(lib, fresh):
    lib.vmmalloc_reset_for_tests()
    with pytest.raises(vmmalloc.VmmallocError, match=r"unknown key `colour`; valid keys: backend, device"):
        vmmalloc.configure("device:host,colour:blue")
    with pytest.raises(vmmalloc.VmmallocError, match=r"bad value `4x` for key `capacity_gb`"):
        vmmalloc.configure("device:host,capacity_gb:4x")


def test_python_reads_the_configuration_from_the_library(lib, fresh):
    # One parser (the library's): `=` and `:`, the last value wins.
    assert vmmalloc._lib.config("device=host")["device"] == "host"
    assert vmmalloc._lib.config("device:cuda,device=host,max_chunk_mb:20")["max_chunk_mb"] == "20"
    with pytest.raises(vmmalloc.VmmallocError, match=r"unknown key `colour`"):
        vmmalloc._lib.config("colour:blue")


def test_bad_env_config_fails_first_malloc(lib, tmp_path):
    code = (
        "import vmmalloc, sys\n"
        "lib = vmmalloc.load()\n"
        "import ctypes; out = ctypes.c_void_p()\n"
        "assert lib.vmmalloc_try_malloc(64, 0, None, ctypes.byref(out)) == 2 and not out.value\n"
        "print(vmmalloc.last_error())\n"
    )
    env = dict(os.environ, VMMALLOC_CONF="device:host,backend:fast", PYTHONPATH=str(PACKAGE_PARENT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bad value `fast` for key `backend`; valid: expandable | caching | torch-es | native" in out.stdout
    # ... and the one log line on stderr says the same.
    assert "vmmalloc: error: VMMALLOC_CONF: bad value `fast`" in out.stderr


# ---------------------------------------------------------------------------
# Snapshots: the schema torch.cuda._memory_viz reads
# ---------------------------------------------------------------------------

STATES = {"active_allocated", "active_pending_free", "inactive"}


def check_memory_viz_schema(snap):
    """Reads the snapshot the way torch/cuda/_memory_viz.py does (segsum,
    segments/memory via _write_blocks, trace) and checks what it asserts.
    Returns (total_reserved, total_allocated)."""
    assert set(snap) >= {"segments", "device_traces"}
    total_reserved = total_allocated = free_external = free_internal = 0
    for seg in sorted(snap["segments"], key=lambda s: s["total_size"]):
        for k in ("address", "total_size", "stream", "allocated_size", "active_size", "requested_size", "device"):
            assert isinstance(seg[k], int), k
        assert seg["segment_type"] in ("small", "large")
        assert isinstance(seg["is_expandable"], bool)
        total_reserved += seg["total_size"]
        seg_alloc = seg_ext = seg_int = 0
        addr = seg["address"]
        for b in seg["blocks"]:
            assert b["state"] in STATES
            assert b["address"] == addr, "blocks follow one another"
            assert isinstance(b["frames"], list)
            # _block_extra: frames and requested_size when 'frames' is present.
            if b["state"] == "active_allocated":
                seg_alloc += b["requested_size"]
                seg_int += b["size"] - b["requested_size"]
            else:
                seg_ext += b["size"]
            addr += b["size"]
        # segsum's assertion.
        assert seg_ext + seg_int + seg_alloc == seg["total_size"]
        total_allocated += seg_alloc
        free_external += seg_ext
        free_internal += seg_int
    assert free_internal + free_external + total_allocated == total_reserved
    for dev in snap["device_traces"]:
        assert isinstance(dev, list)
        for e in dev:
            assert e["action"] in {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                                   "segment_map", "segment_unmap", "oom", "snapshot"}
            assert isinstance(e["addr"], int) and isinstance(e["size"], int)
            assert isinstance(e["stream"], int) and isinstance(e["time_us"], int)
            assert isinstance(e["frames"], list)
            if e["action"] == "oom":
                assert isinstance(e["device_free"], int)
    return total_reserved, total_allocated


def test_snapshot_pickle_has_pytorch_schema(lib, backend, fresh, tmp_path):
    a = fresh(f"{HOST},backend:{backend},record_history:True")
    sizes = [1000, 2 * MIB, 30 * MIB]
    ptrs = [a.malloc(s) for s in sizes]
    assert all(ptrs), vmmalloc.last_error()
    a.free(ptrs[1], sizes[1])
    assert not a.malloc(2 * 1024 * MIB)  # an oom event
    path = tmp_path / "snap.pickle"
    vmmalloc.dump_snapshot(str(path))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    reserved, allocated = check_memory_viz_schema(snap)
    assert allocated == sizes[0] + sizes[2]
    assert reserved == vmmalloc.memory_stats(0)["reserved_bytes.all.current"]
    live = {(b["address"], b["requested_size"]) for s in snap["segments"] for b in s["blocks"]
            if b["state"] == "active_allocated"}
    assert live == {(ptrs[0], sizes[0]), (ptrs[2], sizes[2])}
    actions = [(e["action"], e["addr"]) for e in snap["device_traces"][0] if not e["action"].startswith("segment_")]
    assert actions == [("alloc", ptrs[0]), ("alloc", ptrs[1]), ("alloc", ptrs[2]),
                       ("free_requested", ptrs[1]), ("free_completed", ptrs[1]),
                       ("oom", snap["device_traces"][0][-1]["device_free"])]
    assert snap["allocator_settings"]["backend"] == backend
    assert "record_history:True" in snap["allocator_settings"]["VMMALLOC_CONF"]
    try:
        from torch.cuda import _memory_viz
    except Exception:  # torch is optional here; the checks above mirror its reads
        _memory_viz = None
    if _memory_viz is not None:
        assert "segments:" in _memory_viz.segsum(snap)
        assert "alloc" in _memory_viz.trace(snap) or "=" in _memory_viz.trace(snap)
    a.free(ptrs[0], sizes[0])
    a.free(ptrs[2], sizes[2])


def cli():
    """The vmmalloc CLI built next to the library (cargo test --workspace builds it)."""
    env = os.environ.get("VMMALLOC_CLI")
    if env:
        return env
    if INSTALLED:
        lib_dir = REPO / "target" / "debug"
    else:
        lib_dir = Path(os.environ.get("VMMALLOC_LIBRARY", REPO / "target" / "debug" / "x")).parent
    p = lib_dir / "vmmalloc"
    return str(p) if p.is_file() else None


def test_snapshot_replays_in_our_reader(lib, fresh, tmp_path):
    exe = cli()
    if exe is None:
        pytest.skip("the vmmalloc CLI is not built (cargo build --bin vmmalloc); "
                    "crates/capi/tests/capi.rs reads the pickle with vmmalloc_trace instead")
    a = fresh(f"{HOST},backend:native,record_history:True")
    ptrs = [a.malloc(s) for s in (MIB, 5 * MIB, 7 * MIB)]
    a.free(ptrs[1])
    path = tmp_path / "snap.pickle"
    vmmalloc.dump_snapshot(str(path))
    out = subprocess.run([exe, "replay", str(path), "--policy", "native", "--capacity", "1GiB"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for p in (ptrs[0], ptrs[2]):
        a.free(p)
