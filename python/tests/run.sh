#!/usr/bin/env bash
# Python plug-in tests (ctypes over libvmmalloc.so; no GPU needed).
# Called by .ci/run, two ways:
#   run.sh              builds the cdylib (debug), installs pytest if missing,
#                       runs pytest on python/vmmalloc with VMMALLOC_LIBRARY
#                       pointing at the library just built;
#   run.sh --installed  runs pytest on the vmmalloc package installed in
#                       $PYTHON's environment (`pip install ./python`) and the
#                       libvmmalloc.so inside it; builds nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import pytest" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet pytest
fi
if [ "${1:-}" = "--installed" ]; then
  shift
  unset VMMALLOC_LIBRARY
  export VMMALLOC_TEST_INSTALLED=1
else
  cargo build -p vmmalloc-capi
  export VMMALLOC_LIBRARY="$PWD/target/debug/libvmmalloc.so"
fi
# The CLI replays the dumped snapshot when it was built (cargo test --workspace builds it).
if [ -z "${VMMALLOC_CLI:-}" ] && [ -x target/debug/vmmalloc ]; then
  export VMMALLOC_CLI="$PWD/target/debug/vmmalloc"
fi
exec "$PY" -m pytest -q python/tests "$@"
