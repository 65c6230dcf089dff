"""Sparse ring attention on CPU gloo ranks: imbalance ratio ρ_s per balancing, and fwd+bwd time vs dense USP.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_sparse [--quick]

Workload: a causal "vertical-slash" attention, B = 1, H = H_kv = 8, D = 64, fp32. q and k carry
(a) rotary-like positional features, so scores peak near the diagonal (slash lines), and (b) a
shared direction that a few "heavy" key columns and the first tokens align with (vertical lines),
plus noise; the pattern is estimated from the data like in training (budgets vertical = 0.02·S,
slash = 0.035·S, which keeps about 10 % of the causal pairs at S = 32k: 90 % sparsity; block_size 128, as MTraining).

1. ρ_s (db-SP, docs/sparse.md "Balancing and ρ_s") of the estimated pattern at P = 4 and P = 8 for the contiguous and
   zigzag rings (``balancing: none``), block stripes (``stripe``) and stripes + head balancing
   (``dbsp``: head permutation + block reassignment), at U x R = 1 x P and 2 x P/2 (computed by the
   layer's own planning code, ``plan_balance`` / ``balance_stats``; no ranks needed).
2. At P = world (4): fwd+bwd time of dense USP (zigzag) and of sparse_ring with each balancing, all at
   U x R = 2 x 2, with the measured per-rank work balance (max / mean of computed score pairs).
Prints markdown tables on rank 0 and saves ``benchmarks/results/sparse_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import RESULTS, gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh, SequenceParallelConfig
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.sparse import estimate_pattern
from ds_seqpar.parallel.ring import WorkCounter
from ds_seqpar.parallel.sparse_ring import balance_stats, budget_from_config, plan_balance

H, D, BLOCK = 8, 64, 128
SPARSE = {"vertical": 0.02, "slash": 0.035, "block_size": BLOCK}


def workload(seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global q, k, v ``[1, S, H, D]`` with slash (positional) and vertical (heavy column) structure.

    q and k share 24 rotary frequency pairs (wavelengths 2k..64k tokens) so q_i·k_j decays smoothly
    with i - j (local attention, slash lines); 4 sinks and 0.3-1.2 % heavy columns (more for later
    heads) share a direction with every query (vertical lines); the rest is noise.
    """
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq_len, dtype=torch.float64)
    q = 0.5 * torch.randn(1, seq_len, H, D, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(1, seq_len, H, D, generator=g, dtype=torch.float64)
    waves = torch.logspace(math.log10(2048), math.log10(65536), 24, dtype=torch.float64)
    angle = 2 * math.pi * pos[:, None] / waves[None, :]
    for h in range(H):
        feats = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1) * 0.6 * (1 + 0.1 * h)  # [S, 48]
        q[0, :, h, :48] += feats
        k[0, :, h, :48] += feats
        heavy = torch.rand(seq_len, generator=g) < 0.003 * (1 + h % 4)
        heavy[:4] = True
        q[0, :, h, 48:56] += 1.0
        k[0, heavy, h, 48:56] += 1.2
    v = torch.randn(1, seq_len, H, D, generator=g, dtype=torch.float64)
    return q.float(), k.float(), v.float()


def rho_rows(pattern, seq_len: int) -> list[dict]:
    """ρ_s of ``pattern`` for each (P, U x R, balancing), from the same planning code the layer runs."""
    rows = []
    for p in (4, 8):
        for u in (1, 2):
            r = p // u
            heads = HeadPlan.build(H, H, u)
            runs = {
                "none (contiguous)": ("none", ring_layout("contiguous", r)),
                "none (zigzag)": ("none", ring_layout("zigzag", r)),
                "stripe": ("stripe", ring_layout("stripe", r, BLOCK)),
                "dbsp": ("dbsp", ring_layout("stripe", r, BLOCK)),
            }
            for name, (balancing, layout) in runs.items():
                plan = plan_balance(pattern, layout, seq_len, H, heads, balancing)
                stats = balance_stats(pattern, plan, layout, None)
                rows.append(
                    {
                        "P": p,
                        "UxR": f"{u}x{r}",
                        "balancing": name,
                        "rho_s": stats.rho_s,
                        "moved": stats.blocks_moved,
                    }
                )
    return rows


