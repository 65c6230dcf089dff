"""Image blocks (Gemma 3's bidirectional image tokens) on CPU gloo ranks: fwd+bwd time of ``ds_seqpar.attention``.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 -m benchmarks.bench_image_blocks

Default: S = 8192, H = H_kv = 8, D = 64, causal, fp32, B = 1, ring over all ranks (zigzag), with and without a
sliding window of 1024; rows: text only (``blocks=None``), 8 images of 256 tokens (Gemma 3's image size), one
block of 2048 tokens; each with the engine's tile edge for long pairs with image blocks
(``parallel/ring/tasks.py`` ``IMAGE_BLOCK_TILE``) at 512, 1024 and untiled (one mask per segment pair).
Prints a markdown table on rank 0 and saves ``benchmarks/results/image_blocks_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import ds_seqpar
from benchmarks.common import save_results, slowest_rank_median
from ds_seqpar import SeqParMesh
from ds_seqpar.parallel.ring import tasks as ring_tasks


def _blocks(name: str, seq_len: int) -> torch.Tensor | None:
    """Block ids ``[S]`` of a row: None, 8 images of 256 tokens spread over the row, or one long block."""
    if name == "text only":
        return None
    ids = torch.full((seq_len,), -1, dtype=torch.int64)
    if name == "one block of 2048":
        start = seq_len // 2 - 1000  # across the middle of the row
        ids[start : start + 2048] = 0
        return ids
    for i in range(8):
        start = 100 + i * (seq_len // 8)
        ids[start : start + 256] = i
    return ids


def measure(
    mesh: SeqParMesh, seq_len: int, window: int | None, blocks: torch.Tensor | None, reps: int
) -> float:
    """Median fwd+bwd seconds (slowest rank) of one attention call on this rank's zigzag shard."""
    n, h, d = seq_len // mesh.sp_size, 8, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, d, generator=g) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> None:
        ds_seqpar.attention(*leaves, mesh=mesh, causal=True, window=window, blocks=blocks).backward(dout)

    return slowest_rank_median(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": 1, "ring": {"layout": "zigzag"}})
    rows, default_tile = [], ring_tasks.IMAGE_BLOCK_TILE
    for window in (None, 1024):
        for name in ("text only", "8 images of 256", "one block of 2048"):
            blocks = _blocks(name, args.seq_len)
            for tile in (None,) if blocks is None else (512, 1024, 10**9):
                ring_tasks.IMAGE_BLOCK_TILE = tile or default_tile
                fresh = None if blocks is None else blocks.clone()  # a new tensor: the plan is built anew
                t = measure(mesh, args.seq_len, window, fresh, args.reps)
                label = "-" if tile is None else ("untiled" if tile == 10**9 else str(tile))
                rows.append({"window": str(window), "row": name, "tile": label, "time_s": t})
    if dist.get_rank() == 0:
        for r in rows:
            base = next(x["time_s"] for x in rows if x["window"] == r["window"] and x["row"] == "text only")
            r["vs_text"] = r["time_s"] / base
        table = save_results(
            "image_blocks_cpu",
            f"# Image blocks, fwd+bwd, S={args.seq_len}, H=8, D=64, fp32, ring of {world} CPU ranks "
            f"(zigzag, median of {args.reps})",
            {"seq_len": args.seq_len, "world": world, "reps": args.reps},
            rows,
            [
                ("window", "window", "s"),
                ("row", "row", "s"),
                ("IMAGE_BLOCK_TILE", "tile", "s"),
                ("time (s)", "time_s", ".3f"),
                ("x text only", "vs_text", ".2f"),
            ],
        )
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
