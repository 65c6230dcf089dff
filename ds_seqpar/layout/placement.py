"""Document-aware placement: which tokens of a packed row each ring rank holds (docs/balance.md).

Legend: S tokens in the row, R ranks, n = S / R tokens per rank, L_d the document lengths (their sum
<= S; the rest of the row is padding), W the sliding window (or none).

The attention work of a query token is the number of keys it sees: ``min(i + 1, W)`` at position i of
its document under a causal mask; padding does none. A placement gives every rank exactly n tokens and
aims to give each the same work:

1. documents are taken in decreasing work; one whose work exceeds ``threshold`` x the per-rank target
   is cut head-tail: rank c gets the c-th piece from its start and the c-th piece from its end, each
   about L / 2R tokens (a document of 2R equal pieces is cut exactly as zigzag cuts a row), so every rank
   gets an early and a late part of it and the same work to within a few tokens;
2. the other documents go whole, each to the rank with the least work that has room for it; one that
   no rank has room for is cut across the ranks with room, least work first;
3. padding fills the room that is left.

A row whose documents all fit one rank is first planned with every document whole (no exchange at
all, docs/balance.md "Rows of short documents"); that plan is kept when its max / mean work is within
``tolerance``. When the result's max / mean work exceeds ``tolerance``, the plan is redone with a threshold
four times lower (more documents cut head-tail), down to threshold 0 (every document of at least 2R tokens cut).
Pure: no process group; every rank computes the same plan from the same lengths.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ds_seqpar.layout.base import Layout, LayoutError, padded_length
from ds_seqpar.layout.documents import document_lengths
from ds_seqpar.layout.ring import ZigzagLayout, register_layout

__all__ = [
    "PLACEMENT_TOLERANCE",
    "DocumentsLayout",
    "PlacedRow",
    "Placement",
    "Run",
    "check_lengths",
    "document_work",
    "layout_work",
    "place_documents",
    "token_work",
]

PLACEMENT_TOLERANCE = 1.02  # max / mean work a plan may have before more documents are cut head-tail
FIRST_THRESHOLD = 0.25  # a document above this fraction of the per-rank target is cut head-tail at first
THRESHOLD_STEP = 4.0  # each retry lowers the threshold by this factor
MIN_THRESHOLD = 1e-4  # below it the next retry cuts every document (threshold 0)

Run = tuple[int, int]  # a run of consecutive global positions [start, stop)


def check_lengths(lengths: Sequence[int], seq_len: int, world: int) -> list[int]:
    docs = [int(x) for x in lengths]
    if world < 1:
        raise LayoutError(f"placement world={world} must be >= 1 (the number of ring ranks)")
    if any(x < 1 for x in docs):
        raise LayoutError(f"document lengths {docs[:8]}... must all be >= 1 (drop empty documents)")
    if sum(docs) > seq_len:
        raise LayoutError(
            f"the documents hold {sum(docs)} tokens, more than the row's {seq_len}; pass the row length S "
            f">= the sum of the lengths"
        )
    if seq_len % world:
        raise LayoutError(
            f"sequence length {seq_len} cannot be placed on {world} ranks: every rank holds the same number of "
            f"tokens, so S must be a multiple of {world}; pad it to {padded_length(seq_len, world)}"
        )
    return docs


def document_work(length: int, window: int | None) -> int:
    """Visible (query, key) pairs of one causal document of ``length`` tokens."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def token_work(lengths: Sequence[int], seq_len: int, window: int | None = None) -> torch.Tensor:
    """Keys each query token sees under a causal mask inside its document: float64 ``[S]`` (padding 0)."""
    docs = check_lengths(lengths, seq_len, 1)
    work = torch.zeros(seq_len, dtype=torch.float64)
    start = 0
    for length in docs:
        seen = torch.arange(1, length + 1, dtype=torch.float64)
        work[start : start + length] = seen if window is None else seen.clamp(max=window)
        start += length
    return work


def layout_work(
    layout: Layout, lengths: Sequence[int], seq_len: int, window: int | None = None
) -> list[float]:
    """Each rank's attention work (visible pairs of its query tokens) when ``layout`` shards the row."""
    work = token_work(lengths, seq_len, window)
    return [float(work[layout.local_positions(seq_len, r)].sum()) for r in range(layout.world)]


