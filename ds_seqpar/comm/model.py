"""Closed-form communication model: the bytes one ring rank sends to each peer in one attention layer.

Every schedule of the ring axis (docs ALGORITHMS.md §4, §7, §9, §10, §11; docs/comm_model.md) as a
function of the layer's shape, the ring degree R and the ring rank r. No torch, no process groups:
the schedules' own byte counters are tested against these numbers, and ``benchmarks/project.py``
turns them into time on a cluster model.

Legend (one ring rank, one layer):
    R        ring ranks 0..R-1 (the ``ring`` group; ring rank q is global rank q·U in an SP group
             with Ulysses degree U, :func:`node_map`)
    B, n     batch rows, tokens held by this rank
    h, h_kv  query / K/V heads on this rank,  D head dim
    b, a     bytes per element of q, k, v / of the accumulator dtype (8 for fp64 inputs, else 4)
    E_q = B·n·h·D,  E_kv = B·n·h_kv·D  (elements of this rank's Q, and of one of its K or V)

Result type: ``PeerBytes`` = {peer ring rank: {collective kind: bytes this rank sends to it}},
kinds ``p2p``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` (as ``CommStats`` names them);
zero entries, empty peers and the rank itself are left out. A collective is counted as the bytes
this rank sends to each member (bandwidth-optimal algorithms: every member receives this rank's
share once).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ds_seqpar.comm.hamiltonian import NO_DECOMPOSITION, hamiltonian_decomposition

__all__ = [
    "KINDS",
    "SCHEDULES",
    "LayerShape",
    "PeerBytes",
    "StarTrailPeers",
    "Traffic",
    "accumulator_bytes",
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

KINDS = ("p2p", "all_gather", "reduce_scatter", "all_to_all")
SCHEDULES = ("p2p", "all_gather", "tasp", "startrail", "attention2d")
STARTRAIL_BACKWARDS = ("kv", "query")

PeerBytes = dict[int, dict[str, int]]


def accumulator_bytes(element_bytes: int) -> int:
    """Bytes of the accumulator dtype (out, lse, dK/dV, dQ partials) for inputs of ``element_bytes``."""
    return 8 if element_bytes == 8 else 4


@dataclass(frozen=True)
class LayerShape:
    """One ring rank's share of one attention layer: q [batch, tokens, heads, head_dim], k and v
    [batch, tokens, kv_heads, head_dim]; ``element_bytes`` of q/k/v, ``acc_bytes`` of the accumulators."""

    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    acc_bytes: int

    def __post_init__(self) -> None:
        for name in ("batch", "tokens", "heads", "kv_heads", "head_dim", "element_bytes", "acc_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerShape.{name} must be a positive int; got {value!r}")

    @classmethod
    def of(
        cls, batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element_bytes: int
    ) -> LayerShape:
        """The shape with the accumulator dtype that goes with ``element_bytes`` (:func:`accumulator_bytes`)."""
        return cls(batch, tokens, heads, kv_heads, head_dim, element_bytes, accumulator_bytes(element_bytes))

    @property
    def q_elements(self) -> int:
        """E_q = B·n·h·D."""
        return self.batch * self.tokens * self.heads * self.head_dim

    @property
    def kv_elements(self) -> int:
        """E_kv = B·n·h_kv·D (one of K or V)."""
        return self.batch * self.tokens * self.kv_heads * self.head_dim

    @property
    def row_heads(self) -> int:
        """B·n·h: one value per query row and head (lse, Δ)."""
        return self.batch * self.tokens * self.heads


@dataclass(frozen=True)
class Traffic:
    """One rank's bytes split by where the peer sits: same node (``intra``) or another (``inter``);
    ``busiest_link`` = the most bytes to any one peer; ``per_peer`` = bytes per peer, all kinds summed."""

    intra: int
    inter: int
    busiest_link: int
    per_peer: dict[int, int]


@dataclass(frozen=True)
class StarTrailPeers:
    """Rank r = t·C + k of a StarTrail ring (team t, member k; t = a·m + i, group a, offset i) and its peers."""

    team: int
    member: int
    group: int
    offset: int
    teammates: tuple[int, ...]
    skew_target: int | None  # receives this team's K/V (or query packet) at the start; None for k = 0
    subring_next: int  # next rank of the closed sub-ring (member k of the teams of group a)
    unskew_target: int | None  # backward: the travelling accumulators go home here; None for k = 0


# ---------------------------------------------------------------------------------------------------
# peers of each schedule


def _check_ring(ring: int, rank: int) -> None:
    if not isinstance(ring, int) or ring < 1:
        raise ValueError(f"ring degree must be a positive int; got R={ring!r}")
    if not 0 <= rank < ring:
        raise ValueError(f"rank={rank} is not a ring rank of R={ring} (0..{ring - 1})")


def _split_domain(ring: int, inner: int | None, what: str) -> tuple[int, int]:
    """(R_in, R_out) for ``inner`` (None = one level, R_in = R)."""
    r_in = ring if inner is None else inner
    if not isinstance(r_in, int) or r_in < 1 or ring % r_in:
        valid = [d for d in range(1, ring + 1) if ring % d == 0]
        raise ValueError(f"{what}={inner!r} does not divide the ring degree R={ring}; valid: {valid}")
    return r_in, ring // r_in


def double_ring_peers(ring: int, rank: int, inner: int | None = None) -> tuple[int, int]:
    """(inner next, outer next) of ring rank ``rank`` = o·R_in + i: o·R_in + (i+1) % R_in and
    ((o+1) % R_out)·R_in + i. Single ring (``inner`` None or R): inner next = (r+1) % R, outer = r."""
    _check_ring(ring, rank)
    r_in, r_out = _split_domain(ring, inner, "inner")
    o, i = divmod(rank, r_in)
    return o * r_in + (i + 1) % r_in, ((o + 1) % r_out) * r_in + i


def tasp_domains(ring: int) -> list[int]:
    """TASP domain sizes d that divide R and have a Hamiltonian decomposition (d ≥ 2, d ∉ {4, 6})."""
    return [d for d in range(2, ring + 1) if ring % d == 0 and d not in NO_DECOMPOSITION]


def _check_domain(ring: int, domain: int | None) -> tuple[int, int]:
    d, r_out = _split_domain(ring, domain, "tasp domain (inner)")
    if d == 1:
        raise ValueError(
            f"tasp domain d=1 has no concurrent rings (needs d >= 2); valid for R={ring}: {tasp_domains(ring)}"
        )
    if d in NO_DECOMPOSITION:
        raise ValueError(
            f"tasp domain d={d} has no Hamiltonian decomposition (none exists for 4 or 6 ranks, Tillson); "
            f"nearest valid sizes: d={d - 1} or d={d + 1}; valid for R={ring}: {tasp_domains(ring)}"
        )
    return d, r_out


@functools.cache
def _successors(d: int) -> tuple[tuple[int, ...], ...]:
    """succ[c][x] = the rank after x in Hamiltonian cycle c of the decomposition on d ranks."""
    out = []
    for cycle in hamiltonian_decomposition(d):
        succ = [0] * d
        for pos, x in enumerate(cycle):
            succ[x] = cycle[(pos + 1) % d]
        out.append(tuple(succ))
    return tuple(out)


def tasp_peers(ring: int, rank: int, domain: int | None = None) -> list[int]:
    """The d − 1 peers of ring rank ``rank`` = o·d + i, one per Hamiltonian cycle c: o·d + succ_c(i)."""
    _check_ring(ring, rank)
    d, _ = _check_domain(ring, domain)
    o, i = divmod(rank, d)
    return [o * d + succ[i] for succ in _successors(d)]


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


def startrail_team_sizes(ring: int) -> list[int]:
    """Valid StarTrail team sizes C for R ranks: C² | R."""
    return [c for c in range(1, ring + 1) if c * c <= ring and ring % (c * c) == 0]


def startrail_peers(ring: int, rank: int, team_size: int | None) -> StarTrailPeers:
    """Team, member and peers of ring rank ``rank`` in StarTrail with team size C (C² | R, T = R/C teams,
    sub-rings of m = T/C ranks): skew target ((t + k·m) % T)·C + k, sub-ring next
    (a·m + (i+1) % m)·C + k, un-skew target ((t − k·m) % T)·C + k."""
    _check_ring(ring, rank)
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
    )


def attention2d_grids(ring: int) -> list[tuple[int, int]]:
    """Valid ATTENTION2D grids (P_q, P_kv) with P_q · P_kv = R."""
    return [(ring // p_kv, p_kv) for p_kv in range(1, ring + 1) if ring % p_kv == 0]


def attention2d_peers(ring: int, rank: int, grid: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """(row peers, column peers) of ring rank ``rank`` = i·P_kv + j on the grid (P_q, P_kv): row peers
    i·P_kv + j' (j' ≠ j, the Q gather / output merge), column peers i'·P_kv + j (i' ≠ i, the K/V gather)."""
    _check_ring(ring, rank)
    if grid is None or len(grid) != 2 or any(not isinstance(p, int) or p < 1 for p in grid):
        raise ValueError(f"attention2d needs grid=(P_q, P_kv) of positive ints; got grid={grid!r}")
    p_q, p_kv = grid
    if p_q * p_kv != ring:
        raise ValueError(
            f"attention2d grid={grid!r}: P_q·P_kv = {p_q * p_kv} must equal R={ring}; "
            f"valid: {attention2d_grids(ring)}"
        )
    i, j = divmod(rank, p_kv)
    return [i * p_kv + jj for jj in range(p_kv) if jj != j], [ii * p_kv + j for ii in range(p_q) if ii != i]


# ---------------------------------------------------------------------------------------------------
# bytes per peer


def _put(out: PeerBytes, rank: int, peer: int, kind: str, nbytes: int) -> None:
    """Add ``nbytes`` of ``kind`` to ``peer`` (nothing for 0 bytes or the rank itself)."""
    if nbytes and peer != rank:
        kinds = out.setdefault(peer, {})
        kinds[kind] = kinds.get(kind, 0) + nbytes


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

    ``schedule``: ``p2p`` (single ring, or double ring with ``inner`` = R_in), ``all_gather``, ``tasp``
    (domain d = ``inner`` or R; ``segments`` = runs of the token layout: 2 for zigzag, else 1),
    ``startrail`` (``team_size`` = C, ``startrail_backward`` = kv | query), ``attention2d``
    (``grid`` = (P_q, P_kv)). Parameters a schedule does not use are ignored (``inner`` by all_gather,
    as ``comm_volume.ring_bytes`` does). Formulas: docs/comm_model.md "Bytes per peer".
    """
    _check_ring(ring, rank)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    out: PeerBytes = {}
    if ring == 1:
        return out
    builder = {
        "p2p": _ring,
        "all_gather": _all_gather,
        "tasp": _tasp,
        "startrail": _startrail,
        "attention2d": _attention2d,
    }[schedule]
    builder(
        out,
        shape,
        ring,
        rank,
        backward,
        inner=inner,
        team_size=team_size,
        grid=grid,
        segments=segments,
        startrail_backward=startrail_backward,
    )
    return out


