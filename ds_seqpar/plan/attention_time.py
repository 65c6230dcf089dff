"""Time of one attention layer, forward and backward, of one ring rank on a modelled cluster, per schedule
(docs/comm_model.md "Projection"; the planner's use of it: docs/plan.md).

Legend: N = SP degree (``world`` of the setting), S = tokens per sequence, B = batch rows, H / H_kv / D =
query heads, K/V heads, head dim; a rank holds n = S / N tokens. Bytes come from ``comm/model.py``
(Ulysses: ``parallel/comm_volume.py``), time from the link model (``plan/links.py``).

    compute   the setting's forward seconds of one rank's attention (default: causal 2·2·B·S²·H·D / 2
              FLOPs over N ranks at the cluster's throughput); backward = ``backward_factor`` × forward
    phases    {name: seconds} of one rank; a layer's time = the sum over phases of the slowest
              representative rank's (``slowest``)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ds_seqpar.comm.model import (
    LayerShape,
    double_ring_peers,
    peer_bytes,
    startrail_peers,
    tasp_peers,
    tasp_subchunks,
)
from ds_seqpar.plan.clusters import Cluster
from ds_seqpar.plan.links import Phases, Ring, chain_phases, collective_phases

__all__ = [
    "BWD_FACTOR",
    "ZIGZAG_SEGMENTS",
    "AttentionSetting",
    "HeadShape",
    "Result",
    "collective_only",
    "ring_family",
    "slowest",
    "startrail",
    "traffic_of",
    "ulysses_phases",
]

BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs of attention (recompute of P plus dQ, dK, dV)
ZIGZAG_SEGMENTS = 2  # the balanced causal layout every schedule here assumes: 2 runs per rank


class HeadShape(Protocol):
    """The attention shape of one layer: query heads H, K/V heads H_kv, head dim D."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class AttentionSetting:
    """One case: cluster, model, sequence length S, SP degree N (= world), batch B, bytes per element.

    ``attention_forward_s``: one rank's forward attention seconds (None: the causal FLOP rule at the
    cluster's throughput); ``backward_factor``: backward seconds / forward seconds."""

    cluster: Cluster
    model: HeadShape
    seq_len: int
    world: int
    batch: int = 1
    element_bytes: int = 2
    attention_forward_s: float | None = None
    backward_factor: float = BWD_FACTOR

    @property
    def acc_bytes(self) -> int:
        return 8 if self.element_bytes == 8 else 4

    @property
    def forward_seconds(self) -> float:
        """One rank's forward compute: 2·2·B·S²·H·D / 2 FLOPs over N ranks (or ``attention_forward_s``)."""
        if self.attention_forward_s is not None:
            return self.attention_forward_s
        m = self.model
        return 2 * self.batch * self.seq_len**2 * m.heads * m.head_dim / self.world / self.cluster.flops

    def shape(self, tokens: int, heads: int, kv_heads: int) -> LayerShape:
        """The byte model's shape of a rank holding ``tokens`` tokens of ``heads`` / ``kv_heads`` heads."""
        return LayerShape(
            self.batch, tokens, heads, kv_heads, self.model.head_dim, self.element_bytes, self.acc_bytes
        )


def ring_family(
    st: AttentionSetting, ring: Ring, shape: LayerShape, rank: int, *, schedule: str, inner: int | None
) -> tuple[Phases, Phases]:
    """Single / double ring (``p2p``) and TASP: R − 1 pipelined steps, R compute steps; backward
    also exposes the last inner and the last outer accumulator return."""
    r = ring.size
    cl = st.cluster
    fwd_s = st.forward_seconds
    if r == 1:
        return {"compute": fwd_s}, {"compute": st.backward_factor * fwd_s}
    kw = {"inner": inner}
    if schedule == "tasp":
        kw["segments"] = ZIGZAG_SEGMENTS
    fwd, bwd = (peer_bytes(schedule, shape, r, rank, backward=b, **kw) for b in (False, True))
    r_in = inner or r
    r_out = r // r_in
    inner_next, outer_next = double_ring_peers(r, rank, r_in)
    acc_unit = 2 * shape.batch * shape.kv_heads * shape.head_dim * shape.acc_bytes  # dK + dV per token
    if schedule == "tasp":
        links = tasp_peers(r, rank, r_in)
        chunks = tasp_subchunks(shape.tokens, r_in, ZIGZAG_SEGMENTS)
        closing = {p: acc_unit * s for p, s in zip(links, chunks, strict=True)}
        inner_hop = links[0]
    else:
        closing = {inner_next: acc_unit * shape.tokens} if r_in > 1 else {}
        inner_hop = inner_next
    exposed_bwd = [closing, {outer_next: acc_unit * shape.tokens} if r_out > 1 else {}]
    hops = [(r_out * (r_in - 1), inner_hop), (r_out - 1, outer_next)]
    common = {"compute_steps": r, "steps": r - 1, "hops": hops}
    return (
        chain_phases(fwd, rank, ring, cl, compute=fwd_s, exposed=[], **common),
        chain_phases(bwd, rank, ring, cl, compute=st.backward_factor * fwd_s, exposed=exposed_bwd, **common),
    )


