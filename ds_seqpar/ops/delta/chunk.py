"""Gated delta rule (GDN, KDA) in chunk form with state in/out, and its All-Scan split (docs/delta.md).

Legend:
    B, S, H     batch, tokens (of the sequence or of one rank's contiguous piece), heads
    q, k        [B, S, H, d_k]            (normalised by the caller as its model does)
    v, out      [B, S, H, d_v]
    beta        [B, S, H]                 write strength beta_t in [0, 1]
    log_decay   None; [B, S, H] (gated DeltaNet: one decay per token and head); or [B, S, H, d_k]
                (Kimi Delta Attention: one per token, head and key channel). Finite and <= 0
    state       [B, H, d_k, d_v]
    acc dtype   float64 for float64 inputs, else float32

Recurrence per head (decay first, then the delta correction against the decayed state):
    D_t = diag(exp(log_decay_t)),   S'_t = D_t S_{t-1}
    S_t = S'_t + beta_t k_t (v_t - S'_tᵀ k_t)ᵀ = (I - beta_t k_t k_tᵀ) D_t S_{t-1} + beta_t k_t v_tᵀ
    o_t = scale * S_tᵀ q_t

Chunk form (chunk of C tokens entering with state S_0; G_t = cumulative log decay inside the chunk,
inclusive, so every exp below has an exponent <= 0):
    the state-free "new values"   u_t = beta_t (v_t - k_tᵀ D_t S_{t-1})   satisfy
        (I + diag(beta) L) u = diag(beta) (V - K+ S_0),   L[t, j] = Σ_c k_tc k_jc e^{G_tc - G_jc}  (j < t),
        K+ = K ⊙ e^{G}, so with T = (I + diag(beta) L)^-1:   u = U - W S_0,  U = T diag(beta) V,
        W = T diag(beta) K+
    outputs   O = Q+ S_0 + A u,        A[t, j] = Σ_c q_tc k_jc e^{G_tc - G_jc}  (j <= t),  Q+ = Q ⊙ e^{G}
    leaving   S_C = diag(e^{G_C}) S_0 + (K ⊙ e^{G_C - G})ᵀ u
Everything but the short sweep over chunks (u, O, S_C) is independent of the state, so a piece is
prepared once (``delta_piece``) and swept as often as needed.

All-Scan split: the layer is affine in the entering state, column by column of d_v:
    S_out = M S_in + N        (M [d_k, d_k]: product of the chunk maps diag(e^{G_C}) - (K ⊙ e^{G_C-G})ᵀ W;
                               N: the leaving state from a zero entering state)
    out   = out(0) + out_E    (out_E: the sweep with V = 0 and S_0 = S_in, linear in S_in)
``piece_transition`` gives (M, N), ``piece_outputs`` the outputs and leaving state from any entering
state, ``entering_state_output`` the correction alone. Backward: autograd through these torch ops.

Fused CUDA path: when flash-linear-attention (``fla``) imports and the tensors are on CUDA,
``delta_piece`` returns a ``FusedDeltaPiece`` and the three piece functions call fla's chunked kernels
(``chunk_gated_delta_rule`` for no / per-head decay, ``chunk_kda`` for the per-channel decay) with an
initial state: M is the final state of a run with V = 0 from S_0 = I, N of a run with V from 0, the
outputs of a run from the entering state, the correction of a run with V = 0 from it. They are
registered in ``ops/fla.py``, which compares each with the PyTorch chunk form on first use (outputs,
final state and the gradients of every input, the gate and a random initial state). ``DS_SEQPAR_NO_FLA=1`` turns the path off. The ground truth
(the token-by-token recurrence) is ``reference.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ds_seqpar.ops.delta.checks import check_gates, gate_heads_first
from ds_seqpar.ops.fla import (
    FLA_KERNELS,
    FlaKernel,
    fla_backend,
    fla_call,
    fla_kernel,
    imported,
    outputs_and_grads,
)
from ds_seqpar.ops.linear.checks import check_chunk_size, check_qkv, check_tensor
from ds_seqpar.ops.linear.checks import initial_state as initial_state_of
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = [
    "DeltaPiece",
    "FusedDeltaPiece",
    "chunk_delta_rule",
    "delta_piece",
    "entering_state_output",
    "piece_outputs",
    "piece_transition",
    "prepare_piece",
]


class DeltaPiece(NamedTuple):
    """A prepared piece, heads first, in the acc dtype; N chunks of C tokens (the last zero-padded).

    Attributes:
        length: real tokens S of the piece (rows past it are padding and dropped).
        q_plus: ``[B, H, N, C, d_k]`` scale · q ⊙ e^{G}.
        a_qk: ``[B, H, N, C, C]`` intra-chunk output weights A (lower triangular, diagonal included).
        w: ``[B, H, N, C, d_k]`` W = T diag(beta) K+.
        values: ``[B, H, N, C, d_v]`` U = T diag(beta) V.
        k_end: ``[B, H, N, C, d_k]`` K ⊙ e^{G_C - G}.
        gamma: ``[B, H, N, d_k|1]`` e^{G_C}, the chunk's total decay.
    """

    length: int
    q_plus: torch.Tensor
    a_qk: torch.Tensor
    w: torch.Tensor
    values: torch.Tensor
    k_end: torch.Tensor
    gamma: torch.Tensor


class FusedDeltaPiece(NamedTuple):
    """A piece for fla's kernels: the inputs as given (``[B, S, H, ...]``), the kernel and the scale."""

    kernel: Callable
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    log_decay: torch.Tensor
    scale: float