def _ring(out: PeerBytes, s: LayerShape, ring: int, rank: int, backward: bool, *, inner, **_) -> None:
    """Single / double ring: K/V blocks travel; in backward dK/dV accumulators follow them home."""
    r_in, r_out = _split_domain(ring, inner, "inner")
    inner_next, outer_next = double_ring_peers(ring, rank, inner)
    kv = 2 * s.kv_elements
    _put(out, rank, inner_next, "p2p", r_out * (r_in - 1) * kv * s.element_bytes)
    _put(out, rank, outer_next, "p2p", (r_out - 1) * kv * s.element_bytes)
    if backward:
        _put(out, rank, inner_next, "p2p", (ring * kv * s.acc_bytes) if r_in > 1 else 0)
        _put(out, rank, outer_next, "p2p", (r_out * kv * s.acc_bytes) if r_out > 1 else 0)


def _all_gather(out: PeerBytes, s: LayerShape, ring: int, rank: int, backward: bool, **_) -> None:
    """Llama-3 style: all-gather K/V over the ring; backward re-gathers and reduce-scatters dK/dV."""
    kv = 2 * s.kv_elements
    for peer in range(ring):
        _put(out, rank, peer, "all_gather", kv * s.element_bytes)
        if backward:
            _put(out, rank, peer, "reduce_scatter", kv * s.acc_bytes)


