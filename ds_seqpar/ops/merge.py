"""Merging partial attention results of the same query rows (online softmax, docs/kernels.md "Merge").

Legend:
    B, S, H, D  batch, query rows, query heads, head dim
    out         [B, S, H, D] normalised partial output of some key blocks
    lse         [B, H, S] log-sum-exp of the scores behind ``out``; -inf for a row that saw no key

Stable log-sigmoid form (no overflow, exact for any order; the merge is commutative and
associative up to rounding):
    out' = out_acc - sigmoid(lse_blk - lse_acc) * (out_acc - out_blk)
    lse' = lse_acc - logsigmoid(lse_acc - lse_blk)
Empty rows are guarded explicitly: lse_acc = -inf takes the block, lse_blk = -inf keeps the
accumulator, both -inf stays (0, -inf) - never NaN. Keep out/lse in fp32 (fp64) across a ring
and cast ``out`` to the model dtype once at the end.
"""

from __future__ import annotations

import torch

__all__ = ["apply_sink", "inert_empty_rows", "merge_attn", "merge_attn_", "sink_grad"]

RowIndex = slice | torch.Tensor


def merge_attn(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block result into an accumulator; returns new ``(out [B, S, H, D], lse [B, H, S])``.

    Inputs are not modified. ``out_blk``/``lse_blk`` are promoted to the accumulator dtypes.
    """
    if out_acc.shape != out_blk.shape or lse_acc.shape != lse_blk.shape:
        raise ValueError(
            f"merge_attn shapes differ: out {tuple(out_acc.shape)} vs {tuple(out_blk.shape)}, "
            f"lse {tuple(lse_acc.shape)} vs {tuple(lse_blk.shape)}; merge results for the same rows"
        )
    out_blk = out_blk.to(out_acc.dtype)
    lse_blk = lse_blk.to(lse_acc.dtype)
    acc_empty = lse_acc == float("-inf")
    blk_empty = lse_blk == float("-inf")
    # Finite stand-ins keep the formula NaN-free; torch.where then picks the guarded answer.
    acc_safe = torch.where(acc_empty, torch.zeros_like(lse_acc), lse_acc)
    blk_safe = torch.where(blk_empty, torch.zeros_like(lse_blk), lse_blk)
    lse_new = acc_safe - torch.nn.functional.logsigmoid(acc_safe - blk_safe)
    weight = torch.sigmoid(blk_safe - acc_safe).to(out_acc.dtype)
    out_new = out_acc - weight.transpose(1, 2).unsqueeze(-1) * (out_acc - out_blk)

    take_blk = acc_empty & ~blk_empty  # [B, H, S]
    keep_acc = blk_empty
    lse_new = torch.where(take_blk, lse_blk, torch.where(keep_acc, lse_acc, lse_new))
    take_blk_o = take_blk.transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    keep_acc_o = keep_acc.transpose(1, 2).unsqueeze(-1)
    out_new = torch.where(take_blk_o, out_blk, torch.where(keep_acc_o, out_acc, out_new))
    return out_new, lse_new


def merge_attn_(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out_blk: torch.Tensor,
    lse_blk: torch.Tensor,
    rows: RowIndex | None = None,
    consume: bool = False,
) -> None:
    """In-place :func:`merge_attn` into ``out_acc``/``lse_acc``, optionally into a subset of rows.

    Args:
        out_acc, lse_acc: accumulator ``[B, S, H, D]`` / ``[B, H, S]``, updated in place.
        out_blk, lse_blk: block result for the selected rows, ``[B, S', H, D]`` / ``[B, H, S']``.
        rows: which accumulator rows (sequence dim) the block covers: a ``slice`` or an index /
            bool tensor with S' entries (e.g. the second half of a zigzag shard); None = all rows.
        consume: ``out_blk`` is scratch (a fresh kernel output): the merge may overwrite it.

    With rows a slice (or None) no temporary of the output's size is made besides ``out_blk`` in the
    accumulator's dtype (none with ``consume``): ``out_acc += w · (out_blk - out_acc)``, which is
    :func:`merge_attn`'s ``out_acc - w · (out_acc - out_blk)`` to the bit.
    """
    if rows is None:
        rows = slice(None)
    if not isinstance(rows, slice):  # advanced indexing copies: merge, then write the rows back
        out_new, lse_new = merge_attn(out_acc[:, rows], lse_acc[:, :, rows], out_blk, lse_blk)
        out_acc[:, rows] = out_new
        lse_acc[:, :, rows] = lse_new
        return
    acc_o, acc_l = out_acc[:, rows], lse_acc[:, :, rows]
    if acc_o.shape != out_blk.shape or acc_l.shape != lse_blk.shape:
        raise ValueError(
            f"merge_attn_ shapes differ: out {tuple(acc_o.shape)} vs {tuple(out_blk.shape)}, "
            f"lse {tuple(acc_l.shape)} vs {tuple(lse_blk.shape)}; merge results for the same rows"
        )
    blk_l = lse_blk.to(acc_l.dtype)
    acc_empty = acc_l == float("-inf")
    blk_empty = blk_l == float("-inf")
    acc_safe = acc_l.masked_fill(acc_empty, 0.0)
    blk_safe = blk_l.masked_fill(blk_empty, 0.0)
    take_blk = acc_empty & ~blk_empty  # [B, H, S]
    lse_new = acc_safe - torch.nn.functional.logsigmoid(acc_safe - blk_safe)
    lse_new = torch.where(take_blk, blk_l, torch.where(blk_empty, acc_l, lse_new))
    weight = torch.sigmoid(blk_safe - acc_safe).masked_fill_(take_blk, 1.0).masked_fill_(blk_empty, 0.0)
    weight = weight.to(acc_o.dtype).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    acc_o.masked_fill_(take_blk.transpose(1, 2).unsqueeze(-1), 0.0)  # empty rows: 0 + 1 · (blk - 0) = blk
    if consume and out_blk.dtype == acc_o.dtype:
        step = out_blk.sub_(acc_o)
    else:
        step = out_blk.to(acc_o.dtype) - acc_o
    step.masked_fill_(blk_empty.transpose(1, 2).unsqueeze(-1), 0.0)  # an empty block adds nothing
    acc_o.add_(step.mul_(weight))
    acc_l.copy_(lse_new)


# ----------------------------------------------------------------------------------------------
# attention sinks (gpt-oss ``s_aux``; see docs/kernels.md "Attention sinks")
#
# A sink is one extra logit s_h per query head in every row's softmax denominator, with a zero
# value vector. Given the merged (out, lse) over all real keys:
#     lse_f = logaddexp(lse, s_h)          out_f = out · exp(lse - lse_f) = out · sigmoid(lse - s_h)
# and (out_f, lse_f) are the FINAL results the block backward expects (the sink column adds
# nothing to dV and dP). The sink's own gradient is
#     dL/ds_h = -Σ_rows exp(s_h - lse_f) · Δ,   Δ = rowsum(dout · out_f).


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold per-head sink logits into merged results: ``out [B, S, H, D]``, ``lse [B, H, S]``, ``sink [H]``.

    Returns ``(out_f, lse_f)`` in the dtypes of ``out`` / ``lse``; a row that saw no key keeps out 0
    and gets lse = the sink's logit.
    """
    sink_rows = sink.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    lse_f = torch.logaddexp(lse, sink_rows)
    factor = torch.exp(lse - lse_f).nan_to_num_(0.0)  # lse = -inf rows: factor 0
    return out * factor.transpose(1, 2).unsqueeze(-1).to(out.dtype), lse_f


def sink_grad(
    dout: torch.Tensor, out_f: torch.Tensor, lse_f: torch.Tensor, sink: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sink logits ``[H]`` (in lse's dtype) from this rank's rows (see above)."""
    delta = (dout.to(lse_f.dtype) * out_f.to(lse_f.dtype)).sum(-1).transpose(1, 2)  # [B, H, S]
    weight = torch.exp(sink.to(lse_f.dtype).view(1, -1, 1) - lse_f)
    return -(weight * delta).sum(dim=(0, 2))


def inert_empty_rows(dout: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that saw no key anywhere (final lse -inf) made inert for a backward: their lse becomes 0 and
    their ``dout`` 0, so they contribute nothing instead of NaN. ``dout [B, S, H, D]``, ``lse [B, H, S]``;
    unconditional (no host sync)."""
    empty = lse == float("-inf")
    return dout.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0), lse.masked_fill(empty, 0.0)
