"""CommStats: per-kind bytes and messages, and regions measured by a context manager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_seqpar import CommStats, SeqParMesh


def test_record_and_measure_region():
    stats = CommStats()
    stats.record("p2p", 100)
    with stats.measure() as region:
        stats.record_tensors("all_to_all", torch.zeros(4, 8, dtype=torch.float32), copies=3)
        stats.record("p2p", 10, messages=2)
    assert region.bytes("all_to_all") == 4 * 8 * 4 * 3
    assert region.messages("all_to_all") == 1
    assert region.bytes("p2p") == 10 and region.messages("p2p") == 2
    assert region.bytes("all_gather") == 0
    assert region.total_bytes == 394 and region.total_messages == 3
    assert stats.total_bytes == 494
    assert region.as_dict() == {
        "all_to_all": {"bytes": 384, "messages": 1},
        "p2p": {"bytes": 10, "messages": 2},
    }
    stats.reset()
    assert stats.total_bytes == 0


def test_negative_volume_is_rejected():
    with pytest.raises(ValueError, match="kind='p2p' bytes=-1"):
        CommStats().record("p2p", -1)


def ring_send_counted() -> tuple[int, int]:
    """A ring shift on the mesh's ring group, recorded the way comm primitives record."""
    mesh = SeqParMesh.build(2, 1)
    group = mesh.group("ring")
    members = mesh.members["ring"]
    me = mesh.coords.ring_rank
    send = torch.full((16,), float(me))
    recv = torch.empty(16)
    with mesh.comm_stats.measure() as region:
        ops = [
            dist.P2POp(dist.isend, send, members[(me + 1) % 2], group),
            dist.P2POp(dist.irecv, recv, members[(me - 1) % 2], group),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        mesh.comm_stats.record_tensors("p2p", send)
    return region.bytes("p2p"), int(recv[0].item())


def test_mesh_owns_the_counter_on_real_ranks(dist_pool):
    assert dist_pool(2).run(ring_send_counted) == [(64, 1), (64, 0)]
