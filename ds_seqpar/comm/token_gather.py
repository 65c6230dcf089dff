"""All-gather of every rank's tokens over a group, differentiable: the forward is one all-gather, the backward
one reduce-scatter (sum) of the gradients (docs/dsa.md "Bytes").

Legend: P = ranks of the group, n = tokens per rank, any trailing dims.

``gather_tokens(x [B, n, ...], team, grad=True) -> [B, P·n, ...]``: the members' tokens concatenated in
member order. With ``grad=True`` the gradient of the result ``[B, P·n, ...]`` is summed over the members
and each gets its own rows back; with ``grad=False`` the result carries no gradient (no backward
message). Bytes recorded per peer through the ``TeamComm``: ``all_gather`` B·n·(trailing)·itemsize to
each of the P-1 others; in backward, ``reduce_scatter`` the same amount.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.team import TeamComm

__all__ = ["gather_tokens"]


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, team: TeamComm) -> torch.Tensor:
        ctx.team = team
        return team.gather(x.contiguous(), dim=1)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.team.reduce_rows(grad.contiguous(), dim=1)[0], None


def gather_tokens(x: torch.Tensor, team: TeamComm, grad: bool = True) -> torch.Tensor:
    """Every member's ``x [B, n, ...]`` along dim 1 in member order: ``[B, P·n, ...]`` (see the module)."""
    if not grad:
        with torch.no_grad():
            return team.gather(x.detach().contiguous(), dim=1)[0]
    return _GatherTokens.apply(x, team)
