"""``startrail``: teams of C ranks gather Q/K/V, closed sub-rings carry team blocks (docs/schedules.md).

Legend: T = R / C teams, m = T / C ranks per sub-ring; ring rank r = t·C + k is member k of team t,
t = a·m + i (group a, offset i); n tokens per ring rank, E_q / E_kv as in ``comm/layer_bytes.py``.

The schedule is run by the ring engine on the TEAM's query rows (``parallel/team.py`` does the team
gather before and the LSE merge after). Payload: the team's gathered K/V ``[B, C·n, ...]``. Member k
first fetches the block of team (t − k·m) mod T from member k of that team (the *skew*; none for k = 0),
then circulates it on its sub-ring (member k of teams a·m + 0..m−1, a closed ring of m ranks), so that
over the C members every team block is seen exactly once. Owners yielded are team indices. Backward:
the same motion with dK/dV accumulators (the ring's), which come home after m sends and then take the
skew hop back: member k returns its partial dK/dV of its OWN team's block. The ``query`` backward moves
the team's (Q, dO, lse, Δ) packet and a dQ accumulator the same way instead, K/V staying put.

Bytes per peer and rounds: docs/comm_model.md "StarTrail".
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import Block, Payload, RingComm
from ds_seqpar.comm.schedules.base import (
    RingParams,
    ScheduleSpec,
    TeamRanks,
    check_ring_rank,
    refuse_double_ring,
)
from ds_seqpar.comm.schedules.ring import RingSchedule
from ds_seqpar.comm.team import ShiftComm, TeamComm
from ds_seqpar.layout.composite import GroupLayout

__all__ = [
    "BACKWARD_CHOICES",
    "StarTrailPeers",
    "StarTrailSchedule",
    "StarTrailSpec",
    "startrail_backward_choice",
    "startrail_peers",
    "startrail_team_sizes",
    "team_parts",
]

BACKWARD_CHOICES = ("auto", "kv", "query")  # sequence_parallel.ring.startrail_backward
TAG_SKEW = 13
TAG_SKEW_GRAD = 14


@dataclass(frozen=True)
class StarTrailPeers:
    """Rank r = t·C + k of a StarTrail ring (team t, member k; t = a·m + i, group a, offset i), its peers
    and the ring ranks of its sub-ring (member k of the teams a·m + 0..m−1, in offset order)."""

    team: int
    member: int
    group: int
    offset: int
    teammates: tuple[int, ...]
    skew_target: int | None  # receives this team's K/V (or query packet) at the start; None for k = 0
    subring_next: int  # next rank of the closed sub-ring
    unskew_target: int | None  # backward: the travelling accumulators go home here; None for k = 0
    subring: tuple[int, ...]


def startrail_team_sizes(ring: int) -> list[int]:
    """Valid StarTrail team sizes C for R ranks: C² | R."""
    return [c for c in range(1, ring + 1) if c * c <= ring and ring % (c * c) == 0]


def startrail_peers(ring: int, rank: int, team_size: int | None) -> StarTrailPeers:
    """Team, member and peers of ring rank ``rank`` in StarTrail with team size C (C² | R, T = R/C teams,
    sub-rings of m = T/C ranks): skew target ((t + k·m) % T)·C + k, sub-ring next
    (a·m + (i+1) % m)·C + k, un-skew target ((t − k·m) % T)·C + k."""
    check_ring_rank(ring, rank)
    c = team_size
    if not isinstance(c, int) or c < 1 or ring % (c * c):
        raise ValueError(
            f"startrail team_size C={team_size!r} needs C² to divide R={ring}; valid: {startrail_team_sizes(ring)}"
        )
    teams = ring // c
    m = teams // c
    t, k = divmod(rank, c)
    a, i = divmod(t, m)
    return StarTrailPeers(
        team=t,
        member=k,
        group=a,
        offset=i,
        teammates=tuple(t * c + kk for kk in range(c) if kk != k),
        skew_target=((t + k * m) % teams) * c + k if k else None,
        subring_next=(a * m + (i + 1) % m) * c + k,
        unskew_target=((t - k * m) % teams) * c + k if k else None,
        subring=tuple((a * m + x) * c + k for x in range(m)),
    )


def team_parts(ring: int, team_size: int) -> list[list[int]]:
    """StarTrail teams: ``team_size`` consecutive ring ranks each."""
    return [list(range(t * team_size, (t + 1) * team_size)) for t in range(ring // team_size)]


def startrail_backward_choice(shape: LayerShape, team_size: int) -> str:
    """The StarTrail backward variant that sends fewer p2p bytes per sub-ring step: ``query``
    (C·B·n·(2h·D·b + 2h·a) + C·E_q·a) or ``kv`` (2C·E_kv·b + 2C·E_kv·a); ties → ``kv``. MHA moves less
    with query packets, GQA / MQA with K/V (docs/schedules.md)."""
    c, b, a = team_size, shape.element_bytes, shape.acc_bytes
    query = c * (2 * shape.q_elements * b + 2 * shape.row_heads * a) + c * shape.q_elements * a
    kv = 2 * c * shape.kv_elements * (b + a)
    return "query" if query < kv else "kv"


class StarTrailSchedule(TeamRanks):
    """Skew hop + closed sub-ring over team blocks (see the module docstring).

    Args:
        subring: the single ``RingSchedule`` over this member's sub-ring (m ranks, in team-offset order).
        skew: the skew hop (None for member 0); unskew: its reverse, which returns the accumulators.
        team_comm: the team's collectives (``parallel/team.py`` gathers and merges with them).
        groups: the ring ranks of every team (the query rows and the K/V blocks both are teams).
        team: this rank's team index t; member: its index k in the team.
    """

    gathers_kv = True  # the team's K/V are gathered like its queries: blocks are whole teams

    def __init__(
        self,
        subring: RingSchedule,
        skew: ShiftComm | None,
        unskew: ShiftComm | None,
        team_comm: TeamComm,
        groups: tuple[tuple[int, ...], ...],
        team: int,
        member: int,
    ) -> None:
        self.subring, self.skew, self.unskew, self.team_comm = subring, skew, unskew, team_comm
        self.query_groups = self.key_groups = groups
        self.team, self.member = team, member
        self.team_size, self.teams = len(groups[0]), len(groups)

    @property
    def m(self) -> int:
        return self.teams // self.team_size

    @property
    def size(self) -> int:
        return self.teams

    @property
    def query_rank(self) -> int:
        return self.team

    def _first_block(self) -> int:
        """Team whose block this member starts from: (t − k·m) mod T."""
        return (self.team - self.member * self.m) % self.teams

    def _owner(self, position: int) -> int:
        """Team block that sub-ring position ``position`` started with: g·m + position."""
        return (self._first_block() // self.m) * self.m + position

    def incoming(self) -> Payload | None:
        return self.subring.incoming()

    def backward_variant(self, wanted: str, shape: LayerShape) -> str:
        """``kv`` or ``query``: ``wanted``, or with ``auto`` the one sending fewer bytes for ``shape``."""
        if wanted not in BACKWARD_CHOICES:
            raise ValueError(f"team attention backward={wanted!r}; valid: {', '.join(BACKWARD_CHOICES)}")
        return startrail_backward_choice(shape, self.team_size) if wanted == "auto" else wanted

    def forward(self, kv: Payload) -> Iterator[Block]:
        held = kv if self.skew is None else self.skew.exchange(kv, TAG_SKEW).wait()
        for position, block in self.subring.forward(held):
            yield self._owner(position), block

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        held = kv if self.skew is None else self.skew.exchange(kv, TAG_SKEW).wait()
        steps = self.subring.backward(held)
        del held
        try:
            position, block = next(steps)
            while True:
                grads = yield self._owner(position), block
                del block
                position, block = steps.send(grads)
        except StopIteration as done:
            acc = done.value
        if self.unskew is None:
            return acc
        return self.unskew.exchange(acc, TAG_SKEW_GRAD).wait()


class StarTrailSpec(ScheduleSpec):
    """The ``startrail`` schedule: ``ring.team_size`` C with C² | R, ``ring.startrail_backward``."""

    name = "startrail"
    summary = (
        "teams of team_size ranks gather Q/K/V, sub-rings of R / team_size^2 ranks carry K/V between teams: "
        "inter-node bytes / team_size"
    )
    owns = ("team_size", "startrail_backward")
    places_documents = False
    runner = "team"

    def check_section(self, ring: Any) -> None:
        refuse_double_ring(ring, self.name)

    def check_degree(self, ring: Any, ring_degree: int) -> None:
        c = ring.team_size
        if c is None or ring_degree % (c * c) != 0:
            raise ValueError(
                f"sequence_parallel.ring.team_size={c} does not suit ring.schedule='startrail' on the ring degree "
                f"R={ring_degree}: C^2 must divide R (teams of C ranks, sub-rings of R / C^2); valid: "
                f"{', '.join(map(str, startrail_team_sizes(ring_degree)))}"
            )

    def ring_layout(self, layout: Any, params: RingParams) -> Any:
        return layout.for_teams(params.team_size)

    def build(self, mesh: Any, params: RingParams) -> StarTrailSchedule:
        r, size, stats = mesh.ring_size, params.team_size, mesh.comm_stats
        geo = startrail_peers(r, mesh.coords.ring_rank, size)
        ring_group, ring_members = mesh.group("ring"), mesh.members["ring"]
        group, members, index = mesh.ring_subgroup(f"startrail_team_{size}", team_parts(r, size))
        subring = RingSchedule(
            RingComm(ring_group, [ring_members[q] for q in geo.subring], geo.offset, stats),
            None,
            params.overlap,
        )
        skew = unskew = None
        if geo.member:
            ahead, behind = ring_members[geo.skew_target], ring_members[geo.unskew_target]
            skew = ShiftComm(ring_group, ahead, behind, stats)
            unskew = ShiftComm(ring_group, behind, ahead, stats)
        teams_of = tuple(tuple(p) for p in team_parts(r, size))
        team = TeamComm(group, members, index, stats)
        return StarTrailSchedule(subring, skew, unskew, team, teams_of, geo.team, geo.member)

    def layouts(self, schedule: Any, base: Any) -> tuple[Any, Any]:
        return GroupLayout(base, schedule.key_groups), GroupLayout(base, schedule.query_groups)

    def cache_key(self, params: RingParams) -> tuple:
        return (self.name, params.overlap, params.team_size)

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        """Team gather, skew hop, m − 1 sub-ring hops, team merge (docs/comm_model.md)."""
        ring, c = params.ring, params.team_size
        p = startrail_peers(ring, rank, c)
        variant = params.startrail_backward
        if variant not in BACKWARD_CHOICES:
            raise ValueError(
                f"startrail_backward={variant!r} is unknown; valid: {', '.join(BACKWARD_CHOICES)}"
            )
        variant = startrail_backward_choice(shape, c) if variant == "auto" else variant
        m, b, a, out = ring // (c * c), shape.element_bytes, shape.acc_bytes, {}
        e_q, e_kv, rows = shape.q_elements, shape.kv_elements, shape.row_heads
        for mate in p.teammates:
            if backward:
                add_bytes(out, rank, mate, "all_gather", (2 * e_q + 2 * e_kv) * b + 2 * rows * a)
                add_bytes(out, rank, mate, "reduce_scatter", (e_q + 2 * e_kv) * a)
            else:
                add_bytes(out, rank, mate, "all_gather", (e_q + 2 * e_kv) * b)
                add_bytes(out, rank, mate, "all_to_all", rows * (shape.head_dim + 1) * a)
        kv_block = 2 * c * e_kv  # K and V of one team block (C·n tokens)
        if not backward or variant == "kv":
            hop, acc, closing = kv_block * b, kv_block * a, kv_block * a
        else:  # query packet (Q, dO in b; lse, Δ in a) travels; dQ accumulator C·E_q·a comes home
            hop, acc, closing = c * (2 * e_q * b + 2 * rows * a), c * e_q * a, c * e_q * a
        if p.skew_target is not None:
            add_bytes(out, rank, p.skew_target, "p2p", hop)
        add_bytes(out, rank, p.subring_next, "p2p", (m - 1) * hop)
        if backward:
            add_bytes(out, rank, p.subring_next, "p2p", m * acc if m > 1 else 0)
            if p.unskew_target is not None:
                add_bytes(out, rank, p.unskew_target, "p2p", closing)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        """Forward [C > 1]·(gather + skew + merge) + m − 1; backward [C > 1]·(gather + skew + un-skew +
        reduce-scatter) + m − 1 + [m > 1] (closing hop); the same for both backward variants. C = 1 gives
        the single ring's R − 1 / R."""
        c = params.team_size
        startrail_peers(params.ring, 0, c)  # validates C
        m = params.ring // (c * c)
        collectives = (4 if backward else 3) if c > 1 else 0
        return collectives + m - 1 + (1 if backward and m > 1 else 0)

    def report_rows(self, params: RingParams) -> list[tuple[str, str]]:
        c, ring = params.team_size, params.ring
        teams = team_parts(ring, c)
        return [("StarTrail", f"C {c}: {len(teams)} teams of {c} ring ranks, sub-rings of {ring // (c * c)}")]