def timed(mesh: SeqParMesh, q, k, v, dout, reps: int) -> dict:
    me = mesh.coords.sp_rank
    layout = ds_seqpar.input_layout(mesh)
    seq_len = q.shape[1]
    ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
    dl = layout.shard(dout, me)
    work = WorkCounter()

    def step() -> None:
        work.reset()
        with mesh.comm_stats.measure() as region:
            ds_seqpar.attention(ql, kl, vl, mesh=mesh, work=work, layer=0).backward(dl)
        step.region = region

    seconds = slowest_rank_median(step, reps)
    pairs = gather_floats(work.forward_pairs)
    stats = ds_seqpar.sparse_stats(mesh).get(0)
    return {
        "time_s": seconds,
        "work_balance": max(pairs) / (sum(pairs) / len(pairs)),
        "density": stats.density if stats else 1.0,
        "rho_s": stats.rho_s if stats else float("nan"),
        "MiB": step.region.total_bytes / 2**20,
        "S": seq_len,
        "moved": stats.blocks_moved if stats else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="S = 4k, one repetition (smoke run)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    seq_len = args.seq_len or (4096 if args.quick else 32768)
    reps = args.reps or (1 if args.quick else 2)
    q, k, v = workload(seq_len)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    rank0 = dist.get_rank() == 0

    rho = []
    if rank0:
        pos = torch.arange(seq_len)
        sparse = SequenceParallelConfig(size=1, attention="sparse_ring", sparse=SPARSE).sparse
        pattern = estimate_pattern(q, k, pos, pos, seq_len, budget_from_config(sparse))
        density = pattern.token_density()
        rho = rho_rows(pattern, seq_len)
        print(f"pattern: token density {density:.4f} (sparsity {1 - density:.1%})", flush=True)
        for row in rho:
            print(row, flush=True)

    runs = [("dense USP (zigzag)", "usp", None)]
    runs += [(f"sparse_ring {b}", "sparse_ring", b) for b in ("none", "stripe", "dbsp")]
    timed_rows = []
    u = 2 if world % 2 == 0 else 1
    base = SeqParMesh.build(world, u)
    for name, attention, balancing in runs:
        section = {"size": world, "ulysses_degree": u, "attention": attention}
        if balancing:
            section["sparse"] = {**SPARSE, "balancing": balancing}
            section["ring"] = {"layout": "zigzag"} if balancing == "none" else {}
        mesh = base.with_section(section)
        res = timed(mesh, q, k, v, dout, reps)
        timed_rows.append({"run": name, "UxR": f"{u}x{world // u}", **res})
        if rank0:
            print(timed_rows[-1], flush=True)
    dense = timed_rows[0]["time_s"]
    for row in timed_rows:
        row["speedup"] = dense / row["time_s"]

    if rank0:
        meta = {
            "world": world,
            "S": seq_len,
            "H": H,
            "D": D,
            "block_size": BLOCK,
            "sparse": SPARSE,
            "reps": reps,
        }
        name = "sparse_cpu_quick" if args.quick else "sparse_cpu"
        t1 = save_results(
            f"{name}_rho",
            f"Imbalance ratio rho_s of the estimated vertical-slash pattern, S={seq_len}, H={H}, block {BLOCK}",
            meta,
            rho,
            [
                ("P", "P", "d"),
                ("U x R", "UxR", "s"),
                ("balancing", "balancing", "s"),
                ("rho_s", "rho_s", ".3f"),
            ],
        )
        t2 = save_results(
            name,
            f"fwd+bwd, causal, fp32, B=1, H=H_kv={H}, D={D}, S={seq_len}, P={world} gloo CPU ranks (1 thread each)",
            meta,
            timed_rows,
            [
                ("run", "run", "s"),
                ("U x R", "UxR", "s"),
                ("time (s)", "time_s", ".2f"),
                ("speed-up vs dense", "speedup", ".2f"),
                ("density", "density", ".4f"),
                ("rho_s", "rho_s", ".3f"),
                ("measured work max/mean", "work_balance", ".3f"),
                ("blocks moved", "moved", "d"),
                ("MiB/rank", "MiB", ".1f"),
            ],
        )
        print(t1 + "\n" + t2)
        print(f"results in {RESULTS}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
