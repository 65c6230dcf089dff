"""Differentiable sequence <-> head all-to-all over the Ulysses group (docs/attention.md "What happens", "Bytes per rank and layer").

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

from collections.abc import Callable, Sequence
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


Starts = tuple[tuple[int, ...], ...]  # per tensor: the first head of each group rank's heads


def _contiguous_starts(counts: Counts) -> Starts:
    """Rank u's heads follow rank u-1's: the split of one tensor over the group."""
    return tuple(tuple(sum(c[:u]) for u in range(len(c))) for c in counts)


def _per_rank(counts: Counts) -> list[int]:
    """Heads of all tensors together, per group rank."""
    return [sum(c[u] for c in counts) for u in range(len(counts[0]))]


class PendingExchange:
    """An all-to-all in flight (``async_op=True``) or already done; ``wait()`` returns its tensors."""

    def __init__(
        self, work: Any, unpack: Callable[[], list[torch.Tensor]], send: torch.Tensor | None = None
    ) -> None:
        self._work, self._unpack = work, unpack
        self._send = send  # the send buffer must live until the exchange is done

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
        self._work = self._send = None  # the work object holds the buffers too: both go
        return self._unpack()


# Chunk layout on the wire: token-major ``[B, n, heads, D]``, the heads of every tensor side by side.
# With B = 1 the U chunks a rank receives in seq_to_head are already ``[1, U·n, heads, D]`` in token
# order, so q, k and v come out as views of the receive buffer (no copy), and head_to_seq sends a
# single kernel output as it is.


def post_seq_to_head(
    xs: Sequence[torch.Tensor],
    counts: Counts,
    group: Any,
    me: int,
    stats: CommStats | None = None,
    starts: Starts | None = None,
    async_op: bool = False,
) -> PendingExchange:
    """Start the all-to-all that takes each ``[B, n, H_i, D]`` to ``[B, U·n, counts[i][me], D]``.

    Rank u gets heads ``starts[i][u] : starts[i][u] + counts[i][u]`` of tensor i (default: the
    contiguous split). Not differentiable (see :func:`seq_to_head`). A tensor with no heads for any
    rank comes out with 0 heads.
    """
    degree = len(counts[0])
    starts = _contiguous_starts(counts) if starts is None else starts
    if degree == 1:
        outs = [x[:, :, st[0] : st[0] + c[0]] for x, c, st in zip(xs, counts, starts)]
        return PendingExchange(None, lambda: outs)
    b, n, _, d = xs[0].shape
    to_rank = _per_rank(counts)
    token = b * n * d  # elements per head of one chunk
    send = xs[0].new_empty(sum(to_rank) * token)
    offset = 0
    for u in range(degree):
        chunk = send[offset : offset + to_rank[u] * token].view(b, n, to_rank[u], d)
        head = 0
        for x, c, st in zip(xs, counts, starts):
            chunk[:, :, head : head + c[u]].copy_(x[:, :, st[u] : st[u] + c[u]])
            head += c[u]
        offset += to_rank[u] * token
    mine = to_rank[me]
    recv = send.new_empty(degree * mine * token)
    work = dist.all_to_all_single(
        recv, send, [mine * token] * degree, [t * token for t in to_rank], group=group, async_op=async_op
    )
    if stats is not None:
        stats.record("all_to_all", (send.numel() - mine * token) * send.element_size())

    def unpack() -> list[torch.Tensor]:
        if b == 1:
            full = recv.view(1, degree * n, mine, d)  # already in token order
        else:
            full = recv.view(degree, b, n, mine, d).transpose(0, 1).reshape(b, degree * n, mine, d)
        outs, head = [], 0
        for c in counts:
            outs.append(full[:, :, head : head + c[me]])
            head += c[me]
        return outs

    return PendingExchange(work, unpack, send)


def post_head_to_seq(
    ys: Sequence[torch.Tensor],
    counts: Counts,
    group: Any,
    me: int,
    stats: CommStats | None = None,
    into: Sequence[tuple[torch.Tensor, tuple[int, ...]]] | None = None,
    async_op: bool = False,
) -> PendingExchange:
    """Start the inverse all-to-all: each ``[B, U·n, counts[i][me], D]`` -> ``[B, n, H_i, D]``.

    ``into``: per tensor, ``(out [B, n, H, D], starts)``: the heads from rank u are written to
    ``out[:, :, starts[u] : starts[u] + counts[i][u]]`` (default: a new tensor, contiguous split).
    Not differentiable (see :func:`head_to_seq`).
    """
    degree = len(counts[0])
    b, un, _, d = ys[0].shape
    n = un // degree
    targets, dtype, device = into, ys[0].dtype, ys[0].device

    def outputs() -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        # allocated when the received data is unpacked, after the send buffer is gone: the outputs,
        # the send and the receive buffer are never alive at once (docs/memory.md "Attention buffers")
        if targets is not None:
            return list(targets)
        return [
            (torch.empty(b, n, sum(c), d, dtype=dtype, device=device), st)
            for c, st in zip(counts, _contiguous_starts(counts))
        ]

    if degree == 1:
        into = outputs()
        for y, c, (out, st) in zip(ys, counts, into):
            out[:, :, st[0] : st[0] + c[0]].copy_(y)
        return PendingExchange(None, lambda: [out for out, _ in into])
    from_rank = _per_rank(counts)
    mine = from_rank[me]
    token = b * n * d
    if len(ys) == 1 and b == 1 and ys[0].is_contiguous():
        send = ys[0].view(-1)  # the chunk for rank u is tokens u·n ... (u+1)·n - 1: already in place
    else:
        send = ys[0].new_empty(degree * mine * token)
        chunks = send.view(degree, b, n, mine, d)
        head = 0
        for y, c in zip(ys, counts):
            chunks[..., head : head + c[me], :].copy_(y.unflatten(1, (degree, n)).transpose(0, 1))
            head += c[me]
    recv = send.new_empty(sum(from_rank) * token)
    work = dist.all_to_all_single(
        recv, send, [t * token for t in from_rank], [mine * token] * degree, group=group, async_op=async_op
    )
    if stats is not None:
        stats.record("all_to_all", (degree - 1) * mine * token * send.element_size())

    def unpack() -> list[torch.Tensor]:
        into = outputs()
        offset = 0
        for u in range(degree):
            chunk = recv[offset : offset + from_rank[u] * token].view(b, n, from_rank[u], d)
            head = 0
            for c, (out, st) in zip(counts, into):
                out[:, :, st[u] : st[u] + c[u]].copy_(chunk[:, :, head : head + c[u]])
                head += c[u]
            offset += from_rank[u] * token
        return [out for out, _ in into]

    return PendingExchange(work, unpack, send)


def _seq_to_head(
    xs: list[torch.Tensor], counts: Counts, group: Any, me: int, stats: CommStats | None
) -> list[torch.Tensor]:
    return xs if len(counts[0]) == 1 else post_seq_to_head(xs, counts, group, me, stats).wait()


def _head_to_seq(
    ys: list[torch.Tensor], counts: Counts, group: Any, me: int, stats: CommStats | None
) -> list[torch.Tensor]:
    return ys if len(counts[0]) == 1 else post_head_to_seq(ys, counts, group, me, stats).wait()


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
