"""Token layouts over the R ranks of a ring: which global tokens each rank holds, in which order.

Legend: S = global sequence length, P = ranks in the layout (the ring degree R), n = S / P local
tokens, m = S / (2P) zigzag chunk, G = stripe granularity.

=============== ======================================================== ===================
layout          rank r holds (in this local order)                        S must divide by
=============== ======================================================== ===================
``contiguous``  tokens [r·n, (r+1)·n)                                     P
``zigzag``      chunks c_r and c_{2P-1-r} of 2P equal chunks              2P
``stripe``      blocks b of G tokens with b mod P = r, in increasing b    P·G
=============== ======================================================== ===================

Zigzag pairs an early chunk with a late one, so under a causal mask every rank does the same
amount of attention work; stripes balance any position-dependent cost. Every function works from
global token positions, which is also what the attention masks are built from (``ops/masks.py``),
so a layout never needs its own mask logic.

Packed batches: ``doc_ids_from_cu_seqlens`` turns cumulative document lengths into a per-token
document id (and ``positions_from_cu_seqlens`` into per-document positions for RoPE); shard them
like any other tensor with ``SeqLayout.shard``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

LayoutKind = Literal["contiguous", "zigzag", "stripe"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "stripe")


class LayoutError(ValueError):
    """A length, rank or tensor that a layout cannot handle; the message says what to change."""


class _PositionLayout:
    """Shared by every layout: everything follows from ``local_positions`` and ``world``."""

    world: int

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def permutation(self, seq_len: int) -> torch.Tensor:
        """All ranks' positions concatenated in rank order: ``x[:, perm]`` is the sharded order."""
        return torch.cat([self.local_positions(seq_len, r) for r in range(self.world)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's part of a global tensor ``x`` (sequence along ``dim``)."""
        seq_len = x.shape[dim]
        return x.index_select(dim, self.local_positions(seq_len, rank).to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassemble the global tensor from every rank's shard (rank order)."""
        if len(shards) != self.world:
            raise LayoutError(f"unshard got {len(shards)} shards for a layout over {self.world} ranks")
        stacked = torch.cat(list(shards), dim=dim)
        perm = self.permutation(stacked.shape[dim]).to(stacked.device)
        return stacked.index_select(dim, torch.argsort(perm))


@dataclass(frozen=True)
class SeqLayout(_PositionLayout):
    """How a sequence of S tokens is split over ``world`` ranks.

    Args:
        kind: ``contiguous`` | ``zigzag`` | ``stripe``.
        world: number of ranks sharing the sequence (the ring degree).
        granularity: stripe width G in tokens (``stripe`` only).
        team: ``zigzag`` over world / team teams of ``team`` consecutive ranks (StarTrail's balanced
            layout): team t holds chunks t and 2T − 1 − t of 2T, member k the k-th equal part of each.
            1 = the rank-level zigzag.
    """

    kind: str
    world: int
    granularity: int = 1
    team: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise LayoutError(f"layout={self.kind!r} is not a layout; valid: {', '.join(LAYOUTS)}")
        if self.world < 1:
            raise LayoutError(f"layout world={self.world} must be >= 1 (the number of ring ranks)")
        if self.team < 1 or self.world % self.team or (self.team > 1 and self.kind != "zigzag"):
            raise LayoutError(
                f"team={self.team} needs layout='zigzag' and must divide the {self.world} ranks (layout is "
                f"{self.kind!r})"
            )
        if self.granularity < 1:
            raise LayoutError(f"stripe granularity={self.granularity} must be >= 1")
        if self.kind != "stripe" and self.granularity != 1:
            raise LayoutError(
                f"granularity={self.granularity} only applies to layout='stripe' (layout is {self.kind!r})"
            )

    @property
    def multiple(self) -> int:
        """S must be a multiple of this."""
        if self.kind == "zigzag":
            return 2 * self.world
        if self.kind == "stripe":
            return self.world * self.granularity
        return self.world

    def check_length(self, seq_len: int) -> None:
        """Raise ``LayoutError`` naming the length, the required multiple and the padded length."""
        mult = self.multiple
        if seq_len < 1 or seq_len % mult != 0:
            padded = max(mult, -(-seq_len // mult) * mult)
            why = {
                "contiguous": f"{self.world} (ranks)",
                "zigzag": f"{mult} (2 x {self.world} ranks)",
                "stripe": f"{mult} ({self.world} ranks x granularity {self.granularity})",
            }[self.kind]
            raise LayoutError(
                f"sequence length {seq_len} cannot be split by layout='{self.kind}' over {self.world} ranks: "
                f"it must be a multiple of {why}; pad it to {padded} (ds_seqpar.data pads for you) "
                f"or change the layout"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise LayoutError(
                f"rank={rank} is outside the layout's {self.world} ranks; valid: 0..{self.world - 1}"
            )

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """Global token positions held by ``rank``, in local order: int64 ``[S / world]``."""
        self.check_length(seq_len)
        self._check_rank(rank)
        p, n = self.world, seq_len // self.world
        if self.kind == "contiguous":
            return torch.arange(rank * n, (rank + 1) * n)
        if self.kind == "zigzag":  # over teams of ``team`` ranks: each chunk shared by the team's members
            teams, (t, k) = p // self.team, divmod(rank, self.team)
            chunk, m = seq_len // (2 * teams), n // 2
            first = torch.arange(t * chunk + k * m, t * chunk + (k + 1) * m)
            second = torch.arange(
                (2 * teams - 1 - t) * chunk + k * m, (2 * teams - 1 - t) * chunk + (k + 1) * m
            )
            return torch.cat([first, second])
        g = self.granularity
        blocks = torch.arange(rank, seq_len // g, p)
        return (blocks[:, None] * g + torch.arange(g)[None, :]).reshape(-1)

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        """Local index ranges used as attention blocks (runs of consecutive global positions).

        Zigzag has two (its early and late chunk), which lets the ring skip the empty half-blocks
        of a causal mask; contiguous and stripe layouts use one block per rank.
        """
        n = seq_len // self.world
        if self.kind == "zigzag":
            return [(0, n // 2), (n // 2, n)]
        return [(0, n)]


@dataclass(frozen=True)
class UspLayout(_PositionLayout):
    """The input layout of USP: the ring layout over R ranks, then each ring shard split into U pieces.

    SP rank ``sp = ring_rank · U + ulysses_rank`` (the mesh's mapping) holds piece ``ulysses_rank``
    of ring shard ``ring_rank``. The Ulysses all-to-all gathers the U pieces back in order, so after
    it every rank holds its full ring shard (for H/U heads) in ``ring`` layout. The data side shards
    once, with this layout.
    """

    ring: SeqLayout
    ulysses: int
    pieces: int = 1  # ring.schedule 'tasp': each ring shard's segments cut into this many equal pieces

    def __post_init__(self) -> None:
        if self.ulysses < 1:
            raise LayoutError(f"ulysses degree {self.ulysses} must be >= 1")

    @property
    def world(self) -> int:  # type: ignore[override]
        return self.ring.world * self.ulysses

    @property
    def multiple(self) -> int:
        return math.lcm(piece_multiple(self.ring, self.pieces), self.ring.world * self.ulysses)

    def check_length(self, seq_len: int) -> None:
        mult = self.multiple
        if seq_len < 1 or seq_len % mult != 0:
            padded = max(mult, -(-seq_len // mult) * mult)
            raise LayoutError(
                f"sequence length {seq_len} cannot be split by layout='{self.ring.kind}' over {self.ring.world} "
                f"ring ranks x ulysses degree {self.ulysses}"
                + (f" with {self.pieces} TASP pieces per segment" if self.pieces > 1 else "")
                + f": it must be a multiple of {mult}; pad it to {padded} (ds_seqpar.data pads for you) or "
                "change the layout"
            )

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check_length(seq_len)
        if not 0 <= rank < self.world:
            raise LayoutError(
                f"rank={rank} is outside the layout's {self.world} ranks; valid: 0..{self.world - 1}"
            )
        ring_rank, ulysses_rank = divmod(rank, self.ulysses)
        shard = self.ring.local_positions(seq_len, ring_rank)
        return shard.chunk(self.ulysses)[ulysses_rank]


@dataclass(frozen=True)
class BlockLayout(_PositionLayout):
    """An explicit assignment of G-token blocks to ranks (db-SP block balancing): rank r holds
    ``blocks[r]`` (increasing block ids), every rank the same number of blocks.

    Built at run time from a sparse pattern (``parallel/sparse_ring.py``); data never arrives in this
    layout, it is reached by one all-to-all from the input layout (``comm/relayout.py``).
    """

    blocks: tuple[tuple[int, ...], ...]
    block_size: int
    kind: str = "blocks"

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
        if not 0 <= rank < self.world:
            raise LayoutError(
                f"rank={rank} is outside the layout's {self.world} ranks; valid: 0..{self.world - 1}"
            )
        blocks = torch.tensor(self.blocks[rank], dtype=torch.long)
        return (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        return [(0, seq_len // self.world)]


@dataclass(frozen=True)
class GroupLayout(_PositionLayout):
    """Groups of a base layout's ranks seen as one rank each (team schedules, ``parallel/team.py``): group g
    holds the tokens of its members ``groups[g]``, concatenated in member order (what an all-gather over
    the group produces). StarTrail's teams and ATTENTION2D's rows and columns (disjoint groups), and the
    pieces a TASP step holds (groups of a ``PieceLayout``, which overlap).

    Args:
        base: the layout whose ranks the groups name (``SeqLayout`` or ``PieceLayout``).
        groups: member ranks (of ``base``) of every group, each group the same size.
        interleave: > 1: every member's tokens are this many equal runs, concatenated run-major (run j of
            every member in member order, then run j + 1): TASP's step blocks.
    """

    base: Any
    groups: tuple[tuple[int, ...], ...]
    interleave: int = 1
    kind: str = "groups"

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
class PieceLayout(_PositionLayout):
    """Every rank's tokens of a base layout cut into ``pieces`` equal pieces, each seen as a rank of its own
    (TASP's concurrent rings, ``comm/p2p.py``): rank ``r · pieces + c`` holds piece c of rank r's tokens,
    which is the c-th equal part of each of r's segments (so under zigzag every piece is itself balanced).

    Args:
        base: the layout over the ring's ranks.
        pieces: pieces per rank (TASP: one per Hamiltonian cycle, d − 1).
    """

    base: SeqLayout
    pieces: int
    kind: str = "pieces"

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
            padded = -(-seq_len // mult) * mult
            raise LayoutError(
                f"sequence length {seq_len} cannot be cut into {self.pieces} equal pieces per segment of "
                f"layout='{self.base.kind}' over {self.base.world} ranks (ring.schedule='tasp' sends one piece on "
                f"each of its {self.pieces} rings): it must be a multiple of {mult}; pad it to {padded} "
                "(ds_seqpar.data pads for you)"
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
        size = seq_len // self.world // len(self.base.segments(seq_len))
        return [(i * size, (i + 1) * size) for i in range(len(self.base.segments(seq_len)))]


def piece_multiple(base: SeqLayout, pieces: int) -> int:
    """What S must be a multiple of for every segment of ``base`` to cut into ``pieces`` equal pieces."""
    if pieces == 1:
        return base.multiple
    segments = 2 if base.kind == "zigzag" else 1
    return math.lcm(base.multiple, base.world * segments * pieces)


def _check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1)
    if cu.numel() < 2 or cu[0].item() != 0:
        raise LayoutError(
            f"cu_seqlens={cu.tolist()} must start at 0 and hold at least one document, e.g. [0, {seq_len}]"
        )
    if bool((cu[1:] <= cu[:-1]).any()):
        raise LayoutError(f"cu_seqlens={cu.tolist()} must be strictly increasing (no empty documents)")
    if cu[-1].item() > seq_len:
        raise LayoutError(
            f"cu_seqlens ends at {cu[-1].item()}, beyond the sequence length {seq_len}; the last entry must be <= S"
        )
    return cu


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    """Per-token document id ``[S]`` (int64) from cumulative lengths; tokens past the end get -1 (padding)."""
    cu = _check_cu_seqlens(cu_seqlens, seq_len)
    ids = torch.full((seq_len,), -1, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    ids[: int(cu[-1])] = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return ids


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    """Per-token position inside its document ``[S]`` (RoPE positions of a packed row); padding continues."""
    cu = _check_cu_seqlens(cu_seqlens, seq_len)
    pos = torch.arange(seq_len)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    pos[: int(cu[-1])] -= starts
    end = int(cu[-1])
    pos[end:] -= int(cu[-2])  # padding continues the last document's positions
    return pos


def input_layout(mesh: Any) -> UspLayout:
    """The layout the data side must shard with for a ``SeqParMesh`` and its config: the ring layout over
    the R ring ranks (``sequence_parallel.ring.layout``, or sparse balancing stripes), then each ring
    shard split into U Ulysses pieces."""
    cfg = mesh.settings
    kind, granularity = cfg.ring_layout
    team = cfg.ring.team_size if cfg.ring.schedule == "startrail" and kind == "zigzag" else 1
    return UspLayout(SeqLayout(kind, mesh.ring_size, granularity, team), mesh.ulysses_size, cfg.ring_pieces)
