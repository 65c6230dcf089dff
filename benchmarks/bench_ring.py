"""Ring engine on CPU gloo ranks: fwd+bwd time, bytes per rank and causal work balance per variant.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_ring [--quick]

Prints a markdown table on rank 0 and saves ``benchmarks/results/ring_cpu.json`` and ``.md``.
Time is the median over repetitions of the slowest rank's fwd+bwd (barrier before each rep).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, build_schedule, ring_attention

VARIANTS = [  # (label, layout, schedule, inner size or None)
    ("ring/contiguous", "contiguous", "p2p", None),
    ("ring/zigzag", "zigzag", "p2p", None),
    ("ring/stripe", "stripe", "p2p", None),
    ("double-ring 2x2/zigzag", "zigzag", "p2p", 2),
    ("all-gather/zigzag", "zigzag", "all_gather", None),
]


def measure(
    mesh: SeqParMesh, layout: str, schedule: str, seq_len: int, h: int, h_kv: int, d: int, reps: int
) -> dict:
    lay = ring_layout(layout, mesh.ring_size)
    n = seq_len // mesh.ring_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, h, d, generator=g, requires_grad=True)
    k = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    v = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    dout = torch.randn(1, n, h, d, generator=g)
    work = WorkCounter()
    plan = RingPlan(build_schedule(mesh, schedule), lay, MaskSpec(causal=True), None, "auto", work)

    def step() -> None:
        work.reset()
        with mesh.comm_stats.measure() as region:
            out, _ = ring_attention(q, k, v, plan)
            out.backward(dout)
        step.bytes = region.total_bytes

    seconds = slowest_rank_median(step, reps)
    counts = gather_floats(work.forward_pairs)
    return {
        "time_s": seconds,
        "bytes_per_rank": step.bytes,
        "balance_max_over_mean": max(counts) / (sum(counts) / len(counts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
                rows.append(
                    {"variant": label, "S": seq_len, "H": 8, "H_kv": h_kv, "D": 64, "P": world, **res}
                )
                if dist.get_rank() == 0:
                    print(
                        f"S={seq_len:6d} H_kv={h_kv} {label:24s} {res['time_s']:8.3f} s  "
                        f"{res['bytes_per_rank'] / 2**20:8.2f} MiB  balance {res['balance_max_over_mean']:.2f}",
                        flush=True,
                    )
    if dist.get_rank() == 0:
        for r in rows:
            r["MiB_per_rank"] = r["bytes_per_rank"] / 2**20
        title = (
            f"Ring engine, fwd+bwd, causal, fp32, B=1, H=8, D=64, P={world} gloo CPU ranks (1 thread each)"
        )
        meta = {"world": world, "dtype": "float32", "causal": True, "threads_per_rank": 1, "kernel": "auto"}
        columns = [
            ("S", "S", "d"),
            ("H_kv", "H_kv", "d"),
            ("variant", "variant", "s"),
            ("time (s)", "time_s", ".3f"),
            ("MiB/rank", "MiB_per_rank", ".2f"),
            ("work max/mean", "balance_max_over_mean", ".2f"),
        ]
        print(save_results("ring_cpu_quick" if args.quick else "ring_cpu", title, meta, rows, columns))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
