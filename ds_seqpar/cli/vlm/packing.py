"""Pack encoded records into rows of ``seq_len`` (docs/multimodal_data.md, "Packing").

Records go into rows in file order, a row taking the next record while it fits (a record longer than a
row is refused by name). A row (one sample of ``PackedVlmDataset``) holds ``input_ids``, ``labels``,
``doc_ids`` (document index per token, -1 = padding) and ``mm_token_type_ids``: ``[S]``;
``position_ids``: ``[3, S]`` for mRoPE families (the model's own rope index of each record ALONE,
concatenated), else ``[S]`` (restarting per record); padding gets position 0. The vision inputs of the
row's records are concatenated in order along dim 0. ``collate_vlm`` makes a batch of rows in the form
``SeqParVisionLM`` takes (``position_ids [3, B, S]`` or ``[B, S]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from ds_seqpar.cli.vlm.encode import IGNORE_INDEX, EncodedRecord
from ds_seqpar.cli.vlm.families import VlmFamily
from ds_seqpar.errors import SeqParConfigError

TOKEN_ROW_KEYS = ("input_ids", "labels", "doc_ids", "mm_token_type_ids")


def pack_indices(
    lengths: Sequence[int], seq_len: int, where: Sequence[str] | None = None, pack: bool = True
) -> list[list[int]]:
    """Record indices per row: in order, a row takes the next record while the sum fits ``seq_len`` (with
    ``pack=False`` every record is a row of its own)."""
    rows: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if n > seq_len:
            name = where[i] if where is not None else f"record {i}"
            raise SeqParConfigError(
                f"{name}: {n} tokens (with its image / video tokens and EOS) do not fit a row of --seq-len "
                f"{seq_len}; fix: a longer --seq-len, smaller images, or fewer frames"
            )
        if used + n > seq_len or not pack:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def position_function(family: VlmFamily, model: Any) -> Callable[[EncodedRecord], torch.Tensor]:
    """Positions of ONE record: ``[3, L]`` from the model's own rope index (mRoPE), else ``arange(L)``."""
    if family.rope_index is None:
        return lambda rec: torch.arange(len(rec))
    rope_index = family.rope_index(model)

    def positions(rec: EncodedRecord) -> torch.Tensor:
        grids = {k: v for k, v in rec.vision.items() if k.endswith("_grid_thw") or k == "second_per_grid_ts"}
        pos, _ = rope_index(rec.input_ids[None], mm_token_type_ids=rec.mm_token_type_ids[None], **grids)
        return pos[:, 0]

    return positions


class PackedVlmDataset(Dataset):
    """Rows of ``seq_len`` tokens from ``records`` (see the module docstring); ``positions``: a
    ``position_function``; ``pad_token_id`` fills the end of each row; ``pack=False``: one record per row."""

    def __init__(
        self,
        records: Sequence[EncodedRecord],
        seq_len: int,
        positions: Callable[[EncodedRecord], torch.Tensor],
        pad_token_id: int = 0,
        pack: bool = True,
    ):
        self.records, self.seq_len, self.positions = list(records), seq_len, positions
        self.pad_token_id = pad_token_id
        where = [r.where for r in self.records]
        self.rows = pack_indices([len(r) for r in self.records], seq_len, where, pack)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        recs = [self.records[i] for i in self.rows[index]]
        pad = self.seq_len - sum(len(r) for r in recs)
        pos = [self.positions(r) for r in recs]
        pos.append(torch.zeros(*pos[0].shape[:-1], pad, dtype=torch.long))
        row = {
            "input_ids": _cat([r.input_ids for r in recs], pad, self.pad_token_id),
            "labels": _cat([r.labels for r in recs], pad, IGNORE_INDEX),
            "doc_ids": _cat([torch.full((len(r),), d) for d, r in enumerate(recs)], pad, -1),
            "mm_token_type_ids": _cat([r.mm_token_type_ids for r in recs], pad, 0),
            "position_ids": torch.cat(pos, dim=-1).long(),
        }
        for key in sorted({k for r in recs for k in r.vision}):
            row[key] = torch.cat([r.vision[key] for r in recs if key in r.vision], dim=0)
        return row


def _cat(parts: list[torch.Tensor], pad: int, value: int) -> torch.Tensor:
    return torch.cat([*(p.long() for p in parts), torch.full((pad,), value, dtype=torch.long)])


def collate_vlm(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch: token keys ``[B, S]``, ``position_ids [3, B, S]`` (mRoPE) or ``[B, S]``, and each vision
    key concatenated over the rows in order (dim 0), e.g. ``pixel_values``, ``image_grid_thw``."""
    batch = {key: torch.stack([r[key] for r in rows]) for key in TOKEN_ROW_KEYS}
    pos = [r["position_ids"] for r in rows]
    batch["position_ids"] = torch.stack(pos, dim=1 if pos[0].dim() == 2 else 0)
    for key in sorted({k for r in rows for k in r} - set(batch)):
        batch[key] = torch.cat([r[key] for r in rows if key in r], dim=0)
    return batch


def text_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions restarting at 0 at every change of ``doc_ids [B, S]`` (padding: one more run)."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    index = torch.arange(doc_ids.shape[1]).expand_as(doc_ids)
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def hf_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The plain HF form of a collated batch (the single-process reference forward): ``doc_ids`` dropped,
    mRoPE ``position_ids [3, B, S]`` led by the text positions restarting per document (``[4, B, S]``, what
    Qwen2-VL's text model builds its packed-sequence mask from) and ``use_cache=False`` (HF builds that
    mask only without a cache)."""
    out: dict[str, Any] = {k: v for k, v in batch.items() if k != "doc_ids"}
    if batch["position_ids"].dim() == 3:
        out["position_ids"] = torch.cat([text_positions(batch["doc_ids"])[None], batch["position_ids"]])
    out["use_cache"] = False
    return out


def reference_loss(model: Any, records: Sequence[EncodedRecord]) -> torch.Tensor:
    """The single-process reference: each record through the plain HF forward ALONE; the token-weighted
    mean of their next-token losses (what the SP group's loss of the packed rows must equal)."""
    total, count = 0.0, 0
    for rec in records:
        n = int((rec.labels[1:] != IGNORE_INDEX).sum())
        if n == 0:
            continue
        out = model(
            input_ids=rec.input_ids[None],
            labels=rec.labels[None],
            mm_token_type_ids=rec.mm_token_type_ids[None],
            **rec.vision,
        )
        total = total + out.loss * n
        count += n
    return total / count
