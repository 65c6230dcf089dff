"""Block-sparse patterns of NON-causal (DiT) attention and their estimation (docs/dit_sparse.md).

    mask [B, H, nB, nB]  bool: query block i of head h attends to key block j (blocks of G tokens of the
                         WHOLE sequence, global order; the diagonal block is always kept)

Estimation (``estimate_block_pattern``): q and k are mean-pooled per block of G tokens (padding tokens,
document id < 0, left out of the means), every query block scores every key block with a softmax over
the pooled scores (fp64), and each query block keeps its highest-probability key blocks up to the
budget: at most ``keep`` · nB blocks and / or the fewest blocks whose probabilities add up to
``threshold`` (with both: the smaller count). Distributed, each rank pools its own tokens and one
all-reduce (sum) over the SP group assembles the pooled sums ``[B, nB, H + H_kv, D]`` and token counts
``[B, nB]``; every rank then chooses from identical fp64 inputs, and one broadcast of the bool pattern
makes it bit-identical. The pattern follows q and k, so it changes with the denoising step and layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds_seqpar.ops.sparse.pattern import Reducer

__all__ = ["BlockBudget", "BlockPattern", "block_sparse_reference", "estimate_block_pattern"]


@dataclass(frozen=True)
class BlockPattern:
    """A non-causal block-sparse pattern of every (batch row, query head), in global block order.

    Args:
        mask: bool ``[B, H, nB, nB]`` (B = 1 applies to every row); ``mask[..., i, i]`` must be True.
        block_size: G in tokens; seq_len: S (nB = ceil(S / G)).
    """

    mask: torch.Tensor
    block_size: int
    seq_len: int

    causal = False  # read by RingPlan: a non-causal sparse plan

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"BlockPattern.block_size={self.block_size} must be >= 1")
        if self.mask.dtype != torch.bool or self.mask.dim() != 4:
            raise ValueError(f"BlockPattern.mask must be a bool [B, H, nB, nB] tensor; got {self.mask.dtype} "
                             f"{tuple(self.mask.shape)}")  # fmt: skip
        nb = math.ceil(self.seq_len / self.block_size)
        if self.mask.shape[-2:] != (nb, nb):
            raise ValueError(
                f"BlockPattern.mask covers {tuple(self.mask.shape[-2:])} blocks but S={self.seq_len} with "
                f"block_size={self.block_size} has {nb} x {nb}; build it for this sequence length"
            )
        if not bool(self.mask.diagonal(dim1=-2, dim2=-1).all()):
            raise ValueError("BlockPattern.mask[..., i, i] must be True (the diagonal block is always kept)")

    @property
    def num_heads(self) -> int:
        return self.mask.shape[1]

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.mask.shape[-1]

    def heads(self, index: torch.Tensor | list[int]) -> BlockPattern:
        """The pattern of the query heads ``index`` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.mask.device)
        return BlockPattern(self.mask[:, idx], self.block_size, self.seq_len)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Token visibility ``[B, H, Sq, Sk]`` for 1-D global positions (no documents)."""
        qb, kb = q_pos // self.block_size, k_pos // self.block_size
        return self.mask[:, :, qb][:, :, :, kb]

    def density(self) -> float:
        """Fraction of the (query, key) token pairs kept, over rows and heads (1 - sparsity)."""
        g, s, nb = self.block_size, self.seq_len, self.num_blocks
        size = torch.full((nb,), float(g), dtype=torch.float64)
        size[-1] = s - g * (nb - 1)
        pairs = size[:, None] * size[None, :]
        kept = (self.mask.to(torch.float64).cpu() * pairs).sum()
        return float(kept) / (s * s * self.batch * self.num_heads)


@dataclass(frozen=True)
class BlockBudget:
    """How many key blocks each query block keeps: ``keep`` (fraction of nB in (0, 1], at least one
    block) and / or ``threshold`` (cumulative probability in (0, 1]); with both, the smaller count."""

    block_size: int
    keep: float | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.keep is None and self.threshold is None:
            raise ValueError("BlockBudget needs keep and / or threshold (e.g. keep=0.25)")
        for name, value in (("keep", self.keep), ("threshold", self.threshold)):
            if value is not None and not 0.0 < value <= 1.0:
                raise ValueError(f"BlockBudget.{name}={value!r} must be in (0, 1]")


def _pool(
    x: torch.Tensor, pos: torch.Tensor, real: torch.Tensor, nb: int, g: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block sums ``[B, nB, H, D]`` (fp64) and real-token counts ``[B, nB]`` of this rank's tokens."""
    b = x.shape[0]
    sums = torch.zeros(b, nb, *x.shape[2:], dtype=torch.float64, device=x.device)
    w = real.to(torch.float64)  # [B, n]
    sums.index_add_(1, pos // g, x.to(torch.float64) * w[:, :, None, None])
    counts = torch.zeros(b, nb, dtype=torch.float64, device=x.device)
    counts.index_add_(1, pos // g, w)
    return sums, counts


def _kept_counts(probs: torch.Tensor, budget: BlockBudget) -> torch.Tensor:
    """Key blocks to keep per query block ``[B, H, nB]`` from the sorted probabilities ``[B, H, nB, nB]``."""
    nb = probs.shape[-1]
    count = torch.full(probs.shape[:-1], nb, dtype=torch.long, device=probs.device)
    if budget.keep is not None:
        count.fill_(max(1, math.ceil(budget.keep * nb - 1e-9)))
    if budget.threshold is not None:
        below = probs.cumsum(-1) < budget.threshold - 1e-12  # [B, H, nB, nB]
        count = torch.minimum(count, (below.sum(-1) + 1).clamp(max=nb))
    return count


def estimate_block_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    pos: torch.Tensor,
    seq_len: int,
    budget: BlockBudget,
    scale: float | None = None,
    doc: torch.Tensor | None = None,
    reducer: Reducer | None = None,
) -> BlockPattern:
    """The block pattern of the whole sequence from this rank's tokens (module docstring; no grad).

    Args:
        q: ``[B, n, H, D]``, k: ``[B, n, H_kv, D]`` this rank's tokens (any layout); pos: their global
            positions ``[n]``; doc: their document ids ``[n]`` / ``[B, n]`` (< 0 = padding) or None.
        reducer: sums / broadcast over the ranks sharing the sequence; None = one process holds all.

    Communicated: pooled sums ``[B, nB, H + H_kv, D]`` and counts ``[B, nB]`` (fp64 all-reduce), the
    pattern ``[B, H, nB, nB]`` (uint8 broadcast).
    """
    b, _, h, d = q.shape
    g, nb = budget.block_size, math.ceil(seq_len / budget.block_size)
    scale = d**-0.5 if scale is None else scale
    real = torch.ones(b, pos.numel(), dtype=torch.bool, device=q.device)
    if doc is not None:
        real = real & (doc >= 0).expand(b, -1)
    with torch.no_grad():
        sums, counts = _pool(torch.cat([q, k], dim=2).detach(), pos, real, nb, g)
        if reducer is not None:
            reducer.sum_(sums)
            reducer.sum_(counts)
        means = sums / counts.clamp(min=1.0)[:, :, None, None]
        qm, km = means[:, :, :h], means[:, :, h:].repeat_interleave(h // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", qm, km) * scale
        empty = (counts == 0)[:, None, None, :]  # key blocks of padding only: never chosen by score
        probs = torch.softmax(scores.masked_fill(empty, float("-inf")), dim=-1).nan_to_num(0.0)
        eye = torch.eye(nb, dtype=torch.bool, device=q.device)
        first = torch.where(eye, torch.full_like(probs, 2.0), probs)  # the diagonal first, always kept
        order = torch.sort(first, dim=-1, descending=True, stable=True)
        kept = _kept_counts(probs.gather(-1, order.indices), budget)
        take = torch.arange(nb, device=q.device) < kept[..., None]
        mask = torch.zeros(b, h, nb, nb, dtype=torch.bool, device=q.device).scatter_(-1, order.indices, take)
        if reducer is not None:
            packed = mask.to(torch.uint8)
            reducer.broadcast_(packed)
            mask = packed.bool()
    return BlockPattern(mask, g, seq_len)


def block_sparse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: BlockPattern,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth: dense single-process softmax under the pattern's token mask (and the documents:
    same document, padding < 0 never seen; a row that sees nothing gets 0). q ``[B, S, H, D]``, k, v
    ``[B, S, H_kv, D]`` in global order; returns ``(out [B, S, H, D], lse [B, H, S])`` (autograd)."""
    from ds_seqpar.ops.attention.reference import dense_attention_reference
    from ds_seqpar.ops.masks import MaskSpec, token_mask

    pos = torch.arange(q.shape[1], device=q.device)
    mask = pattern.visible(pos, pos).expand(q.shape[0], -1, -1, -1)
    if doc_ids is not None:
        d = doc_ids.expand(q.shape[0], -1)
        mask = (
            mask & token_mask(pos.expand(d.shape), pos.expand(d.shape), MaskSpec(causal=False), d, d)[:, None]
        )
    return dense_attention_reference(q, k, v, mask, scale)
