"""All-gather of rows whose count differs per rank, differentiable (the vision tower's items, docs/multimodal.md).

Legend: P = ranks of the group, m_r = rows of rank r, M = sum of m_r, any trailing dims.

``gather_rows(x [m_r, ...], counts, team) -> [M, ...]``: every member's rows concatenated in member order.
Forward: one all-gather of the rows padded to max(m_r). Backward: the gradient ``[M, ...]`` of every member is
summed (one all-reduce) and each member keeps its own rows. Bytes recorded per peer through the ``TeamComm``:
``all_gather`` max(m_r)·(trailing)·itemsize to each of the P-1 others; in backward ``all_reduce`` of M rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.team import TeamComm

__all__ = ["gather_rows"]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: tuple[int, ...], team: TeamComm) -> torch.Tensor:
        ctx.counts, ctx.team = counts, team
        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        (stacked,) = team.gather(padded.unsqueeze(0).contiguous(), dim=0)  # [P, width, ...]
        return torch.cat([stacked[r, :c] for r, c in enumerate(counts)], dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        team, counts = ctx.team, ctx.counts
        grad = grad.contiguous().clone()
        if team.size > 1:
            dist.all_reduce(grad, group=team.group)
            team._record("all_reduce", grad.numel() * grad.element_size())
        start = sum(counts[: team.index])
        return grad[start : start + counts[team.index]], None, None


def gather_rows(x: torch.Tensor, counts: Sequence[int], team: TeamComm) -> torch.Tensor:
    """Every member's ``x [m_r, ...]`` (``counts[r] = m_r``, the same list on every member) concatenated along
    dim 0 in member order: ``[M, ...]``; gradients flow back to each member's own rows (see the module)."""
    counts = tuple(int(c) for c in counts)
    if len(counts) != team.size or x.shape[0] != counts[team.index]:
        raise ValueError(
            f"gather_rows: this member holds {x.shape[0]} rows but counts={list(counts)} (member {team.index} "
            f"of {team.size}); every member must pass the same counts, one per member"
        )
    if team.size == 1:
        return x
    return _GatherRows.apply(x, counts, team)