def _chunked(x: torch.Tensor, chunk: int, n_chunks: int) -> torch.Tensor:
    """``[B, H, S, d]`` -> ``[B, H, N, C, d]``, zero-padded to N·C rows."""
    pad = n_chunks * chunk - x.shape[2]
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, x.shape[3])], dim=2)
    return x.reshape(*x.shape[:2], n_chunks, chunk, x.shape[3])


def delta_piece(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    scale: float = 1.0,
) -> DeltaPiece | FusedDeltaPiece:
    """Prepare a piece: every state-independent chunk quantity (triangular solves included), batched over chunks
    (or, on CUDA with fla, a ``FusedDeltaPiece``).

    Memory: the per-channel decay (KDA) builds a ``[B, H, N, C, C, d_k]`` tensor; pick a small chunk
    (16-32) for long KDA pieces.
    """
    check_qkv(q, k, v)
    check_gates(q, beta, log_decay)
    check_chunk_size(chunk_size)
    return prepare_piece(q, k, v, beta, log_decay, chunk_size, scale)


def prepare_piece(q, k, v, beta, log_decay, chunk_size: int, scale: float) -> DeltaPiece | FusedDeltaPiece:
    """:func:`delta_piece` without the input checks (the decay check is a host sync): for callers that
    validated the whole input once, such as ``parallel/delta_scan.py`` for every piece of every pass."""
    fused = _fused_piece(q, k, v, beta, log_decay, scale)
    if fused is not None:
        return fused
    return _torch_piece(q, k, v, beta, log_decay, chunk_size, scale)


