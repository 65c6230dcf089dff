"""Kernel calls of one ring step, as data: pure functions of positions, document ids and a mask spec.

Legend: n local rows; positions are GLOBAL token positions, ``[n]`` (``[B, n]`` with per-row documents).

    block_tasks      (query rows, key rows) of one step -> BlockTask list (EMPTY pairs dropped, FULL
                     neighbours joined, documents cut, long window pairs tiled, PARTIAL masks trimmed)
    varlen_groups    runs of per-document tasks -> one VarlenTask each (varlen or batched kernel call)
    backward_tiles   FULL / square CAUSAL calls cut into tiles for the backward

No process group, no plan object: tests call these directly (docs/ring.md "How a step works").
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.ops.masks import BlockKind, MaskSpec, classify_block, quick_block_kind

__all__ = [
    "BACKWARD_TILE_ROWS",
    "BlockTask",
    "VarlenTask",
    "backward_tiles",
    "block_tasks",
    "varlen_groups",
    "window_tile",
]

BACKWARD_TILES = 4  # a FULL (query segment, key segment) piece runs as up to 4 x 4 tiles in backward
BACKWARD_TILE_ROWS = 1024  # rows per tile side, at least (small blocks stay one call)
IMAGE_BLOCK_TILE = 512  # tile edge of long segment pairs with image blocks (``_image_block_tiles``)


@dataclass(frozen=True)
class BlockTask:
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


def _join_full(tasks: list[BlockTask], along_keys: bool) -> list[BlockTask]:
    """Merge neighbouring FULL tasks into one call: same query rows and adjacent key rows
    (``along_keys``), or same key rows and adjacent query rows."""
    out: list[BlockTask] = []
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
                out[-1] = BlockTask(
                    q_rows, k_rows, BlockKind.FULL, None, last.segment_pairs + task.segment_pairs
                )
                continue
        out.append(task)
    return out


def _tiles(rows: slice, min_rows: int) -> list[slice]:
    """``rows`` cut into up to ``BACKWARD_TILES`` nearly equal runs of at least ``min_rows`` rows."""
    length = rows.stop - rows.start
    count = max(1, min(BACKWARD_TILES, length // min_rows))
    bounds = [rows.start + (length * i) // count for i in range(count + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def backward_tiles(
    tasks: list[Any],
    q_segments: list[tuple[int, int]],
    k_segments: list[tuple[int, int]],
    min_rows: int = BACKWARD_TILE_ROWS,
) -> list[Any]:
    """The backward's calls: FULL tasks cut at segment boundaries, then each piece into tiles
    (``_tiles``) along queries and keys; square CAUSAL tasks cut the same way on both axes, into
    CAUSAL diagonal tiles and FULL tiles below them (the tiles above see nothing). The backward
    kernel's dq / dk / dv parts then exist for one tile at a time (1/16 of a segment pair's), and so
    does the output a call takes (``execute.Rows.final_out``). Other tasks unchanged; the same pairs."""

    def cuts(rows: slice, segments: list[tuple[int, int]]) -> list[slice]:
        pieces = [slice(max(a, rows.start), min(b, rows.stop)) for a, b in segments]
        return [
            tile for p in ([p for p in pieces if p.start < p.stop] or [rows]) for tile in _tiles(p, min_rows)
        ]

    def shifted(rows: slice, by: int) -> slice:
        return slice(rows.start + by, rows.stop + by)

    out: list[Any] = []
    for task in tasks:
        square = isinstance(task, BlockTask) and task.mask is None and task.band is None
        if square and task.kind is BlockKind.FULL:
            pieces = [
                BlockTask(qr, kr, BlockKind.FULL, None)
                for qr in cuts(task.q_rows, q_segments)
                for kr in cuts(task.k_rows, k_segments)
            ]
        elif square and task.kind is BlockKind.CAUSAL:
            rows, by = cuts(task.q_rows, q_segments), task.k_rows.start - task.q_rows.start
            pieces = [
                BlockTask(qr, shifted(kr, by), BlockKind.CAUSAL if a == b else BlockKind.FULL, None)
                for a, qr in enumerate(rows)
                for b, kr in enumerate(rows[: a + 1])
            ]
        else:
            pieces = [task]
        out += [task] if len(pieces) == 1 else pieces
    return out


@dataclass(frozen=True)
class VarlenTask:
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
    tasks: tuple[BlockTask, ...]
    uniform: int


def _packable(task: BlockTask) -> bool:
    return task.mask is None and task.kind in (BlockKind.FULL, BlockKind.CAUSAL)


def _pack(run: list[BlockTask], batch: int, device: torch.device) -> VarlenTask:
    q_len = [t.q_rows.stop - t.q_rows.start for t in run]
    k_len = [t.k_rows.stop - t.k_rows.start for t in run]

    def bounds(lengths: list[int]) -> torch.Tensor:
        edges = torch.tensor([0] + lengths * batch).cumsum(0)
        return edges.to(device=device, dtype=torch.int32)

    return VarlenTask(
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


def varlen_groups(tasks: list[BlockTask], batch: int, device: torch.device) -> list[BlockTask | VarlenTask]:
    """``tasks`` with every run of >= 2 adjacent packable tasks of one kind (consecutive query rows AND
    consecutive key rows: the per-document tasks of packed rows) replaced by one :class:`VarlenTask`."""
    out: list[BlockTask | VarlenTask] = []
    run: list[BlockTask] = []

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


def _trimmed(task: BlockTask) -> BlockTask:
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


def _runs(ids: torch.Tensor, pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(id, start, end)`` of the runs of a 1-D tensor of document ids whose positions are consecutive: a
    run ends where the id changes or the position does not continue (a document placed in several
    pieces on one rank, ``layout/placement.py``, gives one run per piece)."""
    values, positions = ids.tolist(), pos.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][0] == value and positions[i] == positions[i - 1] + 1:
            runs[-1] = (value, runs[-1][1], i + 1)
        else:
            runs.append((value, i, i + 1))
    return runs


