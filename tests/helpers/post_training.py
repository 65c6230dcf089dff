"""TRL's GRPO and DPO trainers, with and without sequence parallelism, on a tiny Llama saved to disk (shared by
``tests/test_post_training.py``): the same data, fixed completions (a rollout function, so sampling is out of
the comparison) and SGD at learning rate 1, so a step's parameter change is minus the gradient."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA = Path(__file__).resolve().parents[2] / "assets" / "tiny-llama"
WORDS = [f"f{i}" for i in range(1, 60)]


def save_tiny_model(path: Path) -> str:
    """The shipped tiny Llama with seeded random weights and its tokenizer, saved to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
    return str(path)


def _text(n: int, g: torch.Generator) -> str:
    return " ".join(WORDS[j] for j in torch.randint(len(WORDS), (n,), generator=g).tolist())


def prompts(count: int) -> Any:
    """``count`` prompts of 50 to 170 words (rows of different lengths: left padding in GRPO's batches)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    return Dataset.from_list([{"prompt": _text(50 + 17 * (i % 8), g)} for i in range(count)])


def preference_pairs(count: int) -> Any:
    """``count`` (prompt, chosen, rejected) rows with completions of different lengths (right padding)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "prompt": _text(60 + 10 * (i % 8), g),
            "chosen": " " + _text(3 + i % 4, g),
            "rejected": " " + _text(2 + i % 3, g),
        }
        for i in range(count)
    ]
    return Dataset.from_list(rows)


def fixed_rollout(batch_prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Completions that depend only on the prompt and how many times it came before in the batch (its
    generation index: the same on one process and on the dp replicas), 3 to 11 tokens."""
    tok = trainer.processing_class
    completion_ids = []
    for i, prompt in enumerate(batch_prompts):
        h = zlib.crc32(f"{prompt}|{batch_prompts[:i].count(prompt)}".encode())
        completion_ids.append([5 + (h >> (2 * k)) % (len(tok) - 10) for k in range(3 + h % 9)])
    return {
        "prompt_ids": [tok(p)["input_ids"] for p in batch_prompts],
        "completion_ids": completion_ids,
        "logprobs": None,
    }


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """A deterministic reward of the completion text."""
    return [float(len(c) % 5) - 0.3 * c.count("1") for c in completions]


def sp_config(sp: int, u: int, stage: int) -> dict[str, Any]:
    """The DeepSpeed config of the SP runs: every value the Trainer owns is "auto"."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "sequence_parallel": {"size": sp, "ulysses_degree": u, "ring": {"layout": "zigzag"}},
    }


def run_post_training(
    kind: str,
    model_dir: str,
    out_dir: str,
    *,
    sp: int | None,
    u: int = 2,
    stage: int = 3,
    loss_type: str = "grpo",
    beta: float = 0.0,
    steps: int = 1,
    per_device: int = 4,
    lora: bool = False,
    evaluate: bool = False,
) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    """``steps`` SGD steps (learning rate 1) of TRL's ``kind`` ("grpo" / "dpo") trainer, under sequence parallelism
    of degree ``sp`` (ZeRO ``stage``) or plain (``sp=None``); returns the logged losses (and for GRPO its reward
    and entropy) and each parameter's change over the steps (gathered under ZeRO-3). ``lora``: a new LoRA adapter on the
    attention projections trains (the reference model is the policy with its adapters disabled); ``evaluate``: TRL's
    ``trainer.evaluate`` on 8 more prompts (pairs) after training, its metrics appended to the logs."""
    import deepspeed
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    import ds_seqpar

    tok = AutoTokenizer.from_pretrained(model_dir)
    common = dict(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=per_device, max_steps=steps,
        learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        report_to=[], logging_steps=1, bf16=False, save_strategy="no", beta=beta, seed=0, gradient_checkpointing=False,
    )  # fmt: skip
    if sp is not None:
        common["deepspeed"] = sp_config(sp, min(u, sp), stage)
    if kind == "grpo":
        args = GRPOConfig(**common, loss_type=loss_type, num_generations=4, max_completion_length=12)
        extra = dict(reward_funcs=length_reward, rollout_func=fixed_rollout, train_dataset=prompts(16))
        base = GRPOTrainer
    else:
        args = DPOConfig(**common, loss_type=[loss_type], max_length=256)
        extra = dict(train_dataset=preference_pairs(16))
        base = DPOTrainer
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    cls = base if sp is None else ds_seqpar.with_sequence_parallel(base)
    torch.manual_seed(0)  # the same LoRA init on both sides
    trainer = cls(model=model_dir, args=args, processing_class=tok, **extra)

    def parameters() -> list[torch.Tensor]:
        model = trainer.model_wrapped if sp is not None else trainer.model
        params = list(getattr(model, "module", model).parameters())
        with deepspeed.zero.GatheredParameters(params) if sp is not None and stage == 3 else torch.no_grad():
            return [p.detach().clone() for p in params]

    before = parameters()
    trainer.train()
    keys = ("loss", "reward", "entropy")
    logs = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
    if evaluate:  # TRL's own evaluation (GRPO: completions of the eval prompts, their loss and reward)
        data = prompts(8) if kind == "grpo" else preference_pairs(8)
        metrics = trainer.evaluate(eval_dataset=data)
        logs.append(
            {k: v for k, v in metrics.items() if k in ("eval_loss", "eval_reward", "eval_rewards/accuracies")}
        )
    return logs, [after - start for after, start in zip(parameters(), before, strict=True)]
