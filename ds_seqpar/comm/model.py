"""Closed-form communication model: the bytes one ring rank sends to each peer in one attention layer.

Every schedule of the ring axis, as its spec states it (``comm/schedules/``, docs/comm_model.md), as a
function of the layer's shape, the ring degree R and the ring rank r. No process groups: the schedules'
own byte counters are tested against these numbers, and ``benchmarks/project.py`` turns them into time
on a cluster model. Legend and result type: ``comm/layer_bytes.py``.

    peer_bytes(schedule, shape, R, r, backward=..., inner=, team_size=, grid=, segments=, startrail_backward=)
    rounds(schedule, R, backward=..., ...)
    classify(peers, r, node_of)   intra / inter node bytes, busiest link
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ds_seqpar.comm.layer_bytes import KINDS, LayerShape, PeerBytes
from ds_seqpar.comm.schedules import SCHEDULES, RingParams, schedule_spec
from ds_seqpar.comm.schedules.attention2d import attention2d_grids, attention2d_peers
from ds_seqpar.comm.schedules.base import check_ring_rank
from ds_seqpar.comm.schedules.ring import double_ring_peers
from ds_seqpar.comm.schedules.startrail import (
    StarTrailPeers,
    startrail_backward_choice,
    startrail_peers,
    startrail_team_sizes,
)
from ds_seqpar.comm.schedules.tasp import tasp_domains, tasp_peers, tasp_subchunks

__all__ = [
    "KINDS",
    "SCHEDULES",
    "LayerShape",
    "PeerBytes",
    "StarTrailPeers",
    "Traffic",
    "attention2d_grids",
    "attention2d_peers",
    "classify",
    "double_ring_peers",
    "kind_totals",
    "node_map",
    "peer_bytes",
    "rounds",
    "startrail_backward_choice",
    "startrail_peers",
    "startrail_team_sizes",
    "tasp_domains",
    "tasp_peers",
    "tasp_subchunks",
]


@dataclass(frozen=True)
class Traffic:
    """One rank's bytes split by where the peer sits: same node (``intra``) or another (``inter``);
    ``busiest_link`` = the most bytes to any one peer; ``per_peer`` = bytes per peer, all kinds summed."""

    intra: int
    inter: int
    busiest_link: int
    per_peer: dict[int, int]


def peer_bytes(
    schedule: str,
    shape: LayerShape,
    ring: int,
    rank: int,
    *,
    backward: bool,
    inner: int | None = None,
    team_size: int | None = None,
    grid: tuple[int, int] | None = None,
    segments: int = 1,
    startrail_backward: str = "kv",
) -> PeerBytes:
    """Bytes ring rank ``rank`` of R = ``ring`` sends to each peer in one layer's forward (or backward).

    ``schedule``: a name in ``SCHEDULES`` (``p2p`` single ring, or double ring with ``inner`` = R_in;
    ``all_gather``; ``tasp`` over domains of d = ``inner`` or R, ``segments`` = runs of the token layout;
    ``startrail`` with ``team_size`` = C and ``startrail_backward`` = kv | query | auto; ``attention2d`` on
    ``grid`` = (P_q, P_kv)). Parameters a schedule does not read are ignored. Formulas: docs/comm_model.md.
    """
    check_ring_rank(ring, rank)
    spec = _spec(schedule)
    if ring == 1:
        return {}
    params = RingParams(ring, inner, True, team_size, grid, segments, startrail_backward)
    return spec.peer_bytes(shape, params, rank, backward)


def rounds(
    schedule: str,
    ring: int,
    *,
    backward: bool,
    inner: int | None = None,
    team_size: int | None = None,
    grid: tuple[int, int] | None = None,
) -> int:
    """Sequential communication rounds of one layer's forward (or backward) on the critical path: a round
    = the transfers a rank posts together and must have completed before it goes on (a batched
    isend/irecv to one or several peers); a collective counts 1; R = 1: 0. Per schedule: its spec's
    ``rounds`` (docs/comm_model.md "Rounds")."""
    check_ring_rank(ring, 0)
    spec = _spec(schedule)
    if ring == 1:
        return 0
    return spec.rounds(RingParams(ring, inner, True, team_size, grid), backward)


def _spec(schedule: str):
    try:
        return schedule_spec(schedule)
    except ValueError:
        raise ValueError(f"schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}") from None


def node_map(ring: int, ranks_per_node: int, stride: int = 1) -> list[int]:
    """node_of[q] for ring ranks q = 0..R−1: ring rank q is global rank q·``stride`` of an SP group that
    starts at rank 0 (stride = the Ulysses degree U), on node (q·stride) // ``ranks_per_node``."""
    if ranks_per_node < 1 or stride < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} and stride={stride} must be positive")
    return [(q * stride) // ranks_per_node for q in range(ring)]


def classify(peers: Mapping[int, Mapping[str, int]], rank: int, node_of: Sequence[int]) -> Traffic:
    """Split ``peers`` (from :func:`peer_bytes` for ``rank``) into same-node and cross-node bytes;
    ``node_of[ring rank]`` = node id (:func:`node_map`)."""
    per_peer = {peer: sum(kinds.values()) for peer, kinds in peers.items()}
    home = node_of[rank]
    intra = sum(v for peer, v in per_peer.items() if node_of[peer] == home)
    inter = sum(v for peer, v in per_peer.items() if node_of[peer] != home)
    return Traffic(intra, inter, max(per_peer.values(), default=0), per_peer)


def kind_totals(peers: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """Bytes per collective kind summed over all peers (what ``CommStats`` records for the rank)."""
    out: dict[str, int] = {}
    for kinds in peers.values():
        for kind, nbytes in kinds.items():
            out[kind] = out.get(kind, 0) + nbytes
    return {kind: nbytes for kind, nbytes in out.items() if nbytes}
