"""Chunked linear attention with decay, and the local/entering-state split of All-Scan (docs/linear.md).

Legend:
    B, S, H     batch, tokens (of the whole sequence or of one rank's contiguous piece), heads
    d_k, d_v    key and value head dims
    q, k        [B, S, H, d_k]
    v, out      [B, S, H, d_v]
    state       [B, H, d_k, d_v]
    log_decay   None (plain, alpha = 1); [H] (RetNet / Lightning: one alpha = exp(log_decay) <= 1 per
                head, same for every token and channel); [B, S, H] (Mamba2 / SSD: one scalar per
                token and head, dt_t * A_h); or [B, S, H, d_k] (GLA: per-token vector gate).
                Always a LOG decay, finite and <= 0
    acc dtype   float64 for float64 inputs, else float32; states, local outputs and gradients use it

Model, per head (§16.1), inclusive of token t:
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,   S_{-1} = initial state
``scale`` is a plain factor on q (no softmax), e.g. d_k ** -0.5; default 1.

Chunk form (chunk c of size C, cumulative log decay g_i = sum of log alpha over chunk tokens <= i):
    o_i = sum_{j <= i in c} q_i diag(exp(g_i - g_j)) k_j^T v_j  +  (q_i * exp(g_i)) S_[c-1]
    S_[c] = diag(exp(g_last)) S_[c-1] + sum_j (k_j * exp(g_last - g_j))^T v_j
Every exponent is a difference g_i - g_j with i >= j (positions i < j are set to -inf before the exp)
or g_last - g_j, so all are <= 0: no overflow for strong decays, exact zeros where they underflow.
The per-channel gate builds a [B, H, C, C, d_k] decay tensor per chunk; the scalar and plain cases
only [C, C]. Backward: autograd through these torch ops.

Sequence parallelism (All-Scan, §16.4): rank p holds a contiguous piece; ``local_scan`` runs it from
a zero state. With E_0 = initial state and E_p the state entering piece p,
    out_p   = local.out + entering_state_output(q_p, local.cum_log_decay, E_p)
    E_{p+1} = advance_state(E_p, local.total_log_decay, local.state)
reproduce :func:`chunk_linear_attention` on the whole sequence (outputs, final state E_P and all
gradients); the distributed scan only has to pass E_p from rank to rank.

Fused CUDA path: when the flash-linear-attention package (``fla``) imports and the tensors are on
CUDA, :func:`local_scan` (what sequence parallelism runs) computes its piece with fla's chunked
kernels (``chunk_simple_gla`` for no / per-head decay, ``chunk_gla`` for the gate). The first use per
(kernel, dtype, device) checks fla against the PyTorch chunk form on a small input; on a mismatch or
an error it warns once and stays on PyTorch, so an incompatible fla version is never silently wrong.
``DS_SEQPAR_NO_FLA=1`` turns the path off.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "LocalScan",
    "advance_state",
    "chunk_linear_attention",
    "entering_state_output",
    "linear_attention_reference",
    "local_scan",
    "piece_state",
]


class LocalScan(NamedTuple):
    """Result of :func:`local_scan` on one contiguous piece, all in the acc dtype.

    Attributes:
        out: ``[B, S, H, d_v]`` output of the piece from a ZERO entering state.
        state: ``[B, H, d_k, d_v]`` local final state S^loc_end from a zero state.
        total_log_decay: ``[B, H, d_k]`` log Gamma, summed log decay of the whole piece (0 without decay).
        cum_log_decay: ``[B, S, H, d_k]`` log A_t, summed log decay from the piece start to t inclusive
            (an expanded view for the per-head decay; do not write into it).
    """

    out: torch.Tensor
    state: torch.Tensor
    total_log_decay: torch.Tensor
    cum_log_decay: torch.Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, d], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(
            f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, S, H, d_k] for both)"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v shape {tuple(v.shape)} must match q in [B, S, H] = {tuple(q.shape[:3])}; only d_v may differ"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_tensor(
    name: str, x: torch.Tensor, shape: tuple[int, ...], device: torch.device, ref: str = "q"
) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} must be {shape}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {ref} is on {device}")


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def _log_decay_bh(q: torch.Tensor, log_decay: torch.Tensor | None) -> torch.Tensor | None:
    """Validated log decay as ``[B|1, H, S, d_k|1]`` in the acc dtype (None for no decay)."""
    if log_decay is None:
        return None
    b, s, h, d_k = q.shape
    if not isinstance(log_decay, torch.Tensor):
        raise ValueError(f"log_decay must be a tensor or None, got {type(log_decay).__name__}")
    if tuple(log_decay.shape) not in ((h,), (b, s, h), (b, s, h, d_k)):
        raise ValueError(
            f"log_decay shape {tuple(log_decay.shape)} must be [H] = {(h,)} (scalar per head), "
            f"[B, S, H] = {(b, s, h)} (scalar per token and head, Mamba2) "
            f"or [B, S, H, d_k] = {(b, s, h, d_k)} (per-token gate)"
        )
    if not log_decay.is_floating_point():
        raise ValueError(f"log_decay must be a floating-point tensor, got dtype {log_decay.dtype}")
    if log_decay.device != q.device:
        raise ValueError(f"log_decay is on {log_decay.device} but q is on {q.device}")
    bad = ~torch.isfinite(log_decay) | (log_decay > 0)
    if bool(bad.any()):
        worst = log_decay[bad].flatten()[0].item()
        raise ValueError(
            f"log_decay must be finite and <= 0 (log of a decay in (0, 1]), got an entry {worst:g}"
        )
    g = log_decay.to(_acc_dtype(q.dtype))
    if g.dim() == 1:
        return g.view(1, h, 1, 1).expand(1, h, s, 1)
    if g.dim() == 3:
        return g.transpose(1, 2).unsqueeze(-1)
    return g.transpose(1, 2)


def _heads_first(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[B, S, H, d]`` -> ``[B, H, S, d]`` in the acc dtype."""
    return x.to(acc).transpose(1, 2)


