#!/usr/bin/env bash
# Install the peer systems the benchmark suite compares against into benchmarks/.peers, a separate
# site directory that only `python -m benchmarks.run` puts on sys.path (never a dependency of ds_seqpar).
#   yunchang 0.6.4, ring-flash-attn 0.1.8   (DeepSpeed's Ulysses and ALST come with the main install)
# flash-attn itself is not installed: on CPU its calls are served by benchmarks/peers/flash_attn_shim.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "peers/install.sh: run 'bash scripts/install.sh' first (.venv is missing)" >&2; exit 1; }
.venv/bin/python -m pip --disable-pip-version-check -q install --no-deps --upgrade \
  --target benchmarks/.peers yunchang==0.6.4 ring-flash-attn==0.1.8 2> >(grep -v "is ignored: it is neither" >&2)
echo "peers/install.sh: yunchang 0.6.4 and ring-flash-attn 0.1.8 are in benchmarks/.peers"
