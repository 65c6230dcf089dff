"""``train.py``'s evaluation: every held-out sample counted once, over every data-parallel replica.

The held-out set is split over the dp replicas (``seqpar_dataloader``'s sampler). A sampler that
pads an uneven split repeats samples, which would count them twice; ``EvenShares`` instead pads
the set to a multiple of dp with copies of sample 0 whose labels are all -100 (they count for
nothing), so every replica runs the same number of forward passes (ZeRO-3 gathers parameters over
the whole world in each) and no sample is seen twice. ``evaluate`` sums loss, correct and count
over the replicas (one all-reduce of three numbers over the dp group; the SP group's sum is the
model's ``evaluate``), so dp = 2 gives the dp = 1 figures.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ds_seqpar.loss import IGNORE_INDEX

__all__ = ["EvenShares", "evaluate"]


class EvenShares(Dataset):
    """``dataset`` padded to a multiple of ``replicas`` with label-free copies of its sample 0."""

    def __init__(self, dataset: Any, replicas: int) -> None:
        self.dataset = dataset
        self.size = len(dataset)
        self.padded = -(-self.size // replicas) * replicas

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < self.size:
            return self.dataset[index]
        sample = dict(self.dataset[0])
        sample["labels"] = torch.full_like(torch.as_tensor(sample["input_ids"]), IGNORE_INDEX)
        return sample


def evaluate(engine: Any, loader: Any, mesh: Any) -> dict[str, float]:
    """Token-weighted eval loss and accuracy over ``loader`` and every dp replica (module docstring);
    the engine is back in train mode after."""
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for batch in loader:
        res = engine.module.evaluate(**batch)
        totals += torch.stack([res["loss"] * res["count"], res["correct"], res["count"]]).double().cpu()
    engine.train()
    if mesh.dp_size > 1:
        reduced = totals.to(engine.device) if dist.get_backend() == "nccl" else totals
        dist.all_reduce(reduced, group=mesh.group("dp"))
        totals = reduced.cpu()
    count = max(totals[2].item(), 1.0)
    return {"eval_loss": totals[0].item() / count, "eval_accuracy": totals[1].item() / count}
