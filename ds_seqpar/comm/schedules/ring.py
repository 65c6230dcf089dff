"""``p2p``: the single ring and the double (hierarchical) ring of isend/irecv (docs/ring.md "Schedules").

Legend: R = ring degree, R_in / R_out = inner / outer ring sizes of the double ring (R = R_out · R_in;
ring_rank = outer · R_in + inner), E_kv = B·n·h_kv·D, b / a bytes per element of K/V / of accumulators.

For each outer step the block that arrived on the outer ring circulates the inner ring, while the next
outer transfer is in flight behind the whole inner loop. Backward re-circulates K/V the same way and
carries a dK/dV accumulator with each block; after the last step the accumulator arrives at the block's
owner (one extra send per ring level).

Bytes per peer (docs/comm_model.md): to the inner next R_out·(R_in − 1)·2E_kv·b forward, backward the
same + [R_in > 1]·R·2E_kv·a; to the outer next (R_out − 1)·2E_kv·b, backward + [R_out > 1]·R_out·2E_kv·a.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import TAG_GRAD, TAG_KV, Block, Payload, PendingExchange, RingComm, accumulate_pending
from ds_seqpar.comm.schedules.base import NestedRing, RingParams, ScheduleSpec, split_domain

__all__ = ["RingSchedule", "RingSpec", "double_ring_peers", "ring_comms"]


@dataclass
class RingSchedule(NestedRing):
    """Single ring (``outer`` is None or of size 1) or double ring over ``inner`` x ``outer``.

    ``ring_rank = outer.index * inner.size + inner.index``; the block a rank holds at outer step t,
    inner step u belongs to ring rank ``((o - t) mod R_out) * R_in + (i - u) mod R_in``.
    """

    inner: RingComm
    outer: RingComm | None = None
    overlap: bool = True
    _incoming: PendingExchange | None = None

    def owner(self, t: int, u: int) -> int:
        """Ring rank whose block this rank holds at outer step ``t``, inner step ``u``."""
        o = 0 if self.outer is None else self.outer.index
        return ((o - t) % self.outer_size) * self.inner_size + (self.inner.index - u) % self.inner_size

    def _rings(self) -> list[RingComm]:
        return [self.inner] if self.outer is None else [self.inner, self.outer]

    def _release(self) -> None:
        for ring in self._rings():
            ring.release()

    def incoming(self) -> Payload | None:
        """The dK/dV accumulator that travelled here with the block being computed on (waits for it),
        for the step's gradients to be added into in place; None when the block's accumulator starts
        at this step. Gradients sent back may then be these very tensors (nothing is added twice)."""
        return None if self._incoming is None else self._incoming.wait()

    def forward(self, kv: Payload) -> Iterator[Block]:
        """Yield every ring rank's K/V block once, starting with this rank's own."""
        try:
            yield from self._forward(kv)
        finally:
            self._release()

    def _forward(self, kv: Payload) -> Iterator[Block]:
        r_in, r_out = self.inner_size, self.outer_size
        outer_cur = kv
        for t in range(r_out):
            outer_next = None
            if t + 1 < r_out and self.overlap:
                outer_next = self.outer.exchange(outer_cur)  # hidden behind the whole inner loop
            cur = outer_cur
            for u in range(r_in):
                inner_next = None
                if u + 1 < r_in and self.overlap:
                    inner_next = self.inner.exchange(cur)
                yield self.owner(t, u), cur
                if u + 1 < r_in:
                    cur = (inner_next or self.inner.exchange(cur)).wait()
            if t + 1 < r_out:
                outer_cur = (outer_next or self.outer.exchange(outer_cur)).wait()

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        """Yield every block again; ``send()`` back its gradients; return this rank's own block gradients.

        The gradient accumulator of a block travels with it around the inner ring and returns to
        the rank that brought it in from the outer ring, then travels the outer ring to its owner.
        Gradients are sent back as a list that the schedule empties (it owns them from there, so
        the engine holds no reference while they travel); they must be fresh tensors (they are
        accumulated into in place), or the tensors ``incoming()`` returned for this step, already
        holding the step's gradients. The inner ring moves them one tensor at a time
        (``RingComm.exchange_each``), and a block nothing computes on any more is dropped before
        its accumulator moves on.
        """
        try:
            return (yield from self._backward(kv))
        finally:
            self._incoming = None
            self._release()

    def _backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        r_in, r_out = self.inner_size, self.outer_size
        outer_cur: Payload | None = kv
        outer_acc: PendingExchange | None = None
        acc: list[torch.Tensor] = []
        for t in range(r_out):
            outer_next = None
            if t + 1 < r_out and self.overlap:
                outer_next = self.outer.exchange(outer_cur)
            cur = outer_cur
            if t + 1 == r_out:  # the last outer block: the inner ring holds the only reference
                outer_cur = None
                if self.outer is not None:
                    self.outer.drop(TAG_KV)
            inner_acc: PendingExchange | None = None
            for u in range(r_in):
                inner_next = None
                if u + 1 < r_in and self.overlap:
                    inner_next = self.inner.exchange(cur)
                self._incoming = inner_acc
                grads = yield self.owner(t, u), cur
                self._incoming = None
                acc = accumulate_pending(inner_acc, grads)
                inner_acc = None
                if u + 1 < r_in:  # first the next block (its send copies go before dK/dV buffers come)
                    cur = (inner_next or self.inner.exchange(cur)).wait()
                else:  # the loop's last block: nothing computes on it any more
                    cur = None
                    self.inner.drop(TAG_KV)
                if r_in > 1:  # the accumulator follows its block; the last send returns it home
                    inner_acc = self.inner.exchange_each(acc, TAG_GRAD)
            if inner_acc is not None:
                acc = list(inner_acc.wait())
                inner_acc = None
            if r_out > 1:
                # the inner ring's received tensors are fresh: the outer send may hold them as they are
                acc = accumulate_pending(outer_acc, acc) if outer_acc is not None else acc
                outer_acc = self.outer.exchange(tuple(acc), TAG_GRAD)
                acc = []
            if t + 1 < r_out:
                outer_cur = (outer_next or self.outer.exchange(outer_cur)).wait()
        if outer_acc is not None:
            acc = list(outer_acc.wait())
        return tuple(acc)  # receive buffers are released after this call: the caller owns them


def double_ring_peers(ring: int, rank: int, inner: int | None = None) -> tuple[int, int]:
    """(inner next, outer next) of ring rank ``rank`` = o·R_in + i: o·R_in + (i+1) % R_in and
    ((o+1) % R_out)·R_in + i. Single ring (``inner`` None or R): inner next = (r+1) % R, outer = r."""
    r_in, r_out = split_domain(ring, inner, "inner")
    o, i = divmod(rank, r_in)
    return o * r_in + (i + 1) % r_in, ((o + 1) % r_out) * r_in + i


def ring_comms(mesh: Any) -> tuple[RingComm, RingComm | None]:
    """The mesh's ring as ``(inner, outer)`` neighbour exchanges: ``(ring, None)`` for a single ring, else
    the double ring's ``ring_inner`` and ``ring_outer`` groups."""
    c, stats = mesh.coords, mesh.comm_stats
    if mesh.ring_inner_size == mesh.ring_size:
        return RingComm(mesh.group("ring"), mesh.members["ring"], c.ring_rank, stats), None
    inner = RingComm(mesh.group("ring_inner"), mesh.members["ring_inner"], c.ring_inner_rank, stats)
    outer = RingComm(mesh.group("ring_outer"), mesh.members["ring_outer"], c.ring_outer_rank, stats)
    return inner, outer


