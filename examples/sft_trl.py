"""Supervised fine-tuning with TRL's ``SFTTrainer`` and packed documents, under sequence parallelism.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/sft_trl.py --ds_config ds_configs/usp_zero3.json

The one change to a TRL script: ``ds_seqpar.with_sequence_parallel(SFTTrainer)`` instead of
``SFTTrainer``. ``packing=True`` works: TRL's packed (padding-free) rows carry ``position_ids`` that
restart at every document, which ds_seqpar turns into document ids, so no token attends across a
document boundary on any rank. (TRL's own context-parallel path refuses packing because it drops
the block-diagonal mask.)
"""

from __future__ import annotations

import sys

import torch
from common import (
    example_parser,
    load_model,
    load_tokenizer,
    report_losses,
    start_distributed,
    trainer_arguments,
)
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

import ds_seqpar


def documents(tokenizer: object, count: int, seed: int) -> Dataset:
    """``count`` text documents of 40-400 words of the shipped tokenizer's vocabulary."""
    words = [w for w in tokenizer.get_vocab() if w[:1] in "fk" and w[1:].isdigit()]
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(count):
        n = int(torch.randint(40, 400, (1,), generator=g))
        texts.append(" ".join(words[i] for i in torch.randint(len(words), (n,), generator=g).tolist()))
    return Dataset.from_dict({"text": texts})


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the logged loss of every step."""
    args = example_parser(__doc__.splitlines()[0], "outputs/example_sft_trl").parse_args(argv)
    start_distributed(args.ds_config)  # before TrainingArguments / Accelerator; the launcher's environment
    tokenizer = load_tokenizer(args.model)
    config = SFTConfig(
        **trainer_arguments(args),
        packing=True,  # several documents per row of max_length tokens
        max_length=args.seq_len,
        bf16=False,  # SFTConfig defaults to bf16; the shipped CPU configs train in fp32 ("bf16": {"enabled": false})
    )
    trainer = ds_seqpar.with_sequence_parallel(SFTTrainer)(  # the one-line change
        model=load_model(args.model, args.seed),
        args=config,
        train_dataset=documents(tokenizer, 64, args.seed),
        processing_class=tokenizer,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return report_losses("sft_trl.py", losses, trainer.is_world_process_zero())


if __name__ == "__main__":
    main(sys.argv[1:])
