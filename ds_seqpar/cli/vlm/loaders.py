"""Batches of packed multimodal rows for a training loop under sequence parallelism: every rank of an SP group
reads the same rows (the sampler splits over the dp replicas only), and each batch is ``collate_vlm`` then
``shard_vlm_batch`` (this rank's tokens, the vision inputs whole)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from ds_seqpar.cli.vlm.packing import collate_vlm
from ds_seqpar.cli.vlm.sharding import shard_vlm_batch
from ds_seqpar.data import dp_dataloader
from ds_seqpar.evaluation import EvenShares
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


def vlm_even_shares(dataset: Any, mesh: SeqParMesh, batch_size: int, pad_token_id: int = 0) -> EvenShares:
    """Evaluation batches of multimodal rows (``ds_seqpar.evaluation.EvenShares`` with the rows' collator): row i
    on dp replica ``i % dp``, each row once, the same number of batches on every replica (a replica short of
    rows runs row 0 with every label -100, which counts for nothing)."""
    return EvenShares(dataset, mesh, batch_size, collator=VlmCollator(mesh, pad_token_id))
