"""Switch which axis of a sharded activation is split over a group, with ONE all-to-all (differentiable).

Legend: P = ranks of the group; ``x`` is this rank's shard of a global tensor whose axis ``sharded``
is split over the P ranks in rank order (rank r holds the r-th of P equal parts of it), every other
axis whole. DSP (docs/dsp.md): a spatio-temporal activation ``[B, T, S, C]`` sharded on T (whole
frames: spatial attention is local) becomes sharded on S (whole time lines: temporal attention is
local), and back.

    switch_axis(x, sharded=1, to=2)   [B, T/P, S, C]  ->  [B, T, S/P, C]

Rank i sends to rank j the j-th P-th of its ``to`` axis (its ``sharded`` part of it) and concatenates
what it receives along ``sharded`` in rank order. The backward is the switch back. Bytes recorded
(kind ``"all_to_all"``, per peer): (P − 1)/P of the shard, x.numel() / P elements to each other rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats


def _exchange(x: torch.Tensor, sharded: int, to: int, group: Any, members: Sequence[int], me: int,
              stats: CommStats | None) -> torch.Tensor:  # fmt: skip
    world = len(members)
    send = x.unflatten(to, (world, -1)).movedim(to, 0).contiguous()  # [P, ...]: part j goes to rank j
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=group)
    if stats is not None:
        per_peer = send[0].numel() * send.element_size()
        stats.record_peers("all_to_all", {m: per_peer for j, m in enumerate(members) if j != me})
    # got[i] has x's axes (``to`` now this rank's part): rank i's part of ``sharded``, joined in rank order
    return torch.cat(list(got.unbind(0)), dim=sharded)


class _SwitchAxis(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sharded: int, to: int, group: Any, members: list[int], me: int,
        stats: CommStats | None,
    ) -> torch.Tensor:  # fmt: skip
        ctx.args = (sharded, to, group, members, me, stats)
        return _exchange(x, sharded, to, group, members, me, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        sharded, to, group, members, me, stats = ctx.args
        return _exchange(grad, to, sharded, group, members, me, stats), None, None, None, None, None, None


def switch_axis(
    x: torch.Tensor,
    sharded: int,
    to: int,
    group: Any,
    members: Sequence[int],
    me: int,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """This rank's shard of the same global tensor, split along ``to`` instead of ``sharded``.

    Args:
        x: the shard, axis ``sharded`` holding this rank's part; axis ``to`` whole and a multiple of P.
        group / members / me: the process group, its global ranks in rank order, this rank's index.
    Returns the shard with axis ``sharded`` whole and axis ``to`` split (P times fewer entries).
    """
    dims = x.dim()
    sharded, to = sharded % dims, to % dims
    if sharded == to:
        raise ValueError(f"switch_axis: sharded axis {sharded} and target axis {to} are the same")
    world = len(members)
    size = x.shape[to]
    if size % world:
        padded = -(-size // world) * world
        raise ValueError(
            f"switch_axis: axis {to} has {size} entries, which do not split over {world} ranks; pad it to "
            f"{padded} (a multiple of {world})"
        )
    if world == 1:
        return x
    return _SwitchAxis.apply(x, sharded, to, group, list(members), me, stats)
