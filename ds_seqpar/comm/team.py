"""Team collectives and the two team schedules: StarTrail's skewed sub-rings and ATTENTION2D's columns.

Legend: a *team* is a group of ring ranks whose query rows are computed together (StarTrail: C
consecutive ring ranks, a node; ATTENTION2D: a grid row of P_kv ranks); n = tokens per ring rank,
C = team size; ``[B, C·n, ...]`` = the team's tokens, members' tokens concatenated in member order.

``TeamComm``: the collectives inside a team, every one recorded with its peers:
    gather(*xs, dim)        all-gather along the token dim: ``[B, n, ...]`` -> ``[B, C·n, ...]``
                            (same-shape tensors travel in ONE collective)
    exchange_rows(x, dim)   all-to-all: member c gets rows c·n..(c+1)·n of everyone's ``x``;
                            returns ``[C, ...my rows...]`` (the partials of my rows, member order)
    reduce_rows(*xs, dim)   reduce-scatter (sum) of the same split: my rows of the sum over members

Schedules (the ``Schedule`` protocol of ``comm/schedule.py``, run by the ring engine on the TEAM's query
rows; ``parallel/team.py`` does the team gather before and the LSE merge after):

``StarTrailSchedule`` (docs/schedules.md "StarTrail", ALGORITHMS.md §10): T = R/C teams, m = T/C;
ring rank t·C + k is member k of team t, t = a·m + i. Payload: the team's gathered K/V ``[B, C·n, ...]``.
Member k first fetches the block of team (t − k·m) mod T from member k of that team (the *skew*; none
for k = 0), then circulates it on its sub-ring (member k of teams a·m + 0..m−1, a closed ring of m
ranks), so that over the C members every team block is seen exactly once. Owners yielded are team
indices. Backward: the same motion with dK/dV accumulators (the ring's), which come home after m
sends and then take the skew hop back: member k returns its partial dK/dV of its OWN team's block.

``GridColumnSchedule`` (ATTENTION2D, ALGORITHMS.md §11): one block, the K/V of the grid column
(all-gathered over the column); backward reduce-scatters dK/dV over the column. Owner = column index.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import torch
import torch.distributed as dist

from ds_seqpar.comm.p2p import Block, Payload, PendingExchange, RingSchedule
from ds_seqpar.comm.stats import CommStats

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TAG_SKEW = 13
TAG_SKEW_GRAD = 14


class TeamComm:
    """Collectives over one team (process group ``group``, global ``members`` in member order, this rank
    at ``index``); bytes recorded per peer (kinds ``all_gather``, ``all_to_all``, ``reduce_scatter``)."""

    def __init__(
        self, group: object, members: Sequence[int], index: int, stats: CommStats | None = None
    ) -> None:
        self.group, self.members, self.index, self.stats = group, list(members), index, stats

    @property
    def size(self) -> int:
        return len(self.members)

    def _record(self, kind: str, per_peer: int) -> None:
        if self.stats is not None and self.size > 1:
            self.stats.record_peers(
                kind, {m: per_peer for j, m in enumerate(self.members) if j != self.index}
            )

    def gather(self, *xs: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
        """Every member's ``xs`` concatenated along ``dim`` in member order (one all-gather for all of
        them: they must share shape and dtype)."""
        if self.size == 1:
            return xs
        stacked = torch.stack(xs).contiguous()  # [T, ...]
        out = stacked.new_empty((self.size * len(xs), *stacked.shape[1:]))
        _all_gather_single(out, stacked, group=self.group)
        self._record("all_gather", stacked.numel() * stacked.element_size())
        parts = out.view(self.size, *stacked.shape)  # [C, T, ...]
        return tuple(torch.cat(list(parts[:, j].unbind(0)), dim=dim) for j in range(len(xs)))

    def _split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with the token dim split by member, member first: ``[C, ..., n, ...]``, contiguous."""
        return x.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous()

    def exchange_rows(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All-to-all of row blocks: returns ``[C, ...]``, entry c = member c's rows of this rank's slice."""
        send = self._split(x, dim)
        if self.size == 1:
            return send
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)
        self._record("all_to_all", send[0].numel() * send.element_size())
        return got

    def reduce_rows(self, *xs: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
        """This rank's rows of the sum over members of each ``x`` ``[B, C·n, ...]`` (one reduce-scatter)."""
        if self.size == 1:
            return xs
        send = torch.stack([self._split(x, dim) for x in xs], dim=1).contiguous()  # [C, T, ...]
        out = send.new_empty(send.shape[1:])
        _reduce_scatter_single(out, send.flatten(0, 1), group=self.group)
        self._record("reduce_scatter", out.numel() * out.element_size())
        return tuple(out.unbind(0))


class ShiftComm:
    """One P2P hop with different partners: send to ``send_to``, receive from ``recv_from`` (global ranks of
    ``group``); the StarTrail skew. Kind ``p2p``."""

    def __init__(self, group: object, send_to: int, recv_from: int, stats: CommStats | None = None) -> None:
        self.group, self.send_to, self.recv_from, self.stats = group, send_to, recv_from, stats

    def exchange(self, payload: Payload, tag: int) -> PendingExchange:
        payload = tuple(t.contiguous() for t in payload)
        got = tuple(torch.empty_like(t) for t in payload)
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group, tag) for t in payload]
        ops += [dist.P2POp(dist.irecv, r, self.recv_from, self.group, tag) for r in got]
        if self.stats is not None:
            self.stats.record_peers("p2p", {self.send_to: sum(t.numel() * t.element_size() for t in payload)})
        return PendingExchange(dist.batch_isend_irecv(ops), got)


class StarTrailSchedule:
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
    def ring_rank(self) -> int:
        return self.team * self.team_size + self.member

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


class GridColumnSchedule:
    """ATTENTION2D's K/V side: the column's K/V as one block; dK/dV reduce-scattered over the column.

    Args:
        row: the grid row's ``TeamComm`` (P_kv ranks: the query team); column: the column's (P_q ranks).
        rows, cols: the ring ranks of every grid row and column (query and K/V groups).
        i, j: this rank's grid coordinates.
    """

    gathers_kv = False  # K/V are gathered over the column, by this schedule

    def __init__(
        self,
        row: TeamComm,
        column: TeamComm,
        rows: tuple[tuple[int, ...], ...],
        cols: tuple[tuple[int, ...], ...],
        i: int,
        j: int,
    ) -> None:
        self.team_comm, self.column, self.query_groups, self.key_groups = row, column, rows, cols
        self.row, self.col, self.cols = i, j, len(cols)

    @property
    def size(self) -> int:
        return 1

    @property
    def ring_rank(self) -> int:
        return self.row * self.cols + self.col

    @property
    def query_rank(self) -> int:
        return self.row

    def incoming(self) -> None:
        return None

    def forward(self, kv: Payload) -> Iterator[Block]:
        yield self.col, self.column.gather(*kv)

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        grads = yield self.col, self.column.gather(*kv)
        out = self.column.reduce_rows(*grads)
        grads.clear()
        return out
