"""The diagonal (per-channel) linear recurrence on one contiguous piece, and its All-Scan split (docs/delta.md).

Legend: B batch, S tokens of the piece, C channels; x, a ``[B, S, C]``; a state ``[B, C]``.

    h_t = a_t ⊙ h_{t-1} + x_t            (inclusive: the output of token t is h_t)
    out_t = h_{t-1}                       (exclusive: the state before token t, RWKV's WKV)

``a_t`` in [0, 1]; a_t = 0 resets the state (RG-LRU at position 0). With E the state entering the
piece and P_t = a_1 ⋯ a_t (P_0 = 1 for the exclusive form), the whole-sequence value of a token is

    h_t = h^loc_t + P_t ⊙ E,   leaving state = h^loc_end + P_end ⊙ E

with h^loc from a zero entering state: the distributed part only passes E from piece to piece
(``parallel/diagonal_scan.py``). The token loop runs in the acc dtype (``ops/precision.py``), as
HF's RG-LRU scan does; products P are cumulative products, so a reset gives exact zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["DiagonalPiece", "diagonal_local_scan", "diagonal_reference"]


class DiagonalPiece(NamedTuple):
    """One piece from a zero entering state, in the acc dtype: ``out [B, S, C]`` (h^loc, inclusive or
    exclusive), ``carry [B, S, C]`` (P_t of the same form), ``state [B, C]`` (h^loc_end), ``gamma [B, C]``
    (P_end, the piece's transition)."""

    out: torch.Tensor
    carry: torch.Tensor
    state: torch.Tensor
    gamma: torch.Tensor


def _check(x: torch.Tensor, a: torch.Tensor) -> None:
    if x.dim() != 3 or a.shape != x.shape:
        raise ValueError(
            f"a diagonal recurrence takes x, a [B, S, C] of one shape; got {tuple(x.shape)}, {tuple(a.shape)}"
        )


def diagonal_local_scan(x: torch.Tensor, a: torch.Tensor, exclusive: bool = False) -> DiagonalPiece:
    """The recurrence of a piece ``x, a [B, S, C]`` from a zero state (differentiable), in the acc dtype."""
    _check(x, a)
    acc = accumulation_dtype(x.dtype)
    x, a = x.to(acc), a.to(acc)
    h = x.new_zeros(x.shape[0], x.shape[2])
    outs = []
    for t in range(x.shape[1]):
        if exclusive:
            outs.append(h)
        h = a[:, t] * h + x[:, t]
        if not exclusive:
            outs.append(h)
    out = torch.stack(outs, dim=1) if outs else x.new_zeros(x.shape)
    inclusive = torch.cumprod(a, dim=1)
    gamma = inclusive[:, -1] if x.shape[1] else x.new_ones(x.shape[0], x.shape[2])
    carry = torch.cat([torch.ones_like(a[:, :1]), inclusive[:, :-1]], dim=1) if exclusive else inclusive
    return DiagonalPiece(out, carry, h, gamma)


def diagonal_reference(
    x: torch.Tensor, a: torch.Tensor, exclusive: bool = False, initial: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole-sequence recurrence token by token (the ground truth), ``[B, S, C]`` in the acc dtype."""
    piece = diagonal_local_scan(x, a, exclusive)
    if initial is None:
        return piece.out
    return piece.out + piece.carry * initial.to(piece.out.dtype)[:, None]
