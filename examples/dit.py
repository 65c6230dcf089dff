"""Generate with, and fine-tune, a diffusion transformer (diffusers) under sequence parallelism.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/dit.py --ds_config ds_configs/dit/cfg2_sp2.json --check
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/dit.py --train --ds_config ds_configs/dit/train_sp2_zero3.json

Generation: ``ds_seqpar.dit.parallelize(pipe, config)`` installs the config's parallelism on the pipeline's
transformer (SP over ``size`` ranks, CFG parallel, PipeFusion: docs/dit.md); the pipeline's own denoising
loop then runs unchanged on every rank. ``--check`` also runs the pipeline in this process without ds_seqpar
and prints the difference of the final latents. Training: ``ds_seqpar.initialize`` wraps the transformer in
``SeqParDiT`` (the denoising loss of a whole batch, its tokens split over the group); the batches are random
latents with the family's target (flow matching for SD3 / Flux, noise for PixArt). The pipeline is the
shipped tiny one with seeded random weights (``--model DIR`` loads a pipeline folder with weights). The
prompts are random embeddings (the tiny assets have no text encoder).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ds_seqpar
from ds_seqpar.dit import load_pipeline, losses, parallelize

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="diffusers pipeline folder (default: assets/tiny-<family>)")
    p.add_argument("--family", default="sd3", choices=["pixart", "sd3", "flux"], help="tiny asset to use")
    p.add_argument("--ds_config", default=str(REPO / "ds_configs" / "dit" / "sp4.json"))
    p.add_argument("--steps", type=int, default=8, help="denoising steps (training: optimizer steps)")
    p.add_argument("--size", type=int, default=64, help="image height and width in pixels")
    p.add_argument("--check", action="store_true", help="also run without ds_seqpar and compare the latents")
    p.add_argument("--train", action="store_true", help="fine-tune the transformer instead of generating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prompt(family: str, seed: int) -> dict:
    """Random prompt embeddings (77 tokens: the length does not divide most SP sizes; the stream is padded)."""
    g = torch.Generator().manual_seed(seed)
    pos, neg = torch.randn(1, 77, 32, generator=g), torch.randn(1, 77, 32, generator=g)
    pooled = torch.randn(2, 32, generator=g)
    if family == "pixart":
        mask = torch.ones(1, 77)
        return dict(prompt_embeds=pos, negative_prompt_embeds=neg, prompt_attention_mask=mask,
                    negative_prompt_attention_mask=mask, negative_prompt=None, use_resolution_binning=False)  # fmt: skip
    if family == "flux":
        return dict(prompt_embeds=pos, pooled_prompt_embeds=pooled[:1])
    return dict(prompt_embeds=pos, negative_prompt_embeds=neg, pooled_prompt_embeds=pooled[:1],
                negative_pooled_prompt_embeds=pooled[1:])  # fmt: skip


def generate(pipe, args: argparse.Namespace) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=args.steps, height=args.size, width=args.size, output_type="latent")
    return pipe(
        **call, **prompt(args.family, args.seed), generator=torch.Generator().manual_seed(args.seed)
    ).images


def run_generation(args: argparse.Namespace) -> None:
    pipe = load_pipeline(
        args.model or REPO / "assets" / f"tiny-{args.family}", random_init=args.model is None
    )
    reference = generate(pipe, args) if args.check else None
    run = parallelize(pipe, args.ds_config)
    start = time.perf_counter()
    latents = generate(pipe, args)
    seconds = (time.perf_counter() - start) / args.steps
    if dist.get_rank() == 0:
        sent = run.mesh.comm_stats.total_bytes / args.steps
        print(f"examples/dit.py: {args.family} {args.steps} steps, latents {tuple(latents.shape)}, "
              f"{seconds:.3f} s/step, {sent / 2**10:.1f} KiB sent per step by rank 0")  # fmt: skip
        if reference is not None:
            diff = float((latents - reference).abs().max() / reference.abs().max())
            print(f"examples/dit.py: max |latents - one process| / max |one process| = {diff:.2e}")
            if diff > 1e-5:
                raise SystemExit("examples/dit.py: the parallel run differs from one process")


def run_training(args: argparse.Namespace) -> None:
    pipe = load_pipeline(
        args.model or REPO / "assets" / f"tiny-{args.family}", random_init=args.model is None
    )
    engine, _, _, _ = ds_seqpar.initialize(model=pipe.transformer, config=args.ds_config)
    g = torch.Generator().manual_seed(args.seed)
    side = args.size // pipe.vae_scale_factor
    for step in range(args.steps):
        batch = prompt_batch(args.family, side, g)
        latents, noise = batch.pop("latents"), torch.randn(batch["hidden_states_shape"], generator=g)
        batch.pop("hidden_states_shape")
        if args.family == "pixart":
            t = torch.randint(0, 1000, (2,), generator=g)
            noisy, target = losses.epsilon(pipe.scheduler, latents, noise, t)
            batch["timestep"] = t
        else:
            sigmas = torch.rand(2, generator=g)
            noisy, target = losses.flow_matching(latents, noise, sigmas)
            batch["timestep"] = sigmas * (1000 if args.family == "sd3" else 1)
        loss = engine(target=target, hidden_states=noisy, **batch)
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            print(f"examples/dit.py: step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)


def prompt_batch(family: str, side: int, g: torch.Generator) -> dict:
    """Two training examples: clean latents and the transformer's conditioning inputs."""
    text = torch.randn(2, 77, 32, generator=g)
    if family == "flux":
        n, grid = (side // 2) ** 2, side // 2
        ids = torch.zeros(n, 3)
        ids[:, 1], ids[:, 2] = torch.arange(n) // grid, torch.arange(n) % grid
        latents = torch.randn(2, n, 16, generator=g)
        return dict(latents=latents, hidden_states_shape=latents.shape, encoder_hidden_states=text,
                    pooled_projections=torch.randn(2, 32, generator=g), img_ids=ids, txt_ids=torch.zeros(77, 3),
                    guidance=None)  # fmt: skip
    latents = torch.randn(2, 4, side, side, generator=g)
    batch = dict(latents=latents, hidden_states_shape=latents.shape, encoder_hidden_states=text)
    if family == "pixart":
        batch["added_cond_kwargs"] = {"resolution": None, "aspect_ratio": None}
    else:
        batch["pooled_projections"] = torch.randn(2, 32, generator=g)
    return batch


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.train:
        run_training(args)
    else:
        run_generation(args)


if __name__ == "__main__":
    main()
