#!/usr/bin/env bash
# shellcheck disable=SC2329  # the step functions run through `step` (bash -c)
# gpu-check.sh — vmmalloc on a real NVIDIA GPU (A100 / H100 / H200), in one
# call of at most 7 minutes (BUDGET_S), with no Rust and no network on the GPU box
# (issue 16).
#
#   usage: scripts/gpu-check.sh [--bundle DIR] [--out DIR] [--dry-run]
#
# Runs from a prebuilt bundle (scripts/gpu-bundle.sh): --bundle DIR, else
# gpu-bundle/ at the repository root, else the folder this script sits in when
# that is a bundle's scripts/. Without a bundle, where cargo exists, it builds
# one first (scripts/gpu-bundle.sh); with neither, it says so and stops.
#
# Steps, in this order (each with its own timeout, all within the time budget
# BUDGET_S; a failing step never stops the others). The steps that never ran
# on a GPU come first, the ones measured before (2026-12-04, H200) last:
#   bundle       the manifest: format, the scripts' hash (a bundle built for
#                other scripts), every file present with its sha256
#   driver       nvidia-smi, `vmmalloc info` (driver version, devices,
#                granularity, VMM support)
#   vmm          step 0: `vmmalloc vmm-check`, reserve → create → map → set
#                access → write/read → unmap → release on the GPU: does this
#                environment (driver, container, gVisor) support the VMM API?
#   python       the Python package loads libvmmalloc.so, and the torch
#                companion is built (10-30 s, once, before any step needs it)
#   graph-pools, history, share, ipc, activation, complete, unpin-threads,
#   hot-path     PyTorch features under the plug-in (never run on a GPU yet)
#   fragmentation, serving, train
#                PyTorch workloads under PyTorch's default allocator, real
#                PyTorch expandable segments and vmmalloc (short forms unless
#                FULL=1: vmmalloc only for fragmentation and train)
#   graphs, plugin-checks, sleep
#                plug-in checks that passed on 2026-12-04: FULL=1 or ONLY
#                (all PyTorch steps: scripts/gpu-check-pytorch.sh, one part a step)
#   conformance  the device conformance suite through the cuda backend
#   suite:NAME   every other bundled #[ignore] suite (-- --ignored)
#   calibrate    `vmmalloc calibrate`: the cost model's size sweep, as JSON
#   two-gpus     vmm-check on device 1 and the peer-copy check, where there
#                are two GPUs
#
# Every step sees VMMALLOC_CLI (the bundle's bin/vmmalloc), VMMALLOC_LIBRARY,
# PYTHONPATH (the bundle's python/) and STEP_DEADLINE (epoch seconds at which
# the step is killed: the scripts' own child timeouts stay inside it).
#
# Writes into --out DIR, else $OUT (a folder), else ./gpu-check-out/:
#   gpu-check.log            everything printed
#   gpu-calibration.json     the calibration (`vmmalloc compare --cost-file`)
#   gpu-check-summary.txt    one verdict line per step: NAME: PASS|FAIL|SKIP (why)
#   results.jsonl            every RESULT line of the PyTorch workloads
#   results-gpu.md           GPU, driver, PyTorch, commit, the verdicts and the
#                            side-by-side tables (copy it to docs/results-gpu.md)
#
# Every step runs in a session of its own; whatever it leaves running is
# killed when it ends or times out.
#
# --dry-run (CI, scripts/gpu-dry-run.sh): no nvidia-smi needed and the PyTorch
# steps that need a GPU are skipped; VMMALLOC_CUDA_LIBRARY must name a driver
# library (the fake libcuda, docs/fake-cuda.md).
#
# Environment:
#   OUT                    output folder (see above)
#   BUDGET_S               time budget of the whole check in seconds (default 420)
#   FULL=1                 the workloads' full forms (every allocator, STEPS
#                          training steps) and the steps measured before
#   ITERATIONS             calibrate: timed calls per point (default 100, min 100)
#   VMMALLOC_TEST_DEVICE   GPU ordinal to test and calibrate (default 0)
#   VMMALLOC_CUDA_LIBRARY  driver library to load instead of libcuda.so.1
#   SKIP_PYTORCH=1         skip the PyTorch steps
#   ONLY="NAME ..."        run only these steps (the others SKIP, "not selected")
#   PYTHON                 python with PyTorch (default python3)
#
# Exit status: 0 when no step failed and every selected step ran (a step may
# SKIP for a reason it names: no GPU, no PyTorch, not selected); 1 when a step
# failed, when a selected step was not run because the time budget was spent
# (the summary says so and names them), or when ONLY names an unknown step.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

