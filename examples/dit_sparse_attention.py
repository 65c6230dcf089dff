"""Block-sparse DiT attention over the SP group, checked against the single-process reference.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/dit_sparse_attention.py

Every rank builds the same q, k, v of the shipped ``image`` pattern's size (S = 4096, H = 8, D = 64), keeps its
shard (``ds_seqpar.input_layout``), runs ``ds_seqpar.block_sparse_attention`` twice (the shipped pattern; the
pattern estimated from q, k) with db-SP balancing at U x R = 2 x 2, and rank 0 prints ρ_s and the largest
error of out and dq against ``block_sparse_reference`` (docs/dit_sparse.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.ops.sparse.block_pattern import BlockBudget, block_sparse_reference, estimate_block_pattern
from ds_seqpar.ops.sparse.dit_patterns import load_shipped


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = ds_seqpar.SeqParMesh.build(world, 2 if world % 2 == 0 else 1)
    shipped = load_shipped("image")
    s, g = shipped.seq_len, shipped.block_size
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, 8, 64, generator=gen) for _ in range(4))
    layout, me = ds_seqpar.input_layout(mesh), mesh.coords.sp_rank
    pos = torch.arange(s)
    estimated = estimate_block_pattern(q, k, pos, s, BlockBudget(g, keep=0.2))  # what the call estimates
    for label, pattern, given in (("shipped", shipped, shipped), ("estimated", estimated, None)):
        settings = ds_seqpar.DitSparseSettings(block_size=g, keep=0.2, balancing="dbsp")
        ql = layout.shard(q, me).requires_grad_()
        out = ds_seqpar.block_sparse_attention(
            ql, layout.shard(k, me), layout.shard(v, me), mesh=mesh, pattern=given, budget=settings, layer=0
        )
        out.backward(layout.shard(dout, me))
        q64 = q.double().requires_grad_()
        ref, _ = block_sparse_reference(q64, k.double(), v.double(), pattern)
        ref.backward(dout.double())
        err = max((out.double() - layout.shard(ref.detach(), me)).abs().max().item(),
                  (ql.grad.double() - layout.shard(q64.grad, me)).abs().max().item())  # fmt: skip
        errs = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(errs, torch.tensor([err]))
        stats = ds_seqpar.dit_sparse_stats(mesh)[0]
        if me == 0:
            print(f"{label}: density {stats.density:.4f}, rho_s {stats.rho_s:.3f}, U x R {stats.degrees}, "
                  f"max error of out and dq {max(e.item() for e in errs):.2e}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
