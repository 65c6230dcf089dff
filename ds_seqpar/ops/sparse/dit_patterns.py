"""Deterministic DiT-like block patterns (docs/dit_sparse.md "Shipped patterns").

The nB = T·Y·X blocks of G tokens are a grid of T frames of Y x X patch blocks, in raster order (frame,
row, column): the token order of a DiT's patch sequence when one block is G consecutive patches. Head h
keeps, for every query block, ``round(density[h] · nB)`` key blocks:

  * the diagonal block (always);
  * the ``global_blocks`` key blocks of head h (every query block sees them; chosen per head);
  * then the nearest key blocks on the grid: distance² = (Δy² + Δx²) + (temporal · Δt)², ties broken by a
    fixed per-head jitter (seeded), so the kept region is a disc (a cylinder over frames).

Per-head densities differ (``densities``, or log-spaced from ``min_density`` to ``max_density`` and then
shuffled per seed), which is what makes head balancing matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_seqpar.ops.sparse.block_pattern import BlockPattern

__all__ = ["SHIPPED", "DitPatternSpec", "dit_pattern", "load_shipped"]


@dataclass(frozen=True)
class DitPatternSpec:
    """One generated pattern: grid ``(T, Y, X)`` of blocks, ``heads``, ``block_size`` G, densities
    (explicit per head, or log-spaced in [min_density, max_density]), global blocks, temporal weight."""

    grid: tuple[int, int, int]
    heads: int
    block_size: int
    seed: int = 0
    min_density: float = 0.05
    max_density: float = 0.5
    densities: tuple[float, ...] | None = None
    global_blocks: int = 2
    temporal: float = 2.0

    def __post_init__(self) -> None:
        if len(self.grid) != 3 or min(self.grid) < 1:
            raise ValueError(f"DitPatternSpec.grid={self.grid!r} must be (T, Y, X) with every entry >= 1")
        if self.densities is not None and len(self.densities) != self.heads:
            raise ValueError(
                f"DitPatternSpec.densities has {len(self.densities)} entries for {self.heads} heads"
            )
        if not 0.0 < self.min_density <= self.max_density <= 1.0:
            raise ValueError(
                f"DitPatternSpec densities [{self.min_density}, {self.max_density}] must lie in (0, 1]"
            )

    @property
    def num_blocks(self) -> int:
        return math.prod(self.grid)

    @property
    def seq_len(self) -> int:
        return self.num_blocks * self.block_size

    def head_densities(self) -> list[float]:
        if self.densities is not None:
            return list(self.densities)
        lo, hi, h = math.log(self.min_density), math.log(self.max_density), self.heads
        values = [math.exp(lo + (hi - lo) * i / max(1, h - 1)) for i in range(h)]
        order = torch.randperm(h, generator=torch.Generator().manual_seed(self.seed)).tolist()
        return [values[i] for i in order]


def dit_pattern(spec: DitPatternSpec) -> BlockPattern:
    """The ``BlockPattern`` ``[1, H, nB, nB]`` of ``spec`` (module docstring); the same for the same spec."""
    _, y, x = spec.grid
    nb = spec.num_blocks
    gen = torch.Generator().manual_seed(spec.seed + 1)
    idx = torch.arange(nb)
    ft, fy, fx = (idx // (y * x)).double(), ((idx // x) % y).double(), (idx % x).double()
    dist2 = (
        (fy[:, None] - fy[None, :]) ** 2
        + (fx[:, None] - fx[None, :]) ** 2
        + (spec.temporal * (ft[:, None] - ft[None, :])) ** 2
    )  # [nB, nB]
    mask = torch.zeros(1, spec.heads, nb, nb, dtype=torch.bool)
    for h, density in enumerate(spec.head_densities()):
        jitter = torch.rand(nb, nb, generator=gen, dtype=torch.float64) * 0.5
        score = dist2 + jitter
        glob = torch.randperm(nb, generator=gen)[: spec.global_blocks]
        score[:, glob] = -1.0  # global blocks right after the diagonal
        score.fill_diagonal_(-2.0)
        count = min(nb, max(1, round(density * nb)))
        mask[0, h].scatter_(1, score.argsort(dim=1, stable=True)[:, :count], True)
    return BlockPattern(mask, spec.block_size, spec.seq_len)


SHIPPED: dict[str, DitPatternSpec] = {
    # an image DiT at 1024 x 1024 px / patch 2 / VAE 8 -> 64 x 64 patches; 8 x 8 blocks of 64 tokens
    "image": DitPatternSpec((1, 8, 8), 8, 64, seed=0, min_density=0.06, max_density=0.5),
    # a video DiT: 4 latent frames of 4 x 8 blocks of 64 tokens (S = 8192)
    "video": DitPatternSpec((4, 4, 8), 8, 64, seed=1, min_density=0.04, max_density=0.4, temporal=2.0),
}
"""The shipped patterns (``assets/dit_patterns/<name>.pt``, written by ``assets/make_dit_patterns.py``)."""


def load_shipped(name: str, root: str | None = None) -> BlockPattern:
    """The committed pattern ``name`` of ``SHIPPED`` (``assets/dit_patterns/<name>.pt``: its bool mask)."""
    from pathlib import Path

    if name not in SHIPPED:
        raise ValueError(f"no shipped DiT pattern {name!r}; valid: {', '.join(SHIPPED)}")
    base = Path(root) if root is not None else Path(__file__).resolve().parents[3] / "assets" / "dit_patterns"
    spec = SHIPPED[name]
    mask = torch.load(base / f"{name}.pt", weights_only=True)
    return BlockPattern(mask, spec.block_size, spec.seq_len)
