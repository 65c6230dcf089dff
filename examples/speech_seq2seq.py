"""An encoder-decoder (Whisper) trained under sequence parallelism: the decoder cross-attends to sharded
encoder states with ``ds_seqpar.initialize`` and your own loop.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/speech_seq2seq.py --ds_config ds_configs/usp_zero3.json

``ds_seqpar.initialize`` wraps an encoder-decoder in ``SeqParSeq2SeqLM``: the decoder tokens are sharded
like a causal LM's (``shard_batch``), ``input_features`` go to every rank whole (each runs the encoder and
keeps its contiguous 1/P of the encoder states), and every cross-attention layer runs through
``ds_seqpar.cross_attention`` (here the queries rotate: 256 decoder tokens against 2048 encoder states).
The model is a tiny random-init Whisper built from a config (``--model`` loads one with
``from_pretrained``); the data is synthetic: ``input_features`` of noise and token transcripts.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from common import example_parser, report_losses
from transformers import WhisperConfig, WhisperForConditionalGeneration

import ds_seqpar

VOCAB, FRAMES, MEL_BINS = 256, 2048, 8


def tiny_whisper(seed: int) -> WhisperForConditionalGeneration:
    """2 encoder + 2 decoder layers, d_model 64, 4 heads, 2048 encoder states (4096 feature frames)."""
    config = WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=MEL_BINS,
        max_source_positions=FRAMES, max_target_positions=4096, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return WhisperForConditionalGeneration(config).float()


def main(argv: list[str] | None = None) -> list[float]:
    """Train ``--max-steps`` steps; returns the loss of every step."""
    parser = example_parser(__doc__.splitlines()[0], "outputs/example_speech")
    parser.set_defaults(seq_len=256)
    args = parser.parse_args(argv)
    model = (
        WhisperForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32)
        if args.model
        else tiny_whisper(args.seed)
    )
    engine, _, _, _ = ds_seqpar.initialize(model=model, config=args.ds_config)
    mesh = engine.seqpar_mesh
    frames = 2 * model.config.max_source_positions
    g = torch.Generator().manual_seed(args.seed + mesh.coords.dp_rank)  # the same batches on every SP rank
    losses: list[float] = []
    for step in range(args.max_steps):
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq_len), generator=g)
        features = torch.randn(1, model.config.num_mel_bins, frames, generator=g)
        batch = ds_seqpar.shard_batch({"input_ids": ids}, mesh)  # this rank's decoder tokens
        with mesh.comm_stats.measure() as comm:
            loss = engine(**batch, input_features=features)  # the SP group's token-mean loss
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(
                f"step {step + 1}: loss {loss.item():.4f}, {comm.total_bytes / 2**20:.2f} MiB sent",
                flush=True,
            )
    return report_losses("speech_seq2seq.py", losses, dist.get_rank() == 0)


if __name__ == "__main__":
    main(sys.argv[1:])
