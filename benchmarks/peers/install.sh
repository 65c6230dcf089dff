#!/usr/bin/env bash
# Install the peer systems the benchmark suite compares against into benchmarks/.peers, a separate
# site directory that only `python -m benchmarks.run` puts on sys.path (never a dependency of ds_seqpar).
#   yunchang 0.6.4, ring-flash-attn 0.1.8   (DeepSpeed's Ulysses and ALST come with the main install)
#   xfuser 0.7.0 (xDiT) and distvae 0.1.0   (benchmarks/peers/xfuser_dit.py; its other deps are in .venv,
#     except sentencepiece, beautifulsoup4 and av: text encoders, Sana captions and video, unused here)
# flash-attn itself is not installed: on CPU its calls are served by benchmarks/peers/flash_attn_shim.
# --no-deps keeps a second torch out; the xfuser wheel also ships top-level benchmark/, benchmarks/,
# docker/, docs/, entrypoints/, examples/ and tests/ folders, removed here so they never shadow ours.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "peers/install.sh: run 'bash scripts/install.sh' first (.venv is missing)" >&2; exit 1; }
.venv/bin/python -m pip --disable-pip-version-check -q install --no-deps --upgrade \
  --target benchmarks/.peers yunchang==0.6.4 ring-flash-attn==0.1.8 xfuser==0.7.0 distvae==0.1.0 \
  2> >(grep -v "is ignored: it is neither" >&2)
for d in benchmark benchmarks docker docs entrypoints examples tests; do rm -rf "benchmarks/.peers/$d"; done
echo "peers/install.sh: yunchang 0.6.4, ring-flash-attn 0.1.8, xfuser 0.7.0 and distvae 0.1.0 are in benchmarks/.peers"
