"""Token layouts over the R ranks of a ring, one class each, and their registry.

Legend: S = global sequence length, P = ranks in the layout (the ring degree R), n = S / P local
tokens, G = stripe granularity, C = team size.

=================== ==================================================== ===================
layout              rank r holds (in this local order)                    S must divide by
=================== ==================================================== ===================
``contiguous``      tokens [r·n, (r+1)·n)                                 P
``zigzag``          chunks c_r and c_{2P-1-r} of 2P equal chunks          2P
``stripe``          blocks b of G tokens with b mod P = r, in increasing b P·G
``team``            zigzag over P / C teams of C ranks: team t holds      2P
                    chunks t and 2T-1-t, member k the k-th part of each
=================== ==================================================== ===================

Zigzag pairs an early chunk with a late one, so under a causal mask every rank does the same amount
of attention work; stripes balance any position-dependent cost. ``team`` is not configured by name:
it is what zigzag becomes for a schedule whose query rows are teams (``for_teams``, StarTrail).

A new layout is a class with ``name``, ``segment_count``, ``multiple``, ``local_positions`` and
``length_rule`` registered with :func:`register_layout`; ``sequence_parallel.ring.layout`` then accepts
its name (docs/architecture.md, "How to add a layout").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ds_seqpar.layout.base import Layout, LayoutError

__all__ = [
    "LAYOUTS",
    "ContiguousLayout",
    "RingLayout",
    "StripeLayout",
    "TeamZigzagLayout",
    "ZigzagLayout",
    "register_layout",
    "ring_layout",
]


@dataclass(frozen=True)
class RingLayout(Layout):
    """A layout of S tokens over ``world`` ring ranks; subclasses say which positions each rank holds.

    Args:
        world: number of ranks sharing the sequence (the ring degree).
        granularity: stripe width G in tokens (only layouts with ``takes_granularity``; else 1).
    """

    world: int
    granularity: int = 1

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for the config's description and the docs
    segment_count: ClassVar[int] = 1  # segments per rank (runs the engine classifies separately)
    takes_granularity: ClassVar[bool] = False
    per_batch: ClassVar[bool] = False  # ``for_batch`` places each batch's documents (its runs vary per batch)

    def __post_init__(self) -> None:
        if self.world < 1:
            raise LayoutError(f"layout world={self.world} must be >= 1 (the number of ring ranks)")
        if self.granularity < 1:
            raise LayoutError(f"stripe granularity={self.granularity} must be >= 1")
        if not self.takes_granularity and self.granularity != 1:
            takes = ", ".join(f"'{n}'" for n, cls in LAYOUTS.items() if cls.takes_granularity)
            raise LayoutError(
                f"granularity={self.granularity} only applies to layout={takes} (layout is {self.name!r})"
            )

    @property
    def multiple(self) -> int:
        return self.world

    def length_rule(self) -> str:
        return f"{self.world} (ranks)"

    def described(self) -> str:
        return f"layout='{self.name}' over {self.world} ranks"

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        """Global token positions held by ``rank``, in local order: int64 ``[S / world]``."""
        self.check_length(seq_len)
        self.check_rank(rank)
        return self._positions(seq_len, rank)

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        """``segment_count`` equal local index ranges (runs of consecutive global positions for every
        layout but stripes, whose one segment is the whole shard)."""
        n, count = seq_len // self.world, self.segment_count
        return [(i * n // count, (i + 1) * n // count) for i in range(count)]

    def for_teams(self, team: int) -> RingLayout:
        """The balanced layout when teams of ``team`` ranks compute their query rows together (StarTrail):
        this layout itself, unless it balances by pairing chunks (zigzag)."""
        return self


LAYOUTS: dict[str, type[RingLayout]] = {}
"""``sequence_parallel.ring.layout`` name -> layout class (registration order = the order docs list)."""


def register_layout(cls: type[RingLayout]) -> type[RingLayout]:
    """Make ``cls`` configurable as ``sequence_parallel.ring.layout = cls.name`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, RingLayout)) or not cls.name:
        raise TypeError(f"register_layout takes a RingLayout subclass with a name, got {cls!r}")
    LAYOUTS[cls.name] = cls
    return cls


def ring_layout(name: str, world: int, granularity: int = 1) -> RingLayout:
    """The registered layout ``name`` over ``world`` ranks (``granularity`` for stripes)."""
    if name not in LAYOUTS:
        raise LayoutError(f"layout={name!r} is not a layout; valid: {', '.join(LAYOUTS)}")
    return LAYOUTS[name](world, granularity)


@register_layout
@dataclass(frozen=True)
class ContiguousLayout(RingLayout):
    """Rank r holds tokens [r·n, (r+1)·n)."""

    name: ClassVar[str] = "contiguous"
    summary: ClassVar[str] = "rank r holds tokens [r·n, (r+1)·n)"

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        n = seq_len // self.world
        return torch.arange(rank * n, (rank + 1) * n)


@register_layout
@dataclass(frozen=True)
class ZigzagLayout(RingLayout):
    """Rank r holds chunks r and 2P − 1 − r of 2P equal chunks (its early and late segment)."""

    name: ClassVar[str] = "zigzag"
    summary: ClassVar[str] = "2R chunks, rank r holds chunks r and 2R-1-r: balanced causal"
    segment_count: ClassVar[int] = 2

    @property
    def multiple(self) -> int:
        return 2 * self.world

    def length_rule(self) -> str:
        return f"{self.multiple} (2 x {self.world} ranks)"

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return _zigzag_over_teams(seq_len, self.world, 1, rank)

    def for_teams(self, team: int) -> RingLayout:
        return self if team == 1 else TeamZigzagLayout(self.world, team=team)


@register_layout
@dataclass(frozen=True)
class StripeLayout(RingLayout):
    """Rank r holds the blocks b of G tokens with b mod P = r, in increasing b (one segment: the shard)."""

    name: ClassVar[str] = "stripe"
    summary: ClassVar[str] = "round-robin blocks of `granularity` tokens"
    takes_granularity: ClassVar[bool] = True

    @property
    def multiple(self) -> int:
        return self.world * self.granularity

    def length_rule(self) -> str:
        return f"{self.multiple} ({self.world} ranks x granularity {self.granularity})"

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        g = self.granularity
        blocks = torch.arange(rank, seq_len // g, self.world)
        return (blocks[:, None] * g + torch.arange(g)[None, :]).reshape(-1)


@dataclass(frozen=True)
class TeamZigzagLayout(ZigzagLayout):
    """Zigzag over world / ``team`` teams of ``team`` consecutive ranks (StarTrail's balanced layout): team
    t holds chunks t and 2T − 1 − t of 2T, its member k the k-th equal part of each. Reached through
    ``ZigzagLayout.for_teams``; not a configurable name of its own."""

    team: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.team < 1 or self.world % self.team:
            raise LayoutError(f"team={self.team} must divide the {self.world} ranks of the zigzag layout")

    def _positions(self, seq_len: int, rank: int) -> torch.Tensor:
        return _zigzag_over_teams(seq_len, self.world, self.team, rank)

    def for_teams(self, team: int) -> RingLayout:
        return ZigzagLayout(self.world).for_teams(team)


def _zigzag_over_teams(seq_len: int, world: int, team: int, rank: int) -> torch.Tensor:
    """Positions of ``rank`` under zigzag over world / team teams (team 1: the rank-level zigzag)."""
    teams, (t, k) = world // team, divmod(rank, team)
    chunk, m = seq_len // (2 * teams), seq_len // world // 2
    first = torch.arange(t * chunk + k * m, t * chunk + (k + 1) * m)
    late = (2 * teams - 1 - t) * chunk
    return torch.cat([first, torch.arange(late + k * m, late + (k + 1) * m)])