bundle="" out_dir="${OUT:-}" dry_run=0
while (($# > 0)); do
    case $1 in
        --bundle) bundle=${2:?--bundle needs a folder}; shift 2 ;;
        --out) out_dir=${2:?--out needs a folder}; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) sed -n '3,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d;s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
out_dir="${out_dir:-$PWD/gpu-check-out}"
if [[ -e $out_dir && ! -d $out_dir ]]; then
    echo "gpu-check: $out_dir is not a folder" >&2
    exit 2
fi
mkdir -p "$out_dir" || exit 2
out_dir="$(cd "$out_dir" && pwd)"
log="$out_dir/gpu-check.log"
summary="$out_dir/gpu-check-summary.txt"
calibration="$out_dir/gpu-calibration.json"
: >"$summary"
# Everything printed also goes to the log.
exec 3>&1 4>&2
exec > >(tee "$log") 2>&1
tee_pid=$!

started=$SECONDS
budget="${BUDGET_S:-420}"
device="${VMMALLOC_TEST_DEVICE:-0}"
iterations="${ITERATIONS:-100}"
PY="${PYTHON:-python3}"
export VMMALLOC_TEST_DEVICE="$device"
full="${FULL:-0}"
failed=0
# Selected steps not run for lack of time, and the step names seen (for ONLY).
budget_cut=()
seen_steps=" "

section() { printf '\n=== %s\n' "$*"; }
# verdict NAME PASS|FAIL|SKIP [WHY]: one line of the summary.
verdict() {
    seen_steps+="$1 "
    local line="$1: $2${3:+ ($3)}"
    echo ">>> $line"
    echo "$line" >>"$summary"
    [[ $2 == FAIL ]] && failed=1
    return 0
}
left() { echo $((budget - (SECONDS - started))); }
# in_session LIMIT CMD...: runs CMD in a session of its own (setsid) and, when
# it ends or after LIMIT seconds, kills every process left in that session:
# a step's grandchildren (Python under a nested `timeout`, which makes a
# process group of its own) never outlive it (issue 25, defect 3: a timed-out
# step's Python child kept 66 GiB of the GPU). Exit status: CMD's, or 124
# when LIMIT ran out.
in_session() {
    local limit=$1
    shift
    setsid "$@" </dev/null &
    local pid=$! ticks=0 rc=0
    while kill -0 "$pid" 2>/dev/null; do
        if ((ticks >= limit * 5)); then
            echo "(timed out after $limit s: killing the step's processes)"
            pkill -TERM -s "$pid" 2>/dev/null
            sleep 3
            pkill -KILL -s "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            return 124
        fi
        sleep 0.2
        ticks=$((ticks + 1))
    done
    wait "$pid" || rc=$?
    # Whatever the step left behind (a background child, a daemon) goes too.
    pkill -KILL -s "$pid" 2>/dev/null
    return "$rc"
}
# step NAME TIMEOUT CMD...: runs CMD under min(TIMEOUT, time left); exit 3
# from CMD is a skip (its last line the reason).
step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then
        verdict "$name" SKIP "not selected (ONLY=$ONLY)"
        return 0
    fi
    local remaining
    remaining=$(left)
    if ((remaining < 5)); then
        # A selected step that did not run is no pass: the run exits 1.
        verdict "$name" SKIP "time budget of ${budget} s spent: NOT RUN"
        budget_cut+=("$name")
        return 0
    fi
    ((limit > remaining)) && limit=$remaining
    section "$name (timeout ${limit} s): $*"
    local t0=$SECONDS rc=0 tmp
    tmp="$(mktemp)"
    # The step's scripts keep their own child timeouts inside this.
    export STEP_DEADLINE=$(($(date +%s) + limit))
    # Functions run through an exported-function bash (`timeout` runs programs).
    if [[ $(type -t "$1") == function ]]; then
        in_session "$limit" bash -c '"$@"' bash "$@" 2>&1 | tee "$tmp"
    else
        in_session "$limit" "$@" 2>&1 | tee "$tmp"
    fi
    rc=${PIPESTATUS[0]}
    local why
    # Why: a Rust program's "Error: ..." line (a backtrace may follow it), else
    # the last line printed.
    why="$(grep -m 1 '^Error: ' "$tmp" || grep -v '^[[:space:]]*$' "$tmp" | tail -n 1)"
    local cause
    cause="$(grep -A1 -m 1 '^Caused by:' "$tmp" | sed -n '2s/^ *\(0: \)\{0,1\}//p')"
    [[ $why == Error:* && -n $cause ]] && why="$why: $cause"
    why="$(cut -c1-240 <<<"$why")"
    rm -f "$tmp"
    local took="$((SECONDS - t0)) s"
    case $rc in
        0) verdict "$name" PASS "$took" ;;
        3) verdict "$name" SKIP "${why:-skipped}" ;;
        124 | 137) verdict "$name" FAIL "timed out after ${limit} s" ;;
        *) verdict "$name" FAIL "exit $rc, $took: ${why}" ;;
    esac
}

