#!/usr/bin/env bash
# Fresh machine: install into .venv (scripts/install.sh), then run train.py's embedded default job
# (tiny Llama, passkey retrieval at 4096 tokens split over 4 CPU processes; a few minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
NPROC=${NPROC:-4}
OUT=${OUT:-outputs/default}
# a rerun starts over (the previous run is moved to $OUT.old-<time>), unless it is asked to --resume
FRESH=--overwrite
for arg in "$@"; do [ "$arg" = "--resume" ] && FRESH=; done
echo "setup.sh: training the embedded default with $NPROC processes into $OUT"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node "$NPROC" train.py --ds_config ds_configs/usp_zero3.json \
  --output-dir "$OUT" $FRESH "$@"
echo "setup.sh: results in $OUT (metrics.jsonl, checkpoints/, hf_model/)"
