"""Topology-aware schedules (TASP, StarTrail, ATTENTION2D) on real gloo ranks vs the dense fp64 reference.

Every case goes through ``ds_seqpar.attention`` with a ``sequence_parallel`` section naming the schedule,
so config, mesh groups, layouts, the engine and the team wrapper are all exercised; each rank reports the
max abs errors of its shard (out and every gradient), its work counter and the bytes it sent per peer.
Many cases run inside one spawned group per world size.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_seqpar import SeqParMesh
from ds_seqpar.config import SequenceParallelConfig
from ds_seqpar.layout import doc_ids_from_cu_seqlens, input_layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.parallel.ring import WorkCounter
from ds_seqpar.parallel.usp import attention
from tests.test_ring import TOL, _inputs, _reference


def _config(world: int, case: dict) -> SequenceParallelConfig:
    ring = {"layout": case["layout"], "schedule": case["schedule"]}
    for key in ("team_size", "grid", "inner_size", "startrail_backward"):
        if case.get(key) is not None:
            ring[key] = case[key]
    section = SequenceParallelConfig(size=world, ulysses_degree=case.get("u", 1), ring=ring)
    return section.validate(None, world)


def run_schedule_cases(cases: list[dict]) -> list[dict]:
    """Run every case on this rank: errors of its shard, work, bytes per peer (forward, backward)."""
    world = torch.distributed.get_world_size()
    meshes: dict[tuple, SeqParMesh] = {}
    results = []
    for case in cases:
        key = (case.get("u", 1), case.get("inner_size"))
        if key not in meshes:
            meshes[key] = SeqParMesh.build(world, *key)
        mesh = meshes[key]
        mesh.config = _config(world, case)
        layout = input_layout(mesh)
        seq_len, dtype = case["seq_len"], case["dtype"]
        spec = MaskSpec(causal=case["causal"], window=case.get("window"))
        docs = doc_ids_from_cu_seqlens(case["cu_seqlens"], seq_len) if case.get("cu_seqlens") else None
        q, k, v, dout = _inputs(seq_len, case["h_kv"], dtype, case["seed"])
        ref = _reference(q, k, v, dout, spec, docs)
        me = mesh.coords.sp_rank
        ql, kl, vl, dl = (
            layout.shard(t, me).detach().clone().requires_grad_(t is not dout) for t in (q, k, v, dout)
        )
        work = WorkCounter()
        with mesh.comm_stats.measure() as fwd:
            out = attention(
                ql,
                kl,
                vl,
                mesh=mesh,
                causal=case["causal"],
                window=case.get("window"),
                doc_ids=docs,
                work=work,
            )
        with mesh.comm_stats.measure() as bwd:
            out.backward(dl)
        ref_out, ref_dq, ref_dk, ref_dv = (layout.shard(t, me, dim=1) for t in (ref[0], *ref[2:]))
        errors = {
            "out": (out.double() - ref_out).abs().max().item(),
            "dq": (ql.grad.double() - ref_dq).abs().max().item(),
            "dk": (kl.grad.double() - ref_dk).abs().max().item(),
            "dv": (vl.grad.double() - ref_dv).abs().max().item(),
            "nan": any(bool(torch.isnan(t).any()) for t in (out, ql.grad, kl.grad, vl.grad)),
        }
        results.append(
            {
                "errors": errors,
                "work": work.forward_pairs,
                "fwd_peers": fwd.peer_bytes(),
                "bwd_peers": bwd.peer_bytes(),
                "fwd": fwd.as_dict(),
                "bwd": bwd.as_dict(),
            }
        )
    return results


def _check(case: dict, per_rank: list[dict]) -> None:
    tol = TOL[case["dtype"]]
    for rank, res in enumerate(per_rank):
        e = res["errors"]
        where = f"{case} rank {rank}: {e}"
        assert not e["nan"], where
        for name in ("out", "dq", "dk", "dv"):
            assert e[name] <= tol, where


def _run(pool, cases: list[dict]) -> list[list[dict]]:
    results = pool.run(run_schedule_cases, cases)
    per_case = [[per_rank[i] for per_rank in results] for i in range(len(cases))]
    for case, got in zip(cases, per_case):
        _check(case, got)
    return per_case


H = 4  # query heads of tests.test_ring's inputs


def _matrix(world: int, schedule: dict, seq_len: int, seed: int) -> list[dict]:
    """causal x layout x MHA/GQA in fp64, plus fp32, packed documents and a window."""
    cases = []
    for causal, layout, h_kv in itertools.product((True, False), ("zigzag", "contiguous"), (H, 1)):
        cases.append(
            dict(schedule, layout=layout, causal=causal, h_kv=h_kv, dtype=torch.float64, seq_len=seq_len)
        )
    cases.append(dict(schedule, layout="zigzag", causal=True, h_kv=2, dtype=torch.float32, seq_len=seq_len))
    cases.append(
        dict(schedule, layout="zigzag", causal=True, h_kv=2, dtype=torch.float64, seq_len=seq_len,
             cu_seqlens=[0, 5, seq_len // 2 + 3, seq_len - 2])
    )  # fmt: skip
    cases.append(
        dict(schedule, layout="contiguous", causal=False, h_kv=2, dtype=torch.float64, seq_len=seq_len,
             cu_seqlens=[0, 7, seq_len])
    )  # fmt: skip
    cases.append(
        dict(schedule, layout="zigzag", causal=True, window=5, h_kv=1, dtype=torch.float64, seq_len=seq_len)
    )
    return [dict(c, seed=seed + i) for i, c in enumerate(cases)]


STARTRAIL = [(4, 1), (4, 2), (8, 1), (8, 2)]
GRIDS = [(4, (2, 2)), (4, (1, 4)), (4, (4, 1)), (8, (2, 4)), (8, (4, 2)), (9, (3, 3))]
TASP = [(2, None), (3, None), (4, 2), (5, None), (7, None), (8, None)]


def _tasp_len(world: int, inner: int | None) -> int:
    multiple = 2 * world * max(1, (inner or world) - 1)  # zigzag: 2R chunks, each cut into d - 1 pieces
    return multiple * -(-32 // multiple)


@pytest.mark.parametrize("world", sorted({w for w, _ in STARTRAIL}))
def test_startrail_matches_dense_reference(dist_pool, world):
    cases = []
    for w, c in STARTRAIL:
        if w == world:
            for backward in ("kv",):
                cases += _matrix(
                    world, dict(schedule="startrail", team_size=c, startrail_backward=backward), 16 * w, 10
                )
    _run(dist_pool(world), cases)


@pytest.mark.parametrize("world", sorted({w for w, _ in GRIDS}))
def test_attention2d_matches_dense_reference(dist_pool, world):
    cases = []
    for w, grid in GRIDS:
        if w == world:
            cases += _matrix(world, dict(schedule="attention2d", grid=list(grid)), 4 * w * 4, 20)
    _run(dist_pool(world), cases)


@pytest.mark.parametrize("world", sorted({w for w, _ in TASP}))
def test_tasp_matches_dense_reference(dist_pool, world):
    cases = []
    for w, inner in TASP:
        if w == world:
            cases += _matrix(world, dict(schedule="tasp", inner_size=inner), _tasp_len(world, inner), 30)
    _run(dist_pool(world), cases)
