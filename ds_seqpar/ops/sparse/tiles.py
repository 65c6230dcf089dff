"""The ``blocks`` sparse kernel: the tile planner over the dense block kernel (docs/sparse.md).

Per (row, head) the query tiles of G rows are split into a few "parts", each ONE batched call of the
block kernel (``ops/attention``, sdpa on CPU) over gathered keys: the diagonal tiles (built-in causal
mode, no mask), the chosen off-diagonal tiles grouped by how many each query tile has (no mask, no
padding), and the bar columns (a small mask). Partial results merge by log-sum-exp; the backward replays
the parts and scatters dK/dV back with ``index_add_``. Work is proportional to the pattern, not to
Sq·Sk. This needs every shard to consist of whole, G-aligned blocks of consecutive positions (stripe(G),
zigzag or contiguous with chunks divisible by G); anything else runs one exact token-masked part, as
slow as dense. Windows and packed documents add a mask to every part. Outputs are in the accumulation
dtype (``ops/precision.py``).

Chosen diagonals δ = i - j are executed at block granularity: a block (i//G, j//G) is computed whole when
a chosen diagonal crosses it, i.e. for d = floor(δ/G) and ceil(δ/G) - the block superset MTraining's
kernels compute too. Vertical columns outside the chosen blocks are "bars": single key columns gathered
per query tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.ops.attention import available_kernels, block_attn_backward, block_attn_forward
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.merge import merge_attn
from ds_seqpar.ops.precision import accumulation_dtype
from ds_seqpar.ops.sparse.pattern import SparsePattern

__all__ = ["check_pair_shapes", "sparse_attn_backward", "sparse_attn_forward"]

NEG_INF = float("-inf")
CAUSAL = MaskSpec()


def _aligned_blocks(pos: torch.Tensor, g: int) -> torch.Tensor | None:
    """Block ids ``[T]`` if ``pos`` is whole, aligned blocks of ``g`` consecutive positions, else None."""
    if pos.numel() % g:
        return None
    tiles = pos.view(-1, g)
    start = tiles[:, 0]
    if bool((start % g).any()) or not torch.equal(tiles, start[:, None] + torch.arange(g, device=pos.device)):
        return None
    return start // g


@dataclass(frozen=True)
class _Part:
    """One batched kernel call of one (row, head): T query tiles x their keys.

    ``q_tiles``: query tiles (of the pair's query tile size), an index ``[T]`` or a slice. Keys are
    one of: gathered key tiles ``k_tiles [T, c]``; gathered key rows ``k_rows [T, nK]`` (bar
    columns); or ``window = (first, c)``: query tile i of the slice sees key tiles
    ``first + i .. first + i + c - 1``, a sliding window read through a strided view (no copy).
    ``causal``: the key tile is the query tile's own block (top-left causal); ``valid``: None
    (every key visible) or a bool ``[T, nK]`` / ``[T, g, nK]`` pattern mask.
    """

    q_tiles: torch.Tensor | slice
    k_tiles: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    causal: bool = False
    valid: torch.Tensor | None = None

    @property
    def num_q_tiles(self) -> int:
        if isinstance(self.q_tiles, slice):
            return self.q_tiles.stop - self.q_tiles.start
        return self.q_tiles.numel()


@dataclass(frozen=True)
class _PairTiles:
    """How one (query shard, key shard) pair is tiled: tile sizes and the parts of every (row, head)."""

    q_tile: int
    k_tile: int
    parts: list[list[list[_Part]]]  # [B][H]


def _uniform_diagonal_runs(active: torch.Tensor) -> list[tuple[int, int]]:
    """Runs ``(first_m, last_m)`` of consecutive tile diagonals m (entries ``[i, i - m]``) that are
    entirely chosen. Block stripes and contiguous shards make every chosen block diagonal a whole
    tile diagonal, so most of the work becomes a few sliding windows."""
    tq, tk = active.shape
    full = [m for m in range(-(tk - 1), tq) if bool(active.diagonal(-m).all())]
    runs: list[tuple[int, int]] = []
    for m in full:
        if runs and runs[-1][1] == m - 1:
            runs[-1] = (runs[-1][0], m)
        else:
            runs.append((m, m))
    return runs


def _head_parts(
    slash: torch.Tensor,
    vertical: torch.Tensor,
    q_blk: torch.Tensor,
    k_blk: torch.Tensor,
    k_pos: torch.Tensor,
    g: int,
) -> list[_Part]:
    """The parts of one (row, head) on an aligned pair: diagonal tiles (causal), chosen off-diagonal
    tiles grouped by how many each query tile has (no mask, no padding), then the bar columns.

    Args:
        slash ``[nB]`` / vertical ``[S]``: this head's pattern; q_blk ``[Tq]`` / k_blk ``[Tk]``: block id of
        each local tile; k_pos ``[Sk]``: key positions.
    """
    d = q_blk[:, None] - k_blk[None, :]  # [Tq, Tk]
    diag = d == 0
    active = (d > 0) & slash[d.clamp(min=0)]
    parts = []
    tq, tk = diag.nonzero(as_tuple=True)
    if tq.numel():
        parts.append(_Part(tq, k_tiles=tk[:, None], causal=True))
    rest = active.clone()
    for first_m, last_m in _uniform_diagonal_runs(active):
        # q tiles i whose whole window (k tiles i - last_m .. i - first_m) exists: one strided call
        lo, hi = max(last_m, 0), min(active.shape[0], active.shape[1] + first_m)
        if hi > lo:
            parts.append(_Part(slice(lo, hi), window=(lo - last_m, last_m - first_m + 1)))
            for m in range(first_m, last_m + 1):
                rest.diagonal(-m)[lo - max(m, 0) : hi - max(m, 0)] = False
    counts = rest.sum(dim=1)
    order = torch.argsort(rest.to(torch.int8), dim=1, descending=True, stable=True)
    for c in counts.unique().tolist():
        if c:
            sel = (counts == c).nonzero().squeeze(1)
            parts.append(_Part(sel, k_tiles=order[sel, :c]))
    bars = vertical[k_pos].nonzero().squeeze(1)
    bar_tile = bars // g
    bar_valid = (k_blk[bar_tile][None, :] < q_blk[:, None]) & ~active[:, bar_tile]  # [Tq, nbar]
    sel = bar_valid.any(dim=1).nonzero().squeeze(1)
    if sel.numel():
        parts.append(_Part(sel, k_rows=bars[None, :].expand(sel.numel(), -1), valid=bar_valid[sel]))
    return parts


def _pair_tiles(pattern: SparsePattern, q_pos: torch.Tensor, k_pos: torch.Tensor) -> _PairTiles:
    """The parts of one (query shard, key shard) pair; unaligned shards get one token-masked part."""
    g = pattern.block_size
    q_blk, k_blk = _aligned_blocks(q_pos, g), _aligned_blocks(k_pos, g)
    if q_blk is None or k_blk is None:
        visible = pattern.visible(q_pos, k_pos)  # [B, H, Sq, Sk], causal included
        zero = torch.zeros(1, dtype=torch.long, device=q_pos.device)
        parts = [
            [
                [_Part(zero, k_tiles=zero[:, None], valid=visible[b, h][None])]
                for h in range(pattern.num_heads)
            ]
            for b in range(pattern.batch)
        ]
        return _PairTiles(q_pos.numel(), k_pos.numel(), parts)
    parts = [
        [
            _head_parts(pattern.slash[b, h], pattern.vertical[b, h], q_blk, k_blk, k_pos, g)
            for h in range(pattern.num_heads)
        ]
        for b in range(pattern.batch)
    ]
    return _PairTiles(g, g, parts)


def _gather_keys(part: _Part, tiles: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keys of a part, ``[T, nK, ...]``, from the key tensor as tiles ``[Tk, g, ...]`` or rows ``[Sk, ...]``."""
    if part.window is not None:
        first, c = part.window
        g, rest = tiles.shape[1], tiles.shape[2:]
        inner = tiles[0, 0].numel()
        return tiles.as_strided(
            (part.num_q_tiles, c * g, *rest),
            (g * inner, inner, *tiles.stride()[2:]),
            tiles.storage_offset() + first * g * inner,
        )
    if part.k_tiles is not None:
        t, c = part.k_tiles.shape
        return tiles[part.k_tiles.reshape(-1)].reshape(t, c * tiles.shape[1], *tiles.shape[2:])
    return rows[part.k_rows]


def _part_mask(
    part: _Part,
    tiles: _PairTiles,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spec: MaskSpec,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> torch.Tensor | None:
    """Bool ``[T, g, nK]`` visibility of a part, or None when the kernel needs no mask (full / causal)."""
    if part.valid is None and spec.window is None and q_doc is None:
        return None
    if part.k_rows is not None and spec.window is None and q_doc is None:
        # bar columns are only valid in blocks before the query tile: no token-level causality needed
        return part.valid[:, None, :].expand(-1, tiles.q_tile, -1)
    qp = q_pos.view(-1, tiles.q_tile)[part.q_tiles]  # [T, g]
    kp = _gather_keys(part, k_pos.view(-1, tiles.k_tile), k_pos)  # [T, nK]
    delta = qp[:, :, None] - kp[:, None, :]
    visible = delta >= 0
    if part.valid is not None:
        visible &= part.valid if part.valid.dim() == 3 else part.valid[:, None, :]
    if spec.window is not None:
        visible &= delta < spec.window
    if q_doc is not None and k_doc is not None:
        qd = q_doc.view(-1, tiles.q_tile)[part.q_tiles]
        kd = _gather_keys(part, k_doc.view(-1, tiles.k_tile), k_doc)
        visible &= (qd[:, :, None] == kd[:, None, :]) & (qd >= 0)[:, :, None] & (kd >= 0)[:, None, :]
    return visible


def check_pair_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    spec: MaskSpec,
) -> None:
    """The checks of one sparse pair that need no host sync (shapes, heads, causality)."""
    if not spec.causal:
        raise ValueError(
            "vertical-slash sparse attention is causal; got MaskSpec(causal=False) - use dense attention"
        )
    if pattern.num_heads != q.shape[2] or pattern.batch not in (1, q.shape[0]):
        raise ValueError(
            f"the sparse pattern covers B={pattern.batch}, H={pattern.num_heads} but q is {tuple(q.shape)} "
            "[B, Sq, H, D]; estimate the pattern from the same heads (after any head permutation / Ulysses split)"
        )
    if q_pos.dim() != 1 or k_pos.dim() != 1 or q_pos.numel() != q.shape[1] or k_pos.numel() != k.shape[1]:
        raise ValueError(
            f"q_pos / k_pos must be 1-D global positions of the q / k rows; got {tuple(q_pos.shape)} / "
            f"{tuple(k_pos.shape)} for q {tuple(q.shape)}, k {tuple(k.shape)}"
        )


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    spec: MaskSpec,
) -> None:
    check_pair_shapes(q, k, q_pos, k_pos, pattern, spec)
    if int(k_pos.max()) >= pattern.seq_len or int(q_pos.max()) >= pattern.seq_len:
        raise ValueError(
            f"positions reach {int(max(q_pos.max(), k_pos.max()))} but the pattern covers S={pattern.seq_len}"
        )


