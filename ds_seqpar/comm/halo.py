"""Halo exchange: the ``width`` inputs just before each contiguous run of a rank's tokens (differentiable).

A causal layer with a short receptive field (a causal conv1d with kernel K needs width K - 1; a token
shift needs 1) computes a token from it and the ``width`` tokens before it. Under sequence parallelism
a rank's rows form runs of consecutive positions (contiguous layout: one run; zigzag: one or two;
stripes of G tokens: n / G), and the first ``width`` outputs of each run need inputs another rank
holds. The layout fixes who holds what, so every rank derives the same plan from the positions of
every rank (``halo_plan``; no collective), then one batched isend/irecv moves the rows
(``halo_exchange``). Positions before 0 are zeros (the sequence start).

Bytes per rank (kind ``"p2p"``): ``width · C`` elements per run whose halo lies on another rank, in
each direction (forward: the inputs; backward: their gradients, added into the owner's rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats


@dataclass(frozen=True)
class HaloPlan:
    """Where this rank's halo rows come from and which of its rows others need.

    Attributes:
        runs: ``(first_row, end_row)`` local row ranges of consecutive positions, in local order.
        width: halo rows per run.
        sources: per halo row (run-major, then oldest to newest): ``(rank, local_row)`` of its owner
            (``rank`` = this rank for rows it holds itself) or None before position 0.
        sends: group rank -> local rows it needs from this rank, in its halo order.
    """

    runs: tuple[tuple[int, int], ...]
    width: int
    sources: tuple[tuple[int, int] | None, ...]
    sends: dict[int, tuple[int, ...]]

    def receives(self, me: int) -> dict[int, list[int]]:
        """Group rank -> indices of this rank's halo rows that rank sends, in order."""
        got: dict[int, list[int]] = {}
        for slot, src in enumerate(self.sources):
            if src is not None and src[0] != me:
                got.setdefault(src[0], []).append(slot)
        return got


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal local row ranges whose positions go up by one."""
    pos = positions.tolist()
    runs, start = [], 0
    for row in range(1, len(pos) + 1):
        if row == len(pos) or pos[row] != pos[row - 1] + 1:
            runs.append((start, row))
            start = row
    return runs


def _halo_positions(positions: torch.Tensor, width: int) -> list[int]:
    """Sequence positions of a rank's halo rows, run-major (may be negative = before the sequence)."""
    pos = positions.tolist()
    return [pos[a] - width + d for a, _ in _runs(positions) for d in range(width)]


def halo_plan(positions: Sequence[torch.Tensor], me: int, width: int) -> HaloPlan:
    """The plan for group rank ``me`` from every rank's global positions (``layout.local_positions``).

    Args:
        positions: per group rank, ``[n]`` global positions of its rows in local order.
        width: halo rows per run (kernel size - 1), >= 0.
    """
    if width < 0:
        raise ValueError(f"halo width must be >= 0, got {width}")
    owner = {}
    for rank, pos in enumerate(positions):
        for row, p in enumerate(pos.tolist()):
            owner[p] = (rank, row)
    sources = tuple(owner[p] if p >= 0 else None for p in _halo_positions(positions[me], width))
    sends = {}
    for rank, pos in enumerate(positions):
        if rank == me:
            continue
        rows = tuple(owner[p][1] for p in _halo_positions(pos, width) if p >= 0 and owner[p][0] == me)
        if rows:
            sends[rank] = rows
    return HaloPlan(tuple(_runs(positions[me])), width, sources, sends)


def _swap(
    outgoing: dict[int, torch.Tensor], incoming: dict[int, torch.Tensor], group: Any, members: Sequence[int],
    stats: CommStats | None,
) -> None:  # fmt: skip
    """One batched isend/irecv: ``outgoing[r]`` to group rank r, ``incoming[r]`` filled from it."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), members[r], group) for r, t in outgoing.items()]
    ops += [dist.P2POp(dist.irecv, t, members[r], group) for r, t in incoming.items()]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if stats is not None and outgoing:
        stats.record_peers("p2p", {members[r]: t.numel() * t.element_size() for r, t in outgoing.items()})


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: HaloPlan, group, members, me, stats) -> torch.Tensor:
        ctx.args = (plan, group, members, me, stats, x.shape)
        b, _, c = x.shape
        halo = x.new_zeros(b, len(plan.sources), c)
        for slot, src in enumerate(plan.sources):
            if src is not None and src[0] == me:
                halo[:, slot] = x[:, src[1]]
        receives = plan.receives(me)
        incoming = {r: x.new_empty(b, len(slots), c) for r, slots in receives.items()}
        _swap({r: x[:, list(rows)] for r, rows in plan.sends.items()}, incoming, group, members, stats)
        for r, slots in receives.items():
            halo[:, slots] = incoming[r]
        return halo

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        plan, group, members, me, stats, shape = ctx.args
        dx = grad.new_zeros(shape)
        for slot, src in enumerate(plan.sources):
            if src is not None and src[0] == me:
                dx[:, src[1]] += grad[:, slot]
        receives = plan.receives(me)
        returned = {r: grad.new_empty(shape[0], len(rows), shape[2]) for r, rows in plan.sends.items()}
        _swap({r: grad[:, slots] for r, slots in receives.items()}, returned, group, members, stats)
        for r, rows in plan.sends.items():
            dx.index_add_(1, torch.tensor(rows, device=dx.device), returned[r])
        return dx, None, None, None, None, None


def halo_exchange(
    x: torch.Tensor,
    plan: HaloPlan,
    group: Any,
    members: Sequence[int],
    me: int,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """This rank's halo rows ``[B, len(plan.runs) · width, C]`` for its rows ``x [B, n, C]`` (differentiable).

    Every rank of the group must call it with its own plan from the same positions and width.
    """
    if x.dim() != 3:
        raise ValueError(f"halo_exchange takes [B, n, C] rows, got shape {tuple(x.shape)}")
    return _Halo.apply(x, plan, group, list(members), me, stats)
