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
and compute optional), ``all_gather`` (Llama-3 style), ``tasp`` (concurrent Hamiltonian rings inside a
domain, ``comm/tasp.py``; optionally inside an outer ring), and the team schedules ``startrail`` and
``attention2d`` (``comm/team.py``), which the engine runs on a team's gathered query rows: they carry
``team_comm`` (the team's collectives), ``query_groups`` / ``key_groups`` (the ring ranks whose tokens
form each query-row team and each K/V block) and ``gathers_kv`` (whether the team gathers K/V too);
``parallel/team.py`` wraps them. A schedule may also have ``pieces`` (TASP: owners are pieces of the
ring layout's shards, ``layout.PieceLayout``). A new schedule is a class with this
interface plus one entry in :data:`SCHEDULES` (docs/architecture.md, "How to add a schedule").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any, Protocol

import torch

from ds_seqpar.comm.p2p import AllGatherSchedule, Block, Payload, RingComm, RingSchedule
from ds_seqpar.comm.tasp import CycleComm, TaspSchedule
from ds_seqpar.comm.team import GridColumnSchedule, ShiftComm, StarTrailSchedule, TeamComm


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


def _outer(mesh: Any) -> RingComm | None:
    if mesh.ring_inner_size == mesh.ring_size:
        return None
    c = mesh.coords
    return RingComm(mesh.group("ring_outer"), mesh.members["ring_outer"], c.ring_outer_rank, mesh.comm_stats)


def _tasp(mesh: Any, overlap: bool) -> Schedule:
    if mesh.ring_inner_size == 1:  # a domain of one rank: only the outer ring is left
        return _p2p(mesh, overlap)
    c, stats = mesh.coords, mesh.comm_stats
    kind = "ring" if mesh.ring_inner_size == mesh.ring_size else "ring_inner"
    index = c.ring_rank if kind == "ring" else c.ring_inner_rank
    domain = CycleComm(mesh.group(kind), mesh.members[kind], index, stats)
    segments = 2 if mesh.settings.ring_layout[0] == "zigzag" else 1
    return TaspSchedule(domain, _outer(mesh), segments, overlap)


def team_parts(ring: int, team_size: int) -> list[list[int]]:
    """StarTrail teams: ``team_size`` consecutive ring ranks each."""
    return [list(range(t * team_size, (t + 1) * team_size)) for t in range(ring // team_size)]


def grid_parts(rows: int, cols: int) -> tuple[list[list[int]], list[list[int]]]:
    """ATTENTION2D rows (``cols`` consecutive ring ranks) and columns (``rows`` ranks of stride ``cols``)."""
    return (
        [[i * cols + j for j in range(cols)] for i in range(rows)],
        [[i * cols + j for i in range(rows)] for j in range(cols)],
    )


def _startrail(mesh: Any, overlap: bool) -> Schedule:
    r, cfg, stats = mesh.ring_size, mesh.settings.ring, mesh.comm_stats
    size = cfg.team_size
    teams, me = r // size, mesh.coords.ring_rank
    m = teams // size
    t, k = divmod(me, size)
    a, i = divmod(t, m)
    ring_group, ring_members = mesh.group("ring"), mesh.members["ring"]
    group, members, index = mesh.ring_subgroup(f"startrail_team_{size}", team_parts(r, size))
    positions = [(a * m + x) * size + k for x in range(m)]  # member k of the teams of group a: the sub-ring
    subring = RingSchedule(
        RingComm(ring_group, [ring_members[q] for q in positions], i, stats), None, overlap
    )
    skew = unskew = None
    if k:
        ahead, behind = ((t + k * m) % teams) * size + k, ((t - k * m) % teams) * size + k
        skew = ShiftComm(ring_group, ring_members[ahead], ring_members[behind], stats)
        unskew = ShiftComm(ring_group, ring_members[behind], ring_members[ahead], stats)
    teams_of = tuple(tuple(p) for p in team_parts(r, size))
    return StarTrailSchedule(subring, skew, unskew, TeamComm(group, members, index, stats), teams_of, t, k)


def _attention2d(mesh: Any, overlap: bool) -> Schedule:
    rows, cols = mesh.settings.ring.grid
    stats, (i, j) = mesh.comm_stats, divmod(mesh.coords.ring_rank, cols)
    row_parts, col_parts = grid_parts(rows, cols)
    row = TeamComm(*mesh.ring_subgroup(f"grid_rows_{rows}x{cols}", row_parts), stats)
    column = TeamComm(*mesh.ring_subgroup(f"grid_cols_{rows}x{cols}", col_parts), stats)
    rows_of, cols_of = tuple(tuple(p) for p in row_parts), tuple(tuple(p) for p in col_parts)
    return GridColumnSchedule(row, column, rows_of, cols_of, i, j)


SCHEDULES: dict[str, Callable[[Any, bool], Schedule]] = {
    "p2p": _p2p,
    "all_gather": _all_gather,
    "tasp": _tasp,
    "startrail": _startrail,
    "attention2d": _attention2d,
}
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
