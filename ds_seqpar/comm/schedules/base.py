"""What a ring schedule is: the runtime ``Schedule`` the engine iterates, and the ``ScheduleSpec`` that
holds every other fact of the schedule in one place (docs/architecture.md, "How to add a schedule").

A ``Schedule`` owns the communication of one ring attention call; the engine (``parallel/ring/``) only
iterates it and never calls a collective itself:

    forward(kv)   yields ``(owner, kv_block)``: the index (in the plan's K/V layout) of the block this rank
                  holds at each step, and that block (this rank's own block first)
    backward(kv)  a generator: yields ``(owner, kv_block)`` like ``forward``, receives via ``send`` the
                  gradients this rank computed for that block (a list it empties: it owns them from there),
                  and returns this rank's own K/V gradients once every contribution has arrived
    incoming()    during a backward step: the gradient accumulator that arrived with the current block
                  (the step may add into it in place and send it back), or None

A ``TeamSchedule`` (runner ``"team"``) is run by ``parallel/team.py`` on a team's gathered query rows; it
adds the team's collectives and groups.

A ``ScheduleSpec`` is the schedule's single home: its name, the ``sequence_parallel.ring`` keys it owns
and their checks (the config validates through it), how its runtime object is built, the layouts the
engine's plan needs, its bytes per peer and rounds (``comm/model.py`` and ``parallel/comm_volume.py``
ask it), and its rows of the environment report. ``SCHEDULES = {spec.name: spec}`` is the only list of
schedule names.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes
from ds_seqpar.comm.p2p import Block, Payload

__all__ = [
    "SCHEDULES",
    "NestedRing",
    "RingParams",
    "Schedule",
    "ScheduleSpec",
    "TeamRanks",
    "TeamSchedule",
    "check_ring_rank",
    "refuse_double_ring",
    "register_schedule",
    "schedule_spec",
    "split_domain",
]


class Schedule(Protocol):
    """The interface the ring engine iterates (see the module docstring)."""

    @property
    def size(self) -> int: ...

    @property
    def ring_rank(self) -> int: ...

    def forward(self, kv: Payload) -> Iterator[Block]: ...

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]: ...

    def incoming(self) -> Payload | None: ...


class NestedRing:
    """Sizes and ring rank of a schedule whose ``inner`` comm (a ring, or a TASP domain) sits inside an
    optional ``outer`` ring (None or of size 1: one level): ring rank = outer index · inner size + inner
    index. Shared by the ``p2p`` and ``tasp`` schedules."""

    inner: Any
    outer: Any

    @property
    def inner_size(self) -> int:
        return self.inner.size

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else self.outer.size

    @property
    def size(self) -> int:
        return self.inner.size * self.outer_size

    @property
    def ring_rank(self) -> int:
        return (0 if self.outer is None else self.outer.index) * self.inner.size + self.inner.index


class TeamSchedule(Schedule, Protocol):
    """A schedule whose query rows are teams: ``team_comm`` (the team's collectives), ``gathers_kv`` (the
    team gathers K/V like Q), ``query_rank`` (this rank's team), and the backward variants it can run."""

    team_comm: Any
    gathers_kv: bool

    @property
    def query_rank(self) -> int: ...

    def backward_variant(self, wanted: str, shape: LayerShape) -> str: ...


class TeamRanks:
    """Where a rank of a team schedule sits: query team ``query_rank`` (a StarTrail team, an ATTENTION2D grid
    row) and ``member`` within it. Teams are runs of ring ranks, so ring rank = query_rank · team width +
    member."""

    query_groups: tuple[tuple[int, ...], ...]
    query_rank: int
    member: int

    @property
    def ring_rank(self) -> int:
        return self.query_rank * len(self.query_groups[0]) + self.member


@dataclass(frozen=True)
class RingParams:
    """The ring settings a schedule reads, resolved (``settings.ring_params()`` builds them).

    Args:
        ring: ring degree R.
        inner: ranks per inner ring R_in of a double ring (None or R: a single ring).
        overlap: post the next transfer before the current step's compute.
        team_size: StarTrail's team size C. grid: ATTENTION2D's (P_q, P_kv).
        segments: segments per rank of the ring layout (zigzag 2, else 1).
        startrail_backward: ``kv`` | ``query`` | ``auto`` (chosen per layer shape).
    """

    ring: int
    inner: int | None = None
    overlap: bool = True
    team_size: int | None = None
    grid: tuple[int, int] | None = None
    segments: int = 1
    startrail_backward: str = "auto"

    @property
    def r_in(self) -> int:
        return self.ring if self.inner is None else self.inner


def split_domain(ring: int, inner: int | None, what: str) -> tuple[int, int]:
    """``(R_in, R_out)`` for ``inner`` (None = one level, R_in = R); ValueError unless R_in divides R."""
    r_in = ring if inner is None else inner
    if not isinstance(r_in, int) or r_in < 1 or ring % r_in:
        valid = [d for d in range(1, ring + 1) if ring % d == 0]
        raise ValueError(f"{what}={inner!r} does not divide the ring degree R={ring}; valid: {valid}")
    return r_in, ring // r_in


def check_ring_rank(ring: int, rank: int) -> None:
    """ValueError unless ``ring`` is a positive int and ``rank`` one of its ranks."""
    if not isinstance(ring, int) or ring < 1:
        raise ValueError(f"ring degree must be a positive int; got R={ring!r}")
    if not 0 <= rank < ring:
        raise ValueError(f"rank={rank} is not a ring rank of R={ring} (0..{ring - 1})")


def refuse_double_ring(ring: Any, name: str) -> None:
    """The rule of a team schedule: ``ring.inner_size`` (a double ring) does not compose with it."""
    if ring.inner_size is not None:
        doubles = " / ".join(f"'{n}'" for n, spec in SCHEDULES.items() if spec.double_ring)
        raise ValueError(
            f"sequence_parallel.ring.inner_size={ring.inner_size} makes a double ring, which "
            f"ring.schedule='{name}' does not compose with (its teams / grid rows already stay inside a node); "
            f"valid: ring.inner_size=null, or ring.schedule={doubles}"
        )


class ScheduleSpec:
    """Every fact of one ring schedule (subclass it, set the class attributes, register an instance).

    Class attributes:
        name: ``sequence_parallel.ring.schedule`` value. summary: one line for the config's description.
        owns: ``sequence_parallel.ring`` keys only this schedule reads (set with another one: refused).
        double_ring: whether ``ring.inner_size`` (a double ring) composes with it.
        sparse_ring: whether ``attention: "sparse_ring"`` runs on it.
        places_documents: whether it runs on a per-batch document placement (``ring.layout='documents'``):
            its K/V owners and query rows are the ring layout's own ranks, not teams or pieces of them.
        runner: ``"ring"`` (``parallel/ring/``'s engine on this rank's rows) or ``"team"`` (``parallel/team.py``).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for the config's description and the docs
    owns: ClassVar[tuple[str, ...]] = ()
    double_ring: ClassVar[bool] = False
    sparse_ring: ClassVar[bool] = False
    places_documents: ClassVar[bool] = True
    runner: ClassVar[str] = "ring"

    # configuration -------------------------------------------------------------------------
    def check_section(self, ring: Any) -> None:
        """Rules on the section's ``ring`` settings that need no ring degree; ValueError naming the fix."""

    def check_degree(self, ring: Any, ring_degree: int) -> None:
        """Rules that need the ring degree R; ValueError naming the key, the value and the valid ones."""

    def pieces(self, params: RingParams) -> int:
        """Equal pieces every segment of a ring shard is cut into (the input layout must allow them)."""
        return 1

    def ring_layout(self, layout: Any, params: RingParams) -> Any:
        """The ring layout this schedule runs on, from the configured one (StarTrail: over teams)."""
        return layout

    # runtime -------------------------------------------------------------------------------
    def build(self, mesh: Any, params: RingParams) -> Schedule:
        """The runtime schedule over ``mesh``'s ring axis (creates subgroups collectively on first use)."""
        raise NotImplementedError

    def layouts(self, schedule: Any, base: Any) -> tuple[Any, Any]:
        """``(kv_layout, query_layout)`` of the engine's plan over the ring layout ``base``: whose tokens
        each yielded owner index holds, and (None: this rank's own) whose rows this rank computes."""
        return base, None

    def cache_key(self, params: RingParams) -> tuple:
        """What the built schedule depends on besides the mesh's groups (one schedule object per key)."""
        return (self.name, params)

    # communication model -------------------------------------------------------------------
    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        """Bytes ring rank ``rank`` sends to each peer in one layer's forward (or backward); R > 1."""
        raise NotImplementedError

    def rounds(self, params: RingParams, backward: bool) -> int:
        """Sequential communication rounds of one layer on the critical path; R > 1."""
        raise NotImplementedError

    def report_rows(self, params: RingParams) -> list[tuple[str, str]]:
        """Rows of ``python -m ds_seqpar.report`` describing what this schedule builds on the ring axis."""
        return []


SCHEDULES: dict[str, ScheduleSpec] = {}
"""``sequence_parallel.ring.schedule`` name -> its spec (registration order is the order docs list)."""


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Make ``spec`` configurable as ``sequence_parallel.ring.schedule = spec.name``."""
    if not isinstance(spec, ScheduleSpec) or not spec.name:
        raise TypeError(f"register_schedule takes a ScheduleSpec instance with a name, got {spec!r}")
    SCHEDULES[spec.name] = spec
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered spec of ``name``; ValueError naming the valid names."""
    if name not in SCHEDULES:
        raise ValueError(f"ring schedule {name!r} is unknown; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]
