"""The block-attention kernel contract (docs/kernels.md "Contract") and the kernel object type.

Legend:
    B, Sq, Sk  batch, query tokens, key tokens of this block
    H, H_kv    query heads, key/value heads; g = H // H_kv (GQA: query head h uses kv head h // g)
    D          head dim
    acc dtype  float64 for float64 inputs, else float32 (``ops/precision.py``): outputs, lse and gradients
               use it so that ring merges and gradient sums stay exact

Contract:
    forward   (q, k, v, mask) -> out [B, Sq, H, D] (acc), lse [B, H, Sq] (acc);
              a row that sees no key gets out 0, lse -inf
    backward  (dout, q, k, v, out, lse, mask) -> dq [B, Sq, H, D], dk, dv [B, Sk, H_kv, D] (acc),
              where out / lse are the FINAL (merged over all key blocks) results of these rows,
              so blocks contribute independently; rows with lse = -inf contribute nothing
    mask      None (all visible), ``causal=True`` (top-left: key j visible iff j <= i), or bool
              [Sq, Sk] / [B, Sq, Sk], True = visible
    softcap   None, or c > 0: every score s = scale · q·k becomes c · tanh(s / c) before the softmax
              (Gemma 2 attention logit soft-capping); lse is that of the capped scores, and the
              backward multiplies the score gradient by 1 - tanh²(s / c)
    alibi     None, or an ``Alibi``: score (i, j) of head h gains slopes[h] · (k_pos[j] - q_pos[i]) from the
              tokens' GLOBAL positions (after the softcap); a constant, so the backward is unchanged but
              for recomputing the biased scores (docs/kernels.md "ALiBi")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Alibi", "AttentionKernel", "BackwardFn", "Band", "ForwardFn", "Varlen"]

# forward(q, k, v, scale, mask, causal, softcap) -> (out, lse); mask is None or bool [B|1, Sq, Sk];
# softcap is None or c > 0 (only passed to kernels with ``softcap=True``); kernels with ``alibi=True``
# also take ``alibi=Alibi(...)`` as a keyword (never passed when None, nor to other kernels)
ForwardFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None, bool, float | None],
    tuple[torch.Tensor, torch.Tensor],
]
# backward(dout, q, k, v, out, lse, scale, mask, causal, softcap) -> (dq, dk, dv); lse finite here
BackwardFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        torch.Tensor | None,
        bool,
        float | None,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


@dataclass(frozen=True)
class AttentionKernel:
    """One exact block-attention backend.

    ``forward`` / ``backward`` receive validated inputs (Sq, Sk >= 1; mask bool ``[B|1, Sq, Sk]``;
    backward gets lse with -inf rows replaced by 0 and their dout zeroed). ``unavailable`` returns
    why the kernel cannot run for ``(device, dtype)``, or None when it can. ``softcap``: whether the
    kernel applies score soft-capping (kernels without it always receive ``softcap=None``). ``alibi``:
    whether ``forward`` / ``backward`` take the keyword ``alibi`` (an :class:`Alibi`, never None).
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    unavailable: Callable[[torch.device, torch.dtype], str | None]
    softcap: bool = False
    varlen: Varlen | None = None
    band: Band | None = None
    summary: str = ""
    alibi: bool = False  # last: positional construction of the fields above stays as it was


@dataclass(frozen=True)
class Band:
    """A kernel's sliding-window mode: blocks whose mask is a diagonal band, run without a mask.

    ``forward(q, k, v, scale, band, softcap) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, scale,
    band, softcap) -> (dq, dk, dv)`` (FINAL out / lse, finite), shapes as in the block contract; ``band``
    = ``(left, right)`` >= 0: key j visible to query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right
    (flash-attn's ``window_size``); ``takes(q)``: whether these inputs fit.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    takes: Callable[[torch.Tensor], bool]


@dataclass(frozen=True)
class Varlen:
    """A kernel's packed-sequence entry points (flash-attn's varlen functions).

    ``forward(q [T, H, D], k, v [Tk, H_kv, D], cu_q, cu_k [n + 1] int32, max_q, max_k, scale, causal,
    softcap) -> (out [T, H, D], lse [H, T] fp32)``; ``backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
    max_k, scale, causal, softcap) -> (dq, dk, dv)`` given the FINAL out / lse; ``takes(q)``: whether
    these inputs fit (else the engine calls ``forward`` per sequence).
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    takes: Callable[[torch.Tensor], bool]


@dataclass(frozen=True)
class Alibi:
    """The ALiBi bias of one block: score (i, j) of query head h gains ``slopes[h] · (k_pos[j] - q_pos[i])``.

    ``slopes`` [H] float (per QUERY head); ``q_pos`` [Sq] / [B, Sq] and ``k_pos`` [Sk] / [B, Sk] integer
    GLOBAL token positions. Families that add ``slopes[h] · j`` (BLOOM, MPT) get the same softmax: the
    difference is ``slopes[h] · i``, constant along a row (docs/kernels.md "ALiBi").
    """

    slopes: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    def bias(self, qs: int, qe: int, ks: int, ke: int, dtype: torch.dtype) -> torch.Tensor:
        """The bias of query rows [qs, qe) x keys [ks, ke): ``[B|1, H, qe - qs, ke - ks]`` in ``dtype``
        (distances taken in int64, then converted: exact for any position below 2**24 in fp32)."""
        dist = self.k_pos[..., ks:ke].long().unsqueeze(-2) - self.q_pos[..., qs:qe].long().unsqueeze(-1)
        dist = dist.to(dtype)
        if dist.dim() == 2:
            dist = dist.unsqueeze(0)
        return self.slopes.to(dtype).view(1, -1, 1, 1) * dist.unsqueeze(1)

    def rows(self, q_rows: slice, k_rows: slice) -> Alibi:
        """The bias of a sub-block (query rows ``q_rows`` x keys ``k_rows``)."""
        return Alibi(self.slopes, self.q_pos[..., q_rows], self.k_pos[..., k_rows])
