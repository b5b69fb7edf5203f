#!/usr/bin/env bash
# gpu-check-pytorch.sh — the PyTorch plug-in (issue 6) on a real GPU, in one
# call of at most ~8 minutes on an H100/H200. Called at the end of
# scripts/gpu-check.sh; runs on its own too.
#
#   1. Builds target/release/libvmmalloc.so (cargo build --release -p vmmalloc-capi),
#      unless VMMALLOC_LIBRARY names one (a bundle's).
#   2. scripts/torch_fragmentation.py under a memory limit (LIMIT_GB, default 8):
#      PyTorch's default allocator and vmmalloc's caching replica must run out
#      of memory from fragmentation; vmmalloc expandable, torch-es and native
#      must complete, with every tensor's contents checked.
#   3. scripts/torch_train_varlen.py (variable sequence lengths) under PyTorch's
#      allocator and each vmmalloc backend: peak reserved and step time side by side.
#   4. scripts/torch_plugin_checks.py (issue 11), under vmmalloc expandable:
#      non-contiguous tensors copied across two GPUs (skipped, with the reason,
#      on a one-GPU box), a CUDA graph replayed 100 times, out-of-memory caught
#      as torch.cuda.OutOfMemoryError with vmmalloc's text,
#      torch.cuda.memory_allocated() matching vmmalloc's stats, a growable
#      tensor's zero-copy torch view and the pressure callback (issue 13).
#   5. scripts/torch_sleep_checks.py sleep (issue 12), under vmmalloc expandable:
#      pause gives back >= 95 % of the tagged bytes (cuMemGetInfo), resume
#      restores the data in place, a captured graph replays after resume.
#   6. scripts/torch_ipc_checks.py (issue 28, IPC): the driver's export rule,
#      the cost of requesting POSIX fd handles (ipc:auto), C ABI round trips
#      between processes both ways, torch.multiprocessing both ways (SKIP until
#      the torch companion wires shareIpcHandle), a PyTorch-native handle read.
#
# usage: scripts/gpu-check-pytorch.sh [PART...]   (default: all of them)
#   PART: fragmentation, train, or one check of torch_plugin_checks.py
#   (peer-copy, graph-replay, oom-exception, memory-allocated, growable), sleep, or ipc; scripts/gpu-check.sh
#   runs them as separate steps.
#
# Runs from a bundle (scripts/gpu-bundle.sh) when VMMALLOC_LIBRARY names its
# libvmmalloc.so and PYTHONPATH its python/ (scripts/gpu-check.sh sets both);
# otherwise builds target/release/libvmmalloc.so with cargo.
#
# Needs python3 with a CUDA build of PyTorch. Exit status: 0 when every check
# passed, 1 otherwise (each check still runs), 3 with one clear line (the
# last) when it cannot run: no python, no PyTorch, no CUDA device, a PyTorch
# without the pluggable-allocator hooks.
#
# Environment: LIMIT_GB (fragmentation limit, default 8), STEPS (training
# steps, default 60), PYTHON (default python3), CARGO_FLAGS (e.g. "--offline"),
# VMMALLOC_LIBRARY (a built libvmmalloc.so: no cargo build).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."

PY="${PYTHON:-python3}"
LIMIT_GB="${LIMIT_GB:-8}"
STEPS="${STEPS:-60}"
read -r -a cargo_flags <<<"${CARGO_FLAGS:-}"

