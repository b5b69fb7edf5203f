#!/usr/bin/env bash
# gpu-check-pytorch.sh — PyTorch on a real GPU under PyTorch's own allocators
# and under vmmalloc, side by side (issues 6, 11, 12, 25). Called by
# scripts/gpu-check.sh, one PART per step; runs on its own too.
#
# usage: scripts/gpu-check-pytorch.sh [PART...]   (default: all of them)
#
# Workloads (each run under PyTorch's default allocator, real PyTorch
# expandable segments — PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True —
# and vmmalloc expandable, plus vmmalloc's replicas where they add something;
# one side-by-side table per part, printed when the part ends; every RESULT
# line is printed, and appended to $RESULTS_JSONL, as soon as it exists):
#   fragmentation  scripts/torch_fragmentation.py under a LIMIT_GB cap: fill
#                  90 % with 4 MiB tensors, free four of five, ask for large
#                  tensors. Verdicts: vmmalloc expandable completes with every
#                  byte intact; vmmalloc's caching / torch-es replicas end
#                  as the real default allocator / real expandable segments
#                  do (replica fidelity), whatever that is.
#   serving        scripts/torch_serving.py under a 7 GiB cap: growing KV
#                  caches and 1.5-3 GiB prefill transients. Verdict: vmmalloc
#                  expandable has no out-of-memory error and no lost byte;
#                  PyTorch's figures are reported.
#   train          scripts/torch_train_varlen.py (STEPS steps, default 22):
#                  peak reserved and step time. Verdict: every run completes.
#   hot-path       scripts/torch_hot_path.py: torch.empty + free from Python,
#                  µs per pair (reported; a run must complete).
# SHORT=1 (gpu-check.sh's default check; the full forms were measured on
# 2026-12-04): fragmentation and train run under vmmalloc expandable only
# (train STEPS=5), hot-path under vmmalloc with and without the companion.
#
# Checks of the plug-in under vmmalloc expandable. A check script's verdict:
# FAIL when it exits non-zero (not 3), prints any `CHECK name: FAIL` line, or
# (but for torch_plugin_checks.py and torch_sleep_checks.py) no CHECK line;
# SKIP, with its reason, when it exits 3 or prints any `CHECK name: SKIP` line
# (what was skipped was not checked: a part is never "ok" for it); else ok.
# Its `RESULT {json}` lines go to $RESULTS_JSONL like the workloads'.
#   peer-copy, graph-replay, oom-exception, memory-allocated, growable
#                  scripts/torch_plugin_checks.py CHECK (issues 11, 13)
#   sleep          scripts/torch_sleep_checks.py (issue 12)
#   unpin-threads  scripts/torch_unpin_threads.py: unpinning with a second
#                  writing thread, and with forward/backward threads (issue 25)
#   complete       scripts/torch_complete_checks.py: torch.compile's CUDA
#                  graphs, NCCL (with and without the register hook, served
#                  since issue 43; register_mem_pool), MemPool under vmmalloc
#                  (issue 28)
#   ipc            scripts/torch_ipc_checks.py: CUDA IPC both ways (issue 28)
#   graph-pools    scripts/torch_graph_pool_checks.py: torch.compile
#                  reduce-overhead (CUDA graphs recorded) peak reserved <=
#                  1.05x PyTorch's, and a graph's pool paused, its contents
#                  restored bitwise on resume, replayed (issue 32)
#   history        scripts/torch_history_checks.py: _record_memory_history
#                  under vmmalloc, OOM observer dump parsed by memory_viz and
#                  replayed at the run's peak by the CLI, cudnn.benchmark,
#                  cost (report-only) (issue 34)
#   share          scripts/torch_share_checks.py: two processes on one GPU
#                  under one shared budget, one shrinks (its cap lowered from
#                  outside) while the other grows; bytes intact, the group
#                  never above its total (issue 33)
#   activation     scripts/torch_activation_checks.py: VMMALLOC_CONF alone
#                  selects vmmalloc (torchrun, spawn), region mode (issue 24)
#
# Runs from a bundle (scripts/gpu-bundle.sh) when VMMALLOC_LIBRARY names its
# libvmmalloc.so and PYTHONPATH its python/ (scripts/gpu-check.sh sets both);
# otherwise builds target/release/libvmmalloc.so with cargo.
#
# Needs python3 with a CUDA build of PyTorch. Exit status: 0 when every
# verdict passed, 1 when one failed (each run still happens), 3 with one clear
# line (the last) when it cannot run or a part was skipped: no python, no
# PyTorch, no CUDA device, a PyTorch without the pluggable-allocator hooks, a
# part whose script is missing, a check script that skipped.
#
# Environment: LIMIT_GB (fragmentation cap, default 8), STEPS (training
# steps, default 22), PYTHON (default python3), CARGO_FLAGS (e.g.
# "--offline"), VMMALLOC_LIBRARY (a built libvmmalloc.so: no cargo build),
# RESULTS_JSONL (append every RESULT line there), TORCH_CHECKED=1 (the
# caller already checked PyTorch: skip the ~3 s probe), SHORT=1 (above),
# STEP_DEADLINE (epoch seconds: no child is given a timeout beyond it),
# VMMALLOC_CLI (the vmmalloc CLI; default the bundle's bin/vmmalloc or
# target/release/vmmalloc, where there is one).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."

