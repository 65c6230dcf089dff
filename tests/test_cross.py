"""Cross-attention under SP (rotate-Q, LV-XAttn, and rotate-KV) on gloo ranks vs the dense fp64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_seqpar import SeqParMesh
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.parallel.cross import choose_cross_schedule, cross_attention, cross_bytes, cross_ulysses_bytes
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
