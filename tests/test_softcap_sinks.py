"""Attention logit soft-capping (Gemma 2), attention sinks (gpt-oss) and ALiBi (BLOOM, MPT) on every
attention path.

Each case shards random q, k, v over P gloo ranks, runs ``ds_seqpar.attention`` with ``softcap``, ``sinks``
and / or ``alibi_slopes`` under one algorithm (USP, Ulysses pipelined and not, ring p2p / all-gather / double ring,
sparse ring), and compares this rank's out, dq, dk, dv and the SP group's summed sink gradient with
the single-process reference (``dense_attention_reference`` / ``sparse_attention_reference``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.ops.attention import Alibi, block_attn_backward, block_attn_forward
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.merge import apply_sink, sink_grad
from ds_seqpar.ops.sparse import estimate_pattern, sparse_attention_reference
from ds_seqpar.parallel.sparse_ring import budget_from_config
from tests.helpers.cases import AttentionCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import assert_within

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
D = 8


def _reference(case: AttentionCase, q, k, v, dout, sinks, mesh, slopes=None):
    seq_len, window, docs = q.shape[1], case.window, case.doc_ids()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    softcap = case.softcap
    if case.sparse:
        pos = torch.arange(seq_len)
        pattern = estimate_pattern(q, k, pos, pos, seq_len, budget_from_config(mesh.settings.sparse))
        out, _ = sparse_attention_reference(
            *leaves, pattern, spec=MaskSpec(window=window), doc_ids=docs, softcap=softcap, sinks=sinks64
        )
    else:
        pos = torch.arange(seq_len)
        mask = (
            token_mask(pos, pos, case.spec) if docs is None else token_mask(pos, pos, case.spec, docs, docs)
        )
        if case.chunk is not None:  # chunks counted from the first real token (HF's chunked mask)
            chunk_of = (pos - case.left_pad).div(case.chunk, rounding_mode="floor")
            mask = mask & (chunk_of[:, None] == chunk_of[None, :])
        alibi = None if slopes is None else Alibi(slopes.double(), pos, pos)
        out, _ = dense_attention_reference(*leaves, mask, softcap=softcap, sinks=sinks64, alibi=alibi)
    out.backward(dout.double())
    grads = [t.grad for t in leaves] + ([] if sinks64 is None else [sinks64.grad])
    return out.detach(), grads, docs


def run_cases(cases: list[AttentionCase]) -> list[dict[str, float]]:
    """Per case, the max abs error of out, dq, dk, dv (this rank's shard) and dsinks (summed over SP)."""
    world = dist.get_world_size()
    results = []
    for i, case in enumerate(cases):
        mesh = mesh_for(case.section(world))
        layout = ds_seqpar.input_layout(mesh, case.doc_ids())
        dtype, seq_len, h, h_kv = case.dtype, case.seq_len, case.h, case.h_kv
        g = torch.Generator().manual_seed(i)
        q, k, v, dout = (
            torch.randn(case.batch, seq_len, n, D, generator=g, dtype=torch.float64).to(dtype)
            for n in (h, h_kv, h_kv, h)
        )
        q = q * 3.0  # large scores, so a softcap of ~1 binds
        sinks = torch.randn(h, generator=g, dtype=torch.float64).to(dtype) if case.sinks else None
        slopes = (
            2.0 ** -torch.arange(1.0, h + 1, dtype=torch.float64) if case.alibi else None
        )  # BLOOM's, 8 / H = 1
        ref_out, ref_grads, docs = _reference(case, q, k, v, dout, sinks, mesh, slopes)
        me = mesh.coords.sp_rank
        local = [layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v)]
        sinks_local = None if sinks is None else sinks.clone().requires_grad_()
        out = ds_seqpar.attention(
            *local,
            mesh=mesh,
            causal=case.causal,
            window=case.window,
            doc_ids=docs,
            softcap=case.softcap,
            sinks=sinks_local,
            layer=0,
            chunk=case.chunk,
            alibi_slopes=slopes,
        )
        out.backward(layout.shard(dout, me))
        got = [out, *(t.grad for t in local)]
        want = [ref_out, *ref_grads[:3]]
        errors = {
            name: (a.double() - layout.shard(b, me)).abs().max().item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        }
        if sinks is not None:
            dsinks = sinks_local.grad.double().clone()
            dist.all_reduce(dsinks, group=mesh.group("sp"))  # each rank holds its rows' share
            errors["dsinks"] = (dsinks - ref_grads[3]).abs().max().item()
        results.append(errors)
    return results


