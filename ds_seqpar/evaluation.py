"""Sharded evaluation: every held-out sample counted once over the dp replicas, every token once over the SP ranks.

Legend: N = samples of the set, dp = data-parallel replicas, b = samples per batch and replica,
B = the batches every replica runs = ceil(ceil(N / dp) / b).

``EvenShares`` splits the set over the dp replicas (replica r reads samples r, r + dp, r + 2 dp, ...;
none is repeated) and collates each batch with ``SeqParCollator`` (the batch sharded over the SP ranks
of the replica). A replica with fewer than B batches of its own runs filler batches: sample 0 with
every label -100, set after the collator (so a collator that rebuilds labels from the input ids keeps
them out too). Fillers count for nothing (no labelled token), and every rank runs B forwards, which
ZeRO-3 needs (it gathers parameters over the whole world in each forward).

``evaluate_shards`` sums ``loss x count``, ``correct`` and ``count`` over the batches (the model's
``evaluate`` sums each over the SP group) and over the dp replicas (one all-reduce of three float64
numbers), so it returns the token-weighted mean loss and next-token accuracy over every labelled
token of the set, the same for any dp, SP degree and batch size (docs/integration.md, "Evaluation").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from ds_seqpar.data import IGNORE_INDEX, SeqParCollator
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.mesh import SeqParMesh

__all__ = ["EvenShares", "evaluate_shards"]

LABEL_KEYS = ("shift_labels", "labels")  # what shard_batch returns for the causal / masked objective


class EvenShares:
    """This dp replica's evaluation batches of ``dataset``: ``len(self)`` = B on every replica (module docstring).

    Args:
        dataset: a map-style dataset of samples (what the collator takes); at least one sample.
        mesh: the SP mesh (its dp rank and size pick the share).
        batch_size: samples per batch and replica.
        collate_fn: the samples' collator (default: stack equal-length samples).
        pad_token_id, objective: as ``ds_seqpar.seqpar_dataloader``.
        collator: instead of the three above, a collator that makes this rank's batch from samples itself
            (multimodal rows: ``ds_seqpar/cli/vlm/loaders.py``).
        loader_kwargs: more DataLoader arguments (``num_workers``, ``pin_memory``).
    """

    def __init__(
        self,
        dataset: Any,
        mesh: SeqParMesh,
        batch_size: int,
        *,
        collate_fn: Callable[[Sequence[Any]], dict[str, Any]] | None = None,
        pad_token_id: int = 0,
        objective: str = "causal",
        collator: Callable[[Sequence[Any]], dict[str, Any]] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        size = len(dataset)
        if size < 1 or batch_size < 1:
            raise SeqParConfigError(
                f"evaluation set of {size} samples at batch size {batch_size}: sharded evaluation needs at "
                "least one sample and a batch size >= 1; valid: a non-empty eval set"
            )
        self.dataset = dataset
        self.collator = collator or SeqParCollator(mesh, collate_fn, pad_token_id, objective)
        dp, rank = mesh.dp_size, mesh.coords.dp_rank
        self.own = list(range(rank, size, dp))
        self.num_batches = math.ceil(math.ceil(size / dp) / batch_size)
        self.loader = (
            DataLoader(
                Subset(dataset, self.own),
                batch_size=batch_size,
                shuffle=False,
                collate_fn=self.collator,
                drop_last=False,
                **loader_kwargs,
            )
            if self.own
            else None
        )

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        done = 0
        for batch in self.loader or ():
            done += 1
            yield batch
        for _ in range(self.num_batches - done):
            yield self.filler()

    def filler(self) -> dict[str, Any]:
        """Sample 0 sharded for this rank, every label -100: a forward that counts for nothing."""
        batch = self.collator([self.dataset[0]])
        for key in LABEL_KEYS:
            if key in batch:
                batch[key] = torch.full_like(batch[key], IGNORE_INDEX)
        return batch


def evaluate_shards(
    evaluate: Callable[..., dict[str, torch.Tensor]],
    batches: Any,
    mesh: SeqParMesh,
    device: torch.device | None = None,
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Token-weighted ``loss`` and ``accuracy`` over every labelled token of ``batches`` on every replica.

    ``evaluate(**batch)`` is the model's (``SeqParCausalLM.evaluate``: ``loss``, ``correct``, ``count``
    over the SP group); ``prepare`` moves a batch to the model's device. Communicates one all-reduce of
    3 float64 over the dp group (on ``device`` for NCCL). Also returns ``tokens`` (labelled tokens
    counted) and ``batches`` (forwards run by this rank).
    """
    totals = torch.zeros(3, dtype=torch.float64)
    steps = 0
    for batch in batches:
        res = evaluate(**(prepare(batch) if prepare is not None else batch))
        totals += torch.stack([res["loss"] * res["count"], res["correct"], res["count"]]).double().cpu()
        steps += 1
    if mesh.dp_size > 1:
        on_device = device is not None and dist.get_backend() == "nccl"
        reduced = totals.to(device) if on_device else totals
        dist.all_reduce(reduced, group=mesh.group("dp"))
        totals = reduced.cpu()
    count = max(totals[2].item(), 1.0)
    return {
        "loss": totals[0].item() / count,
        "accuracy": totals[1].item() / count,
        "tokens": totals[2].item(),
        "batches": steps,
    }
