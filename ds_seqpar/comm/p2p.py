"""Moving tensors between the neighbours of a ring: the exchange primitive every ring schedule uses.

Legend: R = ring degree, n = local tokens, "payload" = a tuple of tensors moved together (K and V in
forward, dK and dV accumulators in backward).

``RingComm``: one ring (ordered member list of a process group). ``exchange(payload)`` posts one
batched isend to the next rank and irecv from the previous one, and returns a ``PendingExchange``
whose ``wait()`` yields the received payload. Receives go into two alternating buffer sets
(double buffering): the payload received at step s is computed on while step s+1 receives into
the other set. A set is allocated when first used, and ``release()`` drops both at the end of every
schedule call, so receive buffers exist only while one attention call runs (nothing is pooled
across layers or steps). ``exchange_each`` moves a payload one tensor at a time (accumulators).

The schedules built on it live in ``comm/schedules/`` (one module each). Tags: gloo matches P2P by
tag, so K/V and accumulators use distinct tags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats

Payload = tuple[torch.Tensor, ...]
# (owner index of the block in the plan's K/V layout, the block's tensors)
Block = tuple[int, Payload]

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


def accumulate_pending(pending: PendingExchange | None, grads: list[torch.Tensor]) -> list[torch.Tensor]:
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
