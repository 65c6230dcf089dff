"""Sequence-parallel forwards for the DeepSeek sparse attention (DSA) layers of HF models (docs/dsa.md).

A DSA layer is MLA (DeepSeek-V3's multi-head latent attention) plus a lightning indexer that keeps, per
query, the ``index_topk`` keys of highest index score. Each forward below mirrors the HF layer's training
path (no cache) step by step and keeps every weight of the module; what spans the sequence goes through
``parallel/topk_sparse.py``:

    MLA latent [B, n, kv_lora_rank + qk_rope_head_dim]   all-gathered with autograd, expanded to K / V
                                                          over the whole sequence by the module's kv_b_proj
    indexer key [B, n, index_head_dim]                    all-gathered without gradient (the indexer runs
                                                          under no_grad in transformers: it is not trained)
    top-k per local query                                 over the S global keys, as in one process
    attention                                             each local query over its selected visible keys

Registered per class in ``DSA_ADAPTERS`` (merged into the layer registry of ``recurrent_layers.py``).
The families differ only in the indexer's RoPE (half-split for DeepSeek-V3.2, interleaved for GLM-MoE-DSA)
and in GLM-MoE-DSA's cross-layer sharing (a ``"shared"`` layer reuses the previous layer's top-k).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.integrations.context import SeqParContext, current_context
from ds_seqpar.integrations.hf_attention import NEUTRAL_KEYWORDS
from ds_seqpar.integrations.hf_model import UnsupportedModelError, text_configs
from ds_seqpar.ops.sparse.topk import topk_attention
from ds_seqpar.parallel.topk_sparse import SequenceGather, dsa_select

__all__ = [
    "DSA_ADAPTERS",
    "axk2_forward",
    "deepseek_v32_forward",
    "glm_moe_dsa_forward",
    "refuse_unrouted_indexers",
]

_SEQ_KEY = "_ds_seqpar_dsa_sequence"  # the SequenceGather of the forward in progress, on its context


def _context(module: torch.nn.Module, kwargs: dict, cache: Any) -> SeqParContext:
    """The forward's context; refuses (by name, before any collective) a cache, dropout and keywords that
    would change the attention."""
    ctx = current_context(kwargs)
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if not isinstance(ctx, SeqParContext):
        raise RuntimeError(
            f"{name} runs under ds_seqpar without a ds_seqpar context; run the model through "
            "ds_seqpar.SeqParCausalLM / ds_seqpar.initialize, or disable_sequence_parallel(model)"
        )
    if cache is not None or kwargs.get("use_cache"):
        raise UnsupportedModelError(
            f"{name}: a KV cache is in use (generation); sequence-parallel DeepSeek sparse attention needs the "
            "whole sequence at once: pass use_cache=False, and generate with an unwrapped model"
        )
    if module.training and module.attention_dropout:
        raise UnsupportedModelError(
            f"{name}: attention dropout={module.attention_dropout} is not supported under sequence "
            "parallelism; set config.attention_dropout=0.0"
        )
    for key, value in kwargs.items():
        if key not in NEUTRAL_KEYWORDS and value is not None:
            raise UnsupportedModelError(
                f"{name} got {key}={value!r:.60}; the sequence-parallel DeepSeek sparse attention would ignore it"
            )
    return ctx


def _sequence(ctx: SeqParContext, hidden: torch.Tensor) -> SequenceGather:
    """The forward's ``SequenceGather`` (built once per forward, shared by its DSA layers)."""
    seq = ctx.__dict__.get(_SEQ_KEY)
    if seq is None or seq.q_pos.numel() != hidden.shape[1]:
        seq = SequenceGather(ctx.mesh, hidden.shape[1], ctx.doc_ids, hidden.device)
        ctx.__dict__[_SEQ_KEY] = seq
    return seq


