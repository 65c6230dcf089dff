#!/usr/bin/env bash
# Install ds_seqpar and its CPU dependencies into .venv (torch pinned first, so pip never pulls a CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
start=$(date +%s)
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install --upgrade pip
if [ "$TORCH_SPEC" != "skip" ]; then
  pip install "$TORCH_SPEC"
fi
pip install -e ".[dev]"
# Exactly one torch, and the pinned one.
.venv/bin/python - "$TORCH_SPEC" <<'PY'
import importlib.metadata as md
import sys

spec = sys.argv[1]
torches = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() in {"torch", "pytorch"}]
if len(torches) != 1:
    sys.exit(f"install.sh: expected one torch distribution, found {[d.version for d in torches]}")
version = torches[0].version
if spec.startswith("torch==") and not version.startswith(spec.split("==", 1)[1]):
    sys.exit(f"install.sh: torch {version} is installed but {spec} was asked for; something pulled another torch")
import deepspeed  # noqa: F401  (also checks the DeepSpeed build against this torch)
import transformers

print(f"install.sh: torch {version}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
PY
echo "install.sh: done in $(( $(date +%s) - start )) s"
