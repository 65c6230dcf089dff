"""Ring engine on CPU gloo ranks: fwd+bwd time, bytes per rank and causal work balance per variant.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 benchmarks/bench_ring.py [--quick]

Prints a markdown table on rank 0 and saves ``benchmarks/results/ring_cpu.json`` and ``.md``.
Time is the median over repetitions of the slowest rank's fwd+bwd (barrier before each rep).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_seqpar import SeqParMesh
from ds_seqpar.layout import SeqLayout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, build_schedule, ring_attention

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = [  # (label, layout, schedule, inner size or None)
    ("ring/contiguous", "contiguous", "p2p", None),
    ("ring/zigzag", "zigzag", "p2p", None),
    ("ring/stripe", "stripe", "p2p", None),
    ("double-ring 2x2/zigzag", "zigzag", "p2p", 2),
    ("all-gather/zigzag", "zigzag", "all_gather", None),
]


def measure(mesh: SeqParMesh, layout: str, schedule: str, seq_len: int, h: int, h_kv: int, d: int, reps: int) -> dict:
    r = mesh.ring_size
    lay = SeqLayout(layout, r)
    n = seq_len // r
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, h, d, generator=g, requires_grad=True)
    k = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    v = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    dout = torch.randn(1, n, h, d, generator=g)
    times = []
    work = WorkCounter()
    plan = RingPlan(build_schedule(mesh, schedule), lay, MaskSpec(causal=True), None, "auto", work)
    for rep in range(reps + 1):  # rep 0 warms up
        work.reset()
        dist.barrier()
        start = time.perf_counter()
        with mesh.comm_stats.measure() as region:
            out, _ = ring_attention(q, k, v, plan)
            out.backward(dout)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if rep:
            times.append(elapsed.item())
    pairs = torch.tensor([float(work.forward_pairs)])
    all_pairs = [torch.zeros(1) for _ in range(mesh.plan.world_size)]
    dist.all_gather(all_pairs, pairs)
    counts = [p.item() for p in all_pairs]
    return {
        "time_s": statistics.median(times),
        "bytes_per_rank": region.total_bytes,
        "balance_max_over_mean": max(counts) / (sum(counts) / len(counts)),
        "pairs_per_rank_max": max(counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition (smoke run)")
    parser.add_argument("--seq-lens", type=int, nargs="*", default=None)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    seq_lens = args.seq_lens or ([1024] if args.quick else [4096, 8192])
    reps = args.reps or (1 if args.quick else 3)
    meshes = {None: SeqParMesh.build(world, 1, None)}
    if world % 2 == 0 and world > 2:
        meshes[2] = SeqParMesh.build(world, 1, 2)
    rows = []
    for seq_len in seq_lens:
        for h_kv in (8, 2):
            for label, layout, schedule, inner in VARIANTS:
                if inner not in meshes:
                    continue
                res = measure(meshes[inner], layout, schedule, seq_len, 8, h_kv, 64, reps)
                rows.append({"variant": label, "S": seq_len, "H": 8, "H_kv": h_kv, "D": 64, "P": world, **res})
                if dist.get_rank() == 0:
                    print(
                        f"S={seq_len:6d} H_kv={h_kv} {label:24s} {res['time_s']:8.3f} s  "
                        f"{res['bytes_per_rank'] / 2**20:8.2f} MiB  balance {res['balance_max_over_mean']:.2f}",
                        flush=True,
                    )
    if dist.get_rank() == 0:
        RESULTS.mkdir(exist_ok=True)
        name = "ring_cpu_quick" if args.quick else "ring_cpu"
        meta = {"world": world, "dtype": "float32", "causal": True, "threads_per_rank": 1, "kernel": "auto"}
        (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        lines = [
            f"Ring engine, fwd+bwd, causal, fp32, B=1, H=8, D=64, P={world} gloo CPU ranks (1 thread each)",
            "",
            "| S | H_kv | variant | time (s) | bytes/rank (MiB) | work max/mean |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['S']} | {r['H_kv']} | {r['variant']} | {r['time_s']:.3f} | {r['bytes_per_rank'] / 2**20:.2f} | "
            f"{r['balance_max_over_mean']:.2f} |"
            for r in rows
        ]
        (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
