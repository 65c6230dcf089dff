"""Differentiable sequence <-> head all-to-all over the Ulysses group (ALGORITHMS.md §2, §8).

Legend: U = Ulysses degree (group size), u = this rank's index in the group, n = local tokens
before the exchange, B = batch, D = head dim, H / H_kv = query / key-value heads.

``seq_to_head``: ``[B, n, H, D]`` (all heads of n tokens) -> ``[B, U·n, h_u, D]`` (h_u heads of the
U·n tokens of the whole group, concatenated in group-rank order). ``head_to_seq`` is its inverse,
and each is the other's backward. Both take several tensors at once and move them in ONE
``all_to_all_single`` (q, k and v of a layer: one call forward, one backward). Head counts need not divide U: rank u gets ``counts[u]`` heads
(uneven ``all_to_all_single`` split sizes), so the only hard limit is U <= H.

GQA (``HeadPlan``): rank u's query heads are a contiguous range; the K/V heads it needs are the
groups of those query heads. When every rank's query heads cover whole GQA groups, or lie inside
one group, only the needed K/V heads move (with U > H_kv each K/V head is replicated to the U/H_kv
ranks that need it, and autograd sums the replicas' gradients back). Otherwise (uneven splits that
cut groups unevenly) K/V heads are expanded to one per query head for that exchange.

Bytes recorded (kind ``"all_to_all"``): what this rank sends to the other U-1 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats


def split_heads(num_heads: int, degree: int) -> list[int]:
    """Heads per rank: as even as possible, the first ``num_heads % degree`` ranks get one more."""
    if degree < 1 or num_heads < degree:
        raise ValueError(
            f"ulysses degree U={degree} exceeds the number of heads H={num_heads}; valid: U <= {num_heads} "
            "(move the rest of the SP degree to the ring)"
        )
    base, extra = divmod(num_heads, degree)
    return [base + (1 if u < extra else 0) for u in range(degree)]


@dataclass(frozen=True)
class HeadPlan:
    """Which query and K/V heads each Ulysses rank owns after the all-to-all.

    Attributes:
        q_counts: query heads per rank (contiguous ranges in rank order).
        kv_index: K/V head indices to gather before the exchange (rank 0's heads first), or None
            when the K/V heads split in place without replication.
        kv_counts: K/V heads per rank after the gather.
    """

    num_heads: int
    num_kv_heads: int
    degree: int
    q_counts: tuple[int, ...]
    kv_index: tuple[int, ...] | None
    kv_counts: tuple[int, ...]

    @classmethod
    def build(cls, num_heads: int, num_kv_heads: int, degree: int) -> HeadPlan:
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"query heads H={num_heads} must be a multiple of key/value heads H_kv={num_kv_heads}"
            )
        q_counts = split_heads(num_heads, degree)
        group = num_heads // num_kv_heads
        kv_index: list[int] = []
        kv_counts: list[int] = []
        start = 0
        for count in q_counts:
            heads = list(range(start, start + count))
            start += count
            needed = sorted({h // group for h in heads})
            # uniform local GQA: every needed K/V head serves the same number of this rank's queries
            uniform = count % len(needed) == 0 and all(
                sum(1 for h in heads if h // group == kv) == count // len(needed) for kv in needed
            )
            chosen = needed if uniform else [h // group for h in heads]
            kv_index.extend(chosen)
            kv_counts.append(len(chosen))
        in_place = kv_index == list(range(num_kv_heads))
        return cls(
            num_heads,
            num_kv_heads,
            degree,
            tuple(q_counts),
            None if in_place else tuple(kv_index),
            tuple(kv_counts),
        )


# Several tensors (q, k, v) travel in ONE all_to_all_single: the chunk for rank u is the
# concatenation, along the head dim, of every tensor's heads for rank u.
Counts = tuple[tuple[int, ...], ...]  # per tensor: heads per group rank


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, counts: Counts, group: Any, me: int, stats: CommStats | None, *xs: torch.Tensor):
        ctx.args = (counts, group, me, stats)
        return tuple(_seq_to_head(list(xs), counts, group, me, stats))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        return (None, None, None, None, *_head_to_seq(list(grads), *ctx.args))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, counts: Counts, group: Any, me: int, stats: CommStats | None, *ys: torch.Tensor):
        ctx.args = (counts, group, me, stats)
        return tuple(_head_to_seq(list(ys), counts, group, me, stats))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        return (None, None, None, None, *_seq_to_head(list(grads), *ctx.args))


def _seq_to_head(
    xs: list[torch.Tensor], counts: Counts, group: Any, me: int, stats: CommStats | None
) -> list[torch.Tensor]:
    """Each ``[B, n, H_i, D]`` -> ``[B, U·n, counts[i][me], D]``, in one all-to-all."""
    degree = len(counts[0])
    if degree == 1:
        return xs
    b, n, _, d = xs[0].shape
    heads_first = [x.permute(2, 0, 1, 3) for x in xs]  # [H_i, B, n, D]
    starts = [[sum(c[:u]) for u in range(degree)] for c in counts]
    send = torch.cat(
        [hf[st[u] : st[u] + c[u]] for u in range(degree) for hf, c, st in zip(heads_first, counts, starts)]
    )
    to_rank = [sum(c[u] for c in counts) for u in range(degree)]
    mine = to_rank[me]
    recv = send.new_empty(degree * mine, b, n, d)
    dist.all_to_all_single(recv, send, [mine] * degree, to_rank, group=group)
    if stats is not None:
        stats.record("all_to_all", (send.shape[0] - mine) * b * n * d * send.element_size())
    recv = recv.view(degree, mine, b, n, d)
    outs, offset = [], 0
    for c in counts:
        part = recv[:, offset : offset + c[me]]  # [U, c_me, B, n, D] -> [B, U·n, c_me, D]
        outs.append(part.permute(2, 0, 3, 1, 4).reshape(b, degree * n, c[me], d))
        offset += c[me]
    return outs


def _head_to_seq(
    ys: list[torch.Tensor], counts: Counts, group: Any, me: int, stats: CommStats | None
) -> list[torch.Tensor]:
    """Each ``[B, U·n, counts[i][me], D]`` -> ``[B, n, H_i, D]``, in one all-to-all."""
    degree = len(counts[0])
    if degree == 1:
        return ys
    b, un, _, d = ys[0].shape
    n = un // degree
    # chunk for source rank u: every tensor's tokens of rank u, heads first: [U, sum_i c_me, B, n, D]
    send = torch.cat([y.view(b, degree, n, y.shape[2], d).permute(1, 3, 0, 2, 4) for y in ys], dim=1)
    mine = send.shape[1]
    from_rank = [sum(c[u] for c in counts) for u in range(degree)]
    recv = send.new_empty(sum(from_rank), b, n, d)
    dist.all_to_all_single(
        recv, send.reshape(degree * mine, b, n, d), from_rank, [mine] * degree, group=group
    )
    if stats is not None:
        stats.record("all_to_all", (degree - 1) * mine * b * n * d * send.element_size())
    # recv holds, per source rank u, [heads of tensor 0 | tensor 1 | ...] for rank u
    pieces: list[list[torch.Tensor]] = [[] for _ in counts]
    offset = 0
    for u in range(degree):
        for i, c in enumerate(counts):
            pieces[i].append(recv[offset : offset + c[u]])
            offset += c[u]
    return [torch.cat(p).permute(1, 2, 0, 3) for p in pieces]  # [H_i, B, n, D] -> [B, n, H_i, D]


def seq_to_head(
    xs: Sequence[torch.Tensor],
    counts: Sequence[Sequence[int]],
    group: Any,
    me: int,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, ...]:
    """All-to-all over ``group``: each ``[B, n, H_i, D]`` -> ``[B, U·n, counts[i][me], D]`` (differentiable).

    All tensors travel in one collective (q, k and v of a layer cost one call, not three).

    Args:
        xs: this rank's n tokens of each tensor, all heads (same B, n, D, dtype).
        counts: per tensor, heads per group rank after the exchange (sum = H_i).
        group: the Ulysses process group; me: this rank's index in it.
    """
    counts_t = tuple(tuple(c) for c in counts)
    for x, c in zip(xs, counts_t, strict=True):
        if (
            x.dim() != 4
            or x.shape[2] != sum(c)
            or x.shape[:2] != xs[0].shape[:2]
            or x.shape[3] != xs[0].shape[3]
        ):
            raise ValueError(
                f"seq_to_head takes [B, n, H, D] tensors sharing B, n, D, with H = {sum(c)} heads here; "
                f"got {tuple(x.shape)}"
            )
    return _SeqToHead.apply(counts_t, group, me, stats, *xs)


def head_to_seq(
    ys: Sequence[torch.Tensor],
    counts: Sequence[Sequence[int]],
    group: Any,
    me: int,
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`seq_to_head`: each ``[B, U·n, counts[i][me], D]`` -> ``[B, n, H_i, D]``."""
    counts_t = tuple(tuple(c) for c in counts)
    degree = len(counts_t[0])
    for y, c in zip(ys, counts_t, strict=True):
        if y.dim() != 4 or y.shape[2] != c[me] or y.shape[1] % degree != 0:
            raise ValueError(
                f"head_to_seq takes [B, U·n, {c[me]}, D] with U·n divisible by U={degree}; got {tuple(y.shape)}"
            )
    return _HeadToSeq.apply(counts_t, group, me, stats, *ys)
