#!/usr/bin/env bash
# Python plug-in tests (ctypes over libvmmalloc.so; no torch, no GPU needed).
# Called by .ci/run. Builds the cdylib, installs pytest if missing, runs pytest
# with VMMALLOC_LIBRARY pointing at the library just built.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet pytest
fi
cargo build -p vmmalloc-capi
export VMMALLOC_LIBRARY="$PWD/target/debug/libvmmalloc.so"
# The CLI replays the dumped snapshot when it was built (cargo test --workspace builds it).
if [ -z "${VMMALLOC_CLI:-}" ] && [ -x target/debug/vmmalloc ]; then
  export VMMALLOC_CLI="$PWD/target/debug/vmmalloc"
fi
exec "$PY" -m pytest -q python/tests "$@"
