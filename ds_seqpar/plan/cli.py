"""``python -m ds_seqpar.plan``: rank the candidates for a model, a world and a sequence (docs/plan.md).

    python -m ds_seqpar.plan --model assets/tiny-llama --world 4 --ranks-per-node 4 --seq-len 8192 --cluster local
    python -m ds_seqpar.plan --model benchmarks/models/llama3_8b_config.json --world 64 --ranks-per-node 8 \\
        --seq-len 1M --memory-budget 80 --cluster h100-ib --top 5 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.plan.candidates import MEMORY_SAVINGS
from ds_seqpar.plan.clusters import GIB
from ds_seqpar.plan.planner import (
    CLUSTER_CHOICES,
    default_budget,
    load_model_config,
    plan_context,
    rank,
    read_lengths,
)
from ds_seqpar.plan.predict import Prediction

__all__ = ["main", "parse_tokens", "table"]


def parse_tokens(text: str) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '524288' -> 524288 (K = 1024)."""
    found = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if not found or int(found[1]) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; valid: e.g. 131072, 128K or 1M")
    return int(found[1]) * {"": 1, "k": 1024, "m": 1024**2}[found[2].lower()]


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer; valid: e.g. 8")
    return int(text)


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GiB; valid: e.g. 80")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of positive integers; valid: e.g. 1,2"
        )
    return values


def _savings(text: str) -> list[str]:
    names = text.split(",")
    bad = [n for n in names if n not in MEMORY_SAVINGS]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)} not known; valid: {', '.join(MEMORY_SAVINGS)}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ds_seqpar.plan", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", required=True, help="a transformers config.json or a model directory (local files)"
    )
    ap.add_argument("--world", type=_positive, required=True, help="ranks N")
    ap.add_argument("--ranks-per-node", type=_positive, required=True, help="ranks per node K")
    seq = ap.add_mutually_exclusive_group(required=True)
    seq.add_argument("--seq-len", type=parse_tokens, help="tokens per sequence, e.g. 131072, 128K, 1M")
    seq.add_argument("--lengths", help="a length mix (benchmarks/lengths/*.json): packed rows of documents")
    ap.add_argument(
        "--memory-budget", type=_gib, help="GiB per rank (default: the device's, or local RAM / ranks)"
    )
    ap.add_argument(
        "--cluster", choices=CLUSTER_CHOICES, default="h100-ib", help="a preset, or local (measured)"
    )
    ap.add_argument("--top", type=_positive, default=10, help="rows printed")
    ap.add_argument("--json", help="write every ranked candidate to this file")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 (presets), fp32 (local)")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3)
    ap.add_argument("--sp-sizes", type=_int_list, help="SP degrees P to try (default: divisors of the world)")
    ap.add_argument("--memory-savings", type=_savings, default=list(MEMORY_SAVINGS),
                    help=f"comma list of {', '.join(MEMORY_SAVINGS)}")  # fmt: skip
    ap.add_argument("--micro-batches", type=_int_list, default=[1], help="micro-batch sizes, e.g. 1,2")
    ap.add_argument(
        "--profile", help="the local profile's cache file (default ~/.cache/ds_seqpar/profile.json)"
    )
    return ap


def table(ranked: list[Prediction], budget: float) -> str:
    """The ranked rows as a markdown table."""
    head = ("rank | P x dp | U | R | inner ring | schedule | layout | policy | memory savings | B | step s | s / sequence "
            "| peak GiB/rank | inter-node GB | intra-node GB | reasons")  # fmt: skip
    lines = [f"| {head} |", "|" + "---|" * (head.count("|") + 1)]
    for i, p in enumerate(ranked, 1):
        c = p.candidate
        inner = str(c.inner) if c.inner else ("-" if c.ring == 1 else "single")
        cells = [str(i), f"{c.size} x {c.data_parallel}", str(c.ulysses), str(c.ring), inner, c.ring_label,
                 c.layout, c.policy, c.memory, str(c.micro_batch), f"{p.step_s:.4g}", f"{p.seconds_per_sequence:.4g}",
                 f"{p.peak_bytes / GIB:.3g}", f"{p.bytes_by_link['inter'] / 1e9:.3g}",
                 f"{p.bytes_by_link['intra'] / 1e9:.3g}", p.reasons]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def as_json(p: Prediction) -> dict:
    """One ranked row as JSON (sizes, choices, seconds, bytes, reasons, the config section)."""
    c = p.candidate
    return {
        "size": c.size, "data_parallel": c.data_parallel, "ulysses": c.ulysses, "ring": c.ring,
        "inner": c.inner, "schedule": c.schedule, "ring_label": c.ring_label, "team_size": c.team_size,
        "grid": list(c.grid) if c.grid else None, "layout": c.layout, "memory": c.memory,
        "micro_batch": c.micro_batch, "policy": c.policy, "degrees": p.degrees, "step_s": p.step_s, "seconds_per_sequence": p.seconds_per_sequence,
        "peak_bytes": p.peak_bytes, "step_bytes": p.step_bytes, "bytes_by_link": p.bytes_by_link,
        "parts_s": p.parts, "fits": p.fits, "reasons": p.reasons, "section": c.section(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        config, name = load_model_config(args.model)
        seq_len, rows = read_lengths(args.lengths) if args.lengths else (args.seq_len, [])
        ctx = plan_context(config, world=args.world, ranks_per_node=args.ranks_per_node, cluster=args.cluster,
                           seq_len=seq_len, rows=rows, dtype=args.dtype, zero_stage=args.zero_stage,
                           profile_path=args.profile, name=name)  # fmt: skip
        budget = args.memory_budget * GIB if args.memory_budget else default_budget(ctx)
        ranked = rank(
            ctx, budget, sizes=args.sp_sizes, memory=args.memory_savings, micro_batches=args.micro_batches
        )
    except (ValueError, SeqParConfigError) as exc:
        ap.error(str(exc))
    sys.stdout.write(
        f"{name}: S = {seq_len}{f' (packed rows of {args.lengths})' if rows else ''}, world {args.world}, "
        f"{args.ranks_per_node} per node, cluster {args.cluster} ({ctx.profile.source}), budget "
        f"{budget / GIB:.3g} GiB per rank: {len(ranked)} candidates fit\n\n"
    )
    sys.stdout.write(table(ranked[: args.top], budget))
    if args.json:
        out = {"model": name, "seq_len": seq_len, "world": args.world, "ranks_per_node": args.ranks_per_node,
               "cluster": args.cluster, "profile": ctx.profile.to_json(), "budget_bytes": budget,
               "ranked": [as_json(p) for p in ranked]}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0
