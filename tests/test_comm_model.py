"""The closed-form communication model (ds_seqpar/comm/model.py, docs/comm_model.md): its identities.

The schedules' byte counters are tested against ``peer_bytes`` elsewhere; here the model is held to
the per-rank totals docs/ring.md states for the ring and the all-gather, and to the relations between
schedules docs/schedules.md derives: TASP moves the ring's bytes over d − 1 links, StarTrail with C = 1
is the ring, ATTENTION2D's degenerate grids are all-gather-KV and all-gather-Q.
"""

from __future__ import annotations

import pytest

from ds_seqpar.comm.model import (
    LayerShape,
    attention2d_grids,
    classify,
    kind_totals,
    node_map,
    peer_bytes,
    rounds,
    startrail_backward_choice,
    startrail_peers,
    startrail_team_sizes,
    tasp_peers,
    tasp_subchunks,
)

MHA = LayerShape.of(batch=2, tokens=840, heads=4, kv_heads=4, head_dim=16, element_bytes=2)
GQA = LayerShape.of(batch=1, tokens=840, heads=8, kv_heads=2, head_dim=8, element_bytes=4)
FP64 = LayerShape.of(batch=1, tokens=840, heads=2, kv_heads=1, head_dim=4, element_bytes=8)


def both(schedule: str, shape: LayerShape, ring: int, rank: int, **kw) -> tuple[dict, dict]:
    return tuple(peer_bytes(schedule, shape, ring, rank, backward=bw, **kw) for bw in (False, True))


def busiest(peers: dict) -> int:
    return max(sum(kinds.values()) for kinds in peers.values())


@pytest.mark.parametrize("shape", [MHA, GQA, FP64], ids=["bf16-mha", "fp32-gqa", "fp64"])
@pytest.mark.parametrize(
    ("ring", "inner"), [(1, None), (2, None), (3, None), (8, None), (8, 2), (8, 4), (8, 1), (12, 3), (6, 6)]
)
def test_ring_and_all_gather_totals_are_the_documented_formulas(shape, ring, inner):
    """docs/ring.md "Bytes per rank and layer": fwd 2(R − 1)·blk·b; bwd the same + 2(R·[R_in > 1] +
    R_out·[R_out > 1])·blk·a (p2p), all-gather again + reduce-scatter 2(R − 1)·blk·a (all_gather)."""
    blk, b, a = shape.kv_elements, shape.element_bytes, shape.acc_bytes
    r_in = inner or ring
    r_out = ring // r_in
    kv = 2 * (ring - 1) * blk * b
    sends = (ring if r_in > 1 else 0) + (r_out if r_out > 1 else 0)
    want = {
        "p2p": ({"p2p": kv}, {"p2p": kv + 2 * sends * blk * a}),
        "all_gather": ({"all_gather": kv}, {"all_gather": kv, "reduce_scatter": 2 * (ring - 1) * blk * a}),
    }
    for schedule, (forward, backward) in want.items():
        for rank in range(ring):
            fwd, bwd = both(schedule, shape, ring, rank, inner=inner)
            assert kind_totals(fwd) == {k: v for k, v in forward.items() if v}
            assert kind_totals(bwd) == {k: v for k, v in backward.items() if v}


def test_single_ring_sends_only_to_its_successor():
    fwd, bwd = both("p2p", MHA, 5, 3)
    e_kv = MHA.kv_elements
    assert fwd == {4: {"p2p": 4 * 2 * e_kv * 2}}
    assert bwd == {4: {"p2p": 4 * 2 * e_kv * 2 + 5 * 2 * e_kv * 4}}
    assert peer_bytes("p2p", MHA, 1, 0, backward=True) == {}


def test_double_ring_splits_inner_and_outer_successors():
    # R = 8 = R_out 2 × R_in 4, rank 6 = (o 1, i 2): inner next 7, outer next 2
    fwd, bwd = both("p2p", GQA, 8, 6, inner=4)
    kv = 2 * GQA.kv_elements
    assert fwd == {7: {"p2p": 2 * 3 * kv * 4}, 2: {"p2p": 1 * kv * 4}}
    assert bwd == {7: {"p2p": 2 * 3 * kv * 4 + 8 * kv * 4}, 2: {"p2p": kv * 4 + 2 * kv * 4}}
    # R_out = 2, R_in = 1 would make inner next = self; R_in = 2, R_out = 2 on R = 4: distinct peers
    fwd4, _ = both("p2p", GQA, 4, 0, inner=2)
    assert set(fwd4) == {1, 2}


