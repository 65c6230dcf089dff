"""Decoding attention over a KV cache split across the SP group (docs/inference.md "Decoding").

Legend: P SP ranks, B batch, m new query tokens (1 when decoding), H query heads, D_v value head dim.

Every rank holds the same queries and its own part of the cache. Each computes the partial (out, lse) of
the queries over its keys (``ops/attention/decode.py``), then ONE all-gather over the ``sp`` group of the
packed ``[B, m, H, D_v + 1]`` float32 tensor (out | lse) gives every rank all P parts, merged in rank order
(``ops/merge.py``), so every rank ends with bit-identical results. Sinks join once, after the merge.
Bytes per layer and step: ``B · m · H · (D_v + 1) · 4`` to each of the P - 1 peers (``decode_bytes``).
"""

from __future__ import annotations

import torch

from ds_seqpar.comm.team import TeamComm
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.attention.decode import partial_attention
from ds_seqpar.ops.merge import apply_sink, merge_attn

__all__ = ["decode_bytes", "sharded_decode_attention"]


def decode_bytes(batch: int, new_tokens: int, heads: int, v_dim: int, elem: int = 4) -> int:
    """Bytes one rank sends to EACH peer per attention layer and decoding step: the packed (out | lse)."""
    return batch * new_tokens * heads * (v_dim + 1) * elem


def sharded_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    scale: float,
    key_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of the queries over the union of every SP rank's keys.

    Args:
        q: ``[B, H, m, D]`` (the same on every rank); k / v: this rank's cached keys and values
            ``[B, H_kv, n_r, D]`` / ``[B, H_kv, n_r, D_v]`` (n_r may differ per rank, and be 0).
        mesh: the mesh; the parts are merged over its ``sp`` group.
        key_mask: None or bool ``[B, n_r]``; softcap: Gemma 2's; sinks: None or ``[H]`` logits (gpt-oss).

    Returns:
        ``out [B, m, H, D_v]`` float32 (float64 for float64 inputs), identical on every rank.
    """
    out, lse = partial_attention(q, k, v, scale=scale, key_mask=key_mask, softcap=softcap)
    if mesh.sp_size > 1:
        team = TeamComm(mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
        packed = torch.cat([out, lse.transpose(1, 2).unsqueeze(-1)], dim=-1)  # [B, m, H, D_v + 1]
        (parts,) = team.gather(packed.unsqueeze(0), dim=0)  # [P, B, m, H, D_v + 1]
        out, lse = parts[0, ..., :-1], parts[0, ..., -1].transpose(1, 2)
        for part in parts[1:]:
            out, lse = merge_attn(out, lse, part[..., :-1], part[..., -1].transpose(1, 2))
    if sinks is not None:
        out, _ = apply_sink(out, lse, sinks)
    return out
