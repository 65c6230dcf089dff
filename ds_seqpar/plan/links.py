"""The link model: seconds to move one rank's bytes on a modelled cluster (docs/comm_model.md "Projection").

No process groups: bytes per peer come from ``comm/model.py``; this module turns them into time.

    link_seconds   link classes in parallel: inter-node = all the rank's cross-node bytes through its NIC;
                   switch node = all its same-node bytes through its injection bandwidth; mesh node = the
                   bytes to its busiest same-node peer over one link
    chain_phases   a chain of K transfer steps beside K' >= K compute steps: K·max(c, t) + (K' − K)·c
                   + the latency of each hop (c, t = compute and link time of one step)
    collective_phases  one exposed phase per collective kind, ⌈log2 p⌉ latencies for a group of p
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ds_seqpar.comm.model import PeerBytes, node_map
from ds_seqpar.plan.clusters import Cluster

__all__ = ["Phases", "Ring", "chain_phases", "collective_phases", "hop_latency", "kind_of", "link_seconds"]

Phases = dict[str, float]  # phase name -> seconds, for one rank


@dataclass(frozen=True)
class Ring:
    """A ring group on the cluster: R ranks, ring rank q = global rank q·stride (node_of[q])."""

    size: int
    node_of: list[int]

    @staticmethod
    def on(cluster: Cluster, size: int, stride: int = 1) -> Ring:
        return Ring(size, node_map(size, cluster.gpus_per_node, stride))

    def representatives(self) -> list[int]:
        """The ring ranks on the first and the last node (the others repeat their pattern)."""
        first, last = self.node_of[0], self.node_of[-1]
        return [q for q in range(self.size) if self.node_of[q] in (first, last)]


def link_seconds(per_peer: Mapping[int, float], rank: int, ring: Ring, cl: Cluster) -> float:
    """Seconds to send ``per_peer`` bytes from ``rank``: link classes in parallel, each at its busiest link."""
    home = ring.node_of[rank]
    inter = sum(v for p, v in per_peer.items() if ring.node_of[p] != home)
    intra = [v for p, v in per_peer.items() if ring.node_of[p] == home]
    intra_s = (sum(intra) if cl.intra == "switch" else max(intra, default=0)) / cl.intra_bw
    return max(inter / cl.inter_bw, intra_s)


def hop_latency(peers: Iterable[int], rank: int, ring: Ring, cl: Cluster) -> float:
    """Latency of one message round to ``peers``: the inter-node one if any peer is on another node."""
    peers = [p for p in peers if p != rank]
    if not peers:
        return 0.0
    return cl.lat_inter if any(ring.node_of[p] != ring.node_of[rank] for p in peers) else cl.lat_intra


def kind_of(peers: PeerBytes, kind: str) -> dict[int, int]:
    """Bytes per peer of one collective kind."""
    return {p: v[kind] for p, v in peers.items() if kind in v}


def collective_phases(peers: PeerBytes, rank: int, ring: Ring, cl: Cluster) -> Phases:
    """One exposed phase per collective kind: link time + ⌈log2 p⌉ latencies (p = members)."""
    out = {}
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        per_peer = kind_of(peers, kind)
        if per_peer:
            hops = math.ceil(math.log2(len(per_peer) + 1))
            out[kind] = link_seconds(per_peer, rank, ring, cl) + hops * hop_latency(per_peer, rank, ring, cl)
    return out


def chain_phases(
    peers: PeerBytes,
    rank: int,
    ring: Ring,
    cl: Cluster,
    *,
    compute: float,
    compute_steps: int,
    steps: int,
    hops: list[tuple[int, int]],
    exposed: list[dict[int, int]],
) -> Phases:
    """The p2p part of a schedule: the ``exposed`` hops one after another (nothing to hide them behind),
    the rest of the p2p bytes spread over ``steps`` transfer steps beside ``compute_steps`` compute
    steps; ``hops`` = (count, peer) message rounds of the chain, each paying its latency."""
    rest = dict(kind_of(peers, "p2p"))
    out: Phases = {}
    for index, hop in enumerate(exposed):
        hop = {p: v for p, v in hop.items() if v and p != rank}
        for p, v in hop.items():
            rest[p] -= v
            if rest[p] < 0:
                raise AssertionError(f"exposed hop {hop} exceeds the model's p2p bytes to {p}")
        if hop:
            out[f"exposed hop {index}"] = link_seconds(hop, rank, ring, cl) + hop_latency(hop, rank, ring, cl)
    c = compute / compute_steps
    pipelined = compute_steps * c
    if steps:
        t = link_seconds(rest, rank, ring, cl) / steps
        latency = sum(count * hop_latency([p], rank, ring, cl) for count, p in hops)
        pipelined = steps * max(c, t) + (compute_steps - steps) * c + latency
    elif any(rest.values()):
        raise AssertionError(f"p2p bytes {rest} left with no transfer step")
    out["compute + p2p chain"] = pipelined
    return out