def _tasp(
    out: PeerBytes, s: LayerShape, ring: int, rank: int, backward: bool, *, inner, segments, **_
) -> None:
    """TASP: d − 1 concurrent rings (Hamiltonian cycles) inside each domain, sub-chunk c on cycle c;
    an outer ring of R/d domains like the double ring's."""
    d, r_out = _check_domain(ring, inner)
    unit = 2 * s.batch * s.kv_heads * s.head_dim  # elements of K and V per token
    for peer, tokens in zip(tasp_peers(ring, rank, d), tasp_subchunks(s.tokens, d, segments), strict=True):
        _put(out, rank, peer, "p2p", r_out * (d - 1) * unit * tokens * s.element_bytes)
        if backward:
            _put(out, rank, peer, "p2p", r_out * d * unit * tokens * s.acc_bytes)
    _, outer_next = double_ring_peers(ring, rank, d)
    kv = 2 * s.kv_elements
    _put(out, rank, outer_next, "p2p", (r_out - 1) * kv * s.element_bytes)
    if backward and r_out > 1:
        _put(out, rank, outer_next, "p2p", r_out * kv * s.acc_bytes)


def _startrail(
    out: PeerBytes,
    s: LayerShape,
    ring: int,
    rank: int,
    backward: bool,
    *,
    team_size,
    startrail_backward,
    **_,
) -> None:
    """StarTrail: team gather, skew hop, m − 1 sub-ring hops, team merge (ALGORITHMS.md §10)."""
    if startrail_backward not in STARTRAIL_BACKWARDS:
        raise ValueError(
            f"startrail_backward={startrail_backward!r} is unknown; valid: {', '.join(STARTRAIL_BACKWARDS)}"
        )
    p = startrail_peers(ring, rank, team_size)
    c = team_size
    m = ring // (c * c)
    b, a = s.element_bytes, s.acc_bytes
    e_q, e_kv, rows = s.q_elements, s.kv_elements, s.row_heads
    for mate in p.teammates:
        if backward:
            _put(out, rank, mate, "all_gather", (2 * e_q + 2 * e_kv) * b + 2 * rows * a)
            _put(out, rank, mate, "reduce_scatter", (e_q + 2 * e_kv) * a)
        else:
            _put(out, rank, mate, "all_gather", (e_q + 2 * e_kv) * b)
            _put(out, rank, mate, "all_to_all", rows * (s.head_dim + 1) * a)
    kv_block = 2 * c * e_kv  # K and V of one team block (C·n tokens)
    if not backward or startrail_backward == "kv":
        hop, acc, closing = kv_block * b, kv_block * a, kv_block * a
    else:  # query packet (Q, dO in b; lse, Δ in a) travels; dQ accumulator C·E_q·a comes home
        hop, acc, closing = c * (2 * e_q * b + 2 * rows * a), c * e_q * a, c * e_q * a
    if p.skew_target is not None:
        _put(out, rank, p.skew_target, "p2p", hop)
    _put(out, rank, p.subring_next, "p2p", (m - 1) * hop)
    if backward:
        _put(out, rank, p.subring_next, "p2p", m * acc if m > 1 else 0)
        if p.unskew_target is not None:
            _put(out, rank, p.unskew_target, "p2p", closing)