def _shared_rows(x: torch.Tensor) -> torch.Tensor | None:
    """A ``[S]`` / ``[B, S]`` tensor as ``[S]`` when every batch row is the same, else None."""
    if x.dim() == 1:
        return x
    return x[0] if bool((x == x[:1]).all()) else None


def _document_tasks(
    spec: MaskSpec,
    q_rows: tuple[int, int],
    k_rows: tuple[int, int],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_doc: torch.Tensor,
    q_end: torch.Tensor | None = None,
) -> list[BlockTask] | None:
    """A segment pair that packed documents make PARTIAL, cut at document boundaries: one call per pair of
    runs of the same document on both sides (FULL, CAUSAL, or PARTIAL with a small mask for windows), so
    no work is spent on pairs of different documents (docs/ring.md, "Packed documents"). None when the
    batch rows hold different documents (or image blocks, ``q_end``)."""
    (qa, qb), (ka, kb) = q_rows, k_rows
    qd, kd = _shared_rows(q_doc[..., qa:qb]), _shared_rows(k_doc[..., ka:kb])
    qp, kp = _shared_rows(q_pos[..., qa:qb]), _shared_rows(k_pos[..., ka:kb])
    qe = None if q_end is None else _shared_rows(q_end[..., qa:qb])
    if qd is None or kd is None or qp is None or kp is None or (q_end is not None and qe is None):
        return None
    keys: dict[int, list[tuple[int, int]]] = {}
    for doc, start, end in _runs(kd, kp):
        if doc >= 0:
            keys.setdefault(doc, []).append((start, end))
    tasks: list[BlockTask] = []
    for doc, start, end in _runs(qd, qp):
        for ks, ke in keys.get(doc, []) if doc >= 0 else []:
            kind, mask = classify_block(
                qp[start:end], kp[ks:ke], spec, q_end=None if qe is None else qe[start:end]
            )
            if kind is not BlockKind.EMPTY:
                task = BlockTask(slice(qa + start, qa + end), slice(ka + ks, ka + ke), kind, mask, 0)
                tasks.append(_trimmed(task) if kind is BlockKind.PARTIAL else task)
    if tasks:
        tasks[0] = dataclasses.replace(tasks[0], segment_pairs=1)
    return tasks