# ---------------------------------------------------------------------------
# The bundle
# ---------------------------------------------------------------------------
if [[ -z $bundle ]]; then
    if [[ -f $repo/gpu-bundle/manifest.txt ]]; then
        bundle=$repo/gpu-bundle
    elif [[ -f $repo/manifest.txt && -d $repo/bin ]]; then
        bundle=$repo # this script is the bundle's own copy
    elif command -v cargo >/dev/null 2>&1 && [[ -x $repo/scripts/gpu-bundle.sh ]]; then
        section "no bundle: building one with cargo (scripts/gpu-bundle.sh)"
        if "$repo/scripts/gpu-bundle.sh" "$repo/gpu-bundle"; then
            bundle=$repo/gpu-bundle
        else
            echo "gpu-check: building the bundle failed"
            exit 1
        fi
    else
        echo "gpu-check: no bundle (gpu-bundle/ at the repository root, or --bundle DIR) and no cargo to build one: run scripts/gpu-bundle.sh on a machine with Rust and carry gpu-bundle/ along"
        exit 1
    fi
fi
bundle="$(cd "$bundle" 2>/dev/null && pwd)" || { echo "gpu-check: bundle folder not found"; exit 1; }
manifest=$bundle/manifest.txt
bin=$bundle/bin/vmmalloc
lib=$bundle/lib/libvmmalloc.so

# The hash gpu-bundle.sh writes: over the check scripts this run uses.
scripts_sha() {
    (cd "$here" && sha256sum gpu-check.sh gpu-check-pytorch.sh gpu_report.py torch_*.py 2>/dev/null |
        LC_ALL=C sort -k2 | sha256sum | cut -d' ' -f1)
}
# check_bundle: one line per problem; exit 1 when there is any.
check_bundle() {
    local bad=0 first=""
    problem() {
        echo "$1"
        [[ -z $first ]] && first=$1
        bad=1
    }
    if [[ ! -f $manifest ]]; then
        echo "bundle: $manifest is missing: not a bundle from scripts/gpu-bundle.sh"
        return 1
    fi
    local format
    format="$(sed -n 's/^format: //p' "$manifest")"
    if [[ $format != vmmalloc-gpu-bundle/1 ]]; then
        problem "bundle: format '${format:-none}', this script reads vmmalloc-gpu-bundle/1"
    fi
    sed -n 's/^\(profile\|git_commit\|git_dirty\|vmmalloc\|rustc\|built_on\|built_at\): /  \1: /p' "$manifest"
    # A dev-profile bundle (BUNDLE_PROFILE=dev: the CI dry run's) runs only
    # on the fake libcuda: on a GPU its timings would be a debug build's.
    if [[ "$(sed -n 's/^profile: //p' "$manifest")" == dev && $dry_run != 1 ]]; then
        problem "bundle: built with the dev profile (BUNDLE_PROFILE=dev, for dry runs): rebuild it with scripts/gpu-bundle.sh for a GPU"
    fi
    # glibc: the executables need at least glibc_required (objdump -T at build time).
    local need_glibc have_glibc
    need_glibc="$(sed -n 's/^glibc_required: //p' "$manifest")"
    have_glibc="$(getconf GNU_LIBC_VERSION 2>/dev/null | sed -n 's/^glibc //p')"
    if [[ $need_glibc =~ ^[0-9.]+$ && -n $have_glibc ]] &&
        [[ "$(printf '%s\n%s\n' "$need_glibc" "$have_glibc" | sort -V | head -n 1)" != "$need_glibc" ]]; then
        problem "bundle: its executables need glibc $need_glibc, this box has $have_glibc: build the bundle on an older distribution"
    else
        echo "  glibc: needs ${need_glibc:-?}, here ${have_glibc:-?}"
    fi
    local want have
    want="$(sed -n 's/^scripts_sha256: //p' "$manifest")"
    have="$(scripts_sha)"
    if [[ $want != "$have" ]]; then
        problem "bundle: built for other check scripts (manifest scripts_sha256 ${want:0:12}, these scripts ${have:0:12}): rebuild it with scripts/gpu-bundle.sh"
    fi
    local sha _size path n=0
    while read -r sha _size path; do
        n=$((n + 1))
        if [[ ! -f $bundle/$path ]]; then
            problem "bundle: missing file $path (listed in the manifest)"
        elif [[ "$(sha256sum "$bundle/$path" | cut -d' ' -f1)" != "$sha" ]]; then
            problem "bundle: $path differs from the manifest (sha256)"
        fi
    done < <(sed -n 's/^file: //p' "$manifest")
    echo "bundle: $bundle, $n files checked"
    if ((bad)); then
        # The first problem again, last: the summary's verdict quotes it.
        echo "$first"
    fi
    return "$bad"
}
export -f scripts_sha check_bundle in_session
export here bundle manifest bin lib out_dir dry_run device iterations calibration PY
step bundle 60 check_bundle

