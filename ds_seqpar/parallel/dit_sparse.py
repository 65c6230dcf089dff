"""Block-sparse attention of diffusion transformers over the SP group, db-SP balanced (docs/dit_sparse.md).

Legend: P = U · R SP ranks, n = S / P tokens per rank, G = block size, nB = S / G.

    q [B, n, H, D], k/v [B, n, H_kv, D] (``mesh.settings.input_layout()`` order, like ``ds_seqpar.attention``)
      1. the pattern: given, or estimated over the SP group from block-mean-pooled q, k
         (``ops/sparse/block_pattern.py``; all-reduce of [B, nB, H + H_kv, D] + [B, nB], broadcast of the
         bool [B, H, nB, nB])
      2. the degrees: the mesh's, an explicit (U', R'), or "auto" (``parallel/dit_degrees.py``); another
         factorisation than the mesh's: one all-to-all over the SP group into its layout (and back after 6)
      3. the balancing plan (``parallel/dit_balance.py``; pure, identical on every rank) and, with dbsp, the
         head permutation of q, k, v
      4. Ulysses all-to-all                                     q [B, S/R, h_u, D]
      5. ring layout of the plan (stripes / db-SP blocks): one all-to-all over the ring, then the ring engine
         with the non-causal block kernel (``RingPlan(sparse=BlockPattern, sparse_kernel=DIT_BLOCK_KERNEL)``)
         and the all-to-all back
      6. inverse all-to-all, inverse head permutation            out [B, n, H, D]

Exact attention under the pattern (and the documents): tests compare it with ``block_sparse_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.reduce import GroupReducer
from ds_seqpar.comm.relayout import relayout
from ds_seqpar.layout import UspLayout
from ds_seqpar.layout.ring import StripeLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.masks import MaskSpec
from ds_seqpar.ops.sparse.block_kernel import DIT_BLOCK_KERNEL
from ds_seqpar.ops.sparse.block_pattern import BlockPattern, estimate_block_pattern
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.dit_balance import DitBalancePlan, dit_balance_rho, plan_dit_balance
from ds_seqpar.parallel.dit_degrees import DegreeCost, allowed_degrees, choose_degrees, degree_mesh
from ds_seqpar.parallel.dit_settings import BALANCINGS, DitSparseSettings
from ds_seqpar.parallel.ring import RingPlan, check_qkv, ring_attention
from ds_seqpar.parallel.ulysses import gather_heads, scatter_heads

__all__ = ["DitSparseStats", "block_sparse_attention", "dit_sparse_stats"]

STATS_KEY = "dit_sparse_stats"
NAME = "block_sparse_attention"


@dataclass(frozen=True)
class DitSparseStats:
    """What one call scheduled: ``rho_s`` (None when a layout splits blocks), ``density`` (kept fraction
    of the token pairs), ``head_order``, ``blocks_moved`` (db-SP block placement), ``degrees`` (U, R)."""

    layer: int | None
    rho_s: float | None
    density: float
    head_order: tuple[int, ...]
    blocks_moved: int
    degrees: tuple[int, int]


def dit_sparse_stats(mesh: SeqParMesh) -> dict[int | None, DitSparseStats]:
    """The latest ``DitSparseStats`` per layer index (None = calls without one)."""
    return mesh.resources.setdefault(STATS_KEY, {})


def _check(q, k, v, mesh: SeqParMesh, cfg: DitSparseSettings, pattern, doc_ids) -> int:
    """Everything before any collective; returns S."""
    check_qkv(q, k, v, NAME)
    settings, layout = mesh.settings, mesh.settings.input_layout()
    if layout.pieces != 1 or layout.dynamic or layout.ring.per_batch or not settings.schedule.sparse_ring:
        raise ValueError(
            f"{NAME} runs on the sparse ring's schedules and plain layouts; got ring.schedule="
            f"{settings.ring.schedule!r}, ring.layout={settings.ring.layout!r}, dynamic_degree="
            f"{layout.dynamic}; use ring.schedule 'p2p' (or 'double_ring') with layout contiguous / zigzag / stripe"
        )
    h, seq_len = q.shape[2], q.shape[1] * layout.world
    if mesh.ulysses_size > h:
        raise ValueError(f"{NAME}: ulysses_degree={mesh.ulysses_size} exceeds the {h} query heads; lower it")
    layout.check_length(seq_len)
    if pattern is not None:
        if not isinstance(pattern, BlockPattern):
            raise TypeError(f"{NAME}: pattern must be a BlockPattern, got {type(pattern).__name__}")
        if (pattern.seq_len, pattern.num_heads, pattern.block_size) != (seq_len, h, cfg.block_size) or (
            pattern.batch not in (1, q.shape[0])
        ):
            raise ValueError(
                f"{NAME}: pattern (B={pattern.batch}, H={pattern.num_heads}, S={pattern.seq_len}, G="
                f"{pattern.block_size}) does not fit q (B={q.shape[0]}, H={h}, S={seq_len}) with budget "
                f"block_size={cfg.block_size}; build it for this call (or pass budget=None)"
            )
    if doc_ids is not None and (doc_ids.dim() not in (1, 2) or doc_ids.shape[-1] != seq_len
                                or doc_ids.is_floating_point() or doc_ids.shape[0] not in (q.shape[0], seq_len)):  # fmt: skip
        raise ValueError(f"{NAME}: doc_ids must be integer [S] or [B, S] with S={seq_len}; got "
                         f"{doc_ids.dtype} {tuple(doc_ids.shape)}")  # fmt: skip
    _check_degrees(cfg, mesh, h, seq_len)
    return seq_len


def _check_degrees(cfg: DitSparseSettings, mesh: SeqParMesh, h: int, seq_len: int) -> None:
    p, g = mesh.sp_size, cfg.block_size
    if cfg.degrees != "mesh" and mesh.settings.ring.schedule != "p2p":
        raise ValueError(
            f"DitSparseSettings.degrees={cfg.degrees!r} runs other factorisations on meshes with the p2p ring, "
            f"but this mesh's ring.schedule is {mesh.settings.ring.schedule!r}; use degrees='mesh' or ring.schedule 'p2p'"
        )
    if cfg.degrees == "auto" and not allowed_degrees(p, h, seq_len, g, cfg.balancing):
        raise ValueError(
            f"{NAME}: degrees='auto' finds no U x R = {p} with U dividing H={h} and S={seq_len} a multiple of "
            f"R x block_size {g}; pad S to a multiple of {p * g} or use balancing='none'"
        )
    if isinstance(cfg.degrees, tuple):
        u, r = cfg.degrees
        if u * r != p or h % u:
            raise ValueError(
                f"DitSparseSettings.degrees={cfg.degrees} must multiply to the SP size {p} with U dividing "
                f"H={h}; pick another (U, R), 'mesh' or 'auto'"
            )
    rings = [mesh.ring_size] if cfg.degrees == "mesh" else [p // u for u in range(1, p + 1) if p % u == 0]
    rings = [cfg.degrees[1]] if isinstance(cfg.degrees, tuple) else rings
    if cfg.balancing != "none" and cfg.degrees != "auto" and seq_len % (rings[0] * g):
        raise ValueError(
            f"{NAME}: S={seq_len} is not a multiple of ring degree {rings[0]} x block_size {g} "
            f"(balancing={cfg.balancing!r}); pad S or use balancing='none'"
        )


def _agree(q, k, v, mesh, cfg: DitSparseSettings, pattern, doc_ids) -> None:
    """Every SP rank passed the same shapes and settings (``parallel/agree.py``: ``RankShapeError`` on every
    rank otherwise; one all-gather the first time a mesh sees these shapes)."""
    degrees = {"mesh": (0, 0), "auto": (-1, -1)}.get(cfg.degrees, cfg.degrees)
    flags = (cfg.block_size, BALANCINGS.index(cfg.balancing), *degrees, int(pattern is not None))
    mask = None if pattern is None else pattern.mask
    check_same_inputs(mesh, NAME, ("q", "k", "v", "doc_ids", "pattern"), (q, k, v, doc_ids, mask), flags,
                      "shard every batch with ds_seqpar.input_layout(mesh) and pass the same settings and pattern "
                      "on every rank", ("block_size", "balancing", "U", "R", "pattern given"))  # fmt: skip


def _estimate(q, k, mesh, seq_len, cfg, scale, doc_ids) -> BlockPattern:
    layout = mesh.settings.input_layout()
    pos = layout.local_positions(seq_len, mesh.coords.sp_rank).to(q.device)
    doc = None if doc_ids is None else layout.shard(doc_ids.to(q.device), mesh.coords.sp_rank, dim=-1)
    reducer = GroupReducer(mesh.group("sp"), mesh.members["sp"], mesh.comm_stats)
    return estimate_block_pattern(q, k, pos, seq_len, cfg.budget, scale, doc, reducer)


def _degrees(cfg, mesh, pattern, h_kv, d, cost) -> tuple[int, int]:
    if cfg.degrees == "mesh":
        return mesh.ulysses_size, mesh.ring_size
    if isinstance(cfg.degrees, tuple):
        return cfg.degrees
    current = (mesh.ulysses_size, mesh.ring_size)
    return choose_degrees(pattern, h_kv, mesh.sp_size, d, balancing=cfg.balancing, cost=cost,
                          current=current, min_block_gain=cfg.min_block_gain,
                          block_search=cfg.block_search).degrees  # fmt: skip


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    pattern: BlockPattern | None = None,
    budget: DitSparseSettings | None = None,
    doc_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    layer: int | None = None,
    cost: DegreeCost | None = None,
) -> torch.Tensor:
    """Exact non-causal attention under a block-sparse pattern over the SP group (module docstring).

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``: this rank's tokens in ``mesh.settings.input_layout()``.
        pattern: a ``BlockPattern`` of the whole sequence (identical on every rank), or None: estimated.
        budget: ``DitSparseSettings`` (block size, keep / threshold, balancing, degrees); None = defaults
            (with a given pattern: its block size).
        doc_ids: ``[S]`` / ``[B, S]`` in global order, < 0 = padding (never a key; its output 0).
        layer: key of ``dit_sparse_stats``; cost: the degree predictor's costs (``degrees="auto"``).

    Returns:
        ``out [B, n, H, D]`` in q.dtype; differentiable in q, k, v (the pattern is not).
    """
    cfg = budget or DitSparseSettings(block_size=pattern.block_size if pattern is not None else 64)
    seq_len = _check(q, k, v, mesh, cfg, pattern, doc_ids)
    _agree(q, k, v, mesh, cfg, pattern, doc_ids)
    scale = q.shape[3] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if pattern is None:
        pattern = _estimate(q, k, mesh, seq_len, cfg, scale, doc_ids)
    u, r = _degrees(cfg, mesh, pattern, k.shape[2], q.shape[3], cost or DegreeCost())
    run = degree_mesh(mesh, u)
    src = mesh.settings.input_layout()
    dst = src if run is mesh else _run_layout(run, cfg, r)
    sp = (mesh.group("sp"), mesh.coords.sp_rank, mesh.comm_stats)
    if dst is not src:
        q, k, v = relayout((q, k, v), src, dst, *sp)
    out, plan = _balanced(q, k, v, run, dst, pattern, cfg, doc_ids, scale)
    if dst is not src:
        (out,) = relayout((out,), dst, src, *sp)
    rho = dit_balance_rho(pattern, plan, r)
    order = tuple(plan.head_order or range(pattern.num_heads))
    dit_sparse_stats(mesh)[layer] = DitSparseStats(
        layer, rho, pattern.density(), order, plan.blocks_moved, (u, r)
    )
    return out


def _run_layout(run: SeqParMesh, cfg: DitSparseSettings, r: int) -> UspLayout:
    """The input layout of a degree mesh: stripes of G over its ring (``none``: its configured ring)."""
    if cfg.balancing == "none":
        return run.settings.input_layout()
    return UspLayout(StripeLayout(r, cfg.block_size), run.ulysses_size)


def _same(a: object, b: object, seq_len: int) -> bool:
    return a is b or all(
        torch.equal(a.local_positions(seq_len, x), b.local_positions(seq_len, x)) for x in range(a.world)
    )


def _balanced(q, k, v, mesh, layout, pattern, cfg, doc_ids, scale) -> tuple[torch.Tensor, DitBalancePlan]:
    """Steps 3-6 on ``mesh`` (its degrees), q/k/v in ``layout``; returns out and the balancing plan."""
    h, h_kv = q.shape[2], k.shape[2]
    heads = HeadPlan.build(h, h_kv, mesh.ulysses_size)
    plan = plan_dit_balance(
        pattern, layout.ring, h_kv, heads, cfg.balancing, cfg.min_block_gain, cfg.block_search
    )
    if plan.head_order is not None:
        q_index = torch.tensor(plan.head_order, device=q.device)
        kv_index = q_index[:: h // h_kv] // (h // h_kv)
        q, k, v = q.index_select(2, q_index), k.index_select(2, kv_index), v.index_select(2, kv_index)
        pattern = pattern.heads(plan.head_order)
    u, seq_len = mesh.coords.ulysses_rank, q.shape[1] * layout.world
    ring_layout = plan.layouts[u]
    ring_plan = RingPlan(mesh.schedule(), ring_layout, MaskSpec(causal=False), doc_ids, "auto",
                         sparse=pattern.heads(plan.groups[u]), sparse_kernel=DIT_BLOCK_KERNEL)  # fmt: skip
    q2, k2, v2 = scatter_heads(q, k, v, heads, mesh)
    moved = not _same(layout.ring, ring_layout, seq_len)
    ring = (mesh.group("ring"), mesh.coords.ring_rank, mesh.comm_stats)
    if moved:
        q2, k2, v2 = relayout((q2, k2, v2), layout.ring, ring_layout, *ring)
    out, _ = ring_attention(q2, k2, v2, ring_plan, scale)
    if moved:
        (out,) = relayout((out,), ring_layout, layout.ring, *ring)
    out = gather_heads(out, heads, mesh)
    if plan.head_order is not None:
        out = out.index_select(2, torch.argsort(torch.tensor(plan.head_order, device=out.device)))
    return out, plan
