"""Multimodal training data for vision-language models (docs/multimodal_data.md).

``read_vlm_data(path, model_path, config, seq_len)`` reads a JSONL of records with images / videos
(``records.py``), runs the model's own processor on each (``encode.py``) and checks that each fits a row;
``PackedVlmDataset`` packs them into rows with document ids and per-document positions (``packing.py``);
``collate_vlm`` batches rows and ``shard_vlm_batch`` turns a batch into ``SeqParVisionLM``'s inputs
(``vlm_dataloader``: both, over the dp replicas). ``uses_vlm_reader`` says when ``train.py --data`` takes
this reader: the model has a ``vision_config`` and a record has images or videos.
"""

from __future__ import annotations

from typing import Any

from ds_seqpar.cli.vlm.encode import EncodedRecord, VlmEncoder
from ds_seqpar.cli.vlm.families import FAMILIES, VlmFamily, family_of, load_processor
from ds_seqpar.cli.vlm.loaders import VlmCollator, vlm_dataloader
from ds_seqpar.cli.vlm.packing import (
    PackedVlmDataset,
    collate_vlm,
    hf_inputs,
    pack_indices,
    position_function,
    reference_loss,
    text_positions,
)
from ds_seqpar.cli.vlm.records import VlmRecord, has_vision, read_records
from ds_seqpar.cli.vlm.sharding import shard_vlm_batch

__all__ = [
    "FAMILIES",
    "EncodedRecord",
    "PackedVlmDataset",
    "VlmCollator",
    "VlmEncoder",
    "VlmFamily",
    "VlmRecord",
    "collate_vlm",
    "family_of",
    "hf_inputs",
    "load_processor",
    "pack_indices",
    "position_function",
    "read_records",
    "read_vlm_data",
    "reference_loss",
    "shard_vlm_batch",
    "text_positions",
    "uses_vlm_reader",
    "vlm_dataloader",
]


def uses_vlm_reader(config: Any, data_path: str | None) -> bool:
    """Whether ``--data`` goes through this reader: a vision-language model and records with images/videos."""
    return (
        data_path is not None and getattr(config, "vision_config", None) is not None and has_vision(data_path)
    )


def read_vlm_data(path: str, model_path: str, config: Any, seq_len: int) -> list[EncodedRecord]:
    """Every record of ``path`` encoded by the processor at ``model_path``; refuses (by name, with the
    fix) an unsupported family, a bad record, a missing file, and a record longer than ``seq_len``."""
    family = family_of(config)
    processor, videos = load_processor(model_path)
    encoder = VlmEncoder(processor, family, config, videos_supported=videos, model_path=model_path)
    encoded = [encoder.encode(record) for record in read_records(path)]
    pack_indices([len(r) for r in encoded], seq_len, [r.where for r in encoded])
    return encoded
