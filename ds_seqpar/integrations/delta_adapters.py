"""Sequence-parallel forwards for more delta-rule layers (registered in ``recurrent_layers.py``).

The families here differ from Qwen3.5's gated DeltaNet and Kimi's KDA (``recurrent_adapters.py``) only
in per-token steps, so they reuse that module's conv halo and delta-rule core: the causal conv1d gets
the previous rank's last K - 1 inputs (``sharded_causal_conv1d``), the recurrence runs through
``parallel/delta_scan.delta_rule_attention`` (matrix All-Scan of the d_k x d_v state per head).
Projections, gates, norms and the output stay local. Conventions per family: docs/delta.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.integrations.recurrent_adapters import (
    _context,
    _conv,
    _delta_core,
    _real_tokens,
    _zero_padding,
)


def _split_qkv(
    module: torch.nn.Module, ctx: Any, hidden_states: torch.Tensor, dims: list[int], heads: list[int]
):
    """``q_proj | k_proj | v_proj`` of ``[B, n, hidden]`` -> conv (halo) -> q, k, v ``[B, n, H, d]``."""
    bsz, n, _ = hidden_states.shape
    mixed = torch.cat(
        [module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)], dim=-1
    )
    parts = torch.split(_conv(module, ctx, mixed), dims, dim=-1)
    return [x.reshape(bsz, n, -1, d) for x, d in zip(parts, heads, strict=True)]


def olmo_hybrid_gdn_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``OlmoHybridGatedDeltaNet.forward``: separate q/k/v/a/b projections, β = sigmoid(b) (× 2 with
    ``allow_neg_eigval``), the gated delta rule over the whole sequence, gated norm with ``g_proj``, ``o_proj``."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    bsz, n, _ = hidden_states.shape
    dims = [self.key_dim, self.key_dim, self.value_dim]
    q, k, v = _split_qkv(self, ctx, hidden_states, dims, [self.head_k_dim, self.head_k_dim, self.head_v_dim])
    beta = self.b_proj(hidden_states).sigmoid()
    if self.allow_neg_eigval:
        beta = beta * 2.0
    g = -self.A_log.float().exp() * F.softplus(self.a_proj(hidden_states).float() + self.dt_bias)
    core = _delta_core(self, ctx, q, k, v, beta, g)
    gate = self.g_proj(hidden_states)
    out = self.o_norm(core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
    return self.o_proj(out.reshape(bsz, n, -1))


def bailing_kda_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``BailingHybridDeltaAttention.forward``: KDA (per-channel log decay from ``forget_gate``, its
    safe-gate form included), β = sigmoid(b_proj), gated norm with ``g_proj`` (sigmoid), ``o_proj``."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    bsz, n, _ = hidden_states.shape
    q, k, v = _split_qkv(self, ctx, hidden_states, [self.qkv_dim] * 3, [self.head_dim] * 3)
    decay = self.forget_gate(hidden_states)
    beta = torch.sigmoid(self.b_proj(hidden_states))
    core = _delta_core(self, ctx, q, k, v, beta, decay)
    gate = self.g_proj(hidden_states).view(bsz, n, -1, self.head_dim)
    return self.o_proj(self.o_norm(core, gate).reshape(bsz, n, -1))
