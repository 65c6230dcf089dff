"""Fine-tune a causal LM with the HF Trainer under sequence parallelism: ``SeqParTrainer`` is the one change.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/trainer.py --ds_config ds_configs/usp_zero3.json
    .venv/bin/deepspeed --num_gpus 4 examples/trainer.py --ds_config ds_configs/usp_zero3.json

The DeepSpeed JSON is used unmodified: ``SeqParTrainer`` resolves the ``sequence_parallel`` section
(its ``"auto"`` values included) before transformers and accelerate see the config, and the
optimizer values the JSON sets explicitly are adopted by ``TrainingArguments`` where those are left
at their defaults (a notice says which); values set differently on both sides are an error.
"""

from __future__ import annotations

import sys

from common import (
    example_parser,
    load_model,
    load_tokenizer,
    passkey_dataset,
    report_losses,
    start_distributed,
    trainer_arguments,
)
from transformers import TrainingArguments

import ds_seqpar


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the logged loss of every step."""
    args = example_parser(__doc__.splitlines()[0], "outputs/example_trainer").parse_args(argv)
    start_distributed(args.ds_config)  # before TrainingArguments / Accelerator; the launcher's environment
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.seed)
    training_args = TrainingArguments(**trainer_arguments(args))
    trainer = ds_seqpar.SeqParTrainer(
        model=model, args=training_args, train_dataset=passkey_dataset(tokenizer, args.seq_len, args.seed)
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return report_losses("trainer.py", losses, trainer.is_world_process_zero())


if __name__ == "__main__":
    main(sys.argv[1:])