def _torch_piece(q, k, v, beta, log_decay, chunk_size: int, scale: float) -> DeltaPiece:
    acc = accumulation_dtype(q.dtype)
    s = q.shape[1]
    c = chunk_size
    n = max(1, -(-s // c))
    q_c, k_c, v_c = (_chunked(gate_heads_first(x, acc), c, n) for x in (q, k, v))
    q_c = q_c * scale
    beta_c = _chunked(gate_heads_first(beta, acc), c, n)  # [B, H, N, C, 1]
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    inclusive = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if log_decay is None:
        cum = q_c.new_zeros(1, 1, 1, c, 1)
        kk = k_c @ k_c.transpose(-1, -2)
        qk = q_c @ k_c.transpose(-1, -2)
    else:
        cum = _chunked(gate_heads_first(log_decay, acc), c, n).cumsum(dim=3)  # [B, H, N, C, d_k|1]
        diff = cum.unsqueeze(4) - cum.unsqueeze(3)  # [.., i, j, .] = G_i - G_j, <= 0 where i >= j
        decay = diff.masked_fill(~inclusive.unsqueeze(-1), float("-inf")).exp()
        if decay.shape[-1] == 1:
            decay = decay.squeeze(-1)
            kk = (k_c @ k_c.transpose(-1, -2)) * decay
            qk = (q_c @ k_c.transpose(-1, -2)) * decay
        else:
            kk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", k_c, k_c, decay)
            qk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", q_c, k_c, decay)
    lower = kk.masked_fill(~strict, 0.0) * beta_c
    eye = torch.eye(c, dtype=acc, device=q.device)
    t_beta = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    t_beta = t_beta * beta_c.transpose(-1, -2)  # T diag(beta): scale the columns
    last = cum[:, :, :, -1:]  # [B|1, H|1, N|1, 1, d_k|1]
    return DeltaPiece(
        length=s,
        q_plus=q_c * cum.exp(),
        a_qk=qk.masked_fill(~inclusive, 0.0),
        w=t_beta @ (k_c * cum.exp()),
        values=t_beta @ v_c,
        k_end=k_c * (last - cum).exp(),
        gamma=last.squeeze(3).exp().expand(*k_c.shape[:3], last.shape[-1]),
    )


def _sweep(
    piece: DeltaPiece, values: torch.Tensor | None, state: torch.Tensor | None, outputs: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Run the chunks in order from ``state`` (None = zero) with new values ``values`` (None = V = 0).

    Returns ``(out [B, S, H, w] or None, leaving state [B, H, d_k, w])``.
    """
    per_chunk = [x.unbind(dim=2) for x in (piece.q_plus, piece.a_qk, piece.w, piece.k_end, piece.gamma)]
    vals = values.unbind(dim=2) if values is not None else [None] * len(per_chunk[0])
    outs = []
    for (q_plus, a_qk, w, k_end, gamma), val in zip(zip(*per_chunk, strict=True), vals, strict=True):
        recalled = None if state is None else w @ state
        u = val if recalled is None else (-recalled if val is None else val - recalled)
        if outputs:
            o = a_qk @ u
            outs.append(o if state is None else o + q_plus @ state)
        kv = k_end.transpose(-1, -2) @ u
        state = kv if state is None else gamma.unsqueeze(-1) * state + kv
    if not outputs:
        return None, state
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, : piece.length]  # [B, H, S, w]
    return out.transpose(1, 2), state


def piece_outputs(
    piece: DeltaPiece | FusedDeltaPiece, entering: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``[B, S, H, d_v]`` and leaving state ``[B, H, d_k, d_v]`` (acc dtype) from ``entering`` (None = 0)."""
    if isinstance(piece, FusedDeltaPiece):
        return _fused_run(piece, piece.v, entering)
    if entering is not None:
        b, h, _, _, d_k = piece.w.shape
        check_tensor(
            "entering", entering, (b, h, d_k, piece.values.shape[-1]), piece.w.device, ref="the piece"
        )
        entering = entering.to(piece.w.dtype)
    out, state = _sweep(piece, piece.values, entering)
    return out, state


def entering_state_output(piece: DeltaPiece | FusedDeltaPiece, entering: torch.Tensor) -> torch.Tensor:
    """The entering state's share of the outputs, ``out(E) - out(0)``, ``[B, S, H, d_v]`` (linear in E)."""
    if isinstance(piece, FusedDeltaPiece):
        return _fused_run(piece, torch.zeros_like(piece.v), entering)[0]
    b, h, _, _, d_k = piece.w.shape
    check_tensor("entering", entering, (b, h, d_k, entering.shape[-1]), piece.w.device, ref="the piece")
    out, _ = _sweep(piece, None, entering.to(piece.w.dtype))
    return out


def piece_transition(piece: DeltaPiece | FusedDeltaPiece) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's affine state map ``S_out = M S_in + N``: ``(M [B, H, d_k, d_k], N [B, H, d_k, d_v])``.

    M is the ordered product of the chunk maps ``diag(gamma) - k_endᵀ W`` (computed batched over chunks,
    then multiplied in sequence order); N is the leaving state of a zero-state sweep (no outputs).
    """
    if isinstance(piece, FusedDeltaPiece):
        b, _, h, d_k = piece.k.shape
        eye = (
            torch.eye(d_k, dtype=accumulation_dtype(piece.q.dtype), device=piece.k.device)
            .expand(b, h, d_k, d_k)
            .contiguous()
        )
        _, transition = _fused_run(piece, piece.k.new_zeros(*piece.k.shape), eye)
        return transition, _fused_run(piece, piece.v, None)[1]
    d_k = piece.w.shape[-1]
    eye = torch.eye(d_k, dtype=piece.w.dtype, device=piece.w.device)
    maps = eye * piece.gamma.unsqueeze(-1) - piece.k_end.transpose(-1, -2) @ piece.w  # [B, H, N, d_k, d_k]
    transition = None
    for m in maps.unbind(dim=2):
        transition = m if transition is None else m @ transition
    _, offset = _sweep(piece, piece.values, None, outputs=False)
    return transition, offset


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the whole sequence in chunk form (any S >= 0).

    Returns ``(out [B, S, H, d_v] in q's dtype, final_state [B, H, d_k, d_v] in the acc dtype)``.
    """
    piece = delta_piece(q, k, v, beta, log_decay, chunk_size, scale=scale)
    out, state = piece_outputs(piece, initial_state_of(q, v, initial_state, accumulation_dtype(q.dtype)))
    return out.to(q.dtype), state


# ----------------------------------------------------------------------------------------------
# optional fused path: fla's chunked kernels (``ops/fla.py``), verified on first use


def _fla_run(kernel: Callable, q, k, v, g, beta, scale: float, initial) -> tuple[torch.Tensor, torch.Tensor]:
    """One fla call on ``[B, S, H, d]`` tensors; ``(out, final state)``; q and k are used as given."""
    return fla_call(kernel, q, k, v, g, beta, scale=scale, initial_state=initial, output_final_state=True)


def _fused_run(piece: FusedDeltaPiece, v: torch.Tensor, initial: torch.Tensor | None):
    """``(out [B, S, H, w], final [B, H, d_k, w])`` in the acc dtype of a fused piece run with values ``v``."""
    acc = accumulation_dtype(piece.q.dtype)
    init = None if initial is None else initial.to(acc)  # fla keeps its states in float32
    out, state = _fla_run(piece.kernel, piece.q, piece.k, v, piece.log_decay, piece.beta, piece.scale, init)
    return out.to(acc), state.to(acc)


def _compare(per_channel: bool) -> Callable:
    """fla against the PyTorch chunk form: outputs, final state and the gradients of q, k, v, beta, the gate
    and the initial state (random)."""

    def compare(kernel: Callable, device: torch.device, dtype: torch.dtype) -> list:
        gen = torch.Generator(device="cpu").manual_seed(0)
        b, s, h, d = 1, 71, 2, 16
        q = torch.randn(b, s, h, d, generator=gen)
        k = torch.nn.functional.normalize(torch.randn(b, s, h, d, generator=gen), dim=-1)
        v = torch.randn(b, s, h, d, generator=gen)
        beta = torch.rand(b, s, h, generator=gen)
        g = -torch.rand(*((b, s, h, d) if per_channel else (b, s, h)), generator=gen) * 0.2
        init = torch.randn(b, h, d, d, generator=gen)
        # leaves: q, k, v, beta, the gate (learned) and the initial state (the SP path's entering state)
        ref = [x.clone().requires_grad_() for x in (q, k, v, beta, g, init)]
        want = piece_outputs(_torch_piece(*ref[:4], ref[4], 16, 0.25), ref[5])  # never the fused path
        fused = [
            x.to(device, dtype if i < 4 else torch.float32).requires_grad_()
            for i, x in enumerate((q, k, v, beta, g, init))
        ]
        got = _fla_run(kernel, *fused[:3], fused[4], fused[3], 0.25, fused[5])
        return list(zip(outputs_and_grads(got, fused), outputs_and_grads(want, ref), strict=True))

    return compare


for _name, _module, _function in (
    ("gated_delta_rule", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    ("kda", "fla.ops.kda", "chunk_kda"),
):
    FLA_KERNELS.register(
        fla_backend(_name, FlaKernel(imported(_module, _function), _compare(_name == "kda")))
    )


def _fused_piece(q, k, v, beta, log_decay, scale: float) -> FusedDeltaPiece | None:
    """A fused piece when an fla kernel may serve (fused device, fla imports, its check passed), else None."""
    kernel = fla_kernel("kda" if log_decay is not None and log_decay.dim() == 4 else "gated_delta_rule", q)
    if kernel is None:
        return None
    g = log_decay if log_decay is not None else q.new_zeros(*q.shape[:3], dtype=torch.float32)
    if g.dtype not in (torch.float32, torch.float64):  # a half-precision log decay loses the small decays
        g = g.float()
    return FusedDeltaPiece(kernel, q, k, v, beta, g, scale)
