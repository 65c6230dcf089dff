"""USP (Ulysses x Ring) through ``ds_seqpar.attention`` on gloo ranks vs the dense reference."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParMesh, parse_section
from ds_seqpar.comm.all_to_all import HeadPlan, split_heads
from ds_seqpar.parallel.comm_volume import attention_layer_bytes, ulysses_bytes
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups
from tests.helpers.cases import AttentionCase
from tests.helpers.usp_cases import B, D, check_usp_cases, run_usp_cases, usp_mesh


def _factorisations(p: int) -> list[int]:
    return [u for u in range(1, p + 1) if p % u == 0]


def _sweep(p: int) -> list[AttentionCase]:
    cases = []
    for u, layout, causal, dtype in itertools.product(
        _factorisations(p), ("contiguous", "zigzag", "stripe"), (True, False), (torch.float64, torch.float32)
    ):
        cases.append(
            AttentionCase(
                u=u, layout=layout, causal=causal, dtype=dtype, seq_len=8 * p, h=8, h_kv=8, seed=len(cases)
            )
        )
    return cases


@pytest.mark.parametrize("p", [2, 4, 8])
def test_every_factorisation_and_layout_matches_reference(dist_pool, p):
    cases = _sweep(p)
    check_usp_cases(cases, dist_pool(p).run(run_usp_cases, cases))


SPECIAL = [
    # double ring under Ulysses: P=8 = U 2 x (R_out 2 x R_in 2)
    AttentionCase(u=2, inner=2, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=8, h_kv=8),
    AttentionCase(u=2, inner=2, layout="stripe", causal=False, dtype=torch.float32, seq_len=64, h=8, h_kv=4),
    # GQA H=8 / H_kv=2 with U=4: K/V heads replicated to two ranks each
    AttentionCase(u=4, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=8, h_kv=2),
    AttentionCase(u=8, layout="zigzag", causal=True, dtype=torch.float32, seq_len=64, h=8, h_kv=2),
    # uneven heads: H=6 with U=4 (split 2,2,1,1), MHA and GQA
    AttentionCase(u=4, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=6, h_kv=6),
    AttentionCase(u=4, layout="contiguous", causal=False, dtype=torch.float64, seq_len=64, h=6, h_kv=2),
    AttentionCase(u=8, layout="contiguous", causal=True, dtype=torch.float64, seq_len=64, h=12, h_kv=4),
    # batch 1: q, k, v are views of the all-to-all's receive buffer (no copy); also uneven and replicated
    AttentionCase(u=8, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=8, h_kv=8, batch=1),
    AttentionCase(u=4, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=6, h_kv=2, batch=1),
    AttentionCase(
        u=4, inner=2, layout="zigzag", causal=True, dtype=torch.float32, seq_len=64, h=8, h_kv=2, batch=1
    ),
    # packed documents with odd lengths, plus a sliding window
    AttentionCase(
        u=2,
        layout="zigzag",
        causal=True,
        dtype=torch.float64,
        seq_len=64,
        h=4,
        h_kv=2,
        cu_seqlens=(0, 7, 30, 59),
    ),
    AttentionCase(
        u=4,
        layout="stripe",
        causal=True,
        dtype=torch.float64,
        seq_len=64,
        h=4,
        h_kv=4,
        cu_seqlens=(0, 13, 64),
    ),
    AttentionCase(u=2, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=4, h_kv=2, window=9),
    AttentionCase(
        u=2,
        layout="contiguous",
        causal=True,
        dtype=torch.float64,
        seq_len=64,
        h=4,
        h_kv=2,
        schedule="all_gather",
    ),
]


def test_double_ring_gqa_replication_uneven_heads_and_documents(dist_pool):
    check_usp_cases(SPECIAL, dist_pool(8).run(run_usp_cases, SPECIAL))


# Pipelined Ulysses (R = 1): head groups with their own K/V, K/V shared by several groups (sent with
# group 0, gradients summed and sent back with the last), replication, masks, batch 1 and 2.
PIPELINED = [
    AttentionCase(u=8, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=16, h_kv=16),
    AttentionCase(
        u=8, layout="contiguous", causal=False, dtype=torch.float64, seq_len=64, h=32, h_kv=8, batch=1
    ),
    AttentionCase(u=8, layout="stripe", causal=True, dtype=torch.float64, seq_len=64, h=24, h_kv=8),
    AttentionCase(u=8, layout="zigzag", causal=True, dtype=torch.float32, seq_len=64, h=16, h_kv=2, batch=1),
    AttentionCase(
        u=8, layout="zigzag", causal=True, dtype=torch.float64, seq_len=64, h=32, h_kv=16, chunks=2
    ),
    AttentionCase(
        u=8,
        layout="zigzag",
        causal=True,
        dtype=torch.float64,
        seq_len=64,
        h=16,
        h_kv=4,
        window=11,
        cu_seqlens=(0, 9, 40, 61),
    ),
]


def run_without_grad(case: AttentionCase) -> float:
    """Max |out(no_grad) - out(grad)| of one case: inference builds no graph and gets the same output."""
    mesh = usp_mesh(case, dist.get_world_size())
    layout = ds_seqpar.input_layout(mesh)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        layout.shard(
            torch.randn(1, case.seq_len, heads, D, generator=g, dtype=torch.float64), mesh.coords.sp_rank
        )
        for heads in (case.h, case.h_kv, case.h_kv)
    )
    with torch.no_grad():
        plain = ds_seqpar.attention(q, k, v, mesh=mesh, causal=True)
    assert plain.grad_fn is None
    tracked = ds_seqpar.attention(q.requires_grad_(), k, v, mesh=mesh, causal=True)
    return (plain - tracked.detach()).abs().max().item()


def test_pipelined_ulysses_without_grad_gives_the_same_output(dist_pool):
    case = AttentionCase(u=8, layout="zigzag", seq_len=64, h=16, h_kv=2)
    assert max(dist_pool(8).run(run_without_grad, case)) == 0.0


def test_pipelined_ulysses_matches_reference_and_moves_the_same_bytes(dist_pool):
    results = dist_pool(8).run(run_usp_cases, PIPELINED)
    check_usp_cases(PIPELINED, results)
    for i, case in enumerate(PIPELINED):
        chunks = parse_section(case.section(8)).validate(None, 8).ulysses_chunks  # "auto" resolved
        groups = HeadGroups.build(HeadPlan.build(case.h, case.h_kv, 8), chunks)
        for per_rank in results:
            fwd = per_rank[i]["fwd"]["all_to_all"]
            n, b = case.seq_len // 8, case.dtype.itemsize
            expected = ulysses_bytes(case.batch, n, case.h, case.h_kv, D, 8, b)
            assert fwd["bytes"] == expected, (case, fwd)
            assert fwd["messages"] == 2 * groups.groups, (case, fwd)  # in and out, per group


def test_head_groups():
    own = HeadGroups.build(HeadPlan.build(16, 8, 2), 4)  # 8 q and 4 K/V heads per rank: 2 + 1 per group
    assert own.groups == 4 and own.q_counts[1] == (2, 2) and own.q_starts[1] == (2, 10)
    assert own.kv_counts[3] == (1, 1) and own.kv_starts[3] == (3, 7) and own.kv_carrier == (0, 1, 2, 3)
    shared = HeadGroups.build(HeadPlan.build(8, 2, 2), 4)  # 4 q heads, 1 K/V head per rank
    assert shared.kv_counts == ((1, 1), (0, 0), (0, 0), (0, 0)) and shared.kv_source == (0, 0, 0, 0)
    assert shared.kv_rows[2] == ((0, 1), (0, 1)) and shared.kv_carrier == (None, None, None, 0)
    # 6 q and 2 K/V heads per rank: 4 groups do not divide 6, 3 groups would cut a GQA group of 3
    assert HeadGroups.build(HeadPlan.build(12, 4, 2), 4).groups == 2
    assert HeadGroups.build(HeadPlan.build(12, 2, 2), 4).groups == 3  # one K/V head per rank: 3 x 2 q heads
    assert HeadGroups.build(HeadPlan.build(6, 6, 4), 4) is None  # uneven split 2, 2, 1, 1
    assert HeadGroups.build(HeadPlan.build(8, 8, 2), 1) is None  # ulysses_chunks = 1


def test_bytes_per_rank_equal_usp_formula(dist_pool):
    """docs/attention.md "Bytes per rank and layer" (``parallel/comm_volume.py``): Ulysses
    (U-1)/U·B·n·D·(2H+2H_kv)·b + ring 2(R-1)·B·(S/R)·(H_kv/U)·D·b forward; backward the same plus Δ
    and the ring's dK/dV accumulators. Every rank, including uneven head splits (H=6 over U=4)."""
    p, s, b = 8, 64, 8
    cases = [
        AttentionCase(u=u, layout="zigzag", causal=True, dtype=torch.float64, seq_len=s, h=8, h_kv=4)
        for u in (1, 2, 4, 8)  # U=8 > H_kv=4 replicates each K/V head to 2 ranks
    ]
    cases.append(replace(cases[0], u=4, h=6, h_kv=2))  # heads 2, 2, 1, 1 per Ulysses rank
    results = dist_pool(p).run(run_usp_cases, cases)
    for i, case in enumerate(cases):
        settings = parse_section(case.section(p)).validate(None, p)
        for rank, per_rank in enumerate(results):
            expected = attention_layer_bytes(
                settings,
                s,
                case.h,
                case.h_kv,
                D,
                batch=B,
                element_bytes=b,
                ulysses_rank=rank % case.u,
            )
            for direction, want in (("fwd", expected.forward), ("bwd", expected.backward)):
                got = {kind: stat["bytes"] for kind, stat in per_rank[i][direction].items()}
                assert got == want, (case, rank, direction, got, want)