def _cases(p: int) -> list[AttentionCase]:
    s = 16 * p
    both = AttentionCase(softcap=1.5, sinks=True, seq_len=s)
    ring = replace(both, u=1, h=4, attention="ring")
    cases = [
        replace(both, u=p, h=8, h_kv=2),  # Ulysses, pipelined head groups
        replace(both, u=p, h=8, h_kv=8, chunks=1, sinks=False, softcap=0.8),  # Ulysses, one exchange
        replace(both, u=p, h=8, h_kv=4, chunks=1, softcap=None, cu_seqlens=(0, 5, s // 2 + 3, s - 2)),
        replace(ring, h_kv=2),  # ring p2p, zigzag
        replace(ring, h_kv=4, layout="stripe", causal=False),
        replace(ring, h_kv=2, schedule="all_gather", layout="contiguous"),
        replace(ring, h_kv=2, window=7),
        replace(ring, h_kv=2, layout="documents", cu_seqlens=(0, 3, s // 2 + 1, s - 5)),  # a placement
        replace(
            both,
            u=p // 2 or 1,
            h=8,
            h_kv=2,
            layout="documents",
            dynamic=True,
            cu_seqlens=tuple(range(0, s + 1, 4)),
        ),  # dynamic_degree: p = 1, every rank alone
        replace(both, u=p // 2, h=6, h_kv=2),  # USP with uneven heads at P=4 (U=2: 3 + 3)
        replace(both, u=p // 2, h=8, h_kv=2, dtype=torch.float32),
        replace(ring, h_kv=2, attention="sparse_ring", sparse="stripe"),
        replace(both, u=2, h=8, h_kv=4, attention="sparse_ring", sparse="dbsp", window=24),
    ]
    if p == 4:  # the double ring 2 x 2 and the topology-aware schedules (docs/schedules.md)
        cases += [
            replace(ring, h_kv=2, inner=2),
            replace(ring, h_kv=4, schedule="startrail", team_size=2, startrail_backward="query"),
            replace(ring, h_kv=2, schedule="startrail", team_size=2, window=7),
            replace(ring, h_kv=2, schedule="attention2d", grid=(2, 2), causal=False),
            replace(ring, h_kv=1, inner=2, schedule="tasp"),
        ]
    return cases


def _alibi_cases(p: int) -> list[AttentionCase]:
    """ALiBi (slopes 2^-h, no softcap) on every dense path: U x R, pure Ulysses, pure ring, documents."""
    s = 16 * p
    ring = AttentionCase(alibi=True, seq_len=s, u=1, h=4, h_kv=2, attention="ring")
    cases = [
        replace(ring, attention="usp", u=p, h=2 * p, chunks=2),  # Ulysses (not pipelined with ALiBi), GQA
        replace(ring, attention="usp", u=p, h=p, h_kv=p, sinks=True),  # with sinks
        ring,  # ring p2p, zigzag
        replace(ring, layout="contiguous", causal=False, window=9),
        replace(ring, cu_seqlens=(0, 5, s // 2 + 3, s - 2)),  # packed documents, padding
        replace(ring, layout="documents", cu_seqlens=(0, 3, s // 2 + 1, s - 5)),
        replace(
            ring, attention="usp", layout="documents", dynamic=True, cu_seqlens=tuple(range(0, s + 1, 8))
        ),
        replace(ring, schedule="all_gather", layout="stripe", dtype=torch.float32, seq_len=min(s, 64)),
    ]
    if p % 2 == 0:  # U x R
        cases += [replace(ring, attention="usp", u=2, h=6, h_kv=2), replace(ring, attention="usp", u=2, h=4)]
    if p == 4:
        cases += [
            replace(ring, inner=2),
            replace(ring, h_kv=4, schedule="startrail", team_size=2, startrail_backward="query"),
            replace(ring, schedule="attention2d", grid=(2, 2), causal=False),
        ]
    return cases


@pytest.mark.parametrize("p", [2, 4])
def test_softcap_and_sinks_match_reference_on_every_path(dist_pool, p):
    cases = _cases(p) + _alibi_cases(p)
    results = dist_pool(p).run(run_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            errors = per_rank[i]
            assert_within(errors, TOL[case.dtype], f"{case} rank {rank}")


@pytest.mark.slow  # P = 2 and 4 run in the default suite (test above); a pool of 3 and of 8 costs ~10 s / ~30 s
@pytest.mark.parametrize("p", [3, 8])
def test_alibi_matches_reference_at_odd_and_large_degrees(dist_pool, p):
    cases = _alibi_cases(p)
    results = dist_pool(p).run(run_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            assert_within(per_rank[i], TOL[case.dtype], f"{case} rank {rank}")


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_block_kernel_softcap_fp64(kernel):
    """One block: forward, lse and every gradient against autograd through the capped reference."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, n, D, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    q = q * 4.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(37, 37, dtype=torch.bool).tril()
    ref, ref_lse = dense_attention_reference(*leaves, mask, softcap=0.7)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)
    out, lse = block_attn_forward(q, k, v, causal=True, softcap=0.7, kernel=kernel)
    grads = block_attn_backward(dout, q, k, v, out, lse, causal=True, softcap=0.7, kernel=kernel)
    assert (out - ref).abs().max() <= 1e-12 and (lse - ref_lse).abs().max() <= 1e-12
    for got, want in zip(grads, leaves, strict=True):
        assert (got - want.grad).abs().max() <= 1e-12


def test_sink_fold_matches_reference():
    """apply_sink / sink_grad on one block equal autograd through the reference with sinks."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 4, D, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[0] = False  # a row that sees no key: out 0, lse = the sink
    ref, ref_lse = dense_attention_reference(*leaves[:3], mask, sinks=leaves[3])
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)
    out, lse = block_attn_forward(q, k, v, mask=mask)
    out_f, lse_f = apply_sink(out, lse, sinks)
    assert (out_f - ref).abs().max() <= 1e-12 and (lse_f - ref_lse).abs().max() <= 1e-12
    assert (sink_grad(dout, out_f, lse_f, sinks) - leaves[3].grad).abs().max() <= 1e-12
    grads = block_attn_backward(dout, q, k, v, out_f, lse_f, mask=mask)
    for got, want in zip(grads, leaves[:3], strict=True):
        assert (got - want.grad).abs().max() <= 1e-12


def test_named_kernel_without_softcap_is_refused():
    q = torch.zeros(1, 4, 2, D)
    with pytest.raises(
        ValueError, match=r"kernel='sdpa' cannot apply softcap=2.0 .*valid here .*: auto, torch"
    ):
        block_attn_forward(q, q, q, softcap=2.0, kernel="sdpa")
    with pytest.raises(ValueError, match=r"softcap=-1 is invalid: use a number > 0"):
        block_attn_forward(q, q, q, softcap=-1)
