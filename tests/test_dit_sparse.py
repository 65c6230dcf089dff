"""Block-sparse DiT attention (``ds_seqpar.block_sparse_attention``) on gloo ranks vs the single-process fp64
dense softmax under the same block pattern (docs/dit_sparse.md).

Every rank builds the whole q, k, v, dout from one seed, the pattern (given, or estimated single-process
from the whole q, k: the distributed estimation from the shards must give the same one, else the outputs
differ), the reference and its gradients, then runs the distributed path on its shard and compares out,
dq, dk, dv.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import DitSparseSettings, block_sparse_attention, dit_sparse_stats
from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout.ring import StripeLayout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse.block_kernel import block_sparse_backward, block_sparse_forward
from ds_seqpar.ops.sparse.block_pattern import (
    BlockBudget,
    BlockPattern,
    block_sparse_reference,
    estimate_block_pattern,
)
from ds_seqpar.ops.sparse.dit_patterns import SHIPPED, DitPatternSpec, dit_pattern, load_shipped
from ds_seqpar.parallel.dit_balance import dit_balance_rho, plan_dit_balance
from ds_seqpar.parallel.dit_degrees import allowed_degrees, choose_degrees
from tests.helpers.meshes import mesh_for

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
B, D = 2, 8


@dataclass(frozen=True)
class DitCase:
    """One distributed call: mesh (U, ring layout), pattern source, settings, inputs."""

    u: int = 1
    layout: str = "zigzag"
    seq_len: int = 128
    block: int = 8
    h: int = 4
    h_kv: int = 4
    dtype: torch.dtype = torch.float64
    balancing: str = "dbsp"
    given: bool = True  # a generated pattern, else estimated from q, k
    docs: bool = False
    degrees: object = "mesh"
    min_gain: float = 0.01
    keep: float | None = 0.3
    threshold: float | None = 0.9
    calls: int = 1  # several calls, each with new inputs (and so a new estimated pattern)
    seed: int = 0


def _inputs(case: DitCase, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = (case.h, case.h_kv, case.h_kv, case.h)
    return [
        torch.randn(B, case.seq_len, n, D, generator=g, dtype=torch.float64).to(case.dtype) for n in shapes
    ]


def _docs(case: DitCase) -> torch.Tensor | None:
    if not case.docs:
        return None
    s = case.seq_len
    ids = torch.zeros(B, s, dtype=torch.long)
    ids[0, s // 3 :] = 1
    ids[0, s - 11 :] = -1  # padding at the end of row 0
    ids[1, : s // 2 + 5] = 3
    ids[1, s // 2 + 5 :] = 4
    ids[1, 7:12] = -1  # padding inside row 1
    return ids


def _pattern(case: DitCase, q, k, seed: int) -> BlockPattern:
    nb = case.seq_len // case.block
    if case.given:
        spec = DitPatternSpec(
            (2, 2, nb // 4), case.h, case.block, seed=seed, min_density=0.1, max_density=0.6
        )
        return dit_pattern(spec)
    pos = torch.arange(case.seq_len)
    return estimate_block_pattern(
        q, k, pos, case.seq_len, BlockBudget(case.block, case.keep, case.threshold), doc=_docs(case)
    )


def run_cases(cases: list[DitCase]) -> list[dict]:
    world, out = dist.get_world_size(), []
    for case in cases:
        mesh = mesh_for({"size": world, "ulysses_degree": case.u, "ring": {"layout": case.layout}})
        layout, me = ds_seqpar.input_layout(mesh), mesh.coords.sp_rank
        settings = DitSparseSettings(
            case.block, case.keep, case.threshold, case.balancing, case.degrees, case.min_gain
        )
        errors = {}
        for call in range(case.calls):
            q, k, v, dout = _inputs(case, case.seed * 10 + call)
            pattern, docs = _pattern(case, q, k, case.seed * 10 + call), _docs(case)
            q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
            ref, _ = block_sparse_reference(q64, k64, v64, pattern, None, docs)
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
            ql, kl, vl = (layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v))
            got = block_sparse_attention(ql, kl, vl, mesh=mesh, pattern=pattern if case.given else None,
                                         budget=settings, doc_ids=docs, layer=7)  # fmt: skip
            got.backward(layout.shard(dout, me))
            for name, g, r in zip(("out", "dq", "dk", "dv"), (got, ql.grad, kl.grad, vl.grad),
                                  (ref, *ref_grads), strict=True):  # fmt: skip
                err = (g.double() - layout.shard(r.detach(), me)).abs().max().item()
                errors[name] = max(errors.get(name, 0.0), err)
        stats = dit_sparse_stats(mesh)[7]
        out.append(
            {"errors": errors, "rho_s": stats.rho_s, "degrees": stats.degrees, "moved": stats.blocks_moved}
        )
    return out


def _check(cases, results) -> None:
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            errs = per_rank[i]["errors"]
            assert max(errs.values()) <= TOL[case.dtype], f"{case} rank {rank}: {errs}"


FAST_4 = [
    DitCase(u=2, balancing="dbsp"),
    DitCase(u=2, balancing="stripe", dtype=torch.float32, h_kv=2),
    DitCase(u=1, balancing="none", layout="contiguous", docs=True),
    DitCase(u=4, balancing="dbsp", h=8, h_kv=4, given=False, calls=2),
    DitCase(
        u=2,
        balancing="dbsp",
        docs=True,
        given=False,
        keep=None,
        threshold=0.5,
        min_gain=float("-inf"),
        dtype=torch.float32,
    ),  # forced block moves
    DitCase(u=2, balancing="none", degrees=(1, 4), h_kv=2),  # another factorisation than the mesh's
    DitCase(u=1, balancing="dbsp", degrees="auto", given=False, docs=True),
    DitCase(u=1, balancing="dbsp", degrees=(2, 2), h_kv=2, docs=True),  # stripes on another factorisation
]


def test_dit_sparse_p4(dist_pool):
    cases = [replace(c, seed=i) for i, c in enumerate(FAST_4)]
    results = dist_pool(4).run(run_cases, cases)
    _check(cases, results)
    assert results[0][4]["moved"] > 0  # the forced block placement ran
    assert results[0][5]["degrees"] == (1, 4) and results[0][7]["degrees"] == (2, 2)


def test_dit_sparse_p2(dist_pool):
    cases = [
        DitCase(u=2, h_kv=1, balancing="dbsp", seed=1),  # GQA with K/V replication (U > H_kv)
        DitCase(u=1, balancing="stripe", given=False, docs=True, dtype=torch.float32, seed=2),
        DitCase(
            u=1, layout="stripe", balancing="none", seq_len=100, block=8, given=False, seed=3
        ),  # S % G != 0
    ]
    _check(cases, dist_pool(2).run(run_cases, cases))


def run_refusals(_: object) -> list[str]:
    """Calls refused before any collective: each rank raises on its own."""
    mesh = mesh_for({"size": dist.get_world_size(), "ulysses_degree": 2, "ring": {"layout": "zigzag"}})
    case = DitCase(u=2)
    q, k, v, _ = _inputs(case, 0)
    layout, me = ds_seqpar.input_layout(mesh), mesh.coords.sp_rank
    ql, kl, vl = (layout.shard(t, me) for t in (q, k, v))
    small = dit_pattern(DitPatternSpec((1, 2, 4), 4, 8))
    bad = [
        dict(pattern=small, budget=DitSparseSettings(8)),
        dict(budget=DitSparseSettings(8, degrees=(3, 1))),
        dict(budget=DitSparseSettings(8), doc_ids=torch.zeros(3, case.seq_len, dtype=torch.long)),
        dict(budget=DitSparseSettings(48)),  # S = 128 is not a multiple of R x G = 96
    ]
    messages = []
    for kw in bad:
        with pytest.raises(ValueError) as err:
            block_sparse_attention(ql, kl, vl, mesh=mesh, **kw)
        messages.append(str(err.value))
    return messages


def test_dit_sparse_refuses_by_name(dist_pool):
    messages = dist_pool(2).run(run_refusals, None)[0]
    for message, word in zip(
        messages, ("does not fit", "degrees=(3, 1)", "doc_ids", "block_size 48"), strict=True
    ):
        assert word in message, message


@pytest.mark.slow
def test_dit_sparse_p4_sweep(dist_pool):
    cases = [
        DitCase(u=u, balancing=bal, dtype=dt, h_kv=hkv, docs=docs, given=given, seed=i)
        for i, (u, bal, dt, hkv, docs, given) in enumerate(
            (u, bal, dt, hkv, docs, given)
            for u in (1, 2, 4)
            for bal in ("none", "stripe", "dbsp")
            for dt in TOL
            for hkv, docs, given in ((4, False, True), (2, True, False))
        )
    ]
    _check(cases, dist_pool(4).run(run_cases, cases))


# --------------------------------------------------------------------------- single process


def test_kernel_pairs_and_token_fallback():
    """The pair kernel on shuffled / partial shards equals the reference rows (fp64), fwd and bwd."""
    g = torch.Generator().manual_seed(3)
    s, h, hkv, blk = 64, 4, 2, 8
    q, k, v, do = (torch.randn(B, s, n, D, generator=g, dtype=torch.float64) for n in (h, hkv, hkv, h))
    pattern = dit_pattern(DitPatternSpec((1, 2, 4), h, blk, seed=5, max_density=0.7))
    docs = _docs(DitCase(seq_len=s, docs=True))
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref, lse = block_sparse_reference(q64, k64, v64, pattern, 0.3, docs)
    dq_r, dk_r, dv_r = torch.autograd.grad(ref, (q64, k64, v64), do)
    pos = torch.arange(s)
    for qp in (pos, torch.cat([pos[24:40], pos[:8]]), pos[torch.randperm(s, generator=g)]):
        kw = dict(scale=0.3, spec=MaskSpec(causal=False), q_doc=docs[:, qp], k_doc=docs)
        out, _, _ = block_sparse_forward(q[:, qp], k, v, qp, pos, pattern, **kw)
        assert (out - ref[:, qp]).abs().max() < 1e-12
        dq, dk, dv = block_sparse_backward(do[:, qp], q[:, qp], k, v, ref[:, qp].detach(), lse[:, :, qp], qp, pos,
                                           pattern, **kw)  # fmt: skip
        assert (dq - dq_r[:, qp]).abs().max() < 1e-12
        if qp is pos:
            assert max((dk - dk_r).abs().max(), (dv - dv_r).abs().max()) < 1e-12


def test_settings_refuse_by_name():
    for bad, word in (
        (dict(block_size=0), "block_size=0"),
        (dict(keep=None, threshold=None), "keep and / or threshold"),
        (dict(keep=1.5), "keep=1.5"),
        (dict(balancing="lpt"), "balancing='lpt'"),
        (dict(degrees=(2,)), "degrees=(2,)"),
    ):
        with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
            DitSparseSettings(**bad)
    with pytest.raises(ValueError, match="diagonal block"):
        BlockPattern(torch.zeros(1, 1, 2, 2, dtype=torch.bool), 4, 8)


def test_budget_keeps_diagonal_and_counts():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 64, 2, D, generator=g), torch.randn(1, 64, 2, D, generator=g)
    pos = torch.arange(64)
    p = estimate_block_pattern(q, k, pos, 64, BlockBudget(8, keep=0.25))
    assert p.mask.sum(-1).eq(2).all() and p.mask.diagonal(dim1=-2, dim2=-1).all()
    loose = estimate_block_pattern(q, k, pos, 64, BlockBudget(8, threshold=0.999))
    tight = estimate_block_pattern(q, k, pos, 64, BlockBudget(8, threshold=0.01))
    assert tight.mask.sum(-1).eq(1).all() and loose.mask.sum() > tight.mask.sum()


def test_generator_is_deterministic_and_densities_differ():
    spec = DitPatternSpec((2, 4, 4), 8, 16, seed=3)
    a, b = dit_pattern(spec), dit_pattern(spec)
    assert torch.equal(a.mask, b.mask)
    per_head = a.mask.float().mean((0, 2, 3))
    assert per_head.max() > 4 * per_head.min()


def test_dbsp_balances_heads_and_choice_is_pure():
    pattern = dit_pattern(DitPatternSpec((1, 8, 8), 8, 16, seed=1))
    s = pattern.seq_len
    rhos = {}
    for bal in ("stripe", "dbsp"):
        plan = plan_dit_balance(pattern, StripeLayout(2, 16), 8, HeadPlan.build(8, 8, 2), bal)
        rhos[bal] = dit_balance_rho(pattern, plan, 2)
    assert rhos["dbsp"] <= 1.05 < rhos["stripe"]
    assert allowed_degrees(4, 8, s, 16, "dbsp") == [(1, 4), (2, 2), (4, 1)]
    first = choose_degrees(pattern, 8, 4, 64)
    assert first == choose_degrees(pattern, 8, 4, 64) and first.degrees in [(1, 4), (2, 2), (4, 1)]


def test_shipped_patterns_are_the_generator_s_and_dbsp_balances_them():
    for name, spec in SHIPPED.items():
        pattern = load_shipped(name)
        assert torch.equal(pattern.mask, dit_pattern(spec).mask), name
        for u, r in ((2, 2), (1, 4)):
            heads = HeadPlan.build(8, 8, u)
            plan = plan_dit_balance(pattern, StripeLayout(r, spec.block_size), 8, heads, "dbsp")
            assert dit_balance_rho(pattern, plan, r) <= 1.05, (name, u, r)