PY="${PYTHON:-python3}"
LIMIT_GB="${LIMIT_GB:-8}"
SHORT="${SHORT:-0}"
if [[ $SHORT == 1 ]]; then STEPS="${STEPS:-5}"; else STEPS="${STEPS:-22}"; fi
read -r -a cargo_flags <<<"${CARGO_FLAGS:-}"

plugin_checks=(peer-copy graph-replay oom-exception memory-allocated growable)
all_parts=(fragmentation serving train hot-path "${plugin_checks[@]}" sleep unpin-threads complete ipc activation graph-pools history share)
parts=("$@")
((${#parts[@]} > 0)) || parts=("${all_parts[@]}")
for part in "${parts[@]}"; do
    [[ " ${all_parts[*]} " == *" $part "* ]] || { echo "gpu-check-pytorch: unknown part $part" >&2; exit 2; }
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
if [[ ${TORCH_CHECKED:-0} != 1 ]]; then
    torch_info="$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)" \
        || skip "PyTorch is not installed for $PY ($(tail -n 1 <<<"$torch_info"))"
    torch_info="$(tail -n 1 <<<"$torch_info")" # after any warnings
    [[ $torch_info == *True ]] || skip "PyTorch has no usable CUDA device (torch, cuda, available: $torch_info)"
    echo "PyTorch: $torch_info"
    # The hook CUDAPluggableAllocator needs (torch/cuda/memory.py,
    # change_current_allocator; PyTorch >= 2.0).
    "$PY" -c 'import torch.cuda.memory as m; m.CUDAPluggableAllocator; m.change_current_allocator' >/dev/null 2>&1 \
        || skip "this PyTorch has no torch.cuda.memory.CUDAPluggableAllocator / change_current_allocator"
fi

failures=()
skips=()
# verdict NAME CMD...: runs CMD, records a failure (or a skip: exit 3, the
# reason in $skip_why).
skip_why="" fail_why=""
verdict() {
    local name=$1 rc=0
    shift
    echo "--- $name"
    local t0=$SECONDS
    skip_why="" fail_why=""
    "$@" || rc=$?
    if ((rc == 0)); then
        echo "--- $name: ok ($((SECONDS - t0)) s)"
    elif ((rc == 3)); then
        echo "--- $name: SKIPPED ($((SECONDS - t0)) s): ${skip_why:-skipped}"
        skips+=("$name: ${skip_why:-skipped}")
    else
        echo "--- $name: FAILED ($((SECONDS - t0)) s)${fail_why:+: $fail_why}"
        failures+=("$name${fail_why:+ ($fail_why)}")
    fi
}

# child_limit SECONDS: SECONDS, or less so that a child ends (5 s, or a tenth
# of what is left when that is under 50 s) before the caller's STEP_DEADLINE
# (gpu-check.sh kills the whole step then), with a reason of its own.
child_limit() {
    local limit=$1
    if [[ -n ${STEP_DEADLINE:-} ]]; then
        local left=$((STEP_DEADLINE - $(date +%s))) margin=5
        ((left < 50)) && margin=$((left / 10 > 1 ? left / 10 : 1))
        left=$((left - margin))
        ((left < 1)) && left=1
        ((left < limit)) && limit=$left
    fi
    echo "$limit"
}

if [[ -n ${VMMALLOC_LIBRARY:-} ]]; then
    [[ -f $VMMALLOC_LIBRARY ]] || skip "VMMALLOC_LIBRARY=$VMMALLOC_LIBRARY does not exist"
    echo "plug-in: $VMMALLOC_LIBRARY"
else
    command -v cargo >/dev/null 2>&1 || skip "no VMMALLOC_LIBRARY and no cargo to build libvmmalloc.so"
    verdict "build libvmmalloc.so" cargo build --release ${cargo_flags[@]+"${cargo_flags[@]}"} -p vmmalloc-capi
    export VMMALLOC_LIBRARY="$PWD/target/release/libvmmalloc.so"
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
# The CLI the check scripts use (history's replay, share's outside cap
# change and sampler): gpu-check.sh exports the bundle's.
if [[ -z ${VMMALLOC_CLI:-} ]]; then
    for cli in "$here/../bin/vmmalloc" "$PWD/target/release/vmmalloc"; do
        [[ -x $cli ]] && { export VMMALLOC_CLI="$cli"; break; }
    done
fi
echo "vmmalloc CLI: ${VMMALLOC_CLI:-none}"
results="${RESULTS_JSONL:-}"
if [[ -z $results ]]; then
    results="$(mktemp)"
    trap 'rm -f "$results"' EXIT
fi
touch "$results"
part_results="$(mktemp)"
trap 'rm -f "$part_results"; [[ -n ${RESULTS_JSONL:-} ]] || rm -f "$results"' EXIT

# run_py ALLOCATOR SCRIPT ARGS...: runs SCRIPT under ALLOCATOR and prints its
# RESULT line at once (and appends it to the results). ALLOCATOR: pytorch
# (the default allocator), pytorch-es (PYTORCH_CUDA_ALLOC_CONF=
# expandable_segments:True), or a VMMALLOC_CONF (python -m vmmalloc).
# Returns the script's exit status.
run_py() {
    local alloc=$1 script=$2
    shift 2
    local out rc=0 label
    case $alloc in
        pytorch) label=pytorch
            out="$(env -u PYTORCH_CUDA_ALLOC_CONF timeout -k 5 "$(child_limit 150)" "$PY" "$here/$script" "$@" 2>&1)" || rc=$? ;;
        pytorch-es) label=pytorch-es
            out="$(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 "$(child_limit 150)" "$PY" "$here/$script" "$@" 2>&1)" || rc=$? ;;
        *) label="vmmalloc ${alloc}"
            out="$(env -u PYTORCH_CUDA_ALLOC_CONF VMMALLOC_CONF="$alloc" timeout -k 5 "$(child_limit 150)" "$PY" -m vmmalloc "$here/$script" "$@" 2>&1)" || rc=$? ;;
    esac
    printf '%s\n' "$out" | grep -v '^RESULT ' | tail -n 4 | sed "s/^/    [$label] /"
    local line
    while IFS= read -r line; do
        echo "    result: ${line#RESULT }"
        printf '%s\n' "${line#RESULT }" >>"$results"
        printf '%s\n' "${line#RESULT }" >>"$part_results"
    done < <(printf '%s\n' "$out" | grep '^RESULT ' || true)
    ((rc == 124 || rc == 137)) && echo "    [$label] timed out"
    return "$rc"
}

