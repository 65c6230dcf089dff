"""The case runner of the schedule tests: shard with the mesh's input layout, run ``ds_seqpar.attention``
under the case's schedule, report errors against the dense fp64 reference, work and bytes per peer
(``test_schedules.py``, ``benchmarks/peer_bytes.py``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ds_seqpar import input_layout
from ds_seqpar.parallel.ring import WorkCounter
from ds_seqpar.parallel.usp import attention
from tests.helpers.cases import AttentionCase
from tests.helpers.meshes import mesh_for
from tests.helpers.references import H, dense_reference, grad_errors, qkv_inputs


def run_schedule_cases(cases: list[AttentionCase]) -> list[dict]:
    """Run every case on this rank: errors of its shard, work, bytes per peer (forward, backward)."""
    world = torch.distributed.get_world_size()
    results = []
    for case in cases:
        mesh = mesh_for(case.section(world))
        layout = input_layout(mesh)
        docs = case.doc_ids()
        q, k, v, dout = qkv_inputs(case.seq_len, case.h_kv, case.dtype, case.seed)
        ref = dense_reference(q, k, v, dout, case.spec, docs)
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
                causal=case.causal,
                window=case.window,
                doc_ids=docs,
                work=work,
            )
        with mesh.comm_stats.measure() as bwd:
            out.backward(dl)
        refs = tuple(layout.shard(t, me, dim=1) for t in (ref[0], *ref[2:]))
        errors = grad_errors(out, (ql, kl, vl), refs)
        results.append(
            {
                "errors": errors,
                "work": work.forward_pairs,
                "fwd_peers": dict(fwd.peers),
                "bwd_peers": dict(bwd.peers),
                "fwd_links": fwd.link_bytes(),
                "bwd_links": bwd.link_bytes(),
            }
        )
    return results


def byte_cases() -> list[AttentionCase]:
    """The byte sweep at P = 8: every schedule and its variants (double ring, TASP domains, StarTrail's
    backward choices and link classes, ATTENTION2D grids), each rank's counted bytes per peer compared with
    the model (``test_schedules.py``) and recorded across commits (``benchmarks/peer_bytes.py``)."""
    base = AttentionCase(dtype=torch.float32, seq_len=2 * 8 * 7 * 2, h_kv=2)
    cases = [
        replace(base, schedule="p2p"),
        replace(base, schedule="p2p", inner=4),
        replace(base, schedule="all_gather"),
        replace(base, schedule="tasp"),
        replace(base, schedule="tasp", inner=2, h_kv=1),
        replace(base, schedule="startrail", team_size=2, startrail_backward="kv", ranks_per_node=2),
        replace(
            base, schedule="startrail", team_size=2, startrail_backward="query", h_kv=H, ranks_per_node=2
        ),
        replace(base, schedule="startrail", team_size=2, startrail_backward="auto", h_kv=1),
        replace(base, schedule="startrail", team_size=1),
        replace(base, schedule="attention2d", grid=(2, 4), ranks_per_node=4),
        replace(base, schedule="attention2d", grid=(4, 2), h_kv=1, layout="contiguous"),
    ]
    return [replace(c, seed=70 + i) for i, c in enumerate(cases)]
