"""Dense single-device attention: the ground truth every kernel and distributed algorithm is tested against.

Legend:
    B, Sq, Sk  batch, query tokens, key tokens
    H, H_kv    query heads, key/value heads (GQA: query head h uses kv head h // (H // H_kv))
    D          head dim

Materialises the full ``[B, H, Sq, Sk]`` score matrix: O(S²) memory, meant for tests (fp64).
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.contract import Alibi

__all__ = ["dense_attention_reference"]


def dense_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention, differentiable by autograd, computed in the input dtype.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, H_kv, D]``.
        mask: None (all visible) or bool ``[Sq, Sk]`` / ``[B, Sq, Sk]`` / per head ``[B, H, Sq, Sk]``,
            True = visible.
        scale: softmax scale, default ``D ** -0.5``.
        softcap: None, or c > 0: scores become ``c · tanh(score / c)`` (Gemma 2).
        sinks: None, or ``[H]`` attention-sink logits (gpt-oss ``s_aux``): one extra logit per head
            in every row's softmax denominator, attached to a zero value vector.
        alibi: None, or an ``Alibi``: score (i, j) of head h gains ``slopes[h] · (k_pos[j] - q_pos[i])``
            (after the softcap).

    Returns:
        ``(out [B, Sq, H, D], lse [B, H, Sq])``; lse includes the sink. A row that sees no key has
        out 0 and lse -inf (the sink's logit with sinks); its gradients are 0, not NaN.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    k_h = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, Sk, D]
    v_h = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = scale * q.transpose(1, 2) @ k_h.transpose(-1, -2)  # [B, H, Sq, Sk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        scores = scores + alibi.bias(0, q.shape[1], 0, k.shape[1], scores.dtype)
    visible = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask
    per_row = visible if visible.dim() != 2 else visible.unsqueeze(0)
    visible = per_row if per_row.dim() == 4 else per_row.unsqueeze(1)  # [B|1, H|1, Sq, Sk]
    empty_row = ~visible.any(dim=-1, keepdim=True)
    # Empty rows get finite dummy scores so softmax/logsumexp stay NaN-free; their p is zeroed below.
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(empty_row, 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    lse = lse.masked_fill(empty_row.squeeze(-1), float("-inf"))
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse))
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    p = torch.exp(scores - safe.unsqueeze(-1)).masked_fill(~visible, 0.0)
    return (p @ v_h).transpose(1, 2), lse
