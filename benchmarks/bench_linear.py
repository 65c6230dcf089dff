"""Linear attention / gated DeltaNet under SP on CPU gloo ranks: bytes per rank of All-Scan vs all-gather, and
fwd+bwd time.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_linear [--quick]
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_linear --layer gdn [--quick]

Workload: B = 1, H = 8, d_k = d_v = 64, fp32, scalar decay per head (Lightning style), U = 1, R = P
(contiguous ring, so every byte is the state scan), S in {8k, 64k}. For each scan mode and S: the
bytes this rank sent per layer (forward, backward) and the slowest rank's fwd+bwd time. All-Scan sends
one [B, H, d_k, d_v] state per hop and direction (rank R-1 sends none forward, rank 0 none backward),
independent of S; all-gather sends this rank's state (and log decay) to R - 1 ranks.
``--layer gdn``: the gated delta rule (``delta_rule_attention``: unit-norm keys, beta in (0, 1), one
decay per token and head, Qwen3-Next's form) on the same shapes; All-Scan still sends one state per hop,
the all-gather sends the state plus the d_k x d_k transition M of the piece.
Prints a markdown table on rank 0 and saves ``benchmarks/results/linear_cpu.json`` (``delta_cpu.json``
for gdn) and ``.md``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.parallel.delta_scan import delta_rule_attention
from ds_seqpar.parallel.linear_scan import linear_attention

H, D = 8, 64


def measure(mesh: SeqParMesh, seq_len: int, reps: int, layer: str = "linear") -> dict:
    n = seq_len // mesh.sp_size
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, H, D, generator=g).mul_(0.1).requires_grad_() for _ in range(3))
    decay = -torch.linspace(0.01, 0.5, H)
    dout = torch.randn(1, n, H, D, generator=g)
    if layer == "gdn":
        k = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
        beta = torch.rand(1, n, H, generator=g).requires_grad_()
        decay = (-torch.rand(1, n, H, generator=g) * 0.1).requires_grad_()

    def forward() -> torch.Tensor:
        if layer == "gdn":
            return delta_rule_attention(q, k, v, beta, mesh=mesh, log_decay=decay, scale=D**-0.5)
        return linear_attention(q, k, v, mesh=mesh, log_decay=decay, scale=D**-0.5)

    def step() -> None:
        with mesh.comm_stats.measure() as fwd:
            out = forward()
        with mesh.comm_stats.measure() as bwd:
            out.backward(dout)
        step.fwd, step.bwd = fwd, bwd

    seconds = slowest_rank_median(step, reps)
    fwd = gather_floats(step.fwd.total_bytes)
    bwd = gather_floats(step.bwd.total_bytes)
    return {"time_s": seconds, "fwd_bytes_max": max(fwd), "bwd_bytes_max": max(bwd), "fwd_bytes": fwd}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="S in {2k, 8k}, one repetition")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--layer", choices=("linear", "gdn"), default="linear")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    lengths = (2048, 8192) if args.quick else (8192, 65536)
    reps = args.reps or (1 if args.quick else 2)
    base = SeqParMesh.build(world, 1)
    state_bytes = H * D * D * 4
    rows = []
    for mode in ("all_scan", "all_gather"):
        for seq_len in lengths:
            mesh = base.with_section(
                {
                    "size": world,
                    "ulysses_degree": 1,
                    "ring": {"layout": "contiguous"},
                    "linear": {"scan": mode, "blocks": 4},
                }
            )
            res = measure(mesh, seq_len, reps, args.layer)
            rows.append(
                {
                    "mode": mode,
                    "S": seq_len,
                    **res,
                    "states_fwd": res["fwd_bytes_max"] / state_bytes,
                    "states_bwd": res["bwd_bytes_max"] / state_bytes,
                }
            )
            if dist.get_rank() == 0:
                print({k: v for k, v in rows[-1].items() if k != "fwd_bytes"}, flush=True)
    if dist.get_rank() == 0:
        what = (
            "Gated DeltaNet (decay per token and head)"
            if args.layer == "gdn"
            else "Linear attention (scalar decay)"
        )
        title = (
            f"{what} fwd+bwd, B=1, H={H}, d_k=d_v={D}, fp32, P={world} gloo CPU ranks "
            f"(U=1, contiguous), one state = H*d_k*d_v*4 = {state_bytes} bytes"
        )
        meta = {"world": world, "state_bytes": state_bytes, "reps": reps, "layer": args.layer}
        columns = [
            ("scan", "mode", "s"),
            ("S", "S", "d"),
            ("time (s)", "time_s", ".2f"),
            ("max bytes/rank fwd", "fwd_bytes_max", ".0f"),
            ("= states", "states_fwd", ".2f"),
            ("max bytes/rank bwd", "bwd_bytes_max", ".0f"),
            ("= states", "states_bwd", ".2f"),
        ]
        name = "delta_cpu" if args.layer == "gdn" else "linear_cpu"
        print(save_results(f"{name}_quick" if args.quick else name, title, meta, rows, columns))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