# outcome_of SCRIPT ALLOCATOR_LABEL: the "outcome" field of that run's RESULT.
outcome_of() {
    "$PY" - "$part_results" "$1" "$2" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
hit = [r for r in rows if r.get("script") == sys.argv[2] and r.get("allocator") == sys.argv[3]]
print(hit[-1].get("outcome", "none") if hit else "none")
EOF
}

# table SCRIPT: the side-by-side table of this part's runs.
table() {
    "$PY" "$here/gpu_report.py" table "$1" "$part_results" || true
    : >"$part_results"
}

if wants fragmentation; then
    echo "=== fragmentation under a ${LIMIT_GB} GiB cap"
    frag=(torch_fragmentation.py --limit-gb "$LIMIT_GB")
    if [[ $SHORT != 1 ]]; then
        run_py pytorch "${frag[@]}" || true
        run_py pytorch-es "${frag[@]}" || true
    fi
    verdict "fragmentation: vmmalloc expandable completes, bytes intact" \
        run_py backend:expandable "${frag[@]}" --expect ok
fi
if wants fragmentation && [[ $SHORT != 1 ]]; then
    run_py backend:torch-es "${frag[@]}" || true
    run_py backend:caching "${frag[@]}" || true
    # Replica fidelity: vmmalloc's replicas end as the real allocators do.
    same_outcome() {
        local real replica
        real="$(outcome_of torch_fragmentation "$1")"
        replica="$(outcome_of torch_fragmentation "$2")"
        echo "    $1: $real; $2: $replica"
        [[ $real != none && $real == "$replica" ]]
    }
    verdict "fragmentation: vmmalloc torch-es ends as real expandable segments" \
        same_outcome pytorch-es vmmalloc:torch-es
    verdict "fragmentation: vmmalloc caching ends as PyTorch's default" \
        same_outcome pytorch vmmalloc:caching