def _attention2d(out: PeerBytes, s: LayerShape, ring: int, rank: int, backward: bool, *, grid, **_) -> None:
    """ATTENTION2D: Q gathered over the row, K/V over the column, outputs merged over the row."""
    row, column = attention2d_peers(ring, rank, grid)
    b, a = s.element_bytes, s.acc_bytes
    for peer in row:
        if backward:
            _put(out, rank, peer, "all_gather", 2 * s.q_elements * b + 2 * s.row_heads * a)
            _put(out, rank, peer, "reduce_scatter", s.q_elements * a)
        else:
            _put(out, rank, peer, "all_gather", s.q_elements * b)
            _put(out, rank, peer, "all_to_all", s.row_heads * (s.head_dim + 1) * a)
    for peer in column:
        _put(out, rank, peer, "all_gather", 2 * s.kv_elements * b)
        if backward:
            _put(out, rank, peer, "reduce_scatter", 2 * s.kv_elements * a)


def startrail_backward_choice(shape: LayerShape, team_size: int) -> str:
    """The StarTrail backward variant that sends fewer p2p bytes per sub-ring step: ``query``
    (C·B·n·(2h·D·b + 2h·a) + C·E_q·a) or ``kv`` (2C·E_kv·b + 2C·E_kv·a); ties → ``kv``."""
    c, b, a = team_size, shape.element_bytes, shape.acc_bytes
    query = c * (2 * shape.q_elements * b + 2 * shape.row_heads * a) + c * shape.q_elements * a
    kv = 2 * c * shape.kv_elements * (b + a)
    return "query" if query < kv else "kv"


