"""flash-attn 2.6 block functions served by PyTorch's CPU flash attention op (see the package docstring).

Windows (``window_size_left/right``, bottom-right aligned like flash-attn) and ``softcap`` run on a
dense fp64 computation instead of the op; the varlen pair loops over the packed sequences.

Layouts as in flash-attn: q ``[B, Sq, H, D]``, k/v ``[B, Sk, H_kv, D]``, out ``[B, Sq, H, D]``,
softmax_lse ``[B, H, Sq]`` fp32. GQA (H_kv < H) expands K/V heads for the op and sums their
gradients back. ``causal`` is bottom-right aligned as in flash-attn (rectangular causal blocks get an explicit mask).
Every call adds its score pairs to ``PAIRS`` (the suite's per-rank work count).
"""

from __future__ import annotations

from typing import Any

import torch

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
PAIRS = [0]  # score pairs computed, causal-aware (a one-element list so importers see updates)


def _refuse(dropout_p: float, alibi: Any) -> None:
    if dropout_p or alibi is not None:
        raise NotImplementedError(
            "the CPU flash_attn shim serves dropout_p=0 and alibi_slopes=None only; "
            f"got dropout_p={dropout_p}, alibi={alibi is not None}"
        )


def _plain(window_left: int, window_right: int, softcap: float | None) -> bool:
    """Whether the CPU op serves the call (no window, no softcap)."""
    return (window_left, window_right) == (-1, -1) and not softcap


def _op_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[bool, torch.Tensor | None]:
    """``(is_causal, attn_mask)`` for the CPU op: flash-attn aligns causality bottom-right, the op
    top-left, so a rectangular causal block gets an explicit additive mask instead."""
    sq, sk = q.shape[1], k.shape[1]
    if not causal or sq == sk:
        return causal, None
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    zero = torch.zeros((), dtype=q.dtype)
    return False, torch.where(visible, zero, float("-inf"))[None, None]


