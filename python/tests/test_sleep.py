"""Sleep and wake through ctypes (issue 12): tags, pause, resume, stats, bad input."""

import pickle

import pytest

import vmmalloc
from conftest import MIB

HOST = "device:host,capacity_gb:1,log:off,backend:expandable"


def test_region_tags_and_restores(lib, fresh):
    fresh(HOST)
    assert vmmalloc.get_tag() == ""
    with vmmalloc.region("py-weights"):
        assert vmmalloc.get_tag() == "py-weights"
        with vmmalloc.region("py-kv"):
            assert vmmalloc.get_tag() == "py-kv"
        assert vmmalloc.get_tag() == "py-weights"
    assert vmmalloc.get_tag() == ""


def test_pause_with_backup_keeps_bytes_at_the_same_address(lib, fresh, tmp_path):
    a = fresh(HOST)
    sizes = (8 * MIB, 3 * MIB + 5, 1000)
    with vmmalloc.region("py-weights"):
        ptrs = [a.malloc(s) for s in sizes]
    assert all(ptrs), vmmalloc.last_error()
    for i, (p, s) in enumerate(zip(ptrs, sizes)):
        a.write(p, bytes([i + 7]) * min(s, 65536))
    other = a.malloc(MIB)
    freed = vmmalloc.pause("py-weights", backup=True)
    assert freed >= 11 * MIB
    vmmalloc.validate(0)
    st = vmmalloc.memory_stats(0)
    assert st["vmmalloc.tags.py-weights.paused"] == 1
    assert st["vmmalloc.paused_bytes"] >= 11 * MIB
    assert st["vmmalloc.backup_bytes"] == st["vmmalloc.paused_bytes"]
    assert "paused" in vmmalloc.memory_summary(0)
    path = tmp_path / "paused.pickle"
    vmmalloc.dump_snapshot(str(path))
    with open(path, "rb") as fh:
        snap = pickle.load(fh)
    assert sorted(b["address"] for b in snap["vmmalloc_paused_blocks"]) == sorted(ptrs)
    seg_blocks = [b["address"] for s in snap["segments"] for b in s["blocks"]]
    assert not set(ptrs) & set(seg_blocks)  # no memory behind them: in no segment
    (t,) = [t for t in vmmalloc.tag_stats(0) if t["tag"] == "py-weights"]
    assert t["paused"] and t["mapped_bytes"] == 0
    # Allocating with a paused tag fails clearly.
    with vmmalloc.region("py-weights"):
        assert a.malloc(MIB) is None
        assert "paused" in vmmalloc.last_error()
    mapped = vmmalloc.resume("py-weights")
    assert mapped >= 11 * MIB
    vmmalloc.validate(0)
    for i, (p, s) in enumerate(zip(ptrs, sizes)):
        assert a.read(p, min(s, 65536)) == bytes([i + 7]) * min(s, 65536)
    for p in ptrs + [other]:
        a.free(p)
    vmmalloc.validate(0)


def test_pause_all_without_backup_then_memory_is_usable(lib, fresh):
    a = fresh(HOST)
    with vmmalloc.region("py-a"):
        p = a.malloc(4 * MIB)
    with vmmalloc.region("py-b"):
        q = a.malloc(2 * MIB)
    assert vmmalloc.pause() >= 6 * MIB  # every non-default tag
    vmmalloc.validate(0)
    assert vmmalloc.resume() >= 6 * MIB
    a.write(p, b"x" * 100)
    a.write(q, b"y" * 100)
    assert a.read(p, 100) == b"x" * 100
    a.free(p)
    a.free(q)


def test_bad_input_raises_and_changes_nothing(lib, fresh):
    a = fresh(HOST)
    with vmmalloc.region("py-bad"):
        p = a.malloc(MIB)
    with pytest.raises(vmmalloc.VmmallocError, match="'py-never-used'"):
        vmmalloc.pause("py-bad", "py-never-used")
    with pytest.raises(vmmalloc.VmmallocError, match="not paused"):
        vmmalloc.resume("py-bad")
    with pytest.raises(vmmalloc.VmmallocError, match="64"):
        vmmalloc.set_tag("t" * 65)
    with pytest.raises(vmmalloc.VmmallocError):
        vmmalloc.set_tag("a,b")
    with pytest.raises(vmmalloc.VmmallocError, match="UTF-8"):
        vmmalloc.set_tag("\udcff")
    # Raw bytes that are not UTF-8, through the C ABI directly.
    vmmalloc._sleep._load()
    assert lib.vmmalloc_set_tag(b"\xff\xfe") == -1
    assert "UTF-8" in vmmalloc.last_error()
    assert lib.vmmalloc_pause(b"\xff", 0) == -1
    assert vmmalloc.get_tag() == ""
    vmmalloc.pause("py-bad")
    with pytest.raises(vmmalloc.VmmallocError, match="already paused"):
        vmmalloc.pause("py-bad")
    vmmalloc.validate(0)
    vmmalloc.resume("py-bad")
    a.free(p)


@pytest.mark.parametrize("backend", ["caching", "native"])
def test_other_policies_cannot_sleep(lib, fresh, backend):
    a = fresh(f"device:host,capacity_gb:1,log:off,backend:{backend}")
    with vmmalloc.region("py-other"):
        p = a.malloc(MIB)
    with pytest.raises(vmmalloc.VmmallocError, match="cannot pause"):
        vmmalloc.pause("py-other")
    a.free(p)
