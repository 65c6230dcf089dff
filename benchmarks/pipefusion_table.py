"""PipeFusion on a tiny PixArt: how far the final latents move from the exact run, per warm-up steps and patches;
bytes per step; peak memory per rank vs exact SP (``DitParallel``) and one process (docs/pipefusion.md).

Run with PyTorch's launcher (one process per rank, P = 2 or 4 stages)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.pipefusion_table

The model: ``assets/tiny-pixart`` deepened to 8 blocks (width 64, 4 heads), random init (seed 0), fp64; a 32 x 32
latent (256 image tokens), batch 2, a 10-token prompt, 8 DDIM steps (``clip_sample=False``). The reference is
the same loop in one process. The difference is max |x - x_ref| over the final latents, and relative to
max |x_ref|, and the mean |x - x_ref|. Bytes: what each rank sends per step (``CommStats``), checked equal to ``step_bytes``. Peak: the
bytes created inside the whole 8-step loop (``LiveBytes``: K/V buffers, received patches, activations; weights
excluded) on the busiest rank. Saves ``benchmarks/results/pipefusion.{json,md}``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results
from ds_seqpar import SeqParMesh
from ds_seqpar.comm.stats import CommStats
from ds_seqpar.comm.team import TeamComm
from ds_seqpar.integrations.dit import DitParallel, PipeFusion
from ds_seqpar.integrations.dit.pipefusion import step_bytes
from ds_seqpar.memory.trace import LiveBytes

B, TEXT, SIDE, LAYERS, STEPS = 2, 10, 32, 8, 8
KIB, MIB = 2**10, 2**20


def pixart() -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    config = dict(PixArtTransformer2DModel.load_config("assets/tiny-pixart/transformer"), num_layers=LAYERS)
    return PixArtTransformer2DModel.from_config(config).double().eval()


def denoise(model: torch.nn.Module) -> tuple[torch.Tensor, int]:
    """The final latents of the 8-step DDIM loop and the peak bytes created inside it."""
    from diffusers import DDIMScheduler

    g = torch.Generator().manual_seed(1)
    scheduler = DDIMScheduler.from_pretrained("assets/tiny-pixart/scheduler", clip_sample=False)
    scheduler.set_timesteps(STEPS)
    cond = {"resolution": None, "aspect_ratio": None}
    with LiveBytes() as live, torch.no_grad():
        x = torch.randn(B, 4, SIDE, SIDE, generator=g, dtype=torch.float64)
        prompt = torch.randn(B, TEXT, 32, generator=g, dtype=torch.float64)
        for t in scheduler.timesteps:
            out = model(x, encoder_hidden_states=prompt, timestep=t.expand(B), added_cond_kwargs=cond)[0]
            x = scheduler.step(out[:, :4], t, x).prev_sample
    return x, live.peak


def row(
    run: str, warmup: str, patches: str, out: torch.Tensor, ref: torch.Tensor, peak: int, sent: int
) -> dict:
    diff = (out - ref).abs()
    err, mean = float(diff.max()), float(diff.mean())
    peaks, sents = gather_floats(peak), gather_floats(sent / STEPS)
    return {"run": run, "W": warmup, "M": patches, "max_abs": err, "rel": err / float(ref.abs().max()), "mean_abs": mean,
            "busiest_KiB": max(sents) / KIB, "total_KiB": sum(sents) / KIB, "peak_MiB": max(peaks) / MIB}  # fmt: skip


def pipefusion_rows(model: torch.nn.Module, ref: torch.Tensor, grid: list[tuple[int, int]]) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = CommStats(rank)
    team = TeamComm(dist.new_group(list(range(world))), list(range(world)), rank, stats)
    cfg = model.config
    width, features = cfg.num_attention_heads * cfg.attention_head_dim, cfg.patch_size**2 * cfg.out_channels
    formula = step_bytes(world, B, (SIDE // cfg.patch_size) ** 2, width, features, 8)
    rows = []
    for warmup, patches in grid:
        pipe = PipeFusion(model, team, patches, warmup)
        with stats.measure() as region:
            out, peak = denoise(model)
        pipe.remove()
        if region.total_bytes != STEPS * formula[rank]:
            raise AssertionError(f"rank {rank}: {region.total_bytes} bytes sent != {STEPS} x {formula[rank]}")
        rows.append(row("PipeFusion", str(warmup), str(patches), out, ref, peak, region.total_bytes))
    return rows


def sp_rows(model: torch.nn.Module, ref: torch.Tensor) -> list[dict]:
    world, rows = dist.get_world_size(), []
    for name, ulysses in (("exact SP, Ulysses", world), ("exact SP, ring", 1)):
        mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": ulysses}, model.config)
        par = DitParallel(model, mesh)
        with mesh.comm_stats.measure() as region:
            out, peak = denoise(model)
        par.remove()
        rows.append(row(name, "-", "-", out, ref, peak, region.total_bytes))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    dist.init_process_group("gloo")
    start, model = time.perf_counter(), pixart()
    ref, peak = denoise(model)  # every rank: the single-process reference (same on each)
    rows = [row("one process", "-", "-", ref, ref, peak, 0)]
    grid = [(STEPS, 4)] + [(w, m) for w in (0, 1, 2, 4) for m in (2, 4, 8)]
    rows += sp_rows(model, ref) + pipefusion_rows(model, ref, grid)
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        table = save_results(
            "pipefusion",
            f"PipeFusion on {world} stages vs one process and exact SP over the same {world} ranks: tiny PixArt "
            f"(8 blocks, width 64), 32 x 32 latent = 256 tokens, batch 2, {STEPS} DDIM steps, fp64, gloo on CPU; "
            f"W = warm-up steps, M = patches; bytes sent per step; peak = bytes created in the loop, weights "
            f"excluded; {seconds:.0f} s",
            {
                "world": world,
                "steps": STEPS,
                "tokens": (SIDE // 2) ** 2,
                "layers": LAYERS,
                "seconds": seconds,
            },
            rows,
            [
                ("run", "run", "s"),
                ("W", "W", "s"),
                ("M", "M", "s"),
                ("max abs diff", "max_abs", ".2e"),
                ("relative", "rel", ".2e"),
                ("mean abs diff", "mean_abs", ".2e"),
                ("KiB/step busiest rank", "busiest_KiB", ".0f"),
                ("KiB/step all ranks", "total_KiB", ".0f"),
                ("peak MiB busiest rank", "peak_MiB", ".2f"),
            ],
        )
        print(table)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
