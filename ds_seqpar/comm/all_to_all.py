"""Differentiable sequence <-> head all-to-all over the Ulysses group (ALGORITHMS.md §2, §8).

Legend: U = Ulysses degree (group size), u = this rank's index in the group, n = local tokens
before the exchange, B = batch, D = head dim, H / H_kv = query / key-value heads.

``seq_to_head``: ``[B, n, H, D]`` (all heads of n tokens) -> ``[B, U·n, h_u, D]`` (h_u heads of the
U·n tokens of the whole group, concatenated in group-rank order). ``head_to_seq`` is its inverse,
and each is the other's backward. Head counts need not divide U: rank u gets ``counts[u]`` heads
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


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, counts: tuple[int, ...], group: Any, me: int, stats: CommStats | None
    ):
        ctx.counts, ctx.group, ctx.me, ctx.stats = counts, group, me, stats
        return _seq_to_head(x, counts, group, me, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _head_to_seq(grad, ctx.counts, ctx.group, ctx.me, ctx.stats), None, None, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, counts: tuple[int, ...], group: Any, me: int, stats: CommStats | None
    ):
        ctx.counts, ctx.group, ctx.me, ctx.stats = counts, group, me, stats
        return _head_to_seq(y, counts, group, me, stats)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _seq_to_head(grad, ctx.counts, ctx.group, ctx.me, ctx.stats), None, None, None, None


def _record(stats: CommStats | None, sent_elements: int, element_size: int) -> None:
    if stats is not None:
        stats.record("all_to_all", sent_elements * element_size)


def _seq_to_head(
    x: torch.Tensor, counts: Sequence[int], group: Any, me: int, stats: CommStats | None
) -> torch.Tensor:
    """``[B, n, H, D]`` -> ``[B, U·n, counts[me], D]``."""
    b, n, h, d = x.shape
    degree = len(counts)
    if degree == 1:
        return x
    send = x.permute(2, 0, 1, 3).contiguous()  # [H, B, n, D]: heads on dim 0, split by counts
    recv = send.new_empty(degree * counts[me], b, n, d)
    dist.all_to_all_single(recv, send, [counts[me]] * degree, list(counts), group=group)
    _record(stats, (h - counts[me]) * b * n * d, x.element_size())
    # [U, h_me, B, n, D] -> [B, U, n, h_me, D] -> [B, U·n, h_me, D]
    return recv.view(degree, counts[me], b, n, d).permute(2, 0, 3, 1, 4).reshape(b, degree * n, counts[me], d)


def _head_to_seq(
    y: torch.Tensor, counts: Sequence[int], group: Any, me: int, stats: CommStats | None
) -> torch.Tensor:
    """``[B, U·n, counts[me], D]`` -> ``[B, n, H, D]``."""
    degree = len(counts)
    if degree == 1:
        return y
    b, un, hm, d = y.shape
    n = un // degree
    send = y.view(b, degree, n, hm, d).permute(1, 3, 0, 2, 4).contiguous()  # [U, h_me, B, n, D]
    recv = send.new_empty(sum(counts), b, n, d)
    dist.all_to_all_single(recv, send.view(degree * hm, b, n, d), list(counts), [hm] * degree, group=group)
    _record(stats, (degree - 1) * hm * b * n * d, y.element_size())
    return recv.permute(1, 2, 0, 3)  # [B, n, H, D]


def seq_to_head(
    x: torch.Tensor, counts: Sequence[int], group: Any, me: int, stats: CommStats | None = None
) -> torch.Tensor:
    """All-to-all ``[B, n, H, D]`` -> ``[B, U·n, counts[me], D]`` over ``group`` (differentiable).

    Args:
        x: this rank's n tokens with all H = sum(counts) heads.
        counts: heads per group rank after the exchange.
        group: the Ulysses process group; me: this rank's index in it.
    """
    if x.dim() != 4 or x.shape[2] != sum(counts):
        raise ValueError(f"seq_to_head takes [B, n, H, D] with H = {sum(counts)} heads; got {tuple(x.shape)}")
    return _SeqToHead.apply(x, tuple(counts), group, me, stats)


def head_to_seq(
    y: torch.Tensor, counts: Sequence[int], group: Any, me: int, stats: CommStats | None = None
) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``[B, U·n, counts[me], D]`` -> ``[B, n, H, D]`` (differentiable)."""
    if y.dim() != 4 or y.shape[2] != counts[me] or y.shape[1] % len(counts) != 0:
        raise ValueError(
            f"head_to_seq takes [B, U·n, {counts[me]}, D] with U·n divisible by U={len(counts)}; got {tuple(y.shape)}"
        )
    return _HeadToSeq.apply(y, tuple(counts), group, me, stats)
