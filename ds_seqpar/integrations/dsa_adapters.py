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

Registered per class in ``DSA_ADAPTERS`` (merged into the layer registry of ``recurrent_layers.py``):
DeepSeek-V3.2, GLM-MoE-DSA, AXK2, dots.3 (its ``indexed_attention`` layers) and HY-V4. What differs per
family (query projection and gate, latent normalisation, the indexer's RoPE and scaling, sinks) is a
``DsaFamily`` of ``dsa_families.py``; a ``"shared"`` layer (GLM-MoE-DSA, HY-V4) reuses the previous layer's
top-k. A model with ``config.index_topk`` and no routed layer is refused by name
(``refuse_unrouted_indexers``; DeepSeek-V4: compressed keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.integrations import dsa_families as families
from ds_seqpar.integrations.context import SeqParContext, current_context
from ds_seqpar.integrations.dsa_families import DsaFamily
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
            "whole sequence at once: pass use_cache=False, and generate with ds_seqpar.generate (docs/inference.md) or an unwrapped model"
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


def _dsa_forward(self: torch.nn.Module, hidden: torch.Tensor, cos_sin: Any, ctx: SeqParContext, family: DsaFamily,
                 shared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [B, n, E], selected key positions [B, n, K])`` of this rank's tokens ``hidden [B, n, E]``;
    ``shared``: the previous layer's selection, for a layer without an indexer (GLM-MoE-DSA ``"shared"``)."""
    seq = _sequence(ctx, hidden)
    q_resid, q_states, extra = family.queries(self, hidden)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    q_rot, k_pass, k_rot = family.latents(self, hidden, q_rot, cos_sin)
    query = torch.cat((q_pass, q_rot), dim=-1).transpose(1, 2)  # [B, n, H, D]
    latent = seq.gather(torch.cat((k_pass, k_rot), dim=-1)[:, 0])  # [B, S, kv_lora_rank + rope]
    k_pass, k_rot = torch.split(latent.unsqueeze(1), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    key, value = self.expand_kv(k_pass, k_rot)  # [B, H, S, D], [B, H, S, D_v]
    if self.indexer is not None:
        with torch.no_grad():
            q_i, k_i, weights, scale = family.indexer(self.indexer, hidden, q_resid, cos_sin)
        selected = dsa_select(seq, q_i, k_i, weights, scale, self.indexer.index_topk)
    elif shared is None:
        raise UnsupportedModelError(
            f"{type(self).__name__} (layer {self.layer_idx}): a shared DSA layer without a previous full indexer "
            "layer's top-k"
        )
    else:
        selected = shared
    sinks = self.sinks if family.sinks else None
    out = topk_attention(query, key.transpose(1, 2), value.transpose(1, 2), selected, seq.visible, self.scaling,
                         sinks=sinks)  # fmt: skip
    ctx.record(self)
    return self.o_proj(family.output(self, hidden, extra, out)), selected


def _forward(family: DsaFamily, shares: bool) -> Callable:
    """The adapter forward of a family: its layer's signature, ``(out, None)`` or, for families whose layers
    pass their top-k on (``shares``), ``(out, None, selected)``."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: Any,
                attention_mask: Any = None, cache: Any = None, position_ids: Any = None,
                prev_topk_indices: torch.Tensor | None = None, **kwargs: Any) -> tuple:  # fmt: skip
        ctx = _context(self, kwargs, cache)
        out, selected = _dsa_forward(self, hidden_states, position_embeddings, ctx, family, prev_topk_indices)
        return (out, None, selected) if shares else (out, None)

    return forward


def dots3_forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: Any,
                  attention_mask: Any = None, cache: Any = None, **kwargs: Any) -> tuple:  # fmt: skip
    """dots.3: an ``"indexed_attention"`` layer runs DSA; its full and sliding layers (no indexer) keep their
    own forward, which calls the ``"ds_seqpar"`` attention."""
    if self.indexer is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    kwargs.pop("position_ids", None)
    ctx = _context(self, kwargs, cache)
    return _dsa_forward(self, hidden_states, position_embeddings, ctx, families.DOTS3)[0], None


deepseek_v32_forward = _forward(families.DEEPSEEK_V32, shares=False)
axk2_forward = _forward(families.AXK2, shares=False)
glm_moe_dsa_forward = _forward(families.GLM_MOE_DSA, shares=True)
hy_v4_forward = _forward(families.HY_V4, shares=True)


# transformers module, class name -> adapter forward
DSA_ADAPTERS: dict[tuple[str, str], Callable] = {
    ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Attention"): deepseek_v32_forward,
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaAttention"): glm_moe_dsa_forward,
    ("transformers.models.axk2.modeling_axk2", "AXK2Attention"): axk2_forward,
    ("transformers.models.dots3_note.modeling_dots3_note", "Dots3NoteTextAttention"): dots3_forward,
    ("transformers.models.hy_v4.modeling_hy_v4", "HYV4Attention"): hy_v4_forward,
}

# model_type -> why its indexed attention is not routed (the structural reason, for the refusal)
UNROUTED_REASONS: dict[str, str] = {
    "deepseek_v4": (
        "its compressed attention layers (compressed_sparse_attention, heavily_compressed_attention) attend to a "
        "sliding window plus keys that a learned compressor makes from windows of compress_rates tokens, and its "
        "indexer (index_topk={topk}) selects among those compressed keys; ds_seqpar's DeepSeek sparse attention "
        "gathers one key per token and does not split a compressor over the sequence (docs/dsa.md)"
    ),
}


def refuse_unrouted_indexers(model: torch.nn.Module, adapter_for: Callable) -> None:
    """A config with ``index_topk`` (DeepSeek sparse attention) whose model has no layer routed through
    ``DSA_ADAPTERS``: raise naming the model and the reason (before any collective)."""
    if getattr(model, "config", None) is None:  # not a transformers model: no DSA config
        return
    routed = set(DSA_ADAPTERS.values())
    for config in text_configs(model):
        topk = getattr(config, "index_topk", None)
        if not topk or any(adapter_for(m) in routed for m in model.modules()):
            continue
        layers = ", ".join(c for _, c in DSA_ADAPTERS)
        reason = UNROUTED_REASONS.get(
            getattr(config, "model_type", ""),
            "config.index_topk={topk} selects keys per query with a learned indexer (DeepSeek sparse attention) in "
            f"a layer that is not one of the routed DSA layers ({layers})",
        )
        raise UnsupportedModelError(
            f"{type(model).__name__}: {reason.format(topk=topk)}: this model cannot run under ds_seqpar"
        )
