"""db-SP balancing of block-sparse DiT attention: heads over the Ulysses ranks, blocks over the ring
(docs/dit_sparse.md "Balancing"). Pure arithmetic on the shared pattern: every rank computes the same plan.

    none    the mesh's ring layout, heads in place
    stripe  blocks of G round-robin over the R ring ranks (``StripeLayout(R, G)``)
    dbsp    stripes, plus (heads) whole GQA groups permuted so the U Ulysses ranks get equal head counts
            and nearly equal work (longest-processing-time, ``sparse_ring.balance_heads``), plus (blocks)
            per Ulysses group a block placement over the ring ranks (``sparse_ring.balance_blocks``) kept
            only if it lowers that group's ρ_s by more than ``min_block_gain``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout import BlockLayout
from ds_seqpar.layout.ring import StripeLayout
from ds_seqpar.ops.sparse.block_pattern import BlockPattern
from ds_seqpar.ops.sparse.block_work import dit_block_work, dit_row_work
from ds_seqpar.ops.sparse.work import imbalance_ratio
from ds_seqpar.parallel.sparse_ring import balance_blocks, balance_heads, block_owner

__all__ = ["DitBalancePlan", "dit_balance_rho", "plan_dit_balance"]


@dataclass(frozen=True)
class DitBalancePlan:
    """``head_order``: query-head permutation applied before the Ulysses all-to-all (None = identity);
    ``groups``: the (permuted) query heads of each Ulysses rank; ``layouts``: the ring layout each Ulysses
    group's ring runs on; ``blocks_moved``: blocks placed off their stripe rank, over the groups."""

    head_order: list[int] | None
    groups: list[list[int]]
    layouts: list[object]
    blocks_moved: int = 0


def _group_layout(pattern: BlockPattern, stripe: StripeLayout, min_gain: float) -> tuple[object, int]:
    """db-SP block placement of one Ulysses group: a ``BlockLayout`` when it lowers ρ_s by more than
    ``min_gain``, else the stripes; and the number of blocks moved."""
    r = stripe.world
    home = block_owner(stripe, pattern.seq_len, pattern.block_size)
    if r == 1 or home is None:
        return stripe, 0
    owner = balance_blocks(dit_row_work(pattern), home, r, 1.0 if min_gain >= 0 else 0.0)
    one = [list(range(pattern.num_heads))]
    rho_home = imbalance_ratio(dit_block_work(pattern, home, r), one)
    rho_new = imbalance_ratio(dit_block_work(pattern, owner, r), one)
    if rho_new >= rho_home - min_gain:
        return stripe, 0
    blocks = tuple(tuple((owner == q).nonzero().squeeze(1).tolist()) for q in range(r))
    return BlockLayout(blocks, pattern.block_size), int((owner != home).sum())


def plan_dit_balance(
    pattern: BlockPattern,
    ring: object,
    num_kv_heads: int,
    heads: HeadPlan,
    balancing: str,
    min_block_gain: float = 0.01,
) -> DitBalancePlan:
    """The plan of ``balancing`` for ``pattern`` (original head order) on a ring of ``ring.world`` ranks whose
    configured layout is ``ring`` (kept by ``none``)."""
    starts = [sum(heads.q_counts[:u]) for u in range(heads.degree)]
    groups = [list(range(st, st + c)) for st, c in zip(starts, heads.q_counts, strict=True)]
    if balancing == "none":
        return DitBalancePlan(None, groups, [ring] * len(groups))
    stripe = StripeLayout(ring.world, pattern.block_size)
    if balancing == "stripe":
        return DitBalancePlan(None, groups, [stripe] * len(groups))
    head_work = pattern.mask.to(torch.float64).sum((0, 2, 3)).cpu()
    order = balance_heads(head_work, num_kv_heads, heads.degree)
    permuted = pattern if order is None else pattern.heads(order)
    placed = [_group_layout(permuted.heads(g), stripe, min_block_gain) for g in groups]
    return DitBalancePlan(order, groups, [p[0] for p in placed], sum(p[1] for p in placed))


def dit_balance_rho(pattern: BlockPattern, plan: DitBalancePlan, world: int) -> float | None:
    """ρ_s of the work ``plan`` schedules (``pattern`` in the ORIGINAL head order); None when a layout
    splits blocks over ranks."""
    if plan.head_order is not None:
        pattern = pattern.heads(plan.head_order)
    owners = [block_owner(lay, pattern.seq_len, pattern.block_size) for lay in plan.layouts]
    if any(o is None for o in owners):
        return None
    work = torch.stack(
        [dit_block_work(pattern.heads(g), o, world).sum(0) for g, o in zip(plan.groups, owners, strict=True)]
    )  # [U, R, R]
    return imbalance_ratio(work, [[k] for k in range(len(plan.groups))])