def startrail(
    st: AttentionSetting, ring: Ring, shape: LayerShape, rank: int, *, team_size: int, variant: str
) -> tuple[Phases, Phases]:
    """Team collectives exposed; the skew (and, backward, the closing hop and the un-skew) exposed;
    m − 1 sub-ring hops pipelined beside m compute steps."""
    r, c = ring.size, team_size
    m = r // (c * c)
    cl = st.cluster
    fwd_s = st.forward_seconds
    p = startrail_peers(r, rank, c)
    b, a = shape.element_bytes, shape.acc_bytes
    kv_hop = 2 * c * shape.kv_elements * b
    if variant == "kv":
        hop_b, back = kv_hop, 2 * c * shape.kv_elements * a
    else:
        hop_b, back = c * (2 * shape.q_elements * b + 2 * shape.row_heads * a), c * shape.q_elements * a
    out = []
    for backward in (False, True):
        peers = peer_bytes(
            "startrail", shape, r, rank, backward=backward, team_size=c, startrail_backward=variant
        )
        skew = {p.skew_target: hop_b if backward else kv_hop} if p.skew_target is not None else {}
        exposed = [skew]
        if backward:
            exposed += [{p.subring_next: back} if m > 1 else {}]
            exposed += [{p.unskew_target: back} if p.unskew_target is not None else {}]
        phases = collective_phases(peers, rank, ring, cl)
        phases.update(
            chain_phases(
                peers,
                rank,
                ring,
                cl,
                compute=fwd_s * (st.backward_factor if backward else 1),
                compute_steps=m,
                steps=m - 1,
                hops=[(m - 1, p.subring_next)],
                exposed=exposed,
            )
        )
        out.append(phases)
    return out[0], out[1]


def collective_only(
    st: AttentionSetting,
    ring: Ring,
    shape: LayerShape,
    rank: int,
    *,
    schedule: str,
    grid: tuple[int, int] | None,
) -> tuple[Phases, Phases]:
    """ATTENTION2D (and all-gather CP): collectives, then the whole compute; nothing overlapped."""
    out = []
    for backward in (False, True):
        peers = peer_bytes(schedule, shape, ring.size, rank, backward=backward, grid=grid)
        phases = collective_phases(peers, rank, ring, st.cluster)
        phases["compute"] = st.forward_seconds * (st.backward_factor if backward else 1)
        out.append(phases)
    return out[0], out[1]


def ulysses_bytes_of(st: AttentionSetting, degree: int) -> tuple[int, int]:
    """(forward, backward) bytes one Ulysses rank sends per layer (backward with Δ)."""
    from ds_seqpar.parallel.comm_volume import delta_bytes, ulysses_bytes

    m = st.model
    n = st.seq_len // st.world
    args = (st.batch, n, m.heads, m.kv_heads, m.head_dim, degree, st.element_bytes, 0)
    fwd = ulysses_bytes(*args, backward=False)
    bwd = ulysses_bytes(*args, backward=True) + delta_bytes(st.batch, n, m.heads, degree, st.acc_bytes)
    return fwd, bwd


def ulysses_phases(st: AttentionSetting, degree: int) -> tuple[Phases, Phases]:
    """USP's all-to-alls (bytes: comm_volume.ulysses_bytes, + Δ in backward) inside the node; a group wider
    than a node sends the share of its peers on other nodes through the NIC (link classes in parallel)."""
    if degree == 1:
        return {}, {}
    cl = st.cluster
    fwd, bwd = ulysses_bytes_of(st, degree)
    g = cl.gpus_per_node
    share = 1 if cl.intra == "switch" else min(degree, g) - 1  # mesh: one link per peer, equal shares
    latency = 2 * math.ceil(math.log2(degree)) * cl.lat_intra  # two exchanges each way

    def seconds(nbytes: int) -> float:
        if degree <= g:
            return nbytes / share / cl.intra_bw + latency
        outside = (degree - g) / (degree - 1)  # peers on other nodes
        intra = nbytes * (1 - outside) / max(share, 1) / cl.intra_bw
        return max(intra, nbytes * outside / cl.inter_bw) + 2 * math.ceil(math.log2(degree)) * cl.lat_inter

    return {"ulysses all_to_all": seconds(fwd)}, {"ulysses all_to_all": seconds(bwd)}


@dataclass
class Result:
    """One schedule's projected time (ms per layer) and its choice (C, grid, U, d)."""

    schedule: str
    choice: str
    fwd_ms: float
    bwd_ms: float
    inter_mb: float  # bytes the busiest representative rank sends across nodes per layer (fwd + bwd)
    intra_mb: float
    phases: dict[str, dict[str, float]]

    @property
    def ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


Evaluate = Callable[[int], tuple[Phases, Phases]]


def slowest(
    name: str, choice: str, ring: Ring, evaluate: Evaluate, traffic: Callable[[int], tuple[int, int]]
) -> Result:
    """Sum over phases of the slowest representative rank's phase time; traffic of the busiest rank."""
    fwd: Phases = {}
    bwd: Phases = {}
    inter = intra = 0
    for rank in ring.representatives():
        f, b = evaluate(rank)
        for acc, phases in ((fwd, f), (bwd, b)):
            for key, sec in phases.items():
                acc[key] = max(acc.get(key, 0.0), sec)
        x, y = traffic(rank)
        inter, intra = max(inter, x), max(intra, y)
    return Result(
        name,
        choice,
        1e3 * sum(fwd.values()),
        1e3 * sum(bwd.values()),
        inter / 1e6,
        intra / 1e6,
        {"forward": {k: 1e3 * v for k, v in fwd.items()}, "backward": {k: 1e3 * v for k, v in bwd.items()}},
    )


def traffic_of(ring: Ring, shape: LayerShape, schedule: str, **kw) -> Callable[[int], tuple[int, int]]:
    """(inter-node, same-node) bytes of a rank, forward + backward."""

    def count(rank: int) -> tuple[int, int]:
        inter = intra = 0
        for backward in (False, True):
            for peer, kinds in peer_bytes(schedule, shape, ring.size, rank, backward=backward, **kw).items():
                if ring.node_of[peer] == ring.node_of[rank]:
                    intra += sum(kinds.values())
                else:
                    inter += sum(kinds.values())
        return inter, intra

    return count