def _masked_kernel(q: torch.Tensor, softcap: float | None) -> str:
    """The fastest available block kernel that takes an explicit mask (and the softcap, if any):
    sdpa on CPU, else torch."""
    return "sdpa" if "sdpa" in available_kernels(q.device, q.dtype, softcap is not None) else "torch"


def _row_pattern(pattern: SparsePattern, batch: int) -> SparsePattern:
    if pattern.batch == batch:
        return pattern
    return SparsePattern(
        pattern.vertical.expand(batch, -1, -1), pattern.slash.expand(batch, -1, -1), pattern.block_size
    )


class _HeadCache:
    """Contiguous ``[Tk, g, 1, D]`` tiles of each K/V head of one batch row, made on first use."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, tile: int) -> None:
        self.k, self.v, self.tile = k, v, tile
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def tiles(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        if head not in self.cache:
            d = self.k.shape[-1]
            self.cache = {
                head: tuple(x[:, head].contiguous().view(-1, self.tile, 1, d) for x in (self.k, self.v))
            }
        return self.cache[head]


def _part_pairs(part: _Part, q_tile: int, mask: torch.Tensor | None) -> int:
    """Score pairs a part computes (a mask counts its visible pairs, causal tiles their lower half)."""
    if mask is not None:
        return int(mask.sum())
    t = part.num_q_tiles
    if part.causal:
        return t * q_tile * (q_tile + 1) // 2
    c = part.window[1] if part.window is not None else part.k_tiles.shape[1]
    return t * q_tile * c * q_tile


def _pair_setup(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    spec: MaskSpec,
    softcap: float | None,
) -> tuple[torch.dtype, int, _PairTiles, str]:
    """Checks, then ``(acc dtype, GQA group size, tiling of the pair, block kernel name)``."""
    _check(q, k, q_pos, k_pos, pattern, spec)
    acc = accumulation_dtype(q.dtype)
    tiles = _pair_tiles(_row_pattern(pattern, q.shape[0]), q_pos, k_pos)
    return acc, q.shape[2] // k.shape[2], tiles, _masked_kernel(q, softcap)


def _row(x: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Batch row ``b`` of per-row document ids (1-D ids are shared by every row)."""
    return x if x is None or x.dim() == 1 else x[b]


