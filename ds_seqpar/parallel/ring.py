"""The ring engine: one autograd Function for every ring-shaped attention (docs/ring.md).

Legend:
    B, H, H_kv, D  batch, query heads, key/value heads, head dim
    R              ranks in the ring (the schedule's size); S = global length over the ring
    n = S / R      local tokens; q ``[B, n, H, D]``, k/v ``[B, n, H_kv, D]`` in the layout's order
    out ``[B, n, H, D]`` (q.dtype), lse ``[B, H, n]`` (fp32, fp64 for fp64 inputs)

A variant is a triple, not a file:
    schedule  which K/V block a rank holds at each step and how blocks move (``comm/p2p.py``:
              single ring, double ring, all-gather)
    layout    which global positions each rank holds (``layout.py``: contiguous, zigzag, stripe);
              its ``segments`` are the sub-blocks the engine classifies
    kernel    the block attention (``ops/attention.py``: torch, sdpa, flash_attn)

Every (query segment, key segment) pair is classified from global positions and document ids
(``ops/masks.py``): EMPTY pairs are skipped (this is what makes zigzag and stripes balanced), FULL
and CAUSAL pairs run without a mask tensor, PARTIAL pairs with one. Forward merges the partial
``(out, lse)`` in fp32 (log-sigmoid form, ``ops/merge.py``); backward re-circulates K/V, carries the
dK/dV accumulators with their blocks and keeps dq local (docs/ring.md "How a step works"). GQA moves only the
H_kv heads. Communication lives entirely in the schedule; this module never calls a collective.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_seqpar.comm.schedule import SCHEDULES, Schedule, build_schedule
from ds_seqpar.layout import GroupLayout, PieceLayout, SeqLayout
from ds_seqpar.ops.attention import AttentionKernel, block_attn_backward, block_attn_forward, kernel_for
from ds_seqpar.ops.masks import BlockKind, MaskSpec, classify_block, quick_block_kind
from ds_seqpar.ops.merge import apply_sink, inert_empty_rows, merge_attn_, sink_grad
from ds_seqpar.ops.sparse import SparsePattern
from ds_seqpar.ops.sparse_kernels import resolve_sparse_kernel, visible_pairs
from ds_seqpar.parallel.work import WorkCounter

__all__ = [
    "SCHEDULES",
    "RingPlan",
    "Schedule",
    "WorkCounter",
    "build_schedule",
    "check_qkv",
    "engine_backward",
    "engine_forward",
    "engine_pair_backward",
    "plan_layouts",
    "ring_attention",
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
        sparse: a vertical-slash pattern of this rank's query heads (``ops/sparse.py``): every step
            then runs the sparse block kernel on the whole (query shard, key shard) pair instead of
            the dense kernel per segment pair (the sparse ring, docs/sparse.md). Needs causal.
        softcap: None, or c > 0: every score s becomes c·tanh(s / c) before the softmax (Gemma 2).
        sparse_kernel: the sparse block kernel (``ops/sparse_kernels.py``: ``"auto"``, ``"triton"``,
            ``"blocks"``, ``"masked"``); used only with ``sparse``.
        query_layout: None (this rank's queries are ``layout``'s rank ``schedule.ring_rank``), or the
            layout of the query rows when they are not one K/V owner's (team schedules,
            ``parallel/team.py``: the rows of a team, or of a grid row); this rank's queries are then its
            rank ``schedule.query_rank``, and the K/V block a schedule yields with owner ``o`` holds
            ``layout``'s rank ``o``.
    """

    schedule: Schedule
    layout: SeqLayout
    spec: MaskSpec = field(default_factory=MaskSpec)
    doc_ids: torch.Tensor | None = None
    kernel: str = "auto"
    work: WorkCounter | None = None
    sparse: SparsePattern | None = None
    softcap: float | None = None
    sparse_kernel: str = "auto"
    query_layout: Any = None

    def __post_init__(self) -> None:
        if self.sparse is not None and not self.spec.causal:
            raise ValueError("a sparse (vertical-slash) ring plan needs MaskSpec(causal=True)")
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


def _q_layout(plan: RingPlan) -> Any:
    """The layout of the query rows (``plan.layout`` unless a team schedule gives its own)."""
    return plan.layout if plan.query_layout is None else plan.query_layout


def _query_rank(plan: RingPlan) -> int:
    """This rank's index in the query layout."""
    return plan.schedule.ring_rank if plan.query_layout is None else plan.schedule.query_rank


@dataclass(frozen=True)
class _BlockTask:
    """One kernel call: a rectangle of (query rows, key rows) with its mask, covering
    ``segment_pairs`` (query segment, key segment) pairs of the layout."""

    q_rows: slice
    k_rows: slice
    kind: BlockKind
    mask: torch.Tensor | None
    segment_pairs: int = 1
    band: tuple[int, int] | None = None  # PARTIAL masks that are a diagonal band: flash-style (left, right)
    visible: int | None = None  # PARTIAL: the mask's visible pairs per batch row (set once, by _trimmed)

    @property
    def pairs(self) -> int:
        """Visible score pairs of the call (the work an ideal kernel does): the rectangle when FULL, its
        lower-left part under a CAUSAL mask (query i sees keys 0..i of the block), the mask's count when
        PARTIAL."""
        rows, cols = self.q_rows.stop - self.q_rows.start, self.k_rows.stop - self.k_rows.start
        if self.kind is BlockKind.PARTIAL and self.visible is not None:
            return self.visible
        if self.kind is not BlockKind.CAUSAL:
            return rows * cols
        full = min(rows, cols)
        return full * (full + 1) // 2 + (rows - full) * cols


def _join_full(tasks: list[_BlockTask], along_keys: bool) -> list[_BlockTask]:
    """Merge neighbouring FULL tasks into one call: same query rows and adjacent key rows
    (``along_keys``), or same key rows and adjacent query rows."""
    out: list[_BlockTask] = []
    for task in tasks:
        last = out[-1] if out else None
        if last is not None and last.kind is task.kind is BlockKind.FULL:
            same, prev, cur = (
                (last.q_rows == task.q_rows, last.k_rows, task.k_rows)
                if along_keys
                else (last.k_rows == task.k_rows, last.q_rows, task.q_rows)
            )
            if same and prev.stop == cur.start:
                rows = slice(prev.start, cur.stop)
                q_rows, k_rows = (task.q_rows, rows) if along_keys else (rows, task.k_rows)
                out[-1] = _BlockTask(
                    q_rows, k_rows, BlockKind.FULL, None, last.segment_pairs + task.segment_pairs
                )
                continue
        out.append(task)
    return out


