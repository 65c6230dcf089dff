"""Sparse ring attention: Ulysses x ring with a dynamic vertical-slash pattern (docs/sparse.md).

Legend: P = U · R SP ranks, n = S / P tokens per rank, G = ``sparse.block_size``.

    q, k [B, n, H|H_kv, D] (UspLayout order: ring layout stripe(G) with balancing, then Ulysses split)
      1. pattern estimation over the whole SP group (all heads; ``ops/sparse/pattern.estimate_pattern``)
         communicated: last queries [B, last_q, H, D] + scores [2, B, H, S] (all-reduce), pattern (broadcast)
      2. dbsp only: head permutation (greedy, equal head counts per Ulysses rank)
      3. Ulysses all-to-all                          q [B, S/R, h_u, D]
      4. dbsp only: block reassignment within the ring group (all-to-all there and back, when it pays)
         the ring engine with the sparse block kernel (``RingPlan(sparse=...)``), single or double ring
      5. inverse all-to-all (and inverse head permutation)   out [B, n, H, D]

Balancing (``sparse.balancing``):
    stripe  block stripes of G tokens over the ring (MTraining's balanced sparse ring): every rank
            holds every region of the sequence, so sinks, verticals and near-diagonal blocks spread
            evenly over ranks and steps.
    dbsp    db-SP, both levels. Heads: whole GQA groups are permuted before the all-to-all so every
            Ulysses rank gets the same number of heads and nearly the same work (longest-processing-time
            greedy; needs H_kv % U == 0, otherwise heads stay in place). Blocks: per ring group, blocks
            are reassigned to ring ranks (greedy, equal counts, biased to stay on their stripe rank);
            when that lowers ρ_s by more than 0.01 the group moves q/k/v into that ``BlockLayout`` with
            one all-to-all over the ring and the output back with another (``comm/relayout.py``).
    none    the configured ring layout (contiguous or zigzag), no permutation: the unbalanced baseline.

After every sparse layer the imbalance ratio ρ_s (db-SP) of the work actually scheduled is
recorded in ``sparse_stats(mesh)`` (``sparse.report_balance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.reduce import GroupReducer
from ds_seqpar.comm.relayout import relayout
from ds_seqpar.layout import BlockLayout, RingLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import (
    SparsePattern,
    VerticalSlashBudget,
    block_row_work,
    block_work,
    estimate_pattern,
    imbalance_ratio,
)
from ds_seqpar.parallel.ring.engine import ring_attention
from ds_seqpar.parallel.ring.plan import RingPlan
from ds_seqpar.parallel.ulysses import gather_heads, local_sinks, scatter_heads
from ds_seqpar.parallel.work import WorkCounter

STATS_KEY = "sparse_stats"
BLOCK_BALANCE_MIN_GAIN = 0.01  # db-SP block moves must lower rho_s by this much to pay for two all-to-alls
BLOCK_BALANCE_REWARD = 1.0  # bonus (x the block's work) for keeping a block on its stripe rank


@dataclass(frozen=True)
class SparseLayerStats:
    """What one sparse attention call scheduled.

    ``rho_s``: db-SP imbalance ratio of the scheduled work (1.0 = perfect); ``density``: fraction of
    the causal score pairs computed (1 - sparsity, over all heads); ``head_order``: query heads in
    the order they were split over the Ulysses ranks; ``blocks_moved``: blocks that db-SP block
    balancing moved away from their stripe rank, summed over the ring groups (0 = stripes kept).
    """

    layer: int | None
    rho_s: float
    density: float
    head_order: tuple[int, ...]
    blocks_moved: int = 0


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


def balance_blocks(
    row_work: torch.Tensor, home: torch.Tensor, world: int, reward: float = 1.0
) -> torch.Tensor:
    """db-SP block-level balancing: an owner rank per block, equal counts per rank.

    Blocks go heaviest first to the rank with the least load that still has room; a block's current
    (home) rank gets a bonus of ``reward`` x its work, so blocks stay home unless moving one evens the
    load (fewer rows to move). Returns ``[nB]`` ranks.
    """
    nb = row_work.numel()
    per_rank = nb // world
    load = [0.0] * world
    count = [0] * world
    owner = torch.empty(nb, dtype=torch.long)
    for a in torch.argsort(row_work, descending=True, stable=True).tolist():
        w, h = float(row_work[a]), int(home[a])
        rank = min(
            (r for r in range(world) if count[r] < per_rank),
            key=lambda r: load[r] - (reward * w if r == h else 0.0),
        )
        owner[a] = rank
        load[rank] += w
        count[rank] += 1
    return owner


def _group_layout(pattern: SparsePattern, ring: RingLayout, seq_len: int) -> object:
    """db-SP block balancing of one ring group (its heads' pattern): a ``BlockLayout`` when it lowers
    ρ_s by more than ``BLOCK_BALANCE_MIN_GAIN``, else the stripe layout unchanged."""
    home = block_owner(ring, seq_len, pattern.block_size)
    if home is None or ring.world == 1:
        return ring
    owner = balance_blocks(block_row_work(pattern), home, ring.world, BLOCK_BALANCE_REWARD)
    heads = [list(range(pattern.num_heads))]
    rho_home = imbalance_ratio(block_work(pattern, home, ring.world), heads)
    rho_new = imbalance_ratio(block_work(pattern, owner, ring.world), heads)
    if rho_new >= rho_home - BLOCK_BALANCE_MIN_GAIN:
        return ring
    blocks = tuple(tuple((owner == r).nonzero().squeeze(1).tolist()) for r in range(ring.world))
    return BlockLayout(blocks, pattern.block_size)


def block_owner(layout: RingLayout, seq_len: int, block_size: int) -> torch.Tensor | None:
    """Ring rank holding each block of G tokens, or None when the layout splits blocks across ranks."""
    owner = torch.full((seq_len,), -1, dtype=torch.long)
    for r in range(layout.world):
        owner[layout.local_positions(seq_len, r)] = r
    blocks = owner.view(-1, block_size) if seq_len % block_size == 0 else None
    if blocks is None or not bool((blocks == blocks[:, :1]).all()):
        return None
    return blocks[:, 0].clone()


@dataclass(frozen=True)
class BalancePlan:
    """How one sparse layer is balanced (``plan_balance``).

    ``head_order``: query-head permutation applied before the Ulysses all-to-all (None = identity);
    ``groups``: the (permuted) query heads of each Ulysses rank; ``layouts``: the ring layout of each
    Ulysses group (the stripe layout, or a ``BlockLayout`` from db-SP block balancing).
    """

    head_order: list[int] | None
    groups: list[list[int]]
    layouts: list[object]


def plan_balance(
    pattern: SparsePattern, ring: RingLayout, seq_len: int, num_kv_heads: int, heads: HeadPlan, balancing: str
) -> BalancePlan:
    """Head and block balancing for ``balancing`` (stripe | dbsp | none); pure arithmetic on the pattern,
    so every rank computes the same plan without communicating. ``pattern`` is in the original head order."""
    starts = [sum(heads.q_counts[:u]) for u in range(heads.degree)]
    groups = [list(range(st, st + c)) for st, c in zip(starts, heads.q_counts, strict=True)]
    if balancing != "dbsp":
        return BalancePlan(None, groups, [ring] * len(groups))
    order = None
    owner = block_owner(ring, seq_len, pattern.block_size)
    if owner is not None:
        order = balance_heads(block_work(pattern, owner, ring.world).sum((1, 2)), num_kv_heads, heads.degree)
    permuted = pattern if order is None else pattern.heads(order)
    return BalancePlan(order, groups, [_group_layout(permuted.heads(g), ring, seq_len) for g in groups])


def balance_stats(
    pattern: SparsePattern, plan: BalancePlan, stripe: RingLayout, layer: int | None
) -> SparseLayerStats | None:
    """ρ_s, density and moved blocks of the work ``plan`` schedules (``pattern`` in the ORIGINAL head order);
    None when a layout splits blocks (token stripes)."""
    if plan.head_order is not None:
        pattern = pattern.heads(plan.head_order)
    owners = [block_owner(lay, pattern.seq_len, pattern.block_size) for lay in plan.layouts]
    if any(o is None for o in owners):
        return None
    work = torch.stack(
        [
            block_work(pattern.heads(g), o, stripe.world).sum(0)
            for g, o in zip(plan.groups, owners, strict=True)
        ]
    )  # [U, R, R]
    causal = pattern.seq_len * (pattern.seq_len + 1) / 2 * pattern.batch * pattern.num_heads
    home = block_owner(stripe, pattern.seq_len, pattern.block_size)
    moved = sum(int((o != home).sum()) for o in owners) if home is not None else 0
    rho = imbalance_ratio(work, [[k] for k in range(len(plan.groups))])
    order = tuple(plan.head_order or range(pattern.num_heads))
    return SparseLayerStats(layer, rho, float(work.sum()) / causal, order, moved)


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse (vertical-slash) attention of the SP group; called by ``ds_seqpar.attention`` after its checks
    (the SP ranks' agreement on shapes, ``parallel/agree.py``, included: every rank's shapes are equal here).

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]`` in ``layout`` (a ``UspLayout``) order.
        mesh: the mesh; ``mesh.settings.sparse`` holds budgets and balancing.
        schedule: the ring schedule; seq_len: global S.
        layer: layer index, used as the key of ``sparse_stats``.
        softcap, sinks: as in ``ds_seqpar.attention`` (applied to the attended blocks; the pattern is
            estimated from the uncapped scores).

    Returns:
        ``out [B, n, H, D]`` in q.dtype; differentiable in q, k, v and sinks (the pattern is not).
    """
    cfg = mesh.settings
    sparse_cfg = cfg.sparse
    h, h_kv, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    pattern = _estimate(q, k, mesh, layout, seq_len, scale)
    heads = HeadPlan.build(h, h_kv, mesh.ulysses_size)
    balance = plan_balance(pattern, layout.ring, seq_len, h_kv, heads, sparse_cfg.balancing)
    full_pattern = pattern
    if balance.head_order is not None:
        q_index = torch.tensor(balance.head_order, device=q.device)
        kv_index = q_index[:: h // h_kv] // (h // h_kv)
        q, k, v = q.index_select(2, q_index), k.index_select(2, kv_index), v.index_select(2, kv_index)
        sinks = None if sinks is None else sinks.index_select(0, q_index)
        pattern = pattern.heads(balance.head_order)
    u = mesh.coords.ulysses_rank
    ring_layout = balance.layouts[u]
    plan = RingPlan(
        schedule, ring_layout, MaskSpec(causal=True, window=window), doc_ids, cfg.kernel, work,
        sparse=pattern.heads(balance.groups[u]), softcap=softcap, sparse_kernel=sparse_cfg.kernel,
    )  # fmt: skip
    q2, k2, v2 = scatter_heads(q, k, v, heads, mesh)
    ring = (mesh.group("ring"), mesh.coords.ring_rank, mesh.comm_stats)
    q2, k2, v2 = relayout((q2, k2, v2), layout.ring, ring_layout, *ring)
    out, _ = ring_attention(q2, k2, v2, plan, scale, local_sinks(sinks, heads, mesh))
    (out,) = relayout((out,), ring_layout, layout.ring, *ring)
    out = gather_heads(out, heads, mesh)
    if balance.head_order is not None:
        out = out.index_select(2, torch.argsort(torch.tensor(balance.head_order, device=out.device)))
    if sparse_cfg.report_balance:
        stats = balance_stats(full_pattern, balance, layout.ring, layer)
        if stats is not None:
            sparse_stats(mesh)[layer] = stats
    return out


def _estimate(
    q: torch.Tensor, k: torch.Tensor, mesh: SeqParMesh, layout: object, seq_len: int, scale: float
) -> SparsePattern:
    """The pattern of the whole sequence, estimated over the SP group from every rank's shard (no grad)."""
    positions = layout.local_positions(seq_len, mesh.coords.sp_rank).to(q.device)
    reducer = GroupReducer(mesh.group("sp"), mesh.members["sp"], mesh.comm_stats)
    budget = budget_from_config(mesh.settings.sparse)
    with torch.no_grad():
        return estimate_pattern(q.detach(), k.detach(), positions, positions, seq_len, budget, scale, reducer)
