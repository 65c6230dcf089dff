"""Counted bytes per peer of every ring schedule at P = 8, to compare two commits byte for byte.

    .venv/bin/python -m benchmarks.peer_bytes OUT.json [--compare OLD.json]

Runs ``ds_seqpar.attention`` on 8 gloo ranks for the byte sweep of the schedule tests (every schedule and
its variants, ``tests/helpers/schedule_cases.byte_cases``) plus U = 2 and other layouts of each schedule,
and writes, per case and rank, the bytes sent to each peer by collective kind (forward, backward) and the
max abs error against the dense fp64 reference. ``--compare`` checks every count against an earlier run
(exit status 1 and the differing rows if any differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace

import torch

from tests.helpers.cases import AttentionCase
from tests.helpers.harness import DistPool
from tests.helpers.schedule_cases import byte_cases, run_schedule_cases

WORLD = 8


def cases() -> list[AttentionCase]:
    """The byte sweep, then each schedule under Ulysses 2 and on other layouts."""
    base = AttentionCase(dtype=torch.float32, seq_len=2 * 8 * 7 * 2, h_kv=2)
    more = [
        replace(base, schedule="p2p", u=2),
        replace(base, schedule="p2p", u=2, inner=2),
        replace(base, schedule="all_gather", u=2),
        replace(base, schedule="tasp", u=2, inner=2),
        replace(base, schedule="startrail", u=2, team_size=2, startrail_backward="kv", seq_len=2 * 8 * 8),
        replace(base, schedule="attention2d", u=2, grid=(2, 2), seq_len=2 * 8 * 8),
        replace(base, schedule="p2p", layout="stripe"),
        replace(base, schedule="p2p", layout="contiguous", causal=False),
        replace(base, schedule="tasp", layout="contiguous"),
        replace(
            base, schedule="startrail", team_size=2, startrail_backward="query", h_kv=4, layout="contiguous"
        ),
    ]
    return byte_cases() + [replace(c, seed=90 + i) for i, c in enumerate(more)]


def measure() -> list[dict]:
    """Every case on 8 ranks: per rank, bytes per (kind -> peer) forward and backward, and the max error."""
    pool = DistPool(WORLD, timeout=900)
    sweep = cases()
    try:
        results = pool.run(run_schedule_cases, sweep)
    finally:
        pool.close()
    rows = []
    for i, case in enumerate(sweep):
        ranks = []
        for per_rank in results:
            got = per_rank[i]
            row = {
                key: {f"{kind}->{peer}": n for (kind, peer), n in sorted(got[key].items())}
                for key in ("fwd_peers", "bwd_peers")
            }
            row["max_err"] = max(got["errors"][name] for name in ("out", "dq", "dk", "dv"))
            ranks.append(row)
        fields = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in dataclasses.asdict(case).items()}
        rows.append({"case": fields, "ranks": ranks})
    return rows


def differences(old: list[dict], new: list[dict]) -> list[str]:
    """Every (case, rank, direction) whose counted bytes differ between two runs."""
    if len(old) != len(new):
        return [f"{len(old)} cases against {len(new)}"]
    out = []
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        for rank, (ra, rb) in enumerate(zip(a["ranks"], b["ranks"], strict=True)):
            out += [
                f"case {i} {b['case']['schedule']} rank {rank} {key}: {ra[key]} -> {rb[key]}"
                for key in ("fwd_peers", "bwd_peers")
                if ra[key] != rb[key]
            ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--compare", default=None, help="an earlier run's JSON: every count must be equal")
    args = parser.parse_args()
    rows = measure()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    total = sum(sum(r[k].values()) for row in rows for r in row["ranks"] for k in ("fwd_peers", "bwd_peers"))
    print(f"{len(rows)} cases x {WORLD} ranks, {total} bytes counted; wrote {args.out}")
    if args.compare:
        with open(args.compare) as f:
            diff = differences(json.load(f), rows)
        print("\n".join(diff) if diff else f"identical to {args.compare}: every count of every case and rank")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
