"""DPO with TRL's ``DPOTrainer`` on long prompts under sequence parallelism.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/dpo.py --ds_config ds_configs/usp_zero3.json

The one change to a TRL script: ``ds_seqpar.with_sequence_parallel(DPOTrainer)``. Each pair is a passkey row
of ``--seq-len`` tokens ending with ``?`` (``ds_seqpar.tasks.passkey``), the passkey as the chosen answer and
another key as the rejected one. The policy's and the reference model's log-probs of both completions run
with each sequence split over the SP ranks; TRL's sigmoid loss then runs unchanged on every rank. The loss
and the reward accuracy (chosen scored above rejected) of every step are printed.
"""

from __future__ import annotations

import sys

import torch
from common import TINY_LLAMA, example_parser, load_tokenizer, start_distributed, trainer_arguments
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer

import ds_seqpar
from ds_seqpar.tasks.passkey import PasskeyTask

NUM_KEYS = 4


def passkey_pairs(tokenizer: object, count: int, seq_len: int, seed: int) -> Dataset:
    """``count`` rows: a passkey prompt of ``seq_len`` words, the passkey (chosen) and another key (rejected)."""
    task = PasskeyTask(tokenizer, num_questions=1, num_keys=NUM_KEYS, prefix=8)
    words = {v: w for w, v in tokenizer.get_vocab().items()}
    g = torch.Generator().manual_seed(seed)
    keys = task.keys.tolist()
    rows = []
    for _ in range(count):
        sample = task.sample(seq_len, g)
        key = int(sample["labels"][sample["labels"] >= 0][0])
        other = keys[(keys.index(key) + 1) % len(keys)]
        prompt = " ".join(words[int(i)] for i in sample["input_ids"][:-1])
        rows.append({"prompt": prompt, "chosen": " " + words[key], "rejected": " " + words[other]})
    return Dataset.from_list(rows)


def tiny_llama(seed: int) -> torch.nn.Module:
    """The shipped tiny Llama with seeded random weights."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA), dtype=torch.float32)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the loss of every step."""
    args = example_parser(__doc__.splitlines()[0], "outputs/example_dpo").parse_args(argv)
    start_distributed(args.ds_config)
    tokenizer = load_tokenizer(args.model)
    # a path: TRL loads the policy and the reference from it; else two equal seeded random models
    model = args.model or tiny_llama(args.seed)
    ref_model = None if args.model else tiny_llama(args.seed)
    config = DPOConfig(**trainer_arguments(args), max_length=args.seq_len + 8, bf16=False)
    trainer = ds_seqpar.with_sequence_parallel(DPOTrainer)(  # the one-line change
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=passkey_pairs(tokenizer, 64, args.seq_len, args.seed),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logs]
    if trainer.is_world_process_zero():
        accuracy = [round(h.get("rewards/accuracies", float("nan")), 3) for h in logs]
        print(
            f"examples/dpo.py: {len(losses)} steps, losses {[round(x, 4) for x in losses]}, "
            f"reward accuracy {accuracy}",
            flush=True,
        )
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
