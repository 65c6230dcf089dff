"""The DeepSpeed dict ``ds_seqpar.verify`` runs the sequence-parallel side with: the user's config, with only
what would make the two runs take different steps (or need compiled ops) replaced, each change noted.

Kept: the ``sequence_parallel`` section as written (memory savings included), the ZeRO stage and its
partitioning, ``gradient_clipping`` (the reference clips by the same rule; when the key is absent,
DeepSpeed's default of 1.0 is written in). Replaced: the optimizer and scheduler (both runs take the same
plain SGD step), half precision (both run in float32), the batch (one sequence per data-parallel group per
step), ZeRO offload, monitors and print cadence.
"""

from __future__ import annotations

import copy
from typing import Any

from ds_seqpar.config import SECTION

__all__ = ["comparison_config"]

_DROPPED = {
    "optimizer": "both runs take the same SGD step at --lr",
    "scheduler": "the learning rate stays --lr",
    "train_batch_size": "one sequence per data-parallel group per step",
    "tensorboard": "no monitor",
    "csv_monitor": "no monitor",
    "wandb": "no monitor",
    "comet": "no monitor",
    "flops_profiler": "no profiler",
}
_HALF = ("fp16", "bf16", "amp")
_OFFLOAD = ("offload_optimizer", "offload_param")


def _deepspeed_clipping_default() -> float:
    """DeepSpeed's ``gradient_clipping`` when the key is absent (1.0 in 0.19.8, not 0)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT)


def comparison_config(ds_config: dict[str, Any], section: Any, path: str) -> tuple[dict[str, Any], list[str]]:
    """``(DeepSpeed dict for ds_seqpar.initialize, notes)`` from ``load_config``'s dict (without the section)
    and the validated ``section``; a note names each key of ``path`` that was changed and why."""
    out, notes = copy.deepcopy(ds_config), []
    for key, why in _DROPPED.items():
        if key in out:
            out.pop(key)
            notes.append(f"{path}: '{key}' ignored ({why})")
    for key in _HALF:
        if isinstance(out.get(key), dict) and out[key].get("enabled", False):
            notes.append(f"{path}: '{key}' disabled (both runs compare in float32)")
        out.pop(key, None)
    for key, value in (("train_micro_batch_size_per_gpu", 1), ("gradient_accumulation_steps", 1)):
        if out.get(key, value) != value:
            notes.append(f"{path}: '{key}'={out[key]!r} set to {value} (one sequence per step)")
        out[key] = value
    zero = dict(out.get("zero_optimization") or {})
    for key in _OFFLOAD:
        if key in zero:
            zero.pop(key)
            notes.append(f"{path}: 'zero_optimization.{key}' ignored (no offload; the partitioning is kept)")
    out["zero_optimization"] = zero
    out.update(zero_allow_untested_optimizer=True, steps_per_print=10**9, wall_clock_breakdown=False)
    out.setdefault("gradient_clipping", _deepspeed_clipping_default())  # what DeepSpeed would clip at
    out[SECTION] = section.model_dump(exclude_unset=True)
    return out, notes
