"""No host sync in the attention step loop once the block plan of a batch is built.

A ``TorchDispatchMode`` counts every op that makes the host wait for a device value
(``aten._local_scalar_dense``: every ``.item()``, ``bool(tensor)``, ``int(tensor)``) or that has a
data-dependent output shape (``nonzero``, ``masked_select``, ``unique``). The first call of
``ds_seqpar.attention`` on a batch builds and caches the block plan (classification, document cuts,
masks; under ``ring.layout='documents'`` also the batch's placement); the second call, forward and
backward, must count 0 for dense, packed documents and sliding-window attention on P in {2, 4, 8}, and for the sparse ring's step loop with the sync-free
sparse kernels (``masked``; ``triton`` under its CPU interpreter). Packed documents are also checked for exactness and for
the work they save (pairs of different documents are never computed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ds_seqpar
from ds_seqpar import SeqParMesh
from ds_seqpar.layout import ring_layout
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import MaskSpec, token_mask
from ds_seqpar.ops.sparse import estimate_pattern, sparse_attention_reference
from ds_seqpar.ops.sparse.kernels import available_sparse_kernels
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, build_schedule, ring_attention
from ds_seqpar.parallel.ring import execute as ring
from tests.helpers.cases import AttentionCase, SparseCase
from tests.helpers.meshes import mesh_for

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
}


class SyncCounter(TorchDispatchMode):
    """Counts the ops of ``SYNC_OPS`` dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNC_OPS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _step(
    mesh: SeqParMesh, case: AttentionCase, local: list[torch.Tensor], dout: torch.Tensor, docs, work
) -> list:
    """One forward and backward of this rank's shard; returns out and the gradients of q, k, v."""
    leaves = [t.clone().requires_grad_() for t in local]
    out = ds_seqpar.attention(*leaves, mesh=mesh, window=case.window, doc_ids=docs, work=work)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


class _Counted:
    """Wraps ``module.name`` and counts its calls (restore with ``module.name = counted.original``)."""

    def __init__(self, module, name: str) -> None:
        self.original, self.count = getattr(module, name), 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.original(*args, **kwargs)


def _count_calls(module, name: str) -> _Counted:
    counted = _Counted(module, name)
    setattr(module, name, counted)
    return counted


def run_sync_cases(cases: list[AttentionCase]) -> list[dict]:
    """Per case: host syncs of the second (cached) call, max error against the reference, work pairs."""
    world = dist.get_world_size()
    out = []
    for i, case in enumerate(cases):
        mesh = mesh_for(case.section(world))
        docs = case.doc_ids()
        layout = ds_seqpar.input_layout(mesh, docs)  # ring.layout='documents': placed once per batch
        s = case.seq_len
        g = torch.Generator().manual_seed(i)
        h = max(4, world)
        q, k, v, dout = (torch.randn(2, s, h, 8, generator=g, dtype=torch.float64) for _ in range(4))
        me = mesh.coords.sp_rank
        local = [layout.shard(t, me) for t in (q, k, v)]
        work = WorkCounter()
        args = (mesh, case, local, layout.shard(dout, me), docs, work)
        _step(*args)  # builds and caches the block plan of this batch
        work.reset()
        calls = _count_calls(ring, "block_attn_forward")
        with SyncCounter() as counter:
            got = _step(*args)
        ring.block_attn_forward = calls.original
        pos = torch.arange(s)
        spec = case.spec
        mask = token_mask(pos, pos, spec) if docs is None else token_mask(pos, pos, spec, docs, docs)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, _ = dense_attention_reference(*ref, mask)
        ref_out.backward(dout)
        want = [ref_out.detach(), *(t.grad for t in ref)]
        err = max((a - layout.shard(b, me)).abs().max().item() for a, b in zip(got, want, strict=True))
        out.append({"syncs": counter.ops, "err": err, "pairs": work.forward_pairs, "calls": calls.count})
    return out


