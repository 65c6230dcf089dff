"""DSP's axis switch on gloo ranks: exact re-layout, its gradient, bytes, refusals, and a spatial /
temporal attention pair under DSP equal to one process (out and input gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import SeqParMesh
from ds_seqpar.parallel.dsp import switch_bytes, switch_sharded_axis

B, T, S, C = 2, 12, 12, 6


def _attend(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Self-attention of ``x [B, T, S, C]`` along ``axis`` (1: temporal, per position; 2: spatial, per frame)."""
    seq = x.movedim(axis, -2)  # [..., L, C]
    out = F.scaled_dot_product_attention(seq.unsqueeze(-3), seq.unsqueeze(-3), seq.unsqueeze(-3)).squeeze(-3)
    return out.movedim(-2, axis)


def _block_pair(x: torch.Tensor, switch=None) -> torch.Tensor:
    """Spatial attention, then temporal attention, each with a residual (``switch``: DSP's re-layouts)."""
    x = x + _attend(x, 2)
    if switch is not None:
        x = switch(x, 1, 2)
    x = x + _attend(x, 1)
    if switch is not None:
        x = switch(x, 2, 1)
    return x


def run_dsp_cases(_: None = None) -> dict:
    world = torch.distributed.get_world_size()
    mesh = SeqParMesh.build(world, 1)
    me = mesh.coords.sp_rank
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, S, C, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, S, C, generator=g, dtype=torch.float64)
    out = {}
    shard_t = x.chunk(world, 1)[me].clone().requires_grad_()
    with mesh.comm_stats.measure() as region:
        moved = switch_sharded_axis(shard_t, mesh=mesh, sharded=1, to=2)
    out["layout"] = torch.equal(moved, x.chunk(world, 2)[me])
    out["peers"] = region.peer_bytes("all_to_all")
    (moved * w.chunk(world, 2)[me]).sum().backward()  # d/dx = w, seen through the switch back
    out["grad"] = torch.equal(shard_t.grad, w.chunk(world, 1)[me])
    back = switch_sharded_axis(moved, mesh=mesh, sharded=2, to=1)
    out["round_trip"] = torch.equal(back, shard_t.detach())
    try:
        switch_sharded_axis(torch.zeros(B, T // world, S + 1, C), mesh=mesh, sharded=1, to=2)
    except ValueError as e:
        out["uneven"] = str(e)
    # a spatial + temporal attention pair: DSP against one process
    ref_x = x.clone().requires_grad_()
    ref = _block_pair(ref_x)
    ref.backward(w)
    local = x.chunk(world, 1)[me].clone().requires_grad_()

    def switch(t, a, b):
        return switch_sharded_axis(t, mesh=mesh, sharded=a, to=b)

    with mesh.comm_stats.measure() as pair:
        got = _block_pair(local, switch)
        got.backward(w.chunk(world, 1)[me])
    out["pair_out"] = (got - ref.chunk(world, 1)[me]).abs().max().item()
    out["pair_grad"] = (local.grad - ref_x.grad.chunk(world, 1)[me]).abs().max().item()
    out["pair_bytes"] = pair.bytes("all_to_all")
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_axis_switch_and_a_dsp_block_pair(dist_pool, world):
    shard = B * (T // world) * S * C
    for rank, res in enumerate(dist_pool(world).run(run_dsp_cases)):
        assert res["layout"] and res["grad"] and res["round_trip"], (rank, res)
        per_peer = shard // world * 8
        assert res["peers"] == {p: per_peer for p in range(world) if p != rank}
        assert sum(res["peers"].values()) == switch_bytes(shard, 8, world)
        assert (
            f"axis 2 has {S + 1} entries, which do not split over {world} ranks; pad it to" in res["uneven"]
        )
        assert res["pair_out"] <= 1e-10 and res["pair_grad"] <= 1e-10, res
        assert res["pair_bytes"] == 4 * switch_bytes(shard, 8, world)  # 2 switches forward, 2 back
