"""Per-rank peak memory and time of a VLM's vision tower on a long video, whole (P = 1) and split over the SP group
(P = 2, 4; ``ds_seqpar/integrations/vision/split_tower.py``), forward and backward.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.vision_tower_memory [--quick]

Two towers, random init, fp32: a Qwen2-VL vision transformer (4 blocks, width 256, 4 heads; the "frames" rule:
one unit per temporal patch) on a video of T temporal patches of 16 x 16 patches (T x 256 patches, attention
inside each temporal patch), and a SigLIP tower as LLaVA-NeXT-Video uses it (4 layers, width 256; the
"images" rule: one unit per frame) on T frames of 64 x 64 pixels (256 patches each). The peak is the bytes
created inside one forward + backward of the tower (``LiveBytes``; weights excluded), on the busiest rank of
the first SP group (the world is dp x P; the other groups wait). The split tower's outputs are checked against
the whole tower's on every run (fp32, max abs difference).

Prints markdown on rank 0 and saves ``benchmarks/results/vision_tower_memory_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results
from ds_seqpar import SeqParMesh
from ds_seqpar.integrations.vision.split_tower import split_towers
from ds_seqpar.memory.trace import LiveBytes

MIB = 2**20


def qwen_tower() -> torch.nn.Module:
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLConfig

    vision = dict(depth=4, embed_dim=256, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    text = dict(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision)).eval()


def siglip_tower() -> torch.nn.Module:
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    vision = dict(model_type="siglip_vision_model", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, image_size=64, patch_size=4)  # fmt: skip
    text = dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                num_attention_heads=4)  # fmt: skip
    torch.manual_seed(0)
    return LlavaNextVideoForConditionalGeneration(
        LlavaNextVideoConfig(text_config=text, vision_config=vision, vision_feature_select_strategy="full")
    ).eval()


def video(kind: str, frames: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(frames)
    if kind == "qwen2_vl":
        return {"hidden_states": torch.randn(frames * 256, 3 * 2 * 14 * 14, generator=g),
                "grid_thw": torch.tensor([[frames, 16, 16]])}  # fmt: skip
    return {"pixel_values": torch.randn(frames, 3, 64, 64, generator=g)}


def step(model: torch.nn.Module, inputs: dict, mesh: SeqParMesh | None) -> tuple[int, float, torch.Tensor]:
    """Peak bytes and seconds of one forward + backward of the tower (split over ``mesh`` when given); the
    output the model reads (Qwen: the merged tokens; SigLIP: the last hidden state)."""
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower
    field = "pooler_output" if hasattr(model.model, "visual") else "last_hidden_state"
    start = time.perf_counter()
    with LiveBytes() as live:
        if mesh is None:
            out = tower(**inputs)[field]
        else:
            with split_towers(model, mesh):
                out = tower(**inputs)[field]
        out.square().mean().backward()
    return live.peak, time.perf_counter() - start, out.detach()


def rows_for(kind: str, model: torch.nn.Module, frames: int, meshes: dict[int, SeqParMesh]) -> list[dict]:
    inputs = video(kind, frames)
    base_peak, base_s, whole = step(model, inputs, None) if dist.get_rank() == 0 else (0, 0.0, None)
    single, single_s = gather_floats(base_peak)[0] / MIB, gather_floats(base_s)[0]
    rows = [{"tower": kind, "frames": frames, "P": 1, "single_MiB": single, "peak_MiB": single, "ratio": 1.0,
             "seconds": single_s, "single_seconds": single_s, "max_abs_err": 0.0}]  # fmt: skip
    for p, mesh in meshes.items():
        mine = dist.get_rank() < p
        peak, seconds, out = step(model, inputs, mesh) if mine else (0, 0.0, None)
        err = float((out - whole).abs().max()) if dist.get_rank() == 0 else 0.0
        peaks, times = gather_floats(peak)[:p], gather_floats(seconds)[:p]
        rows.append({"tower": kind, "frames": frames, "P": p, "single_MiB": single,
                     "peak_MiB": max(peaks) / MIB, "ratio": max(peaks) / MIB / single,
                     "seconds": max(times), "single_seconds": single_s,
                     "max_abs_err": gather_floats(err)[0]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 temporal units only")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    meshes = {p: SeqParMesh.from_config({"size": p, "ulysses_degree": 1}) for p in (2, 4) if world % p == 0}
    start, rows = time.perf_counter(), []
    for frames in (16,) if args.quick else (16, 64):
        for kind, build in (("qwen2_vl", qwen_tower), ("siglip", siglip_tower)):
            rows += rows_for(kind, build(), frames, meshes)
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        table = save_results(
            "vision_tower_memory_cpu",
            f"Vision tower on a long video: peak MiB created in one forward + backward (weights excluded) on the "
            f"busiest rank, whole (single process) vs split over P ranks by whole temporal units; fp32, {world} gloo "
            f"ranks, CPU; {seconds:.0f} s",
            {"world": world, "seconds": seconds},
            rows,
            [
                ("tower", "tower", "s"),
                ("units", "frames", "d"),
                ("P", "P", "d"),
                ("whole", "single_MiB", ".1f"),
                ("split (busiest rank)", "peak_MiB", ".1f"),
                ("split / whole", "ratio", ".3f"),
                ("s whole", "single_seconds", ".2f"),
                ("s split", "seconds", ".2f"),
                ("max abs err", "max_abs_err", ".1e"),
            ],
        )
        print(table)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
