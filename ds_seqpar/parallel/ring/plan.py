"""The ring engine's plan: which kernel calls one ring step makes, built by pure functions (docs/ring.md).

Legend: S global length over the ring, n local rows, B batch rows; positions are GLOBAL token positions.

For every (this rank's query rows, one K/V block) pair the engine asks :func:`pair_calls` (forward) or
:func:`backward_calls` (backward) for its kernel calls. They classify every (query segment, key
segment) pair of the layouts from global positions and document ids (``ops/masks.py``): EMPTY pairs are
dropped, FULL and CAUSAL pairs need no mask tensor, PARTIAL ones get one (trimmed to the box of their
visible pairs, as a diagonal band when they are one). Then the calls are made as few as the mask allows
(whole-block calls, neighbouring FULL pairs joined, packed documents cut at their boundaries and run as
one varlen or batched call, long sliding-window pairs tiled) and, in backward, cut into tiles so the
kernel's gradient parts exist for one tile at a time.

Everything here is host work done once per batch: results are kept in one LRU cache (``PLAN_CACHE``)
keyed by the plan's layouts, mask spec, document ids and what was asked, so the step loop makes no host
sync. No process group is touched: a plan's schedule is read only for its size and this rank's index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.comm.schedules.base import Schedule
from ds_seqpar.layout import Layout
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse import SparsePattern
from ds_seqpar.parallel.ring.tasks import (
    BACKWARD_TILE_ROWS,
    BlockTask,
    VarlenTask,
    backward_tiles,
    block_tasks,
    varlen_groups,
)
from ds_seqpar.parallel.work import WorkCounter

__all__ = [
    "PLAN_CACHE",
    "PlanCache",
    "RingPlan",
    "backward_calls",
    "has_padding",
    "pair_calls",
    "per_row",
    "query_layout",
    "query_meta",
    "query_rank",
    "segment_pairs",
    "step_tasks",
    "tokens",
]


@dataclass(frozen=True)
class RingPlan:
    """Everything a ring attention call needs besides q, k, v (explicit; nothing global).

    Args:
        schedule: how K/V blocks move (``build_schedule``).
        layout: token layout over the ring; ``layout.world`` must equal the schedule's size.
        spec: causal / sliding window, in global positions.
        doc_ids: document id per token in GLOBAL order, ``[S]`` or ``[B, S]`` (packed batches;
            negative = padding), or None for one document per row.
        kernel: block kernel name (``"auto"``, ``"torch"``, ``"sdpa"``, ``"flash_attn"``).
        work: optional counter of the work this rank computes.
        sparse: a vertical-slash pattern of this rank's query heads (``ops/sparse/pattern.py``): every step
            then runs the sparse block kernel on the whole (query shard, key shard) pair instead of
            the dense kernel per segment pair (the sparse ring, docs/sparse.md). Needs causal.
        softcap: None, or c > 0: every score s becomes c·tanh(s / c) before the softmax (Gemma 2).
        sparse_kernel: the sparse block kernel (``ops/sparse/kernels.py``: ``"auto"``, ``"triton"``,
            ``"blocks"``, ``"masked"``), or a kernel object itself (the DiT block kernel,
            ``ops/sparse/block_kernel.py``); used only with ``sparse``.
        query_layout: None (this rank's queries are ``layout``'s rank ``schedule.ring_rank``), or the
            layout of the query rows when they are not one K/V owner's (team schedules,
            ``parallel/team.py``: the rows of a team, or of a grid row); this rank's queries are then its
            rank ``schedule.query_rank``, and the K/V block a schedule yields with owner ``o`` holds
            ``layout``'s rank ``o``.
        backward_tile: backward tiles have at least this many rows per side (``backward_tiles``).
        alibi: None, or ALiBi slopes ``[h]`` of the query heads this call holds: score (i, j) of head h gains
            ``alibi[h] · (pos_j - pos_i)`` from GLOBAL positions (docs/kernels.md "ALiBi"). Not with ``sparse``.
        reach: None, or per token in the order of ``doc_ids`` (``[S]`` / ``[B, S]`` int64) how many later
            positions of its own image block a query also sees (``ops/image_blocks.py``; 0 for text). Needs
            causal; not with ``sparse``.
    """

    schedule: Schedule
    layout: Layout
    spec: MaskSpec = field(default_factory=MaskSpec)
    doc_ids: torch.Tensor | None = None
    kernel: str = "auto"
    work: WorkCounter | None = None
    sparse: SparsePattern | None = None
    softcap: float | None = None
    sparse_kernel: Any = "auto"
    query_layout: Any = None
    backward_tile: int = BACKWARD_TILE_ROWS
    alibi: torch.Tensor | None = None
    reach: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.reach is not None and (self.sparse is not None or not self.spec.causal):
            raise ValueError("image blocks (reach) need a dense plan with MaskSpec(causal=True)")
        if self.sparse is not None and self.alibi is not None:
            raise ValueError(
                "a sparse (vertical-slash) ring plan cannot apply ALiBi: its kernels take no bias"
            )
        if self.sparse is not None and self.spec.causal != getattr(self.sparse, "causal", True):
            raise ValueError(  # a vertical-slash pattern is causal, a DiT BlockPattern is not (docs/dit_sparse.md)
                f"a sparse ring plan with a {type(self.sparse).__name__} needs MaskSpec(causal="
                f"{getattr(self.sparse, 'causal', True)})"
            )
        if self.query_layout is not None:
            if self.sparse is not None:
                raise ValueError(
                    "a sparse ring plan takes its query positions from `layout`: no query_layout"
                )
            return
        if self.layout.world != self.schedule.size:
            raise ValueError(
                f"layout over {self.layout.world} ranks does not match the ring of {self.schedule.size} ranks; "
                "build the layout with world = ring degree"
            )


def query_layout(plan: RingPlan) -> Any:
    """The layout of the query rows (``plan.layout`` unless a team schedule gives its own)."""
    return plan.layout if plan.query_layout is None else plan.query_layout


def query_rank(plan: RingPlan) -> int:
    """This rank's index in the query layout."""
    return plan.schedule.ring_rank if plan.query_layout is None else plan.schedule.query_rank


