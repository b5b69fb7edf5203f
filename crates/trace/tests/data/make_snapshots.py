#!/usr/bin/env python3
"""Writes the synthetic PyTorch-style snapshots the tests read (no torch needed).

Run from this directory: python3 make_snapshots.py
The expected figures are asserted in ../snapshots.rs.
"""
import pickle

MIB = 1 << 20

# PyTorch 2.0 schema: blocks without `address` (they follow one another from the
# segment address), sizes from `history` (no `requested_size`), no
# `is_expandable`, events without `time_us`, `oom` with `device_free`; two devices.
v20 = {
    "segments": [
        {
            "device": 0, "address": 0x10000000, "total_size": 20 * MIB, "allocated_size": 2 * MIB,
            "active_size": 2 * MIB, "stream": 0, "segment_type": "large",
            "blocks": [
                {"size": 2 * MIB, "state": "active_allocated",
                 "history": [{"addr": 0x10000000, "real_size": 999, "frames": []},
                             {"addr": 0x10000000, "real_size": 1_500_000,
                              "frames": [{"filename": "train.py", "line": 3, "name": "f"}]}]},
                {"size": 18 * MIB, "state": "inactive"},
            ],
        },
        {
            "device": 0, "address": 0x10700000, "total_size": 2 * MIB, "allocated_size": 512,
            "active_size": 512, "stream": 0, "segment_type": "small",
            "blocks": [
                {"size": 512, "state": "active_allocated", "history": [{"addr": 0x10700000, "real_size": 10, "frames": []}]},
                {"size": 2 * MIB - 512, "state": "inactive"},
            ],
        },
    ],
    "device_traces": [
        [
            {"action": "alloc", "addr": 0x10200000, "size": 4_000_000, "stream": 0, "frames": []},
            {"action": "free_requested", "addr": 0x10200000, "size": 4_000_000, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": 0x10200000, "size": 4_000_000, "stream": 0, "frames": []},
            {"action": "free_requested", "addr": 0x10600000, "size": 700, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": 0x10600000, "size": 700, "stream": 0, "frames": []},
            {"action": "oom", "device_free": 123, "size": 1 << 40, "stream": 0, "frames": []},
            {"action": "segment_alloc", "addr": 0x10700000, "size": 2 * MIB, "stream": 0, "frames": []},
            {"action": "alloc", "addr": 0x10700000, "size": 10, "stream": 0, "frames": []},
        ],
        [
            {"action": "alloc", "addr": 0x20000000, "size": 100, "stream": 5, "frames": []},
            {"action": "free_requested", "addr": 0x20000000, "size": 100, "stream": 5, "frames": []},
            {"action": "free_completed", "addr": 0x20000000, "size": 100, "stream": 5, "frames": []},
            {"action": "alloc", "addr": 0x20000000, "size": 200, "stream": 5, "frames": []},
            {"action": "alloc", "addr": 0x20001000, "size": 300, "stream": 5, "frames": []},
            {"action": "free_requested", "addr": 0x20001000, "size": 300, "stream": 5, "frames": []},
        ],
        [],
    ],
}

S = 0x7000_0000_0000
ctx = {"compile_context": "N/A", "user_metadata": ""}
frames = [{"name": "forward", "filename": "model.py", "line": 54}]


def ev(action, addr, size, t, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1_700_000_000_000_000 + t,
         "frames": frames}
    e.update(ctx)
    e.update(extra)
    return e


# Current schema, recorded mid-run (ring buffer): the trace starts with a
# free_completed whose alloc (and free_requested) were dropped, one final active
# block was freed by the trace (a counted warning), one is pending free at the end.
current = {
    "segments": [
        {
            "device": 0, "address": S, "total_size": 40 * MIB, "allocated_size": 8 * MIB,
            "active_size": 8 * MIB, "requested_size": 7_000_000, "stream": 0, "segment_type": "large",
            "segment_pool_id": (0, 0), "is_expandable": True, "frames": [],
            "blocks": [
                {"address": S, "size": 2 * MIB, "requested_size": 2_000_000, "state": "active_allocated", "frames": frames},
                {"address": S + 2 * MIB, "size": 4 * MIB, "requested_size": 4_000_000, "state": "active_pending_free", "frames": []},
                {"address": S + 6 * MIB, "size": 2 * MIB, "requested_size": 1_000_000, "state": "active_allocated", "frames": []},
                {"address": S + 8 * MIB, "size": 32 * MIB, "requested_size": 0, "state": "inactive", "frames": []},
            ],
        }
    ],
    "device_traces": [
        [
            ev("free_completed", S + 8 * MIB, 3_000_000, 0),
            ev("segment_map", S, 40 * MIB, 1),
            ev("alloc", S + 2 * MIB, 4_000_000, 2),
            ev("alloc", S + 6 * MIB, 1_000_000, 3),
            ev("snapshot", 0, 0, 4),
            ev("free_requested", S + 6 * MIB, 1_000_000, 5),
            ev("free_completed", S + 6 * MIB, 1_000_000, 6, user_metadata="step 1"),
            ev("segment_unmap", S + 8 * MIB, 32 * MIB, 7),
            ev("free_requested", S + 2 * MIB, 4_000_000, 8, newer_field=[1, 2, 3]),
        ]
    ],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                           "expandable_segments": True, "garbage_collection_threshold": 0.0},
    "external_annotations": [{"device": 0, "stage": "START", "name": "step", "time_us": 1}],
}

with open("v20_two_devices_proto5.pickle", "wb") as f:
    pickle.dump(v20, f, protocol=5)
with open("current_midrun_proto4.pickle", "wb") as f:
    pickle.dump(current, f, protocol=4)
with open("current_midrun_proto2.pickle", "wb") as f:
    pickle.dump(current, f, protocol=2)
with open("foreign_object_proto4.pickle", "wb") as f:
    import collections
    pickle.dump(collections.OrderedDict(a=1), f, protocol=4)
