"""Sequence-parallel forwards for the recurrent layers of HF hybrid models (registered in ``recurrent_layers.py``).

Each forward mirrors the HF layer's training path (no cache) step by step and keeps every weight of
the module; only three things change: the causal conv1d gets its halo from the previous rank
(``parallel/delta_scan.sharded_causal_conv1d``), and the recurrence runs over the whole sequence through
``ds_seqpar.linear_attention`` (Lightning) or ``parallel/delta_scan.delta_rule_attention`` (gated
DeltaNet, KDA). Per-token steps (projections, gates, norms) stay local. The Mamba mixers (v1 and Mamba2)
are in ``mamba_adapters.py`` and use the helpers here.

Padding (document id < 0) is zeroed where HF's ``apply_mask_to_padding_states`` zeroes it. Packed
documents do not reset the recurrent state, as in the HF model without a cache; the family conventions
(beta, decay, q/k normalisation, GVA) are in docs/delta.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds_seqpar.integrations.context import SeqParContext, current_context
from ds_seqpar.integrations.delta_state import conv_step, delta_step, keep_state, neutral_padding
from ds_seqpar.parallel.delta_scan import delta_rule_attention, sharded_causal_conv1d
from ds_seqpar.parallel.linear_scan import linear_attention
from ds_seqpar.settings import input_layout


def _context(module: torch.nn.Module, kwargs: dict, cache: Any) -> Any:
    ctx = current_context(kwargs)
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if not isinstance(ctx, SeqParContext):
        raise RuntimeError(
            f"{name} runs under ds_seqpar without a ds_seqpar context; run the model through "
            "ds_seqpar.SeqParCausalLM / ds_seqpar.initialize, or disable_sequence_parallel(model)"
        )
    if cache is not None or kwargs.get("use_cache"):
        raise RuntimeError(
            f"{name}: a recurrent cache is in use (generation); sequence-parallel recurrent layers need the whole "
            "sequence at once: pass use_cache=False, and generate with ds_seqpar.generate (docs/inference.md) or an unwrapped model"
        )
    return ctx


def _real_tokens(ctx: Any, batch: int) -> torch.Tensor | None:
    """``[B, n, 1]`` 1 for this rank's real tokens, 0 for padding (doc id < 0); None without doc ids."""
    if ctx.doc_ids is None:
        return None
    real = ctx.doc_ids if ctx.doc_ids.dim() == 2 else ctx.doc_ids.expand(batch, -1)
    return (input_layout(ctx.mesh, ctx.doc_ids).shard(real, ctx.mesh.coords.sp_rank, dim=1) >= 0)[:, :, None]


