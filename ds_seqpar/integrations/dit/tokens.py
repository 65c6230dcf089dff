"""A diffusion transformer's token streams cut into SP pieces and put back (docs/dit.md "Token streams").

Legend: P = SP ranks, r = this rank, L = a stream's tokens, L_pad = L rounded up to a multiple of P,
n = L_pad / P tokens per rank. A stream whose L does not divide P is padded at its end; the padding tokens are
excluded as keys (document id -1) and cut away when the stream is gathered.

``take_piece(x, dim, r, P)``: rank r's n tokens of ``x`` (no communication; the backward puts the gradient
back at those tokens, zeros elsewhere). ``gather_pieces(x, dim, team, L)``: every rank's piece concatenated,
padding cut: one all-gather of ``x`` (B·n·C elements to each of the P-1 others); its backward takes this
rank's piece of the gradient, no communication — the model after the gather is replicated on every rank
(the same loss everywhere), so the gradient of the gathered tensor is already whole on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.comm.team import TeamComm

__all__ = ["StreamCuts", "gather_pieces", "take_piece"]


def _padded(length: int, parts: int) -> int:
    return -(-length // parts) * parts


class _TakePiece(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
        length = x.shape[dim]
        n = _padded(length, parts) // parts
        ctx.dim, ctx.length, ctx.start, ctx.n = dim, length, rank * n, n
        stop = min(length, rank * n + n)
        piece = x.narrow(dim, min(rank * n, length), max(0, stop - rank * n))
        if piece.shape[dim] < n:  # the stream's padding
            pad = list(x.shape)
            pad[dim] = n - piece.shape[dim]
            piece = torch.cat([piece, x.new_zeros(pad)], dim=dim)
        return piece.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.length
        full = grad.new_zeros(shape)
        real = max(0, min(ctx.n, ctx.length - ctx.start))
        if real:
            full.narrow(ctx.dim, ctx.start, real).copy_(grad.narrow(ctx.dim, 0, real))
        return full, None, None, None


def take_piece(x: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``x`` along ``dim`` (``[.., n, ..]``, zero-padded at the stream's end)."""
    dim = dim % x.dim()
    if x.is_floating_point() and x.requires_grad:
        return _TakePiece.apply(x, dim, rank, parts)
    with torch.no_grad():
        return _TakePiece.forward(_Ctx(), x, dim, rank, parts)


class _Ctx:
    """Stand-in for autograd's ctx when a piece is taken without a graph."""


class _GatherPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, team: TeamComm, length: int) -> torch.Tensor:
        ctx.dim, ctx.index, ctx.n = dim, team.index, x.shape[dim]
        moved = x.movedim(dim, 1).contiguous()
        (whole,) = team.gather(moved, dim=1)
        return whole.narrow(1, 0, length).movedim(1, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        start, n = ctx.index * ctx.n, ctx.n
        real = max(0, min(n, grad.shape[ctx.dim] - start))
        piece = grad.narrow(ctx.dim, min(start, grad.shape[ctx.dim]), real)
        if real < n:
            pad = list(grad.shape)
            pad[ctx.dim] = n - real
            piece = torch.cat([piece, grad.new_zeros(pad)], dim=ctx.dim)
        return piece.contiguous(), None, None, None


def gather_pieces(x: torch.Tensor, dim: int, team: TeamComm, length: int) -> torch.Tensor:
    """Every rank's piece of a stream concatenated along ``dim`` and cut to the stream's ``length``."""
    return _GatherPieces.apply(x, dim % x.dim(), team, length)


@dataclass
class StreamCuts:
    """The streams split during one forward of the transformer: name -> whole length L (same on every rank)."""

    parts: int
    lengths: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, length: int) -> None:
        self.lengths[name] = length

    def local(self, name: str) -> int:
        return _padded(self.lengths[name], self.parts) // self.parts

    def padded(self) -> bool:
        return any(length % self.parts for length in self.lengths.values())

    def whole_length(self, padded_length: int) -> int:
        """L of the stream whose padded length is ``padded_length`` (a gather cuts its padding)."""
        found = {L for L in self.lengths.values() if _padded(L, self.parts) == padded_length}
        if len(found) > 1:
            raise ValueError(
                f"two split streams pad to {padded_length} tokens with different lengths {sorted(found)}; the "
                "gather cannot tell which one it holds: choose lengths that divide the SP size"
            )
        return found.pop() if found else padded_length

    def real_mask(self, order: tuple[str, ...], rank: int) -> torch.Tensor:
        """Bool ``[n]``: which of rank ``rank``'s tokens of the joint sequence ``cat(order)`` are real."""
        pieces = []
        for name in order:
            n, length = self.local(name), self.lengths[name]
            pieces.append(torch.arange(rank * n, rank * n + n) < length)
        return torch.cat(pieces)
