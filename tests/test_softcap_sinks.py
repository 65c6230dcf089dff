"""Attention logit soft-capping (Gemma 2) and attention sinks (gpt-oss) on every attention path.

Each case shards random q, k, v over P gloo ranks, runs ``ds_seqpar.attention`` with ``softcap`` and /
or ``sinks`` under one algorithm (USP, Ulysses pipelined and not, ring p2p / all-gather / double ring,
sparse ring), and compares this rank's out, dq, dk, dv and the SP group's summed sink gradient with
the single-process reference (``dense_attention_reference`` / ``sparse_attention_reference``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParMesh, SequenceParallelConfig
from ds_seqpar.layout import doc_ids_from_cu_seqlens
from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.merge import apply_sink, sink_grad
from ds_seqpar.ops.reference import dense_attention_reference
from ds_seqpar.ops.sparse import estimate_pattern, sparse_attention_reference
from ds_seqpar.parallel.sparse_ring import budget_from_config

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
D = 8
_MESHES: dict[tuple, SeqParMesh] = {}  # per rank process: building a mesh creates process groups


def _mesh(world: int, case: dict) -> SeqParMesh:
    key = (world, case["u"], case.get("inner"))
    if key not in _MESHES:
        _MESHES[key] = SeqParMesh.build(world, case["u"], case.get("inner"))
    mesh = _MESHES[key]
    extra = {}
    if case.get("sparse"):
        extra["sparse"] = dict(
            vertical=0.05, slash=0.05, block_size=4, last_q=16, sink_tokens=2, local_diagonals=4
        )
        extra["sparse"]["balancing"] = case["sparse"]
    mesh.config = SequenceParallelConfig(
        size=world,
        ulysses_degree=case["u"],
        ulysses_chunks=case.get("chunks", "auto"),
        attention=case.get("attention", "usp"),
        ring={
            "inner_size": case.get("inner"),
            "schedule": case.get("schedule", "p2p"),
            **case.get("ring", {}),
        }
        | ({} if case.get("sparse") else {"layout": case.get("layout", "zigzag")}),
        **extra,
    )
    return mesh


def _reference(case, q, k, v, dout, sinks, mesh):
    seq_len, window = q.shape[1], case.get("window")
    docs = doc_ids_from_cu_seqlens(case["cu_seqlens"], seq_len) if case.get("cu_seqlens") else None
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    softcap = case.get("softcap")
    if case.get("sparse"):
        pos = torch.arange(seq_len)
        pattern = estimate_pattern(q, k, pos, pos, seq_len, budget_from_config(mesh.config.sparse))
        out, _ = sparse_attention_reference(
            *leaves, pattern, spec=MaskSpec(window=window), doc_ids=docs, softcap=softcap, sinks=sinks64
        )
    else:
        spec = MaskSpec(causal=case.get("causal", True), window=window)
        pos = torch.arange(seq_len)
        mask = token_mask(pos, pos, spec) if docs is None else token_mask(pos, pos, spec, docs, docs)
        out, _ = dense_attention_reference(*leaves, mask, softcap=softcap, sinks=sinks64)
    out.backward(dout.double())
    grads = [t.grad for t in leaves] + ([] if sinks64 is None else [sinks64.grad])
    return out.detach(), grads, docs


def run_cases(cases: list[dict]) -> list[dict[str, float]]:
    """Per case, the max abs error of out, dq, dk, dv (this rank's shard) and dsinks (summed over SP)."""
    world = dist.get_world_size()
    results = []
    for i, case in enumerate(cases):
        mesh = _mesh(world, case)
        layout = ds_seqpar.input_layout(mesh)
        dtype, seq_len, h, h_kv = case["dtype"], case["seq_len"], case["h"], case["h_kv"]
        g = torch.Generator().manual_seed(i)
        q, k, v, dout = (
            torch.randn(case.get("batch", 2), seq_len, n, D, generator=g, dtype=torch.float64).to(dtype)
            for n in (h, h_kv, h_kv, h)
        )
        q = q * 3.0  # large scores, so a softcap of ~1 binds
        sinks = torch.randn(h, generator=g, dtype=torch.float64).to(dtype) if case.get("sinks") else None
        ref_out, ref_grads, docs = _reference(case, q, k, v, dout, sinks, mesh)
        me = mesh.coords.sp_rank
        local = [layout.shard(t, me).detach().clone().requires_grad_() for t in (q, k, v)]
        sinks_local = None if sinks is None else sinks.clone().requires_grad_()
        out = ds_seqpar.attention(
            *local,
            mesh=mesh,
            causal=case.get("causal", True),
            window=case.get("window"),
            doc_ids=docs,
            softcap=case.get("softcap"),
            sinks=sinks_local,
            layer=0,
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


def _cases(p: int) -> list[dict]:
    s = 16 * p
    both = dict(softcap=1.5, sinks=True)
    cases = [
        dict(u=p, h=8, h_kv=2, **both),  # Ulysses, pipelined head groups
        dict(u=p, h=8, h_kv=8, chunks=1, softcap=0.8),  # Ulysses, one exchange
        dict(u=p, h=8, h_kv=4, chunks=1, sinks=True, cu_seqlens=[0, 5, s // 2 + 3, s - 2]),
        dict(u=1, h=4, h_kv=2, attention="ring", **both),  # ring p2p, zigzag
        dict(u=1, h=4, h_kv=4, attention="ring", layout="stripe", causal=False, **both),
        dict(u=1, h=4, h_kv=2, attention="ring", schedule="all_gather", layout="contiguous", **both),
        dict(u=1, h=4, h_kv=2, attention="ring", window=7, **both),
        dict(u=p // 2, h=6, h_kv=2, **both),  # USP with uneven heads at P=4 (U=2: 3 + 3)
        dict(u=p // 2, h=8, h_kv=2, dtype=torch.float32, **both),
        dict(u=1, h=4, h_kv=2, attention="sparse_ring", sparse="stripe", **both),
        dict(u=2, h=8, h_kv=4, attention="sparse_ring", sparse="dbsp", window=24, **both),
    ]
    if p == 4:
        cases.append(dict(u=1, inner=2, h=4, h_kv=2, attention="ring", **both))  # double ring 2 x 2
        ring = dict(u=1, h=4, attention="ring", **both)  # the topology-aware schedules (docs/schedules.md)
        cases.append(
            dict(ring, h_kv=4, schedule="startrail", ring={"team_size": 2, "startrail_backward": "query"})
        )
        cases.append(dict(ring, h_kv=2, schedule="startrail", ring={"team_size": 2}, window=7))
        cases.append(dict(ring, h_kv=2, schedule="attention2d", ring={"grid": [2, 2]}, causal=False))
        cases.append(dict(ring, h_kv=1, inner=2, schedule="tasp"))
    for case in cases:
        case.setdefault("dtype", torch.float64)
        case.setdefault("seq_len", s)
    return cases


@pytest.mark.parametrize("p", [2, 4])
def test_softcap_and_sinks_match_reference_on_every_path(dist_pool, p):
    cases = _cases(p)
    results = dist_pool(p).run(run_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            errors = per_rank[i]
            assert all(e <= TOL[case["dtype"]] for e in errors.values()), f"{case} rank {rank}: {errors}"


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