# ---------------------------------------------------------------------------------------------------
# rounds, placement, classification


def rounds(
    schedule: str,
    ring: int,
    *,
    backward: bool,
    inner: int | None = None,
    team_size: int | None = None,
    grid: tuple[int, int] | None = None,
) -> int:
    """Sequential communication rounds of one layer's forward (or backward) on the critical path.

    A round = the transfers a rank posts together and must have completed before it can go on (a
    batched isend/irecv to one or several peers); a collective counts 1. R = 1: 0.

    * ``p2p`` / ``tasp`` (R_in = ``inner`` or R, R_out = R / R_in): forward R − 1 (R_out·(R_in − 1)
      inner hops + R_out − 1 outer hops, the outer one in flight behind the inner loop); backward
      R − 1 + [R_in > 1] + [R_out > 1] (accumulators ride with the K/V of the next hop, except the last
      inner return and the last outer return). Single ring: R − 1 / R.
    * ``all_gather``: forward 1; backward 2 (gather, reduce-scatter).
    * ``startrail`` (C, m = R/C²): forward [C > 1]·(gather + skew + merge) + m − 1; backward
      [C > 1]·(gather + skew + un-skew + reduce-scatter) + m − 1 + [m > 1] (closing hop); same for
      both backward variants. C = 1 gives the single ring's R − 1 / R.
    * ``attention2d`` (P_q, P_kv): forward [P_kv > 1]·(row gather + row merge) + [P_q > 1]·column
      gather; backward [P_kv > 1]·(row gather + dQ reduce-scatter) + [P_q > 1]·(column gather +
      dK/dV reduce-scatter).
    """
    _check_ring(ring, 0)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    if ring == 1:
        return 0
    if schedule in ("p2p", "tasp"):
        if schedule == "tasp":
            r_in, r_out = _check_domain(ring, inner)
        else:
            r_in, r_out = _split_domain(ring, inner, "inner")
        return ring - 1 + ((r_in > 1) + (r_out > 1) if backward else 0)
    if schedule == "all_gather":
        return 2 if backward else 1
    if schedule == "startrail":
        startrail_peers(ring, 0, team_size)  # validates C
        c = team_size
        m = ring // (c * c)
        collectives = (4 if backward else 3) if c > 1 else 0
        return collectives + m - 1 + (1 if backward and m > 1 else 0)
    attention2d_peers(ring, 0, grid)  # validates the grid
    p_q, p_kv = grid
    row, column = int(p_kv > 1), int(p_q > 1)
    return 2 * (row + column) if backward else 2 * row + column


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
