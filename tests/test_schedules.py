"""Topology-aware schedules (TASP, StarTrail, ATTENTION2D) on real gloo ranks vs the dense fp64 reference.

Every case goes through ``ds_seqpar.attention`` with a ``sequence_parallel`` section naming the schedule,
so config, mesh groups, layouts, the engine and the team wrapper are all exercised; each rank reports the
max abs errors of its shard (out and every gradient), its work counter and the bytes it sent per peer.
Many cases run inside one spawned group per world size.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from ds_seqpar.comm import model
from tests.helpers.cases import AttentionCase
from tests.helpers.references import TOL, H, assert_within
from tests.helpers.schedule_cases import byte_cases, run_schedule_cases


def _check(case: AttentionCase, per_rank: list[dict]) -> None:
    for rank, res in enumerate(per_rank):
        e = res["errors"]
        where = f"{case} rank {rank}: {e}"
        assert not e["nan"], where
        assert_within({name: e[name] for name in ("out", "dq", "dk", "dv")}, TOL[case.dtype], where)


def _run(pool, cases: list[AttentionCase]) -> list[list[dict]]:
    results = pool.run(run_schedule_cases, cases)
    per_case = [[per_rank[i] for per_rank in results] for i in range(len(cases))]
    for case, got in zip(cases, per_case, strict=True):
        _check(case, got)
    return per_case


def _matrix(schedule: AttentionCase, seq_len: int, seed: int) -> list[AttentionCase]:
    """causal x layout x MHA/GQA in fp64, plus fp32, packed documents and a window (of ``schedule``'s mesh)."""
    base = replace(schedule, seq_len=seq_len)
    cases = [
        replace(base, layout=layout, causal=causal, h_kv=h_kv)
        for causal, layout, h_kv in itertools.product((True, False), ("zigzag", "contiguous"), (H, 1))
    ]
    cases += [
        replace(base, h_kv=2, dtype=torch.float32),
        replace(base, h_kv=2, cu_seqlens=(0, 5, seq_len // 2 + 3, seq_len - 2)),
        replace(base, layout="contiguous", causal=False, h_kv=2, cu_seqlens=(0, 7, seq_len)),
        replace(base, window=5, h_kv=1),
        replace(base, layout="stripe", h_kv=2),
    ]
    return [replace(c, seed=seed + i) for i, c in enumerate(cases)]


STARTRAIL = [(4, 1), (4, 2), (8, 1), (8, 2)]
GRIDS = [(4, (2, 2)), (4, (1, 4)), (4, (4, 1)), (8, (2, 4)), (8, (4, 2)), (9, (3, 3))]
TASP = [(2, None), (3, None), (4, 2), (5, None), (7, None), (8, None)]


def _tasp_len(world: int, inner: int | None) -> int:
    multiple = 2 * world * max(1, (inner or world) - 1)  # zigzag: 2R chunks, each cut into d - 1 pieces
    return multiple * -(-32 // multiple)


def _with_slow(worlds: set[int], slow: set[int]) -> list:
    """The worlds in order; those in ``slow`` (the costliest, ~30 s each) run in the slow suite."""
    return [pytest.param(w, marks=pytest.mark.slow) if w in slow else w for w in sorted(worlds)]


@pytest.mark.parametrize("world", sorted({w for w, _ in STARTRAIL}))
def test_startrail_matches_dense_reference(dist_pool, world):
    cases = []
    for w, c in STARTRAIL:
        if w == world:
            for backward in ("kv", "query"):
                startrail = AttentionCase(schedule="startrail", team_size=c, startrail_backward=backward)
                cases += _matrix(startrail, 16 * w, 10)
    _run(dist_pool(world), cases)


@pytest.mark.parametrize("world", _with_slow({w for w, _ in GRIDS}, {9}))
def test_attention2d_matches_dense_reference(dist_pool, world):
    cases = []
    for w, grid in GRIDS:
        if w == world:
            cases += _matrix(AttentionCase(schedule="attention2d", grid=grid), 4 * w * 4, 20)
    _run(dist_pool(world), cases)


@pytest.mark.parametrize("world", _with_slow({w for w, _ in TASP}, {7}))
def test_tasp_matches_dense_reference(dist_pool, world):
    cases = []
    for w, inner in TASP:
        if w == world:
            cases += _matrix(AttentionCase(schedule="tasp", inner=inner), _tasp_len(world, inner), 30)
    _run(dist_pool(world), cases)


def test_schedules_under_ulysses(dist_pool):
    """U x schedule: Ulysses 2 outside a ring of 4 run by each topology-aware schedule."""
    schedules = [
        AttentionCase(schedule="startrail", team_size=2, startrail_backward="auto"),
        AttentionCase(schedule="attention2d", grid=(2, 2)),
        AttentionCase(schedule="tasp", inner=2),
    ]
    cases = [
        replace(schedule, u=2, causal=causal, h_kv=2, seq_len=64, seed=40 + i)
        for i, (schedule, causal) in enumerate(itertools.product(schedules, (True, False)))
    ]
    _run(dist_pool(8), cases)


def _balance_cases(world: int) -> list[AttentionCase]:
    base = AttentionCase(h_kv=1, dtype=torch.float32, seed=50, seq_len=2 * world * 32)
    return [
        replace(base, schedule="startrail", team_size=2),
        replace(base, schedule="attention2d", grid=(2, world // 2)),
        replace(base, schedule="tasp", inner=None if world not in (4, 6) else 2, seq_len=2 * world * 7 * 8),
    ]


def test_causal_balance_of_each_schedule_with_zigzag(dist_pool):
    """Work counter max / mean <= 1.05 for every schedule with its balanced (zigzag) layout."""
    cases = _balance_cases(8)
    for case, per_rank in zip(cases, _run(dist_pool(8), cases)):
        work = [r["work"] for r in per_rank]
        assert max(work) / (sum(work) / len(work)) <= 1.05, (case.schedule, work)


@pytest.mark.slow
def test_schedules_at_p16(dist_pool):
    """P = 16: StarTrail C in {1, 2, 4}, TASP as the inner ring (8) of a double ring, ATTENTION2D 4 x 4."""
    cases = [
        AttentionCase(schedule="startrail", team_size=c, layout=layout, causal=causal, h_kv=h_kv, seq_len=128)
        for c in (1, 2, 4)
        for causal, layout, h_kv in itertools.product((True, False), ("zigzag", "contiguous"), (H, 1))
    ]
    for causal, h_kv in itertools.product((True, False), (H, 1)):
        cases.append(AttentionCase(schedule="tasp", inner=8, causal=causal, h_kv=h_kv, seq_len=2 * 16 * 7))
        cases.append(
            AttentionCase(schedule="attention2d", grid=(4, 4), causal=causal, h_kv=h_kv, seq_len=128)
        )
    _run(dist_pool(16), [replace(c, seed=60 + i) for i, c in enumerate(cases)])


def _model_bytes(case: AttentionCase, world: int, rank: int, backward: bool) -> model.PeerBytes:
    """The model's bytes of ring rank ``rank`` per peer (U = 1: ring rank = global rank)."""
    shape = model.LayerShape.of(2, case.seq_len // world, H, case.h_kv, 8, case.dtype.itemsize)
    kind = case.startrail_backward
    if kind == "auto":
        kind = model.startrail_backward_choice(shape, case.team_size or 1)
    return model.peer_bytes(
        case.schedule, shape, world, rank, backward=backward, inner=case.inner, team_size=case.team_size,
        grid=case.grid, segments=case.segments, startrail_backward=kind,
    )  # fmt: skip


def _model_peers(case: AttentionCase, world: int, rank: int, backward: bool) -> dict[tuple[str, int], int]:
    """``_model_bytes`` keyed like CommStats: (kind, peer) -> bytes."""
    peers = _model_bytes(case, world, rank, backward)
    return {(k, peer): n for peer, kinds in peers.items() for k, n in kinds.items()}


def test_counted_bytes_equal_the_model_per_peer(dist_pool):
    """Every byte each rank sends, per collective kind and per peer, equals comm/model.py exactly (forward
    and backward), nothing is unattributed, and link classes follow ranks_per_node; TASP's busiest link
    carries the ring's / (d - 1), StarTrail sends the ring's inter-node bytes / C plus the skew hop."""
    world = 8
    cases = byte_cases()
    per_case = _run(dist_pool(world), cases)
    for case, per_rank in zip(cases, per_case):
        for rank, got in enumerate(per_rank):
            for backward, key in ((False, "fwd_peers"), (True, "bwd_peers")):
                assert got[key] == _model_peers(case, world, rank, backward), (case, rank, backward)
            for links in (got["fwd_links"], got["bwd_links"]):
                assert links["unattributed"] == 0, (case, rank, links)
            per_node = world if case.ranks_per_node == "auto" else case.ranks_per_node
            want = model.classify(
                _model_bytes(case, world, rank, backward=False), rank, model.node_map(world, per_node)
            )
            assert (got["fwd_links"]["intra"], got["fwd_links"]["inter"]) == (want.intra, want.inter), (
                case,
                rank,
            )
    ring, tasp = per_case[0], per_case[3]
    for rank in range(world):
        ring_link = max(ring[rank]["fwd_peers"].values())
        tasp_links = [n for (kind, _), n in tasp[rank]["fwd_peers"].items() if kind == "p2p"]
        assert len(tasp_links) == world - 1 and max(tasp_links) * (world - 1) == ring_link
    n_kv = 2 * 2 * (cases[5].seq_len // world) * 2 * 8 * 4  # 2·E_kv·b of one rank (B 2, h_kv 2, D 8, fp32)
    for rank, got in enumerate(per_case[5]):
        team_size, m, member = 2, world // 4, rank % 2
        assert got["fwd_links"]["inter"] == ((m - 1) + (member > 0)) * team_size * n_kv, (
            rank,
            got["fwd_links"],
        )


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [
        ("llama", {"schedule": "startrail", "team_size": 2}),
        ("mistral", {"schedule": "attention2d", "grid": [2, 2]}),  # sliding window 12 < S
        ("qwen3", {"schedule": "tasp", "inner_size": 2}),
    ],
)
def test_hf_model_under_each_schedule_equals_non_sp(dist_pool, kind, schedule):
    """A tiny HF model's loss and every parameter gradient under the schedule equal one process's."""
    from tests.helpers.hf_ab import sp_vs_reference
    from tests.helpers.hf_models import batches

    batch = batches(1, 2, 64)[0]
    for rep in dist_pool(4).run(sp_vs_reference, kind, 1, "zigzag", batch, None, None, schedule):
        assert rep["finite"], rep
        assert rep["loss_err"] <= 1e-5 and rep["grad_rel_err"] <= 1e-5, rep