# need FILE WHAT: 0 when FILE is there, else a skip verdict for the step.
need() {
    [[ -e $1 ]] && return 0
    verdict "$2" SKIP "missing from the bundle: ${1#"$bundle"/}"
    return 1
}

# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------
gpu_count=0
info_json="$(mktemp)"
driver_check() {
    if ((dry_run)); then
        echo "dry run: nvidia-smi not consulted"
    elif ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi is not installed"
        return 1
    elif ! nvidia-smi -L || ! nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv; then
        echo "nvidia-smi failed"
        return 1
    fi
    [[ -x $bin ]] || { echo "missing from the bundle: bin/vmmalloc"; return 1; }
    "$bin" info || return 1
    "$bin" info --json >"$info_json" 2>/dev/null || return 1
    if ! grep -q '"vmm_supported": true' "$info_json"; then
        echo "no CUDA device with virtual memory management; $("$bin" info 2>/dev/null | grep -m 1 '^CUDA driver' || echo 'CUDA driver: ?')"
        return 1
    fi
}
export info_json
export -f driver_check
if ((dry_run)) && [[ -z ${VMMALLOC_CUDA_LIBRARY:-} ]]; then
    echo "gpu-check: --dry-run needs VMMALLOC_CUDA_LIBRARY (the fake libcuda, docs/fake-cuda.md)"
    exit 2
fi
step driver 60 driver_check
# Devices the CUDA driver lists (one "ordinal" key per device).
gpu_count="$(grep -c '"ordinal"' "$info_json" || true)"
rm -f "$info_json"
echo "CUDA devices: $gpu_count"

# ---------------------------------------------------------------------------
# Step 0: the VMM API on the GPU
# ---------------------------------------------------------------------------
need "$bin" vmm && step vmm 60 "$bin" vmm-check --device "$device"
# No driver or no device at all ("NOT usable here"): the GPU steps below are
# skipped with that reason. Without VMM support ("NOT supported") they still
# run: what fails and what does not (plain cuMemAlloc) is worth the log.
no_gpu=""
if grep -q '^vmm: FAIL .*VMM API: NOT usable here' "$summary"; then
    no_gpu="no usable CUDA driver or device (step vmm)"
fi
# gpu_step NAME TIMEOUT CMD...: step, or SKIP when there is no usable GPU.
gpu_step() {
    if [[ -n $no_gpu ]]; then
        verdict "$1" SKIP "$no_gpu"
    else
        step "$@"
    fi
}