def _zero_padding(keep: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x [B, n, ...]`` with the rows of padding tokens zeroed, as HF's padding mask does."""
    if keep is None:
        return x
    return (x * keep.view(*keep.shape[:2], *([1] * (x.dim() - 2)))).to(x.dtype)


def _family(module: torch.nn.Module) -> Any:
    """The module's own transformers modeling module (for its ``l2norm`` and activation table)."""
    return sys.modules[type(module).__module__]


def _conv(module: torch.nn.Module, ctx: Any, mixed: torch.Tensor) -> torch.Tensor:
    """The layer's causal depthwise conv1d + activation on ``[B, n, C]`` rows, the halo from the previous rank."""
    act = _family(module).ACT2FN[module.activation]
    return sharded_causal_conv1d(mixed, module.conv1d, mesh=ctx.mesh, activation=act)


# -- MiniMax: Lightning attention ---------------------------------------------------------------


def lightning_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``MiniMaxLightningAttention.forward``: qkv = silu(qkv_proj(x)); S_t = e^{-s_h} S_{t-1} + k_tᵀ v_t;
    out = out_proj(sigmoid(output_gate(x)) * norm(o))."""
    ctx = _context(self, kwargs, cache)
    b, n, _ = hidden_states.shape
    h, d = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(b, n, h, 3 * d)
    keep = _real_tokens(ctx, b)
    q, k, v = (_zero_padding(keep, x) for x in torch.split(qkv, d, dim=3))
    out = linear_attention(q, k, v, mesh=ctx.mesh, log_decay=-self.slope_rate.view(h).to(q.dtype))
    out = self.norm(out.reshape(b, n, h * d))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    ctx.record(self)
    return self.out_proj(out), None


# -- gated DeltaNet (Qwen3-Next, Qwen3.5) and KDA (Kimi Linear) ------------------------------------


def _qk(
    module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k through the family's own l2norm, repeated to the ``heads`` value heads (GVA)."""
    l2norm = _family(module).l2norm
    q, k = (l2norm(x.float(), dim=-1, eps=1e-6) for x in (q, k))
    rep = heads // q.shape[2]
    if rep > 1:
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    return q, k


def _delta_core(module: torch.nn.Module, ctx: Any, q, k, v, beta, g) -> torch.Tensor:
    """HF's ``chunk_*_delta_rule(..., use_qk_l2norm_in_kernel=True)`` under SP: float32, the family's own
    l2norm on q and k, q scaled by d_k^-1/2, q/k heads repeated to the value heads (GVA)."""
    return _delta_scan(module, ctx, q, k, v, beta, g, keep=False)[0]


def _delta_scan(
    module: torch.nn.Module,
    ctx: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_delta_core``; with ``keep`` (``ds_seqpar.prefill``) also this rank's share of the final state
    ``[B, H, d_k, d_v]``, the padding past the prompt made neutral."""
    dtype = q.dtype
    q, k = _qk(module, q, k, v.shape[2])
    beta, g = beta.float(), g.float()
    if keep:
        beta, g = neutral_padding(ctx.cache, beta, g)
    out = delta_rule_attention(
        q, k, v.float(), beta, mesh=ctx.mesh, log_decay=g, scale=q.shape[-1] ** -0.5, final_state=keep
    )
    out, share = out if keep else (out, None)
    ctx.record(module)
    return out.to(dtype), share


def _layer(module: torch.nn.Module, ctx: Any) -> int:
    return ctx.layer_of.get(id(module), getattr(module, "layer_idx", None))


def _gdn_mixing(module: torch.nn.Module, conv: Callable, mixed_qkv, b, a) -> tuple[torch.Tensor, ...]:
    """``mixed_qkv [B, n, C]`` (pre-conv), ``b``, ``a`` -> ``conv`` (the sharded one, or one decoding step),
    split, beta and decay of the GDN families: ``q, k [B, n, H_k, d_k]``, ``v [B, n, H, d_v]``, ``beta``,
    ``g [B, n, H]``."""
    bsz, n = mixed_qkv.shape[:2]
    mixed_qkv = conv(mixed_qkv)
    q, k, v = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(bsz, n, -1, module.head_k_dim)
    k = k.reshape(bsz, n, -1, module.head_k_dim)
    v = v.reshape(bsz, n, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return q, k, v, beta, g


def _gdn_out(module: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Gated norm and output projection: ``core, z [B, n, H, d_v]`` -> ``[B, n, E]``."""
    bsz, n = core.shape[:2]
    out = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(bsz, n, -1))


def _gdn_tail(module: torch.nn.Module, ctx: Any, mixed_qkv, z, b, a) -> torch.Tensor:
    """Conv, the gated delta rule, gated norm and output projection shared by the GDN families; under
    ``ds_seqpar.prefill`` the layer's decoding state is kept (``delta_state.keep_state``)."""
    q, k, v, beta, g = _gdn_mixing(module, lambda x: _conv(module, ctx, x), mixed_qkv, b, a)
    core, share = _delta_scan(module, ctx, q, k, v, beta, g, keep=ctx.cache is not None)
    if share is not None:
        width = module.conv1d.kernel_size[0] - 1
        keep_state(ctx.cache, _layer(module, ctx), mixed_qkv, width, share)
    return _gdn_out(module, core, z)


def gdn_step(module: torch.nn.Module, ctx: Any, mixed_qkv, z, b, a) -> torch.Tensor:
    """One decoding token of a GDN layer (``[B, 1, ...]`` inputs) from its kept ``DeltaState``: HF's cached path
    (conv update, recurrent gated delta rule, gated norm, output); nothing communicated."""
    state = ctx.cache.states.get(_layer(module, ctx))
    if state is None:
        raise RuntimeError(
            f"ds_seqpar decoding: {type(module).__name__} (layer {_layer(module, ctx)}) kept no state at prefill "
            "(its decoder was registered after ds_seqpar.prefill ran); prefill again"
        )
    act = _family(module).ACT2FN[module.activation]
    q, k, v, beta, g = _gdn_mixing(module, lambda x: conv_step(state, x, module.conv1d, act), mixed_qkv, b, a)
    q, k = _qk(module, q, k, v.shape[2])
    core = delta_step(state, q, k, v, beta, g, q.shape[-1] ** -0.5)
    ctx.record(module)
    return _gdn_out(module, core.to(v.dtype), z)


def _qwen3_next_inputs(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's interleaved qkvz / ba projections -> ``mixed_qkv [B, n, C]``, ``z``, ``b``, ``a``."""
    q, k, v, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    return mixed, z, b, a


def _qwen3_5_inputs(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3.5's separate qkv / z / b / a projections -> ``mixed_qkv [B, n, C]``, ``z``, ``b``, ``a``."""
    bsz, n, _ = hidden_states.shape
    z = self.in_proj_z(hidden_states).reshape(bsz, n, -1, self.head_v_dim)
    return self.in_proj_qkv(hidden_states), z, self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)


def qwen3_next_gdn_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet.forward`` (interleaved qkvz / ba projections) with the sequence split."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    return _gdn_tail(self, ctx, *_qwen3_next_inputs(self, hidden_states))


def qwen3_next_gdn_step(self: torch.nn.Module, hidden_states: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet`` on one decoding token ``[B, 1, E]`` from its kept state."""
    return gdn_step(self, ctx, *_qwen3_next_inputs(self, hidden_states))


def qwen3_5_gdn_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` (separate qkv / z / b / a projections) with the sequence split."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    return _gdn_tail(self, ctx, *_qwen3_5_inputs(self, hidden_states))


def qwen3_5_gdn_step(self: torch.nn.Module, hidden_states: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet`` on one decoding token ``[B, 1, E]`` from its kept state."""
    return gdn_step(self, ctx, *_qwen3_5_inputs(self, hidden_states))


def kda_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``KimiLinearDeltaAttention.forward``: per-channel forget gate, delta rule, gated norm, output."""
    ctx = _context(self, kwargs, cache)
    hidden_states = _zero_padding(_real_tokens(ctx, hidden_states.shape[0]), hidden_states)
    bsz, n, _ = hidden_states.shape
    shape = (bsz, n, -1, self.head_dim)
    mixed = torch.cat(
        [self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1
    )
    mixed = _conv(self, ctx, mixed)
    q, k, v = (x.reshape(shape) for x in torch.split(mixed, [self.qkv_dim] * 3, dim=-1))
    g = self.forget_gate(hidden_states)
    beta = torch.sigmoid(self.b_proj(hidden_states))
    core = _delta_core(self, ctx, q, k, v, beta, g)
    gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(shape)
    return self.o_proj(self.o_norm(core, gate).reshape(bsz, n, -1))