fi
wants fragmentation && table torch_fragmentation

if wants serving; then
    echo "=== serving loop under a 7 GiB cap"
    run_py pytorch torch_serving.py || true
    run_py pytorch-es torch_serving.py || true
    verdict "serving: vmmalloc expandable, no out-of-memory, bytes intact" \
        run_py backend:expandable torch_serving.py --expect-no-oom
    table torch_serving
fi

if wants train; then
    echo "=== training with variable sequence lengths ($STEPS steps)"
    allocs=(pytorch pytorch-es backend:expandable,on_oom:abort)
    [[ $SHORT == 1 ]] && allocs=(backend:expandable,on_oom:abort)
    for alloc in "${allocs[@]}"; do
        verdict "train_varlen: $alloc" run_py "$alloc" torch_train_varlen.py --steps "$STEPS"
    done
    table torch_train_varlen
fi

if wants hot-path; then
    echo "=== torch.empty + free from Python"
    allocs=(pytorch pytorch-es backend:expandable)
    [[ $SHORT == 1 ]] && allocs=(backend:expandable)
    for alloc in "${allocs[@]}"; do
        verdict "hot-path: $alloc" run_py "$alloc" torch_hot_path.py
    done
    # The same through PyTorch's pluggable allocator (no companion): the
    # companion's own path (allocate/raw_deleter, issue 35) beside it.
    VMMALLOC_COMPANION=0 verdict "hot-path: backend:expandable (pluggable)" run_py backend:expandable torch_hot_path.py
    table torch_hot_path
fi

