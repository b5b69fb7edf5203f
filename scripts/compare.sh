#!/usr/bin/env bash
# Regenerates docs/results.md and its plots (docs/results/) from the built-in set:
# the bundled PyTorch snapshot and the four generated workloads, every policy.
# A second section replays longer runs of the same workloads (more steps, same
# parameters otherwise), where steady-state driver work outweighs the cold start;
# a third is the ablation of the expandable policy's largest physical chunk.
# Extra arguments go to each `vmmalloc compare` of the built-in set (e.g.
# `--cost linear`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin vmmalloc
rm -rf docs/results
./target/release/vmmalloc compare --out docs/results --json docs/results/results.json "$@"
# Ablation hook: the expandable policy with its largest physical chunk capped
# (policy option max_chunk) at 2, 20 and 64 MiB and at its default, on the
# built-in set. ABLATION="" skips it; ABLATION="SPEC,..." replaces the list.
ABLATION=${ABLATION-expandable:max_chunk=2MiB,expandable:max_chunk=20MiB,expandable:max_chunk=64MiB,expandable}
if [[ -n $ABLATION ]]; then
  ./target/release/vmmalloc compare --policies "$ABLATION" --out docs/results/ablation \
    --json docs/results/ablation/results.json "$@"
fi
# Second ablation: when free chunks are split instead of pinned
# (split_threshold: live bytes as a fraction of the limit; 1 = never, 0 = always).
SPLITS=${SPLITS-expandable:split_threshold=0,expandable:split_threshold=0.2,expandable,expandable:split_threshold=0.6,expandable:split_threshold=1}
if [[ -n $SPLITS ]]; then
  ./target/release/vmmalloc compare --policies "$SPLITS" --out docs/results/splits \
    --json docs/results/splits/results.json "$@"
fi
# Third ablation: how many uncovered bytes a partly covered free chunk may keep
# and still be pinned rather than split (split_slack; the default is 4 MiB).
SLACKS=${SLACKS-expandable:split_slack=0,expandable:split_slack=2MiB,expandable,expandable:split_slack=8MiB,expandable:split_slack=20MiB}
if [[ -n $SLACKS ]]; then
  ./target/release/vmmalloc compare --policies "$SLACKS" --out docs/results/slack \
    --json docs/results/slack/results.json "$@"
fi
LONG=(train-varlen:steps=100 serve-kv:steps=8000 frag-adversary:rounds=16)
./target/release/vmmalloc compare "${LONG[@]}" --out docs/results/long --json docs/results/long/results.json
{
  sed -e 's#](\([a-z0-9_.-]*\.svg\))#](results/\1)#g' docs/results/report.md
  echo
  echo "## Longer runs"
  echo
  echo "The same workloads run longer (\`vmmalloc compare ${LONG[*]}\`): the cold start (creating"
  echo "physical memory up to the peak) is paid once, the work after it on every step; the steady"
  echo "columns show what a further iteration of the whole trace costs. Full report:"
  echo "[results/long/report.md](results/long/report.md)."
  echo
  echo '```'
  sed -n '/^trace /,/^```/p' docs/results/long/report.md | sed '/^```/d'
  echo '```'
  if [[ -n $ABLATION ]]; then
    echo
    echo "## Ablation: largest physical chunk"
    echo
    echo "\`vmmalloc compare --policies $ABLATION\` on the built-in set: min capacity against cold"
    echo "and steady driver time at the tight capacity, one row per cap on the largest physical"
    echo "handle (\`max_chunk\`; \`default\` is the allocator's own choice). Full report:"
    echo "[results/ablation/report.md](results/ablation/report.md)."
    echo
    sed -n '/^## Ablation: expandable options/,/^## Traces/p' docs/results/ablation/report.md | sed '1,2d;/^## Traces/d;/^!\[/d'
  fi
  if [[ -n $SPLITS ]]; then
    echo
    echo "## Ablation: when free chunks are split"
    echo
    echo "\`vmmalloc compare --policies $SPLITS\` on the built-in set: the expandable policy's"
    echo "\`split_threshold\` (live bytes, as a fraction of the limit, above which a free chunk that a"
    echo "new block covers only in part is split instead of pinned; 1 = never, 0 = always; the default"
    echo "is 0.4). Full report: [results/splits/report.md](results/splits/report.md)."
    echo
    sed -n '/^## Ablation: expandable options/,/^## Traces/p' docs/results/splits/report.md | sed '1,2d;/^## Traces/d;/^!\[/d'
  fi
  if [[ -n $SLACKS ]]; then
    echo
    echo "## Ablation: pinned slack"
    echo
    echo "\`vmmalloc compare --policies $SLACKS\` on the built-in set: the expandable policy's"
    echo "\`split_slack\` (bytes a partly covered free chunk may leave uncovered and still be reused"
    echo "whole while memory is tight; 0 splits every partly covered chunk; the default is 4 MiB)."
    echo "Full report: [results/slack/report.md](results/slack/report.md)."
    echo
    sed -n '/^## Ablation: expandable options/,/^## Traces/p' docs/results/slack/report.md | sed '1,2d;/^## Traces/d;/^!\[/d'
  fi
  echo
  echo "Command: \`scripts/compare.sh\` ($(./target/release/vmmalloc --version), $(date -u +%Y-%m-%d), $(nproc) cores)."
} > docs/results.md
rm docs/results/report.md
echo "wrote docs/results.md and docs/results/"
