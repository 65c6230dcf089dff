"""Packed batches: per-token document ids and per-document positions from cumulative document lengths.

``doc_ids_from_cu_seqlens`` turns ``cu_seqlens`` into a per-token document id (padding -1), and
``positions_from_cu_seqlens`` into per-document positions (what RoPE of a packed row needs); shard them
like any other tensor with a layout's ``shard``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_seqpar.layout.base import LayoutError

__all__ = ["doc_ids_from_cu_seqlens", "document_lengths", "positions_from_cu_seqlens"]


def _check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1)
    if cu.numel() < 2 or cu[0].item() != 0:
        raise LayoutError(
            f"cu_seqlens={cu.tolist()} must start at 0 and hold at least one document, e.g. [0, {seq_len}]"
        )
    if bool((cu[1:] <= cu[:-1]).any()):
        raise LayoutError(f"cu_seqlens={cu.tolist()} must be strictly increasing (no empty documents)")
    if cu[-1].item() > seq_len:
        raise LayoutError(
            f"cu_seqlens ends at {cu[-1].item()}, beyond the sequence length {seq_len}; the last entry must be <= S"
        )
    return cu


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    """Per-token document id ``[S]`` (int64) from cumulative lengths; tokens past the end get -1 (padding)."""
    cu = _check_cu_seqlens(cu_seqlens, seq_len)
    ids = torch.full((seq_len,), -1, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    ids[: int(cu[-1])] = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return ids


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], seq_len: int) -> torch.Tensor:
    """Per-token position inside its document ``[S]`` (RoPE positions of a packed row); padding continues."""
    cu = _check_cu_seqlens(cu_seqlens, seq_len)
    pos = torch.arange(seq_len)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    pos[: int(cu[-1])] -= starts
    end = int(cu[-1])
    pos[end:] -= int(cu[-2])  # padding continues the last document's positions
    return pos


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal document ids of a packed row ``[S]`` (or ``[B, S]`` whose rows all
    have the same runs), in row order; a trailing run of padding (id < 0) is left out. Host work."""
    ids = doc_ids if doc_ids.dim() == 1 else doc_ids[0]
    if doc_ids.dim() == 2 and doc_ids.shape[0] > 1:
        starts = doc_ids[:, 1:] != doc_ids[:, :-1]
        if not bool((starts == starts[:1]).all()) or not bool(((doc_ids < 0) == (ids < 0)).all()):
            raise LayoutError(
                "ring.layout='documents' places one set of documents per micro-batch, but the rows of this "
                f"batch [B={doc_ids.shape[0]}, S={doc_ids.shape[1]}] have different document boundaries; use a "
                "micro-batch of one packed row per SP group, or another ring.layout (e.g. 'zigzag')"
            )
    ids = ids.to("cpu")
    cuts = torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1
    bounds = [0, *cuts.tolist(), ids.numel()]
    runs = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    if runs and int(ids[runs[-1][0]]) < 0:
        runs.pop()
    return [b - a for a, b in runs]
