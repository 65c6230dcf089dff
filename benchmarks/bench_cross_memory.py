"""Cross-attention of an encoder-decoder under SP on CPU gloo ranks: kept bytes, peak, time and bytes sent.

Run with PyTorch's launcher (one process per rank)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.bench_cross_memory [--quick]

A Whisper decoder (E = 256, 4 heads, random init) on 512 tokens cross-attends to S_kv = 16384 encoder
states, sharded over 4 ranks (m = 4096 each, given as ``encoder_hidden_states``), batch 1, fp32, through
``ds_seqpar.SeqParSeq2SeqLM``. Per decoder depth L, cross schedule and ``recompute_cross_kv``:
bytes alive after the forward (what autograd keeps for backward: ``ds_seqpar.memory.trace.LiveBytes``),
the peak of the step's live bytes, the median fwd+bwd time of the slowest rank, and the bytes one rank
sends per step. Prints a markdown table on rank 0 and saves ``benchmarks/results/cross_memory_cpu.{json,md}``.
Exactness is the tests' job (``tests/test_seq2seq.py``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.common import gather_floats, save_results, slowest_rank_median
from ds_seqpar import SeqParMesh, SeqParSeq2SeqLM, shard_batch, shard_encoder_states
from ds_seqpar.memory.trace import LiveBytes

WIDTH, HEADS, TOKENS, FRAMES = 256, 4, 512, 16384


def whisper(layers: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=512, d_model=WIDTH, encoder_layers=1, decoder_layers=layers, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=4 * WIDTH, decoder_ffn_dim=4 * WIDTH, num_mel_bins=8,
        max_source_positions=FRAMES, max_target_positions=TOKENS, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(cfg).float()
    model.set_attn_implementation("sdpa")
    return model


def measure(mesh: SeqParMesh, layers: int, schedule: str, recompute: bool, reps: int) -> dict:
    sp = SeqParSeq2SeqLM(whisper(layers), mesh, cross_schedule=schedule, recompute_cross_kv=recompute)
    g = torch.Generator().manual_seed(1)
    batch = shard_batch({"input_ids": torch.randint(3, 512, (1, TOKENS), generator=g)}, mesh)
    states, _ = shard_encoder_states(torch.randn(1, FRAMES, WIDTH, generator=g), mesh)
    states.requires_grad_()

    def step() -> None:
        with mesh.comm_stats.measure() as region:
            loss = sp(**batch, encoder_hidden_states=states)
            loss.backward()
        step.region = region

    with LiveBytes() as live:
        loss = sp(**batch, encoder_hidden_states=states)
        kept = live.current
        loss.backward()
    seconds = slowest_rank_median(step, reps)
    sent = max(gather_floats(step.region.total_bytes))
    return {
        "layers": layers,
        "schedule": schedule,
        "recompute": recompute,
        "kept_MiB": max(gather_floats(kept)) / 2**20,
        "peak_MiB": max(gather_floats(live.peak)) / 2**20,
        "kv_MiB_per_layer": 2 * states.numel() * 4 / 2**20,
        "time_s": seconds,
        "sent_MiB": sent / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 4 only, 1 repetition")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = SeqParMesh.from_config({"size": world, "ulysses_degree": 1})
    depths = (2, 4) if args.quick else (2, 4, 8)
    reps = 1 if args.quick else 3
    rows = [measure(mesh, n, "rotate_q", r, reps) for n in depths for r in (False, True)]
    rows += [measure(mesh, 4, "rotate_kv", r, reps) for r in (False, True)]
    if dist.get_rank() == 0:
        table = save_results(
            "cross_memory_cpu",
            f"Cross-attention under SP: {world} gloo ranks, Whisper decoder E={WIDTH}, {TOKENS} tokens, "
            f"S_kv={FRAMES} encoder states (m={FRAMES // world} per rank), batch 1, fp32",
            {"world": world, "width": WIDTH, "heads": HEADS, "tokens": TOKENS, "frames": FRAMES},
            rows,
            [
                ("decoder layers", "layers", "d"),
                ("schedule", "schedule", "s"),
                ("recompute K/V", "recompute", ""),
                ("kept after forward (MiB)", "kept_MiB", ".1f"),
                ("peak (MiB)", "peak_MiB", ".1f"),
                ("one layer's K+V (MiB)", "kv_MiB_per_layer", ".1f"),
                ("fwd+bwd (s)", "time_s", ".3f"),
                ("sent per step (MiB)", "sent_MiB", ".2f"),
            ],
        )
        print(table, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
