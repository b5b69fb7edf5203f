#!/usr/bin/env bash
# gpu-check.sh — vmmalloc on a real NVIDIA GPU (A100 / H100 / H200), in one call.
#
#   1. Fails clearly (exit 1, one line "no NVIDIA GPU/driver found: ...") where
#      there is no nvidia-smi, no GPU, or no libcuda.
#   2. Prints the driver version, device names, allocation granularity and VMM
#      support (`vmmalloc info`).
#   3. Runs every #[ignore]d GPU test suite (see "GPU test suites" below).
#   4. Calibrates the cost model (`vmmalloc calibrate`): create / map / set
#      access / unmap / release and cuMemAlloc / cuMemFree at 2-1024 MiB, set
#      access / unmap over 1-256 handles, each point the median of ITERATIONS
#      calls; fits fixed + per-MiB + per-handle per call kind and writes a cost
#      file (`--cost-file` reads it) to $OUT (a file; or, if $OUT is a
#      directory, $OUT/gpu-calibration.json), default ./gpu-calibration.json;
#      then says which preset (a100 or linear) is closer to this GPU.
#   5. Runs PyTorch under the plug-in (scripts/gpu-check-pytorch.sh).
#
# Environment:
#   OUT                    where the calibration JSON goes (see above)
#   ITERATIONS             timed calls per driver call kind (default 200, min 100)
#   VMMALLOC_TEST_DEVICE   GPU ordinal to test and calibrate (default 0)
#   VMMALLOC_CUDA_LIBRARY  driver library to load instead of libcuda.so.1
#   CARGO_FLAGS            extra cargo flags, e.g. "--offline"
#   SKIP_PYTORCH=1         skip step 5 (see scripts/gpu-check-pytorch.sh for its settings)
#
# Exit status: 0 when every step passed, 1 otherwise (each step still runs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

no_gpu() {
    echo "no NVIDIA GPU/driver found: $*" >&2
    exit 1
}

# ---------------------------------------------------------------------------
# 1. Is there a GPU and a driver?
# ---------------------------------------------------------------------------

command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not installed"
if ! gpus="$(nvidia-smi -L 2>&1)"; then
    no_gpu "nvidia-smi -L failed: $(printf '%s' "$gpus" | head -n 1)"
fi
grep -q '^GPU ' <<<"$gpus" || no_gpu "nvidia-smi lists no GPU"