def _image_block_tiles(
    spec: MaskSpec,
    q_seg: tuple[int, int],
    k_seg: tuple[int, int],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: Any,
    k_doc: Any,
    q_end: torch.Tensor,
) -> list[BlockTask] | None:
    """A long segment pair with image blocks (``q_end``), cut into tiles of ``IMAGE_BLOCK_TILE`` tokens (the
    window's tile with a window) that are classified one by one: the diagonal of a causal pair is then CAUSAL
    and FULL tiles with small PARTIAL tiles only where a block or a document border crosses, instead of one
    mask of the whole pair (docs/kernels.md "Image blocks"). None when the pair fits in one tile."""
    (qa, qb), (ka, kb) = q_seg, k_seg
    tile = IMAGE_BLOCK_TILE if spec.window is None else min(IMAGE_BLOCK_TILE, window_tile(spec.window))
    if max(qb - qa, kb - ka) <= tile:
        return None
    docs = (_rows(q_doc, qa, qb), _rows(k_doc, ka, kb))
    if quick_block_kind(q_pos[..., qa:qb], k_pos[..., ka:kb], spec, *docs, q_end[..., qa:qb]) is not None:
        return None  # the whole pair is one EMPTY / FULL / CAUSAL call
    tasks: list[BlockTask] = []
    for a in range(qa, qb, tile):
        b = min(a + tile, qb)
        for c in range(ka, kb, tile):
            d = min(c + tile, kb)
            kind, mask = classify_block(
                q_pos[..., a:b],
                k_pos[..., c:d],
                spec,
                _rows(q_doc, a, b),
                _rows(k_doc, c, d),
                q_end[..., a:b],
            )
            if kind is not BlockKind.EMPTY:
                task = BlockTask(slice(a, b), slice(c, d), kind, mask, 0)
                tasks.append(_trimmed(task) if kind is BlockKind.PARTIAL else task)
    if tasks:
        tasks[0] = dataclasses.replace(tasks[0], segment_pairs=1)
    return tasks


