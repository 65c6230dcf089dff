"""USP on CPU gloo ranks: fwd+bwd time and bytes per rank for every U x R factorisation of P.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_usp [--quick]

Default: S = 16k, H = H_kv = 8, D = 64, causal, fp32, zigzag ring layout, U x R in {4x1, 2x2, 1x4}.
Prints a markdown table on rank 0 and saves ``benchmarks/results/usp_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import save_results, slowest_rank_median
from ds_seqpar import SeqParMesh


def measure(mesh: SeqParMesh, seq_len: int, h: int, h_kv: int, d: int, reps: int) -> dict:
    n = seq_len // mesh.sp_size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, n, h, d, generator=g, requires_grad=True)
    k = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    v = torch.randn(1, n, h_kv, d, generator=g, requires_grad=True)
    dout = torch.randn(1, n, h, d, generator=g)

    def step() -> None:
        with mesh.comm_stats.measure() as region:
            ds_seqpar.attention(q, k, v, mesh=mesh, causal=True).backward(dout)
        step.region = region

    seconds = slowest_rank_median(step, reps)
    region = step.region
    return {
        "time_s": seconds,
        "a2a_MiB": region.bytes("all_to_all") / 2**20,
        "p2p_MiB": region.bytes("p2p") / 2**20,
        "total_MiB": region.total_bytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="S = 2k, one repetition (smoke run)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    seq_len = args.seq_len or (2048 if args.quick else 16384)
    reps = args.reps or (1 if args.quick else 2)
    rows = []
    for u in sorted((u for u in range(1, world + 1) if world % u == 0), reverse=True):
        mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": u, "ring": {"layout": "zigzag"}})
        res = measure(mesh, seq_len, args.heads, args.kv_heads, 64, reps)
        rows.append({"UxR": f"{u}x{world // u}", "S": seq_len, "H": args.heads, "H_kv": args.kv_heads, **res})
        if dist.get_rank() == 0:
            print(rows[-1], flush=True)
    if dist.get_rank() == 0:
        title = (
            f"USP fwd+bwd, causal, fp32, B=1, H={args.heads}, H_kv={args.kv_heads}, D=64, S={seq_len}, "
            f"P={world} gloo CPU ranks (1 thread each), zigzag ring layout"
        )
        meta = {"world": world, "dtype": "float32", "threads_per_rank": 1, "reps": reps}
        columns = [
            ("U x R", "UxR", "s"),
            ("S", "S", "d"),
            ("time (s)", "time_s", ".2f"),
            ("all-to-all MiB/rank", "a2a_MiB", ".2f"),
            ("ring P2P MiB/rank", "p2p_MiB", ".2f"),
            ("total MiB/rank", "total_MiB", ".2f"),
        ]
        print(save_results("usp_cpu_quick" if args.quick else "usp_cpu", title, meta, rows, columns))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
