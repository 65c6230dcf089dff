"""APB / Star Attention approximate prefill: the pure math (docs/inference.md "APB and Star Attention").

Legend:
    P          SP ranks; rank r holds the contiguous block of global positions [r·n, (r+1)·n)
    B, H, D    batch, query heads, head dim; H_kv key/value heads, g = H // H_kv
    l_a        anchor length: the first l_a tokens of the input, prepended to every rank's block
    l_q        query length: the last l_q tokens of the input, embedded at the end of the anchor
    l_p        passing length: K/V entries per KV head that each rank passes to the later ranks

Selection rule (training-free stand-in for APB's learned retaining heads, docs/inference.md): the score
of local key j for KV head h is ``sum over query rows i and the g query heads of h of softmax_j(s_ij)``,
the softmax running over this rank's candidate keys; the l_p best keys per KV head are passed
(ties: the earlier position), kept in position order.

``apb_reference`` computes the whole approximation densely on one process (fp64 in the tests) from
the global q / k / v: the ground truth of ``parallel/apb.py``.
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.reference import dense_attention_reference

__all__ = ["apb_reference", "passing_scores", "select_passing"]


def passing_scores(
    q_query: torch.Tensor, k_cand: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Scores ``[B, H_kv, n_c]`` (fp32 or fp64) of the candidate keys ``k_cand [B, n_c, H_kv, D]`` from
    the query rows ``q_query [B, l_q, H, D]``: softmax over the candidates, summed over rows and the g
    query heads of each KV head (softcap applied to the logits when given)."""
    acc = torch.float64 if q_query.dtype == torch.float64 else torch.float32
    b, l_q, h, d = q_query.shape
    h_kv = k_cand.shape[2]
    q = q_query.to(acc).reshape(b, l_q, h_kv, h // h_kv, d)
    logits = scale * torch.einsum("bqkgd,bnkd->bkgqn", q, k_cand.to(acc))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.softmax(logits, dim=-1).sum(dim=(2, 3))


def select_passing(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices ``[B, H_kv, budget]`` (long, ascending) of the ``budget`` best scores along the last dim
    of ``scores [B, H_kv, n_c]``; equal scores prefer the earlier index. ``budget <= n_c``."""
    if budget > scores.shape[-1]:
        raise ValueError(f"select_passing: budget {budget} exceeds the {scores.shape[-1]} candidates")
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :budget]
    return torch.sort(order, dim=-1).values


def _passed(q_query, k, n, rank, spec, scale, softcap) -> torch.Tensor:
    """Bool ``[B, H_kv, S]``: the global positions rank ``rank`` passes per KV head."""
    l_a, _, l_p = spec
    start = l_a if rank == 0 else 0
    chosen = torch.zeros(k.shape[0], k.shape[2], k.shape[1], dtype=torch.bool)
    budget = min(l_p, n - start)
    if budget <= 0:
        return chosen
    cand = k[:, rank * n + start : (rank + 1) * n]
    idx = select_passing(passing_scores(q_query, cand, scale, softcap), budget)
    chosen.scatter_(2, idx + rank * n + start, True)
    return chosen


def apb_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    world: int,
    spec: tuple[int, int, int],
    *,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """APB on one process. ``q [B, S, H, D]``, ``k, v [B, S, H_kv, D]`` global (contiguous blocks of
    n = S / world), ``query`` = the embedded query rows' ``(q, k, v)`` ``[B, l_q, ., D]``, ``spec`` =
    ``(l_a, l_q, l_p)``. Returns ``(out [B, S, H, D], anchor_out [B, l_a + l_q, H, D])``: every global row
    over the anchor prefix (ranks > 0), the passed keys of the earlier ranks and its own block causally;
    the anchor rows causally over [prefix ; query rows] (positions 0 .. l_a + l_q - 1)."""
    (b, s, _, d), g = q.shape, q.shape[2] // k.shape[2]
    l_a, l_q, _ = spec
    scale = d**-0.5 if scale is None else scale
    n = s // world
    pos = torch.arange(s)
    causal = pos.view(-1, 1) >= pos.view(1, -1)
    if window is not None:
        causal &= pos.view(-1, 1) - pos.view(1, -1) < window
    passed = [_passed(query[0], k, n, r, spec, scale, softcap) for r in range(world)]
    outs = []
    for r in range(world):
        rows = slice(r * n, (r + 1) * n)
        own = torch.zeros(s, dtype=torch.bool)
        own[rows] = True
        if r > 0:
            own[:l_a] = True  # the anchor prefix (rank 0: its own block)
        seen = own.view(1, 1, -1).expand(b, k.shape[2], s).clone()
        for src in range(r):
            seen |= passed[src]
        mask = seen.repeat_interleave(g, dim=1).unsqueeze(2) & causal[rows].view(1, 1, n, s)
        out, _ = dense_attention_reference(q[:, rows], k, v, mask, scale, softcap, sinks)
        outs.append(out)
    qa = torch.cat([q[:, :l_a], query[0]], 1)
    ka, va = torch.cat([k[:, :l_a], query[1]], 1), torch.cat([v[:, :l_a], query[2]], 1)
    apos = torch.arange(l_a + l_q)
    amask = apos.view(-1, 1) >= apos.view(1, -1)
    if window is not None:
        amask &= apos.view(-1, 1) - apos.view(1, -1) < window
    anchor_out, _ = dense_attention_reference(qa, ka, va, amask, scale, softcap, sinks)
    return torch.cat(outs, 1), anchor_out
