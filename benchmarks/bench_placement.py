"""Packed rows of the shipped length mixes on CPU gloo ranks: zigzag vs the document placement.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_placement

Rows: the first ``--rows`` rows of each mix in ``benchmarks/lengths/``, their document lengths scaled to
``--seq-len`` tokens (S = 16384 by default; lengths rounded, at least 1). For each row, fwd+bwd of
``ds_seqpar.attention`` (causal, H = H_kv = 8, D = 64, fp32) on the meshes with a ring (U x R = 1 x P and
2 x P/2) under ``ring.layout`` zigzag and documents, and the no-communication reference (every rank runs
each document's causal kernel call on H / P heads, no collective: perfect balance, no SP cost). Reports
the slowest rank's median time, its ratio to the reference, the measured balance of the work (max / mean
of the visible pairs each rank computed) and the ring's step critical path (the sum over ring steps of
the busiest rank's pairs, over the ideal: what a lockstep ring waits for). Saves ``benchmarks/results/placement_cpu.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.bench_packed import measure_reference
from benchmarks.common import gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.layout import doc_ids_from_cu_seqlens
from ds_seqpar.parallel.ring import WorkCounter

MIXES = Path(__file__).resolve().parent / "lengths"
H, D = 8, 64


def scaled_rows(seq_len: int, count: int) -> dict[str, list[int]]:
    """``"<mix> row i"`` -> cu_seqlens of that row's documents scaled to ``seq_len`` tokens."""
    rows = {}
    for path in sorted(MIXES.glob("*.json")):
        mix = json.loads(path.read_text())
        for i, lengths in enumerate(mix["rows"][:count]):
            cu = [0]
            for length in lengths:
                scaled = max(1, round(length * seq_len / mix["seq_len"]))
                if cu[-1] + scaled > seq_len:
                    break
                cu.append(cu[-1] + scaled)
            rows[f"{mix['name']} row {i}"] = cu
    return rows


def step_critical_path(layout, docs: torch.Tensor, seq_len: int, world: int) -> float:
    """Sum over ring steps of the busiest rank's pairs, over the ideal (all pairs / R): what a lockstep ring
    waits for when each rank's pairs of a step cost their count (1.00 = every step balanced)."""
    critical = total = 0  # every visible pair lies in exactly one (rank, step): their sum is all pairs
    for t in range(world):
        busiest = 0
        for r in range(world):
            qp, kp = layout.local_positions(seq_len, r), layout.local_positions(seq_len, (r - t) % world)
            qd, kd = docs[qp], docs[kp]
            seen = int(
                ((qp[:, None] >= kp[None, :]) & (qd[:, None] == kd[None, :]) & (qd[:, None] >= 0)).sum()
            )
            busiest, total = max(busiest, seen), total + seen
        critical += busiest
    return critical * world / max(total, 1)


def measure(mesh: SeqParMesh, seq_len: int, cu: list[int], reps: int) -> tuple[float, float]:
    """(slowest rank's median fwd+bwd seconds, max / mean forward pairs over ranks)."""
    docs = doc_ids_from_cu_seqlens(cu, seq_len)
    layout = ds_seqpar.input_layout(mesh, docs)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq_len, H, D, generator=g) for _ in range(4)]
    me = mesh.coords.sp_rank
    q, k, v, dout = (layout.shard(t, me) for t in full)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    work = WorkCounter()

    def step() -> None:
        ds_seqpar.attention(*leaves, mesh=mesh, causal=True, doc_ids=docs, work=work).backward(dout)

    seconds = slowest_rank_median(step, reps)
    pairs = gather_floats(work.forward_pairs)
    return seconds, max(pairs) * len(pairs) / max(sum(pairs), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, results = dist.get_world_size(), []
    for name, cu in scaled_rows(args.seq_len, args.rows).items():
        reference = measure_reference(world, H, D, cu, args.reps)
        results.append({"row": name, "docs": len(cu) - 1, "system": "reference: no communication",
                        "time_s": reference, "balance": 1.0, "critical": 1.0})  # fmt: skip
        for u in (1, 2):
            for layout in ("zigzag", "documents"):
                section = {"size": world, "ulysses_degree": u, "ring": {"layout": layout}}
                mesh = SeqParMesh.from_config(section)
                seconds, balance = measure(mesh, args.seq_len, cu, args.reps)
                docs = doc_ids_from_cu_seqlens(cu, args.seq_len)
                ring = ds_seqpar.input_layout(mesh, docs).ring
                results.append({"row": name, "docs": len(cu) - 1, "system": f"U{u} x R{world // u} {layout}",
                                "time_s": seconds, "balance": balance,
                                "critical": step_critical_path(ring, docs, args.seq_len, ring.world)})  # fmt: skip
    if dist.get_rank() == 0:
        for r in results:
            ref = next(
                x["time_s"] for x in results if x["row"] == r["row"] and x["system"].startswith("reference")
            )
            r["vs_reference"] = r["time_s"] / ref
        title = (
            f"Packed rows of the shipped mixes scaled to S={args.seq_len}, causal fwd+bwd, H=H_kv={H}, D={D}, fp32, "
            f"{world} gloo CPU ranks (1 thread each), slowest rank, median of {args.reps}. x reference: time / the "
            "no-communication reference's (1.00 = no SP cost). balance: max / mean of the pairs each rank computed. "
            "step critical path: the sum over ring steps of the busiest ring rank's pairs / (all pairs / R)."
        )
        columns = [("row", "row", "s"), ("documents", "docs", "d"), ("system", "system", "s"),
                   ("fwd+bwd (s)", "time_s", ".3f"), ("x reference", "vs_reference", ".2f"),
                   ("balance", "balance", ".3f"), ("step critical path", "critical", ".3f")]  # fmt: skip
        print(save_results("placement_cpu", title, vars(args) | {"world": world}, results, columns))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
