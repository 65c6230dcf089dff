"""Ulysses head parallelism: scatter heads / gather sequence before attention, the inverse after.

Legend: U = Ulysses degree, n = tokens per SP rank, H / H_kv = query / key-value heads,
h_u / k_u = query / K/V heads of Ulysses rank u after the exchange (``HeadPlan``).

    q [B, n, H, D], k/v [B, n, H_kv, D]
      --seq_to_head (all-to-all over the Ulysses group)-->  q [B, U·n, h_u, D], k/v [B, U·n, k_u, D]
      --any attention over the U·n tokens (the ring engine, or a single device when R = 1)-->
      out [B, U·n, h_u, D] --head_to_seq--> out [B, n, H, D]

Communication per rank and layer (even split, no replication, fwd; bwd the same):
``(U-1)/U · B·n·D·(2H + 2H_kv)`` elements (q, k, v in, out back). When U > H_kv each K/V head is
replicated to the U/H_kv ranks that need it before the exchange (``HeadPlan``), and its gradient
is summed back by autograd.
"""

from __future__ import annotations

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq, seq_to_head
from ds_seqpar.mesh import SeqParMesh


def gather_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: HeadPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, n, H_kv, D]`` -> the K/V heads the plan sends, in rank order (replicated where U > H_kv)."""
    if heads.kv_index is None:
        return k, v
    index = torch.tensor(heads.kv_index, device=k.device)
    return k.index_select(2, index), v.index_select(2, index)


def scatter_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: HeadPlan,
    mesh: SeqParMesh,
    separate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, n, H|H_kv, D]`` -> ``[B, U·n, h_u|k_u, D]`` for q, k, v (differentiable).

    One all-to-all by default: q, k and v come out as views of one receive buffer. ``separate``: one
    all-to-all per tensor (same bytes), so each comes out contiguous: K/V that then travel a ring are
    sent as they are, with no contiguous copy of this rank's block at the first ring step.
    """
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    k, v = gather_kv_heads(k, v, heads)
    counts = (heads.q_counts, heads.kv_counts, heads.kv_counts)
    if separate:
        return tuple(seq_to_head((x,), (c,), group, me, stats)[0] for x, c in zip((q, k, v), counts))
    q2, k2, v2 = seq_to_head((q, k, v), counts, group, me, stats)
    return q2, k2, v2


def gather_heads(out: torch.Tensor, heads: HeadPlan, mesh: SeqParMesh) -> torch.Tensor:
    """``[B, U·n, h_u, D]`` -> ``[B, n, H, D]`` (differentiable)."""
    (full,) = head_to_seq(
        (out,), (heads.q_counts,), mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    )
    return full


def local_sinks(sinks: torch.Tensor | None, heads: HeadPlan, mesh: SeqParMesh) -> torch.Tensor | None:
    """The sink logits ``[h_u]`` of the query heads this Ulysses rank attends after the all-to-all."""
    if sinks is None:
        return None
    me = mesh.coords.ulysses_rank
    first = sum(heads.q_counts[:me])
    return sinks[first : first + heads.q_counts[me]]
