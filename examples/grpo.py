"""GRPO with TRL's ``GRPOTrainer`` on long prompts under sequence parallelism: passkey retrieval, reward = exact match.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/grpo.py --ds_config ds_configs/usp_zero3.json

The one change to a TRL script: ``ds_seqpar.with_sequence_parallel(GRPOTrainer)``. Each prompt is a passkey
row of ``--seq-len`` tokens (``ds_seqpar.tasks.passkey``: one of 2 keys repeated 8 times in the first half,
filler words, a ``?`` at the end). The policy samples ``--generations`` completions of 4 words per prompt
(TRL's in-process ``generate`` of the whole model on every rank; the SP group's first rank's completions are
used), and the reward is the fraction of the completion's words equal to the passkey: a verifiable reward.
The log-probs of prompt + completion, policy and loss, run with each sequence split over the SP ranks.

The JSON is the shipped one with two changes made here: its micro batch and accumulation become ``"auto"``
(GRPO's batch is one prompt's group of completions, ``GRPOConfig`` sets it), and ``--lr`` replaces its
optimizer's learning rate (1e-4 moves a random tiny model slowly). The reward of every step is printed.
"""

from __future__ import annotations

import json
import sys

import torch
from common import TINY_LLAMA, example_parser, load_tokenizer, start_distributed, trainer_arguments
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

import ds_seqpar
from ds_seqpar.tasks.passkey import PasskeyTask

NUM_KEYS = 2


def passkey_prompts(tokenizer: object, count: int, seq_len: int, seed: int) -> Dataset:
    """``count`` prompts of ``seq_len`` words ending with ``?``, with their ``passkey`` word."""
    task = PasskeyTask(tokenizer, num_questions=1, num_keys=NUM_KEYS, prefix=8)
    words = {v: w for w, v in tokenizer.get_vocab().items()}
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        sample = task.sample(seq_len, g)
        ids = sample["input_ids"][:-1]  # ends with the "?" question
        key = int(sample["labels"][sample["labels"] >= 0][0])
        rows.append({"prompt": " ".join(words[int(i)] for i in ids), "passkey": words[key]})
    return Dataset.from_list(rows)


def passkey_reward(completions: list[str], passkey: list[str], **_: object) -> list[float]:
    """The fraction of each completion's words that equal its prompt's passkey."""
    return [
        sum(w == key for w in text.split()) / max(1, len(text.split()))
        for text, key in zip(completions, passkey)
    ]


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the mean reward of every step."""
    p = example_parser(__doc__.splitlines()[0], "outputs/example_grpo")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO's group)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the JSON optimizer's)")
    args = p.parse_args(argv)
    start_distributed(args.ds_config)
    with open(args.ds_config, encoding="utf-8") as fh:
        ds_config = json.load(fh)
    if args.lr is not None and "optimizer" in ds_config:
        ds_config["optimizer"]["params"]["lr"] = args.lr
    # GRPO's batches are its own: a step's micro batch is one prompt's group of completions
    ds_config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    tokenizer = load_tokenizer(args.model)
    torch.manual_seed(args.seed)  # a path: TRL loads it; else the shipped tiny Llama, seeded random weights
    model = args.model or AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(TINY_LLAMA), dtype=torch.float32
    )
    config = GRPOConfig(
        **{**trainer_arguments(args), "deepspeed": ds_config},
        per_device_train_batch_size=args.generations,  # one prompt per step and replica, all its completions
        num_generations=args.generations,
        max_completion_length=4,
        temperature=1.0,
        bf16=False,  # the shipped CPU configs train in fp32
    )
    trainer = ds_seqpar.with_sequence_parallel(GRPOTrainer)(  # the one-line change
        model=model,
        reward_funcs=passkey_reward,
        args=config,
        train_dataset=passkey_prompts(tokenizer, 64, args.seq_len, args.seed),
        processing_class=tokenizer,
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if trainer.is_world_process_zero():
        print(f"examples/grpo.py: {len(rewards)} steps, reward {[round(r, 3) for r in rewards]}", flush=True)
    return rewards


if __name__ == "__main__":
    main(sys.argv[1:])