def _scores(q, k, scale, causal, window_left, window_right, softcap):
    """fp64 scores ``[B, H, Sq, Sk]`` (soft-capped, hidden pairs -inf) and tanh(s / softcap) (or None)."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, dim=2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right alignment
    j = torch.arange(sk)[None, :]
    right = 0 if causal else window_right
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + right
    if window_left >= 0:
        visible &= j >= i - window_left
    return s.masked_fill(~visible, float("-inf")), t


def _math_forward(q, k, v, scale, causal, window_left, window_right, softcap):
    s, _ = _scores(q, k, scale, causal, window_left, window_right, softcap)
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Sq]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    rep = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(rep, dim=2))
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, scale, causal, window_left, window_right, softcap):
    s, t = _scores(q, k, scale, causal, window_left, window_right, softcap)
    p = torch.exp(s - lse.double()[..., None]).nan_to_num(0.0)
    rep = q.shape[2] // k.shape[2]
    do, vv = dout.double(), v.double().repeat_interleave(rep, dim=2)
    kk = k.double().repeat_interleave(rep, dim=2)
    delta = (do * out.double()).sum(-1).transpose(1, 2)[..., None]  # [B, H, Sq, 1]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    return dq, dk, dv


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
    _refuse(dropout_p, alibi_slopes)
    _count(q.shape[1], k.shape[1], q.shape[2], q.shape[0], causal)
    if not _plain(window_size_left, window_size_right, softcap):
        out, lse = _math_forward(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
        return out, lse.to(_lse_dtype(q)), None, None
    q_t, k_t, v_t, _ = _heads_first(q, k, v)
    is_causal, mask = _op_causal(q, k, causal)
    out, lse = _FWD(q_t, k_t, v_t, 0.0, is_causal, attn_mask=mask, scale=softmax_scale)  # lse fp32 (fp64)
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
    _refuse(dropout_p, alibi_slopes)
    _count(q.shape[1], k.shape[1], q.shape[2], q.shape[0], causal)
    if not _plain(window_size_left, window_size_right, softcap):
        gq, gk, gv = _math_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
        )
        return _store(gq, gk, gv, q, k, v, dq, dk, dv, rep=q.shape[2] // k.shape[2])
    q_t, k_t, v_t, rep = _heads_first(q, k, v)
    is_causal, mask = _op_causal(q, k, causal)
    grads = _BWD(
        dout.transpose(1, 2),
        q_t,
        k_t,
        v_t,
        out.transpose(1, 2),
        softmax_lse.to(_lse_dtype(q)),
        0.0,
        is_causal,
        attn_mask=mask,
        scale=softmax_scale,
    )
    gq, gk, gv = (g.transpose(1, 2) for g in grads)
    return _store(gq, gk, gv, q, k, v, dq, dk, dv, rep)


def _store(gq, gk, gv, q, k, v, dq, dk, dv, rep: int):
    """Sum repeated K/V heads' gradients, write them into the given buffers (or new ones)."""
    if rep > 1:
        b, s, h, d = gk.shape
        gk = gk.reshape(b, s, h // rep, rep, d).sum(3)
        gv = gv.reshape(b, s, h // rep, rep, d).sum(3)
    dq = gq.to(q.dtype) if dq is None else dq.copy_(gq)
    dk = gk.to(k.dtype) if dk is None else dk.copy_(gk)
    dv = gv.to(v.dtype) if dv is None else dv.copy_(gv)
    return dq, dk, dv, None


def _spans(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """``(q rows, k rows)`` slices of every packed sequence."""
    qs, ks = cu_q.tolist(), cu_k.tolist()
    return [(slice(qs[i], qs[i + 1]), slice(ks[i], ks[i + 1])) for i in range(len(qs) - 1)]


def _flash_attn_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
    block_table=None, leftpad_k=None, seqused_k=None,
):  # fmt: skip
    """Packed ``q [T, H, D]``, ``k, v [Tk, H_kv, D]`` -> ``(out [T, H, D], softmax_lse [H, T] fp32, None, None)``."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q))
    for rq, rk in _spans(cu_seqlens_q, cu_seqlens_k):
        o, lse_seq, _, _ = _flash_attn_forward(
            q[None, rq], k[None, rk], v[None, rk], dropout_p, softmax_scale, causal,
            window_size_left, window_size_right, softcap, alibi_slopes,
        )  # fmt: skip
        out[rq], lse[:, rq] = o[0], lse_seq[0]
    return out, lse, None, None


def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
    alibi_slopes=None, deterministic=False, rng_state=None,
):  # fmt: skip
    """Writes the gradients of every packed sequence into ``dq``, ``dk``, ``dv``; returns them."""
    dq = torch.zeros_like(q) if dq is None else dq.zero_()
    dk = torch.zeros_like(k) if dk is None else dk.zero_()
    dv = torch.zeros_like(v) if dv is None else dv.zero_()
    for rq, rk in _spans(cu_seqlens_q, cu_seqlens_k):
        gq, gk, gv, _ = _flash_attn_backward(
            dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], softmax_lse[None, :, rq],
            None, None, None, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
            alibi_slopes,
        )  # fmt: skip
        dq[rq] += gq[0]
        dk[rk] += gk[0]
        dv[rk] += gv[0]
    return dq, dk, dv, None


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, softmax_scale, causal):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout, _dlse):
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
    """Differentiable ``flash_attn_func`` on ``[B, S, H, D]`` tensors (CPU op underneath); with
    ``return_attn_probs`` it returns ``(out, softmax_lse [B, H, S], None)`` as flash-attn 2.6.3 does
    (no attention probabilities: the shim has no dropout mask to return)."""
    _refuse(dropout_p, alibi_slopes)
    if not _plain(*window_size, softcap):
        raise NotImplementedError(
            "the shim's flash_attn_func serves no window or softcap (its block functions do)"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _FlashAttnFunc.apply(q, k, v, scale, causal)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """Forward-only ``flash_attn_varlen_func`` on packed ``q [T, H, D]``, ``k, v [Tk, H_kv, D]``: out
    ``[T, H, D]`` (with ``return_attn_probs``: ``(out, softmax_lse [H, T], None)``). Refuses gradients."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(
            "the CPU flash_attn shim's flash_attn_varlen_func is forward-only; "
            "call it under torch.no_grad() (the varlen block functions have a backward)"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse, _, _ = _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal,
        window_size[0], window_size[1], softcap, alibi_slopes,
    )  # fmt: skip
    return (out, lse, None) if return_attn_probs else out
