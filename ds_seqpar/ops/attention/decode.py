"""Attention of a few new query tokens over one rank's part of a KV cache (decoding; docs/inference.md).

Legend: B batch, m new query tokens (decoding: 1), H / H_kv query / key-value heads (query head h uses
kv head h // (H / H_kv)), n cached keys on this rank, D / D_v query-key / value head dims.

``partial_attention`` returns the normalised output and the log-sum-exp of the scores over the keys it
was given, so the parts of several ranks merge exactly (``ops/merge.py``). Keys are grouped per kv head:
the cache is never repeated to the query heads. Everything is computed in float32 (float64 stays).
"""

from __future__ import annotations

import torch

__all__ = ["partial_attention"]


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of every query over every given key (no causal mask: all keys precede the queries).

    Args:
        q: ``[B, H, m, D]``; k: ``[B, H_kv, n, D]``; v: ``[B, H_kv, n, D_v]`` (HF layout).
        scale: softmax scale.
        key_mask: None, or bool ``[B, n]`` (True = visible), e.g. the keys of the queries' document.
        softcap: None, or c > 0: scores become ``c · tanh(score / c)`` (Gemma 2).

    Returns:
        ``(out [B, m, H, D_v], lse [B, H, m])`` in float32 (float64 for float64 inputs); a query that sees no
        key (n = 0 or all masked) has out 0 and lse -inf.
    """
    b, h, m, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    if h % h_kv or k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d:
        raise ValueError(
            f"partial_attention takes q [B, H, m, D], k [B, H_kv, n, D], v [B, H_kv, n, D_v] with H a multiple of "
            f"H_kv; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if n == 0:
        out = q.new_zeros(b, m, h, v.shape[-1], dtype=acc)
        return out, q.new_full((b, h, m), float("-inf"), dtype=acc)
    group = h // h_kv
    qg = q.to(acc).reshape(b, h_kv, group * m, d)
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale  # [B, H_kv, g·m, n]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H_kv, g·m]
    empty = lse == float("-inf")
    weights = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    out = torch.matmul(weights, v.to(acc))  # [B, H_kv, g·m, D_v]
    out = out.reshape(b, h, m, -1).transpose(1, 2)
    return out, lse.reshape(b, h, m)