def _cases(p: int) -> list[AttentionCase]:
    s = 32 * p
    docs16 = tuple(range(0, s + 1, s // 16))  # a row of 16 short documents
    base = AttentionCase(seq_len=s)
    return [
        base,
        replace(base, cu_seqlens=(0, s // 8, s // 4 + 3, s)),
        replace(base, layout="contiguous", window=11),
        replace(base, u=p, cu_seqlens=docs16),  # R = 1: one PARTIAL block, cut per document
        replace(base, layout="stripe", cu_seqlens=docs16, window=9),
        replace(base, cu_seqlens=(0, 5, s // 2 + 1, s - 3), kernel="torch"),
        replace(base, layout="documents", cu_seqlens=(0, 5, s // 2 + 1, s - 3)),
        replace(base, layout="documents", dynamic=True, cu_seqlens=docs16),  # dynamic_degree: p = 1
        replace(base, layout="documents", dynamic=True, cu_seqlens=(0, 3 * s // 8, s // 2, 7 * s // 8, s)),
    ]


@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # P = 8: slow suite
def test_no_host_sync_after_the_plan_is_built(dist_pool, p):
    cases = _cases(p)
    results = dist_pool(p).run(run_sync_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            assert r["syncs"] == [], (case, rank, r["syncs"][:5])
            assert r["err"] <= 1e-10, (case, rank, r["err"])


def test_packed_documents_compute_only_their_own_pairs(dist_pool):
    """16 documents of 8 tokens at S = 128 on 4 ranks, U = 4 (R = 1, one head per rank): causal 8 x 8
    blocks per document (16 x 36 visible score pairs per rank), not the 128 x 128 square of a whole-block mask,
    and, the documents having equal lengths, all in ONE batched kernel call."""
    s = 128
    case = AttentionCase(u=4, seq_len=s, cu_seqlens=tuple(range(0, s + 1, 8)))
    for per_rank in dist_pool(4).run(run_sync_cases, [case]):
        assert per_rank[0]["err"] <= 1e-10, per_rank
        assert per_rank[0]["pairs"] == 16 * (8 * 9 // 2), per_rank
        assert per_rank[0]["calls"] == 1, per_rank


def _sparse_step(plan: RingPlan, local: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in local]
    got, _ = ring_attention(*leaves, plan)
    got.backward(dout)
    return [got.detach(), *(t.grad for t in leaves)]


def run_sparse_sync_cases(cases: list[SparseCase]) -> list[dict]:
    """The sparse ring's step loop (pattern given, as after estimation) with a sync-free sparse kernel:
    host syncs of the second call, forward and backward, and the max error against the reference."""
    world, me = dist.get_world_size(), dist.get_rank()
    out = []
    for i, case in enumerate(cases):
        mesh = mesh_for(AttentionCase(layout="stripe").section(world))
        s, dtype = case.seq_len, case.dtype
        layout = ring_layout(case.layout, world, case.granularity)
        g = torch.Generator().manual_seed(50 + i)
        q, dout = (torch.randn(1, s, 4, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
        k, v = (torch.randn(1, s, 2, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
        pos = torch.arange(s)
        pattern = estimate_pattern(q, k, pos, pos, s, case.budget())
        docs = case.doc_ids()
        spec = MaskSpec(window=case.window)
        plan = RingPlan(
            build_schedule(mesh, "p2p"), layout, spec, docs, sparse=pattern, sparse_kernel=case.kernel
        )
        args = (plan, [layout.shard(t, me) for t in (q, k, v)], layout.shard(dout, me))
        _sparse_step(*args)  # first call: positions and documents of every step cached
        with SyncCounter() as counter:
            got = _sparse_step(*args)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = sparse_attention_reference(*ref, pattern, spec=spec, doc_ids=docs)
        ref_out.backward(dout.double())
        want = [ref_out.detach(), *(t.grad for t in ref)]
        err = max(
            (a.double() - layout.shard(b, me)).abs().max().item() for a, b in zip(got, want, strict=True)
        )
        out.append({"syncs": counter.ops, "err": err})
    return out


@pytest.mark.parametrize("p", [2, 4, pytest.param(8, marks=pytest.mark.slow)])  # P = 8: slow suite
def test_sparse_step_loop_has_no_host_sync(dist_pool, p):
    s = 32 * p
    docs = (0, 7, s // 2 + 5, s - 3)
    base = SparseCase(seq_len=s, granularity=8, kernel="masked")
    cases = [base, replace(base, window=20, cu_seqlens=docs)]
    if sparse_triton_runs():
        cases.append(replace(base, kernel="triton", dtype=torch.float32, window=20, cu_seqlens=docs))
    results = dist_pool(p).run(run_sparse_sync_cases, cases)
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            assert r["syncs"] == [], (case, rank, r["syncs"][:5])
            assert r["err"] <= (1e-10 if case.dtype == torch.float64 else 1e-5), (case, rank, r["err"])


def sparse_triton_runs() -> bool:
    """Whether the triton sparse kernel can run on CPU here (the package and its interpreter)."""
    return "triton" in available_sparse_kernels("cpu", torch.float32)
