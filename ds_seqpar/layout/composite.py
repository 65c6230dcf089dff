"""Layouts built from a ring layout: USP's input layout, db-SP block layouts, team groups, TASP pieces.

Legend: R ring ranks, U Ulysses degree, S global length, G block size, n = S / R tokens per ring rank.

* ``UspLayout``: the ring layout over R ranks, then each ring shard cut into U pieces (what the data
  side shards with; the Ulysses all-to-all reassembles the ring shards).
* ``BlockLayout``: an explicit assignment of G-token blocks to ranks (db-SP block balancing).
* ``GroupLayout``: groups of a base layout's ranks seen as one rank each (team schedules' rows and K/V
  blocks, and the pieces a TASP step holds).
* ``PieceLayout``: every rank's tokens cut into equal pieces, each a rank of its own (TASP's rings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.layout.base import Layout, LayoutError, padded_length
from ds_seqpar.layout.grouped import grouped_for_batch
from ds_seqpar.layout.ring import RingLayout

__all__ = ["BlockLayout", "GroupLayout", "PieceLayout", "UspLayout", "piece_multiple"]


def piece_multiple(base: RingLayout, pieces: int) -> int:
    """What S must be a multiple of for every segment of ``base`` to cut into ``pieces`` equal pieces."""
    if pieces == 1:
        return base.multiple
    return math.lcm(base.multiple, base.world * base.segment_count * pieces)


@dataclass(frozen=True)
class UspLayout(Layout):
    """The input layout of USP: the ring layout over R ranks, then each ring shard split into U pieces.

    SP rank ``sp = ring_rank · U + ulysses_rank`` (the mesh's mapping) holds piece ``ulysses_rank``
    of ring shard ``ring_rank``. The Ulysses all-to-all gathers the U pieces back in order, so after
    it every rank holds its full ring shard (for H/U heads) in ``ring`` layout. The data side shards
    once, with this layout.

    Args:
        ring: the ring layout. ulysses: U.
        pieces: equal pieces every segment of a ring shard is cut into (a schedule that sends pieces on
            concurrent rings, TASP), else 1.
        dynamic: a batch whose documents balance over groups of fewer ranks runs in such groups
            (``dynamic_degree``: ``for_batch`` returns a ``GroupedPlacement``, ``layout/grouped.py``).
    """

    ring: RingLayout
    ulysses: int
    pieces: int = 1
    dynamic: bool = False

    def __post_init__(self) -> None:
        if self.ulysses < 1:
            raise LayoutError(f"ulysses degree {self.ulysses} must be >= 1")

    @property
    def world(self) -> int:  # type: ignore[override]
        return self.ring.world * self.ulysses

    @property
    def multiple(self) -> int:
        return math.lcm(piece_multiple(self.ring, self.pieces), self.ring.world * self.ulysses)

    def described(self) -> str:
        pieces = f" with {self.pieces} TASP pieces per segment" if self.pieces > 1 else ""
        return f"layout='{self.ring.name}' over {self.ring.world} ring ranks x ulysses degree {self.ulysses}{pieces}"

    def for_batch(self, doc_ids: torch.Tensor | None) -> Layout:
        """This layout for a batch with these document ids (global order): with ``dynamic``, the grouped
        placement of the smallest degree that balances (if any); else the ring layout's ``for_batch`` (a
        document placement under ``ring.layout='documents'``), split into U pieces."""
        if doc_ids is None:
            return self
        if self.dynamic:
            grouped = grouped_for_batch(doc_ids, self.world)
            if grouped is not None:
                return grouped
        ring = self.ring.for_batch(doc_ids)
        return self if ring is self.ring else UspLayout(ring, self.ulysses, self.pieces, self.dynamic)

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check_length(seq_len)
        self.check_rank(rank)
        ring_rank, ulysses_rank = divmod(rank, self.ulysses)
        shard = self.ring.local_positions(seq_len, ring_rank)
        return shard.chunk(self.ulysses)[ulysses_rank]


@dataclass(frozen=True)
class BlockLayout(Layout):
    """An explicit assignment of G-token blocks to ranks (db-SP block balancing): rank r holds
    ``blocks[r]`` (increasing block ids), every rank the same number of blocks.

    Built at run time from a sparse pattern (``parallel/sparse_ring.py``); data never arrives in this
    layout, it is reached by one all-to-all from the input layout (``comm/relayout.py``).
    """

    blocks: tuple[tuple[int, ...], ...]
    block_size: int

    name = "blocks"

    def __post_init__(self) -> None:
        counts = {len(b) for b in self.blocks}
        flat = sorted(i for b in self.blocks for i in b)
        if (
            len(counts) != 1
            or flat != list(range(len(flat)))
            or any(list(b) != sorted(b) for b in self.blocks)
        ):
            raise LayoutError(
                "BlockLayout needs every block id 0..nB-1 exactly once, sorted per rank, with equal counts per rank"
            )

    @property
    def world(self) -> int:  # type: ignore[override]
        return len(self.blocks)

    @property
    def num_blocks(self) -> int:
        return sum(len(b) for b in self.blocks)

    @property
    def multiple(self) -> int:
        return self.num_blocks * self.block_size

    def check_length(self, seq_len: int) -> None:
        if seq_len != self.multiple:
            raise LayoutError(
                f"sequence length {seq_len} does not match this block layout of {self.num_blocks} blocks x "
                f"{self.block_size} tokens = {self.multiple}"
            )

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check_length(seq_len)
        self.check_rank(rank)
        blocks = torch.tensor(self.blocks[rank], dtype=torch.long)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        return [(0, seq_len // self.world)]


@dataclass(frozen=True)
class GroupLayout(Layout):
    """Groups of a base layout's ranks seen as one rank each (team schedules): group g holds the tokens of
    its members ``groups[g]``, concatenated in member order (what an all-gather over the group produces).
    StarTrail's teams and ATTENTION2D's rows and columns (disjoint groups), and the pieces a TASP step
    holds (groups of a ``PieceLayout``, which overlap).

    Args:
        base: the layout whose ranks the groups name (a ring layout or a ``PieceLayout``).
        groups: member ranks (of ``base``) of every group, each group the same size.
        interleave: > 1: every member's tokens are this many equal runs, concatenated run-major (run j of
            every member in member order, then run j + 1): TASP's step blocks.
    """

    base: Any
    groups: tuple[tuple[int, ...], ...]
    interleave: int = 1

    def __post_init__(self) -> None:
        sizes = {len(g) for g in self.groups}
        members = {r for g in self.groups for r in g}
        distinct = all(len(set(g)) == len(g) for g in self.groups)
        if len(sizes) != 1 or not distinct or not members <= set(range(self.base.world)):
            raise LayoutError(
                f"GroupLayout needs groups of equal size, each of distinct ranks 0..{self.base.world - 1}; got "
                f"{self.groups}"
            )

    @property
    def world(self) -> int:  # type: ignore[override]
        return len(self.groups)

    @property
    def multiple(self) -> int:
        return self.base.multiple

    def check_length(self, seq_len: int) -> None:
        self.base.check_length(seq_len)

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        if not 0 <= rank < self.world:
            raise LayoutError(f"group={rank} is outside the layout's {self.world} groups")
        parts = [self.base.local_positions(seq_len, r).chunk(self.interleave) for r in self.groups[rank]]
        return torch.cat([member[j] for j in range(self.interleave) for member in parts])

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        """Every member's segments, shifted to the member's place in the group."""
        n = seq_len // self.base.world
        return [
            (i * n + a, i * n + b) for i in range(len(self.groups[0])) for a, b in self.base.segments(seq_len)
        ]


@dataclass(frozen=True)
class PieceLayout(Layout):
    """Every rank's tokens of a base layout cut into ``pieces`` equal pieces, each seen as a rank of its own
    (TASP's concurrent rings): rank ``r · pieces + c`` holds piece c of rank r's tokens, which is the c-th
    equal part of each of r's segments (so under zigzag every piece is itself balanced).

    Args:
        base: the layout over the ring's ranks.
        pieces: pieces per rank (TASP: one per Hamiltonian cycle, d − 1).
    """

    base: RingLayout
    pieces: int

    def __post_init__(self) -> None:
        if self.pieces < 1:
            raise LayoutError(f"pieces={self.pieces} must be >= 1")

    @property
    def world(self) -> int:  # type: ignore[override]
        return self.base.world * self.pieces

    @property
    def multiple(self) -> int:
        return piece_multiple(self.base, self.pieces)

    def check_length(self, seq_len: int) -> None:
        self.base.check_length(seq_len)
        mult = self.multiple
        if seq_len % mult:
            raise LayoutError(
                f"sequence length {seq_len} cannot be cut into {self.pieces} equal pieces per segment of "
                f"layout='{self.base.name}' over {self.base.world} ranks (ring.schedule='tasp' sends one piece on "
                f"each of its {self.pieces} rings): it must be a multiple of {mult}; pad it to "
                f"{padded_length(seq_len, mult)} (ds_seqpar.data pads for you)"
            )

    def piece_index(self, seq_len: int, piece: int) -> torch.Tensor:
        """Local indices (into a base rank's tokens) of piece ``piece``: int64 ``[n / pieces]``."""
        self.check_length(seq_len)
        return torch.cat([
            torch.arange(a, b).view(self.pieces, -1)[piece] for a, b in self.base.segments(seq_len)
        ])  # fmt: skip

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        if not 0 <= rank < self.world:
            raise LayoutError(f"piece rank={rank} is outside the layout's {self.world} pieces")
        owner, piece = divmod(rank, self.pieces)
        return self.base.local_positions(seq_len, owner)[self.piece_index(seq_len, piece)]

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        count = self.base.segment_count
        size = seq_len // self.world // count
        return [(i * size, (i + 1) * size) for i in range(count)]
