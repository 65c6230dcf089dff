"""``blocks`` of ``ds_seqpar.attention``: Gemma 3's bidirectional image blocks (docs/kernels.md "Image blocks").

Checked before any collective; the result is the per-token ``reach`` of ``ops/image_blocks.py`` (``[S]`` /
``[B, S]`` int64, global order, like ``doc_ids``) that the ring plan shards with its layouts. Nothing is
communicated: every rank derives its queries' end positions from the whole sequence's block ids.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.ops.image_blocks import blocks_reach

__all__ = ["image_block_reach"]


def image_block_reach(
    blocks: torch.Tensor | None,
    causal: bool,
    chunk: int | None,
    seq_len: int,
    q: torch.Tensor,
    doc_ids: torch.Tensor | None,
    attention: str,
    layout: Any,
) -> torch.Tensor | None:
    """``ds_seqpar.attention``'s ``blocks``: the image block id per token of the whole sequence in global order,
    ``[S]`` / ``[B, S]`` integers (negative = text; HF's ``block_sequence_ids``). With ``causal`` a query also
    sees the later tokens of its own block (Gemma 3's bidirectional image tokens; the window still bounds
    ``i - j < window``). Each block must be one run of consecutive tokens inside one document (checked, raising
    by name). Ignored with ``causal=False`` (a non-causal query already sees its whole block within its
    window). Refused by name with ``chunk`` and ``sparse_ring``.

    Returns the reach of ``blocks`` for the ring plan (``[S]`` / ``[B, S]`` int64), or None."""
    if blocks is None or not causal:
        return None
    if attention == "sparse_ring":
        raise ValueError(
            "ds_seqpar.attention: blocks (bidirectional image blocks) with sequence_parallel.attention="
            "'sparse_ring': its vertical-slash pattern and kernels follow the causal rule only; use attention "
            "'usp', 'ulysses' or 'ring'"
        )
    if chunk is not None:
        raise ValueError(
            f"ds_seqpar.attention: blocks with chunk={chunk}: HF lets an image block see across a chunk border "
            "(its block overlay is OR'd after the chunk rule), which the chunks-as-documents path cannot; pass "
            "blocks=None for chunked layers or chunk=None"
        )
    return blocks_reach(blocks, seq_len, q.shape[0], doc_ids, q.device)
