"""Top-k selected-key attention (DeepSeek sparse attention, DSA): the indexer's scores, the top-k per query,
and softmax attention of each query over its selected keys (docs/dsa.md).

Legend: B batch, n query rows (this rank's tokens, any layout), S keys (the whole sequence in global
order, positions 0..S-1), H / D heads and head dim of the attention (D_v of the values), H_i / D_i heads
and head dim of the indexer, K = min(topk, S) selected keys per query.

    indexer_scores(q [B, n, H_i, D_i], k [B, S, D_i], w [B, n, H_i], scale) -> [B, n, S] fp32
        score[b, s, t] = sum_h w[b, s, h] * relu(scale * q[b, s, h] . k[b, t])
    select_topk(scores [B, n, S], visible [B|1, n, S], topk) -> [B, n, K] key positions
    topk_attention(q [B, n, H, D], k [B, S, H, D], v [B, S, H, D_v], idx, visible, scale) -> [B, n, H, D_v]
    topk_attention_reference(...)  the same attention, dense over S under the selected-and-visible mask

The scores are computed with the same operations and shapes per query row as transformers' DSA indexer
(one matmul per query row over all S keys, then the head-weighted sum), so a rank that holds any subset of
the queries gets the bit-identical scores, hence the same top-k set, as one process (docs/dsa.md
"Exactness"). ``topk_attention`` gathers the K selected keys per query in chunks of queries, so its
memory is O(n * K * H * D), never [n, S] per head.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Index scores ``[B, n, S]`` (fp32) of queries ``q [B, n, H_i, D_i]`` over keys ``k [B, S, D_i]`` (one
    key head), head weights ``weights [B, n, H_i]`` (fp32, already scaled)."""
    per_head = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale  # [B, n, H_i, S]
    per_head = torch.relu(per_head)
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``min(topk, S)`` key positions ``[B, n, K]`` of the highest scores among the visible keys
    (``visible [B|1, n, S]`` bool); invisible keys score -inf (selected only when fewer than K are
    visible, and masked again by the attention)."""
    masked = scores.masked_fill(~visible, float("-inf"))
    return masked.topk(min(topk, scores.shape[-1]), dim=-1).indices


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    chunk: int = 256,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q [B, n, H, D]`` over the keys ``idx [B, n, K]`` of ``k [B, S, H, D]`` /
    ``v [B, S, H, D_v]`` that are also ``visible [B|1, n, S]``; a row with no such key gives 0. ``sinks [H]``:
    one extra logit per head in the softmax denominator (no value). Differentiable (autograd); chunks of
    ``chunk`` queries keep memory O(n * K * H * D)."""
    b, n = q.shape[:2]
    visible = visible.expand(b, -1, -1)
    rows = torch.arange(b, device=q.device).view(b, 1, 1)
    outs = []
    for start in range(0, n, chunk):
        sel = idx[:, start : start + chunk].long()  # [B, c, K]
        k_sel, v_sel = k[rows, sel], v[rows, sel]  # [B, c, K, H, D]
        logits = torch.einsum("bchd,bckhd->bchk", q[:, start : start + chunk], k_sel) * scale
        valid = visible[:, start : start + chunk].gather(-1, sel).unsqueeze(2)  # [B, c, 1, K]
        probs = _softmax(logits.masked_fill(~valid, torch.finfo(logits.dtype).min), sinks) * valid
        outs.append(torch.einsum("bchk,bckhd->bchd", probs, v_sel))
    return torch.cat(outs, dim=1)


def _softmax(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``logits [B, c, H, K]``, with one sink logit per head ``sinks [H]``."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.to(logits.dtype).view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def selected_mask(idx: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[B, n, S]`` bool: key selected by ``idx [B, n, K]`` and visible."""
    b, n = idx.shape[:2]
    chosen = torch.zeros(b, n, visible.shape[-1], dtype=torch.bool, device=idx.device)
    return chosen.scatter(-1, idx.long(), True) & visible.expand(b, -1, -1)


def topk_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense ground truth of :func:`topk_attention`: ``[B, H, n, S]`` logits under the selected-and-visible
    mask (and a sink column per head), softmax, times V; rows with no key give 0."""
    mask = selected_mask(idx, visible).unsqueeze(1)  # [B, 1, n, S]
    logits = torch.einsum("bnhd,bshd->bhns", q, k) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)[..., : k.shape[1]] * mask.any(-1, keepdim=True)
    return torch.einsum("bhns,bshd->bnhd", probs, v)
