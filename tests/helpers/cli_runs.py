"""``train.py``'s main on a rank of a gloo pool, returning its metrics rows (``test_train_cli.py``,
``test_monitor.py``)."""

from __future__ import annotations

import json

import torch.distributed as dist

from ds_seqpar.cli import main


def run_cli(argv: list[str]) -> list[dict]:
    main(argv)
    dist.barrier()
    out = argv[argv.index("--output-dir") + 1]
    with open(f"{out}/metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]
