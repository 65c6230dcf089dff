"""Batches of packed multimodal rows for a training loop under sequence parallelism: every rank of an SP group
reads the same rows (the sampler splits over the dp replicas only), and each batch is ``collate_vlm`` then
``shard_vlm_batch`` (this rank's tokens, the vision inputs whole)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ds_seqpar.cli.vlm.packing import collate_vlm
from ds_seqpar.cli.vlm.sharding import shard_vlm_batch
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
    sampler = DistributedSampler(
        dataset,
        num_replicas=mesh.dp_size,
        rank=mesh.coords.dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=VlmCollator(mesh, pad_token_id),
        drop_last=drop_last,
    )
