#!/usr/bin/env bash
# Regenerates docs/results.md and its plots (docs/results/) from the built-in set:
# the bundled PyTorch snapshot and the three generated workloads, every policy.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin vmmalloc
rm -rf docs/results
./target/release/vmmalloc compare --out docs/results --json docs/results/results.json "$@"
{
  sed -e 's#](\([a-z0-9_.-]*\.svg\))#](results/\1)#g' docs/results/report.md
  echo
  echo "Command: \`scripts/compare.sh\` ($(./target/release/vmmalloc --version), $(date -u +%Y-%m-%d), $(nproc) cores)."
} > docs/results.md
rm docs/results/report.md
echo "wrote docs/results.md and docs/results/"
