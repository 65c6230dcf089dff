"""Work and balance of a non-causal ``BlockPattern`` over ring ranks (docs/dit_sparse.md "ρ_s").

The non-causal form of docs/sparse.md's ρ_s: a kept block pair (i, j) costs G² score pairs (every pair of
the two blocks is computed), whoever holds its query block computes it at the ring step where the key
block's owner's K/V arrives.
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.sparse.block_pattern import BlockPattern

__all__ = ["dit_block_work", "dit_row_work"]


def dit_block_work(pattern: BlockPattern, owner: torch.Tensor, world: int) -> torch.Tensor:
    """Score pairs per head and (query rank, key rank) ``[H, world, world]`` (fp64, summed over rows).

    Args:
        owner: ``[nB]`` ring rank holding each block of G tokens.
    """
    g = float(pattern.block_size)
    onehot = torch.nn.functional.one_hot(owner.long().cpu(), world).to(torch.float64)  # [nB, R]
    kept = pattern.mask.cpu().to(torch.float64).sum(0)  # [H, nB, nB]
    return torch.einsum("hij,ir,js->hrs", kept, onehot, onehot) * (g * g)


def dit_row_work(pattern: BlockPattern) -> torch.Tensor:
    """Score pairs of the queries of each block, summed over rows and heads: ``[nB]`` (fp64)."""
    g = float(pattern.block_size)
    return pattern.mask.cpu().to(torch.float64).sum((0, 1, 3)) * (g * g)
