"""db-SP balancing of block-sparse DiT attention: heads over the Ulysses ranks, blocks over the ring
(docs/dit_sparse.md "Balancing"). Pure arithmetic on the shared pattern: every rank computes the same plan.

    none    the mesh's ring layout, heads in place
    stripe  blocks of G round-robin over the R ring ranks (``StripeLayout(R, G)``)
    dbsp    stripes, plus (heads) whole GQA groups permuted so the U Ulysses ranks get equal head counts
            and nearly equal work (longest-processing-time, ``sparse_ring.balance_heads``), plus (blocks)
            per Ulysses group a block placement over the ring ranks (``sparse_ring.balance_blocks``, then a
            bounded swap search on ρ_s) kept only if it lowers that group's ρ_s by more than ``min_block_gain``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout import BlockLayout
from ds_seqpar.layout.ring import StripeLayout
from ds_seqpar.ops.sparse.block_pattern import BlockPattern
from ds_seqpar.ops.sparse.dit_work import dit_block_work, dit_row_work
from ds_seqpar.ops.sparse.work import imbalance_ratio
from ds_seqpar.parallel.sparse_ring import balance_blocks, balance_heads, block_owner

RANDOM_STARTS = 16  # seeded random placements the block search tries first

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


def _rho(m: torch.Tensor, owner: torch.Tensor, r: int, steps: torch.Tensor) -> float:
    """ρ_s of one Ulysses group whose summed kept-block matrix is ``m [nB, nB]`` under ``owner [nB]``."""
    o = torch.nn.functional.one_hot(owner, r).to(m.dtype)
    w = o.T @ m @ o  # [R, R]: query rank x key rank
    total = float(w.sum())
    return float(w[torch.arange(r)[None, :], steps].amax(1).sum()) * r / total if total else 1.0


def _search(m: torch.Tensor, start: torch.Tensor, r: int, budget: int) -> torch.Tensor:
    """Lower ρ_s from ``start`` by swapping blocks of different ranks (counts stay equal): ``budget`` seeded
    random pairs, each swap kept if it lowers ρ_s (deterministic: the same on every rank)."""
    steps = (
        torch.arange(r)[None, :] - torch.arange(r)[:, None]
    ) % r  # [t, i] -> key rank of rank i at step t
    gen = torch.Generator().manual_seed(0)
    best, best_rho = start, _rho(m, start, r, steps)
    nb = start.numel()
    pairs = torch.randint(0, nb, (budget, 2), generator=gen).tolist()
    for a, b in pairs:
        if best[a] == best[b]:
            continue
        owner = best.clone()
        owner[a], owner[b] = best[b], best[a]
        rho = _rho(m, owner, r, steps)
        if rho < best_rho:
            best, best_rho = owner, rho
    return best


def _group_layout(
    pattern: BlockPattern, stripe: StripeLayout, min_gain: float, budget: int
) -> tuple[object, int]:
    """db-SP block placement of one Ulysses group: a ``BlockLayout`` when it lowers ρ_s by more than
    ``min_gain``, else the stripes; and the number of blocks moved. The placement starts from the
    longest-processing-time placement of the rows' work (``sparse_ring.balance_blocks``) and is refined by
    ``_search`` on ρ_s itself."""
    r = stripe.world
    home = block_owner(stripe, pattern.seq_len, pattern.block_size)
    if r == 1 or home is None:
        return stripe, 0
    owner = balance_blocks(dit_row_work(pattern), home, r, 1.0 if min_gain >= 0 else 0.0)
    if budget > 0:
        m = pattern.mask.cpu().to(torch.float64).sum((0, 1))
        owner = _search(m, owner, r, budget)
    one = [list(range(pattern.num_heads))]
    rho_home = imbalance_ratio(dit_block_work(pattern, home, r), one)
    rho_new = imbalance_ratio(dit_block_work(pattern, owner, r), one)
    if rho_new >= rho_home - min_gain or bool((owner == home).all()):
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
    block_search: int = 512,
) -> DitBalancePlan:
    """The plan of ``balancing`` for ``pattern`` (original head order) on a ring of ``ring.world`` ranks whose
    configured layout is ``ring`` (kept by ``none``); ``block_search``: ρ_s evaluations of the block search."""
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
    placed = [_group_layout(permuted.heads(g), stripe, min_block_gain, block_search) for g in groups]
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
