"""Position ids of packed multimodal rows for families that number tokens in 3-D (Qwen's mRoPE, docs/multimodal.md
"Packed documents").

The family's own ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, ...,
attention_mask)`` numbers the tokens of each row that ``attention_mask`` keeps, taking the images' and videos'
grids in order, row after row. ``packed_rope_positions`` calls it ONCE on a batch with one row per document (every
row the whole packed row, its mask that document's tokens), so each document is numbered as if it were alone
(what the plain model does with it) and the grids are consumed in document order.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["packed_rope_positions"]


def packed_rope_positions(
    base: torch.nn.Module, rows: torch.Tensor, doc_ids: torch.Tensor, vision: dict[str, Any]
) -> torch.Tensor:
    """Position ids ``[k, B, S]`` of packed rows ``rows [B, S]`` with document ids ``doc_ids [B, S]`` (-1 =
    padding, numbered 0 like the family numbers masked tokens); ``vision``: the batch's vision inputs (the grids
    of all documents of all rows, in order)."""
    params = inspect.signature(base.get_rope_index).parameters
    if "attention_mask" not in params:
        raise UnsupportedModelError(
            f"{type(base).__name__}.get_rope_index takes no attention_mask, so ds_seqpar cannot number packed "
            "documents one by one: one document per row for this family"
        )
    docs: list[tuple[int, int]] = []  # (row, document id) in order
    for b in range(rows.shape[0]):
        docs += [(b, int(d)) for d in torch.unique_consecutive(doc_ids[b]).tolist() if d >= 0]
    ids = torch.stack([rows[b] for b, _ in docs])
    mask = torch.stack([(doc_ids[b] == d).long() for b, d in docs])
    given = {k: v for k, v in vision.items() if k in params and k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in given:
        given["mm_token_type_ids"] = torch.stack([given["mm_token_type_ids"][b] for b, _ in docs])
    per_doc, _ = base.get_rope_index(input_ids=ids, attention_mask=mask, **given)
    out = torch.zeros((per_doc.shape[0], *rows.shape), dtype=per_doc.dtype, device=per_doc.device)
    for j, (b, d) in enumerate(docs):
        keep = doc_ids[b] == d
        out[:, b, keep] = per_doc[:, j, keep]
    return out