class PlanCache:
    """An LRU cache of plan results keyed by (the plan's layouts, mask spec, document ids, what, device).

    Every layer of a forward and its backward build their ring plans from the same document-id tensor
    (the batch's), so block classification and masks (host work, host syncs on a GPU) happen once per
    batch; the step loop itself then makes no host sync and no host-to-device copy. An entry holds its
    document-id (and image-block reach) tensor, so that the tensor's id cannot be reused while the entry lives.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[torch.Tensor | None, Any]] = OrderedDict()

    def get(self, plan: RingPlan, what: tuple, device: torch.device, build: Callable[[], Any]) -> Any:
        """``build()`` once per (plan's layouts, mask spec, document ids, ``what``, device)."""
        docs, reach = plan.doc_ids, plan.reach
        key = (
            plan.layout,
            plan.query_layout,
            plan.spec,
            id(docs),
            None if docs is None else docs._version,
            None if reach is None else (id(reach), reach._version),
            what,
            str(device),
        )
        entry = self._entries.get(key)
        if entry is not None and entry[0][0] is docs and entry[0][1] is reach:
            self._entries.move_to_end(key)
            return entry[1]
        value = build()
        self._entries[key] = ((docs, reach), value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value


PLAN_CACHE = PlanCache()


def tokens(
    plan: RingPlan, seq_len: int, rank: int, device: torch.device, queries: bool = False
) -> tuple[torch.Tensor, Any]:
    """1-D global positions ``[n]`` and document ids (``[n]`` / ``[B, n]`` or None) of ``rank``'s tokens
    (of the query layout with ``queries``, else of the K/V layout), cached (the one lookup of positions
    and documents of the engine)."""
    layout = query_layout(plan) if queries else plan.layout

    def build() -> tuple[torch.Tensor, Any]:
        pos = layout.local_positions(seq_len, rank).to(device)
        doc = None if plan.doc_ids is None else layout.shard(plan.doc_ids, rank, dim=-1).to(device)
        return pos, doc

    side = "queries" if queries and plan.query_layout is not None else "keys"
    return PLAN_CACHE.get(plan, ("tokens", side, seq_len, rank), device, build)


def has_padding(plan: RingPlan, device: torch.device) -> bool:
    """Whether some token is padding (document id < 0): the only rows that see no key at all (every other
    query sees at least itself). Host work once per document-id tensor (cached like the tasks)."""
    if plan.doc_ids is None:
        return False
    return PLAN_CACHE.get(plan, ("padding",), device, lambda: bool((plan.doc_ids < 0).any()))


def per_row(pos: torch.Tensor, doc: Any) -> torch.Tensor:
    """Positions expanded to the documents' ``[B, n]`` when the documents differ per batch row."""
    return pos if doc is None else pos.expand(doc.shape)


def query_meta(plan: RingPlan, seq_len: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """Global positions (per row, with per-row documents) and document ids of this rank's queries."""
    pos, doc = tokens(plan, seq_len, query_rank(plan), device, queries=True)
    return per_row(pos, doc), doc


def query_ends(plan: RingPlan, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """With image blocks (``plan.reach``): the last position each of this rank's queries sees under the causal
    rule, ``[n]`` / ``[B, n]`` (its position plus its reach); else None."""
    if plan.reach is None:
        return None

    def build() -> torch.Tensor:
        pos, _ = tokens(plan, seq_len, query_rank(plan), device, queries=True)
        return pos + query_layout(plan).shard(plan.reach, query_rank(plan), dim=-1).to(device)

    return PLAN_CACHE.get(plan, ("ends", seq_len, query_rank(plan)), device, build)


def step_tasks(plan: RingPlan, seq_len: int, owner: int, q_pos: torch.Tensor, q_doc: Any) -> list[BlockTask]:
    """The block tasks of (this rank's queries, ``owner``'s keys) (``tasks.block_tasks``), once per batch."""

    def build() -> list[BlockTask]:
        k_pos, k_doc = tokens(plan, seq_len, owner, q_pos.device)
        q_segments, k_segments = query_layout(plan).segments(seq_len), plan.layout.segments(seq_len)
        q_end = query_ends(plan, seq_len, q_pos.device)
        return block_tasks(
            plan.spec, q_segments, k_segments, q_pos, per_row(k_pos, k_doc), q_doc, k_doc, q_end=q_end
        )

    return PLAN_CACHE.get(plan, ("tasks", seq_len, query_rank(plan), owner), q_pos.device, build)


def pair_calls(
    plan: RingPlan, seq_len: int, owner: int, q_pos: torch.Tensor, q_doc: Any, batch: int, varlen: bool
) -> list[BlockTask | VarlenTask]:
    """The forward calls for (this rank's queries, ``owner``'s K/V block): runs of per-document tasks grouped
    (one :class:`VarlenTask` for a kernel with a varlen entry point, else one batched call when the
    documents have equal lengths), the other tasks one by one; ``q_pos`` / ``q_doc`` from :func:`query_meta`."""
    device, me = q_pos.device, query_rank(plan)
    found = step_tasks(plan, seq_len, owner, q_pos, q_doc)

    def build() -> list[BlockTask | VarlenTask]:
        groups = varlen_groups(found, batch, device)
        if varlen:
            return groups
        out: list[BlockTask | VarlenTask] = []
        for g in groups:
            out.extend([g] if not isinstance(g, VarlenTask) or g.uniform else g.tasks)
        return out

    return PLAN_CACHE.get(plan, ("groups", seq_len, me, owner, batch, varlen), device, build)


def backward_calls(
    plan: RingPlan, seq_len: int, owner: int, q_pos: torch.Tensor, q_doc: Any, batch: int, varlen: bool
) -> list[BlockTask | VarlenTask]:
    """The backward calls: :func:`pair_calls` with FULL rectangles cut at segment boundaries and into tiles
    (:func:`backward_tiles`, at least ``plan.backward_tile`` rows a side); one rank with its own rows keeps
    the forward's calls (the parts are then the gradients themselves)."""
    calls = pair_calls(plan, seq_len, owner, q_pos, q_doc, batch, varlen)
    if plan.schedule.size == 1 and plan.query_layout is None:
        return calls
    tile, me = plan.backward_tile, query_rank(plan)
    q_segments, k_segments = query_layout(plan).segments(seq_len), plan.layout.segments(seq_len)
    key = ("backward", seq_len, me, owner, batch, varlen, tile)
    return PLAN_CACHE.get(
        plan, key, q_pos.device, lambda: backward_tiles(calls, q_segments, k_segments, tile)
    )


def segment_pairs(plan: RingPlan, seq_len: int) -> int:
    """(query segment, key segment) pairs of one step: what the work counter counts blocks against."""
    return len(query_layout(plan).segments(seq_len)) * len(plan.layout.segments(seq_len))
