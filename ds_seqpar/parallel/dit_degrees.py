"""db-SP's runtime choice of the parallel degrees U x R of block-sparse DiT attention (docs/dit_sparse.md
"The degree choice"). Pure arithmetic on the shared pattern, so every rank picks the same factorisation.

For the SP size P and every U x R = P that the heads allow (U divides H, and with ``stripe`` / ``dbsp``
S is a multiple of R·G), the predicted time of one fwd+bwd call is

    compute  = ρ_s(U, R) · W / P · pair_s          W = score pairs the pattern keeps (all rows and heads)
    comm     = (Ulysses + ring elements per rank) · elem_s
               Ulysses (U-1)/U · B·n·D·(2H + 2H_kv) x 2 (q, k, v in, out back; fwd and bwd alike)
               ring    2(R-1) · B·(S/R)·k_u·D x 2   (K/V of the k_u K/V heads of a Ulysses rank)
             + db-SP's moved blocks: 2 · (moved · G / P) · B·D·(2h_u + 2k_u) (q, k, v there, out back)
             + (when the choice differs from the mesh's) 2 · B·n·D·(H + 2H_kv) + B·n·H·D to reach its
               layout and back (``relayout`` over the SP group)

with ρ_s from the balancing plan the call would run (``parallel/dit_balance.py``). ``pair_s`` and
``elem_s`` are measured costs (``DegreeCost``; ``benchmarks/bench_dit_sparse.py`` prints them).
The meshes of every factorisation are created once, collectively, at the first call that needs one
(``degree_mesh``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.layout.ring import StripeLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.sparse.block_pattern import BlockPattern
from ds_seqpar.parallel.dit_balance import dit_balance_rho, plan_dit_balance

__all__ = [
    "DegreeChoice",
    "DegreeCost",
    "allowed_degrees",
    "choose_degrees",
    "degree_mesh",
    "predict_degrees",
]

DEGREE_MESHES = "dit_degree_meshes"  # key in mesh.groups.subgroups (shared by every mesh on those groups)


@dataclass(frozen=True)
class DegreeCost:
    """Seconds per kept score pair (fwd+bwd, per rank) and per element communicated (fwd+bwd)."""

    pair_s: float = 2.0e-9
    elem_s: float = 4.0e-9


@dataclass(frozen=True)
class DegreePrediction:
    """One factorisation's prediction: ``rho_s`` (None when a layout splits blocks: not chosen),
    ``compute_s``, ``comm_s`` and their sum ``total_s``."""

    ulysses: int
    ring: int
    rho_s: float | None
    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class DegreeChoice:
    """The chosen ``degrees`` (U, R) and every candidate's prediction (U ascending)."""

    degrees: tuple[int, int]
    table: tuple[DegreePrediction, ...]


def allowed_degrees(
    sp_size: int, num_heads: int, seq_len: int, block_size: int, balancing: str
) -> list[tuple[int, int]]:
    """Every (U, R) with U·R = P, U dividing H, and (``stripe`` / ``dbsp``) S a multiple of R·G."""
    out = []
    for u in range(1, sp_size + 1):
        r = sp_size // u
        if sp_size % u or num_heads % u:
            continue
        if balancing != "none" and seq_len % (r * block_size):
            continue
        out.append((u, r))
    return out


def _comm_elements(u: int, r: int, batch: int, seq_len: int, heads: HeadPlan, head_dim: int) -> float:
    n, h, hkv = seq_len / (u * r), heads.num_heads, heads.num_kv_heads
    ulysses = (u - 1) / u * batch * n * head_dim * (2 * h + 2 * hkv)
    ring = 2 * (r - 1) * batch * (seq_len / r) * max(heads.kv_counts) * head_dim
    return 2.0 * (ulysses + ring)


def predict_degrees(
    pattern: BlockPattern,
    num_kv_heads: int,
    sp_size: int,
    head_dim: int,
    balancing: str = "dbsp",
    cost: DegreeCost = DegreeCost(),
    current: tuple[int, int] | None = None,
    ring_for: Callable[[int], object] | None = None,
    min_block_gain: float = 0.01,
    block_search: int = 512,
) -> tuple[DegreePrediction, ...]:
    """The prediction of every allowed factorisation (module docstring). ``current``: the mesh's (U, R)
    (others pay the relayout); ``ring_for(R)``: the ring layout ``none`` keeps (default: stripes)."""
    s, g, h, b = pattern.seq_len, pattern.block_size, pattern.num_heads, pattern.batch
    kept = float(pattern.mask.to(torch.float64).sum()) * g * g
    rows = []
    for u, r in allowed_degrees(sp_size, h, s, g, balancing):
        heads = HeadPlan.build(h, num_kv_heads, u)
        ring = (ring_for or (lambda rr: StripeLayout(rr, g)))(r)
        plan = plan_dit_balance(pattern, ring, num_kv_heads, heads, balancing, min_block_gain, block_search)
        rho = dit_balance_rho(pattern, plan, r)
        elems = _comm_elements(u, r, b, s, heads, head_dim)
        h_u, k_u = max(heads.q_counts), max(heads.kv_counts)
        elems += (
            2 * plan.blocks_moved * g / (u * r) * b * head_dim * (2 * h_u + 2 * k_u)
        )  # the block relayout
        if current is not None and (u, r) != tuple(current):
            elems += 2 * b * (s / sp_size) * head_dim * (2 * h + 2 * num_kv_heads)
        compute = (rho if rho is not None else float("inf")) * kept / sp_size * cost.pair_s
        rows.append(DegreePrediction(u, r, rho, compute, elems * cost.elem_s))
    return tuple(rows)


def choose_degrees(
    pattern: BlockPattern, num_kv_heads: int, sp_size: int, head_dim: int, **kw: object
) -> DegreeChoice:
    """The allowed (U, R) with the lowest predicted time (first in U order on ties); ``kw`` as
    ``predict_degrees``. Raises when no factorisation is allowed."""
    table = predict_degrees(pattern, num_kv_heads, sp_size, head_dim, **kw)
    if not table:
        raise ValueError(
            f"no U x R = {sp_size} fits H={pattern.num_heads} heads and S={pattern.seq_len} with block_size="
            f"{pattern.block_size}; pad S to a multiple of {sp_size * pattern.block_size} or use balancing='none'"
        )
    best = min(table, key=lambda row: row.total_s)
    return DegreeChoice((best.ulysses, best.ring), table)


def degree_mesh(mesh: SeqParMesh, ulysses: int) -> SeqParMesh:
    """A mesh of the same SP ranks with Ulysses degree ``ulysses`` (ring: the rest). The first call on these
    process groups creates the groups of EVERY factorisation (collective over the world, same order on
    every rank); later calls communicate nothing."""
    if ulysses == mesh.ulysses_size:
        return mesh
    cache = mesh.groups.subgroups
    if DEGREE_MESHES not in cache:
        p = mesh.sp_size
        cache[DEGREE_MESHES] = {
            u: SeqParMesh.build(p, u, fault_timeout_s=mesh.settings.fault_timeout_s)
            for u in range(1, p + 1)
            if p % u == 0 and u != mesh.ulysses_size
        }
    return cache[DEGREE_MESHES][ulysses]
