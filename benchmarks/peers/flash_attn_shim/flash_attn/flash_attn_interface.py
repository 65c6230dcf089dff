"""flash-attn 2.6 block functions served by PyTorch's CPU flash attention op (see the package docstring).

Layouts as in flash-attn: q ``[B, Sq, H, D]``, k/v ``[B, Sk, H_kv, D]``, out ``[B, Sq, H, D]``,
softmax_lse ``[B, H, Sq]`` fp32. GQA (H_kv < H) expands K/V heads for the op and sums their
gradients back. ``causal`` is top-left aligned for Sq == Sk (the only causal shape peers pass).
Every call adds its score pairs to ``PAIRS`` (the suite's per-rank work count).
"""

from __future__ import annotations

from typing import Any

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
PAIRS = [0]  # score pairs computed, causal-aware (a one-element list so importers see updates)


def _refuse(dropout_p: float, window_left: int, window_right: int, softcap: float | None, alibi: Any) -> None:
    if dropout_p or (window_left, window_right) != (-1, -1) or softcap or alibi is not None:
        raise NotImplementedError(
            "the CPU flash_attn shim serves dropout_p=0, window_size=(-1, -1), softcap=0, alibi_slopes=None only; "
            f"got dropout_p={dropout_p}, window=({window_left}, {window_right}), softcap={softcap}, alibi={alibi is not None}"
        )


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``[B, S, H, D]`` views -> ``[B, H, S, D]``; K/V heads repeated to H when H_kv < H."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), rep


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The op's lse dtype: fp32 for fp32 / bf16 / fp16 inputs, fp64 for fp64."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _count(sq: int, sk: int, heads: int, batch: int, causal: bool) -> None:
    PAIRS[0] += batch * heads * (sq * (sq + 1) // 2 if causal else sq * sk)


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
):
    """Returns ``(out [B, Sq, H, D], softmax_lse [B, H, Sq] fp32, None, None)`` like flash-attn 2.6.3."""
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    q_t, k_t, v_t, _ = _heads_first(q, k, v)
    out, lse = _FWD(q_t, k_t, v_t, 0.0, causal, scale=softmax_scale)  # lse fp32 for every input dtype
    _count(q.shape[1], k.shape[1], q.shape[2], q.shape[0], causal)
    return out.transpose(1, 2), lse.to(_lse_dtype(q)), None, None


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    rng_state: torch.Tensor | None = None,
):
    """Writes the gradients into ``dq``, ``dk``, ``dv`` (allocated when None); returns them."""
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    q_t, k_t, v_t, rep = _heads_first(q, k, v)
    grads = _BWD(
        dout.transpose(1, 2),
        q_t,
        k_t,
        v_t,
        out.transpose(1, 2),
        softmax_lse.to(_lse_dtype(q)),
        0.0,
        causal,
        scale=softmax_scale,
    )
    gq, gk, gv = (g.transpose(1, 2) for g in grads)
    if rep > 1:
        b, s, h, d = gk.shape
        gk = gk.reshape(b, s, h // rep, rep, d).sum(3)
        gv = gv.reshape(b, s, h // rep, rep, d).sum(3)
    _count(q.shape[1], k.shape[1], q.shape[2], q.shape[0], causal)
    dq = gq.to(q.dtype) if dq is None else dq.copy_(gq)
    dk = gk.to(k.dtype) if dk is None else dk.copy_(gk)
    dv = gv.to(v.dtype) if dv is None else dv.copy_(gv)
    return dq, dk, dv, None


def _flash_attn_varlen_forward(*args: Any, **kwargs: Any):
    raise NotImplementedError("the CPU flash_attn shim does not serve varlen (packed) attention")


_flash_attn_varlen_backward = _flash_attn_varlen_forward


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, softmax_scale, causal):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal)
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal = ctx.args
        dq, dk, dv, _ = _flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.0, scale, causal)
        return dq, dk, dv, None, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Differentiable ``flash_attn_func`` on ``[B, S, H, D]`` tensors (CPU op underneath)."""
    _refuse(dropout_p, window_size[0], window_size[1], softcap, alibi_slopes)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _FlashAttnFunc.apply(q, k, v, scale, causal)
