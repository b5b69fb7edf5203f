#!/usr/bin/env bash
# Regenerates docs/results.md and its plots (docs/results/) from the built-in set:
# the bundled PyTorch snapshot and the four generated workloads, every policy.
# A second section replays longer runs of the same workloads (more steps, same
# parameters otherwise), where steady-state driver work outweighs the cold start;
# then the ablations of the expandable policy's largest physical chunk and of
# unpinning against splitting.
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
# Second ablation: unpinning, mapping ahead and splitting. The default pins
# freely, maps a growing tail ahead to 20 MiB and unpins when memory runs
# short; `grow_granule=0` maps exactly what each block needs; `unpin=0` never
# moves a live tensor (pins stay until freed); `split_threshold=0.4` splits
# free chunks ahead of need once live bytes pass 2/5 of the limit; with
# `unpin=0,grow_granule=0` that is the default before unpinning.
SPLITS=${SPLITS-expandable,expandable:grow_granule=0,expandable:unpin=0,expandable:split_threshold=0.4,expandable:split_threshold=0.4,unpin=0,grow_granule=0}
if [[ -n $SPLITS ]]; then
  ./target/release/vmmalloc compare --policies "$SPLITS" --out docs/results/splits \
    --json docs/results/splits/results.json "$@"
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
    echo "## Ablation: unpinning, mapping ahead and splitting"
    echo
    echo "\`vmmalloc compare --policies $SPLITS\` on the built-in set. \`expandable\` (the default)"
    echo "reuses a free chunk whole even when a new block covers only part of it (pins it), maps a"
    echo "growing segment tail ahead to 20 MiB boundaries while memory has room, and, when an allocation"
    echo "runs short, unpins: the live pages move to chunks of their own at the same addresses and the"
    echo "chunk's free pages come back (docs/expandable.md, \"Unpinning\"). \`grow_granule=0\` maps exactly"
    echo "what each block needs; \`unpin=0\` never moves a live tensor (pins stay until their blocks are"
    echo "freed); \`split_threshold=0.4\` splits a partly covered free chunk ahead of need once live bytes"
    echo "pass 2/5 of the limit; \`split_threshold=0.4,unpin=0,grow_granule=0\` is the default before"
    echo "unpinning. Full report: [results/splits/report.md](results/splits/report.md)."
    echo
    sed -n '/^## Ablation: expandable options/,/^## Traces/p' docs/results/splits/report.md | sed '1,2d;/^## Traces/d;/^!\[/d'
  fi
  echo
  echo "Command: \`scripts/compare.sh\` ($(./target/release/vmmalloc --version), $(date -u +%Y-%m-%d), $(nproc) cores)."
} > docs/results.md
rm docs/results/report.md
# One self-contained HTML page is kept as an example (docs/results/report.html);
# the ablation, splits and long runs' pages repeat it at ~0.4 MB each (issue 27).
rm -f docs/results/ablation/report.html docs/results/splits/report.html docs/results/long/report.html
echo "wrote docs/results.md and docs/results/"