BACKWARD_TILES = 4  # a FULL (query segment, key segment) piece runs as up to 4 x 4 tiles in backward
BACKWARD_TILE_MIN = 1024  # rows per tile side, at least (small blocks stay one call)


def _tiles(rows: slice, min_rows: int) -> list[slice]:
    """``rows`` cut into up to ``BACKWARD_TILES`` nearly equal runs of at least ``min_rows`` rows."""
    length = rows.stop - rows.start
    count = max(1, min(BACKWARD_TILES, length // min_rows))
    bounds = [rows.start + (length * i) // count for i in range(count + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _backward_tiles(
    tasks: list[Any],
    q_segments: list[tuple[int, int]],
    k_segments: list[tuple[int, int]],
    min_rows: int = BACKWARD_TILE_MIN,
) -> list[Any]:
    """The backward's calls: FULL tasks cut at segment boundaries, then each piece into tiles
    (``_tiles``) along queries and keys; square CAUSAL tasks cut the same way on both axes, into
    CAUSAL diagonal tiles and FULL tiles below them (the tiles above see nothing). The backward
    kernel's dq / dk / dv parts then exist for one tile at a time (1/16 of a segment pair's), and so
    does the output a call takes (``_Rows.final_out``). Other tasks unchanged; the same pairs."""

    def cuts(rows: slice, segments: list[tuple[int, int]]) -> list[slice]:
        pieces = [slice(max(a, rows.start), min(b, rows.stop)) for a, b in segments]
        return [
            tile for p in ([p for p in pieces if p.start < p.stop] or [rows]) for tile in _tiles(p, min_rows)
        ]

    def shifted(rows: slice, by: int) -> slice:
        return slice(rows.start + by, rows.stop + by)

    out: list[Any] = []
    for task in tasks:
        square = isinstance(task, _BlockTask) and task.mask is None and task.band is None
        if square and task.kind is BlockKind.FULL:
            pieces = [
                _BlockTask(qr, kr, BlockKind.FULL, None)
                for qr in cuts(task.q_rows, q_segments)
                for kr in cuts(task.k_rows, k_segments)
            ]
        elif square and task.kind is BlockKind.CAUSAL:
            rows, by = cuts(task.q_rows, q_segments), task.k_rows.start - task.q_rows.start
            pieces = [
                _BlockTask(qr, shifted(kr, by), BlockKind.CAUSAL if a == b else BlockKind.FULL, None)
                for a, qr in enumerate(rows)
                for b, kr in enumerate(rows[: a + 1])
            ]
        else:
            pieces = [task]
        out += [task] if len(pieces) == 1 else pieces
    return out


@dataclass(frozen=True)
class _VarlenTask:
    """Adjacent tasks of one kind (FULL, or square CAUSAL: the documents of a packed row) run as ONE
    call: of a kernel's varlen entry point (rows ``q_rows`` / ``k_rows`` of every batch row flattened to
    ``[B·Lq]`` / ``[B·Lk]``, ``cu_q`` / ``cu_k`` (int32, on the device) the sequence boundaries there), or,
    when every sequence has ``uniform`` query and key rows, of any kernel with the sequences as batch
    rows ``[B·n, uniform, H, D]``. ``tasks``: the tasks it replaces (run one by one otherwise)."""

    q_rows: slice
    k_rows: slice
    causal: bool
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    pairs: int
    segment_pairs: int
    tasks: tuple[_BlockTask, ...]
    uniform: int


def _packable(task: _BlockTask) -> bool:
    return task.mask is None and task.kind in (BlockKind.FULL, BlockKind.CAUSAL)


def _pack(run: list[_BlockTask], batch: int, device: torch.device) -> _VarlenTask:
    q_len = [t.q_rows.stop - t.q_rows.start for t in run]
    k_len = [t.k_rows.stop - t.k_rows.start for t in run]

    def bounds(lengths: list[int]) -> torch.Tensor:
        edges = torch.tensor([0] + lengths * batch).cumsum(0)
        return edges.to(device=device, dtype=torch.int32)

    return _VarlenTask(
        slice(run[0].q_rows.start, run[-1].q_rows.stop),
        slice(run[0].k_rows.start, run[-1].k_rows.stop),
        run[0].kind is BlockKind.CAUSAL,
        bounds(q_len),
        bounds(k_len),
        max(q_len),
        max(k_len),
        sum(t.pairs for t in run),
        sum(t.segment_pairs for t in run),
        tuple(run),
        q_len[0] if len(set(q_len + k_len)) == 1 else 0,
    )


def _varlen_groups(
    tasks: list[_BlockTask], batch: int, device: torch.device
) -> list[_BlockTask | _VarlenTask]:
    """``tasks`` with every run of >= 2 adjacent packable tasks of one kind (consecutive query rows AND
    consecutive key rows: the per-document tasks of packed rows) replaced by one :class:`_VarlenTask`."""
    out: list[_BlockTask | _VarlenTask] = []
    run: list[_BlockTask] = []

    def flush() -> None:
        out.extend([_pack(run, batch, device)] if len(run) > 1 else run)
        run.clear()

    for task in tasks:
        if run and _packable(task) and task.kind is run[-1].kind:
            last = run[-1]
            if last.q_rows.stop == task.q_rows.start and last.k_rows.stop == task.k_rows.start:
                run.append(task)
                continue
        flush()
        if _packable(task):
            run.append(task)
        else:
            out.append(task)
    flush()
    return out


def _trimmed(task: _BlockTask) -> _BlockTask:
    """A PARTIAL task cut to the bounding box of its visible pairs (rows and keys outside it see nothing:
    no work for them), with ``band`` set when the box's mask is a diagonal band lo <= j - i <= hi (a
    sliding window): then ``(left, right)`` in flash-attn's bottom-right convention (key j visible to
    query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right) describe it exactly, and kernels with a
    window mode need no mask (docs/ring.md "Windows"). Host work, done once per plan."""
    mask = task.mask
    flat = mask if mask.dim() == 2 else mask.any(0)
    rows, cols = flat.any(1).nonzero().squeeze(1), flat.any(0).nonzero().squeeze(1)
    qs, qe, ks, ke = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    box = mask[..., qs:qe, ks:ke]
    band = None
    if mask.dim() == 2 or bool((box == box[:1]).all()):
        plain = box if box.dim() == 2 else box[0]
        diag = (
            torch.arange(ke - ks, device=mask.device)[None, :]
            - torch.arange(qe - qs, device=mask.device)[:, None]
        )
        lo, hi = int(diag[plain].min()), int(diag[plain].max())
        if torch.equal(plain, (diag >= lo) & (diag <= hi)):
            shift = (ke - ks) - (qe - qs)
            band = (shift - lo, hi - shift)  # both >= 0: the box's last row sees its last key
    start_q, start_k = task.q_rows.start, task.k_rows.start
    return dataclasses.replace(
        task,
        q_rows=slice(start_q + qs, start_q + qe),
        k_rows=slice(start_k + ks, start_k + ke),
        mask=box.contiguous(),
        band=band,
        visible=int(box.sum()) // (box.shape[0] if box.dim() == 3 else 1),
    )


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """``(id, start, end)`` of the runs of equal values of a 1-D tensor, or None when an id other than
    padding (< 0) forms more than one run."""
    values = ids.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1], i + 1)
        else:
            runs.append((value, i, i + 1))
    real = [r[0] for r in runs if r[0] >= 0]
    return runs if len(real) == len(set(real)) else None


