"""Moving K/V blocks between the ranks of a ring: neighbour exchange and block schedules.

Legend: R = ring degree, R_in / R_out = inner / outer ring sizes of the double ring
(R = R_out · R_in; ring_rank = outer · R_in + inner), n = local tokens, "payload" = a tuple of
tensors moved together (K and V in forward, dK and dV accumulators in backward).

``RingComm``: one ring (ordered member list of a process group). ``exchange(payload)`` posts one
batched isend to the next rank and irecv from the previous one, and returns a ``PendingExchange``
whose ``wait()`` yields the received payload. Receives go into two alternating buffer sets
(double buffering): the payload received at step s is computed on while step s+1 receives into
the other set. A set is allocated when first used, and ``release()`` drops both at the end of every
schedule call, so receive buffers exist only while one attention call runs (nothing is pooled
across layers or steps).

Schedules decide which block a rank holds at each step and when transfers are posted; they are
generators so the attention math (``parallel/ring.py``) stays free of communication:

* ``RingSchedule`` - the single ring (R_out = 1) and the double / hierarchical ring: for each outer
  step the block that arrived on the outer ring circulates the inner ring, while the next outer
  transfer is in flight behind the whole inner loop. Backward re-circulates K/V the same way and
  carries a dK/dV accumulator with each block; after the last step the accumulator arrives at the
  block's owner (one extra send per ring level).
* ``AllGatherSchedule`` - the Llama-3 context-parallel style: all-gather K/V over the ring group,
  compute against every block, reduce-scatter dK/dV back to owners. Suited to irregular packed
  batches and the most accurate (no travelling accumulators).

Bytes sent per rank and layer (b = bytes per element), checked by tests (docs/ring.md "Bytes per rank and layer"):
single ring forward 2(R−1)·B·n·H_kv·D·b; backward the same for K/V plus 2R·B·n·H_kv·D·b_acc for
dK/dV. Tags: gloo matches P2P by tag, so K/V and accumulators use distinct tags.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats

Payload = tuple[torch.Tensor, ...]
# (owner ring rank of the block, the block's tensors)
Block = tuple[int, Payload]

# torch >= 2.11 names; older releases only have the *_tensor spellings (same arguments)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TAG_KV = 11
TAG_GRAD = 12


class PendingExchange:
    """An exchange in flight: ``wait()`` completes the sends and receives and returns the payload."""

    def __init__(self, requests: list[dist.Work], received: Payload) -> None:
        self._requests = requests
        self._received = received

    def wait(self) -> Payload:
        for req in self._requests:
            req.wait()
        self._requests = []
        return self._received


class RingComm:
    """Neighbour exchange on one ring: send to the next member, receive from the previous one.

    Args:
        group: the process group of the ring.
        members: its global ranks in ring order.
        index: this rank's position in ``members``.
        stats: counter that every exchange reports to (kind ``"p2p"``).
    """

    def __init__(
        self, group: object, members: Sequence[int], index: int, stats: CommStats | None = None
    ) -> None:
        if not 0 <= index < len(members):
            raise ValueError(f"ring index {index} is outside the ring of {len(members)} members")
        self.group = group
        self.members = list(members)
        self.index = index
        self.stats = stats
        self._buffers: dict[int, list[Payload | None]] = {}
        self._flip: dict[int, int] = {}

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def next_rank(self) -> int:
        return self.members[(self.index + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.members[(self.index - 1) % self.size]

    def _receive_buffers(self, payload: Payload, tag: int) -> Payload:
        """The next of two alternating buffer sets for payloads of this shape (double buffering),
        allocated when first used."""
        sets = self._buffers.setdefault(tag, [None, None])
        slot = self._flip.get(tag, 0)
        self._flip[tag] = 1 - slot
        got = sets[slot]
        if got is None or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(got, payload)):
            got = sets[slot] = tuple(torch.empty_like(t) for t in payload)
        return got

    def release(self) -> None:
        """Drop the receive buffers (the end of one schedule call); tensors handed out stay valid."""
        self._buffers.clear()
        self._flip.clear()

    def drop(self, tag: int) -> None:
        """Drop the receive buffers of ``tag`` only (nothing receives into them any more in this call)."""
        self._buffers.pop(tag, None)
        self._flip.pop(tag, None)

    def exchange(self, payload: Payload, tag: int = TAG_KV) -> PendingExchange:
        """Post ``payload`` to the next rank and a receive of the same shapes from the previous one.

        The received tensors live in a buffer set that is reused two exchanges later: consume (or
        copy) them before then.
        """
        if self.size == 1:
            raise RuntimeError("a ring of one rank has nothing to exchange (gloo refuses send-to-self)")
        payload = tuple(t.contiguous() for t in payload)
        received = self._receive_buffers(payload, tag)
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group, tag) for t in payload]
        ops += [dist.P2POp(dist.irecv, r, self.prev_rank, self.group, tag) for r in received]
        requests = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.record_tensors("p2p", *payload, peers=[self.next_rank])
        return PendingExchange(requests, received)

    def exchange_each(self, payload: list[torch.Tensor], tag: int) -> PendingExchange:
        """``exchange`` one tensor at a time, emptying ``payload``: each receive is allocated just before
        its transfer, and each sent tensor is dropped once delivered, so one tensor more than the payload
        is alive, not a second payload. Blocking (the exchange is complete on return); the received
        tensors are fresh, never reused by a later exchange.
        """
        if self.size == 1:
            raise RuntimeError("a ring of one rank has nothing to exchange (gloo refuses send-to-self)")
        received = []
        while payload:
            received.append(self._sendrecv(payload.pop(0), tag))  # the sent tensor is freed on return
        return PendingExchange([], tuple(received))

    def _sendrecv(self, sent: torch.Tensor, tag: int) -> torch.Tensor:
        """Send ``sent`` to the next rank and receive one like it from the previous one; blocking. No
        reference to ``sent`` outlives the call (requests and ops are locals)."""
        sent = sent.contiguous()
        got = torch.empty_like(sent)
        ops = [
            dist.P2POp(dist.isend, sent, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, got, self.prev_rank, self.group, tag),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if self.stats is not None:
            self.stats.record_tensors("p2p", sent, peers=[self.next_rank])
        return got


@dataclass
class RingSchedule:
    """Single ring (``outer`` is None or of size 1) or double ring over ``inner`` x ``outer``.

    ``ring_rank = outer.index * inner.size + inner.index``; the block a rank holds at outer step t,
    inner step u belongs to ring rank ``((o - t) mod R_out) * R_in + (i - u) mod R_in``.
    """

    inner: RingComm
    outer: RingComm | None = None
    overlap: bool = True
    _incoming: PendingExchange | None = None

    @property
    def inner_size(self) -> int:
        return self.inner.size

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else self.outer.size

    @property
    def size(self) -> int:
        return self.inner_size * self.outer_size

    @property
    def ring_rank(self) -> int:
        outer_index = 0 if self.outer is None else self.outer.index
        return outer_index * self.inner_size + self.inner.index

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
                acc = _accumulate(inner_acc, grads)
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
                acc = _accumulate(outer_acc, acc) if outer_acc is not None else acc
                outer_acc = self.outer.exchange(tuple(acc), TAG_GRAD)
                acc = []
            if t + 1 < r_out:
                outer_cur = (outer_next or self.outer.exchange(outer_cur)).wait()
        if outer_acc is not None:
            acc = list(outer_acc.wait())
        return tuple(acc)  # receive buffers are released after this call: the caller owns them


def _accumulate(pending: PendingExchange | None, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``received + grads`` (in place into the received tensors), or ``grads`` when nothing is pending;
    ``grads`` is emptied (the result holds what is still needed)."""
    return accumulate_into(None if pending is None else pending.wait(), grads)


