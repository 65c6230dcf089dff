#!/usr/bin/env bash
# Dense USP fwd+bwd (benchmarks.bench_usp: S = 16k, H = H_kv = 8, fp32, 4 gloo ranks, every U x R) of two
# commits, run alternately ROUNDS times each (the order flips every round, so machine drift hits both),
# printing one line per run.   usage: bash benchmarks/ab_commits.sh OLD_REV NEW_REV [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
old=$1 new=$2 rounds=${3:-4}
work=$(mktemp -d)
for rev in "$old" "$new"; do git clone -q "$root" "$work/$rev" && git -C "$work/$rev" checkout -q "$rev"; done
for ((i = 1; i <= rounds; i++)); do
  order=("$old" "$new"); ((i % 2 == 0)) && order=("$new" "$old")
  for rev in "${order[@]}"; do
    (cd "$work/$rev" && OMP_NUM_THREADS=1 PYTHONPATH="$work/$rev" "$root/.venv/bin/torchrun" --nproc_per_node 4 \
      --master_port 29611 -m benchmarks.bench_usp --reps 3 2>/dev/null | grep "^{" | sed "s/^/round $i $rev /")
  done
done
rm -rf "$work"