def _shared_rows(x: torch.Tensor) -> torch.Tensor | None:
    """A ``[S]`` / ``[B, S]`` tensor as ``[S]`` when every batch row is the same, else None."""
    if x.dim() == 1:
        return x
    return x[0] if bool((x == x[:1]).all()) else None


def _document_tasks(
    plan: RingPlan,
    q_rows: tuple[int, int],
    k_rows: tuple[int, int],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
) -> list[_BlockTask] | None:
    """A segment pair that packed documents make PARTIAL, cut at document boundaries: one call per
    document present on both sides (FULL, CAUSAL, or PARTIAL with a small mask for windows), so no
    work is spent on pairs of different documents (docs/ring.md, "Packed documents"). None when the
    batch rows hold different documents or a document is split into several runs."""
    (qa, qb), (ka, kb) = q_rows, k_rows
    qd, kd = _shared_rows(q_doc[..., qa:qb]), _shared_rows(k_doc[..., ka:kb])
    qp, kp = _shared_rows(q_pos[..., qa:qb]), _shared_rows(k_pos[..., ka:kb])
    if qd is None or kd is None or qp is None or kp is None:
        return None
    q_runs, k_runs = _runs(qd), _runs(kd)
    if q_runs is None or k_runs is None:
        return None
    keys = {doc: (start, end) for doc, start, end in k_runs if doc >= 0}
    tasks: list[_BlockTask] = []
    for doc, start, end in q_runs:
        if doc < 0 or doc not in keys:
            continue
        ks, ke = keys[doc]
        kind, mask = classify_block(qp[start:end], kp[ks:ke], plan.spec)
        if kind is not BlockKind.EMPTY:
            task = _BlockTask(slice(qa + start, qa + end), slice(ka + ks, ka + ke), kind, mask, 0)
            tasks.append(_trimmed(task) if kind is BlockKind.PARTIAL else task)
    if tasks:
        tasks[0] = dataclasses.replace(tasks[0], segment_pairs=1)
    return tasks


def window_tile(window: int) -> int:
    """Tile edge (tokens) of the window tiling: ``window`` clamped to [128, 1024]."""
    return max(128, min(1024, window))


def _consecutive(pos: torch.Tensor) -> bool:
    """Whether a 1-D position tensor is one run ``p0, p0 + 1, ...``."""
    if pos.dim() != 1 or pos.numel() < 2:
        return pos.dim() == 1
    return int(pos[-1]) - int(pos[0]) == pos.numel() - 1 and bool((pos[1:] - pos[:-1] == 1).all())


def _window_tasks(
    plan: RingPlan, q_seg: tuple[int, int], k_seg: tuple[int, int], q_pos: torch.Tensor, k_pos: torch.Tensor
) -> list[_BlockTask] | None:
    """A long segment pair under a sliding window, cut into tiles of :func:`window_tile` tokens: only the
    tiles the window reaches are classified, so no ``[Sq, Sk]`` mask of the whole pair is ever built (at
    S = 1M it would not fit). Tiles the window covers run as FULL / CAUSAL calls (neighbours joined), the
    window's edge tiles as small PARTIAL (band) calls whose masks are shared: with consecutive positions a
    tile's mask depends only on its offset. None when the pair is small or its positions are not runs
    (docs/ring.md "Windows")."""
    spec, w = plan.spec, plan.spec.window
    (qa, qb), (ka, kb) = q_seg, k_seg
    if w is None or q_pos.dim() != 1 or k_pos.dim() != 1:
        return None
    tile = window_tile(w)
    if max(qb - qa, kb - ka) <= 4 * tile:
        return None
    qp, kp = q_pos[qa:qb], k_pos[ka:kb]
    if quick_block_kind(qp, kp, spec) is not None or not (_consecutive(qp) and _consecutive(kp)):
        return None  # the whole pair is one EMPTY / FULL / CAUSAL call, or its positions are not runs
    q0, k0, nk = int(qp[0]), int(kp[0]), kb - ka
    shared: dict[tuple[int, int, int], _BlockTask] = {}
    tasks: list[_BlockTask] = []
    for a in range(0, qb - qa, tile):
        b = min(a + tile, qb - qa)
        lo = q0 + a - (w - 1) - k0  # key rows (relative to ka) this query tile may see
        hi = q0 + b - 1 + (0 if spec.causal else w - 1) - k0
        first, last = max(0, lo), min(nk - 1, hi)
        for c in range(first - first % tile, last + 1, tile):
            d = min(c + tile, nk)
            key = (q0 + a - k0 - c, b - a, d - c)
            if key not in shared:
                kind, mask = classify_block(qp[a:b], kp[c:d], spec)
                rel = _BlockTask(slice(0, b - a), slice(0, d - c), kind, mask, 0)
                shared[key] = _trimmed(rel) if kind is BlockKind.PARTIAL else rel
            rel = shared[key]
            if rel.kind is BlockKind.EMPTY:
                continue
            tasks.append(dataclasses.replace(
                rel,
                q_rows=slice(qa + a + rel.q_rows.start, qa + a + rel.q_rows.stop),
                k_rows=slice(ka + c + rel.k_rows.start, ka + c + rel.k_rows.stop),
            ))  # fmt: skip
    if tasks:
        tasks[0] = dataclasses.replace(tasks[0], segment_pairs=1)
    return tasks


