"""Attention masks derived from per-token global positions and document ids (docs/kernels.md "Masks from global positions").

Legend:
    B      batch size
    Sq, Sk query / key tokens of one block (local shard, any layout)
    pos    global token position (integer); the only ordering the mask ever looks at
    doc    document id of a packed batch (integer); a negative id marks padding

Rules (True = key visible to the query; ``d = pos_q - pos_k``):
    causal, no window      d >= 0
    causal, window w       0 <= d < w      (HF/Mistral ``sliding_window``: a query sees the
                                            last ``w`` positions, itself included)
    non-causal, no window  always
    non-causal, window w   |d| < w         (``w - 1`` positions on each side plus itself)
    documents              doc_q == doc_k, and both >= 0 (a padding token, doc < 0, sees
                           nothing and is seen by nothing; its attention row is empty)
    chunks of c tokens     (i - p) // c == (j - p) // c on row indices i, j, p = the row's leading
                           padding tokens (Llama 4's chunked attention): applied as documents,
                           ``chunk_doc_ids`` splits every document at the chunk borders
    image blocks (causal)  pos_k <= end_q replaces d >= 0 (the window still bounds d < w): ``end_q`` =
                           the last position of the query's own image block (Gemma 3's bidirectional
                           image tokens), ``pos_q`` for text; see ``ops/image_blocks.py``

Because every rule is a function of (pos, doc) pairs, contiguous, zigzag, stripe and any other
token layout get the right mask from the same code; no layout-specific "shift" tricks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = [
    "BlockKind",
    "MaskSpec",
    "check_chunk",
    "chunk_doc_ids",
    "classify_block",
    "quick_block_kind",
    "token_mask",
]


@dataclass(frozen=True)
class MaskSpec:
    """What a query may see, in global positions.

    Args:
        causal: keys at later positions are invisible.
        window: sliding window in positions (>= 1), see the module legend; ``None`` = unlimited.
    """

    causal: bool = True
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise ValueError(
                f"MaskSpec.window={self.window!r} is invalid: use an int >= 1 (a query sees the last "
                "`window` positions, itself included) or None for no window"
            )


class BlockKind(Enum):
    """How a (query block, key block) pair must be computed.

    EMPTY: no pair visible, skip the block. FULL: every pair visible, no mask.
    CAUSAL: the mask is exactly top-left causal by local index (key j visible iff j <= i, Sq == Sk),
    so kernels can use their built-in causal mode. PARTIAL: anything else; explicit bool mask.
    """

    EMPTY = "empty"
    FULL = "full"
    CAUSAL = "causal"
    PARTIAL = "partial"


def _check_tokens(name: str, pos: torch.Tensor, doc: torch.Tensor | None) -> None:
    if pos.dim() not in (1, 2):
        raise ValueError(f"{name}_pos must be [S] or [B, S], got shape {tuple(pos.shape)}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise ValueError(f"{name}_pos must hold integer positions, got dtype {pos.dtype}")
    if doc is not None and doc.shape != pos.shape:
        raise ValueError(
            f"{name}_doc has shape {tuple(doc.shape)} but {name}_pos has {tuple(pos.shape)}: "
            "give one document id per token"
        )


def _check_pair(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    q_end: torch.Tensor | None = None,
) -> None:
    _check_tokens("q", q_pos, q_doc)
    _check_tokens("k", k_pos, k_doc)
    if q_end is not None and (q_end.shape[-1] != q_pos.shape[-1] or q_end.dim() not in (1, 2)):
        raise ValueError(
            f"q_end has shape {tuple(q_end.shape)} but q_pos has {tuple(q_pos.shape)}: give one end "
            "position per query ([Sq] or [B, Sq])"
        )
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc (packed documents) or neither")
    if q_pos.dim() == 2 and k_pos.dim() == 2 and q_pos.shape[0] != k_pos.shape[0]:
        raise ValueError(
            f"batch mismatch: q_pos is {tuple(q_pos.shape)} and k_pos is {tuple(k_pos.shape)}; "
            "[B, S] positions need the same B on both sides"
        )


def _visible(d: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """Position rule applied to ``d = pos_q - pos_k`` (any shape)."""
    if spec.causal:
        vis = d >= 0
        return vis if spec.window is None else vis & (d < spec.window)
    if spec.window is None:
        return torch.ones_like(d, dtype=torch.bool)
    return d.abs() < spec.window


def token_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spec: MaskSpec = MaskSpec(),
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    q_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool visibility mask (True = key visible to the query).

    Args:
        q_pos, k_pos: global positions, ``[Sq]`` / ``[Sk]`` or per batch row ``[B, Sq]`` / ``[B, Sk]``.
        spec: causal / window rule.
        q_doc, k_doc: document ids with the shapes of the positions (both or neither).
        q_end: None, or (causal only) the last position each query sees, ``[Sq]`` / ``[B, Sq]`` (>= q_pos;
            its image block's last position, module legend); ignored when ``spec.causal`` is False.

    Returns:
        ``[Sq, Sk]`` if every input is 1-D, else ``[B, Sq, Sk]``.
    """
    _check_pair(q_pos, k_pos, q_doc, k_doc, q_end)
    d = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    if spec.causal and q_end is not None:
        mask = k_pos.unsqueeze(-2) <= q_end.unsqueeze(-1)
        mask = mask if spec.window is None else mask & (d < spec.window)
    else:
        mask = _visible(d, spec)
    if q_doc is not None and k_doc is not None:
        same = q_doc.unsqueeze(-1) == k_doc.unsqueeze(-2)
        real = (q_doc >= 0).unsqueeze(-1) & (k_doc >= 0).unsqueeze(-2)
        mask = mask & same & real
    return mask


