"""ds_seqpar's diffusion-transformer modes on the tiny assets: time per denoising step, bytes per step, peak
activation memory per rank and the final latents' difference from one process.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.dit_bench [--size 128] [--steps 8]

For each family (assets/tiny-pixart, tiny-sd3, tiny-flux: seeded random weights, fp32) the same pipeline call
(``--size`` px, ``--steps`` steps, 77 random prompt-embedding tokens, CFG where the pipeline batches it) runs
in one process on rank 0 (the reference), then under each mode of ``ds_seqpar.dit.parallelize`` on all ranks.
Columns: seconds per step (the whole call / steps ; all 4 ranks share this machine's cores: read
the time as relative),
bytes sent per step by the busiest rank (``CommStats``), peak live bytes of the tensors created during the
run on the busiest rank (``LiveBytes``; weights excluded), max |latents - reference| / max |reference|.
Prints markdown on rank 0 and saves ``benchmarks/results/dit_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_seqpar.dit import load_pipeline, parallelize
from ds_seqpar.memory.trace import LiveBytes

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
MODES = {
    "SP U4": {"size": 4, "ulysses_degree": 4},
    "SP U2xR2": {"size": 4, "ulysses_degree": 2},
    "SP R4": {"size": 4, "ulysses_degree": 1},
    "CFG2 x SP U2": {"size": 2, "dit": {"cfg_parallel": 2}},
}


def prompt(family: str) -> dict:
    g = torch.Generator().manual_seed(0)
    pos, neg, pooled = (
        torch.randn(1, 77, 32, generator=g),
        torch.randn(1, 77, 32, generator=g),
        torch.randn(2, 32, generator=g),
    )
    if family == "pixart":
        mask = torch.ones(1, 77)
        return dict(prompt_embeds=pos, negative_prompt_embeds=neg, prompt_attention_mask=mask, negative_prompt=None,
                    negative_prompt_attention_mask=mask, use_resolution_binning=False, guidance_scale=4.5)  # fmt: skip
    if family == "flux":
        return dict(prompt_embeds=pos, pooled_prompt_embeds=pooled[:1], guidance_scale=3.5)
    return dict(prompt_embeds=pos, negative_prompt_embeds=neg, pooled_prompt_embeds=pooled[:1],
                negative_pooled_prompt_embeds=pooled[1:], guidance_scale=5.0)  # fmt: skip


def timed_run(pipe, family: str, args: argparse.Namespace) -> tuple[torch.Tensor, float, int]:
    """Final latents, seconds per step (the whole call / steps) and peak live bytes of one pipeline call."""
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=args.steps, height=args.size, width=args.size, output_type="latent")
    start = time.perf_counter()
    with LiveBytes() as live:
        latents = pipe(**call, **prompt(family), generator=torch.Generator().manual_seed(0)).images
    return latents, (time.perf_counter() - start) / args.steps, int(live.peak)


def busiest(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_family(family: str, args: argparse.Namespace) -> list[dict]:
    rank = dist.get_rank()
    pipe = load_pipeline(REPO / "assets" / f"tiny-{family}", random_init=True)
    rows = []
    ref = torch.zeros(0)
    if rank == 0:
        ref, seconds, peak = timed_run(pipe, family, args)
        rows.append({"family": family, "mode": "one process", "s_per_step": seconds, "bytes_per_step": 0,
                     "peak_mib": peak / 2**20, "max_rel_diff": 0.0})  # fmt: skip
    dist.barrier()
    holder = [ref if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    ref = holder[0]
    for mode, section in MODES.items():
        if family == "flux" and "dit" in section:
            continue  # no batched CFG in FluxPipeline (refused by name)
        run = parallelize(pipe, {"sequence_parallel": section})
        run.mesh.comm_stats.reset()
        latents, seconds, peak = timed_run(pipe, family, args)
        sent = run.mesh.comm_stats.total_bytes / args.steps
        run.remove()
        diff = float((latents - ref).abs().max() / ref.abs().max())
        rows.append({"family": family, "mode": mode, "s_per_step": busiest(seconds), "bytes_per_step": busiest(sent),
                     "peak_mib": busiest(peak) / 2**20, "max_rel_diff": busiest(diff)})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=128, help="image side in pixels (latent side = size / 2)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--families", default="pixart,sd3,flux")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rows = [row for family in args.families.split(",") for row in bench_family(family, args)]
    if dist.get_rank() == 0:
        lines = [f"DiT modes, {args.size}x{args.size} px ({(args.size // 4) ** 2} image tokens), {args.steps} steps, "
                 f"fp32, {dist.get_world_size()} gloo ranks on this machine", "",
                 "| family | mode | s / step | bytes / step (busiest rank) | peak MiB (busiest rank) | max rel diff |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['family']} | {r['mode']} | {r['s_per_step']:.3f} | {r['bytes_per_step'] / 2**20:.2f} MiB "
                         f"| {r['peak_mib']:.1f} | {r['max_rel_diff']:.1e} |")  # fmt: skip
        text = "\n".join(lines) + "\n"
        print(text)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "dit_cpu.md").write_text(text)
        (OUT / "dit_cpu.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
