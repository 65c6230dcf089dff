"""One full training step (forward, backward, optimizer) at a very long sequence, with every memory saving on.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.long_step --model window --seq-len 1048576

Models (random init, fp32, the shipped tiny Llama's sizes: hidden 64, 2 layers, H 4, H_kv 2, vocab 133):
    dense   assets/tiny-llama (Llama, causal attention over the whole sequence)
    window  the same sizes as a Mistral config with ``sliding_window`` = --window (default 4096)

Runs through ``ds_seqpar.initialize`` with ZeRO-3, AdamW and ``sequence_parallel.memory`` all on
(activation checkpointing, offload, tiled MLP and norms), ulysses_degree auto, zigzag. Reports the wall
time of the step, the loss, the peak resident memory of every rank and their sum, and the memory
model's prediction; appends a row to ``benchmarks/results/long_step.json`` and rewrites
``long_step.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, gather_floats

ROOT = Path(__file__).resolve().parents[1]
SAVINGS = {"activation_checkpointing": True, "offload": True, "tiled_mlp": True, "tiled_norms": True}


def model_config(kind: str, window: int) -> object:
    from transformers import AutoConfig, MistralConfig

    base = AutoConfig.from_pretrained(ROOT / "assets" / "tiny-llama")
    if kind == "dense":
        return base
    fields = {k: getattr(base, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                             "pad_token_id", "bos_token_id", "eos_token_id")}  # fmt: skip
    return MistralConfig(**fields, sliding_window=window, max_position_embeddings=1 << 22, head_dim=16)


def _rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["dense", "window"], default="window")
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--no-save", action="store_true", help="print only, write no result files")
    args = parser.parse_args()

    import ds_seqpar
    from ds_seqpar.integrations.deepspeed import init_distributed

    init_distributed()
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    from transformers import AutoModelForCausalLM

    cfg = model_config(args.model, args.window)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    section = {"size": world, "ulysses_degree": "auto", "ring": {"layout": "zigzag"}, "memory": SAVINGS}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
        "sequence_parallel": section,
    }
    engine, _, _, _ = ds_seqpar.initialize(model=model, config=config)
    mesh = engine.seqpar_mesh
    estimate = ds_seqpar.memory_estimate(cfg, args.seq_len, mesh.settings, world_size=world)
    ids = torch.randint(4, cfg.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = ds_seqpar.shard_batch({"input_ids": ids}, mesh)
    del ids
    if rank == 0:
        print(f"long step: {args.model}, S={args.seq_len}, {mesh.describe()}; predicted per rank:\n{estimate.table()}",
              flush=True)  # fmt: skip
    dist.barrier()
    start = time.perf_counter()
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    peaks = gather_floats(_rss_peak_mib())
    row = {
        "model": args.model,
        "window": args.window if args.model == "window" else None,
        "S": args.seq_len,
        "P": world,
        "mesh": f"U {mesh.ulysses_size} x R {mesh.ring_size}",
        "loss": float(loss.detach()),
        "step_s": seconds.item(),
        "peak_rss_MiB_per_rank": peaks,
        "peak_rss_GiB_all_ranks": sum(peaks) / 1024,
        "predicted_device_peak_MiB_per_rank": estimate.device_peak / 2**20,
        "predicted_host_MiB_per_rank": estimate.host_bytes / 2**20,
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if rank == 0:
        print(json.dumps(row, indent=1), flush=True)
        if not args.no_save:
            _save(row)
    dist.barrier()


def _save(row: dict) -> None:
    path = RESULTS / "long_step.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [r for r in rows if (r["model"], r["S"], r["P"]) != (row["model"], row["S"], row["P"])] + [row]
    path.write_text(json.dumps(rows, indent=1))
    lines = [
        "One full training step (forward, backward, AdamW) with every memory saving on, ZeRO-3, fp32, on the "
        "2-core reference machine (`python -m benchmarks.long_step`). Peak RSS is the resident high-water mark "
        "of each rank process (model, DeepSpeed, Python and the step).",
        "",
        "| model | S | P | mesh | step time | loss | peak RSS per rank (max) | peak RSS, all ranks | predicted per rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["model"] + (f" (window {r['window']})" if r["window"] else "")
        lines.append(
            f"| {name} | {r['S']:,} | {r['P']} | {r['mesh']} | {r['step_s']:.0f} s | {r['loss']:.3f} | "
            f"{max(r['peak_rss_MiB_per_rank']):.0f} MiB | {r['peak_rss_GiB_all_ranks']:.2f} GiB | "
            f"{r['predicted_device_peak_MiB_per_rank']:.0f} MiB |"
        )
    (RESULTS / "long_step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