class PlacedRow(Layout):
    """What every per-batch placement of one row shares: it holds exactly ``seq_len`` tokens, each rank's
    shard is one segment (its runs differ per rank; the engine cuts at document ends), no recurrent scan
    order, and its balance is max / mean of its planned ``work`` per rank."""

    seq_len: int
    work: tuple[float, ...]
    replan: ClassVar[str] = "ds_seqpar.layout.place_documents"  # what the length error says to call again

    @property
    def multiple(self) -> int:
        return self.seq_len

    def check_length(self, seq_len: int) -> None:
        if seq_len != self.seq_len:
            raise LayoutError(
                f"sequence length {seq_len} does not match this document placement of {self.seq_len} tokens; "
                f"place each row's documents again ({self.replan})"
            )

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        """One segment, the whole shard."""
        return [(0, seq_len // self.world)]

    def scan_chain(self) -> tuple[int, ...] | None:
        """None: the runs differ per batch, so recurrent scans have no fixed order of ranks."""
        return None

    @property
    def balance(self) -> float:
        """max / mean of the planned work (1.0 = perfect; 1.0 when there is no work at all)."""
        work = self.work
        mean = sum(work) / max(len(work), 1)
        return max(work) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Placement(PlacedRow):
    """An explicit placement of a row's tokens on ``world`` ranks: rank r holds ``runs[r]`` (runs of
    consecutive global positions, in increasing order), every rank the same number of tokens.

    Built by :func:`place_documents` from the row's document lengths; ``work`` is each rank's attention
    work under the mask it was planned for; ``whole``: no document is cut, so the attention of this
    batch needs no exchange between the ranks (``parallel/usp.py`` then skips the ring).
    """

    runs: tuple[tuple[Run, ...], ...]
    seq_len: int
    work: tuple[float, ...] = ()
    whole: bool = False  # every document on one rank: no rank's queries see another rank's keys

    name = "documents"

    def __post_init__(self) -> None:
        counts = {sum(b - a for a, b in rank) for rank in self.runs}
        flat = sorted(run for rank in self.runs for run in rank)
        covered = all(flat[i][1] == flat[i + 1][0] for i in range(len(flat) - 1))
        if len(counts) != 1 or not flat or flat[0][0] != 0 or flat[-1][1] != self.seq_len or not covered:
            raise LayoutError(
                f"a Placement needs every position 0..{self.seq_len - 1} exactly once and the same number of "
                "tokens on every rank"
            )
        if any(list(rank) != sorted(rank) for rank in self.runs):
            raise LayoutError("a Placement keeps each rank's runs in increasing order")

    @property
    def world(self) -> int:  # type: ignore[override]
        return len(self.runs)

    def described(self) -> str:
        return f"a document placement of {self.seq_len} tokens over {self.world} ranks"

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check_length(seq_len)
        self.check_rank(rank)
        return torch.cat([torch.arange(a, b) for a, b in self.runs[rank]])

    @property
    def needs_exchange(self) -> bool:
        return not self.whole

    def local_doc_ids(self, doc_ids: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s document ids (``[n]`` / ``[B, n]``) of the global ``doc_ids``, once per tensor (every
        layer of a step asks with the same one; a new tensor each call would rebuild the ring plan)."""
        key = ("local", id(doc_ids), doc_ids._version, rank, self)
        return per_batch(key, doc_ids, lambda: self.shard(doc_ids, rank, dim=-1))


def place_documents(
    lengths: Sequence[int],
    seq_len: int,
    world: int,
    *,
    window: int | None = None,
    tolerance: float = PLACEMENT_TOLERANCE,
) -> Placement:
    """Place a packed row's documents on ``world`` ranks with balanced causal attention work (module doc).

    Args:
        lengths: the documents' token counts in row order (their sum <= ``seq_len``; the rest is padding).
        seq_len: S, a multiple of ``world``.
        world: R, the ranks sharing the row (the ring degree).
        window: sliding window W of the attention, or None.
        tolerance: the max / mean work accepted before more documents are cut head-tail.
    """
    docs = check_lengths(lengths, seq_len, world)
    if window is not None and window < 1:
        raise LayoutError(f"window={window} must be >= 1 or None")
    if world > 1 and max(docs, default=0) <= seq_len // world:  # every document could stay whole
        plan = _place(docs, seq_len, world, window, math.inf)
        if plan.whole and plan.balance <= tolerance:
            return plan
    threshold = FIRST_THRESHOLD
    while True:
        plan = _place(docs, seq_len, world, window, threshold)
        if plan.balance <= tolerance or threshold == 0.0:
            return plan
        threshold = threshold / THRESHOLD_STEP if threshold / THRESHOLD_STEP >= MIN_THRESHOLD else 0.0


def _place(docs: list[int], seq_len: int, world: int, window: int | None, threshold: float) -> Placement:
    """One plan at one threshold (module doc, steps 1-3)."""
    per_token = token_work(docs, seq_len, window)
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64), per_token.cumsum(0)])
    starts = [0]
    for length in docs:
        starts.append(starts[-1] + length)
    works = [document_work(length, window) for length in docs]
    target = sum(works) / world
    runs: list[list[Run]] = [[] for _ in range(world)]
    work, room = [0.0] * world, [seq_len // world] * world

    def give(rank: int, a: int, b: int) -> None:
        runs[rank].append((a, b))
        work[rank] += float(prefix[b] - prefix[a])
        room[rank] -= b - a

    order = sorted(range(len(docs)), key=lambda d: (-works[d], d))
    whole = []
    for d in order:
        length, start = docs[d], starts[d]
        if length >= 2 * world and works[d] > threshold * target:
            head, tail = start, start + length
            for c, share in enumerate(_shares(length, room)):
                give(c, head, head + share // 2)
                give(c, tail - (share - share // 2), tail)
                head, tail = head + share // 2, tail - (share - share // 2)
        else:
            whole.append(d)
    cut = len(whole) < len(docs)  # some document went head-tail
    for d in whole:
        a, b = starts[d], starts[d] + docs[d]
        fits = [r for r in range(world) if room[r] >= b - a]
        if fits:
            give(min(fits, key=lambda r: (work[r], r)), a, b)
            continue
        cut = True
        for r in sorted((r for r in range(world) if room[r] > 0), key=lambda r: (work[r], r)):
            take = min(room[r], b - a)
            give(r, a, a + take)
            a += take
            if a == b:
                break
    position = starts[-1]  # padding fills what room is left
    for r in range(world):
        if room[r]:
            size = room[r]
            give(r, position, position + size)
            position += size
    placed = tuple(tuple(_merged(sorted(rank))) for rank in runs)
    return Placement(placed, seq_len, tuple(work), whole=world == 1 or not cut)


def _shares(length: int, room: list[int]) -> list[int]:
    """Tokens of a head-tail document per rank: L // R each, the L mod R extra ones to the roomiest ranks
    (so the ranks' room stays within one token of each other and every share fits)."""
    world = len(room)
    shares = [length // world] * world
    for r in sorted(range(world), key=lambda r: (-room[r], r))[: length % world]:
        shares[r] += 1
    return shares


def _merged(runs: list[Run]) -> list[Run]:
    """Neighbouring runs joined into one."""
    out: list[Run] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


PLACEMENTS: OrderedDict[tuple, tuple[torch.Tensor, object]] = OrderedDict()
PLACEMENT_CACHE_SIZE = 16  # placements and local document ids kept (every layer of a step asks alike)


def per_batch(key: tuple, doc_ids: torch.Tensor, build: Callable[[], Any]) -> Any:
    """``build()``'s value for ``doc_ids`` under ``key``, built once per tensor (every layer of a step asks
    with the same one). An entry holds its tensor, so the tensor's id cannot be reused while it lives."""
    entry = PLACEMENTS.get(key)
    if entry is not None and entry[0] is doc_ids:
        PLACEMENTS.move_to_end(key)
        return entry[1]
    value = build()
    PLACEMENTS[key] = (doc_ids, value)
    while len(PLACEMENTS) > PLACEMENT_CACHE_SIZE:
        PLACEMENTS.popitem(last=False)
    return value


@register_layout
@dataclass(frozen=True)
class DocumentsLayout(ZigzagLayout):
    """Per batch, the row's documents placed on the ranks with balanced causal work (``place_documents``);
    a batch without document ids is zigzag (what the placement of one document is)."""

    name: ClassVar[str] = "documents"
    per_batch: ClassVar[bool] = True
    summary: ClassVar[str] = (
        "per packed batch: whole short documents and head-tail pieces of long ones, balanced causal work "
        "(docs/balance.md)"
    )

    def for_batch(self, doc_ids: torch.Tensor) -> Layout:
        """The placement of ``doc_ids``'s documents (``[S]`` / ``[B, S]``, rows alike), once per tensor."""
        key = (id(doc_ids), doc_ids._version, self.world)
        return per_batch(
            key, doc_ids, lambda: place_documents(document_lengths(doc_ids), doc_ids.shape[-1], self.world)
        )

    def scan_chain(self) -> tuple[int, ...] | None:
        """None: each batch has its own runs (recurrent scans need ``contiguous`` or ``zigzag``)."""
        return None
