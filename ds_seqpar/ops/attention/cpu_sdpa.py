"""The ``sdpa`` block kernel: PyTorch's CPU flash op (``_scaled_dot_product_flash_attention_for_cpu`` and
its backward). q/k/v are ``[B, H, S, D]`` for the op; GQA is native; causal is top-left aligned; bool masks
are refused by the op, so masks go in as an additive float mask of the query dtype; an all-masked row
returns lse 0 (fixed here); Sq = 0 or Sk = 0 crashes the process, so the dispatcher never calls it then.
bf16/fp16 run natively (fp32 accumulation inside the op, as flash-attn does). No softcap. ALiBi goes in as
the op's additive mask per head ``[B|1, H, Sq, Sk]`` in the accumulation dtype (the op takes a per-head
mask, and an fp32 one with bf16 inputs), with the block's mask or causality folded in as -inf.
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.attention.contract import Alibi, AttentionKernel
from ds_seqpar.ops.attention.cuda_sdpa import refuse_softcap
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["SDPA"]

NEG_INF = float("-inf")
_SDPA_OP = "_scaled_dot_product_flash_attention_for_cpu"


def _sdpa_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"needs CPU tensors (got device {device.type!r})"
    if not hasattr(torch.ops.aten, _SDPA_OP):
        return f"needs torch.ops.aten.{_SDPA_OP} (PyTorch >= 2.2)"
    return None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B|1, Sq, Sk]`` -> additive ``[B|1, 1, Sq, Sk]`` (0 visible, -inf hidden)."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, NEG_INF).unsqueeze(1)


def _op_mask(
    q: torch.Tensor, sk: int, mask: torch.Tensor | None, causal: bool, alibi: Alibi | None
) -> tuple[torch.Tensor | None, bool]:
    """The op's ``(attn_mask, is_causal)``: the additive bool mask, or the ALiBi bias ``[B|1, H, Sq, Sk]``
    with the mask (or top-left causality) folded in as -inf."""
    if alibi is None:
        return (None if mask is None else _additive(mask, q.dtype)), causal
    sq = q.shape[1]
    bias = alibi.bias(0, sq, 0, sk, accumulation_dtype(q.dtype))
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril().unsqueeze(0)
    if mask is not None:
        bias = bias.masked_fill(~mask.unsqueeze(1), NEG_INF)
    return bias, False


def _sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_softcap("sdpa", softcap)
    # the op takes fp32, fp64 and bf16 / fp16 natively (fp32 accumulation inside, fp32 lse), like flash-attn
    q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
    attn_mask, is_causal = _op_mask(q, k.shape[1], mask, causal, alibi)
    out, lse = getattr(torch.ops.aten, _SDPA_OP)(
        q_t, k_t, v_t, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    out = out.transpose(1, 2)
    if mask is not None:
        empty = ~mask.any(dim=-1)  # [B|1, Sq]; the op reports lse 0 for these rows
        lse = lse.masked_fill(empty.unsqueeze(1), NEG_INF)
        out = out.masked_fill(empty[:, :, None, None], 0.0)
    return out, lse


def _sdpa_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None = None,
    alibi: Alibi | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    refuse_softcap("sdpa", softcap)
    do_t, q_t, k_t, v_t, o_t = (x.to(q.dtype).transpose(1, 2) for x in (dout, q, k, v, out))
    attn_mask, is_causal = _op_mask(q, k.shape[1], mask, causal, alibi)
    grads = getattr(torch.ops.aten, _SDPA_OP + "_backward")(
        do_t,
        q_t,
        k_t,
        v_t,
        o_t,
        lse.to(accumulation_dtype(q.dtype)),
        0.0,
        is_causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    dq, dk, dv = (x.transpose(1, 2) for x in grads)
    return dq, dk, dv


SDPA = AttentionKernel(
    name="sdpa",
    forward=_sdpa_forward,
    backward=_sdpa_backward,
    unavailable=_sdpa_unavailable,
    alibi=True,
    summary="PyTorch CPU flash op",
)
