"""The per-family steps of the DSA layers routed by ``dsa_adapters.py``: each mirrors, per token, what the HF
layer computes (same operations, same order), so only the sequence-spanning part changes (docs/dsa.md).

A ``DsaFamily`` is four steps on this rank's tokens (``hidden [B, n, E]``):

    queries(attn, hidden)                 -> (q_resid [B, n, q_lora_rank], queries [B, H, n, D], extra)
    latents(attn, hidden, q_rot, cos_sin) -> (q_rot roped, k_pass [B, 1, n, kv_lora_rank], k_rot roped
                                              [B, 1, n, qk_rope_head_dim])
    indexer(idx, hidden, q_resid, cos_sin) -> (q [B, n, H_i, D_i], k [B, n, D_i], weights [B, n, H_i] fp32,
                                               scale of the per-head scores)
    output(attn, hidden, extra, out [B, n, H, D_v]) -> [B, n, H·D_v] (an output gate, if any)

and ``sinks``: whether the layer's ``sinks`` parameter (one logit per head) joins the softmax.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def _module_of(obj: Any) -> Any:
    """The object's transformers modeling module (its RoPE helpers)."""
    return sys.modules[type(obj).__module__]


@dataclass(frozen=True)
class DsaFamily:
    queries: Callable
    latents: Callable
    indexer: Callable
    output: Callable
    sinks: bool = False


# -- queries --------------------------------------------------------------------------------------------


def mla_queries(attn: torch.nn.Module, hidden: torch.Tensor, lora_scale: float | None = None) -> tuple:
    """MLA queries; ``lora_scale`` (dots.3): the normalised query latent is rescaled first."""
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    if lora_scale is not None:
        q_resid = q_resid * lora_scale
    return q_resid, attn.q_b_proj(q_resid).view(*hidden.shape[:2], -1, attn.qk_head_dim).transpose(1, 2), None


def dots_queries(attn: torch.nn.Module, hidden: torch.Tensor) -> tuple:
    return mla_queries(attn, hidden, attn.q_lora_scale)


def hy_queries(attn: torch.nn.Module, hidden: torch.Tensor) -> tuple:
    """HY-V4: MLA queries and a per-head output gate ``[B, n, H, D_v]`` from ``gate_proj``."""
    gate = attn.gate_proj(hidden).view(*hidden.shape[:2], -1, attn.gate_projection_size)
    return (*mla_queries(attn, hidden)[:2], gate)


def axk2_queries(attn: torch.nn.Module, hidden: torch.Tensor) -> tuple:
    """AXK2: one fused projection of ``[q_resid, q_compressed]`` gives the queries and the gate ``[B, n, H·D_v]``."""
    b, n, _ = hidden.shape
    q_compressed = attn.q_a_proj(hidden)
    q_resid = attn.q_a_layernorm(q_compressed)
    fused = attn.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1))
    fused = fused.view(b, n, -1, attn.qk_head_dim + attn.v_head_dim)
    q_states, gate = torch.split(fused, [attn.qk_head_dim, attn.v_head_dim], dim=-1)
    return q_resid, q_states.transpose(1, 2), gate.reshape(b, n, -1)


# -- the MLA latent -------------------------------------------------------------------------------------


def mla_latents(attn: torch.nn.Module, hidden: torch.Tensor, q_rot: torch.Tensor, cos_sin: Any) -> tuple:
    """The normalised KV latent and the shared RoPE key (interleaved RoPE, as the query's rope part)."""
    b, n, _ = hidden.shape
    kv_pass, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    k_pass = attn.kv_a_layernorm(kv_pass).view(b, 1, n, attn.kv_lora_rank)
    q_rot, k_rot = _module_of(attn).apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, n, -1), *cos_sin)
    return q_rot, k_pass, k_rot


def dots_latents(attn: torch.nn.Module, hidden: torch.Tensor, q_rot: torch.Tensor, cos_sin: Any) -> tuple:
    """dots.3: the latent rescaled, the RoPE key normalised before RoPE, dtypes kept."""
    b, n, _ = hidden.shape
    kv_pass, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    k_pass = attn.kv_a_layernorm(kv_pass.contiguous()).view(b, 1, n, attn.kv_lora_rank) * attn.kv_lora_scale
    k_rot = attn.k_rope_only_layernorm(k_rot.view(b, 1, n, attn.qk_rope_head_dim))
    q_dtype, k_dtype = q_rot.dtype, k_rot.dtype
    q_rot, k_rot = _module_of(attn).apply_rotary_pos_emb_interleave(q_rot, k_rot, *cos_sin)
    return q_rot.to(q_dtype), k_pass, k_rot.to(k_dtype)