def test_head_plans():
    assert split_heads(6, 4) == [2, 2, 1, 1]
    even = HeadPlan.build(8, 4, 2)
    assert (even.q_counts, even.kv_index, even.kv_counts) == ((4, 4), None, (2, 2))
    replicated = HeadPlan.build(8, 2, 4)  # each K/V head goes to two ranks
    assert (replicated.kv_index, replicated.kv_counts) == ((0, 0, 1, 1), (1, 1, 1, 1))
    uneven = HeadPlan.build(6, 2, 4)  # q heads 0-1 | 2-3 | 4 | 5 ; groups of 3
    assert uneven.q_counts == (2, 2, 1, 1)
    assert (uneven.kv_index, uneven.kv_counts) == ((0, 0, 1, 1, 1), (1, 2, 1, 1))
    with pytest.raises(
        ValueError, match=r"ulysses degree U=8 exceeds the number of heads H=4; valid: U <= 4"
    ):
        HeadPlan.build(4, 4, 8)


def attention_error(ulysses: int, heads: int, positions: list[int] | None) -> str:
    """The message ds_seqpar.attention raises on this rank (nothing may have been communicated)."""
    mesh = SeqParMesh.build(2, ulysses)
    x = torch.zeros(1, 4, heads, 8)
    pos = None if positions is None else torch.tensor(positions)
    try:
        ds_seqpar.attention(x, x, x, mesh=mesh, positions=pos)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_errors_raise_on_every_rank_before_any_collective(dist_pool):
    pool = dist_pool(2)
    for message in pool.run(attention_error, 2, 1, None):
        assert "sequence_parallel.ulysses_degree=2 exceeds the 1 query heads" in message
    for message in pool.run(attention_error, 1, 2, [0, 1, 2, 3]):  # per-rank positions on both ranks
        assert "do not match the 'zigzag' layout over 2 SP ranks" in message
