"""Attention-work balance of packed rows over R ring ranks: zigzag over the row vs document placement.

Run: ``.venv/bin/python -m benchmarks.balance`` (no process group; seconds).

For every shipped mix (``benchmarks/lengths/*.json``) and R in {4, 8}, each row is sharded three ways and
each rank's causal attention work (visible query-key pairs of its query tokens, ``layout/placement.py``)
is summed:

* ``zigzag over the row``: the row padded to a multiple of 2R, chunks r and 2R-1-r on rank r (today's
  default for packed rows);
* ``zigzag per document``: every document padded to a multiple of 2R and zigzagged on its own (what
  torchtitan asks of its inputs): balanced, at the cost of that padding;
* ``placement``: ``place_documents`` (the row padded to a multiple of R only).

Reported per (mix, R, method): max / mean work per rank averaged over rows and in the worst row, the
padding the method adds (% of the document tokens), and the runs of consecutive positions per rank (kernel pieces).
Saves ``benchmarks/results/balance.json`` and ``.md``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import save_results
from ds_seqpar.layout import padded_length, ring_layout
from ds_seqpar.layout.placement import layout_work, place_documents

MIXES = Path(__file__).resolve().parent / "lengths"
WORLDS = (4, 8)


def _ratio(work: list[float]) -> float:
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def zigzag_row(lengths: list[int], seq_len: int, world: int) -> tuple[float, int, float]:
    """(max / mean, padding the method adds, runs per rank) of zigzag over the whole row."""
    padded = padded_length(seq_len, 2 * world)
    return _ratio(layout_work(ring_layout("zigzag", world), lengths, padded)), padded - seq_len, 2.0


def zigzag_documents(lengths: list[int], seq_len: int, world: int) -> tuple[float, int, float]:
    """Every document padded to a multiple of 2R and zigzagged on its own (its padding at its end)."""
    work = [0.0] * world
    for length in lengths:
        padded = padded_length(length, 2 * world)
        for r, w in enumerate(layout_work(ring_layout("zigzag", world), [length], padded)):
            work[r] += w
    padding = sum(padded_length(x, 2 * world) for x in lengths) - sum(lengths)
    return _ratio(work), padding, 2.0 * len(lengths)


def placement(lengths: list[int], seq_len: int, world: int) -> tuple[float, int, float]:
    padded = padded_length(seq_len, world)
    plan = place_documents(lengths, padded, world)
    return plan.balance, padded - seq_len, statistics.mean(len(r) for r in plan.runs)


METHODS = {"zigzag over the row": zigzag_row, "zigzag per document": zigzag_documents, "placement": placement}


def main() -> None:
    rows = []
    for path in sorted(MIXES.glob("*.json")):
        mix = json.loads(path.read_text())
        tokens = sum(sum(r) for r in mix["rows"])
        for world in WORLDS:
            for method, fn in METHODS.items():
                results = [fn(lengths, mix["seq_len"], world) for lengths in mix["rows"]]
                rows.append({
                    "mix": mix["name"],
                    "seq_len": mix["seq_len"],
                    "R": world,
                    "method": method,
                    "mean_ratio": statistics.mean(r[0] for r in results),
                    "worst_ratio": max(r[0] for r in results),
                    "padding_pct": 100.0 * sum(r[1] for r in results) / tokens,
                    "runs_per_rank": statistics.mean(r[2] for r in results),
                })  # fmt: skip
    title = (
        "Causal attention work per rank, max / mean (1.00 = balanced), over the rows of each shipped mix "
        "(benchmarks/lengths/). padding added: tokens the method pads (the row to its multiple, or every "
        "document to a multiple of 2R), % of the document tokens. runs per rank: runs of consecutive "
        "positions a rank holds (kernel pieces)."
    )
    columns = [("mix", "mix", "s"), ("S", "seq_len", "d"), ("R", "R", "d"), ("method", "method", "s"),
               ("max/mean, mean over rows", "mean_ratio", ".3f"), ("max/mean, worst row", "worst_ratio", ".3f"),
               ("padding added (%)", "padding_pct", ".3f"), ("runs per rank", "runs_per_rank", ".1f")]  # fmt: skip
    print(save_results("balance", title, {"worlds": WORLDS}, rows, columns))


if __name__ == "__main__":
    main()
