#!/usr/bin/env bash
# Run the test suite in .venv. Default: everything not marked slow. --slow: only the slow sweeps.
set -euo pipefail
cd "$(dirname "$0")/.."
marker="not slow"
if [ "${1:-}" = "--slow" ]; then marker="slow"; shift; fi
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -m "$marker" --timeout 900 "$@"