def accumulate_into(received: Sequence[torch.Tensor] | None, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``received + grads`` (in place into the received tensors), or ``grads`` when nothing was received;
    ``grads`` is emptied (the result holds what is still needed)."""
    if received is None:
        out = list(grads)
    else:
        out = list(received)
        for r, g in zip(out, grads, strict=True):
            if r is not g:  # ``g is r``: the step added into the arrived accumulator (``incoming()``)
                r.add_(g)
    grads.clear()
    return out


class AllGatherSchedule:
    """All-gather K/V over the ring group; reduce-scatter dK/dV back to the owners.

    Args:
        group: ring process group; members: its global ranks in ring order; index: this rank's
        position; stats: counter (kinds ``"all_gather"`` and ``"reduce_scatter"``).
    """

    def __init__(
        self, group: object, members: Sequence[int], index: int, stats: CommStats | None = None
    ) -> None:
        self.group = group
        self.members = list(members)
        self.index = index
        self.stats = stats

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def ring_rank(self) -> int:
        return self.index

    def _gather(self, kv: Payload) -> list[Payload]:
        """Every rank's payload, indexed by ring rank: one all-gather of the stacked payload."""
        if self.size == 1:
            return [kv]
        stacked = torch.stack(kv)  # [T, ...]: K and V travel in one collective
        out = stacked.new_empty((self.size * len(kv), *stacked.shape[1:]))
        _all_gather_single(out, stacked, group=self.group)
        if self.stats is not None:
            self.stats.record_tensors("all_gather", stacked, peers=self._peers())
        gathered = out.view(self.size, *stacked.shape)
        return [tuple(gathered[j]) for j in range(self.size)]

    def _peers(self) -> list[int]:
        return [m for j, m in enumerate(self.members) if j != self.index]

    def _order(self) -> list[int]:
        """Own block first, then the others (the same order as the ring's first step)."""
        return [(self.index - s) % self.size for s in range(self.size)]

    def forward(self, kv: Payload) -> Iterator[Block]:
        blocks = self._gather(kv)
        for j in self._order():
            yield j, blocks[j]

    def incoming(self) -> None:
        """No accumulator travels: gradients are summed here and reduce-scattered at the end."""
        return None

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        blocks = self._gather(kv)
        sums: torch.Tensor | None = None  # [R, T, ...]: gradients for every owner's payload
        for j in self._order():
            grads = yield j, blocks[j]
            if sums is None:
                sums = grads[0].new_zeros((self.size, len(grads), *grads[0].shape))
            sums[j] += torch.stack(grads)
            grads.clear()
        assert sums is not None
        if self.size == 1:
            return tuple(sums[0])
        local = sums.new_empty(sums.shape[1:])
        _reduce_scatter_single(local, sums.flatten(0, 1), group=self.group)  # dK and dV in one collective
        if self.stats is not None:
            self.stats.record_tensors("reduce_scatter", local, peers=self._peers())
        return tuple(local)
