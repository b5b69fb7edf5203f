#!/usr/bin/env bash
# Regenerates docs/results.md and its plots (docs/results/) from the built-in set:
# the bundled PyTorch snapshot and the three generated workloads, every policy.
# A second section replays longer runs of the same workloads (more steps, same
# parameters otherwise), where steady-state driver work outweighs the cold start.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin vmmalloc
rm -rf docs/results
./target/release/vmmalloc compare --out docs/results --json docs/results/results.json "$@"
LONG=(train-varlen:steps=100 serve-kv:steps=8000 frag-adversary:rounds=16)
./target/release/vmmalloc compare "${LONG[@]}" --out docs/results/long --json docs/results/long/results.json
{
  sed -e 's#](\([a-z0-9_.-]*\.svg\))#](results/\1)#g' docs/results/report.md
  echo
  echo "## Longer runs"
  echo
  echo "The same workloads run longer (\`vmmalloc compare ${LONG[*]}\`). The cold start (creating"
  echo "physical memory up to the peak) costs every page-mapping policy about the same; what differs is"
  echo "the work after it. Full report: [results/long/report.md](results/long/report.md)."
  echo
  echo '```'
  sed -n '/^trace /,/^```/p' docs/results/long/report.md | sed '/^```/d'
  echo '```'
  echo
  echo "Command: \`scripts/compare.sh\` ($(./target/release/vmmalloc --version), $(date -u +%Y-%m-%d), $(nproc) cores)."
} > docs/results.md
rm docs/results/report.md
echo "wrote docs/results.md and docs/results/"
