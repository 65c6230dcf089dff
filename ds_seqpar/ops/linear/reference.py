"""The fp64 ground truth of linear attention: the token-by-token recurrence (O(S) Python steps).

S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,   S_{-1} = initial state
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.linear.checks import check_qkv, heads_first, log_decay_bh
from ds_seqpar.ops.linear.checks import initial_state as initial_state_of
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["linear_attention_reference"]


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
    check_qkv(q, k, v)
    acc = accumulation_dtype(q.dtype)
    g = log_decay_bh(q, log_decay)
    state = initial_state_of(q, v, initial_state, acc)
    b, s, h, d_k = q.shape
    if state is None:
        state = torch.zeros(b, h, d_k, v.shape[-1], dtype=acc, device=q.device)
    q_h, k_h, v_h = heads_first(q, acc) * scale, heads_first(k, acc), heads_first(v, acc)
    outs = []
    for t in range(s):
        if g is not None:
            state = g[:, :, t].unsqueeze(-1).exp() * state
        state = state + k_h[:, :, t].unsqueeze(-1) * v_h[:, :, t].unsqueeze(-2)
        outs.append((q_h[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    out = torch.stack(outs, dim=1) if outs else q.new_zeros(b, 0, h, v.shape[-1], dtype=acc)
    return out.to(q.dtype), state
