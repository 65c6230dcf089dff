"""Team collectives: all-gather, row exchange and reduce-scatter inside a team, and a one-hop shift.

Legend: a *team* is a group of ring ranks whose query rows are computed together (StarTrail: C
consecutive ring ranks, a node; ATTENTION2D: a grid row of P_kv ranks); n = tokens per ring rank,
C = team size; ``[B, C·n, ...]`` = the team's tokens, members' tokens concatenated in member order.

``TeamComm``: the collectives inside a team, every one recorded with its peers:
    gather(*xs, dim)        all-gather along the token dim: ``[B, n, ...]`` -> ``[B, C·n, ...]``
                            (same-shape tensors travel in ONE collective)
    exchange_rows(x, dim)   all-to-all: member c gets rows c·n..(c+1)·n of everyone's ``x``;
                            returns ``[C, ...my rows...]`` (the partials of my rows, member order)
    reduce_rows(*xs, dim)   reduce-scatter (sum) of the same split: my rows of the sum over members

``ShiftComm``: one P2P hop with different send and receive partners (StarTrail's skew). The team
schedules built on them are ``comm/schedules/startrail.py`` and ``comm/schedules/attention2d.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ds_seqpar.comm.collectives import all_gather_single, reduce_scatter_single
from ds_seqpar.comm.p2p import Payload, PendingExchange
from ds_seqpar.comm.stats import CommStats


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
        all_gather_single(out, stacked, group=self.group)
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
        reduce_scatter_single(out, send.flatten(0, 1), group=self.group)
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