def _initial_state(
    q: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor | None:
    if initial_state is None:
        return None
    b, _, h, d_k = q.shape
    _check_tensor("initial_state", initial_state, (b, h, d_k, v.shape[-1]), q.device)
    return initial_state.to(acc)


def _scan_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk form on heads-first acc tensors ``q, k [B, H, S, d_k]``, ``v [B, H, S, d_v]``, ``g`` as
    from :func:`_log_decay_bh`; ``state`` None = zero. Returns ``(out [B, H, S, d_v], state)``."""
    b, h, s, d_k = q.shape
    d_v = v.shape[-1]
    tril = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    outs = []
    # split once: slicing inside the loop would make autograd build a full-size gradient per chunk
    chunks = [x.split(chunk_size, dim=2) if s else () for x in (q, k, v)]
    if g is None or not s:
        g_chunks = [None] * len(chunks[0])
    else:
        g_chunks = g.expand(-1, -1, s, -1).split(chunk_size, dim=2)
    for q_c, k_c, v_c, g_c in zip(*chunks, g_chunks, strict=True):
        c = q_c.shape[2]
        visible = tril[:c, :c]
        if g is None:
            scores = (q_c @ k_c.transpose(-1, -2)).masked_fill(~visible, 0.0)  # [B, H, c, c]
            out_c = scores @ v_c
            if state is not None:
                out_c = out_c + q_c @ state
            kv = k_c.transpose(-1, -2) @ v_c
            state = kv if state is None else state + kv
        else:
            cum = g_c.cumsum(dim=2)  # [B|1, H, c, d_k|1], non-increasing along c
            last = cum[:, :, -1:]
            diff = cum.unsqueeze(3) - cum.unsqueeze(2)  # [.., i, j, .] = g_i - g_j, <= 0 where i >= j
            decay = diff.masked_fill(~visible.unsqueeze(-1), float("-inf")).exp()
            if decay.shape[-1] == 1:
                scores = (q_c @ k_c.transpose(-1, -2)) * decay.squeeze(-1)
            else:
                scores = (q_c.unsqueeze(3) * k_c.unsqueeze(2) * decay).sum(dim=-1)
            out_c = scores @ v_c
            if state is not None:
                out_c = out_c + (q_c * cum.exp()) @ state
            kv = (k_c * (last - cum).exp()).transpose(-1, -2) @ v_c
            state = kv if state is None else last.transpose(-1, -2).exp() * state + kv
        outs.append(out_c)
    if state is None:
        state = q.new_zeros(b, h, d_k, d_v)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(b, h, 0, d_v)
    return out, state


def linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (the ground truth, O(S) Python steps; differentiable).

    Returns ``(out [B, S, H, d_v] in q's dtype, final_state [B, H, d_k, d_v] in the acc dtype)``.
    """
    _check_qkv(q, k, v)
    acc = _acc_dtype(q.dtype)
    g = _log_decay_bh(q, log_decay)
    state = _initial_state(q, v, initial_state, acc)
    b, s, h, d_k = q.shape
    if state is None:
        state = torch.zeros(b, h, d_k, v.shape[-1], dtype=acc, device=q.device)
    q_h, k_h, v_h = _heads_first(q, acc) * scale, _heads_first(k, acc), _heads_first(v, acc)
    outs = []
    for t in range(s):
        if g is not None:
            state = g[:, :, t].unsqueeze(-1).exp() * state
        state = state + k_h[:, :, t].unsqueeze(-1) * v_h[:, :, t].unsqueeze(-2)
        outs.append((q_h[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    out = torch.stack(outs, dim=1) if outs else q.new_zeros(b, 0, h, v.shape[-1], dtype=acc)
    return out.to(q.dtype), state


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked linear attention: intra-chunk masked term + inter-chunk term with a running state.

    Any S >= 0 (the last chunk may be short). Computes in the acc dtype; returns
    ``(out [B, S, H, d_v] in q's dtype, final_state [B, H, d_k, d_v] in the acc dtype)``.
    """
    _check_qkv(q, k, v)
    _check_chunk_size(chunk_size)
    acc = _acc_dtype(q.dtype)
    g = _log_decay_bh(q, log_decay)
    state = _initial_state(q, v, initial_state, acc)
    q_h, k_h, v_h = _heads_first(q, acc) * scale, _heads_first(k, acc), _heads_first(v, acc)
    out, state = _scan_chunks(q_h, k_h, v_h, g, state, chunk_size)
    return out.transpose(1, 2).to(q.dtype), state


# ----------------------------------------------------------------------------------------------
# optional fused path (flash-linear-attention on CUDA), verified on first use

FUSED_DEVICES = ("cuda",)
_FLA_CHECKED: dict[tuple[str, torch.dtype, str], bool] = {}


def _fla_kernel(kind: str) -> Callable | None:
    """fla's chunked kernel for ``kind`` (``simple``: none / per-head decay; ``gla``: gate), if importable."""
    try:
        if kind == "gla":
            from fla.ops.gla import chunk_gla as kernel
        else:
            from fla.ops.simple_gla import chunk_simple_gla as kernel
    except Exception:  # not installed, or no Triton / CUDA: stay on PyTorch
        return None
    return kernel


def _fla_call(kernel: Callable, q, k, v, g, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an fla kernel on ``[B, S, H, d]`` tensors from a zero state; ``(out, final state)``."""
    kwargs = {"scale": scale, "initial_state": None, "output_final_state": True}
    if "head_first" in inspect.signature(kernel).parameters:  # older fla: say the layout explicitly
        kwargs["head_first"] = False
    out, state = kernel(q, k, v, g, **kwargs)
    return out, state


def _fla_inputs(q: torch.Tensor, log_decay: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
    """fla kernel kind and its log-decay argument (``[B, S, H]`` per head and token, or the gate)."""
    if log_decay is not None and log_decay.dim() == 4:
        return "gla", log_decay
    if log_decay is None:
        return "simple", None
    if log_decay.dim() == 3:
        return "simple", log_decay
    return "simple", log_decay.view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)


def fla_enabled(q: torch.Tensor, devices: tuple[str, ...]) -> bool:
    """Whether an fla path may serve ``q``: on one of ``devices``, ``DS_SEQPAR_NO_FLA`` unset, a non-empty piece."""
    return q.device.type in devices and os.environ.get("DS_SEQPAR_NO_FLA") != "1" and q.shape[1] > 0


def fla_check_once(
    cache: dict, key: tuple, kind: str, compare: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]
) -> bool:
    """The first-use check of an fla kernel, cached under ``key`` = (kind, dtype, device).

    ``compare()`` runs fla and the PyTorch form on a small input and returns ``(fla, pytorch)`` pairs;
    the largest relative error must stay within 1e-3 (float32) or 5e-2 (half precision). On a mismatch
    or an error (an incompatible fla API) it warns once and the key stays False: PyTorch serves it.
    """
    if key not in cache:
        tol = 1e-3 if key[1] in (torch.float32, torch.float64) else 5e-2
        try:
            err = max(
                float(
                    (got.float().cpu() - ref.float().cpu()).abs().max()
                    / ref.float().abs().max().clamp(min=1e-6)
                )
                for got, ref in compare()
            )
            ok, why = err <= tol, f"relative error {err:.2e} > {tol:g}"
        except Exception as exc:  # an incompatible fla API
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if not ok:
            warnings.warn(
                f"flash-linear-attention {kind} kernel disagrees with ds_seqpar ({why}); using PyTorch",
                stacklevel=3,
            )
        cache[key] = ok
    return cache[key]


def _fla_verified(kind: str, kernel: Callable, dtype: torch.dtype, device: torch.device) -> bool:
    """Compare fla with the PyTorch chunk form once per (kind, dtype, device)."""

    def compare() -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, 71, 2, 16, generator=gen).mul(0.5).to(device, dtype) for _ in range(3))
        shape = (1, 71, 2, 16) if kind == "gla" else (2,)
        log_decay = (-torch.rand(shape, generator=gen) * 0.2).to(device, torch.float32)
        out, state = _fla_call(kernel, q, k, v, _fla_inputs(q, log_decay)[1], 0.25)
        ref, ref_state = chunk_linear_attention(q, k, v, log_decay, scale=0.25)
        return [(out, ref), (state, ref_state)]

    return fla_check_once(_FLA_CHECKED, (kind, dtype, str(device)), kind, compare)


def _fused_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, state)`` of a piece from a zero state via fla, or None when the fused path is unavailable."""
    if not fla_enabled(q, FUSED_DEVICES):
        return None
    kind, g = _fla_inputs(q, log_decay)
    kernel = _fla_kernel(kind)
    if kernel is None:
        return None
    if not _fla_verified(kind, kernel, q.dtype, q.device):
        return None
    return _fla_call(kernel, q, k, v, g, scale)


def local_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    scale: float = 1.0,
) -> LocalScan:
    """One rank's piece from a zero entering state, plus the decays the entering state needs.

    ``log_decay`` is the piece's own slice (``[B, S_piece, H, d_k]``) or the per-head ``[H]``.
    All outputs are in the acc dtype (keep them there until the entering-state term is added).
    """
    _check_qkv(q, k, v)
    _check_chunk_size(chunk_size)
    acc = _acc_dtype(q.dtype)
    g = _log_decay_bh(q, log_decay)
    b, s, h, d_k = q.shape
    fused = _fused_piece(q, k, v, log_decay, scale)
    if fused is not None:
        out, state = fused[0].to(acc).transpose(1, 2), fused[1].to(acc)
    else:
        q_h, k_h, v_h = _heads_first(q, acc) * scale, _heads_first(k, acc), _heads_first(v, acc)
        out, state = _scan_chunks(q_h, k_h, v_h, g, None, chunk_size)
    if g is None:
        cum = torch.zeros(b, s, h, d_k, dtype=acc, device=q.device)
        total = torch.zeros(b, h, d_k, dtype=acc, device=q.device)
    else:
        cum_h = g.cumsum(dim=2).expand(b, h, s, d_k)  # [B, H, S, d_k]
        total = cum_h[:, :, -1] if s > 0 else torch.zeros(b, h, d_k, dtype=acc, device=q.device)
        cum = cum_h.transpose(1, 2)
    return LocalScan(out.transpose(1, 2), state, total, cum)


def piece_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The piece's summary without its outputs (one pass, no chunk loop), for starting a scan early.

    Returns ``(state [B, H, d_k, d_v], total_log_decay [B, H, d_k], cum_log_decay [B, S, H, d_k])``:
    the same ``state`` / ``total_log_decay`` / ``cum_log_decay`` as :func:`local_scan`, from
    ``state = Σ_t (k_t * exp(G_end - G_t))ᵀ v_t`` (every exponent <= 0). Differentiable by autograd.
    """
    _check_qkv(q, k, v)
    acc = _acc_dtype(q.dtype)
    g = _log_decay_bh(q, log_decay)
    b, s, h, d_k = q.shape
    if g is None:
        cum = torch.zeros(b, s, h, d_k, dtype=acc, device=q.device)
        total = torch.zeros(b, h, d_k, dtype=acc, device=q.device)
        weighted = k.to(acc)
    else:
        cum_h = g.cumsum(dim=2).expand(b, h, s, d_k)
        total = cum_h[:, :, -1] if s > 0 else torch.zeros(b, h, d_k, dtype=acc, device=q.device)
        cum = cum_h.transpose(1, 2)
        weighted = k.to(acc) * torch.exp(total.unsqueeze(1) - cum)
    state = torch.einsum("bshk,bshv->bhkv", weighted, v.to(acc))
    return state, total, cum


def entering_state_output(
    q: torch.Tensor, cum_log_decay: torch.Tensor, state_in: torch.Tensor, *, scale: float = 1.0
) -> torch.Tensor:
    """Contribution ``scale * (q_t * A_t) @ E_p`` of the entering state to each output, ``[B, S, H, d_v]``.

    Args:
        q: ``[B, S, H, d_k]`` queries of the piece (same ``scale`` as in :func:`local_scan`).
        cum_log_decay: ``[B, S, H, d_k]`` log A_t, i.e. ``LocalScan.cum_log_decay``.
        state_in: ``[B, H, d_k, d_v]`` entering state E_p.
    Returns the term in the acc dtype of ``q``.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, S, H, d_k], got shape {tuple(q.shape)}")
    b, s, h, d_k = q.shape
    _check_tensor("cum_log_decay", cum_log_decay, (b, s, h, d_k), q.device)
    if state_in.dim() != 4:
        raise ValueError(f"state_in must be 4-D [B, H, d_k, d_v], got shape {tuple(state_in.shape)}")
    _check_tensor("state_in", state_in, (b, h, d_k, state_in.shape[-1]), q.device)
    acc = _acc_dtype(q.dtype)
    q_dec = q.to(acc) * cum_log_decay.to(acc).exp() * scale
    return torch.einsum("bshk,bhkv->bshv", q_dec, state_in.to(acc))


def advance_state(
    state_in: torch.Tensor, total_log_decay: torch.Tensor, local_state: torch.Tensor
) -> torch.Tensor:
    """State leaving a piece: ``diag(Gamma) E_p + S^loc_end``, ``[B, H, d_k, d_v]``.

    Args:
        state_in: ``[B, H, d_k, d_v]`` entering state E_p.
        total_log_decay: ``[B, H, d_k]`` log Gamma, i.e. ``LocalScan.total_log_decay``.
        local_state: ``[B, H, d_k, d_v]`` ``LocalScan.state``.
    Returns E_{p+1} in the acc dtype of ``local_state``.
    """
    if local_state.dim() != 4:
        raise ValueError(f"local_state must be 4-D [B, H, d_k, d_v], got shape {tuple(local_state.shape)}")
    shape = tuple(local_state.shape)
    _check_tensor("state_in", state_in, shape, local_state.device, ref="local_state")
    _check_tensor("total_log_decay", total_log_decay, shape[:3], local_state.device, ref="local_state")
    acc = _acc_dtype(local_state.dtype)
    return total_log_decay.to(acc).exp().unsqueeze(-1) * state_in.to(acc) + local_state.to(acc)
