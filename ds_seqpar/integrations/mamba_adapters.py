"""Sequence-parallel forwards of the Mamba mixers (registered in ``recurrent_layers.py``; docs/delta.md).

Each forward mirrors the HF mixer's torch (no cache) path and keeps every weight of the module; the conv1d
gets its halo from the previous rank (``parallel/delta_scan.sharded_causal_conv1d``) and the recurrence runs
over the whole sequence:

    Mamba v1 (Mamba, Falcon-Mamba, Jamba, Zamba)     ``parallel/selective_scan.selective_scan``
    Mamba2 / SSD (Mamba2, Falcon-H1, the hybrids)    ``parallel/selective_scan.ssd_scan``

Per-token steps (projections, the B / C / dt norms, the D skip, the gate, the gated norm) stay local.
Padding (document id < 0) is zeroed where HF's ``apply_mask_to_padding_states`` zeroes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.integrations.recurrent_adapters import _context, _conv, _real_tokens, _zero_padding
from ds_seqpar.parallel.selective_scan import selective_scan, ssd_scan

# -- Mamba v1: selective scan ----------------------------------------------------------------------


def _v1_tail(module, ctx, x, dt, b, c, gate, dtype) -> torch.Tensor:
    """``y = (scan + D x) * silu(gate)``; out_proj. x, dt, gate ``[B, n, D]``, b, c ``[B, n, G, N]``."""
    a = -torch.exp(module.A_log.float()).reshape(x.shape[-1], -1)
    y = selective_scan(x, dt, a, b, c, mesh=ctx.mesh)
    y = (y + x * module.D.float().reshape(-1)) * F.silu(gate)
    ctx.record(module)
    return module.out_proj(y.to(dtype))


def _v1_forward(module, hidden_states, cache, kwargs, normed: bool) -> torch.Tensor:
    """``MambaMixer.forward`` (``normed``: the dt / B / C RMS norms of Falcon-Mamba and Jamba)."""
    ctx = _context(module, kwargs, cache)
    dtype = hidden_states.dtype
    keep = _real_tokens(ctx, hidden_states.shape[0])
    x, gate = module.in_proj(_zero_padding(keep, hidden_states)).chunk(2, dim=-1)
    x = _zero_padding(keep, _conv(module, ctx, x))
    state = module.ssm_state_size
    step, b, c = module.x_proj(x).split([module.time_step_rank, state, state], dim=-1)
    if normed:
        step, b, c = module.dt_layernorm(step), module.b_layernorm(b), module.c_layernorm(c)
    dt = F.softplus(module.dt_proj(step))  # = W step + bias (called, so ZeRO-3 gathers dt_proj)
    return _v1_tail(module, ctx, x, dt, b[:, :, None], c[:, :, None], gate, dtype)


def mamba_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs,
) -> torch.Tensor:
    """``MambaMixer.forward``: in_proj -> (x, gate); conv1d + act; x_proj -> (dt, B, C); dt_proj + softplus;
    the selective scan h_t = e^{dt A} h_{t-1} + dt B_t x_t, y_t = C_t h_t + D x_t; y * silu(gate); out_proj."""
    return _v1_forward(self, hidden_states, cache, kwargs, normed=False)


def normed_mamba_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs,
) -> torch.Tensor:
    """``FalconMambaMixer`` / ``JambaMambaMixer``: Mamba v1 with RMS norms on dt (before dt_proj), B and C."""
    return _v1_forward(self, hidden_states, cache, kwargs, normed=True)


def zamba_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs,
) -> torch.Tensor:
    """``ZambaMambaMixer.forward``: Mamba v1 with per-head x_proj / dt_proj weights and per-head B, C
    (heads = contiguous channel groups); in_proj interleaves (x, gate) per channel."""
    ctx = _context(self, kwargs, cache)
    bsz, n, _ = hidden_states.shape
    dtype = hidden_states.dtype
    keep = _real_tokens(ctx, bsz)
    heads, width, state = self.n_mamba_heads, self.mamba_head_dim, self.ssm_state_size
    x, gate = self.in_proj(_zero_padding(keep, hidden_states)).view(bsz, n, -1, 2).unbind(-1)
    x = _zero_padding(keep, _conv(self, ctx, x.contiguous()))
    params = torch.einsum("hpd,bnhd->bnhp", self.x_proj_weight, x.view(bsz, n, heads, width))
    step, b, c = params.split([self.time_step_rank, state, state], dim=-1)
    dt = torch.einsum("hdr,bnhr->bnhd", self.dt_proj_weight, step)
    dt = F.softplus(dt + self.dt_proj_bias.float().to(dt.dtype)).reshape(bsz, n, heads * width)
    return _v1_tail(self, ctx, x, dt, b, c, gate, dtype)


# -- Mamba2 / SSD mixers ---------------------------------------------------------------------------


def _ssd(module, ctx, projected, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 torch path after in_proj: (gate, xBC, dt); conv1d + act on xBC; the SSD scan
    h_t = e^{dt_t A_h} h_{t-1} + dt_t B_t x_tᵀ, y_t = C_t h_t + D_h x_t. Returns ``(y [B, n, I] fp32, gate)``."""
    bsz, n, _ = projected.shape
    a_log = -torch.exp(module.A_log.float())
    gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
    xbc = _zero_padding(keep, _conv(module, ctx, xbc))
    groups, state = module.n_groups, module.ssm_state_size
    x, b_in, c_in = torch.split(xbc, [module.intermediate_size, groups * state, groups * state], dim=-1)
    limit = getattr(module, "time_step_limit", (0.0, float("inf")))
    dt = torch.clamp(F.softplus(dt + module.dt_bias.to(dt.dtype)), min=limit[0], max=limit[1])
    heads = module.num_heads
    x = x.reshape(bsz, n, heads, module.head_dim).float()
    b_in, c_in = (
        t.reshape(bsz, n, groups, state).float().repeat_interleave(heads // groups, dim=2, output_size=heads)
        for t in (b_in, c_in)
    )
    y = ssd_scan(c_in, b_in, x * dt[..., None].float(), a_log * dt.float(), mesh=ctx.mesh)
    y = y + module.D[..., None] * x
    ctx.record(module)
    return y.reshape(bsz, n, -1), gate


def mamba2_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs,
) -> torch.Tensor:
    """The Mamba2 mixer (Mamba2, Nemotron-H, Bamba, Granite-4, Zamba2): in_proj; the SSD path (``_ssd``);
    gated RMSNorm; out_proj."""
    ctx = _context(self, kwargs, cache)
    dtype = hidden_states.dtype
    keep = _real_tokens(ctx, hidden_states.shape[0])
    y, gate = _ssd(self, ctx, self.in_proj(_zero_padding(keep, hidden_states)), keep)
    return self.out_proj(self.norm(y, gate).to(dtype))


def falcon_h1_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs,
) -> torch.Tensor:
    """``FalconH1Mixer.forward``: the input scaled by ssm_in_multiplier, in_proj's output by the muP vector
    (ssm_multipliers per section), the SSD path, then the gated RMSNorm when ``mamba_rms_norm``, else
    y * silu(gate); out_proj."""
    ctx = _context(self, kwargs, cache)
    dtype = hidden_states.dtype
    keep = _real_tokens(ctx, hidden_states.shape[0])
    hidden_states = _zero_padding(keep, hidden_states) * self.ssm_in_multiplier
    y, gate = _ssd(self, ctx, self.in_proj(hidden_states) * self.mup_vector, keep)
    y = self.norm(y, gate) if self.mamba_rms_norm else y * F.silu(gate)
    return self.out_proj(y.to(dtype))