def _indexer_inputs(indexer: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: Any,
                    rope: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The indexer's queries ``[B, n, H_i, D_i]``, keys ``[B, n, D_i]`` and head weights ``[B, n, H_i]`` (fp32)
    of this rank's tokens, as the HF indexer computes them (RoPE on the first qk_rope_head_dim channels)."""
    b, n, _ = hidden.shape
    rot = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, n, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rot, indexer.head_dim - rot], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # [B, n, 1, D_i]
    k_rot, k_pass = torch.split(k, [rot, indexer.head_dim - rot], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, weights * (indexer.n_heads**-0.5)


def _mla_queries(self: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """DeepSeek-V3.2 / GLM-MoE-DSA: ``(q_resid [B, n, q_lora_rank], queries [B, H, n, D], no gate)``."""
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
    return q_resid, self.q_b_proj(q_resid).view(*hidden.shape[:2], -1, self.qk_head_dim).transpose(1, 2), None


def _gated_queries(
    self: torch.nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AXK2: one fused projection of ``[q_resid, q_compressed]`` gives the queries ``[B, H, n, D]`` and the
    output gate ``[B, n, H·D_v]``."""
    b, n, _ = hidden.shape
    q_compressed = self.q_a_proj(hidden)
    q_resid = self.q_a_layernorm(q_compressed)
    fused = self.q_gate_proj(torch.cat([q_resid, q_compressed], dim=-1)).view(
        b, n, -1, self.qk_head_dim + self.v_head_dim
    )
    q_states, gate = torch.split(fused, [self.qk_head_dim, self.v_head_dim], dim=-1)
    return q_resid, q_states.transpose(1, 2), gate.reshape(b, n, -1)


def _dsa_forward(self: torch.nn.Module, hidden: torch.Tensor, cos_sin: Any, ctx: SeqParContext,
                 indexer_rope: Callable, shared: torch.Tensor | None,
                 queries: Callable = _mla_queries) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [B, n, hidden], selected key positions [B, n, K])`` of this rank's tokens ``hidden [B, n, E]``;
    ``queries(self, hidden)``: the family's ``(q_resid, queries, output gate or None)``."""
    family = sys.modules[type(self).__module__]
    b, n, _ = hidden.shape
    seq = _sequence(ctx, hidden)
    q_resid, q_states, gate = queries(self, hidden)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(
        self.kv_a_proj_with_mqa(hidden), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
    )
    k_pass = self.kv_a_layernorm(kv_pass).view(b, 1, n, self.kv_lora_rank)
    q_rot, k_rot = family.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, n, -1), *cos_sin)
    query = torch.cat((q_pass, q_rot), dim=-1).transpose(1, 2)  # [B, n, H, D]
    latent = seq.gather(torch.cat((k_pass, k_rot), dim=-1)[:, 0])  # [B, S, kv_lora_rank + rope]
    k_pass, k_rot = torch.split(latent.unsqueeze(1), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    key, value = self.expand_kv(k_pass, k_rot)  # [B, H, S, D], [B, H, S, D_v]
    if self.indexer is not None:
        with torch.no_grad():
            q_i, k_i, weights = _indexer_inputs(self.indexer, hidden, q_resid, cos_sin, indexer_rope)
        selected = dsa_select(seq, q_i, k_i, weights, self.indexer.softmax_scale, self.indexer.index_topk)
    elif shared is None:
        raise UnsupportedModelError(f"{type(self).__name__} (layer {self.layer_idx}): a shared DSA layer without a "
                                    "previous full indexer layer's top-k")  # fmt: skip
    else:
        selected = shared
    out = topk_attention(
        query, key.transpose(1, 2), value.transpose(1, 2), selected, seq.visible, self.scaling
    )
    ctx.record(self)
    out = out.reshape(b, n, -1)
    if gate is not None:  # AXK2: a sigmoid gate per output channel
        out = (out * torch.sigmoid(gate.float())).to(out.dtype)
    return self.o_proj(out), selected


def deepseek_v32_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """DeepSeek-V3.2 (and AXK2) DSA layer: half-split RoPE on the indexer."""
    ctx = _context(self, kwargs, cache)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    return _dsa_forward(self, hidden_states, position_embeddings, ctx, rope, None)[0], None


def axk2_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AXK2 DSA layer: DeepSeek-V3.2's, with a fused query + gate projection and a sigmoid output gate."""
    ctx = _context(self, kwargs, cache)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb
    return _dsa_forward(self, hidden_states, position_embeddings, ctx, rope, None, _gated_queries)[0], None


def glm_moe_dsa_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any = None,
    cache: Any = None,
    position_ids: Any = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None, torch.Tensor]:
    """GLM-MoE-DSA layer: interleaved RoPE on the indexer; a ``"shared"`` layer reuses ``prev_topk_indices``."""
    ctx = _context(self, kwargs, cache)
    rope = sys.modules[type(self).__module__].apply_rotary_pos_emb_interleave
    out, selected = _dsa_forward(self, hidden_states, position_embeddings, ctx, rope, prev_topk_indices)
    return out, None, selected


# transformers module, class name -> adapter forward
DSA_ADAPTERS: dict[tuple[str, str], Callable] = {
    ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Attention"): deepseek_v32_forward,
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaAttention"): glm_moe_dsa_forward,
    ("transformers.models.axk2.modeling_axk2", "AXK2Attention"): axk2_forward,
}

# model_type -> why its indexed attention is not routed (the structural reason, for the refusal)
UNROUTED_REASONS: dict[str, str] = {}


def refuse_unrouted_indexers(model: torch.nn.Module, adapter_for: Callable) -> None:
    """A config with ``index_topk`` (DeepSeek sparse attention) whose model has no layer routed through
    ``DSA_ADAPTERS``: raise naming the model and the reason (before any collective)."""
    routed = set(DSA_ADAPTERS.values())
    for config in text_configs(model):
        topk = getattr(config, "index_topk", None)
        if not topk or any(adapter_for(m) in routed for m in model.modules()):
            continue
        reason = UNROUTED_REASONS.get(getattr(config, "model_type", ""), "its indexed attention layer is not one of "
                                      f"the routed DSA layers ({', '.join(c for _, c in DSA_ADAPTERS)})")  # fmt: skip
        raise UnsupportedModelError(
            f"{type(model).__name__}: config.index_topk={topk} selects keys per query with a learned indexer "
            f"(DeepSeek sparse attention); {reason}: this model cannot run under ds_seqpar"
        )
