"""``train.py --eval-generate``: the passkey task evaluated by generation at the training length (docs/train.md,
"Passkey accuracy by generation").

For each held-out row of the teacher-forced evaluation (``--eval-samples`` rows at ``--seq-len``) the prompt is
the row up to and including its first question token ``?``; ``ds_seqpar.generate`` decodes one token greedily
over the SP group, from the trained engine's module (under ZeRO-3 DeepSpeed's hooks gather each module's
parameters as it runs), and the token is compared to the passkey. The rows are split over the dp replicas
(each row counted once; a replica with fewer rows runs its last row again, uncounted, so every rank runs the
same modules: ZeRO-3's gathers span every rank) and the counts are summed over them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["add_eval_generate_flag", "check_eval_generate", "generate_accuracy"]


def add_eval_generate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eval-generate",
        action="store_true",
        help="at every evaluation also answer the embedded passkey task by generation: each held-out row up to its "
        "first '?' is the prompt, one token is decoded greedily over the SP group and compared to the passkey "
        "(metrics.jsonl generate_accuracy)",
    )


def check_eval_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--eval-generate`` needs the embedded passkey task, a causal LM and every SP rank in one group."""
    if not args.eval_generate:
        return
    if args.data is not None:
        parser.error(
            "--eval-generate answers the embedded passkey task's questions; with --data there is no passkey to "
            "compare: drop --eval-generate (--eval-data gives a held-out loss)"
        )
    if args.objective != "causal":
        parser.error(f"--eval-generate decodes with a causal LM; --objective {args.objective} has none")
    if args.settings.dynamic_degree:
        parser.error(
            "--eval-generate: sequence_parallel.dynamic_degree=true runs batches on groups of ranks, decoding merges "
            "over the whole SP group: drop --eval-generate or switch dynamic_degree off"
        )


def _prompts(dataset: Any, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts [b, q + 1]`` (each row up to its first question) and ``answers [b]`` (the passkeys)."""
    question = dataset.task.question
    rows = [dataset[i] for i in indices]
    first = [int(torch.nonzero(r["input_ids"] == question)[0]) for r in rows]
    if len(set(first)) != 1:
        raise ValueError(f"passkey rows ask their first question at different places {sorted(set(first))}")
    q = first[0]
    prompts = torch.stack([r["input_ids"][: q + 1] for r in rows])
    answers = torch.stack(
        [r["labels"][q + 1] for r in rows]
    )  # labels are next-token aligned (tasks/passkey.py)
    return prompts, answers


def generate_accuracy(engine: Any, dataset: Any, mesh: Any, rows_per_call: int) -> dict[str, float]:
    """Fraction of ``dataset``'s rows whose first question, answered by greedy generation, gives the passkey;
    the same on every rank. The engine is back in train mode after."""
    from ds_seqpar.integrations.generation import generate

    dp, rank = mesh.dp_size, mesh.coords.dp_rank
    mine = list(range(rank, len(dataset), dp))
    runs = -(-len(dataset) // dp)  # every replica runs as many rows
    counted = [True] * len(mine) + [False] * (runs - len(mine))
    mine += [mine[-1] if mine else 0] * (runs - len(mine))
    device = engine.device
    correct = torch.zeros(2, dtype=torch.float64, device=device)  # correct, counted
    t0 = time.perf_counter()
    engine.eval()
    try:
        for start in range(0, runs, rows_per_call):
            prompts, answers = _prompts(dataset, mine[start : start + rows_per_call])
            out = generate(engine, prompts.to(device), max_new_tokens=1, do_sample=False)
            hits = out.sequences[:, -1].cpu() == answers
            keep = torch.tensor(counted[start : start + rows_per_call])
            correct += torch.tensor([float((hits & keep).sum()), float(keep.sum())], device=device)
    finally:
        engine.train()
    if dp > 1:
        dist.all_reduce(correct, group=mesh.group("dp"))
    return {
        "generate_accuracy": float(correct[0] / correct[1]),
        "generate_samples": int(correct[1]),
        "generate_time_s": time.perf_counter() - t0,
    }
