"""``tasp``: d − 1 concurrent rings inside an all-to-all domain, one per Hamiltonian cycle (docs/schedules.md).

Legend: d = ranks of the domain (the inner ring of the double ring, or the whole ring), p = d − 1
rings = pieces per block, n local tokens, R_out = outer ring size (1 without an outer ring).

A ring uses one outgoing link per rank; inside an NVSwitch / Infinity-Fabric node every pair of ranks
has its own. Here every rank's K/V block is cut into p pieces (``layout.PieceLayout``: the c-th equal
part of each layout segment, so under zigzag each piece is itself balanced: the causal "zigzag per
cycle") and piece c travels the Hamiltonian cycle c of ``comm/hamiltonian.py``. The p cycles use every
ordered pair of the domain once, so one step of all p rings is ONE batched exchange in which each rank
sends one message on each of its p outgoing links:

    bytes per rank and step   = the ring's (2·B·n·H_kv·D·b), spread over p links
    busiest link per step     = the ring's / p
    steps                     = d (the own block, then d − 1 exchanges), as the ring

Backward: the K/V pieces circulate again and each carries its dK/dV accumulator, which after d
sends arrives at the piece's owner (as the ring's). With an outer ring (``ring.inner_size`` = d < R)
the block that arrives on the outer ring circulates the domain exactly like the double ring's inner ring
(``schedules/ring.py``), and the assembled accumulator then travels the outer ring home.

Each step yields the d − 1 pieces held as ONE block (segment-major: one set of kernel calls per step,
as the ring's; the own step is the local block itself); its owner indexes ``step_groups``, the pieces it
holds (ranks of ``layout.PieceLayout(ring layout, p)``), from which the spec builds the plan's K/V layout.

Bytes per peer (docs/comm_model.md): the n tokens are cut into d − 1 sub-chunks (``tasp_subchunks``);
to the cycle-c peer R_out·(d − 1)·2·B·s_c·h_kv·D·b forward, backward + R_out·d·2·B·s_c·h_kv·D·a; to the
outer next as the double ring's.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.hamiltonian import (
    NO_DECOMPOSITION,
    cycle_successors,
    hamiltonian_decomposition,
    has_decomposition,
)
from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import TAG_GRAD, TAG_KV, Block, Payload, PendingExchange, RingComm, accumulate_into
from ds_seqpar.comm.schedules.base import NestedRing, RingParams, ScheduleSpec, split_domain
from ds_seqpar.comm.schedules.ring import RingSpec, chain_rounds, double_ring_peers
from ds_seqpar.comm.stats import CommStats
from ds_seqpar.layout.composite import GroupLayout, PieceLayout

__all__ = [
    "CycleComm",
    "TaspSchedule",
    "TaspSpec",
    "nearest_domains",
    "tasp_domains",
    "tasp_peers",
    "tasp_subchunks",
]


class CycleComm:
    """The p = d − 1 Hamiltonian cycles of one domain: this rank's successor and predecessor on each.

    Args:
        group: the domain's process group; members: its global ranks in domain order; index: this rank's
            position; stats: counter (kind ``"p2p"``, one message per batched exchange, bytes per peer).
    """

    def __init__(
        self, group: object, members: Sequence[int], index: int, stats: CommStats | None = None
    ) -> None:
        self.group, self.members, self.index, self.stats = group, list(members), index, stats
        cycles = self._cycles = hamiltonian_decomposition(len(self.members))
        self.succ = [self.members[self.origin_of(index, c, -1)] for c in range(len(cycles))]
        self.pred = [self.members[self.origin_of(index, c, 1)] for c in range(len(cycles))]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def cycles(self) -> int:
        return self.size - 1

    def origin_of(self, index: int, cycle: int, step: int) -> int:
        """Domain index whose piece domain index ``index`` holds on ``cycle`` after ``step`` exchanges (the
        rank ``step`` places before it on the cycle; ``step`` = −1: its successor)."""
        c = self._cycles[cycle]
        return c[(c.index(index) - step) % len(c)]

    def exchange(self, pieces: list[Payload], tag: int) -> PendingExchange:
        """Send piece c to its cycle-c successor and receive one like it from the cycle-c predecessor,
        for every cycle at once (one batched exchange); returns the received pieces flattened in cycle order."""
        ops, received, sent = [], [], {}
        for c, payload in enumerate(pieces):
            payload = tuple(t.contiguous() for t in payload)
            got = tuple(torch.empty_like(t) for t in payload)
            ops += [dist.P2POp(dist.isend, t, self.succ[c], self.group, tag) for t in payload]
            ops += [dist.P2POp(dist.irecv, r, self.pred[c], self.group, tag) for r in got]
            received += got
            sent[self.succ[c]] = sum(t.numel() * t.element_size() for t in payload)
        if self.stats is not None:
            self.stats.record_peers("p2p", sent)
        return PendingExchange(dist.batch_isend_irecv(ops), tuple(received))


def _regroup(flat: Payload, cycles: int) -> list[Payload]:
    """A flattened exchange result back into one payload per cycle."""
    width = len(flat) // cycles
    return [tuple(flat[c * width : (c + 1) * width]) for c in range(cycles)]


class TaspSchedule(NestedRing):
    """TASP over a domain (``inner``), optionally inside an outer ring (``outer``); the ``Schedule`` protocol.

    Args:
        inner: the domain's cycles. outer: the outer ring (None or size 1: the domain is the ring).
        segments: segments per rank of the ring layout (zigzag 2, else 1); pieces cut each of them.
        overlap: post the next exchange before the current step's compute.
    """

    def __init__(self, inner: CycleComm, outer: RingComm | None, segments: int, overlap: bool = True) -> None:
        self.inner, self.outer, self.segments, self.overlap = inner, outer, segments, overlap
        self._incoming: PendingExchange | None = None
        self._arrived: Payload | None = None

    @property
    def pieces(self) -> int:
        return self.inner.cycles

    @property
    def query_rank(self) -> int:
        return self.ring_rank

    @property
    def step_groups(self) -> tuple[tuple[int, ...], ...]:
        """What each yielded block holds: entry ``(o'·d + x)·d + s`` lists the pieces (ranks of
        ``PieceLayout(ring layout, p)``: ``ring_rank · p + c``) that domain index x holds after s exchanges
        of a block set that came from outer index o', in cycle order (``parallel/ring/`` builds the
        K/V layout of the plan from it)."""
        d, p, groups = self.inner.size, self.pieces, []
        for outer in range(self.outer_size):
            for x in range(d):
                for step in range(d):
                    groups.append(
                        tuple((outer * d + self.inner.origin_of(x, c, step)) * p + c for c in range(p))
                    )
        return tuple(groups)

    def _owner(self, t: int, step: int) -> int:
        o = 0 if self.outer is None else self.outer.index
        return (((o - t) % self.outer_size) * self.inner.size + self.inner.index) * self.inner.size + step

    def _cut(self, payload: Payload) -> list[Payload]:
        """Piece c of every tensor ``[B, n, ...]``: the c-th equal part of each segment."""
        p, s = self.pieces, self.segments
        return [tuple(t.unflatten(1, (s, p, -1))[:, :, c].flatten(1, 2) for t in payload) for c in range(p)]

    def _join(self, pieces: list[Payload]) -> Payload:
        """The inverse of ``_cut``: pieces into one block, segment-major (segment j of every piece in cycle
        order, then segment j + 1): the own pieces give back the local order, and a step's block is what
        ``GroupLayout(PieceLayout(...), step_groups, interleave=segments)`` describes."""
        p, s = self.pieces, self.segments
        joined = []
        for j in range(len(pieces[0])):
            parts = [pieces[c][j].unflatten(1, (s, -1)) for c in range(p)]  # [B, s, L, ...] each
            joined.append(torch.stack(parts, dim=2).flatten(1, 3))
        return tuple(joined)

    def incoming(self) -> Payload | None:
        """The dK/dV accumulators that arrived with the pieces being computed on, as one block, or None
        (their first step)."""
        if self._incoming is None:
            return None
        if self._arrived is None:
            self._arrived = self._join(_regroup(self._incoming.wait(), self.pieces))
        return self._arrived

    def forward(self, kv: Payload) -> Iterator[Block]:
        """Yield, per step, the d − 1 pieces held (one per cycle) as one block, this rank's own first."""
        try:
            yield from self._forward(kv)
        finally:
            if self.outer is not None:
                self.outer.release()

    def _forward(self, kv: Payload) -> Iterator[Block]:
        d = self.inner.size
        outer_cur = kv
        for t in range(self.outer_size):
            outer_next = None
            if t + 1 < self.outer_size and self.overlap:
                outer_next = self.outer.exchange(outer_cur)
            held = self._cut(outer_cur)
            for step in range(d):
                pending = None
                if step + 1 < d and self.overlap:
                    pending = self.inner.exchange(held, TAG_KV)
                yield self._owner(t, step), self._join(held)
                if step + 1 < d:
                    held = _regroup((pending or self.inner.exchange(held, TAG_KV)).wait(), self.pieces)
            if t + 1 < self.outer_size:
                outer_cur = (outer_next or self.outer.exchange(outer_cur)).wait()

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        """Yield every step's block again; ``send()`` back its gradients; return this rank's own dK/dV.

        Each piece's accumulator follows it on its cycle (one batched exchange per step for all cycles)
        and reaches the piece's owner after d sends; with an outer ring the assembled accumulator then
        travels the outer ring like the double ring's."""
        try:
            return (yield from self._backward(kv))
        finally:
            self._incoming = self._arrived = None
            if self.outer is not None:
                self.outer.release()

    def _backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        d, p = self.inner.size, self.pieces
        outer_cur: Payload | None = kv
        outer_acc: PendingExchange | None = None
        acc: list[torch.Tensor] = []
        for t in range(self.outer_size):
            outer_next = None
            if t + 1 < self.outer_size and self.overlap:
                outer_next = self.outer.exchange(outer_cur)
            held = self._cut(outer_cur)
            if t + 1 == self.outer_size:
                outer_cur = None
            arrived: PendingExchange | None = None
            for step in range(d):
                pending = None
                if step + 1 < d and self.overlap:
                    pending = self.inner.exchange(held, TAG_KV)
                self._incoming, self._arrived = arrived, None
                grads = yield self._owner(t, step), self._join(held)
                into = self.incoming()
                self._incoming = self._arrived = None
                sums = self._cut(accumulate_into(into, grads))
                if step + 1 < d:
                    held = _regroup((pending or self.inner.exchange(held, TAG_KV)).wait(), p)
                else:
                    held = []
                arrived = self.inner.exchange(sums, TAG_GRAD)  # the last send brings each piece's home
                del sums
            acc = list(self._join(_regroup(arrived.wait(), p)))
            if self.outer_size > 1:
                acc = accumulate_into(None if outer_acc is None else list(outer_acc.wait()), acc)
                outer_acc = self.outer.exchange(tuple(acc), TAG_GRAD)
                acc = []
            if t + 1 < self.outer_size:
                outer_cur = (outer_next or self.outer.exchange(outer_cur)).wait()
        if outer_acc is not None:
            acc = list(outer_acc.wait())
        return tuple(acc)