# ---------------------------------------------------------------------------
# Python, the torch companion, and PyTorch under the plug-in (first: the
# steps that never ran on a GPU)
# ---------------------------------------------------------------------------
export VMMALLOC_LIBRARY="$lib"
export VMMALLOC_CLI="$bin"
export PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}"
python_check() {
    command -v "$PY" >/dev/null 2>&1 || { echo "$PY is not installed"; return 3; }
    "$PY" -c 'import vmmalloc, sys; p = vmmalloc.library_path(); print("vmmalloc package", vmmalloc.__file__, "library", p); sys.exit(0 if p else 1)' || return 1
    if ((dry_run)); then
        echo "dry run: the torch companion is built on the GPU box"
        return 0
    fi
    # The companion (77 KB of C++, 10-30 s) is built here, once, not by the
    # first vmmalloc process of a timed step. No PyTorch: nothing to build.
    "$PY" -c '
import sys, time
try:
    import torch
except ImportError as e:
    print("no PyTorch for this python: no torch companion to build (%s)" % e)
    sys.exit(0)
from vmmalloc import _companion
t = time.time()
lib = _companion.load(torch)
print("torch companion for PyTorch %s built or found in %.1f s: %s; methods left out: %s"
      % (torch.__version__, time.time() - t, lib.path, ", ".join(_companion.lost_methods(lib.path)) or "none"))
' || { echo failed >"$companion_state"; echo "the torch companion could not be built (above)"; return 1; }
}
# A failed companion build is not retried by every PyTorch process (10-30 s
# each): the steps after it run without it, and say so.
companion_state="$(mktemp)"
export -f python_check
export companion_state
if need "$lib" python && need "$bundle/python/vmmalloc/__init__.py" python; then
    step python 90 python_check
fi
if [[ -s $companion_state ]]; then
    export VMMALLOC_COMPANION=0
    echo "gpu-check: no torch companion (step python): the PyTorch steps run with VMMALLOC_COMPANION=0"
fi
rm -f "$companion_state"

# One step per part of scripts/gpu-check-pytorch.sh, each with its own
# timeout, PART:TIMEOUT[:PART2...], in the order they run. The estimates (s,
# on an H200, from the 2026-12-04 run's ~5 s per PyTorch process) are in
# docs/driver.md; the default check's total is about 375 s of 420.
pytorch_steps=(
    graph-pools:150 history:120 share:60 ipc:90 activation:120 complete:150 unpin-threads:50 hot-path:60
    fragmentation:60 serving:60 train:110
    graphs:30:graph-replay plugin-checks:45:oom-exception:memory-allocated:growable sleep:30
)
# Passed on 2026-12-04 (H200) and not in the default check: FULL=1 or ONLY.
full_only=" graphs plugin-checks sleep "
pt=$here/gpu-check-pytorch.sh
export RESULTS_JSONL="$out_dir/results.jsonl"
: >"$RESULTS_JSONL"
# The workloads' short forms (gpu-check-pytorch.sh, SHORT=1) unless FULL=1.
((full)) || export SHORT=1
torch_version=""
if [[ ${SKIP_PYTORCH:-0} == 1 ]]; then
    pytorch_skip="SKIP_PYTORCH=1"
elif ((dry_run)); then
    pytorch_skip="dry run: needs PyTorch on a GPU"
else
    # One probe for every PyTorch step (each would spend ~3 s on its own).
    pytorch_skip=""
    probe="$(in_session 60 "$PY" -c 'import torch, torch.cuda.memory as m; m.CUDAPluggableAllocator; m.change_current_allocator; print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)" ||
        pytorch_skip="no usable PyTorch for $PY: $(tail -n 1 <<<"$probe" | cut -c1-200)"
    if [[ -z $pytorch_skip ]]; then
        probe="$(grep '^torch ' <<<"$probe" | tail -n 1)"
        [[ $probe == *True ]] || pytorch_skip="PyTorch sees no CUDA device ($probe)"
        torch_version="$(cut -d' ' -f2,3 <<<"$probe")"
        echo "PyTorch: $probe"
    fi
    export TORCH_CHECKED=1