def _rows(x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """Columns ``start:stop`` of a ``[n]`` / ``[B, n]`` tensor, or None."""
    return None if x is None else x[..., start:stop]


def window_tile(window: int) -> int:
    """Tile edge (tokens) of the window tiling: ``window`` clamped to [128, 1024]."""
    return max(128, min(1024, window))


def _consecutive(pos: torch.Tensor) -> bool:
    """Whether a 1-D position tensor is one run ``p0, p0 + 1, ...``."""
    if pos.dim() != 1 or pos.numel() < 2:
        return pos.dim() == 1
    return int(pos[-1]) - int(pos[0]) == pos.numel() - 1 and bool((pos[1:] - pos[:-1] == 1).all())


def _window_tasks(
    spec: MaskSpec, q_seg: tuple[int, int], k_seg: tuple[int, int], q_pos: torch.Tensor, k_pos: torch.Tensor
) -> list[BlockTask] | None:
    """A long segment pair under a sliding window, cut into tiles of :func:`window_tile` tokens: only the
    tiles the window reaches are classified, so no ``[Sq, Sk]`` mask of the whole pair is ever built (at
    S = 1M it would not fit). Tiles the window covers run as FULL / CAUSAL calls (neighbours joined), the
    window's edge tiles as small PARTIAL (band) calls whose masks are shared: with consecutive positions a
    tile's mask depends only on its offset. None when the pair is small or its positions are not runs
    (docs/ring.md "Windows")."""
    w = spec.window
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
    shared: dict[tuple[int, int, int], BlockTask] = {}
    tasks: list[BlockTask] = []
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
                rel = BlockTask(slice(0, b - a), slice(0, d - c), kind, mask, 0)
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


def block_tasks(
    spec: MaskSpec,
    q_segments: list[tuple[int, int]],
    k_segments: list[tuple[int, int]],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: Any,
    k_doc: Any,
    q_end: torch.Tensor | None = None,
) -> list[BlockTask]:
    """The kernel calls for (query rows, key rows) of one step; EMPTY pairs dropped.

    ``q_pos`` / ``k_pos``: global positions ``[n]`` (``[B, n]`` with per-row documents), ``q_doc`` / ``k_doc``
    document ids or None; ``q_segments`` / ``k_segments``: the layouts' segments. Segment pairs are
    classified from global positions; the calls are then as few as the mask allows: the whole block in
    one call when it is FULL or top-left CAUSAL as a whole (the own step of zigzag), else neighbouring
    FULL pairs joined into one rectangle, and pairs that packed documents make PARTIAL cut at document
    boundaries. ``q_end``: None, or the last position each query sees (image blocks, ``ops/masks.py``).
    Host work (with host syncs on a GPU): done once per batch (``plan.PLAN_CACHE``).
    """
    if len(q_segments) * len(k_segments) > 1:
        whole = quick_block_kind(q_pos, k_pos, spec, q_doc, k_doc, q_end)
        if whole is BlockKind.EMPTY:
            return []
        if whole in (BlockKind.FULL, BlockKind.CAUSAL):
            covered = len(q_segments) * len(k_segments)
            if whole is BlockKind.CAUSAL:  # no pair above the diagonal
                covered = sum(
                    quick_block_kind(q_pos[..., qa:qb], k_pos[..., ka:kb], spec, q_end=_rows(q_end, qa, qb))
                    is not BlockKind.EMPTY
                    for qa, qb in q_segments
                    for ka, kb in k_segments
                )
            return [BlockTask(slice(0, q_pos.shape[-1]), slice(0, k_pos.shape[-1]), whole, None, covered)]
    tasks = []
    for qa, qb in q_segments:
        for ka, kb in k_segments:
            tasks += _pair_tasks(spec, (qa, qb), (ka, kb), q_pos, k_pos, q_doc, k_doc, q_end)
    return _join_full(_join_full(tasks, along_keys=True), along_keys=False)


def _pair_tasks(
    spec: MaskSpec,
    q_seg: tuple[int, int],
    k_seg: tuple[int, int],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: Any,
    k_doc: Any,
    q_end: torch.Tensor | None = None,
) -> list[BlockTask]:
    """The calls of one (query segment, key segment) pair: window tiles, per-document calls, or one call.
    With image blocks (``q_end``) no window tiling (its tiles share masks by offset)."""
    (qa, qb), (ka, kb) = q_seg, k_seg
    plain = q_doc is None and q_end is None
    tiled = _window_tasks(spec, q_seg, k_seg, q_pos, k_pos) if plain else None
    if q_end is not None:
        tiled = _image_block_tiles(spec, q_seg, k_seg, q_pos, k_pos, q_doc, k_doc, q_end)
    if tiled is not None:
        return tiled
    ends = _rows(q_end, qa, qb)
    if (
        q_doc is not None
        and quick_block_kind(
            q_pos[..., qa:qb], k_pos[..., ka:kb], spec, q_doc[..., qa:qb], k_doc[..., ka:kb], ends
        )
        is None
    ):  # packed documents: cut at their runs before any mask of the whole pair is built
        split = _document_tasks(spec, q_seg, k_seg, q_pos, k_pos, q_doc, k_doc, q_end)
        if split is not None:
            return split
    kind, mask = classify_block(
        q_pos[..., qa:qb],
        k_pos[..., ka:kb],
        spec,
        None if q_doc is None else q_doc[..., qa:qb],
        None if k_doc is None else k_doc[..., ka:kb],
        ends,
    )
    if kind is BlockKind.EMPTY:
        return []
    task = BlockTask(slice(qa, qb), slice(ka, kb), kind, mask)
    return [_trimmed(task) if kind is BlockKind.PARTIAL else task]