parts=("$@")
((${#parts[@]} > 0)) || parts=(fragmentation train peer-copy graph-replay oom-exception memory-allocated growable sleep ipc)
for part in "${parts[@]}"; do
    case $part in
        fragmentation | train | peer-copy | graph-replay | oom-exception | memory-allocated | growable | sleep | ipc) ;;
        *) echo "gpu-check-pytorch: unknown part $part" >&2; exit 2 ;;
    esac
done
wants() {
    local p
    for p in "${parts[@]}"; do [[ $p == "$1" ]] && return 0; done
    return 1
}

skip() {
    # One line (the last printed): scripts/gpu-check.sh quotes it.
    echo "gpu-check-pytorch: cannot run: $(tr '\n' ' ' <<<"$*" | sed 's/ *$//')"
    exit 3
}
command -v "$PY" >/dev/null 2>&1 || skip "$PY is not installed"
torch_info="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)" \
    || skip "PyTorch is not installed for $PY ($(tail -n 1 <<<"$torch_info"))"
torch_info="$(tail -n 1 <<<"$torch_info")" # after any warnings
[[ $torch_info == *True ]] || skip "PyTorch has no usable CUDA device (torch, cuda, available: $torch_info)"
echo "PyTorch: $torch_info"
# The hook CUDAPluggableAllocator needs (torch/cuda/memory.py,
# change_current_allocator; PyTorch >= 2.0).
"$PY" -c 'import torch.cuda.memory as m; m.CUDAPluggableAllocator; m.change_current_allocator' >/dev/null 2>&1 \
    || skip "this PyTorch has no torch.cuda.memory.CUDAPluggableAllocator / change_current_allocator"

failures=()
step() {
    local name=$1
    shift
    echo "--- $name"
    local t0=$SECONDS
    if "$@"; then
        echo "--- $name: ok ($((SECONDS - t0)) s)"
    else
        echo "--- $name: FAILED ($((SECONDS - t0)) s)"
        failures+=("$name")
    fi
}

if [[ -n ${VMMALLOC_LIBRARY:-} ]]; then
    [[ -f $VMMALLOC_LIBRARY ]] || skip "VMMALLOC_LIBRARY=$VMMALLOC_LIBRARY does not exist"
    echo "plug-in: $VMMALLOC_LIBRARY"
else
    command -v cargo >/dev/null 2>&1 || skip "no VMMALLOC_LIBRARY and no cargo to build libvmmalloc.so"
    step "build libvmmalloc.so" cargo build --release ${cargo_flags[@]+"${cargo_flags[@]}"} -p vmmalloc-capi
    export VMMALLOC_LIBRARY="$PWD/target/release/libvmmalloc.so"
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
results="$(mktemp)"
trap 'rm -f "$results"' EXIT

# run_py LABEL CONF SCRIPT ARGS...: runs SCRIPT (under `python -m vmmalloc` with
# VMMALLOC_CONF=CONF, or plainly when CONF is empty), collects its RESULT line.
run_py() {
    local label=$1 conf=$2
    shift 2
    local out rc=0
    if [[ -z $conf ]]; then
        out="$(timeout 150 "$PY" "$@" 2>&1)" || rc=$?
    else
        out="$(VMMALLOC_CONF="$conf" timeout 150 "$PY" -m vmmalloc "$@" 2>&1)" || rc=$?
    fi
    printf '%s\n' "$out" | grep -v '^RESULT ' | tail -n 5 | sed "s/^/    [$label] /"
    printf '%s\n' "$out" | grep '^RESULT ' | sed "s/^RESULT //" >>"$results" || true
    return "$rc"
}

if wants fragmentation; then
echo "=== fragmentation under a ${LIMIT_GB} GiB limit"
step "fragmentation: pytorch default (expect oom)" \
    run_py pytorch "" "$here"/torch_fragmentation.py --limit-gb "$LIMIT_GB" --expect oom
for spec in caching:oom expandable:ok torch-es:ok native:ok; do
    backend=${spec%%:*} expect=${spec##*:}
    step "fragmentation: vmmalloc $backend (expect $expect)" \
        run_py "$backend" "backend:$backend" "$here"/torch_fragmentation.py --limit-gb "$LIMIT_GB" --expect "$expect"
done
fi

if wants train; then
echo "=== training with variable sequence lengths ($STEPS steps)"
step "train_varlen: pytorch default" run_py pytorch "" "$here"/torch_train_varlen.py --steps "$STEPS"
for backend in expandable torch-es caching native; do
    step "train_varlen: vmmalloc $backend" \
        run_py "$backend" "backend:$backend,on_oom:abort" "$here"/torch_train_varlen.py --steps "$STEPS"
done
fi

echo "=== PyTorch-process checks (issue 11)"
# plugin_check NAME: exit 3 from the script is a skip (its reason printed), not a failure.
plugin_check() {
    local out rc=0
    out="$(VMMALLOC_CONF="backend:expandable" timeout 300 "$PY" -m vmmalloc "$here"/torch_plugin_checks.py "$1" 2>&1)" \
        || rc=$?
    printf '%s\n' "$out" | tail -n 8 | sed "s/^/    [$1] /"
    if ((rc == 3)); then
        echo "    [$1] skipped"
        return 0
    fi
    return "$rc"
}
for check in peer-copy graph-replay oom-exception memory-allocated growable; do
    wants "$check" || continue
    step "plugin: $check" plugin_check "$check"
done
if wants sleep; then
    echo "=== sleep and wake (issue 12)"
    sleep_check() {
        local out rc=0
        out="$(VMMALLOC_CONF="backend:expandable" timeout 300 "$PY" -m vmmalloc "$here"/torch_sleep_checks.py sleep 2>&1)" \
            || rc=$?
        printf '%s\n' "$out" | tail -n 8 | sed "s/^/    [sleep] /"
        if ((rc == 3)); then
            echo "    [sleep] skipped"
            return 0
        fi
        return "$rc"
    }
    step "plugin: sleep" sleep_check
fi
if wants ipc; then
    echo "=== IPC (issue 28)"
    ipc_check() {
        local out rc=0
        out="$(timeout 120 "$PY" "$here"/torch_ipc_checks.py 2>&1)" || rc=$?
        printf '%s\n' "$out" | grep -E '^(CHECK|torch_ipc_checks)' | sed "s/^/    [ipc] /"
        return "$rc"
    }
    step "plugin: ipc" ipc_check
fi

echo "=== side by side"
"$PY" - "$results" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
frag = [r for r in rows if r["script"] == "torch_fragmentation"]
train = [r for r in rows if r["script"] == "torch_train_varlen"]
print(f"{'fragmentation':<22} {'outcome':>8} {'peak reserved MiB':>18} {'seconds':>8}")
for r in frag:
    print(f"{r['allocator']:<22} {r['outcome']:>8} {r['peak_reserved_bytes'] / 2**20:>18.1f} {r['seconds']:>8}")
print()
print(f"{'train_varlen':<22} {'peak reserved MiB':>18} {'peak alloc MiB':>15} {'step ms':>9} {'max ms':>9} {'loss':>8}")
for r in train:
    print(f"{r['allocator']:<22} {r['peak_reserved_mib']:>18} {r['peak_allocated_mib']:>15} "
          f"{r['step_ms_mean']:>9} {r['step_ms_max']:>9} {r['final_loss']:>8}")
EOF

if ((${#failures[@]} > 0)); then
    echo "gpu-check-pytorch: FAILED: ${failures[*]}"
    exit 1
fi
echo "gpu-check-pytorch: all PyTorch plug-in checks passed"
