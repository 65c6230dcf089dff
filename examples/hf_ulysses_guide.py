"""A Trainer script in the form of HF's Ulysses guide, run by ds_seqpar: ``SeqParTrainer`` is the one change.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/hf_ulysses_guide.py --ds_config ds_configs/usp_zero3.json

HF's guide (transformers' "Ulysses sequence parallelism") configures SP with accelerate's
``ParallelismConfig(sp_backend="deepspeed", sp_size=4, ...)`` on ``TrainingArguments``. Here the same
arguments go with a DeepSpeed JSON that has a ``"sequence_parallel"`` section: ``sp_size`` states the SP
size (the section's ``size`` must agree, or be ``"auto"`` / absent), the section chooses the algorithm
(Ulysses x ring, layout, kernel), and DeepSpeed's ALST Ulysses is not run. ``sp_attn_implementation="sdpa"``
selects the section's SDPA kernel (the guide's ``"flash_attention_2"`` selects ``flash_attn`` on GPUs).
"""

from __future__ import annotations

import sys

import torch
from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
from common import (
    example_parser,
    load_model,
    load_tokenizer,
    passkey_dataset,
    report_losses,
    start_distributed,
)
from transformers import TrainingArguments

import ds_seqpar


def build(argv: list[str] | None = None) -> ds_seqpar.SeqParTrainer:
    """The guide's arguments and trainer, ready to train."""
    parser = example_parser(__doc__.splitlines()[0], "outputs/example_hf_ulysses_guide")
    parser.add_argument("--sp-size", type=int, default=4)
    args = parser.parse_args(argv)
    # the guide's configuration, unchanged
    parallelism_config = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=args.sp_size,
        dp_replicate_size=1,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True,
            sp_attn_implementation="sdpa",
        ),
    )
    start_distributed(args.ds_config, parallelism_config)  # on CPU: gloo before TrainingArguments (common.py)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, args.seed)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.ds_config,  # + the "sequence_parallel" section
        parallelism_config=parallelism_config,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    return ds_seqpar.SeqParTrainer(  # the one change: the guide's transformers.Trainer
        model=model, args=training_args, train_dataset=passkey_dataset(tokenizer, args.seq_len, args.seed)
    )


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the logged loss of every step."""
    trainer = build(argv)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return report_losses("hf_ulysses_guide.py", losses, trainer.is_world_process_zero())


if __name__ == "__main__":
    main(sys.argv[1:])
