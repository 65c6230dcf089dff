"""The vertical-slash pattern (one per batch row and query head) and its estimation (docs/sparse.md).

    vertical [B, H, S]  chosen key columns ("vertical lines", sink tokens included)
    slash    [B, H, nB] chosen block diagonals d = q_block - k_block (d = 0 always chosen)

Estimation (``estimate_pattern``): the last ``last_q`` queries of the WHOLE sequence score every key
(causal softmax); a key column's vertical score is the sum of its probabilities, a diagonal's slash
score the sum along it. The first ``sink_tokens`` columns and the ``local_diagonals`` nearest diagonals
are always taken; then the top-``vertical`` columns and top-``slash`` diagonals. Distributed, each rank
scores only its own keys: a ``Reducer`` (sum / max / broadcast over the ring or SP group; ``None`` = one
process) completes the sums, so every rank ends with the same pattern. This module never calls a
collective itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Reducer", "SparsePattern", "VerticalSlashBudget", "diagonals_to_blocks", "estimate_pattern"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SparsePattern:
    """Vertical-slash pattern of every (batch row, query head), in global positions.

    Args:
        vertical: bool ``[B, H, S]``, chosen key columns.
        slash: bool ``[B, H, nB]``, chosen block diagonals (``slash[..., 0]`` must be True: every
            query sees its own block, causally).
        block_size: G in tokens.
    """

    vertical: torch.Tensor
    slash: torch.Tensor
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"SparsePattern.block_size={self.block_size} must be >= 1")
        if self.vertical.dtype != torch.bool or self.slash.dtype != torch.bool:
            raise ValueError("SparsePattern.vertical and .slash must be bool tensors")
        if (
            self.vertical.dim() != 3
            or self.slash.dim() != 3
            or self.vertical.shape[:2] != self.slash.shape[:2]
        ):
            raise ValueError(
                f"SparsePattern needs vertical [B, H, S] and slash [B, H, nB]; got {tuple(self.vertical.shape)} "
                f"and {tuple(self.slash.shape)}"
            )
        if self.slash.shape[-1] != math.ceil(self.seq_len / self.block_size):
            raise ValueError(
                f"slash has {self.slash.shape[-1]} block diagonals but S={self.seq_len} with block_size="
                f"{self.block_size} has {math.ceil(self.seq_len / self.block_size)}"
            )
        if not bool(self.slash[..., 0].all()):
            raise ValueError(
                "SparsePattern.slash[..., 0] must be True (the diagonal block is always computed)"
            )

    @property
    def seq_len(self) -> int:
        return self.vertical.shape[-1]

    @property
    def num_heads(self) -> int:
        return self.vertical.shape[1]

    @property
    def batch(self) -> int:
        return self.vertical.shape[0]

    def heads(self, index: torch.Tensor | list[int]) -> SparsePattern:
        """The pattern of the query heads ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.vertical.device)
        return SparsePattern(self.vertical[:, idx], self.slash[:, idx], self.block_size)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Pattern-and-causal visibility ``[B, H, Sq, Sk]`` for 1-D global positions (no window / docs)."""
        d_blk = q_pos[:, None] // self.block_size - k_pos[None, :] // self.block_size
        causal = q_pos[:, None] >= k_pos[None, :]
        slash = self.slash[:, :, d_blk.clamp(min=0)]  # [B, H, Sq, Sk]
        vertical = self.vertical[:, :, k_pos][:, :, None, :]
        return causal & (slash | vertical)

    def token_density(self) -> float:
        """Fraction of the causal (query, key) pairs the pattern keeps (1 - sparsity), over rows and heads."""
        pos = torch.arange(self.seq_len, device=self.vertical.device)
        kept = 0
        for start in range(0, self.seq_len, 1024):  # bounded memory
            kept += int(self.visible(pos[start : start + 1024], pos).sum())
        causal = self.seq_len * (self.seq_len + 1) // 2
        return kept / (causal * self.batch * self.num_heads)


@dataclass(frozen=True)
class VerticalSlashBudget:
    """How many vertical columns and slash diagonals to keep per head, and the estimation window.

    ``vertical`` / ``slash``: a count (int >= 0) or a fraction of S (float in (0, 1]).
    """

    vertical: int | float
    slash: int | float
    block_size: int = 64
    last_q: int = 64
    sink_tokens: int = 4
    local_diagonals: int = 64

    def count(self, value: int | float, seq_len: int) -> int:
        if isinstance(value, float):
            return min(seq_len, max(1, round(value * seq_len)))
        return min(seq_len, int(value))


class Reducer(Protocol):
    """In-place reductions over the ranks that share the sequence (every rank must call each)."""

    def sum_(self, t: torch.Tensor) -> None: ...

    def max_(self, t: torch.Tensor) -> None: ...

    def broadcast_(self, t: torch.Tensor) -> None: ...


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, S, H_kv, D]`` -> ``[B, S, H, D]`` (GQA: query head h uses kv head h // (H / H_kv))."""
    group = num_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def estimate_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    seq_len: int,
    budget: VerticalSlashBudget,
    scale: float | None = None,
    reducer: Reducer | None = None,
) -> SparsePattern:
    """Vertical-slash pattern of the whole sequence from this rank's shard (see module docstring).

    Args:
        q: ``[B, n, H, D]``, k: ``[B, n, H_kv, D]``: this rank's tokens (any layout).
        q_pos, k_pos: their global positions ``[n]``.
        seq_len: global S.
        budget: counts and estimation window.
        reducer: sums / maxima / broadcast over the ranks sharing the sequence; None = one process
            holding all of it.

    Communicated (through ``reducer``, in fp64): the last queries ``[B, last_q, H, D]`` (sum), the row maxima
    and sums ``[B, H, last_q]``, the scores ``[2, B, H, S]`` (sum) and the chosen pattern (broadcast).
    """
    b, _, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    acc = torch.float64  # tiny (last_q x n) and makes the top-k identical however the sums are split
    last = min(budget.last_q, seq_len)
    first_last = seq_len - last
    # 1. the last queries of the sequence, assembled from whichever ranks hold them
    q_last = torch.zeros(b, last, h, d, dtype=acc, device=q.device)
    mine = q_pos >= first_last
    q_last[:, q_pos[mine] - first_last] = q[:, mine].to(acc)
    if reducer is not None:
        reducer.sum_(q_last)
    last_pos = torch.arange(first_last, seq_len, device=q.device)
    # 2. causal softmax of those queries over every key; each rank scores its own keys
    keys = _expand_kv(k, h).to(acc)
    scores = torch.einsum("bihd,bjhd->bhij", q_last, keys) * scale  # [B, H, last, n]
    delta = last_pos[:, None] - k_pos[None, :]  # [last, n]
    visible = delta >= 0
    scores = scores.masked_fill(~visible, NEG_INF)
    row_max = scores.amax(dim=-1).clamp(min=torch.finfo(acc).min)
    if reducer is not None:
        reducer.max_(row_max)
    probs = torch.exp(scores - row_max[..., None])
    row_sum = probs.sum(dim=-1)
    if reducer is not None:
        reducer.sum_(row_sum)
    probs = probs / row_sum.clamp(min=torch.finfo(acc).tiny)[..., None]
    # 3. vertical (column) and slash (diagonal) scores over the whole sequence
    totals = torch.zeros(2, b, h, seq_len, dtype=acc, device=q.device)
    totals[0].index_add_(2, k_pos, probs.sum(dim=2))
    flat = probs.masked_fill(~visible, 0.0).reshape(b, h, -1)
    totals[1].index_add_(2, delta.clamp(min=0).reshape(-1), flat)
    if reducer is not None:
        reducer.sum_(totals)
    # 4. selection (identical input on every rank), then one broadcast makes it bit-identical
    v_count = budget.count(budget.vertical, seq_len)
    s_count = budget.count(budget.slash, seq_len)
    v_score, s_score = totals[0].clone(), totals[1].clone()
    v_score[..., : budget.sink_tokens] = float("inf")
    s_score[..., : budget.local_diagonals] = float("inf")
    vertical = torch.zeros(b, h, seq_len, dtype=torch.bool, device=q.device)
    if v_count:
        vertical.scatter_(2, v_score.topk(v_count, dim=-1).indices, True)
    offsets = torch.zeros(b, h, seq_len, dtype=torch.bool, device=q.device)
    if s_count:
        offsets.scatter_(2, s_score.topk(s_count, dim=-1).indices, True)
    slash = diagonals_to_blocks(offsets, budget.block_size)
    if reducer is not None:
        packed = torch.cat([vertical, slash], dim=-1).to(torch.uint8)
        reducer.broadcast_(packed)
        vertical, slash = packed[..., :seq_len].bool(), packed[..., seq_len:].bool()
    return SparsePattern(vertical, slash, budget.block_size)


def diagonals_to_blocks(offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Chosen token diagonals ``[B, H, S]`` (δ = i - j) -> block diagonals ``[B, H, nB]`` they cross.

    A diagonal δ crosses the blocks whose offset d satisfies |δ - d·G| < G: d = floor(δ/G), ceil(δ/G).
    Block diagonal 0 is always set.
    """
    b, h, s = offsets.shape
    nb = math.ceil(s / block_size)
    delta = torch.arange(s, device=offsets.device)
    slash = torch.zeros(b, h, nb, dtype=torch.bool, device=offsets.device)
    for d in (delta // block_size, (delta + block_size - 1) // block_size):
        hit = torch.zeros(b, h, nb + 1, dtype=torch.int32, device=offsets.device)
        hit.index_add_(2, d, offsets.to(torch.int32))
        slash |= hit[..., :nb] > 0
    slash[..., 0] = True
    return slash
