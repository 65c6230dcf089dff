"""The sparse attention's fp64 ground truth: dense single-process attention under the pattern's token mask.

Effective mask (True = the key is attended):
    M[b, h, i, j] = causal(i >= j) and (slash[b, h, i//G - j//G] or vertical[b, h, j])
                    and the window / document rules of ``MaskSpec`` and ``doc_ids``.
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.sparse.pattern import SparsePattern

__all__ = ["sparse_attention_reference"]

CAUSAL = MaskSpec()


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: SparsePattern,
    scale: float | None = None,
    spec: MaskSpec = CAUSAL,
    doc_ids: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense single-process attention under the pattern's token mask (ground truth; autograd).

    Args:
        q: ``[B, S, H, D]``; k, v: ``[B, S, H_kv, D]`` in global order; doc_ids ``[S]`` / ``[B, S]``.
        softcap, sinks: as in ``ops/attention/reference.dense_attention_reference``.

    Returns:
        ``(out [B, S, H, D], lse [B, H, S])`` in the input dtype.
    """
    s = q.shape[1]
    pos = torch.arange(s, device=q.device)
    mask = pattern.visible(pos, pos).expand(q.shape[0], -1, -1, -1)
    base = (
        token_mask(pos, pos, spec)
        if doc_ids is None
        else token_mask(pos.expand(doc_ids.shape), pos.expand(doc_ids.shape), spec, doc_ids, doc_ids)
    )
    base = base if base.dim() == 3 else base[None]
    return dense_attention_reference(q, k, v, mask & base[:, None], scale, softcap, sinks)