# -- the indexer ----------------------------------------------------------------------------------------


def _indexer(
    idx: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any, rope: str
) -> tuple:
    """DeepSeek-V3.2 / GLM-MoE-DSA indexer: RoPE (``rope``: the modeling module's function) on the first
    qk_rope_head_dim channels of q and k; scores scaled per head by ``softmax_scale``."""
    b, n, _ = hidden.shape
    rot, rest = idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim
    q_rot, q_pass = torch.split(idx.wq_b(q_resid).view(b, n, idx.n_heads, idx.head_dim), [rot, rest], dim=-1)
    k_rot, k_pass = torch.split(idx.k_norm(idx.wk(hidden)).unsqueeze(2), [rot, rest], dim=-1)
    q_rot, k_rot = getattr(_module_of(idx), rope)(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = idx.weights_proj(hidden.to(idx.weights_proj.weight.dtype)).float() * (idx.n_heads**-0.5)
    return q, k, weights, idx.softmax_scale


def half_split_indexer(
    idx: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any
) -> tuple:
    return _indexer(idx, hidden, q_resid, cos_sin, "apply_rotary_pos_emb")


def interleaved_indexer(
    idx: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any
) -> tuple:
    return _indexer(idx, hidden, q_resid, cos_sin, "apply_rotary_pos_emb_interleave")


def hy_indexer(idx: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any) -> tuple:
    """HY-V4 indexer: interleaved RoPE on the LAST qk_rope_head_dim channels, the key norm in its own dtype,
    ``softmax_scale`` folded into the head weights (per-head scores unscaled: scale 1.0)."""
    b, n, _ = hidden.shape
    rot, rest = idx.qk_rope_head_dim, idx.head_dim - idx.qk_rope_head_dim
    q_pass, q_rot = torch.split(idx.wq_b(q_resid).view(b, n, idx.n_heads, idx.head_dim), [rest, rot], dim=-1)
    k = idx.k_norm(idx.wk(hidden).to(idx.k_norm.weight.dtype)).to(hidden.dtype).unsqueeze(2)
    k_pass, k_rot = torch.split(k, [rest, rot], dim=-1)
    q_rot, k_rot = _module_of(idx).apply_rotary_pos_emb_interleave(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q, k = torch.cat([q_pass, q_rot], dim=-1), torch.cat([k_pass, k_rot], dim=-1).squeeze(2)
    weights = idx.weights_proj(hidden.to(idx.weights_proj.weight.dtype)).float() * (idx.n_heads**-0.5)
    return q, k, weights * idx.softmax_scale, 1.0


# -- the output -----------------------------------------------------------------------------------------


def plain_output(attn: torch.nn.Module, hidden: torch.Tensor, extra: Any, out: torch.Tensor) -> torch.Tensor:
    return out.reshape(*out.shape[:2], -1)


def axk2_output(
    attn: torch.nn.Module, hidden: torch.Tensor, gate: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """AXK2: a sigmoid gate per output channel (computed in fp32)."""
    out = out.reshape(*out.shape[:2], -1)
    return (out * torch.sigmoid(gate.float())).to(out.dtype)


def dots_output(attn: torch.nn.Module, hidden: torch.Tensor, extra: Any, out: torch.Tensor) -> torch.Tensor:
    """dots.3: a sigmoid gate per head from ``g_proj``."""
    gate = attn.g_proj(hidden).view(*hidden.shape[:2], -1, 1)
    return (out * gate.sigmoid()).reshape(*out.shape[:2], -1)


def hy_output(
    attn: torch.nn.Module, hidden: torch.Tensor, gate: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """HY-V4: a sigmoid gate per head and value channel."""
    return (out * torch.sigmoid(gate)).reshape(*out.shape[:2], -1)


DEEPSEEK_V32 = DsaFamily(mla_queries, mla_latents, half_split_indexer, plain_output)
GLM_MOE_DSA = DsaFamily(mla_queries, mla_latents, interleaved_indexer, plain_output)
AXK2 = DsaFamily(axk2_queries, mla_latents, half_split_indexer, axk2_output)
DOTS3 = DsaFamily(dots_queries, dots_latents, interleaved_indexer, dots_output)
HY_V4 = DsaFamily(hy_queries, mla_latents, hy_indexer, hy_output, sinks=True)
