"""How K/V blocks travel around the ring axis: the ``Schedule`` protocol and its registry.

A schedule owns the communication of one ring attention call; the engine (``parallel/ring.py``) only
iterates it and never calls a collective itself:

    forward(kv)   yields ``(owner, kv_block)``: the ring rank whose K/V block this rank holds at each
                  step, and that block (this rank's own block first)
    backward(kv)  a generator: yields ``(owner, kv_block)`` like ``forward``, receives via ``send`` the
                  gradients this rank computed for that block (a list it empties: it owns them from there),
                  and returns this rank's own K/V gradients once every contribution has arrived
    incoming()    during a backward step: the gradient accumulator that arrived with the current block
                  (the step may add into it in place and send it back), or None

Registered: ``p2p`` (single ring, or the double ring when ``ring.inner_size`` < R; overlap of transfer
and compute optional) and ``all_gather`` (Llama-3 style). A new schedule is a class with this
interface plus one entry in :data:`SCHEDULES` (docs/architecture.md, "How to add a schedule").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import torch

from ds_seqpar.comm.p2p import AllGatherSchedule, Block, Payload, RingComm, RingSchedule


class Schedule(Protocol):
    """The interface the ring engine iterates (see the module docstring)."""

    @property
    def size(self) -> int: ...

    @property
    def ring_rank(self) -> int: ...

    def forward(self, kv: Payload) -> Iterator[Block]: ...

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]: ...

    def incoming(self) -> Payload | None: ...


def _p2p(mesh: Any, overlap: bool) -> Schedule:
    c, stats = mesh.coords, mesh.comm_stats
    if mesh.ring_inner_size == mesh.ring_size:
        return RingSchedule(
            RingComm(mesh.group("ring"), mesh.members["ring"], c.ring_rank, stats), None, overlap
        )
    inner = RingComm(mesh.group("ring_inner"), mesh.members["ring_inner"], c.ring_inner_rank, stats)
    outer = RingComm(mesh.group("ring_outer"), mesh.members["ring_outer"], c.ring_outer_rank, stats)
    return RingSchedule(inner, outer, overlap)


def _all_gather(mesh: Any, overlap: bool) -> Schedule:
    return AllGatherSchedule(mesh.group("ring"), mesh.members["ring"], mesh.coords.ring_rank, mesh.comm_stats)


SCHEDULES: dict[str, Callable[[Any, bool], Schedule]] = {"p2p": _p2p, "all_gather": _all_gather}
"""``sequence_parallel.ring.schedule`` name -> builder ``(mesh, overlap) -> Schedule``."""


def build_schedule(mesh: Any, kind: str = "p2p", overlap: bool = True) -> Schedule:
    """The schedule ``kind`` over ``mesh``'s ring axis (a ``SeqParMesh``; its ``ring_inner`` /
    ``ring_outer`` groups define the double ring).

    Args:
        kind: a name in :data:`SCHEDULES`.
        overlap: overlap transfers with compute (p2p only).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"ring schedule {kind!r} is unknown; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[kind](mesh, overlap)
