"""Work and balance of a sparse pattern over a layout's ranks (db-SP's ρ_s, docs/sparse.md "Balancing and ρ_s")."""

from __future__ import annotations

import itertools

import torch

from ds_seqpar.ops.sparse.pattern import SparsePattern

__all__ = ["block_row_work", "block_work", "imbalance_ratio"]


def block_work(pattern: SparsePattern, owner: torch.Tensor, world: int) -> torch.Tensor:
    """Score pairs the sparse kernel computes per head and (query rank, key rank): ``[H, world, world]``.

    Args:
        owner: ``[nB]`` rank that holds each block of G tokens (from the layout).
        world: ring ranks. Summed over batch rows; a chosen block counts G² (the diagonal block
            G(G+1)/2), a bar column G per query tile: exactly what the kernel computes.
    """
    g, nb = pattern.block_size, pattern.slash.shape[-1]
    owner = owner.to(pattern.slash.device)
    blocks = torch.arange(nb, device=owner.device)
    work = torch.zeros(pattern.num_heads, world * world, dtype=torch.float64, device=owner.device)
    for h in range(pattern.num_heads):
        for bi in range(pattern.batch):
            for d in pattern.slash[bi, h].nonzero().squeeze(1).tolist():
                a = blocks[d:]
                work[h].index_add_(
                    0,
                    owner[a] * world + owner[a - d],
                    torch.full(
                        a.shape,
                        float(g * g if d else g * (g + 1) // 2),
                        dtype=torch.float64,
                        device=owner.device,
                    ),
                )
            cols = pattern.vertical[bi, h].nonzero().squeeze(1) // g  # block of each bar column
            later = blocks[None, :] - cols[:, None]  # [nbar, nB] query block - column block
            bar = (later > 0) & ~pattern.slash[bi, h][later.clamp(min=0)]
            col_i, q_blk = bar.nonzero(as_tuple=True)
            work[h].index_add_(
                0,
                owner[q_blk] * world + owner[cols[col_i]],
                torch.full(q_blk.shape, float(g), dtype=torch.float64, device=owner.device),
            )
    return work.view(pattern.num_heads, world, world)


def block_row_work(pattern: SparsePattern) -> torch.Tensor:
    """Score pairs the kernel computes for the queries of each block, summed over rows and heads: ``[nB]``."""
    g, nb = pattern.block_size, pattern.slash.shape[-1]
    blocks = torch.arange(nb, device=pattern.slash.device)
    work = torch.zeros(nb, dtype=torch.float64, device=pattern.slash.device)
    for bi, h in itertools.product(range(pattern.batch), range(pattern.num_heads)):
        for d in pattern.slash[bi, h].nonzero().squeeze(1).tolist():
            work[d:] += float(g * g if d else g * (g + 1) // 2)
        cols = pattern.vertical[bi, h].nonzero().squeeze(1) // g
        later = blocks[None, :] - cols[:, None]
        work += ((later > 0) & ~pattern.slash[bi, h][later.clamp(min=0)]).sum(0) * float(g)
    return work


def imbalance_ratio(work: torch.Tensor, head_groups: list[list[int]]) -> float:
    """db-SP ρ_s of a ``[H, R, R]`` work matrix with the heads split into Ulysses groups.

    ρ_s = max_k Σ_t max_i w[k, i, (i - t) mod R] / (Σ w / (U·R)): each ring step lasts as long as its
    slowest rank; 1.0 = perfect balance.
    """
    r = work.shape[-1]
    groups = torch.stack([work[g].sum(0) for g in head_groups])  # [U, R, R]
    ranks = torch.arange(r)
    steps = torch.stack([groups[:, ranks, (ranks - t) % r].amax(dim=-1) for t in range(r)], dim=-1)
    ideal = float(work.sum()) / (len(head_groups) * r)
    return float(steps.sum(-1).max()) / ideal if ideal > 0 else 1.0