@pytest.mark.parametrize("shape", [MHA, GQA, FP64], ids=["bf16-mha", "fp32-gqa", "fp64"])
@pytest.mark.parametrize(("ring", "inner"), [(3, None), (5, None), (7, None), (8, None), (10, 5), (16, 8)])
@pytest.mark.parametrize("segments", [1, 2])
def test_tasp_moves_the_ring_bytes_over_every_link(shape, ring, inner, segments):
    """Same totals as the (double) ring of the same R / inner when d − 1 divides the segments."""
    d = inner or ring
    for rank in range(ring):
        tasp = both("tasp", shape, ring, rank, inner=inner, segments=segments)
        ring_ = both("p2p", shape, ring, rank, inner=inner)
        for got, want in zip(tasp, ring_, strict=True):
            assert kind_totals(got) == kind_totals(want)
        domain = {(rank // d) * d + x for x in range(d)} - {rank}
        assert domain <= set(tasp[0]) and domain <= set(tasp[1])  # every link of the domain carries bytes


@pytest.mark.parametrize("d", [3, 5, 7, 8])
@pytest.mark.parametrize("shape", [MHA, GQA, FP64], ids=["bf16-mha", "fp32-gqa", "fp64"])
def test_tasp_busiest_link_is_the_rings_divided_by_d_minus_1(d, shape):
    for rank in range(d):
        for backward in (False, True):
            tasp = peer_bytes("tasp", shape, d, rank, backward=backward, segments=2)
            ring = peer_bytes("p2p", shape, d, rank, backward=backward)
            assert busiest(tasp) * (d - 1) == busiest(ring)
            assert len(tasp) == d - 1  # all d − 1 outgoing links used, equally
            assert len({sum(k.values()) for k in tasp.values()}) == 1


def test_tasp_peers_follow_the_hamiltonian_cycles_and_uneven_subchunks():
    assert tasp_subchunks(17, 5, 1) == [5, 4, 4, 4]  # tensor_split of 17 into 4
    assert tasp_subchunks(18, 5, 2) == [6, 4, 4, 4]  # two runs of 9 → 3, 2, 2, 2 each
    assert sum(tasp_subchunks(1000, 8, 2)) == 1000
    for rank in range(16):
        peers = tasp_peers(16, rank, 8)
        assert sorted(peers) == sorted({(rank // 8) * 8 + x for x in range(8)} - {rank})
    # d = 2: one cycle, the same as a ring of 2
    assert both("tasp", MHA, 2, 1) == both("p2p", MHA, 2, 1)


@pytest.mark.parametrize("shape", [MHA, GQA, FP64], ids=["bf16-mha", "fp32-gqa", "fp64"])
@pytest.mark.parametrize("ring", [2, 5, 8])
def test_startrail_with_teams_of_one_is_the_single_ring(shape, ring):
    for rank in range(ring):
        assert both("startrail", shape, ring, rank, team_size=1) == both("p2p", shape, ring, rank)
    for backward in (False, True):
        assert rounds("startrail", ring, backward=backward, team_size=1) == rounds(
            "p2p", ring, backward=backward
        )


@pytest.mark.parametrize("shape", [MHA, GQA], ids=["bf16-mha", "fp32-gqa"])
@pytest.mark.parametrize(("ring", "c"), [(8, 2), (16, 2), (16, 4), (18, 3), (32, 4), (64, 8)])
def test_startrail_inter_node_bytes_are_the_rings_over_c_plus_the_skew(shape, ring, c):
    """Teams = nodes (C ranks per node): only the skew and the sub-ring cross nodes, forward
    (m − 1)·2C·E_kv·b + [k ≥ 1]·2C·E_kv·b, about the ring's (R − 1)·2E_kv·b divided by C."""
    m, b = ring // (c * c), shape.element_bytes
    kv = 2 * shape.kv_elements
    nodes = node_map(ring, c)
    ring_inter = (ring - 1) * kv * b
    for rank in range(ring):
        k = rank % c
        got = classify(peer_bytes("startrail", shape, ring, rank, backward=False, team_size=c), rank, nodes)
        assert got.inter == (m - 1) * c * kv * b + (c * kv * b if k else 0)
        assert got.inter <= ring_inter / c + c * kv * b
        team = peer_bytes("startrail", shape, ring, rank, backward=False, team_size=c)
        mates = set(startrail_peers(ring, rank, c).teammates)
        assert got.intra == sum(sum(v.values()) for p, v in team.items() if p in mates)


def test_startrail_peers_cover_every_team_block_once():
    """Member k covers group (a − k) mod C after the skew: across members every KV block is visited once."""
    ring, c = 32, 2
    teams, m = ring // c, ring // (c * c)
    for t in range(teams):
        seen = []
        for k in range(c):
            p = startrail_peers(ring, t * c + k, c)
            start = (t - k * m) % teams  # the block the skew brings in
            g = start // m
            seen += [g * m + (start % m - j) % m for j in range(m)]
            if k:
                assert startrail_peers(ring, p.skew_target, c).member == k
                assert p.unskew_target == ((t - k * m) % teams) * c + k
        assert sorted(seen) == list(range(teams))


def test_startrail_backward_variants_and_choice():
    ring, c = 16, 2
    gqa = LayerShape.of(batch=1, tokens=64, heads=32, kv_heads=8, head_dim=128, element_bytes=2)
    assert startrail_backward_choice(gqa, c) == "kv"  # GQA: K/V travel
    mha = LayerShape.of(batch=1, tokens=64, heads=4, kv_heads=4, head_dim=128, element_bytes=2)
    assert startrail_backward_choice(mha, c) == "query"  # bf16 MHA: Q, dO + fp32 dQ < K, V + fp32 dK, dV
    tie = LayerShape.of(batch=1, tokens=64, heads=2, kv_heads=2, head_dim=2, element_bytes=4)
    assert startrail_backward_choice(tie, c) == "kv"  # 2·(12D + 8) = 16·2·D at D = 2: ties go to kv
    big_kv = LayerShape.of(batch=1, tokens=64, heads=1, kv_heads=8, head_dim=128, element_bytes=2)
    assert startrail_backward_choice(big_kv, c) == "query"
    for rank in range(ring):
        kv = peer_bytes("startrail", gqa, ring, rank, backward=True, team_size=c)
        query = peer_bytes(
            "startrail", gqa, ring, rank, backward=True, team_size=c, startrail_backward="query"
        )
        collectives = ("all_gather", "reduce_scatter")
        assert {p: {k: v[k] for k in collectives if k in v} for p, v in kv.items() if set(v) - {"p2p"}} == {
            p: {k: v[k] for k in collectives if k in v} for p, v in query.items() if set(v) - {"p2p"}
        }
        m, n, h, d = ring // (c * c), gqa.tokens, gqa.heads, gqa.head_dim
        packet = c * n * (2 * h * d * 2 + 2 * h * 4)
        nxt = startrail_peers(ring, rank, c).subring_next
        assert query[nxt]["p2p"] == (m - 1) * packet + m * c * gqa.q_elements * 4


@pytest.mark.parametrize("shape", [MHA, GQA, FP64], ids=["bf16-mha", "fp32-gqa", "fp64"])
@pytest.mark.parametrize("ring", [2, 3, 8])
def test_attention2d_degenerate_grids(shape, ring):
    """(R, 1): one K/V block per rank gathered over everyone = all-gather-KV CP, no output merge.
    (1, R): Q gathered over everyone, K/V stay, outputs LSE-merged by all-to-all (docs/comm_model.md)."""
    b, a = shape.element_bytes, shape.acc_bytes
    for rank in range(ring):
        assert both("attention2d", shape, ring, rank, grid=(ring, 1)) == both("all_gather", shape, ring, rank)
        fwd, bwd = both("attention2d", shape, ring, rank, grid=(1, ring))
        others = set(range(ring)) - {rank}
        assert fwd == {
            p: {"all_gather": shape.q_elements * b, "all_to_all": shape.row_heads * (shape.head_dim + 1) * a}
            for p in others
        }
        assert bwd == {
            p: {
                "all_gather": 2 * shape.q_elements * b + 2 * shape.row_heads * a,
                "reduce_scatter": shape.q_elements * a,
            }
            for p in others
        }


def test_attention2d_square_grid_rows_in_nodes():
    ring, rows = 16, 4
    shape = MHA
    nodes = node_map(ring, rows)  # one row per node
    fwd = peer_bytes("attention2d", shape, ring, 5, backward=False, grid=(4, 4))
    got = classify(fwd, 5, nodes)
    assert got.inter == 3 * 2 * shape.kv_elements * 2  # the column gather only
    assert got.intra == 3 * (shape.q_elements * 2 + shape.row_heads * (shape.head_dim + 1) * 4)
    assert got.busiest_link == max(got.per_peer.values())
    assert (4, 4) in attention2d_grids(16) and len(attention2d_grids(16)) == 5


def test_rounds():
    assert rounds("p2p", 8, backward=False) == 7 and rounds("p2p", 8, backward=True) == 8
    assert rounds("p2p", 8, backward=True, inner=4) == 9 and rounds("p2p", 8, backward=True, inner=1) == 8
    assert rounds("tasp", 16, backward=False, inner=8) == 15
    assert rounds("all_gather", 8, backward=True) == 2
    assert rounds("startrail", 64, backward=False, team_size=4) == 3 + 3  # gather, skew, merge + m − 1
    assert rounds("startrail", 64, backward=True, team_size=4) == 4 + 3 + 1
    assert rounds("startrail", 16, backward=False, team_size=4) == 3  # m = 1: no sub-ring hop
    assert rounds("attention2d", 8, backward=False, grid=(8, 1)) == 1
    assert rounds("attention2d", 8, backward=True, grid=(2, 4)) == 4
    assert rounds("p2p", 1, backward=True) == 0


def test_node_map_and_classify():
    assert node_map(8, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert node_map(4, 8, stride=4) == [0, 0, 1, 1]  # USP: ring ranks of one Ulysses index
    fwd = peer_bytes("p2p", MHA, 8, 3, backward=False)
    assert classify(fwd, 3, node_map(8, 4)).inter == sum(fwd[4].values())
    fwd2 = peer_bytes("p2p", MHA, 8, 2, backward=False)
    assert classify(fwd2, 2, node_map(8, 4)).intra == sum(fwd2[3].values())
    assert classify({}, 0, [0]).busiest_link == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: peer_bytes("startrail", MHA, 16, 0, backward=False, team_size=3),
            r"C=3 .*R=16.*\[1, 2, 4\]",
        ),
        (lambda: peer_bytes("startrail", MHA, 8, 0, backward=False, team_size=None), r"C=None"),
        (lambda: peer_bytes("attention2d", MHA, 8, 0, backward=False, grid=(2, 3)), r"grid=\(2, 3\).*R=8"),
        (lambda: peer_bytes("tasp", MHA, 4, 0, backward=False), r"d=4 .*valid for R=4: \[2\]"),
        (
            lambda: peer_bytes("tasp", MHA, 12, 0, backward=False, inner=6),
            r"d=6 .*valid for R=12: \[2, 3, 12\] \(nearest: 3\)",
        ),
        (lambda: peer_bytes("p2p", MHA, 8, 0, backward=False, inner=3), r"inner=3 .*R=8"),
        (lambda: peer_bytes("tasp", MHA, 5, 0, backward=False, segments=11), r"segments=11"),
        (lambda: peer_bytes("ring", MHA, 8, 0, backward=False), r"schedule='ring'"),
        (lambda: peer_bytes("p2p", MHA, 8, 8, backward=False), r"rank=8"),
        (
            lambda: peer_bytes("startrail", MHA, 8, 0, backward=True, team_size=2, startrail_backward="q"),
            r"startrail_backward='q'",
        ),
        (lambda: rounds("startrail", 8, backward=False, team_size=4), r"C=4 .*R=8"),
    ],
)
def test_bad_parameters_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_valid_choices():
    assert startrail_team_sizes(64) == [1, 2, 4, 8]
    assert startrail_team_sizes(18) == [1, 3]


def test_projection_is_bounded_by_the_compute_floor_and_sees_the_links():
    """benchmarks/project.py: no schedule beats free communication; on switch nodes TASP's extra links
    buy nothing (injection-bound), on a direct-link mesh they do; compute-bound cases all agree."""
    from benchmarks.project import compute_only_ms, project, setting

    for cluster in ("h100-ib", "mi300x-ib"):
        for seq in (128 * 1024, 1024**2):
            st = setting(cluster, "llama3-8b", seq, 64)
            results, candidates = project(st)
            by = {r.schedule: r for r in results}
            floor = compute_only_ms(st)
            assert all(r.ms >= floor for r in results)
            assert set(candidates["StarTrail"]) == {f"C={c} (kv)" for c in (1, 2, 4, 8)}
            assert by["StarTrail"].ms == min(candidates["StarTrail"].values())
            if seq == 1024**2:
                assert all(r.ms <= 1.05 * floor for r in results)
            elif cluster == "h100-ib":
                assert by["TASP"].ms == pytest.approx(by["double ring"].ms, rel=1e-9)
                assert by["double ring"].ms < by["ring"].ms / 2
            else:
                assert by["TASP"].ms < by["double ring"].ms / 1.5


def test_docs_snippets_run_as_written():
    """docs/comm_model.md's python block runs; every JSON block of docs/schedules.md is a valid section."""
    import json
    import re
    from pathlib import Path

    from ds_seqpar.config import load_config

    docs = Path(__file__).resolve().parents[1] / "docs"
    blocks = re.findall(r"```python\n(.*?)```", (docs / "comm_model.md").read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/comm_model.md", "exec"), {})
    sections = re.findall(r"```json\n(.*?)```", (docs / "schedules.md").read_text(), flags=re.S)
    assert len(sections) == 3
    for text in sections:
        section, _ = load_config(json.loads(text), world_size=16)
        assert section.ring.schedule in ("tasp", "startrail", "attention2d")