def sparse_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    *,
    scale: float,
    spec: MaskSpec = CAUSAL,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sparse attention of one (query shard, key shard) pair under ``pattern``.

    Args:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, H_kv, D]``; q_pos ``[Sq]`` / k_pos ``[Sk]`` global positions.
        pattern: covers the H query heads (B rows or 1).
        spec: must be causal; its window applies on top of the pattern.
        q_doc, k_doc: document ids ``[Sq]`` / ``[B, Sq]`` (negative = padding) or None.
        softcap: None, or c > 0: scores become c·tanh(score / c) (see ``ops/attention/torch_kernel.py``).

    Returns:
        ``(out [B, Sq, H, D], lse [B, H, Sq], pairs)`` in fp32 (fp64 for fp64 inputs); rows that see
        no key have out 0 and lse -inf; ``pairs`` = score pairs computed over rows and heads.
    """
    acc, group, tiles, kernel = _pair_setup(q, k, q_pos, k_pos, pattern, spec, softcap)
    b, sq, h, d = q.shape
    out = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, sq), NEG_INF, dtype=acc, device=q.device)
    pairs = 0
    for bi in range(b):
        qd, kd = _row(q_doc, bi), _row(k_doc, bi)
        kv = _HeadCache(k[bi], v[bi], tiles.k_tile)
        for hi in range(h):
            q_t = q[bi, :, hi].contiguous().view(-1, tiles.q_tile, 1, d)  # [Tq, g, 1, D]
            out_t = torch.zeros(q_t.shape, dtype=acc, device=q.device)
            lse_t = torch.full((q_t.shape[0], 1, tiles.q_tile), NEG_INF, dtype=acc, device=q.device)
            k_t, v_t = kv.tiles(hi // group)
            for part in tiles.parts[bi][hi]:
                mask = _part_mask(part, tiles, q_pos, k_pos, spec, qd, kd)
                o_p, lse_p = block_attn_forward(
                    q_t[part.q_tiles],
                    _gather_keys(part, k_t, k_t.view(-1, 1, d)),  # [T, nK, 1, D]
                    _gather_keys(part, v_t, v_t.view(-1, 1, d)),
                    scale=scale,
                    mask=mask,
                    causal=part.causal and mask is None,
                    kernel=kernel,
                    softcap=softcap,
                )
                out_t[part.q_tiles], lse_t[part.q_tiles] = merge_attn(
                    out_t[part.q_tiles], lse_t[part.q_tiles], o_p, lse_p
                )
                pairs += _part_pairs(part, o_p.shape[1], mask)
            out[bi, :, hi] = out_t.view(sq, d)
            lse[bi, hi] = lse_t.view(sq)
    return out, lse, pairs


def sparse_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: SparsePattern,
    *,
    scale: float,
    spec: MaskSpec = CAUSAL,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one pair given the FINAL ``out`` ``[B, Sq, H, D]`` and ``lse`` ``[B, H, Sq]`` of the rows.

    Returns ``(dq [B, Sq, H, D], dk, dv [B, Sk, H_kv, D])`` in fp32 (fp64 for fp64 inputs).
    """
    acc, group, tiles, kernel = _pair_setup(q, k, q_pos, k_pos, pattern, spec, softcap)
    b, sq, h, d = q.shape
    dq = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(k.shape, dtype=acc, device=q.device)
    gq = tiles.q_tile
    for bi in range(b):
        qd, kd = _row(q_doc, bi), _row(k_doc, bi)
        kv = _HeadCache(k[bi], v[bi], tiles.k_tile)
        for hi in range(h):
            q_t, do_t, o_t = (x[bi, :, hi].contiguous().view(-1, gq, 1, d) for x in (q, dout, out))
            lse_t = lse[bi, hi].reshape(-1, 1, gq)
            dq_t = torch.zeros(q_t.shape, dtype=acc, device=q.device)
            k_t, v_t = kv.tiles(hi // group)
            dk_h = torch.zeros(k_t.shape, dtype=acc, device=q.device)  # [Tk, g, 1, D]
            dv_h = torch.zeros(k_t.shape, dtype=acc, device=q.device)
            for part in tiles.parts[bi][hi]:
                mask = _part_mask(part, tiles, q_pos, k_pos, spec, qd, kd)
                dq_p, dk_p, dv_p = block_attn_backward(
                    do_t[part.q_tiles],
                    q_t[part.q_tiles],
                    _gather_keys(part, k_t, k_t.view(-1, 1, d)),
                    _gather_keys(part, v_t, v_t.view(-1, 1, d)),
                    o_t[part.q_tiles],
                    lse_t[part.q_tiles],
                    scale=scale,
                    mask=mask,
                    causal=part.causal and mask is None,
                    kernel=kernel,
                    softcap=softcap,
                )
                if isinstance(part.q_tiles, slice):
                    dq_t[part.q_tiles] += dq_p
                else:
                    dq_t.index_add_(0, part.q_tiles, dq_p)
                if part.window is not None:
                    first, c = part.window
                    n = part.num_q_tiles
                    dk_w, dv_w = (x.reshape(n, c, *k_t.shape[1:]) for x in (dk_p, dv_p))
                    for j in range(c):  # key tile first + i + j of query tile i
                        dk_h[first + j : first + j + n] += dk_w[:, j]
                        dv_h[first + j : first + j + n] += dv_w[:, j]
                elif part.k_tiles is not None:
                    index, shape = part.k_tiles.reshape(-1), (-1, *k_t.shape[1:])
                    dk_h.index_add_(0, index, dk_p.reshape(shape))
                    dv_h.index_add_(0, index, dv_p.reshape(shape))
                else:
                    index = part.k_rows.reshape(-1)
                    dk_h.view(-1, 1, d).index_add_(0, index, dk_p.reshape(-1, 1, d))
                    dv_h.view(-1, 1, d).index_add_(0, index, dv_p.reshape(-1, 1, d))
            dq[bi, :, hi] = dq_t.view(sq, d)
            dk[bi, :, hi // group] += dk_h.view(-1, d)
            dv[bi, :, hi // group] += dv_h.view(-1, d)
    return dq, dk, dv
