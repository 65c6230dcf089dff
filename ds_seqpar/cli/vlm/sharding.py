"""A collated multimodal batch (``collate_vlm``) in the form ``SeqParVisionLM`` takes: the text keys through
``ds_seqpar.shard_batch`` (this rank's tokens, pre-shifted labels, document ids from positions restarting per
record, padding as ``attention_mask`` 0), the vision inputs whole and the same on every rank."""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.cli.vlm.packing import text_positions
from ds_seqpar.data import shard_batch
from ds_seqpar.mesh import SeqParMesh

# keys of a collated batch that shard_batch consumes (position_ids: the rows' own, [3, B, S] for mRoPE, which
# the wrapper recomputes per document with the family's rope index)
ROW_KEYS = ("input_ids", "labels", "doc_ids", "position_ids")


def shard_vlm_batch(
    batch: dict[str, torch.Tensor], mesh: SeqParMesh, pad_token_id: int = 0
) -> dict[str, Any]:
    """``shard_batch`` of the text part ``[B, S]`` plus every vision input of ``batch`` as it is."""
    doc = batch["doc_ids"]
    text = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "attention_mask": (doc >= 0).long(),
        "position_ids": text_positions(doc),
    }
    out = shard_batch(text, mesh, pad_token_id=pad_token_id)
    out.update({k: v for k, v in batch.items() if k not in ROW_KEYS})
    return out
