"""Batches of packed multimodal rows for a training loop under sequence parallelism: every rank of an SP group
reads the same rows (the sampler splits over the dp replicas only), and each batch is ``collate_vlm`` then
``shard_vlm_batch`` (this rank's tokens, the vision inputs whole)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from ds_seqpar.cli.vlm.packing import IGNORE_INDEX, collate_vlm
from ds_seqpar.cli.vlm.sharding import shard_vlm_batch
from ds_seqpar.data import dp_dataloader
from ds_seqpar.mesh import SeqParMesh


class VlmCollator:
    """Rows -> ``shard_vlm_batch(collate_vlm(rows))`` for this rank."""

    def __init__(self, mesh: SeqParMesh, pad_token_id: int = 0) -> None:
        self.mesh, self.pad_token_id = mesh, pad_token_id

    def __call__(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, Any]:
        return shard_vlm_batch(collate_vlm(rows), self.mesh, self.pad_token_id)


def vlm_dataloader(
    dataset: Any,
    mesh: SeqParMesh,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    pad_token_id: int = 0,
    drop_last: bool = True,
) -> DataLoader:
    """Training batches of ``dataset`` (``PackedVlmDataset`` rows) for this rank; ``set_epoch`` as usual."""
    return dp_dataloader(dataset, mesh, batch_size, VlmCollator(mesh, pad_token_id), shuffle, seed, drop_last)


class VlmEvenShares:
    """Evaluation batches (what ``ds_seqpar.evaluation.EvenShares`` is for text): row i on dp replica
    ``i % dp``, each row once, the same number of batches on every replica (a replica short of rows runs row 0
    with every label -100, which counts for nothing)."""

    def __init__(self, dataset: Any, mesh: SeqParMesh, batch_size: int, pad_token_id: int = 0) -> None:
        self.dataset, self.collator = dataset, VlmCollator(mesh, pad_token_id)
        own = list(range(mesh.coords.dp_rank, len(dataset), mesh.dp_size))
        self.num_batches = math.ceil(math.ceil(len(dataset) / mesh.dp_size) / batch_size)
        self.loader = (
            DataLoader(Subset(dataset, own), batch_size=batch_size, collate_fn=self.collator) if own else None
        )

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        done = 0
        for batch in self.loader or ():
            done += 1
            yield batch
        for _ in range(self.num_batches - done):
            batch = self.collator([self.dataset[0]])
            batch["shift_labels"] = torch.full_like(batch["shift_labels"], IGNORE_INDEX)
            yield batch
