"""What the example scripts share: flags, the model, the tokenizer and a small training set.

Every example runs as it is on CPU (gloo ranks) and on GPUs: ``--model PATH`` loads a HF checkpoint
with ``from_pretrained``; without it the shipped tiny Llama (``assets/tiny-llama``: config and
tokenizer, no weights) is built with seeded random weights. The data is the embedded passkey task
(``ds_seqpar.tasks.passkey``), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ds_seqpar.tasks.passkey import PasskeyDataset, PasskeyTask

REPO = Path(__file__).resolve().parents[1]
TINY_LLAMA = REPO / "assets" / "tiny-llama"
DEFAULT_CONFIG = REPO / "ds_configs" / "usp_zero3.json"


def example_parser(description: str, output_dir: str) -> argparse.ArgumentParser:
    """The flags every example takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--ds_config", "--deepspeed", default=str(DEFAULT_CONFIG), help="DeepSpeed JSON, used unmodified"
    )
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the shipped tiny Llama, random init)"
    )
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--output-dir", default=output_dir)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--local_rank", type=int, default=-1, help=argparse.SUPPRESS
    )  # set by the DeepSpeed launcher
    return p


def load_tokenizer(path: str | None) -> object:
    return AutoTokenizer.from_pretrained(path or TINY_LLAMA)


def load_model(path: str | None, seed: int) -> torch.nn.Module:
    """``from_pretrained(path)``, or the shipped tiny Llama with random weights (seeded)."""
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA), dtype=torch.float32)


def passkey_dataset(tokenizer: object, seq_len: int, seed: int, num_samples: int = 64) -> PasskeyDataset:
    """``num_samples`` passkey rows of ``seq_len`` tokens (``input_ids``, ``labels``)."""
    return PasskeyDataset(PasskeyTask(tokenizer, num_questions=16), num_samples, seq_len, seed=seed)


def report_losses(script: str, losses: list[float], main_process: bool) -> list[float]:
    """Print the run's losses once (on the main process) and return them."""
    if main_process:
        print(f"examples/{script}: {len(losses)} steps, losses {[round(x, 4) for x in losses]}", flush=True)
    return losses


def trainer_arguments(args: argparse.Namespace) -> dict[str, object]:
    """``TrainingArguments`` (or TRL ``SFTConfig``) keywords of a short example run with the JSON as it is."""
    return {
        "output_dir": args.output_dir,
        "deepspeed": args.ds_config,  # the shipped JSON, unmodified
        "max_steps": args.max_steps,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": args.seed,
        "use_cpu": not torch.cuda.is_available(),
        "disable_tqdm": True,
    }


def start_distributed(config_path: str, parallelism_config: object = None) -> None:
    """torch.distributed for the run (gloo on CPU, NCCL on GPU), with the config's ``fault_timeout_s``.

    On CPU it must exist before ``TrainingArguments`` / ``Accelerator`` are created, which would
    otherwise start a process group of their own (with their own timeout). ``parallelism_config``: HF's
    ``ParallelismConfig``, which may state the section's size.
    """
    import json

    import ds_seqpar
    from ds_seqpar.integrations.deepspeed import init_distributed
    from ds_seqpar.integrations.parallelism_config import section_with_parallelism

    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    if "sequence_parallel" in config:
        config["sequence_parallel"] = section_with_parallelism(
            config["sequence_parallel"], parallelism_config
        )
    init_distributed(ds_seqpar.load_config(config)[0].fault_timeout_s)
