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

Model, per head, inclusive of token t:
    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,   S_{-1} = initial state
``scale`` is a plain factor on q (no softmax), e.g. d_k ** -0.5; default 1.

Chunk form (chunk c of size C, cumulative log decay g_i = sum of log alpha over chunk tokens <= i):
    o_i = sum_{j <= i in c} q_i diag(exp(g_i - g_j)) k_j^T v_j  +  (q_i * exp(g_i)) S_[c-1]
    S_[c] = diag(exp(g_last)) S_[c-1] + sum_j (k_j * exp(g_last - g_j))^T v_j
Every exponent is a difference g_i - g_j with i >= j (positions i < j are set to -inf before the exp)
or g_last - g_j, so all are <= 0: no overflow for strong decays, exact zeros where they underflow.
The per-channel gate builds a [B, H, C, C, d_k] decay tensor per chunk; the scalar and plain cases
only [C, C]. Backward: autograd through these torch ops.

Sequence parallelism (All-Scan, docs/linear.md): rank p holds a contiguous piece; ``local_scan`` runs it from
a zero state. With E_0 = initial state and E_p the state entering piece p,
    out_p   = local.out + entering_state_output(q_p, local.cum_log_decay, E_p)
    E_{p+1} = advance_state(E_p, local.total_log_decay, local.state)
reproduce :func:`chunk_linear_attention` on the whole sequence (outputs, final state E_P and all
gradients); the distributed scan only has to pass E_p from rank to rank.

Fused CUDA path: when the flash-linear-attention package (``fla``) imports and the tensors are on
CUDA, :func:`local_scan` (what sequence parallelism runs) computes its piece with fla's chunked
kernels (``chunk_simple_gla`` for no / per-head decay, ``chunk_gla`` for the gate), registered in
``ops/fla.py``, which checks each against the PyTorch chunk form on first use. ``DS_SEQPAR_NO_FLA=1``
turns the path off. The ground truth (the token-by-token recurrence) is ``reference.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ds_seqpar.ops.fla import (
    FLA_KERNELS,
    FlaKernel,
    fla_backend,
    fla_call,
    fla_kernel,
    imported,
    outputs_and_grads,
)
from ds_seqpar.ops.linear.checks import (
    check_chunk_size,
    check_qkv,
    check_tensor,
    heads_first,
    log_decay_bh,
)
from ds_seqpar.ops.linear.checks import initial_state as _initial
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = [
    "LocalScan",
    "advance_state",
    "chunk_linear_attention",
    "entering_state_output",
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
    check_qkv(q, k, v)
    check_chunk_size(chunk_size)
    acc = accumulation_dtype(q.dtype)
    g = log_decay_bh(q, log_decay)
    state = _initial(q, v, initial_state, acc)
    q_h, k_h, v_h = heads_first(q, acc) * scale, heads_first(k, acc), heads_first(v, acc)
    out, state = _scan_chunks(q_h, k_h, v_h, g, state, chunk_size)
    return out.transpose(1, 2).to(q.dtype), state


# ----------------------------------------------------------------------------------------------
# optional fused path: fla's chunked kernels (``ops/fla.py``), verified on first use


def _fla_inputs(q: torch.Tensor, log_decay: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
    """fla kernel name and its log-decay argument (``[B, S, H]`` per head and token, or the gate)."""
    if log_decay is not None and log_decay.dim() == 4:
        return "gla", log_decay
    if log_decay is None:
        return "simple_gla", None
    if log_decay.dim() == 3:
        return "simple_gla", log_decay
    return "simple_gla", log_decay.view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)


def _fla_run(kernel: Callable, q, k, v, g, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an fla kernel on ``[B, S, H, d]`` tensors from a zero state; ``(out, final state)``."""
    out, state = fla_call(kernel, q, k, v, g, scale=scale, initial_state=None, output_final_state=True)
    return out, state


def _compare(gate: bool) -> Callable:
    """fla against the PyTorch chunk form: outputs, final state and the gradients of q, k, v and the decay."""

    def compare(kernel: Callable, device: torch.device, dtype: torch.dtype) -> list:
        gen = torch.Generator(device="cpu").manual_seed(0)
        xs = [torch.randn(1, 71, 2, 16, generator=gen).mul(0.5).to(device, dtype) for _ in range(3)]
        shape = (1, 71, 2, 16) if gate else (2,)
        log_decay = (-torch.rand(shape, generator=gen) * 0.2).to(device, torch.float32)
        # q, k, v and the log decay (learned in GLA and Mamba2) as leaves of each side
        fused, ref = ([x.clone().requires_grad_() for x in (*xs, log_decay)] for _ in range(2))
        got = _fla_run(kernel, *fused[:3], _fla_inputs(xs[0], fused[3])[1], 0.25)
        want = chunk_linear_attention(*ref[:3], ref[3], scale=0.25)
        return list(zip(outputs_and_grads(got, fused), outputs_and_grads(want, ref), strict=True))

    return compare


for _name, _module, _function in (
    ("simple_gla", "fla.ops.simple_gla", "chunk_simple_gla"),
    ("gla", "fla.ops.gla", "chunk_gla"),
):
    FLA_KERNELS.register(
        fla_backend(_name, FlaKernel(imported(_module, _function), _compare(_name == "gla")))
    )


def _fused_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, state)`` of a piece from a zero state via fla, or None when the fused path does not serve."""
    name, g = _fla_inputs(q, log_decay)
    kernel = fla_kernel(name, q)
    return None if kernel is None else _fla_run(kernel, q, k, v, g, scale)


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
    check_qkv(q, k, v)
    check_chunk_size(chunk_size)
    acc = accumulation_dtype(q.dtype)
    g = log_decay_bh(q, log_decay)
    b, s, h, d_k = q.shape
    fused = _fused_piece(q, k, v, log_decay, scale)
    if fused is not None:
        out, state = fused[0].to(acc).transpose(1, 2), fused[1].to(acc)
    else:
        q_h, k_h, v_h = heads_first(q, acc) * scale, heads_first(k, acc), heads_first(v, acc)
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
    check_qkv(q, k, v)
    acc = accumulation_dtype(q.dtype)
    g = log_decay_bh(q, log_decay)
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
    check_tensor("cum_log_decay", cum_log_decay, (b, s, h, d_k), q.device)
    if state_in.dim() != 4:
        raise ValueError(f"state_in must be 4-D [B, H, d_k, d_v], got shape {tuple(state_in.shape)}")
    check_tensor("state_in", state_in, (b, h, d_k, state_in.shape[-1]), q.device)
    acc = accumulation_dtype(q.dtype)
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
    check_tensor("state_in", state_in, shape, local_state.device, ref="local_state")
    check_tensor("total_log_decay", total_log_decay, shape[:3], local_state.device, ref="local_state")
    acc = accumulation_dtype(local_state.dtype)
    return total_log_decay.to(acc).exp().unsqueeze(-1) * state_in.to(acc) + local_state.to(acc)
