"""The fp64 ground truth of the gated delta rule: the token-by-token recurrence (O(S) Python steps).

S'_t = diag(exp(log_decay_t)) S_{t-1},   S_t = S'_t + beta_t k_t (v_t - S'_tᵀ k_t)ᵀ,   o_t = scale * S_tᵀ q_t
"""

from __future__ import annotations

import torch

from ds_seqpar.ops.delta.checks import check_gates, gate_heads_first
from ds_seqpar.ops.linear.checks import check_qkv
from ds_seqpar.ops.linear.checks import initial_state as initial_state_of
from ds_seqpar.ops.precision import accumulation_dtype

__all__ = ["delta_rule_reference"]


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (the ground truth; O(S) Python steps; differentiable).

    Returns ``(out [B, S, H, d_v] in q's dtype, final_state [B, H, d_k, d_v] in the acc dtype)``.
    """
    check_qkv(q, k, v)
    check_gates(q, beta, log_decay)
    acc = accumulation_dtype(q.dtype)
    b, s, h, d_k = q.shape
    state = initial_state_of(q, v, initial_state, acc)
    if state is None:
        state = torch.zeros(b, h, d_k, v.shape[-1], dtype=acc, device=q.device)
    q_h, k_h, v_h = (gate_heads_first(x, acc) for x in (q, k, v))
    beta_h, g_h = gate_heads_first(beta, acc), gate_heads_first(log_decay, acc)
    outs = []
    for t in range(s):
        if g_h is not None:
            state = g_h[:, :, t].exp().unsqueeze(-1) * state
        k_t = k_h[:, :, t]
        recalled = (k_t.unsqueeze(-1) * state).sum(dim=-2)  # S'ᵀ k  [B, H, d_v]
        delta = beta_h[:, :, t] * (v_h[:, :, t] - recalled)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(scale * (q_h[:, :, t].unsqueeze(-1) * state).sum(dim=-2))
    out = torch.stack(outs, dim=1) if outs else torch.zeros(b, 0, h, v.shape[-1], dtype=acc, device=q.device)
    return out.to(q.dtype), state