def tasp_domains(ring: int) -> list[int]:
    """TASP domain sizes d that divide R and have a Hamiltonian decomposition (d >= 2, d not 4 or 6)."""
    return [d for d in range(2, ring + 1) if ring % d == 0 and has_decomposition(d)]


def nearest_domains(ring: int, domain: int) -> list[int]:
    """The valid TASP domain sizes for ring degree ``ring`` (:func:`tasp_domains`) nearest to ``domain``."""
    valid = tasp_domains(ring)
    best = min((abs(d - domain) for d in valid), default=0)
    return [d for d in valid if abs(d - domain) == best]


def _check_domain(ring: int, domain: int | None) -> tuple[int, int]:
    d, r_out = split_domain(ring, domain, "tasp domain (inner)")
    if d == 1:
        raise ValueError(
            f"tasp domain d=1 has no concurrent rings (needs d >= 2); valid for R={ring}: {tasp_domains(ring)}"
        )
    if not has_decomposition(d):
        raise ValueError(
            f"tasp domain d={d} has no Hamiltonian decomposition (none exists for 4 or 6 ranks, Tillson); "
            f"valid for R={ring}: {tasp_domains(ring)} (nearest: {' or '.join(map(str, nearest_domains(ring, d)))})"
        )
    return d, r_out


