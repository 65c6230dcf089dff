"""A tiny spatio-temporal transformer (video DiT-style blocks) trained under DSP, against Ulysses and one process.

    .venv/bin/torchrun --nproc_per_node 2 examples/dsp_video.py [--mode dsp|ulysses] [--steps 3]

Activations are ``[B, T, S, C]``: T frames of S spatial tokens. Each block runs spatial attention (over S,
within a frame), an MLP, temporal attention (over T, per spatial position) and an MLP, each with a
residual. The frames are sharded over the ranks (rank r holds T/P whole frames), so spatial attention
and the MLPs are local in both modes; temporal attention needs every frame:

* ``dsp``: switch the sharded axis from T to S before it and back after it (``ds_seqpar.parallel.dsp``,
  one all-to-all of the activation each way), and attend locally;
* ``ulysses``: ``ds_seqpar.attention`` (``attention: "ulysses"``, non-causal) over T inside it: q, k, v
  in and the output back through all-to-alls over heads.

The loss (mean squared error against a fixed target) is summed over the local tokens and divided by the
global count, so gradients summed over the ranks are the single-process ones. Prints per step the loss,
and at the end the bytes each rank sent per step, for comparison (docs/dsp.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_seqpar import SeqParMesh, attention
from ds_seqpar.parallel.dsp import switch_sharded_axis

B, T, S, C_IN, C, H, BLOCKS = 2, 8, 16, 4, 32, 4, 2


class AxisAttention(nn.Module):
    """Multi-head self-attention of ``[B, T, S, C]`` along one axis (1: temporal, 2: spatial)."""

    def __init__(self, axis: int) -> None:
        super().__init__()
        self.axis, self.qkv, self.out = axis, nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x: torch.Tensor, attend=None) -> torch.Tensor:
        seq = x.movedim(self.axis, -2)  # [..., L, C]
        lead, length = seq.shape[:-2], seq.shape[-2]
        q, k, v = self.qkv(seq).reshape(-1, length, 3, H, C // H).unbind(2)  # [N, L, H, D] each
        if attend is None:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            o = o.transpose(1, 2)
        else:
            o = attend(q, k, v)
        return self.out(o.reshape(*lead, length, C)).movedim(-2, self.axis)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(C) for _ in range(4))
        self.spatial, self.temporal = AxisAttention(2), AxisAttention(1)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C)) for _ in range(2)
        )

    def forward(self, x: torch.Tensor, temporal) -> torch.Tensor:
        x = x + self.spatial(self.norms[0](x))
        x = x + self.mlps[0](self.norms[1](x))
        x = x + temporal(self.temporal, self.norms[2](x))
        return x + self.mlps[1](self.norms[3](x))


class VideoModel(nn.Module):
    """Linear patch embedding, ``BLOCKS`` spatio-temporal blocks, linear head: ``[B, T, S, C_IN]`` in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(C_IN, C), nn.Linear(C, C_IN)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor, temporal) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, temporal)
        return self.head(x)


def local_temporal(attn: AxisAttention, x: torch.Tensor) -> torch.Tensor:
    return attn(x)


def dsp_temporal(mesh: SeqParMesh):
    """Temporal attention under DSP: frames-sharded in, switch to positions-sharded, attend, switch back."""

    def run(attn: AxisAttention, x: torch.Tensor) -> torch.Tensor:
        y = attn(switch_sharded_axis(x, mesh=mesh, sharded=1, to=2))
        return switch_sharded_axis(y, mesh=mesh, sharded=2, to=1)

    return run


def ulysses_temporal(mesh: SeqParMesh):
    """Temporal attention with the frames sharded throughout: Ulysses all-to-alls inside the attention."""

    def run(attn: AxisAttention, x: torch.Tensor) -> torch.Tensor:
        return attn(x, attend=lambda q, k, v: attention(q, k, v, mesh=mesh, causal=False))

    return run


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, S, C_IN, generator=g, dtype=torch.float64)
    return x, torch.roll(x, 1, dims=1) * 0.5  # predict half the previous frame


def train(mode: str, steps: int, mesh: SeqParMesh | None = None, seed: int = 0) -> dict:
    """``steps`` SGD steps in ``mode`` (single | dsp | ulysses); losses, final parameters, bytes per step."""
    torch.manual_seed(seed)
    model = VideoModel().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(seed)
    world, me = (1, 0) if mesh is None else (mesh.sp_size, mesh.coords.sp_rank)
    temporal = {"single": local_temporal, "dsp": None, "ulysses": None}[mode]
    if mode == "dsp":
        temporal = dsp_temporal(mesh)
    if mode == "ulysses":
        temporal = ulysses_temporal(mesh)
    x_local, y_local = x.chunk(world, 1)[me], y.chunk(world, 1)[me]
    losses, step_bytes = [], 0
    for _ in range(steps):
        opt.zero_grad()
        if mesh is None:
            loss = F.mse_loss(model(x_local, temporal), y_local, reduction="sum") / y.numel()
            loss.backward()
        else:
            with mesh.comm_stats.measure() as region:
                loss = F.mse_loss(model(x_local, temporal), y_local, reduction="sum") / y.numel()
                loss.backward()
            step_bytes = region.total_bytes
            for p in model.parameters():  # each rank holds its tokens' share of every gradient
                dist.all_reduce(p.grad, group=mesh.group("sp"))
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=mesh.group("sp"))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "bytes": step_bytes}


def build_mesh(mode: str) -> SeqParMesh:
    """The SP group of every rank: Ulysses over all ranks (the DSP switch uses the same ``sp`` group)."""
    world = dist.get_world_size()
    return SeqParMesh.from_config({"size": world, "ulysses_degree": world, "attention": "ulysses"})


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("dsp", "ulysses"), default="dsp")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    started = dist.is_initialized()
    if not started:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if T % world or S % world or H % world:
        raise SystemExit(f"examples/dsp_video.py: T={T}, S={S} and H={H} must divide by the {world} ranks")
    result = train(args.mode, args.steps, build_mesh(args.mode))
    if dist.get_rank() == 0:
        for i, loss in enumerate(result["losses"]):
            print(f"step {i}: loss {loss:.6f}")
        print(f"{args.mode}: {result['bytes']:,} bytes sent per rank per step (P = {world})")
    if not started:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
