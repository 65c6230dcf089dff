"""``train.py``'s training health: a run that diverges, or trains on nothing, stops by name.

After every step ``StepHealth.reduce`` takes three facts of this rank: the loss is non-finite,
the SP group's batch had no labelled token, DeepSpeed skipped the optimizer step (its loss-scale or
overflow check: ``engine.skipped_steps`` grew). One all-reduce (MAX over the world, three numbers)
makes the verdict the same on every rank, so every rank raises together in ``judge`` (nothing hangs):

* a batch with no labelled token raises ``NoLabelsError`` at once (a loss of 0.0 that looks perfect);
* ``--max-bad-steps`` consecutive bad steps (non-finite loss or skipped step) raise
  ``TrainingDiverged``; a run that ends inside a bad streak raises too, before the final save and the
  export. A checkpoint is saved only after a healthy step (``healthy``), so no save holds a state
  whose loss was non-finite.

``finite_row`` makes a metrics row valid JSON: non-finite numbers become the strings ``"nan"``,
``"inf"``, ``"-inf"``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.errors import SeqParConfigError

__all__ = ["NoLabelsError", "StepHealth", "TrainingDiverged", "finite_row"]


class TrainingDiverged(SeqParConfigError):
    """Consecutive steps had a non-finite loss or were skipped by DeepSpeed; nothing bad was saved."""


class NoLabelsError(SeqParConfigError):
    """A training batch had no labelled token: its loss would be 0.0 and train nothing."""


class StepHealth:
    """The run's health over steps (module docstring).

    Args:
        max_bad_steps: consecutive bad steps that stop the run (``--max-bad-steps``).
        lr: the run's learning rate, named in the message.
    """

    def __init__(self, max_bad_steps: int, lr: float | None) -> None:
        self.max_bad_steps = max_bad_steps
        self.lr = lr
        self.streak: list[tuple[int, str]] = []
        self.last_good = 0

    @property
    def healthy(self) -> bool:
        """The last step was good (a checkpoint of it may be saved)."""
        return not self.streak

    def reduce(self, loss: float, num_tokens: float, skipped: bool) -> tuple[bool, bool, bool]:
        """``(non-finite loss, no labelled token, skipped)`` of any rank: one all-reduce (MAX) over the world."""
        flags = torch.tensor([float(not math.isfinite(loss)), float(num_tokens == 0), float(skipped)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                flags = flags.cuda()
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite, empty, was_skipped = (bool(f) for f in flags.tolist())
        return nonfinite, empty, was_skipped

    def judge(self, step: int, verdict: tuple[bool, bool, bool], seq_len: int) -> None:
        """Judge step ``step`` from ``reduce``'s verdict (module docstring); raises on every rank alike."""
        nonfinite, empty, was_skipped = verdict
        if empty:
            raise NoLabelsError(
                f"step {step}: the batch has no labelled token (every label is -100), so its loss is 0.0 and it "
                f"trains nothing (--seq-len {seq_len}: a causal LM needs >= 2 tokens of text per row; blank "
                "documents or fully masked labels give the same): fix the data or --seq-len"
            )
        if not (nonfinite or was_skipped):
            self.streak, self.last_good = [], step
            return
        self.streak.append((step, "non-finite loss" if nonfinite else "step skipped by DeepSpeed (overflow)"))
        if len(self.streak) >= self.max_bad_steps:
            raise self.diverged()

    def diverged(self) -> TrainingDiverged:
        """The error for the current bad streak."""
        steps = ", ".join(f"{s} ({why})" for s, why in self.streak)
        lr = f" (now {self.lr:g})" if self.lr is not None else ""
        return TrainingDiverged(
            f"training diverged: {len(self.streak)} consecutive bad steps: {steps}; stopped without saving or "
            f"exporting them (the last good step is {self.last_good}). Lower --lr{lr}, check the data, or raise "
            f"--max-bad-steps (now {self.max_bad_steps}) if the loss scale needs more steps to settle"
        )

    def check_eval(self, step: int, metrics: dict[str, float]) -> None:
        """A non-finite evaluation loss stops the run like a bad streak (before any save or export)."""
        if not math.isfinite(metrics["eval_loss"]):
            self.streak.append((step, f"eval loss {metrics['eval_loss']}"))
            raise self.diverged()


def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every non-finite float as a string (``json.dumps`` would write bare NaN)."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
