"""``DitSparseSettings``: the frozen, validated settings of block-sparse DiT attention (docs/dit_sparse.md).

Not a key of the ``sequence_parallel`` section: the caller (a diffusers attention processor) builds one
and passes it to ``block_sparse_attention(..., budget=settings)``. Every bad value raises a ValueError
that names it and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_seqpar.ops.sparse.block_pattern import BlockBudget

__all__ = ["BALANCINGS", "DitSparseSettings"]

BALANCINGS = ("none", "stripe", "dbsp")


@dataclass(frozen=True)
class DitSparseSettings:
    """How block-sparse DiT attention estimates its pattern, balances and picks its degrees.

    Args:
        block_size: G, tokens per block of the pattern (>= 1; S must be a multiple of R·G for
            ``stripe`` / ``dbsp``).
        keep: fraction of the nB key blocks each query block keeps, in (0, 1], or None.
        threshold: cumulative block probability each query block keeps, in (0, 1], or None (with
            ``keep``: the smaller count; at least one of the two).
        balancing: ``none`` (the mesh's ring layout), ``stripe`` (blocks round-robin over the ring),
            ``dbsp`` (stripes + head-level + block-level balancing).
        degrees: ``"mesh"`` (the mesh's U x R), ``"auto"`` (per call, the factorisation of the SP size
            with the lowest predicted cost, ``parallel/dit_degrees.py``), or an explicit ``(U, R)``.
        min_block_gain: db-SP moves blocks away from their stripe rank only when that lowers ρ_s by more
            than this (it costs two all-to-alls over the ring); a negative value forces the balanced
            placement, without the bonus for staying on the stripe rank (tests use it).
        block_search: swaps of two blocks that db-SP's block placement tries on ρ_s (0 = only the
            longest-processing-time placement of the rows' work).
    """

    block_size: int = 64
    keep: float | None = 0.25
    threshold: float | None = None
    balancing: str = "dbsp"
    degrees: str | tuple[int, int] = "mesh"
    min_block_gain: float = 0.01
    block_search: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(
                f"DitSparseSettings.block_size={self.block_size!r} must be an int >= 1 (e.g. 64)"
            )
        try:
            BlockBudget(self.block_size, self.keep, self.threshold)
        except ValueError as err:
            raise ValueError(f"DitSparseSettings: {err}") from None
        if self.balancing not in BALANCINGS:
            raise ValueError(
                f"DitSparseSettings.balancing={self.balancing!r} is not one of {', '.join(BALANCINGS)}"
            )
        d = self.degrees
        if isinstance(d, list):
            object.__setattr__(self, "degrees", d := tuple(d))
        explicit = isinstance(d, tuple) and len(d) == 2 and all(isinstance(x, int) and x >= 1 for x in d)
        if d not in ("mesh", "auto") and not explicit:
            raise ValueError(
                f"DitSparseSettings.degrees={d!r} must be 'mesh', 'auto' or a pair (U, R) of ints >= 1 "
                "whose product is the SP size"
            )
        if not isinstance(self.min_block_gain, (int, float)) or self.min_block_gain != self.min_block_gain:
            raise ValueError(
                f"DitSparseSettings.min_block_gain={self.min_block_gain!r} must be a number (e.g. 0.01)"
            )

        if not isinstance(self.block_search, int) or self.block_search < 0:
            raise ValueError(
                f"DitSparseSettings.block_search={self.block_search!r} must be an int >= 0 (e.g. 512)"
            )

    @property
    def budget(self) -> BlockBudget:
        """The estimation budget (``ops/sparse/block_pattern.BlockBudget``)."""
        return BlockBudget(self.block_size, self.keep, self.threshold)
