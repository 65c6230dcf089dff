"""The mLSTM (xLSTM) of one chunk with its stabiliser given: the pieces of the chunkwise form (docs/delta.md "mLSTM").

Legend: B batch, c tokens of the chunk, h heads, d_k / d_v head dims; q, k ``[B, c, h, d_k]``, v ``[B, c, h, d_v]``,
the gate pre-activations i, f ``[B, c, h]``; a state ``[B, h, d_k, d_v + 1]`` (C and n side by side).

Per head, with log f_t = logsigmoid(f_t) and F_t = Σ_{s<=t} log f_s (from the chunk start):

    m_t = max(F_t + m_enter, max_{j<=t} (F_t - F_j + i_j))          the max-stabiliser (a max-plus scan)
    C_t = e^{F_t + m_enter - m_t} C_enter + Σ_{j<=t} e^{F_t - F_j + i_j - m_t} k_j [v_j | 1]ᵀ   (stabilised)
    h_t = q̃_t C_t[:, :d_v] / (max(|q̃_t C_t[:, d_v]|, e^{-m_t}) + eps),   q̃ = q · d_k^-1/2

which is HF's chunkwise and recurrent mLSTM (m starts at 0). m_t cancels from h_t except in the eps term,
so it must be the same max-plus prefix as HF's; it does not depend on where chunks or pieces start.
A chunk maps m affinely in the max-plus sense, ``m_leave = max(g + m_enter, l)``, and the stabilised state
linearly, ``C_leave = e^{g + m_enter - m_leave} C_enter + local``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["MlstmChunk", "chunk_output", "chunk_state", "chunk_summary"]


class MlstmChunk(NamedTuple):
    """A chunk's gates: ``cum [B, c, h]`` (F_t), ``best [B, c, h]`` (max_{j<=t} (i_j - F_j)), ``gain [B, h]``
    (g = F_last) and ``peak [B, h]`` (l = F_last + best_last): ``m_leave = max(g + m_enter, l)``."""

    cum: torch.Tensor
    best: torch.Tensor
    gain: torch.Tensor
    peak: torch.Tensor


def chunk_summary(i: torch.Tensor, f: torch.Tensor) -> MlstmChunk:
    """The max-plus summary of a chunk from its gate pre-activations ``i, f [B, c, h]``."""
    cum = F.logsigmoid(f).cumsum(dim=1)
    best = torch.cummax(i - cum, dim=1).values
    return MlstmChunk(cum, best, cum[:, -1], cum[:, -1] + best[:, -1])


def chunk_state(
    k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, chunk: MlstmChunk, m_leave: torch.Tensor
) -> torch.Tensor:
    """The chunk's own contribution to the stabilised state it leaves, ``[B, h, d_k, d_v + 1]``."""
    weight = torch.exp(chunk.gain[:, None] - chunk.cum + i - m_leave[:, None])  # [B, c, h]
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    return torch.einsum("bchk,bchv->bhkv", k * weight[..., None], values)


def chunk_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    chunk: MlstmChunk,
    m_enter: torch.Tensor,
    state: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """h ``[B, c, h, d_v]`` of a chunk given the stabiliser ``m_enter [B, h]`` and the stabilised state
    ``state [B, h, d_k, d_v + 1]`` entering it."""
    c = q.shape[1]
    q = q * q.shape[-1] ** -0.5
    m = torch.maximum(chunk.cum + m_enter[:, None], chunk.cum + chunk.best)  # [B, c, h]
    inter = torch.exp(chunk.cum + m_enter[:, None] - m)[..., None] * torch.einsum("bchk,bhkv->bchv", q, state)
    logd = chunk.cum[:, :, None] - chunk.cum[:, None] + i[:, None] - m[:, :, None]  # [B, t, j, h]
    visible = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = logd.masked_fill(~visible[None, :, :, None], float("-inf")).exp()
    scores = torch.einsum("bthk,bjhk->btjh", q, k) * decay
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    total = inter + torch.einsum("btjh,bjhv->bthv", scores, values)
    num, den = total[..., :-1], total[..., -1:]
    return num / (torch.maximum(den.abs(), torch.exp(-m)[..., None]) + eps)