def tasp_peers(ring: int, rank: int, domain: int | None = None) -> list[int]:
    """The d − 1 peers of ring rank ``rank`` = o·d + i, one per Hamiltonian cycle c: o·d + succ_c(i)."""
    d, _ = _check_domain(ring, domain)
    o, i = divmod(rank, d)
    return [o * d + succ[i] for succ in cycle_successors(d)]


def tasp_subchunks(tokens: int, domain: int, segments: int = 1) -> list[int]:
    """Tokens s_c of sub-chunk c (c = 0..d−2, the one cycle c carries): each of the layout's
    ``segments`` equal runs of tokens / segments is cut like ``torch.tensor_split`` into d − 1 pieces
    (the first L % (d−1) pieces get one token more) and piece c of every run goes to sub-chunk c."""
    if segments < 1 or tokens % segments:
        raise ValueError(f"tokens={tokens} do not split into segments={segments} equal runs")
    if domain < 2:
        raise ValueError(f"tasp domain d={domain} needs d >= 2")
    length, pieces = tokens // segments, domain - 1
    base, extra = divmod(length, pieces)
    return [segments * (base + (1 if c < extra else 0)) for c in range(pieces)]


class TaspSpec(ScheduleSpec):
    """The ``tasp`` schedule over domains of ``ring.inner_size`` (or R) ranks, optionally inside an outer ring."""

    name = "tasp"
    summary = (
        "d - 1 concurrent rings over the Hamiltonian cycles of a domain of d = inner_size (or R) ranks: every "
        "link of an all-to-all node busy"
    )
    double_ring = True
    places_documents = False

    def check_degree(self, ring: Any, ring_degree: int) -> None:
        inner = ring.inner_size
        domain = inner or ring_degree
        if domain in NO_DECOMPOSITION:
            raise ValueError(
                f"sequence_parallel.ring.schedule='tasp' over a domain of {domain} ranks (ring.inner_size="
                f"{inner}, ring degree R={ring_degree}): the complete digraph on 4 or 6 ranks has no Hamiltonian "
                f"decomposition; valid: ring.inner_size in {', '.join(map(str, tasp_domains(ring_degree)))} "
                f"(the sizes that divide R={ring_degree} and have one; nearest to {domain}: "
                f"{' or '.join(map(str, nearest_domains(ring_degree, domain)))}), or ring.schedule='p2p'"
            )

    def pieces(self, params: RingParams) -> int:
        return max(1, params.r_in - 1)

    def build(self, mesh: Any, params: RingParams) -> Any:
        if mesh.ring_inner_size == 1:  # a domain of one rank: only the outer ring is left
            return RingSpec().build(mesh, params)
        c, stats = mesh.coords, mesh.comm_stats
        single = mesh.ring_inner_size == mesh.ring_size
        kind, index = ("ring", c.ring_rank) if single else ("ring_inner", c.ring_inner_rank)
        domain = CycleComm(mesh.group(kind), mesh.members[kind], index, stats)
        outer = None
        if not single:
            outer = RingComm(mesh.group("ring_outer"), mesh.members["ring_outer"], c.ring_outer_rank, stats)
        return TaspSchedule(domain, outer, params.segments, params.overlap)

    def layouts(self, schedule: Any, base: Any) -> tuple[Any, Any]:
        if not isinstance(schedule, TaspSchedule):  # a domain of one rank runs the outer ring
            return base, None
        pieces = PieceLayout(base, schedule.pieces)  # a step's block = one piece from each cycle
        return GroupLayout(pieces, schedule.step_groups, interleave=schedule.segments), base

    def cache_key(self, params: RingParams) -> tuple:
        return (self.name, params.overlap, params.segments)

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        ring = params.ring
        d, r_out = _check_domain(ring, params.inner)
        unit, out = 2 * shape.batch * shape.kv_heads * shape.head_dim, {}  # elements of K and V per token
        subchunks = tasp_subchunks(shape.tokens, d, params.segments)
        for peer, tokens in zip(tasp_peers(ring, rank, d), subchunks, strict=True):
            add_bytes(out, rank, peer, "p2p", r_out * (d - 1) * unit * tokens * shape.element_bytes)
            if backward:
                add_bytes(out, rank, peer, "p2p", r_out * d * unit * tokens * shape.acc_bytes)
        _, outer_next = double_ring_peers(ring, rank, d)
        kv = 2 * shape.kv_elements
        add_bytes(out, rank, outer_next, "p2p", (r_out - 1) * kv * shape.element_bytes)
        if backward and r_out > 1:
            add_bytes(out, rank, outer_next, "p2p", r_out * kv * shape.acc_bytes)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        """As the ring family's (``schedules/ring.py``)."""
        r_in, r_out = _check_domain(params.ring, params.inner)
        return chain_rounds(params.ring, r_in, r_out, backward)

    def report_rows(self, params: RingParams) -> list[tuple[str, str]]:
        domain = params.r_in
        if domain < 2:
            return []
        cycles = hamiltonian_decomposition(domain)
        shown = " ".join("→".join(str(x) for x in c) for c in cycles[:4]) + (
            " ..." if len(cycles) > 4 else ""
        )
        return [("TASP cycles", f"{len(cycles)} over each domain of {domain}: {shown}")]