def _is_top_left_causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """True iff ``k_pos[j] <= q_pos[i]  <=>  j <= i`` for every row (needs Sq == Sk).

    With k non-decreasing it suffices that each query sees its own index (k_i <= q_i) and not the
    next one (k_{i+1} > q_i); then j <= i gives k_j <= k_i <= q_i and j > i gives k_j >= k_{i+1} > q_i.
    """
    if q_pos.shape[-1] != k_pos.shape[-1]:
        return False
    q, k = torch.broadcast_tensors(q_pos, k_pos)
    k_sorted = bool((k[..., 1:] >= k[..., :-1]).all())
    return k_sorted and bool((k <= q).all()) and bool((k[..., 1:] > q[..., :-1]).all())


def quick_block_kind(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spec: MaskSpec = MaskSpec(),
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    q_end: torch.Tensor | None = None,
) -> BlockKind | None:
    """The block's kind from min/max tests on positions and documents, or None when only an
    ``[Sq, Sk]`` mask can tell (no mask is ever built here). Shapes as in :func:`token_mask`; with
    ``q_end`` (image blocks) the causal tests use each query's end position instead of its position."""
    _check_pair(q_pos, k_pos, q_doc, k_doc, q_end)
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return BlockKind.EMPTY
    docs_uniform = True
    if q_doc is not None and k_doc is not None:
        q_lo, q_hi = int(q_doc.min()), int(q_doc.max())
        k_lo, k_hi = int(k_doc.min()), int(k_doc.max())
        if q_hi < 0 or k_hi < 0 or q_hi < k_lo or k_hi < q_lo:
            return BlockKind.EMPTY  # all padding on one side, or disjoint document ranges
        docs_uniform = q_lo == q_hi == k_lo == k_hi

    q_lo, q_hi = int(q_pos.min()), int(q_pos.max())
    k_lo, k_hi = int(k_pos.min()), int(k_pos.max())
    w = spec.window
    if spec.causal:
        ends = (
            q_pos if q_end is None else q_end
        )  # keys after a query's end are hidden (d >= 0 without blocks)
        if k_lo > (q_hi if q_end is None else int(q_end.max())) or (w is not None and q_lo - k_hi >= w):
            return BlockKind.EMPTY
        window_never_binds = w is None or q_hi - k_lo < w
        if docs_uniform and window_never_binds:
            if k_hi <= q_lo:
                return BlockKind.FULL
            if _is_top_left_causal(ends, k_pos):
                return BlockKind.CAUSAL
    elif w is None:
        if docs_uniform:
            return BlockKind.FULL
    else:
        if k_lo - q_hi >= w or q_lo - k_hi >= w:
            return BlockKind.EMPTY
        if docs_uniform and max(q_hi - k_lo, k_hi - q_lo) < w:
            return BlockKind.FULL
    return None


def classify_block(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spec: MaskSpec = MaskSpec(),
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    q_end: torch.Tensor | None = None,
) -> tuple[BlockKind, torch.Tensor | None]:
    """Classify a (query block, key block) pair; build the mask only when it is PARTIAL.

    Shapes as in :func:`token_mask`. Cheap min/max tests on positions and documents
    (:func:`quick_block_kind`) decide most blocks of contiguous, zigzag and document layouts
    without an ``[Sq, Sk]`` tensor.

    Returns:
        ``(kind, mask)``: ``mask`` is the bool ``[Sq, Sk]`` / ``[B, Sq, Sk]`` mask for PARTIAL, else None.
    """
    kind = quick_block_kind(q_pos, k_pos, spec, q_doc, k_doc, q_end)
    if kind is not None:
        return kind, None
    mask = token_mask(q_pos, k_pos, spec, q_doc, k_doc, q_end)
    if not bool(mask.any()):
        return BlockKind.EMPTY, None
    if bool(mask.all()):
        return BlockKind.FULL, None
    return BlockKind.PARTIAL, mask


def check_chunk(chunk: object) -> int | None:
    """``chunk`` validated: None, or the int >= 1 tokens of an attention chunk."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(
            f"chunk={chunk!r} is invalid: use an int >= 1 (a query sees only the keys of its own chunk of "
            "`chunk` consecutive tokens, Llama 4's attention_chunk_size) or None"
        )
    return chunk


def chunk_doc_ids(
    doc_ids: torch.Tensor | None, chunk: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    """Document ids that also end at every chunk border: chunked attention as packed documents.

    Token ``i`` of a row with ``p`` leading padding tokens (doc id < 0) is in chunk ``(i - p) // chunk``
    (HF's chunked mask counts chunks from the first real token); two tokens see each other only if they
    share their document and their chunk. Padding keeps its negative id.

    Args:
        doc_ids: ``[S]`` / ``[B, S]`` document ids in global order, or None (one document).
        chunk: tokens per chunk.
        seq_len: S.

    Returns:
        ``[S]`` (no ids, or ``[S]`` ids) / ``[B, S]`` int64 ids, unique per (document, chunk).
    """
    index = torch.arange(seq_len, device=device)
    if doc_ids is None:
        return index // chunk
    docs = doc_ids.to(device=device, dtype=torch.int64)
    lead = (torch.cumsum((docs >= 0).to(torch.int64), dim=-1) == 0).sum(dim=-1, keepdim=True)
    chunks = torch.div(index - lead, chunk, rounding_mode="floor")
    per_doc = seq_len // chunk + 2
    return torch.where(docs >= 0, docs * per_doc + chunks.clamp(min=0), docs)
