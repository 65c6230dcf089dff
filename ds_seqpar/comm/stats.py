"""Bytes and messages sent per collective kind, per rank.

Every communication primitive in ``ds_seqpar.comm`` reports what this rank injects into the
network through a ``CommStats`` object (the one owned by the ``SeqParMesh``; no global counter)::

    with mesh.comm_stats.measure() as region:
        out = attention(q, k, v, mesh=mesh)
    region.bytes("all_to_all"), region.total_bytes

Conventions: "bytes" are the bytes this rank sends (all-to-all: the chunks for the other ranks;
P2P: the payload of its isends; all-gather: its own shard times (group size - 1)), so they can be
compared with the per-rank formulas in docs/attention.md, docs/ring.md and docs/linear.md. A "message" is one call of a primitive.

Links: primitives that know their destinations also record bytes per peer (global rank), and with
``node_of`` set (the mesh sets it from ``ranks_per_node``) ``region.link_bytes()`` splits them into
``intra`` (same node) and ``inter`` (another node); bytes of primitives that do not name peers are
``unattributed``. ``region.peer_bytes()`` is what the busiest-link formulas of docs/comm_model.md
are checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    peers: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, global peer) -> bytes
    node_of: Callable[[int], int] | None = None
    rank: int | None = None

    def peer_bytes(self, kind: str | None = None) -> dict[int, int]:
        """Bytes sent to each peer (global rank), of one kind or of all."""
        out: dict[int, int] = {}
        for (k, peer), nbytes in self.peers.items():
            if kind is None or k == kind:
                out[peer] = out.get(peer, 0) + nbytes
        return out

    def link_bytes(self) -> dict[str, int]:
        """``{"intra": ..., "inter": ..., "unattributed": ...}``: bytes to peers on this rank's node, on other
        nodes, and bytes of primitives that named no peer (needs ``node_of``)."""
        if self.node_of is None or self.rank is None:
            raise ValueError("link classes need the mesh's ranks_per_node (CommStats.node_of and rank unset)")
        me = self.node_of(self.rank)
        split = {"intra": 0, "inter": 0}
        for peer, nbytes in self.peer_bytes().items():
            split["intra" if self.node_of(peer) == me else "inter"] += nbytes
        split["unattributed"] = self.total_bytes - split["intra"] - split["inter"]
        return split

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

    def __init__(self, rank: int | None = None, node_of: Callable[[int], int] | None = None) -> None:
        self._counters: dict[str, CommCounter] = {}
        self._peers: dict[tuple[str, int], int] = {}
        self.rank, self.node_of = rank, node_of

    def record_peers(self, kind: str, sent: dict[int, int], messages: int = 1) -> None:
        """One message of ``kind`` carrying ``sent[peer]`` bytes to each peer (global ranks)."""
        self.record(kind, sum(sent.values()), messages)
        for peer, nbytes in sent.items():
            self._peers[(kind, peer)] = self._peers.get((kind, peer), 0) + int(nbytes)

    def record(self, kind: str, nbytes: int, messages: int = 1) -> None:
        """Add ``nbytes`` sent and ``messages`` calls to the counter of ``kind``."""
        if nbytes < 0 or messages < 0:
            raise ValueError(
                f"negative communication volume: kind={kind!r} bytes={nbytes} messages={messages}"
            )
        counter = self._counters.setdefault(kind, CommCounter())
        counter.bytes += int(nbytes)
        counter.messages += int(messages)

    def record_tensors(
        self, kind: str, *tensors: torch.Tensor, copies: int = 1, peers: list[int] | None = None
    ) -> None:
        """Record one message carrying ``tensors``, each sent ``copies`` times (e.g. to R-1 peers), or sent
        once to each of ``peers`` (global ranks; then ``copies`` is their number)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if peers is None:
            self.record(kind, nbytes * copies, 1)
        else:
            self.record_peers(kind, dict.fromkeys(peers, nbytes))

    def snapshot(self) -> dict[str, CommCounter]:
        """A copy of the current totals."""
        return {k: CommCounter(c.bytes, c.messages) for k, c in self._counters.items()}

    def reset(self) -> None:
        self._counters.clear()
        self._peers.clear()

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self._counters.values())

    @contextmanager
    def measure(self) -> Iterator[CommRegion]:
        """Measure a region: the yielded ``CommRegion`` holds the region's totals once it exits."""
        before, peers_before = self.snapshot(), dict(self._peers)
        region = CommRegion(node_of=self.node_of, rank=self.rank)
        try:
            yield region
        finally:
            for kind, now in self._counters.items():
                old = before.get(kind, CommCounter())
                delta = CommCounter(now.bytes - old.bytes, now.messages - old.messages)
                if delta.bytes or delta.messages:
                    region.counters[kind] = delta
            for key, nbytes in self._peers.items():
                if nbytes - peers_before.get(key, 0):
                    region.peers[key] = nbytes - peers_before.get(key, 0)