fi
for entry in "${pytorch_steps[@]}"; do
    IFS=: read -r -a f <<<"$entry"
    name=${f[0]} limit=${f[1]}
    parts=("${f[@]:2}")
    ((${#parts[@]})) || parts=("$name")
    if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then
        verdict "$name" SKIP "not selected (ONLY=$ONLY)"
    elif [[ -z ${ONLY:-} ]] && ((!full)) && [[ $full_only == *" $name "* ]]; then
        verdict "$name" SKIP "passed 2026-12-04 on an H200; FULL=1 or ONLY=$name runs it"
    elif [[ -n $pytorch_skip ]]; then
        verdict "$name" SKIP "$pytorch_skip"
    else
        step "$name" "$limit" "$pt" "${parts[@]}"
    fi
done

# ---------------------------------------------------------------------------
# The #[ignore]d GPU test suites, single-threaded so that memory figures are
# not disturbed by concurrent tests. The device suite's conformance test is
# its own step.
# ---------------------------------------------------------------------------
device_suite=$bundle/tests/vmmalloc-device.cuda_gpu
if need "$device_suite" conformance && need "$device_suite" suite:device; then
    gpu_step conformance 120 "$device_suite" --ignored --exact conformance_suite --test-threads=1
    gpu_step suite:device 120 "$device_suite" --ignored --skip conformance_suite --test-threads=1
fi
while read -r suite; do
    [[ $suite == vmmalloc-device.cuda_gpu ]] && continue
    if need "$bundle/tests/$suite" "suite:$suite"; then
        gpu_step "suite:$suite" 120 "$bundle/tests/$suite" --ignored --test-threads=1
    fi
done < <(sed -n 's/^file: [0-9a-f]* [0-9]* tests\/\(.*\)$/\1/p' "$manifest" 2>/dev/null)

# ---------------------------------------------------------------------------
# Cost-model calibration: create / map / set access / unmap / release and
# cuMemAlloc / cuMemFree at 2-1024 MiB, each point the median of ITERATIONS
# calls; fits fixed + per-MiB + per-handle per call kind (docs/driver.md).
# ---------------------------------------------------------------------------
calibrate() {
    "$bin" calibrate --device "$device" --iterations "$iterations" --json "$calibration" || return
    grep -E '"(closer_preset|fit_distance)"' "$calibration" || true
    echo "replay with the measured model: vmmalloc compare --cost-file $calibration"
}
export -f calibrate
need "$bin" calibrate && gpu_step calibrate 150 calibrate

# ---------------------------------------------------------------------------
# Two GPUs
# ---------------------------------------------------------------------------
two_gpus() {
    "$bin" vmm-check --device 1 || return 1
    if ((dry_run)) || [[ ${SKIP_PYTORCH:-0} == 1 ]]; then
        echo "peer copy under PyTorch not run (needs PyTorch on GPUs)"
    else
        "$pt" peer-copy
    fi
}
export pt
export -f two_gpus
if ((gpu_count < 2)); then
    verdict two-gpus SKIP "$gpu_count CUDA device(s)"
elif need "$bin" two-gpus; then
    step two-gpus 90 two_gpus
fi

# ONLY names a step that does not exist: nothing ran under that name.
for name in ${ONLY:-}; do
    [[ $seen_steps == *" $name "* ]] || verdict "$name" FAIL "ONLY names no step of this check"
done
# Selected steps the time budget left out: the run is not a pass.
if ((${#budget_cut[@]} > 0)); then
    failed=1
    for line in "gpu-check: ${#budget_cut[@]} selected step(s) NOT RUN: the ${budget} s time budget was spent" \
        "gpu-check: rerun them with ONLY=\"${budget_cut[*]}\""; do
        echo "$line"
        echo "$line" >>"$summary"
    done
fi

# results-gpu.md: the GPU, driver, PyTorch and commit, the verdicts, and the
# side-by-side tables (docs/results-gpu.md holds a copy of the last real run).
gpu_name="" driver_version=""
if ((!dry_run)) && command -v nvidia-smi >/dev/null 2>&1; then
    gpu_name="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i "$device" 2>/dev/null | head -n 1)"
    driver_version="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader -i "$device" 2>/dev/null | head -n 1)"
fi
((dry_run)) && gpu_name="none (dry run on the fake libcuda)"
# (In sessions of their own too: nothing the python leaves behind survives.)
py_version="$(in_session 20 "$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null | tail -n 1)"
in_session 60 "$PY" "$here/gpu_report.py" markdown "$out_dir/results-gpu.md" --results "$RESULTS_JSONL" \
    --summary "$summary" --log "$log" --manifest "$manifest" \
    --env "date=$(date -u +%Y-%m-%d)" --env "gpu=${gpu_name:-?}" --env "driver=${driver_version:-?}" \
    --env "torch=${torch_version:-not run}" --env "python=${py_version:-?}" ||
    echo "gpu-check: results-gpu.md not written"

section "summary ($((SECONDS - started)) s; $out_dir)"
cat "$summary"

# Let tee finish the log before exiting.
exec 1>&3 2>&4
wait "$tee_pid" 2>/dev/null || true
exit "$failed"
