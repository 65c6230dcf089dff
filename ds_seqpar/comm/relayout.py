"""Move a sequence-sharded tensor from one token layout to another with ONE all-to-all (differentiable).

Legend: R = ranks of the group, n = S / R local tokens, any trailing dims (heads, head dim).

``relayout(x, src, dst, ...)``: ``x [B, n, ...]`` holds this rank's tokens in ``src`` order; the result
holds its tokens under ``dst``, in ``dst`` order. Rank i sends to rank j the rows of the positions that
``dst`` gives to j (uneven ``all_to_all_single`` split sizes); the backward is the same exchange from
``dst`` to ``src``. Used by db-SP block balancing to reach a pattern-dependent ``BlockLayout`` from the
stripe layout and back. Bytes recorded (kind ``"all_to_all"``): rows sent to the other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats


def _plan(
    src: Any, dst: Any, seq_len: int, me: int
) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """(send order of local rows, send counts, receive counts, permutation of received rows into dst order)."""
    world = src.world
    owner = torch.empty(seq_len, dtype=torch.long)
    for r in range(world):
        owner[dst.local_positions(seq_len, r)] = r
    mine = src.local_positions(seq_len, me)
    dest = owner[mine]
    send_order = torch.argsort(dest, stable=True)  # rows for rank 0 first, each run in src order
    send = torch.bincount(dest, minlength=world).tolist()
    recv_pos = []
    for r in range(world):
        theirs = src.local_positions(seq_len, r)
        recv_pos.append(theirs[owner[theirs] == me])
    recv = [p.numel() for p in recv_pos]
    arrived = torch.cat(recv_pos)
    target = dst.local_positions(seq_len, me)
    index_of = torch.empty(seq_len, dtype=torch.long)
    index_of[arrived] = torch.arange(arrived.numel())
    return send_order, send, recv, index_of[target]


def _exchange(
    x: torch.Tensor, src: Any, dst: Any, group: Any, me: int, stats: CommStats | None
) -> torch.Tensor:
    seq_len = x.shape[1] * src.world
    order, send, recv, gather = _plan(src, dst, seq_len, me)
    rows = x.transpose(0, 1).index_select(0, order.to(x.device)).contiguous()  # [n, B, ...]
    out = rows.new_empty(rows.shape)
    dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=group)
    if stats is not None:
        stats.record("all_to_all", (rows.numel() - send[me] * rows[0].numel()) * rows.element_size())
    return out.index_select(0, gather.to(x.device)).transpose(0, 1)


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src: Any, dst: Any, group: Any, me: int, stats: CommStats | None):
        ctx.args = (src, dst, group, me, stats)
        return _exchange(x, src, dst, group, me, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        src, dst, group, me, stats = ctx.args
        return _exchange(grad, dst, src, group, me, stats), None, None, None, None, None


def relayout(
    xs: Sequence[torch.Tensor], src: Any, dst: Any, group: Any, me: int, stats: CommStats | None = None
) -> list[torch.Tensor]:
    """Each ``x [B, n, ...]`` from layout ``src`` to layout ``dst`` (same world, this rank = ``me``).

    All tensors travel in ONE exchange (packed along their trailing dims); they must share B, n and dtype.
    """
    if src.world != dst.world:
        raise ValueError(f"relayout between layouts over {src.world} and {dst.world} ranks; they must match")
    if src == dst:
        return list(xs)
    b, n = xs[0].shape[:2]
    flat = [x.reshape(b, n, -1) for x in xs]
    moved = _Relayout.apply(torch.cat(flat, dim=2), src, dst, group, me, stats)
    parts = moved.split([f.shape[2] for f in flat], dim=2)
    return [p.reshape(x.shape) for p, x in zip(parts, xs, strict=True)]