# check_script NAME MODE SCRIPT ARGS...: a check script; MODE vmmalloc runs it
# under `python -m vmmalloc` with backend:expandable, plain as it is. Its
# lines are printed as they come. Returns 1 when it exits non-zero (not 3) or
# prints a `CHECK ...: FAIL` line; 3 (the reason in skip_why) when it exits 3
# or prints a `CHECK ...: SKIP` line; else 0. Its RESULT lines are collected.
check_script() {
    local name=$1 mode=$2 script=$3
    shift 3
    if [[ ! -f $here/$script ]]; then
        skip_why="$script is not in this bundle"
        echo "    [$name] SKIP: $skip_why"
        return 3
    fi
    local rc=0 out limit
    out="$(mktemp)"
    limit="$(child_limit 300)"
    if [[ $mode == vmmalloc ]]; then
        VMMALLOC_CONF="${CHECK_CONF:-backend:expandable}" PYTHONUNBUFFERED=1 timeout -k 5 "$limit" \
            "$PY" -m vmmalloc "$here/$script" "$@" 2>&1 | tee "$out" | sed -u "s/^/    [$name] /" || rc=${PIPESTATUS[0]}
    else
        PYTHONUNBUFFERED=1 timeout -k 5 "$limit" "$PY" "$here/$script" "$@" 2>&1 | tee "$out" |
            sed -u "s/^/    [$name] /" || rc=${PIPESTATUS[0]}
    fi
    local line
    while IFS= read -r line; do
        printf '%s\n' "${line#RESULT }" >>"$results"
    done < <(grep '^RESULT {' "$out" || true)
    local fails skipped last checks
    checks="$(grep -c '^CHECK [^:]*: ' "$out" || true)"
    fails="$(grep -c '^CHECK [^:]*: FAIL' "$out" || true)"
    fail_why="$(grep -m 1 '^CHECK [^:]*: FAIL' "$out" | sed 's/^CHECK //' | cut -c1-120 || true)"
    skipped="$(grep '^CHECK [^:]*: SKIP' "$out" | sed 's/^CHECK \([^:]*\): SKIP */\1: /' | tr '\n' ';' | sed 's/;$//' || true)"
    last="$(grep -v '^[[:space:]]*$' "$out" | tail -n 1 | cut -c1-200)"
    rm -f "$out"
    ((rc == 124 || rc == 137)) && echo "    [$name] timed out after $limit s"
    if ((rc != 0 && rc != 3)) || ((fails > 0)); then
        ((rc == 0)) && echo "    [$name] exit 0, but $fails check(s) printed FAIL"
        return 1
    fi
    if ((rc == 3)); then
        skip_why="${last:-exit 3}"
        return 3
    fi
    # Every check script but the plug-in's and sleep's (exit status only)
    # prints a CHECK line per check: none at all is no pass.
    if ((checks == 0)) && [[ $script != torch_plugin_checks.py && $script != torch_sleep_checks.py ]]; then
        fail_why="exit 0, but no CHECK line printed"
        echo "    [$name] $fail_why"
        return 1
    fi
    if [[ -n $skipped ]]; then
        skip_why="$(cut -c1-200 <<<"$skipped")"
        return 3
    fi
    return 0
}

for check in "${plugin_checks[@]}"; do
    wants "$check" || continue
    verdict "plugin: $check" check_script "$check" vmmalloc torch_plugin_checks.py "$check"
done
wants sleep && verdict "plugin: sleep" check_script sleep vmmalloc torch_sleep_checks.py sleep
wants unpin-threads && verdict "unpin with threads" check_script unpin-threads vmmalloc torch_unpin_threads.py
wants complete && verdict "complete allocator" check_script complete vmmalloc torch_complete_checks.py
wants ipc && verdict "ipc" check_script ipc plain torch_ipc_checks.py
wants activation && verdict "activation" check_script activation plain torch_activation_checks.py
wants graph-pools && verdict "graph pools" check_script graph-pools plain torch_graph_pool_checks.py
wants history && verdict "history" check_script history plain torch_history_checks.py
wants share && verdict "share" check_script share plain torch_share_checks.py

if ((${#failures[@]} > 0)); then
    echo "gpu-check-pytorch: FAILED: ${failures[*]}${skips[*]:+; skipped: ${skips[*]}}"
    exit 1
fi
if ((${#skips[@]} > 0)); then
    # The last line: gpu-check.sh quotes it as the step's SKIP reason.
    echo "gpu-check-pytorch: skipped (not checked): $(printf '%s; ' "${skips[@]}" | sed 's/; $//')"
    exit 3
fi
echo "gpu-check-pytorch: all passed (${parts[*]})"