class RingSpec(ScheduleSpec):
    """The ``p2p`` schedule: single ring, or the double ring when ``ring.inner_size`` < R."""

    name = "p2p"
    summary = "ring / double ring of isend/irecv"
    double_ring = True
    sparse_ring = True

    def build(self, mesh: Any, params: RingParams) -> RingSchedule:
        inner, outer = ring_comms(mesh)
        return RingSchedule(inner, outer, params.overlap)

    def cache_key(self, params: RingParams) -> tuple:
        return (self.name, params.overlap)

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        ring = params.ring
        r_in, r_out = split_domain(ring, params.inner, "inner")
        inner_next, outer_next = double_ring_peers(ring, rank, params.inner)
        kv, out = 2 * shape.kv_elements, {}
        add_bytes(out, rank, inner_next, "p2p", r_out * (r_in - 1) * kv * shape.element_bytes)
        add_bytes(out, rank, outer_next, "p2p", (r_out - 1) * kv * shape.element_bytes)
        if backward:
            add_bytes(out, rank, inner_next, "p2p", (ring * kv * shape.acc_bytes) if r_in > 1 else 0)
            add_bytes(out, rank, outer_next, "p2p", (r_out * kv * shape.acc_bytes) if r_out > 1 else 0)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        """Forward R − 1 (R_out·(R_in − 1) inner hops + R_out − 1 outer hops, the outer one in flight behind
        the inner loop); backward R − 1 + [R_in > 1] + [R_out > 1] (accumulators ride with the K/V of the
        next hop, except the last inner return and the last outer return)."""
        r_in, r_out = split_domain(params.ring, params.inner, "inner")
        return chain_rounds(params.ring, r_in, r_out, backward)


def chain_rounds(ring: int, r_in: int, r_out: int, backward: bool) -> int:
    """Rounds of a two-level chain of R_in x R_out hops (the ring family: ``p2p`` and ``tasp``)."""
    return ring - 1 + ((r_in > 1) + (r_out > 1) if backward else 0)
