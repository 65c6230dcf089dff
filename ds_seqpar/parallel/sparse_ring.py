"""Sparse ring attention: Ulysses x ring with a dynamic vertical-slash pattern (ALGORITHMS.md §14, §15).

Legend: P = U · R SP ranks, n = S / P tokens per rank, G = ``sparse.block_size``.

    q, k [B, n, H|H_kv, D] (UspLayout order: ring layout stripe(G) with balancing, then Ulysses split)
      1. pattern estimation over the whole SP group (all heads; ``ops/sparse.estimate_pattern``)
         communicated: last queries [B, last_q, H, D] + scores [2, B, H, S] (all-reduce), pattern (broadcast)
      2. dbsp only: head permutation (greedy, equal head counts per Ulysses rank)
      3. Ulysses all-to-all                          q [B, S/R, h_u, D]
      4. the ring engine with the sparse block kernel (``RingPlan(sparse=...)``), single or double ring
      5. inverse all-to-all (and inverse head permutation)   out [B, n, H, D]

Balancing (``sparse.balancing``):
    stripe  block stripes of G tokens over the ring (MTraining's balanced sparse ring): every rank
            holds every region of the sequence, so sinks, verticals and near-diagonal blocks spread
            evenly over ranks and steps.
    dbsp    stripes plus db-SP's head-level balancing: heads (whole GQA groups) are permuted before the
            all-to-all so every Ulysses rank gets the same number of heads and nearly the same work
            (longest-processing-time greedy). Needs H_kv % U == 0, otherwise heads stay in place.
    none    the configured ring layout (contiguous or zigzag), no permutation: the unbalanced baseline.

After every sparse layer the imbalance ratio ρ_s (db-SP) of the work actually scheduled is
recorded in ``sparse_stats(mesh)`` (``sparse.report_balance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.reduce import GroupReducer
from ds_seqpar.layout import SeqLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import (
    SparsePattern,
    VerticalSlashBudget,
    block_work,
    estimate_pattern,
    imbalance_ratio,
)
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, ring_attention
from ds_seqpar.parallel.ulysses import gather_heads, scatter_heads

STATS_KEY = "sparse_stats"


@dataclass(frozen=True)
class SparseLayerStats:
    """What one sparse attention call scheduled.

    ``rho_s``: db-SP imbalance ratio of the scheduled work (1.0 = perfect); ``density``: fraction of
    the causal score pairs computed (1 - sparsity, over all heads); ``head_order``: query heads in
    the order they were split over the Ulysses ranks.
    """

    layer: int | None
    rho_s: float
    density: float
    head_order: tuple[int, ...]


def sparse_stats(mesh: SeqParMesh) -> dict[int | None, SparseLayerStats]:
    """The latest ``SparseLayerStats`` per layer index (None = calls without a layer index)."""
    return mesh.resources.setdefault(STATS_KEY, {})


def budget_from_config(sparse_cfg: object) -> VerticalSlashBudget:
    """A ``VerticalSlashBudget`` from ``sequence_parallel.sparse``."""
    return VerticalSlashBudget(
        vertical=sparse_cfg.vertical,
        slash=sparse_cfg.slash,
        block_size=sparse_cfg.block_size,
        last_q=sparse_cfg.last_q,
        sink_tokens=sparse_cfg.sink_tokens,
        local_diagonals=sparse_cfg.local_diagonals,
    )


def balance_heads(head_work: torch.Tensor, num_kv_heads: int, degree: int) -> list[int] | None:
    """db-SP head-level balancing: a query-head order whose U equal slices carry nearly equal work.

    Whole GQA groups move together (a query head stays with its K/V head); groups are assigned,
    heaviest first, to the lightest Ulysses rank that still has room (equal counts). Returns None
    when no permutation is possible or needed (U = 1, or H_kv not divisible by U).
    """
    if degree == 1 or num_kv_heads % degree != 0:
        return None
    num_heads = head_work.numel()
    group = num_heads // num_kv_heads
    group_work = head_work.view(num_kv_heads, group).sum(1)
    per_rank = num_kv_heads // degree
    load = [0.0] * degree
    assigned: list[list[int]] = [[] for _ in range(degree)]
    for g in torch.argsort(group_work, descending=True, stable=True).tolist():
        rank = min((r for r in range(degree) if len(assigned[r]) < per_rank), key=lambda r: load[r])
        assigned[rank].append(g)
        load[rank] += float(group_work[g])
    return [g * group + i for rank_groups in assigned for g in sorted(rank_groups) for i in range(group)]


def block_owner(layout: SeqLayout, seq_len: int, block_size: int) -> torch.Tensor | None:
    """Ring rank holding each block of G tokens, or None when the layout splits blocks across ranks."""
    owner = torch.full((seq_len,), -1, dtype=torch.long)
    for r in range(layout.world):
        owner[layout.local_positions(seq_len, r)] = r
    blocks = owner.view(-1, block_size) if seq_len % block_size == 0 else None
    if blocks is None or not bool((blocks == blocks[:, :1]).all()):
        return None
    return blocks[:, 0].clone()


def _record_stats(
    mesh: SeqParMesh,
    pattern: SparsePattern,
    layout: SeqLayout,
    heads: HeadPlan,
    head_order: list[int],
    layer: int | None,
) -> None:
    """ρ_s and density of the scheduled work (pattern in the permuted head order)."""
    owner = block_owner(layout, pattern.seq_len, pattern.block_size)
    if owner is None:
        return
    work = block_work(pattern, owner, layout.world)
    starts = [sum(heads.q_counts[:u]) for u in range(heads.degree)]
    groups = [list(range(s, s + c)) for s, c in zip(starts, heads.q_counts, strict=True)]
    causal = pattern.seq_len * (pattern.seq_len + 1) / 2 * pattern.batch * pattern.num_heads
    stats = SparseLayerStats(
        layer, imbalance_ratio(work, groups), float(work.sum()) / causal, tuple(head_order)
    )
    sparse_stats(mesh)[layer] = stats


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    layout: object,
    schedule: object,
    seq_len: int,
    softmax_scale: float | None = None,
    window: int | None = None,
    doc_ids: torch.Tensor | None = None,
    work: WorkCounter | None = None,
    layer: int | None = None,
) -> torch.Tensor:
    """Sparse (vertical-slash) attention of the SP group; called by ``ds_seqpar.attention`` after its checks.

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]`` in ``layout`` (a ``UspLayout``) order.
        mesh: the mesh; ``mesh.config.sparse`` holds budgets and balancing.
        schedule: the ring schedule; seq_len: global S.
        layer: layer index, used as the key of ``sparse_stats``.

    Returns:
        ``out [B, n, H, D]`` in q.dtype; differentiable in q, k, v (the pattern is not).
    """
    cfg = mesh.config
    sparse_cfg = cfg.sparse
    h, h_kv, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    positions = layout.local_positions(seq_len, mesh.coords.sp_rank).to(q.device)
    reducer = GroupReducer(mesh.group("sp"), mesh.members["sp"], mesh.comm_stats)
    with torch.no_grad():
        pattern = estimate_pattern(
            q.detach(),
            k.detach(),
            positions,
            positions,
            seq_len,
            budget_from_config(sparse_cfg),
            scale,
            reducer,
        )
    order = None
    if sparse_cfg.balancing == "dbsp":
        owner = block_owner(layout.ring, seq_len, pattern.block_size)
        if owner is not None:
            order = balance_heads(
                block_work(pattern, owner, layout.ring.world).sum((1, 2)), h_kv, mesh.ulysses_size
            )
    if order is not None:
        q_index = torch.tensor(order, device=q.device)
        group = h // h_kv
        kv_index = q_index[::group] // group
        q, k, v = q.index_select(2, q_index), k.index_select(2, kv_index), v.index_select(2, kv_index)
        pattern = pattern.heads(order)
    heads = HeadPlan.build(h, h_kv, mesh.ulysses_size)
    u = mesh.coords.ulysses_rank
    start = sum(heads.q_counts[:u])
    local_pattern = pattern.heads(list(range(start, start + heads.q_counts[u])))
    plan = RingPlan(
        schedule,
        layout.ring,
        MaskSpec(causal=True, window=window),
        doc_ids,
        "auto",
        work,
        sparse=local_pattern,
    )
    q2, k2, v2 = scatter_heads(q, k, v, heads, mesh)
    out, _ = ring_attention(q2, k2, v2, plan, scale)
    out = gather_heads(out, heads, mesh)
    if order is not None:
        out = out.index_select(2, torch.argsort(torch.tensor(order, device=out.device)))
    if sparse_cfg.report_balance:
        _record_stats(mesh, pattern, layout.ring, heads, order or list(range(h)), layer)
    return out
