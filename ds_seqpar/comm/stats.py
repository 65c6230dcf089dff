"""Bytes and messages sent per collective kind, per rank.

Every communication primitive in ``ds_seqpar.comm`` reports what this rank injects into the
network through a ``CommStats`` object (the one owned by the ``SeqParMesh``; no global counter)::

    with mesh.comm_stats.measure() as region:
        out = attention(q, k, v, mesh=mesh)
    region.bytes("all_to_all"), region.total_bytes

Conventions: "bytes" are the bytes this rank sends (all-to-all: the chunks for the other ranks;
P2P: the payload of its isends; all-gather: its own shard times (group size - 1)), so they can be
compared with the per-rank formulas in docs/attention.md, docs/ring.md and docs/linear.md. A "message" is one call of a primitive.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class CommCounter:
    """Running totals for one collective kind."""

    bytes: int = 0
    messages: int = 0


@dataclass
class CommRegion:
    """Totals of the region measured by ``CommStats.measure()``, filled in when the region ends."""

    counters: dict[str, CommCounter] = field(default_factory=dict)

    def bytes(self, kind: str) -> int:
        """Bytes of one kind sent in the region (0 if none)."""
        return self.counters.get(kind, CommCounter()).bytes

    def messages(self, kind: str) -> int:
        """Calls of one kind in the region (0 if none)."""
        return self.counters.get(kind, CommCounter()).messages

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.counters.values())

    @property
    def total_messages(self) -> int:
        return sum(c.messages for c in self.counters.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"bytes": c.bytes, "messages": c.messages} for k, c in sorted(self.counters.items())}


class CommStats:
    """Per-rank counters of bytes and messages, keyed by collective kind (``"all_to_all"``, ``"p2p"``...)."""

    def __init__(self) -> None:
        self._counters: dict[str, CommCounter] = {}

    def record(self, kind: str, nbytes: int, messages: int = 1) -> None:
        """Add ``nbytes`` sent and ``messages`` calls to the counter of ``kind``."""
        if nbytes < 0 or messages < 0:
            raise ValueError(
                f"negative communication volume: kind={kind!r} bytes={nbytes} messages={messages}"
            )
        counter = self._counters.setdefault(kind, CommCounter())
        counter.bytes += int(nbytes)
        counter.messages += int(messages)

    def record_tensors(self, kind: str, *tensors: torch.Tensor, copies: int = 1) -> None:
        """Record one message carrying ``tensors``, each sent ``copies`` times (e.g. to R-1 peers)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * copies
        self.record(kind, nbytes, 1)

    def snapshot(self) -> dict[str, CommCounter]:
        """A copy of the current totals."""
        return {k: CommCounter(c.bytes, c.messages) for k, c in self._counters.items()}

    def reset(self) -> None:
        self._counters.clear()

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self._counters.values())

    @contextmanager
    def measure(self) -> Iterator[CommRegion]:
        """Measure a region: the yielded ``CommRegion`` holds the region's totals once it exits."""
        before = self.snapshot()
        region = CommRegion()
        try:
            yield region
        finally:
            for kind, now in self._counters.items():
                old = before.get(kind, CommCounter())
                delta = CommCounter(now.bytes - old.bytes, now.messages - old.messages)
                if delta.bytes or delta.messages:
                    region.counters[kind] = delta
