"""Cross-attention under SP (rotate-Q, LV-XAttn, and rotate-KV) on gloo ranks vs the dense fp64 reference."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import pytest
import torch

from ds_seqpar import SeqParMesh
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.parallel.agree import RankShapeError
from ds_seqpar.parallel.cross import (
    choose_cross_schedule,
    cross_attention,
    cross_bytes,
    cross_plan,
    cross_ulysses_bytes,
)
from tests.helpers.cases import CrossCase
from tests.helpers.references import assert_within

B, H, D = 2, 4, 8


def run_cross_cases(cases: list[CrossCase], u: int = 1) -> list[dict]:
    """Each case on a mesh of U = ``u`` x R = world / u; every rank holds its contiguous 1/world of both sides."""
    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.build(world, u)
    me = mesh.coords.sp_rank
    results = []
    for i, case in enumerate(cases):
        g = torch.Generator().manual_seed(i)
        s_q, s_kv, h_kv = case.s_q, case.s_kv, case.h_kv
        q = torch.randn(B, s_q, H, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, s_kv, h_kv, D, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(B, s_q, H, D, generator=g, dtype=torch.float64)
        mask = None
        if case.padding:
            mask = torch.ones(B, s_kv, dtype=torch.bool)
            mask[0, s_kv - 3 :] = False  # padding at the end of row 0
            mask[1, : s_kv // world] = False  # a whole rank's keys padded in row 1
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, _ = dense_attention_reference(
            *leaves, None if mask is None else mask[:, None, :].expand(B, s_q, s_kv)
        )
        ref.backward(dout)
        local = [t.chunk(world, 1)[me].clone().requires_grad_() for t in (q, k, v)]
        kv_mask = None if mask is None else mask.chunk(world, 1)[me]
        with mesh.comm_stats.measure() as fwd:
            out = cross_attention(*local, mesh=mesh, kv_mask=kv_mask, schedule=case.schedule)
        with mesh.comm_stats.measure() as bwd:
            out.backward(dout.chunk(world, 1)[me])
        want = [ref, *(t.grad for t in leaves)]
        got = [out, *(t.grad for t in local)]
        errors = {
            n: (a - b.chunk(world, 1)[me]).abs().max().item()
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)
        }
        results.append(
            {
                "errors": errors,
                "fwd": fwd.bytes("p2p"),
                "bwd": bwd.bytes("p2p"),
                "total": fwd.total_bytes,
                "ulysses_fwd": fwd.bytes("all_to_all") + fwd.bytes("all_gather"),
                "ulysses_bwd": bwd.bytes("all_to_all"),
                "ulysses_rank": mesh.coords.ulysses_rank,
            }
        )
    return results


def _cases(world: int) -> list[CrossCase]:
    return [
        CrossCase(schedule, s_q, s_kv, h_kv, padding)
        for schedule, (s_q, s_kv), h_kv, padding in itertools.product(
            ("rotate_q", "rotate_kv"), ((world, 8 * world), (4 * world, 4 * world)), (H, 1), (False, True)
        )
    ]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_cross_attention_matches_dense_reference_and_the_byte_formula(dist_pool, world):
    cases = _cases(world)
    for case, per_rank in zip(cases, zip(*dist_pool(world).run(run_cross_cases, cases))):
        n_q, n_kv = case.s_q // world, case.s_kv // world
        for rank, res in enumerate(per_rank):
            assert_within(res["errors"], 1e-10, (case, rank))
            args = (case.schedule, B, n_q, n_kv, H, case.h_kv, D, 8, world, case.padding)
            assert res["fwd"] == res["total"] == cross_bytes(*args), (case, res)
            assert res["bwd"] == cross_bytes(*args, backward=True), (case, res)


ULYSSES_MESHES = [(4, 2), (4, 4), (8, 2), (8, 4)]  # (world, U): U x R = 2x2, 4x1, 2x4, 4x2


@pytest.mark.parametrize(("world", "u"), ULYSSES_MESHES)
def test_ulysses_over_heads_composes_with_both_schedules(dist_pool, world, u):
    """U > 1: all-to-all over heads inside each ring rank (K/V heads replicated when U > H_kv = 1), the
    key mask all-gathered; exact, and the counted bytes equal cross_ulysses_bytes + cross_bytes(U·n)."""
    cases = [c for c in _cases(world) if c.s_q != c.s_kv or c.padding]
    ring = world // u
    for case, per_rank in zip(cases, zip(*dist_pool(world).run(run_cross_cases, cases, u))):
        n_q, n_kv = case.s_q // world, case.s_kv // world
        plan = HeadPlan.build(H, case.h_kv, u)
        for rank, res in enumerate(per_rank):
            assert_within(res["errors"], 1e-10, (case, u, rank))
            me = res["ulysses_rank"]
            common = (B, n_q, n_kv, H, case.h_kv, u, me, D, 8, case.padding)
            assert res["ulysses_fwd"] == cross_ulysses_bytes(*common), (case, res)
            assert res["ulysses_bwd"] == cross_ulysses_bytes(*common, backward=True), (case, res)
            heads = (plan.q_counts[me], plan.kv_counts[me])
            ring_args = (case.schedule, B, u * n_q, u * n_kv, *heads, D, 8, ring, case.padding)
            assert res["fwd"] == cross_bytes(*ring_args), (case, res)
            assert res["bwd"] == cross_bytes(*ring_args, backward=True), (case, res)


def test_auto_rotates_the_smaller_side():
    assert choose_cross_schedule(64, 8, 4096, 2) == "rotate_q"  # 512 < 8192: short text queries
    assert choose_cross_schedule(4096, 8, 4096, 8) == "rotate_kv"  # equal: K/V (the ring)
    assert choose_cross_schedule(4096, 32, 1024, 8) == "rotate_kv"


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule='ring'; valid: auto, rotate_q, rotate_kv"):
        cross_attention(
            torch.zeros(1, 2, 2, 4),
            torch.zeros(1, 2, 2, 4),
            torch.zeros(1, 2, 2, 4),
            mesh=None,
            schedule="ring",
        )


def test_the_mesh_kernel_is_honoured():
    """``sequence_parallel.kernel`` reaches the block calls: a kernel this device lacks fails before any ring."""
    from types import SimpleNamespace

    from ds_seqpar import SequenceParallelConfig

    settings = SequenceParallelConfig(size=2, ulysses_degree=1, kernel="cuda_sdpa").validate()
    mesh = SimpleNamespace(ulysses_size=1, ring_size=2, settings=settings)
    x = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="cuda_sdpa"):
        cross_attention(x, x, x, mesh=mesh)


# --- shards that differ between ranks (parallel/agree.py, docs/cross_attention.md "Shapes across ranks") ---


@dataclass(frozen=True)
class UnevenCase:
    """Per-rank token counts of the queries and keys (their sums are S_q and S_kv), the schedule, which ranks
    pass a key mask (padding at the end of row 0), and the Ulysses degree of the mesh."""

    q_split: tuple[int, ...]
    kv_split: tuple[int, ...]
    schedule: str = "auto"
    masked_ranks: tuple[int, ...] = ()
    u: int = 1


def run_uneven_cases(cases: list[UnevenCase]) -> list[dict]:
    """Each case on the pool's ranks: the agreed plan, the p2p bytes and the errors vs the dense fp64 reference."""
    world = torch.distributed.get_world_size()
    results, meshes = [], {}
    for i, case in enumerate(cases):
        mesh = meshes.setdefault(case.u, SeqParMesh.build(world, case.u))
        me = mesh.coords.sp_rank
        g = torch.Generator().manual_seed(100 + i)
        s_q, s_kv = sum(case.q_split), sum(case.kv_split)
        q = torch.randn(B, s_q, H, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, s_kv, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(B, s_q, H, D, generator=g, dtype=torch.float64)
        mask = torch.ones(B, s_kv, dtype=torch.bool)
        start = sum(case.kv_split[:me])
        for r in case.masked_ranks:  # the last key of rank r's shard, row 0, is padding
            end = sum(case.kv_split[: r + 1])
            if case.kv_split[r]:
                mask[0, end - 1] = False
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, _ = dense_attention_reference(*leaves, mask[:, None, :].expand(B, s_q, s_kv))
        ref.backward(dout)
        local = [
            t.split(split, 1)[me].clone().requires_grad_()
            for t, split in zip((q, k, v), (case.q_split, case.kv_split, case.kv_split))
        ]
        kv_mask = mask[:, start : start + case.kv_split[me]] if me in case.masked_ranks else None
        plan = cross_plan(*local, kv_mask, mesh, case.schedule)
        with mesh.comm_stats.measure() as fwd:
            out = cross_attention(*local, mesh=mesh, kv_mask=kv_mask, schedule=case.schedule)
        out.backward(dout.split(case.q_split, 1)[me])
        want = [ref, *(t.grad for t in leaves)]
        splits = (case.q_split, case.q_split, case.kv_split, case.kv_split)
        errors = {
            n: (a - b.split(split, 1)[me]).abs().max().item() if a.numel() else 0.0
            for n, a, b, split in zip(
                ("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)), want, splits
            )
        }
        results.append({"plan": plan, "errors": errors, "fwd": fwd.bytes("p2p"), "shape": tuple(out.shape)})
    return results


UNEVEN = [
    UnevenCase((2, 2), (5, 4), "rotate_kv"),  # the rotating K/V side uneven (was a gloo abort)
    UnevenCase((3, 1), (4, 4), "rotate_q"),  # the rotating query side uneven
    UnevenCase((1, 7), (7, 1)),  # alone, rank 0 would rotate q and rank 1 K/V: agreed, both rotate K/V
    UnevenCase((4, 4), (6, 0), "rotate_kv"),  # a rank without keys
    UnevenCase((4, 4), (3, 3), "rotate_q", masked_ranks=(0,)),  # a key mask on one rank only
    UnevenCase((3, 2), (2, 5), "rotate_kv", masked_ranks=(0, 1)),
    UnevenCase((3, 1), (5, 2), u=2),  # Ulysses: every shard padded before the all-to-all
]


def test_uneven_shards_are_padded_exactly_and_ranks_agree_on_the_schedule(dist_pool):
    per_case = zip(UNEVEN, zip(*dist_pool(2).run(run_uneven_cases, UNEVEN, timeout=120)))
    for case, (r0, r1) in per_case:
        assert r0["plan"] == r1["plan"], case  # one plan: padded sizes, mask and schedule
        plan = r0["plan"]
        assert (plan.q_tokens, plan.kv_tokens) == (max(case.q_split), max(case.kv_split))
        if case.u == 1:
            expected = case.schedule if case.schedule != "auto" else "rotate_kv"
            assert plan.schedule == expected, case
        for rank, res in enumerate((r0, r1)):
            assert_within(res["errors"], 1e-10, (case, rank))
            assert res["shape"] == (B, case.q_split[rank], H, D)
            if case.u == 1:  # the byte formula with the padded sizes (every rank sends the same)
                args = (plan.schedule, B, plan.q_tokens, plan.kv_tokens, H, 2, D, 8, 2, plan.kv_mask)
                assert res["fwd"] == cross_bytes(*args), (case, res)


def run_disagreeing_ranks(kind: str) -> tuple[str, str]:
    """Rank 1 differs from rank 0 in ``kind``; returns the error this rank raised (type name, message)."""
    mesh = SeqParMesh.build(2, 1)
    odd = mesh.coords.sp_rank == 1
    h_kv = 4 if odd and kind == "h_kv" else 2
    dtype = torch.float32 if odd and kind == "dtype" else torch.float64
    schedule = "rotate_q" if odd and kind == "schedule" else "rotate_kv"
    q = torch.randn(B, 3, H, D, dtype=dtype)
    k = v = torch.randn(B, 4 + mesh.coords.sp_rank, h_kv, D, dtype=dtype)
    try:
        cross_attention(q, k, v, mesh=mesh, schedule=schedule)
    except RankShapeError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        ("h_kv", r"rank 0: q \[2, 3, 4, 8\] float64, k \[2, 4, 2, 8\] .*rank 1: .*k \[2, 5, 4, 8\]"),
        ("dtype", r"rank 0: q \[2, 3, 4, 8\] float64.*rank 1: q \[2, 3, 4, 8\] float32"),
        ("schedule", r"schedule=rotate_kv; rank 1: .* schedule=rotate_q"),
    ],
    ids=["h_kv", "dtype", "schedule"],
)
def test_ranks_that_disagree_raise_by_name_on_every_rank(dist_pool, kind, names):
    """B, H, H_kv, D, dtype and schedule must agree: every rank raises RankShapeError (a SeqParConfigError)
    naming each rank's shapes and the fix, instead of aborting inside gloo."""
    for name, message in dist_pool(2).run(run_disagreeing_ranks, kind, timeout=60):
        assert name == "RankShapeError", message
        assert re.search(names, message), message
        assert "only the token counts n_q and n_kv may differ" in message
