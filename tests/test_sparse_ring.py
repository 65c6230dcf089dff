"""Sparse ring attention on gloo ranks vs the single-process dense reference under the same pattern.

Every rank estimates the vertical-slash pattern from the whole q, k on its own (no communication),
runs the dense-masked reference with it, then runs the distributed path - whose pattern is estimated
from the shards with collectives - and compares its shard of out, dq, dk, dv. A pattern that differed
would change the outputs, so the distributed estimation is checked too.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.comm.relayout import relayout
from ds_seqpar.layout import BlockLayout, ring_layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import estimate_pattern, sparse_attention_reference
from ds_seqpar.parallel import sparse_ring
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, build_schedule, ring_attention
from ds_seqpar.parallel.sparse_ring import budget_from_config, sparse_stats
from tests.helpers.cases import SparseCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
B, D = 1, 8


def _inputs(seq_len: int, h: int, h_kv: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, seq_len, heads, D, generator=g, dtype=torch.float64).to(dtype)
        for heads in (h, h_kv, h_kv, h)
    ]


def _reference(q, k, v, dout, pattern, window, docs):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = sparse_attention_reference(q64, k64, v64, pattern, spec=MaskSpec(window=window), doc_ids=docs)
    out.backward(dout.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _errors(layout, me, got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    return {
        name: (g.double() - layout.shard(r, me)).abs().max().item()
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)
    }


def run_ring_cases(cases: list[SparseCase]) -> list[dict]:
    """The ring engine with a sparse plan (pattern given), any layout, single or double ring."""
    results = []
    world = dist.get_world_size()
    for case in cases:
        mesh = mesh_for({"size": world, "ulysses_degree": 1, "ring": {"inner_size": case.inner}})
        layout = _random_blocks(world, case.seq_len, case.block) if case.layout == "blocks" else None
        layout = layout or ring_layout(case.layout, world, case.granularity)
        seq_len, dtype = case.seq_len, case.dtype
        q, k, v, dout = _inputs(seq_len, case.h, case.h_kv, dtype, case.seed)
        budget = case.budget()
        pos = torch.arange(seq_len)
        pattern = estimate_pattern(q, k, pos, pos, seq_len, budget)
        docs = case.doc_ids()
        ref = _reference(q, k, v, dout, pattern, case.window, docs)
        me = mesh.coords.ring_rank
        ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
        work = WorkCounter()
        plan = RingPlan(
            build_schedule(mesh, "p2p"),
            layout,
            MaskSpec(window=case.window),
            docs,
            work=work,
            sparse=pattern,
            sparse_kernel=case.kernel,
        )
        out, _ = ring_attention(ql, kl, vl, plan)
        out.backward(layout.shard(dout, me))
        results.append(
            {
                "errors": _errors(layout, me, [out, ql.grad, kl.grad, vl.grad], ref),
                "pairs": work.forward_pairs,
            }
        )
    return results


def _random_blocks(world: int, seq_len: int, block: int, seed: int = 0) -> BlockLayout:
    perm = torch.randperm(seq_len // block, generator=torch.Generator().manual_seed(seed))
    return BlockLayout(tuple(tuple(sorted(c.tolist())) for c in perm.chunk(world)), block)


def run_relayout_cases(cases: list[SparseCase]) -> list[float]:
    """stripe -> random BlockLayout -> back: values land where the destination layout says; grads too."""
    world, me = dist.get_world_size(), dist.get_rank()
    mesh = mesh_for({"size": world, "ulysses_degree": 1})
    errors = []
    for case in cases:
        seq_len, block = case.seq_len, case.block
        src, dst = ring_layout("stripe", world, block), _random_blocks(world, seq_len, block, case.seed)
        g = torch.Generator().manual_seed(case.seed)
        x, w = torch.randn(2, seq_len, 3, 4, generator=g), torch.randn(2, seq_len, 3, 4, generator=g)
        y = torch.randn(2, seq_len, 5, generator=g)
        xl, yl = src.shard(x, me).requires_grad_(), src.shard(y, me)
        moved_x, moved_y = relayout((xl, yl), src, dst, mesh.group("ring"), me, mesh.comm_stats)
        (moved_x * dst.shard(w, me)).sum().backward()
        (back,) = relayout((moved_x,), dst, src, mesh.group("ring"), me)
        errors.append(
            max(
                (moved_x - dst.shard(x, me)).abs().max().item(),
                (moved_y - dst.shard(y, me)).abs().max().item(),
                (back - xl).abs().max().item(),
                (xl.grad - src.shard(w, me)).abs().max().item(),
            )
        )
    return errors


def test_relayout_moves_rows_and_gradients(dist_pool):
    cases = [SparseCase(seq_len=64, block=4, seed=s) for s in range(3)] + [
        SparseCase(seq_len=48, block=2, seed=7)
    ]
    for per_rank in dist_pool(4).run(run_relayout_cases, cases):
        assert max(per_rank) == 0.0


def run_usp_cases(cases: list[SparseCase]) -> list[dict]:
    """``ds_seqpar.attention`` with ``attention: "sparse_ring"``: estimation, balancing, Ulysses, ring."""
    results = []
    world = dist.get_world_size()
    for case in cases:
        # force_blocks: accept any db-SP block move, so the relayout path runs even when gains are small
        force = case.force_blocks
        sparse_ring.BLOCK_BALANCE_MIN_GAIN = float("-inf") if force else 0.01
        sparse_ring.BLOCK_BALANCE_REWARD = 0.0 if force else 1.0
        mesh = mesh_for(case.section(world))
        cfg = mesh.settings
        layout = ds_seqpar.input_layout(mesh)
        seq_len, dtype = case.seq_len, case.dtype
        q, k, v, dout = _inputs(seq_len, case.h, case.h_kv, dtype, case.seed)
        pos = torch.arange(seq_len)
        pattern = estimate_pattern(q, k, pos, pos, seq_len, budget_from_config(cfg.sparse))
        docs = case.doc_ids()
        ref = _reference(q, k, v, dout, pattern, case.window, docs)
        me = mesh.coords.sp_rank
        ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
        out = ds_seqpar.attention(ql, kl, vl, mesh=mesh, window=case.window, doc_ids=docs, layer=3)
        out.backward(layout.shard(dout, me))
        stats = sparse_stats(mesh)[3]
        results.append(
            {
                "errors": _errors(layout, me, [out, ql.grad, kl.grad, vl.grad], ref),
                "rho_s": stats.rho_s,
                "density": stats.density,
                "head_order": stats.head_order,
                "blocks_moved": stats.blocks_moved,
            }
        )
    return results


def _check(cases: list[SparseCase], results: list[list[dict]]) -> None:
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            errors = per_rank[i]["errors"]
            assert_within(errors, TOL[case.dtype], f"{case} rank {rank}")


def _ring_cases(p: int) -> list[SparseCase]:
    base = SparseCase(seq_len=32 * p)
    docs = (0, 9, 16 * p + 3, 32 * p - 5)
    cases = [
        replace(base, layout=layout, granularity=8 if layout == "stripe" else 1, dtype=dtype, h_kv=h_kv)
        for layout, dtype, h_kv in itertools.product(("stripe", "zigzag", "contiguous"), TOL, (4, 2))
    ]
    cases += [
        replace(base, layout="stripe"),  # token stripes
        replace(base, granularity=8, h_kv=1, window=40),
        replace(base, layout="zigzag", cu_seqlens=docs),
        # the sync-free sparse kernels (ops/sparse/kernels.py); triton under its CPU interpreter
        replace(base, granularity=8, dtype=torch.float32, window=40, cu_seqlens=docs, kernel="triton"),
        replace(base, layout="zigzag", h_kv=1, cu_seqlens=docs, kernel="masked"),
    ]
    if p == 8:
        cases += [replace(base, granularity=8, dtype=dt, inner=4) for dt in TOL]
        cases.append(replace(base, layout="zigzag", inner=2))
    return [replace(case, seed=i) for i, case in enumerate(cases)]


@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # P = 8: slow suite
def test_sparse_ring_matches_reference(dist_pool, p):
    cases = _ring_cases(p)
    _check(cases, dist_pool(p).run(run_ring_cases, cases))


def _usp_cases(p: int) -> list[SparseCase]:
    base = SparseCase(seq_len=16 * p, block=4, h=8, h_kv=4)
    cases = [
        replace(base, u=u, balancing=balancing, dtype=dtype, h_kv=4 if u < 8 else 8)
        for u, balancing, dtype in itertools.product(
            [d for d in (1, 2, 4) if p % d == 0], ("stripe", "dbsp"), TOL
        )
    ]
    cases += [
        replace(base, u=2, layout="zigzag", h_kv=2),
        replace(base, layout="contiguous", dtype=torch.float32, h=4),
        replace(base, u=2, balancing="dbsp", h_kv=8, window=24, cu_seqlens=(0, 5, 8 * p + 1, 16 * p - 3)),
        replace(base, balancing="dbsp", force_blocks=True, h=4, h_kv=2),
        replace(base, u=2, balancing="dbsp", dtype=torch.float32, window=20, kernel="triton"),
        replace(base, balancing="stripe", h=4, h_kv=2, kernel="masked"),
        replace(base, u=2, balancing="dbsp", force_blocks=True, dtype=torch.float32, window=20),
    ]
    if p == 8:
        cases += [
            replace(base, u=2, inner=2, balancing="dbsp", force_blocks=True),
            replace(base, u=2, inner=2, balancing="stripe"),
            replace(base, inner=4, balancing="dbsp", dtype=torch.float32, h=4, h_kv=2),
        ]
    return [replace(case, seed=100 + i) for i, case in enumerate(cases)]


@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # P = 8: slow suite
def test_sparse_usp_matches_reference(dist_pool, p):
    cases = _usp_cases(p)
    results = dist_pool(p).run(run_usp_cases, cases)
    _check(cases, results)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert all(r["rho_s"] == per_rank[0]["rho_s"] and r["rho_s"] >= 1.0 - 1e-12 for r in per_rank), case
        assert 0.0 < per_rank[0]["density"] <= 1.0
        assert sorted(per_rank[0]["head_order"]) == list(range(case.h))
        if case.force_blocks and p > 2:
            assert per_rank[0]["blocks_moved"] > 0, case  # the BlockLayout + relayout path really ran
