"""Packed documents on CPU gloo ranks: fwd+bwd time of ``ds_seqpar.attention`` per mesh.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_packed

Default: S = 4096, H = H_kv = 8, D = 64, causal, fp32, one row packed with documents of 512 + 1024 +
2560 tokens and one of 16 documents of 256; meshes U x R in {4x1 (the shipped default), 2x2, 1x4}
with ring.layout zigzag, documents, and documents with dynamic_degree; and the no-communication reference: each rank runs one causal kernel call
on its share of the documents' causal work (1/P of each document's heads), no collective. Prints a
markdown table on rank 0 and saves ``benchmarks/results/packed_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.layout import doc_ids_from_cu_seqlens
from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward

ROWS = {
    "3 documents (512, 1024, 2560)": [0, 512, 1536, 4096],
    "16 documents of 256": list(range(0, 4097, 256)),
}


LAYOUTS = (("zigzag", False), ("documents", False), ("documents", True))  # ring.layout, dynamic_degree


def _inputs(n: int, h: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, n, h, d, generator=g) for _ in range(4))


def measure_mesh(mesh: SeqParMesh, seq_len: int, h: int, d: int, cu: list[int], reps: int) -> float:
    q, k, v, dout = _inputs(seq_len // mesh.sp_size, h, d)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    docs = doc_ids_from_cu_seqlens(cu, seq_len)

    def step() -> None:
        ds_seqpar.attention(*leaves, mesh=mesh, causal=True, doc_ids=docs).backward(dout)

    return slowest_rank_median(step, reps)


def measure_reference(world: int, h: int, d: int, cu: list[int], reps: int) -> float:
    """Each rank: every document's causal attention for h / world heads, one kernel call per document."""
    heads = max(1, h // world)
    tensors = [_inputs(b - a, heads, d) for a, b in itertools.pairwise(cu)]

    def step() -> None:
        for q, k, v, dout in tensors:
            out, lse = block_attn_forward(q, k, v, causal=True)
            block_attn_backward(dout, q, k, v, out, lse, causal=True)

    return slowest_rank_median(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, h, d = dist.get_world_size(), 8, 64
    rows = []
    for name, cu in ROWS.items():
        cu = [min(c, args.seq_len) for c in cu]
        for (layout, dynamic), u in itertools.product(
            LAYOUTS, [x for x in (world, 2, 1) if world % x == 0 and x <= h]
        ):
            section = {
                "size": world,
                "ulysses_degree": u,
                "ring": {"layout": layout},
                "dynamic_degree": dynamic,
            }
            t = measure_mesh(SeqParMesh.from_config(section), args.seq_len, h, d, cu, args.reps)
            what = layout + (" + dynamic_degree" if dynamic else "")
            rows.append({"row": name, "system": f"ds_seqpar U{u} x R{world // u}, {what}", "time_s": t})
        t = measure_reference(world, h, d, cu, args.reps)
        rows.append({"row": name, "system": "reference: no communication", "time_s": t})
    if dist.get_rank() == 0:
        for r in rows:
            ref = next(
                x["time_s"] for x in rows if x["row"] == r["row"] and x["system"].startswith("reference")
            )
            r["vs_reference"] = r["time_s"] / ref
        table = save_results(
            "packed_cpu",
            f"# Packed documents, fwd+bwd, S={args.seq_len}, H=8, D=64, fp32, {world} CPU ranks (median of {args.reps})",
            {"seq_len": args.seq_len, "world": world, "reps": args.reps},
            rows,
            [
                ("row", "row", "s"),
                ("system", "system", "s"),
                ("time (s)", "time_s", ".3f"),
                ("x reference", "vs_reference", ".2f"),
            ],
        )
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