def _tasks(plan: RingPlan, seq_len: int, owner: int, q_pos: torch.Tensor, q_doc: Any) -> list[_BlockTask]:
    """The kernel calls for (this rank's queries, ``owner``'s keys); EMPTY pairs dropped.

    Segment pairs are classified from global positions; the calls are then as few as the mask
    allows: the whole block in one call when it is FULL or top-left CAUSAL as a whole (the own
    step of zigzag), else neighbouring FULL pairs joined into one rectangle, and pairs that packed
    documents make PARTIAL cut at document boundaries. Host work (with host syncs on a GPU): done
    once per (plan, length, owner) by :func:`_cached_tasks`.
    """
    k_pos, k_doc = _tokens(plan, seq_len, owner, q_pos.device)
    k_pos = _per_row(k_pos, k_doc)  # per-row documents need per-row positions
    q_segments, k_segments = _q_layout(plan).segments(seq_len), plan.layout.segments(seq_len)
    if len(q_segments) * len(k_segments) > 1:
        whole = quick_block_kind(q_pos, k_pos, plan.spec, q_doc, k_doc)
        if whole is BlockKind.EMPTY:
            return []
        if whole in (BlockKind.FULL, BlockKind.CAUSAL):
            covered = len(q_segments) * len(k_segments)
            if whole is BlockKind.CAUSAL:  # no pair above the diagonal
                covered = sum(
                    quick_block_kind(q_pos[..., qa:qb], k_pos[..., ka:kb], plan.spec) is not BlockKind.EMPTY
                    for qa, qb in q_segments
                    for ka, kb in k_segments
                )
            return [_BlockTask(slice(0, q_pos.shape[-1]), slice(0, k_pos.shape[-1]), whole, None, covered)]
    tasks = []
    for qa, qb in q_segments:
        for ka, kb in k_segments:
            tiled = None if q_doc is not None else _window_tasks(plan, (qa, qb), (ka, kb), q_pos, k_pos)
            if tiled is not None:
                tasks += tiled
                continue
            kind, mask = classify_block(
                q_pos[..., qa:qb],
                k_pos[..., ka:kb],
                plan.spec,
                None if q_doc is None else q_doc[..., qa:qb],
                None if k_doc is None else k_doc[..., ka:kb],
            )
            if kind is BlockKind.EMPTY:
                continue
            if kind is BlockKind.PARTIAL and q_doc is not None:
                split = _document_tasks(plan, (qa, qb), (ka, kb), q_pos, k_pos, q_doc, k_doc)
                if split is not None:
                    tasks += split
                    continue
            task = _BlockTask(slice(qa, qb), slice(ka, kb), kind, mask)
            tasks.append(_trimmed(task) if kind is BlockKind.PARTIAL else task)
    return _join_full(_join_full(tasks, along_keys=True), along_keys=False)


PLAN_CACHE_SIZE = 64


@dataclass
class _PlanEntry:
    doc_ids: torch.Tensor | None  # held, so that its id cannot be reused while the entry lives
    value: Any


_PLANS: OrderedDict[tuple, _PlanEntry] = OrderedDict()


def _cached(plan: RingPlan, what: tuple, device: torch.device, build: Callable[[], Any]) -> Any:
    """``build()`` once per (plan's layout, mask spec, document ids, ``what``, device), LRU-cached.

    Every layer of a forward and its backward build their ring plans from the same document-id tensor
    (the batch's), so block classification and masks (host work, host syncs on a GPU) happen once per
    batch; the step loop itself then makes no host sync and no host-to-device copy.
    """
    docs = plan.doc_ids
    key = (
        plan.layout,
        plan.query_layout,
        plan.spec,
        id(docs),
        None if docs is None else docs._version,
        what,
        str(device),
    )
    entry = _PLANS.get(key)
    if entry is not None and entry.doc_ids is docs:
        _PLANS.move_to_end(key)
        return entry.value
    value = build()
    _PLANS[key] = _PlanEntry(docs, value)
    while len(_PLANS) > PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return value


def _cached_tasks(
    plan: RingPlan, seq_len: int, owner: int, q_pos: torch.Tensor, q_doc: Any
) -> list[_BlockTask]:
    me = _query_rank(plan)
    return _cached(
        plan, ("tasks", seq_len, me, owner), q_pos.device, lambda: _tasks(plan, seq_len, owner, q_pos, q_doc)
    )


def _check_sparse(plan: RingPlan, q: torch.Tensor, seq_len: int) -> None:
    pattern = plan.sparse
    if pattern.seq_len != seq_len or pattern.num_heads != q.shape[2] or pattern.batch not in (1, q.shape[0]):
        raise ValueError(
            f"the sparse pattern covers B={pattern.batch}, H={pattern.num_heads}, S={pattern.seq_len} but the ring "
            f"holds B={q.shape[0]}, H={q.shape[2]}, S={seq_len}; estimate it for this rank's heads and sequence"
        )


def _sparse_pair(
    plan: RingPlan, seq_len: int, owner: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Positions of this rank's queries and ``owner``'s keys, and the sparse kernel's mask keywords."""
    q_pos, q_doc = _tokens(plan, seq_len, _query_rank(plan), device, queries=True)
    k_pos, k_doc = _tokens(plan, seq_len, owner, device)
    return q_pos, k_pos, dict(spec=plan.spec, q_doc=q_doc, k_doc=k_doc, softcap=plan.softcap)


def _tokens(
    plan: RingPlan, seq_len: int, rank: int, device: torch.device, queries: bool = False
) -> tuple[torch.Tensor, Any]:
    """1-D global positions ``[n]`` and document ids (``[n]`` / ``[B, n]`` or None) of ``rank``'s tokens
    (of the query layout with ``queries``, else of the K/V layout), cached like the block tasks (the one
    lookup of positions and documents of the engine)."""
    layout = _q_layout(plan) if queries else plan.layout

    def build() -> tuple[torch.Tensor, Any]:
        pos = layout.local_positions(seq_len, rank).to(device)
        doc = None if plan.doc_ids is None else layout.shard(plan.doc_ids, rank, dim=-1).to(device)
        return pos, doc

    side = "queries" if queries and plan.query_layout is not None else "keys"
    return _cached(plan, ("tokens", side, seq_len, rank), device, build)


def _has_padding(plan: RingPlan, device: torch.device) -> bool:
    """Whether some token is padding (document id < 0): the only rows that see no key at all (every other
    query sees at least itself). Host work once per document-id tensor (cached like the tasks)."""
    if plan.doc_ids is None:
        return False
    return _cached(plan, ("padding",), device, lambda: bool((plan.doc_ids < 0).any()))


def _per_row(pos: torch.Tensor, doc: Any) -> torch.Tensor:
    """Positions expanded to the documents' ``[B, n]`` when the documents differ per batch row."""
    return pos if doc is None else pos.expand(doc.shape)


def _query_meta(plan: RingPlan, seq_len: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """Global positions (per row, with per-row documents) and document ids of this rank's queries."""
    pos, doc = _tokens(plan, seq_len, _query_rank(plan), device, queries=True)
    return _per_row(pos, doc), doc


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caller: str) -> None:
    """Shapes, dtypes and devices of local q ``[B, n, H, D]`` and k, v ``[B, n, H_kv, D]``."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"{caller} takes q [B, n, H, D] and k, v [B, n, H_kv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, local length and head dim"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device; got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
            f"{v.dtype}/{v.device}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(
            f"q, k, v are {q.dtype}; attention needs float tensors (float32, bfloat16, float16 or float64)"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads H={q.shape[2]} must be a multiple of key/value heads H_kv={k.shape[2]}"
        )


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, caller: str) -> None:
    """Sink logits must be one float per query head of ``q [B, n, H, D]``, on q's device."""
    if sinks is None:
        return
    h = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (h,) or not sinks.dtype.is_floating_point:
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"{caller}: sinks must be a float tensor [H] with one logit per query head (H={h}); got {got}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"{caller}: sinks are on {sinks.device} but q is on {q.device}; move them to one device"
        )


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> int:
    """Validate before any communication; return the global length S (a team schedule's caller checks
    its local q, k, v itself: its rows and blocks differ in length)."""
    if plan.query_layout is None:
        check_qkv(q, k, v, "ring attention")
    layout = _q_layout(plan)
    seq_len = q.shape[1] * layout.world
    layout.check_length(seq_len)
    if plan.doc_ids is not None and plan.doc_ids.shape[-1] != seq_len:
        raise ValueError(
            f"doc_ids has {plan.doc_ids.shape[-1]} tokens but the ring holds S = {q.shape[1]} x "
            f"{layout.world} = {seq_len}; pass document ids of the whole (global-order) sequence"
        )
    return seq_len


