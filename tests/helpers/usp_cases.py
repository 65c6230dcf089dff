"""The case runner of the USP tests: shard with the mesh's input layout, run ``ds_seqpar.attention`` on
gloo ranks, compare with the dense fp64 reference (``test_usp.py``, ``test_properties.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar import SeqParMesh
from ds_seqpar.ops.attention.reference import dense_attention_reference
from ds_seqpar.ops.masks import token_mask
from tests.helpers.cases import AttentionCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import TOL, assert_within

B, D = 2, 8


def usp_mesh(case: AttentionCase, world: int) -> SeqParMesh:
    """The mesh of one case, built from its ``sequence_parallel`` section."""
    return mesh_for(case.section(world))


def run_usp_cases(cases: list[AttentionCase]) -> list[dict]:
    """Each case: shard with the mesh's input layout, run ds_seqpar.attention, compare with the reference."""
    world = dist.get_world_size()
    results = []
    for case in cases:
        mesh = usp_mesh(case, world)
        # with ring.layout='documents' the layout is the batch's placement
        layout = ds_seqpar.input_layout(mesh, case.doc_ids())
        seq_len, h, h_kv, dtype = case.seq_len, case.h, case.h_kv, case.dtype
        g = torch.Generator().manual_seed(case.seed)
        q, k, v, dout = (
            torch.randn(case.batch, seq_len, heads, D, generator=g, dtype=torch.float64).to(dtype)
            for heads in (h, h_kv, h_kv, h)
        )
        spec, docs = case.spec, case.doc_ids()
        pos = torch.arange(seq_len)
        mask = token_mask(pos, pos, spec) if docs is None else token_mask(pos, pos, spec, docs, docs)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out, _ = dense_attention_reference(q64, k64, v64, mask)
        ref_out.backward(dout.double())
        me = mesh.coords.sp_rank
        ql, kl, vl = (layout.shard(t.detach(), me).clone().requires_grad_() for t in (q, k, v))
        with mesh.comm_stats.measure() as fwd:
            out = ds_seqpar.attention(
                ql,
                kl,
                vl,
                mesh=mesh,
                causal=case.causal,
                window=case.window,
                positions=layout.local_positions(seq_len, me),
                doc_ids=docs,
            )
        with mesh.comm_stats.measure() as bwd:
            out.backward(layout.shard(dout, me))
        errors = {
            name: (got.double() - layout.shard(ref, me)).abs().max().item()
            for name, got, ref in (
                ("out", out, ref_out.detach()),
                ("dq", ql.grad, q64.grad),
                ("dk", kl.grad, k64.grad),
                ("dv", vl.grad, v64.grad),
            )
        }
        results.append({"errors": errors, "fwd": fwd.as_dict(), "bwd": bwd.as_dict()})
    return results


def check_usp_cases(cases: list[AttentionCase], results: list[list[dict]]) -> None:
    """Every rank's errors of every case (out, dq, dk, dv) within the dtype's tolerance."""
    for i, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            assert_within(per_rank[i]["errors"], TOL[case.dtype], f"{case} rank {rank}")
