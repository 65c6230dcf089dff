"""Bidirectional image blocks in a causal mask (Gemma 3's image tokens; docs/kernels.md "Image blocks").

Legend: S tokens of the whole sequence in global order, B batch rows; ``blocks`` ``[S]`` / ``[B, S]``: the image
block id of every token, negative for text (HF's ``block_sequence_ids``).

HF's rule (``blockwise_overlay`` OR'd into the causal mask, the sliding window AND'ed after it):

    visible(q, k) = (k <= q  OR  blocks[q] == blocks[k] >= 0)  AND  q - k < w  (AND documents / padding)

A block is one run of consecutive positions, so the keys a query gains are exactly the positions after it up
to its block's last one: the causal rule becomes ``k <= end[q]`` with ``end[q] = q + reach[q]``, ``reach[q]`` =
how many later positions of its own block there are (0 for text). Only the queries' end moves; the window
and the documents apply as before, so every layout gets the mask from global positions plus ``reach``.
"""

from __future__ import annotations

import torch

__all__ = ["REACH_CACHE", "block_reach", "blocks_reach", "check_blocks"]


def _fail(detail: str) -> ValueError:
    return ValueError(
        f"ds_seqpar.attention: blocks {detail}; pass the image block id of every token of the WHOLE sequence in "
        "global order, [S] or [B, S] integers (negative = text), each block one run of consecutive tokens inside "
        "one document (HF's block_sequence_ids, e.g. Gemma 3's get_block_sequence_ids_for_mask)"
    )


def _check_runs(row: torch.Tensor, doc: torch.Tensor | None, index: int) -> None:
    """One row ``[S]``: every block id >= 0 is one run per document (an id may come back in another document:
    the documents' rule separates them, as HF's packed mask does), not on padding, inside one document."""
    image = row >= 0
    if doc is not None and bool((image & (doc < 0)).any()):
        at = int((image & (doc < 0)).nonzero()[0])
        raise _fail(f"id {int(row[at])} of batch row {index} covers padding (doc_ids < 0) at token {at}")
    if doc is not None:
        cut = image[1:] & (row[1:] == row[:-1]) & (doc[1:] != doc[:-1])
        if bool(cut.any()):
            at = int(cut.nonzero()[0]) + 1
            raise _fail(f"id {int(row[at])} of batch row {index} crosses a document border at token {at}")
    prev = torch.cat([row.new_full((1,), -1), row[:-1]])
    starts = image & (row != prev)
    keys = torch.stack(
        [row[starts], (torch.zeros_like(row) if doc is None else doc.to(row.dtype))[starts]], 1
    )
    found, counts = torch.unique(keys, dim=0, return_counts=True)
    if bool((counts > 1).any()):
        bad, runs = found[counts > 1][0], int(counts[counts > 1][0])
        where = "" if doc is None else f" (document {int(bad[1])})"
        raise _fail(f"id {int(bad[0])} of batch row {index} is split into {runs} runs{where}")


def check_blocks(
    blocks: object, seq_len: int, batch: int, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``blocks`` validated (type, shape ``[S]`` / ``[B, S]``, integer dtype, runs inside documents); returned."""
    if not isinstance(blocks, torch.Tensor):
        raise _fail(f"is a {type(blocks).__name__}, not a tensor")
    if blocks.dtype.is_floating_point or blocks.dtype.is_complex or blocks.dtype == torch.bool:
        raise _fail(f"has dtype {blocks.dtype}, not an integer dtype")
    if blocks.dim() not in (1, 2) or blocks.shape[-1] != seq_len:
        raise _fail(f"has shape {tuple(blocks.shape)} for a sequence of S = {seq_len} tokens")
    if blocks.dim() == 2 and blocks.shape[0] != batch:
        raise _fail(f"has {blocks.shape[0]} batch rows but q has B = {batch}")
    rows, docs = blocks.reshape(-1, seq_len).cpu(), None
    if doc_ids is not None:
        docs = doc_ids.reshape(-1, seq_len).cpu()
        if rows.shape[0] != docs.shape[0] and 1 not in (rows.shape[0], docs.shape[0]):
            raise _fail(f"has {rows.shape[0]} batch rows but doc_ids has {docs.shape[0]}")
        rows, docs = torch.broadcast_tensors(rows, docs)
    for i in range(rows.shape[0]):
        _check_runs(rows[i], None if docs is None else docs[i], i)
    return blocks


def block_reach(blocks: torch.Tensor) -> torch.Tensor:
    """int64 ``[S]`` / ``[B, S]``: how many later tokens of its own block each token also sees (0 for text).

    ``blocks`` must be runs (:func:`check_blocks`): then a token's block ends at the first position ``j >= i``
    where the next id differs."""
    ids = blocks.to(torch.int64)
    seq_len = ids.shape[-1]
    index = torch.arange(seq_len, device=ids.device).expand(ids.shape)
    last = torch.ones_like(ids, dtype=torch.bool)
    last[..., :-1] = ids[..., 1:] != ids[..., :-1]
    stop = torch.where(last, index, torch.full_like(index, seq_len))
    ends = stop.flip(-1).cummin(-1).values.flip(-1)  # first run end at or after each token
    return torch.where(ids >= 0, ends - index, torch.zeros_like(index))


REACH_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
"""(blocks, doc_ids, S, B, device) -> (blocks, doc_ids, reach): each batch is checked once, and every layer gets the
same reach tensor (the ring plan cache is keyed by it)."""


def blocks_reach(
    blocks: object, seq_len: int, batch: int, doc_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """:func:`check_blocks` then :func:`block_reach` on ``device``, once per (blocks, doc_ids) tensors."""
    key = (
        id(blocks),
        getattr(blocks, "_version", None),
        None if doc_ids is None else (id(doc_ids), doc_ids._version),
        seq_len,
        batch,
        str(device),
    )
    entry = REACH_CACHE.get(key)
    if entry is not None and entry[0] is blocks and entry[1] is doc_ids:
        return entry[2]
    reach = block_reach(check_blocks(blocks, seq_len, batch, doc_ids).to(device))
    if len(REACH_CACHE) >= 16:
        REACH_CACHE.clear()
    REACH_CACHE[key] = (blocks, doc_ids, reach)
    return reach