cuda_lib="${VMMALLOC_CUDA_LIBRARY:-libcuda.so.1}"
find_lib() {
    local name=$1 dir
    if [[ $name == */* ]]; then
        [[ -e $name ]]
        return
    fi
    local ldconfig
    ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
    if [[ -x $ldconfig ]] && "$ldconfig" -p 2>/dev/null | grep -qF "$name"; then
        return 0
    fi
    local IFS=:
    for dir in ${LD_LIBRARY_PATH:-} /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu \
        /usr/lib64 /usr/lib /usr/local/nvidia/lib64 /usr/local/cuda/compat /usr/lib/wsl/lib; do
        [[ -n $dir && -e $dir/$name ]] && return 0
    done
    return 1
}
find_lib "$cuda_lib" || no_gpu "$cuda_lib not found (ldconfig -p, LD_LIBRARY_PATH, standard paths)"

command -v cargo >/dev/null 2>&1 || { echo "gpu-check: cargo is not installed" >&2; exit 1; }

# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

started=$SECONDS
failures=()
section() { printf '\n=== %s\n' "$*"; }
# run_step NAME CMD...: runs CMD, records a failure without stopping.
run_step() {
    local name=$1
    shift
    echo "--- $name: $*"
    local t0=$SECONDS
    if "$@"; then
        echo "--- $name: ok ($((SECONDS - t0)) s)"
    else
        local rc=$?
        echo "--- $name: FAILED (exit $rc, $((SECONDS - t0)) s)"
        failures+=("$name")
    fi
}

# shellcheck disable=SC2206  # CARGO_FLAGS is split on purpose
cargo_flags=(${CARGO_FLAGS:-})
target_dir="${CARGO_TARGET_DIR:-target}"
bin="$target_dir/release/vmmalloc"
device="${VMMALLOC_TEST_DEVICE:-0}"
iterations="${ITERATIONS:-200}"
out="${OUT:-gpu-calibration.json}"
if [[ -d $out ]]; then
    out="$out/gpu-calibration.json"
fi

section "GPUs (nvidia-smi)"
echo "$gpus"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv || true

section "build"
cargo build --release ${cargo_flags[@]+"${cargo_flags[@]}"} --bin vmmalloc

# ---------------------------------------------------------------------------
# 2. Driver version, devices, granularity, VMM support
# ---------------------------------------------------------------------------

section "vmmalloc info"
"$bin" info
info_json="$("$bin" info --json)"
if ! grep -q '"vmm_supported": true' <<<"$info_json"; then
    no_gpu "the CUDA driver reports no device with virtual memory management: $("$bin" info | grep '^CUDA driver' || true)"
fi

# ---------------------------------------------------------------------------
# 3. GPU test suites (each test #[ignore]d so that `cargo test` skips it
#    where there is no GPU). One run_step per suite, single-threaded so that
#    memory figures are not disturbed by concurrent tests.
# ---------------------------------------------------------------------------

section "GPU test suites"
export VMMALLOC_TEST_DEVICE="$device"
run_step "device (cuda backend)" \
    cargo test --release ${cargo_flags[@]+"${cargo_flags[@]}"} -p vmmalloc-device -- --ignored --test-threads=1
# ---- more GPU suites: add one run_step per suite here ---------------------
run_step "expandable allocator on cuda" \
    cargo test --release ${cargo_flags[@]+"${cargo_flags[@]}"} -p vmmalloc-alloc --test expandable_cuda -- --ignored --test-threads=1
# ---- end of GPU suites -----------------------------------------------------

# ---------------------------------------------------------------------------
# 4. Cost-model calibration
# ---------------------------------------------------------------------------

section "calibrate (median of $iterations calls each) -> $out"
run_step "calibrate" "$bin" calibrate --device "$device" --iterations "$iterations" --json "$out"
# Which preset the measured GPU is closer to (mean |ln(predicted / measured)|
# over every measured point; see docs/driver.md, "vmmalloc calibrate").
if [[ -f $out ]] && command -v python3 >/dev/null 2>&1; then
    python3 - "$out" <<'PY' || true
import json, sys
doc = json.load(open(sys.argv[1]))
d = doc.get("preset_distance", {})
print("closer preset: %s (distance %s; the fitted model: %s)" % (
    doc.get("closer_preset"),
    ", ".join("%s %.3f" % (k, v) for k, v in sorted(d.items())),
    doc.get("fit_distance")))
PY
elif [[ -f $out ]]; then
    grep -E '"(closer_preset|fit_distance)"' "$out" || true
fi
echo "replay with the measured model: $bin compare --cost-file $out"

# ---------------------------------------------------------------------------
# 5. The PyTorch plug-in (issue 6): PyTorch under libvmmalloc.so, a
#    fragmentation check and a variable-length training loop per backend
#    (up to ~8 minutes; needs python3 with a CUDA build of PyTorch).
#    Last, so that a slow run never costs the calibration. SKIP_PYTORCH=1 skips it.
# ---------------------------------------------------------------------------

if [[ ${SKIP_PYTORCH:-0} == 1 ]]; then
    section "PyTorch plug-in: skipped (SKIP_PYTORCH=1)"
else
    section "PyTorch plug-in (scripts/gpu-check-pytorch.sh)"
    run_step "PyTorch plug-in" scripts/gpu-check-pytorch.sh
fi

section "summary ($((SECONDS - started)) s)"
if ((${#failures[@]} > 0)); then
    echo "FAILED: ${failures[*]}"
    exit 1
fi
echo "all GPU checks passed; calibration in $out"

