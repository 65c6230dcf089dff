"""Attention of a batch placed at a dynamic SP degree p < P (``layout/grouped.py``, docs/balance.md).

Legend: P SP ranks, p ranks per group, n = S / P tokens per rank, B, H, H_kv, D as usual.

Every group holds whole documents of its own, so a rank's queries only see keys of its own group. Each rank
keeps all H heads (no Ulysses all-to-all) and runs the ring engine over its group:

    p = 1 (or a group whose documents all stay whole on its ranks): a ring of one, nothing sent;
    p > 1: a ring of the group's p SP ranks over the group's sub-row (its documents in row order), laid
           out by the group's ``Placement``; K/V of ``[B, n, H_kv, D]`` travel p − 1 steps.

Communication per rank and layer (fwd): ``2(p − 1) · B·n·H_kv·D`` elements on the ring, none at p = 1.
Point-to-point to the group's global ranks: no process group beyond the default one is needed.
"""

from __future__ import annotations

import torch

from ds_seqpar.comm.p2p import RingComm
from ds_seqpar.comm.schedules import RingSchedule
from ds_seqpar.layout import ContiguousLayout, GroupedPlacement
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.parallel.ring import RingPlan, WorkCounter, ring_attention


def grouped_plan(
    mesh: SeqParMesh,
    layout: GroupedPlacement,
    mask: MaskSpec,
    doc_ids: torch.Tensor,
    work: WorkCounter | None,
    softcap: float | None,
    reach: torch.Tensor | None = None,
) -> RingPlan:
    """The ring plan of this rank's group: a ring of its p SP ranks over the group's sub-row, or a ring of
    one when no document of the group is cut across its ranks. ``reach``: image blocks (``RingPlan.reach``) in
    global order, taken to the sub-row like the documents (a block lies inside one document)."""
    group, member = divmod(mesh.coords.sp_rank, layout.degree)
    part = layout.parts[group]
    docs = layout.group_doc_ids(doc_ids, group)
    reach = None if reach is None else layout.group_doc_ids(reach, group)
    overlap, kernel = mesh.settings.ring.overlap, mesh.settings.kernel
    if not part.needs_exchange:
        alone = RingSchedule(RingComm(None, [mesh.coords.rank], 0, mesh.comm_stats), overlap=overlap)
        local = part.local_doc_ids(docs, member)
        local_reach = None if reach is None else part.local_doc_ids(reach, member)
        return RingPlan(
            alone, ContiguousLayout(1), mask, local, kernel, work, softcap=softcap, reach=local_reach
        )
    members = mesh.members["sp"][group * layout.degree : (group + 1) * layout.degree]
    ring = RingSchedule(RingComm(None, members, member, mesh.comm_stats), overlap=overlap)
    return RingPlan(ring, part, mask, docs, kernel, work, softcap=softcap, reach=reach)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``out [B, n, H, D]`` of this rank's queries ``q [B, n, H, D]`` against its group's keys (k, v
    ``[B, n, H_kv, D]`` of every member, sent around the group's ring)."""
    return ring_attention(q, k, v, plan, scale, sinks)[0]