def _covers(rows: slice, n: int) -> bool:
    return rows.start == 0 and rows.stop == n


def _only_call(plan: RingPlan, tasks: list[_BlockTask], n: int) -> bool:
    """One ring rank and one kernel call covering the whole block: nothing is ever merged."""
    return (
        plan.schedule.size == 1
        and plan.query_layout is None  # team rows are merged with the teammates' afterwards
        and len(tasks) == 1
        and _covers(tasks[0].q_rows, n)
        and _covers(tasks[0].k_rows, n)
    )


def _accumulate(
    acc_tensor: torch.Tensor | None, part: torch.Tensor, rows: slice, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``acc_tensor[:, rows] += part``; the first part covering every row becomes the accumulator."""
    if acc_tensor is None:
        if _covers(rows, like.shape[1]):
            return part.contiguous()  # it may travel to the next rank (P2P needs contiguous memory)
        acc_tensor = torch.zeros_like(like, dtype=dtype)
    acc_tensor[:, rows] += part
    return acc_tensor


@dataclass
class _Rows:
    """What one ring attention call accumulates for this rank's query rows.

    Forward: ``out [B, n, H, D]`` / ``lse [B, H, n]`` (the first block covering every row becomes the
    accumulator; no zero-filled buffer). Backward: ``dq``, with ``dout``, ``lse`` and either ``out``
    (the final output of the rows) or ``delta`` ``[B, n, H]`` = rowsum(dout · out) (``OutputDelta``).
    """

    q: torch.Tensor
    acc: torch.dtype
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    dout: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    delta: torch.Tensor | None = None

    def final_out(self, rows: slice) -> torch.Tensor:
        """What a backward kernel call takes as the final output of ``rows``: ``out`` itself, or, with
        ``delta`` instead, the projection of out onto dout, ``dout · Δ / |dout|²``. A kernel reads out
        only through Δ = rowsum(dout · out), and the projection has the same Δ (exact up to rounding;
        a row whose |dout|² underflows gets 0, which its gradient is then within rounding of). One
        ``[B, len(rows), H, D]`` temporary in the acc dtype, for the call only."""
        if self.out is not None:
            return self.out[:, rows]
        dout = self.dout[:, rows]
        copied = dout.dtype != self.acc  # then the cast below is a fresh tensor, scaled in place
        dout = dout.to(self.acc)
        norm = dout.square().sum(-1, keepdim=True)
        scale = torch.where(norm > 0, self.delta[:, rows, :, None] / norm, torch.zeros_like(norm))
        return dout.mul_(scale) if copied else dout * scale

    def zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, h, d = self.q.shape
        return (
            torch.zeros(b, n, h, d, dtype=self.acc, device=self.q.device),
            torch.full((b, h, n), float("-inf"), dtype=self.acc, device=self.q.device),
        )

    def merge(self, rows: slice, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        if self.out is None and _covers(rows, self.q.shape[1]):
            self.out, self.lse = out_blk.contiguous(), lse_blk.contiguous()
            return
        if self.out is None:
            self.out, self.lse = self.zeros()
        merge_attn_(self.out, self.lse, out_blk, lse_blk, rows=rows, consume=True)


class _PairWork:
    """The work of one ring step for (this rank's queries, one K/V block): the one interface the
    engine's forward and backward loops call. Dense: the cached block tasks of the pair, one block
    kernel call each (runs of per-document tasks as one varlen call when the kernel has one). Sparse
    (``_SparsePairWork``): the sparse block kernel on the whole pair."""

    def __init__(self, plan: RingPlan, seq_len: int, scale: float, rows: _Rows, merged: bool) -> None:
        self.plan, self.seq_len, self.scale, self.rows = plan, seq_len, scale, rows
        self.q_pos, self.q_doc = _query_meta(plan, seq_len, rows.q.device)
        self.merged = merged  # sinks are folded in after the loop: never adopt a q.dtype output
        q = rows.q
        self.kernel: AttentionKernel = kernel_for(plan.kernel, q.device, q.dtype, plan.softcap)
        varlen, band = self.kernel.varlen, self.kernel.band
        self.varlen = varlen is not None and varlen.takes(q)
        self.banded = band is not None and band.takes(q)

    def _tasks(self, owner: int) -> list[_BlockTask | _VarlenTask]:
        """The pair's calls: runs of per-document tasks grouped (one varlen call with a varlen kernel,
        else one batched call when the documents have equal lengths), the other tasks one by one."""
        plan, q = self.plan, self.rows.q
        tasks = _cached_tasks(plan, self.seq_len, owner, self.q_pos, self.q_doc)
        key = ("groups", self.seq_len, _query_rank(plan), owner, q.shape[0], self.varlen)

        def build() -> list[_BlockTask | _VarlenTask]:
            groups = _varlen_groups(tasks, q.shape[0], q.device)
            if self.varlen:
                return groups
            out: list[_BlockTask | _VarlenTask] = []
            for g in groups:
                out.extend([g] if not isinstance(g, _VarlenTask) or g.uniform else g.tasks)
            return out

        return _cached(plan, key, q.device, build)

    def _backward_tasks(self, owner: int) -> list[_BlockTask | _VarlenTask]:
        """The forward's calls with FULL rectangles cut at segment boundaries and into tiles
        (``_backward_tiles``): the backward kernel's dq / dk / dv parts exist for one tile at a time, not for
        the whole rectangle."""
        plan, q = self.plan, self.rows.q
        tasks = self._tasks(owner)
        if plan.schedule.size == 1 and plan.query_layout is None:  # the parts are the gradients
            return tasks
        tile = BACKWARD_TILE_MIN
        key = ("backward", self.seq_len, _query_rank(plan), owner, q.shape[0], self.varlen, tile)
        q_segments, k_segments = _q_layout(plan).segments(self.seq_len), plan.layout.segments(self.seq_len)
        return _cached(plan, key, q.device, lambda: _backward_tiles(tasks, q_segments, k_segments, tile))

    def forward(self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int) -> None:
        plan, q, n = self.plan, self.rows.q, self.rows.q.shape[1]
        tasks = self._tasks(owner)
        only = _only_call(plan, tasks, n) and not self.merged
        for task in tasks:
            if isinstance(task, _VarlenTask):
                run = _varlen_forward if self.varlen else _batched_forward
                out_blk, lse_blk = run(self.kernel, q, k_blk, v_blk, task, self.scale, plan.softcap)
                out_blk, lse_blk = out_blk.to(self.rows.acc), lse_blk.to(self.rows.acc)
            elif task.band is not None and self.banded:
                out_blk, lse_blk = self.kernel.band.forward(
                    q[:, task.q_rows], k_blk[:, task.k_rows], v_blk[:, task.k_rows], self.scale, task.band,
                    plan.softcap,
                )  # fmt: skip
                out_blk, lse_blk = out_blk.to(self.rows.acc), lse_blk.to(self.rows.acc)
            else:
                out_blk, lse_blk = block_attn_forward(
                    q[:, task.q_rows],
                    k_blk[:, task.k_rows],
                    v_blk[:, task.k_rows],
                    scale=self.scale,
                    mask=task.mask,
                    causal=task.kind is BlockKind.CAUSAL,
                    kernel=self.kernel,
                    out_dtype=q.dtype if only else None,  # nothing to merge: skip the fp32 round trip
                    softcap=plan.softcap,
                )
            self.rows.merge(task.q_rows, out_blk, lse_blk)
            del out_blk, lse_blk  # not alive during the next kernel call
        if plan.work is not None:
            plan.work.forward_pairs += sum(task.pairs for task in tasks)
            covered = sum(task.segment_pairs for task in tasks)
            plan.work.blocks += covered
            pairs = len(_q_layout(plan).segments(self.seq_len)) * len(plan.layout.segments(self.seq_len))
            plan.work.skipped_blocks += pairs - covered

    def backward(
        self,
        k_blk: torch.Tensor,
        v_blk: torch.Tensor,
        owner: int,
        into: Callable[[], tuple[torch.Tensor, ...] | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """dq into ``rows.dq``; returns (dk, dv) of the block.

        ``into`` (the schedule's ``incoming``) gives the block's travelling dK/dV accumulator; the
        step's parts are added into it, so the step has no accumulator of its own. It is asked for
        before the first kernel call: waiting for it also completes the previous step's send, whose
        dK/dV are then freed before this step's kernel outputs exist. The accumulator's transfer is
        not hidden behind this step's compute (one dK/dV transfer per step, linear in n against the
        quadratic block work); the next K/V block's transfer still is.
        """
        plan, rows, q = self.plan, self.rows, self.rows.q
        tasks = self._backward_tasks(owner)
        only = _only_call(plan, tasks, q.shape[1])
        dk, dv = (into() if into is not None else None) or (None, None)
        for task in tasks:
            if isinstance(task, _VarlenTask):
                run = _varlen_backward if self.varlen else _batched_backward
                dq_p, dk_p, dv_p = run(self.kernel, rows, k_blk, v_blk, task, self.scale, plan.softcap)
            elif task.band is not None and self.banded:  # band rows always see a key: lse finite
                dq_p, dk_p, dv_p = self.kernel.band.backward(
                    rows.dout[:, task.q_rows], q[:, task.q_rows], k_blk[:, task.k_rows], v_blk[:, task.k_rows],
                    rows.final_out(task.q_rows), rows.lse[:, :, task.q_rows], self.scale, task.band, plan.softcap,
                )  # fmt: skip
            else:
                dq_p, dk_p, dv_p = block_attn_backward(
                    rows.dout[:, task.q_rows],
                    q[:, task.q_rows],
                    k_blk[:, task.k_rows],
                    v_blk[:, task.k_rows],
                    rows.final_out(task.q_rows),
                    rows.lse[:, :, task.q_rows],
                    scale=self.scale,
                    mask=task.mask,
                    causal=task.kind is BlockKind.CAUSAL,
                    kernel=self.kernel,
                    grad_dtype=q.dtype if only else None,
                    softcap=plan.softcap,
                    inert=True,
                )
            rows.dq = _accumulate(rows.dq, dq_p, task.q_rows, q, rows.acc)
            dk = _accumulate(dk, dk_p, task.k_rows, k_blk, rows.acc)
            dv = _accumulate(dv, dv_p, task.k_rows, v_blk, rows.acc)
            del dq_p, dk_p, dv_p  # not alive during the next kernel call
            if plan.work is not None:
                plan.work.backward_pairs += task.pairs
        if dk is None:  # no block of this step was computed, and nothing arrived
            dk, dv = torch.zeros_like(k_blk, dtype=rows.acc), torch.zeros_like(v_blk, dtype=rows.acc)
        return dk, dv


def _packed(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``[B, n, H, D]`` flattened to ``[B·L, H, D]``."""
    return x[:, rows].reshape(-1, *x.shape[2:])


def _varlen_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    task: _VarlenTask,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One varlen call for ``task``: ``out [B, Lq, H, D]``, ``lse [B, H, Lq]``."""
    b, h = q.shape[0], q.shape[2]
    out, lse = kernel.varlen.forward(
        _packed(q, task.q_rows), _packed(k, task.k_rows), _packed(v, task.k_rows),
        task.cu_q, task.cu_k, task.max_q, task.max_k, scale, task.causal, softcap,
    )  # fmt: skip
    return out.view(b, -1, h, q.shape[3]), lse.view(h, b, -1).transpose(0, 1)


def _varlen_backward(
    kernel: AttentionKernel,
    rows: _Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    task: _VarlenTask,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``task`` given the final out / lse of its rows: dq ``[B, Lq, H, D]``, dk, dv ``[B, Lk, H_kv, D]``."""
    q = rows.q
    b, h = q.shape[0], q.shape[2]
    dout = rows.dout[:, task.q_rows]  # padding rows were made inert once for the whole backward
    lse = rows.lse[:, :, task.q_rows].transpose(0, 1).reshape(h, -1)  # [H, B·Lq]
    dq, dk, dv = kernel.varlen.backward(
        dout.reshape(-1, h, q.shape[3]), _packed(q, task.q_rows), _packed(k, task.k_rows),
        _packed(v, task.k_rows), rows.final_out(task.q_rows).reshape(-1, h, q.shape[3]), lse, task.cu_q, task.cu_k,
        task.max_q,
        task.max_k, scale, task.causal, softcap,
    )  # fmt: skip
    return dq.view(b, -1, *dq.shape[1:]), dk.view(b, -1, *dk.shape[1:]), dv.view(b, -1, *dv.shape[1:])


def _as_batch(x: torch.Tensor, rows: slice, length: int) -> torch.Tensor:
    """Rows ``rows`` of ``[B, n, H, D]`` as ``[B·m, length, H, D]`` (m = len(rows) / length sequences)."""
    return x[:, rows].reshape(-1, length, *x.shape[2:])


def _batched_forward(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    task: _VarlenTask,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length sequences as batch rows of one block call: ``out [B, Lq, H, D]``, ``lse [B, H, Lq]``."""
    b, h, length = q.shape[0], q.shape[2], task.uniform
    out, lse = block_attn_forward(
        _as_batch(q, task.q_rows, length), _as_batch(k, task.k_rows, length), _as_batch(v, task.k_rows, length),
        scale=scale, causal=task.causal, kernel=kernel, softcap=softcap,
    )  # fmt: skip
    return out.view(b, -1, h, q.shape[3]), lse.view(b, -1, h, length).transpose(1, 2).reshape(b, h, -1)


def _batched_backward(
    kernel: AttentionKernel,
    rows: _Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    task: _VarlenTask,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of equal-length sequences run as batch rows: dq ``[B, Lq, H, D]``, dk, dv ``[B, Lk, H_kv, D]``."""
    q = rows.q
    b, h, length = q.shape[0], q.shape[2], task.uniform
    lse = rows.lse[:, :, task.q_rows].reshape(b, h, -1, length).transpose(1, 2).reshape(-1, h, length)
    dq, dk, dv = block_attn_backward(
        _as_batch(rows.dout, task.q_rows, length), _as_batch(q, task.q_rows, length),
        _as_batch(k, task.k_rows, length), _as_batch(v, task.k_rows, length),
        rows.final_out(task.q_rows).reshape(-1, length, h, q.shape[3]), lse, scale=scale, causal=task.causal,
        kernel=kernel,
        softcap=softcap, inert=True,
    )  # fmt: skip
    return dq.view(b, -1, *dq.shape[2:]), dk.view(b, -1, *dk.shape[2:]), dv.view(b, -1, *dv.shape[2:])


class _SparsePairWork(_PairWork):
    """The sparse ring's step: the whole local query shard against a K/V block, one sparse kernel call
    (``ops/sparse_kernels.py``, resolved once per call of the engine)."""

    def __init__(self, plan: RingPlan, seq_len: int, scale: float, rows: _Rows, merged: bool) -> None:
        super().__init__(plan, seq_len, scale, rows, merged)
        _check_sparse(plan, rows.q, seq_len)
        self.kernel = resolve_sparse_kernel(plan.sparse_kernel, rows.q.device, rows.q.dtype)

    def forward(self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int) -> None:
        plan, q = self.plan, self.rows.q
        q_pos, k_pos, kw = _sparse_pair(plan, self.seq_len, owner, q.device)
        out_blk, lse_blk, pairs = self.kernel.forward(
            q, k_blk, v_blk, q_pos, k_pos, plan.sparse, scale=self.scale, **kw
        )
        if self.rows.out is None:
            self.rows.out, self.rows.lse = self.rows.zeros()
        merge_attn_(self.rows.out, self.rows.lse, out_blk, lse_blk)
        if plan.work is not None:
            if pairs is None:  # a sync-free kernel: count the visible pairs (a diagnostic host sync)
                pairs = visible_pairs(
                    q_pos, k_pos, plan.sparse, plan.spec, kw["q_doc"], kw["k_doc"], batch=q.shape[0]
                )
            plan.work.forward_pairs += pairs // q.shape[2]
            plan.work.blocks += 1 if pairs else 0
            plan.work.skipped_blocks += 0 if pairs else 1

    def backward(
        self,
        k_blk: torch.Tensor,
        v_blk: torch.Tensor,
        owner: int,
        into: Callable[[], tuple[torch.Tensor, ...] | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan, rows = self.plan, self.rows  # one kernel call: fresh dk, dv (the schedule adds them)
        q_pos, k_pos, kw = _sparse_pair(plan, self.seq_len, owner, rows.q.device)
        dq_p, dk, dv = self.kernel.backward(
            rows.dout,
            rows.q,
            k_blk,
            v_blk,
            rows.final_out(slice(None)),
            rows.lse,
            q_pos,
            k_pos,
            plan.sparse,
            scale=self.scale,
            **kw,
        )
        rows.dq = dq_p if rows.dq is None else rows.dq.add_(dq_p)
        return dk, dv


def _pair_work(plan: RingPlan, seq_len: int, scale: float, rows: _Rows, merged: bool) -> _PairWork:
    cls = _PairWork if plan.sparse is None else _SparsePairWork
    return cls(plan, seq_len, scale, rows, merged)


class OutputDelta:
    """Δ = rowsum(dout · out) ``[B, n, H]`` of a ring call's query rows, handed to its backward by the
    code that keeps the call's output (``parallel/usp.py``: the output in the token layout, which the
    output projection saves anyway). A call given one saves no output of its own: its backward runs
    on Δ (``_Rows.final_out``). ``give`` must come before that backward starts; ``take`` once.
    """

    def __init__(self) -> None:
        self._delta: torch.Tensor | None = None

    def give(self, delta: torch.Tensor) -> None:
        self._delta = delta

    def take(self, q: torch.Tensor) -> torch.Tensor:
        delta, self._delta = self._delta, None
        want = (q.shape[0], q.shape[1], q.shape[2])
        if delta is None or tuple(delta.shape) != want:
            got = None if delta is None else tuple(delta.shape)
            raise RuntimeError(
                f"ring attention backward needs the output's rowsum(dout * out) of shape {want}, got {got}: "
                "the call's output must reach the loss through the code that gave the OutputDelta"
            )
        return delta


def engine_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float, merged: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward loop: ``(out, lse, S)`` of this rank's query rows over every block the schedule yields,
    out ``[B, n, H, D]`` and lse ``[B, H, n]`` in the accumulation dtype (fp32, fp64 for fp64 inputs);
    ``merged``: the caller merges more into them (sinks, a team's partials), so a single kernel call
    never returns q.dtype. Checks every input first."""
    seq_len = _check_inputs(q, k, v, plan)
    rows = _Rows(q, torch.float64 if q.dtype == torch.float64 else torch.float32)
    work = _pair_work(plan, seq_len, scale, rows, merged=merged)
    for owner, (k_blk, v_blk) in plan.schedule.forward((k, v)):
        work.forward(k_blk, v_blk, owner)
    out, lse = (rows.out, rows.lse) if rows.out is not None else rows.zeros()  # all EMPTY: padding only
    return out, lse, seq_len


def engine_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    scale: float,
    seq_len: int,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    merged: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward loop from the FINAL ``lse`` and ``out`` (or Δ = rowsum(dout · out) ``[B, n, H]``) of
    this rank's query rows: ``(dq, dk, dv)`` in the accumulation dtype, dq of the rows, dk / dv of the
    K/V payload ``(k, v)`` the schedule started from (returned by its backward)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = _Rows(q, acc, out=out, lse=lse, dout=dout, delta=delta)
    if _has_padding(plan, q.device):  # padding rows saw no key: inert once here, not per block
        rows.dout, rows.lse = inert_empty_rows(dout, lse)
    work = _pair_work(plan, seq_len, scale, rows, merged=merged)
    steps = plan.schedule.backward((k, v))
    owner, block = next(steps)
    while True:
        grads = list(work.backward(*block, owner, into=plan.schedule.incoming))
        del block  # the schedule keeps the block while it still needs it
        try:  # the schedule owns (and empties) the step's dK/dV from here: sent on, freed once delivered
            owner, block = steps.send(grads)
        except StopIteration as done:
            dk_local, dv_local = done.value
            break
    dq = rows.dq if rows.dq is not None else torch.zeros_like(q, dtype=acc)
    return dq, dk_local, dv_local


@dataclass(frozen=True)
class _QueryRows:
    """A schedule stand-in naming whose query rows one pair call computes (``engine_pair_backward``)."""

    size: int
    ring_rank: int
    query_rank: int


def engine_pair_backward(
    plan: RingPlan,
    seq_len: int,
    scale: float,
    rows_of: int,
    owner: int,
    q: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dq: torch.Tensor | None = None,
    dkv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ONE pair: the query rows of ``rows_of`` (in ``plan.query_layout``; q, dout ``[B, L, H, D]``,
    final lse ``[B, H, L]``, Δ ``[B, L, H]``) against ``owner``'s K/V block (``plan.layout``). Gradients are
    added in place into ``dq`` and ``dkv`` when given (accumulators that travel or stay), else fresh;
    returns ``(dq, dk, dv)`` in the accumulation dtype. StarTrail's query-packet backward calls it once per
    packet that passes (``parallel/team.py``)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    pair_plan = dataclasses.replace(
        plan, schedule=_QueryRows(plan.schedule.size, plan.schedule.ring_rank, rows_of)
    )
    rows = _Rows(q, acc, lse=lse, dout=dout, delta=delta, dq=dq)
    work = _pair_work(pair_plan, seq_len, scale, rows, merged=True)
    dk, dv = work.backward(k, v, owner, into=None if dkv is None else (lambda: dkv))
    return (rows.dq if rows.dq is not None else torch.zeros_like(q, dtype=acc)), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: RingPlan,
        scale: float,
        delta: OutputDelta | None,
    ):
        check_sinks(sinks, q, "ring attention")
        out, lse, seq_len = engine_forward(q, k, v, plan, scale, merged=sinks is not None)
        if sinks is not None:  # the backward then sees the FINAL (out, lse), sink included
            out, lse = apply_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out if delta is None else None, lse, sinks)
        ctx.plan, ctx.scale, ctx.seq_len, ctx.delta = plan, scale, seq_len, delta
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        delta = None if ctx.delta is None else ctx.delta.take(q)
        dq, dk_local, dv_local = engine_backward(
            q,
            k,
            v,
            ctx.plan,
            ctx.scale,
            ctx.seq_len,
            dout,
            lse,
            out=out,
            delta=delta,
            merged=sinks is not None,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dk_local.to(k.dtype), dv_local.to(v.dtype), dsinks, None, None, None


def plan_layouts(schedule: Schedule, base: SeqLayout) -> tuple[Any, Any]:
    """``(layout, query_layout)`` of a ring plan for ``schedule`` over the ring layout ``base``: the base
    itself for ring-shaped schedules; for TASP the pieces of its shards held at each step (``step_groups``
    of a ``PieceLayout``); the groups of a team
    schedule (``key_groups`` / ``query_groups``: StarTrail's teams, ATTENTION2D's columns and rows)."""
    if hasattr(schedule, "key_groups"):
        return GroupLayout(base, schedule.key_groups), GroupLayout(base, schedule.query_groups)
    if hasattr(schedule, "step_groups"):  # TASP: a step's block = one piece from each cycle
        pieces = PieceLayout(base, schedule.pieces)
        return GroupLayout(pieces, schedule.step_groups, interleave=schedule.segments), base
    return base, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    delta: OutputDelta | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's queries over the keys of every rank in the ring.

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``, this rank's tokens in ``plan.layout`` order.
        plan: schedule, layout, mask spec, document ids, kernel, softcap, work counter.
        softmax_scale: default ``D ** -0.5``.
        sinks: None, or ``[H]`` attention-sink logits of these query heads (``ops/merge.apply_sink``).
        delta: None (the call saves its output for backward), or an ``OutputDelta`` that the caller
            fills with rowsum(dout · out) before this call's backward runs; the output is then not
            saved. Not with ``sinks`` (their gradient reads the output).

    Returns:
        ``(out [B, n, H, D] in q.dtype, lse [B, H, n])`` (lse includes the sinks); differentiable in
        q, k, v and sinks.
    """
    if delta is not None and sinks is not None:
        raise ValueError(
            "ring_attention: delta= cannot be used with sinks (the sink gradient needs the output)"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _RingAttention.apply(q, k, v, sinks, plan, scale, delta)
