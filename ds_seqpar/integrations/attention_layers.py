"""Route the softmax-attention layers that do not call transformers' attention interface: a registry of
layer class -> adapter forward (the attention counterpart of ``recurrent_layers.py``).

Most families compute attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, which
ds_seqpar replaces by its ``"ds_seqpar"`` implementation (``hf_attention.py``). A few compute their scores
themselves (or index their own tokens, Llama 4's NoPE temperature); their adapter keeps the module's own projections and output and hands q, k, v (and what the
family adds to the scores, e.g. ALiBi slopes) to the attention interface instead:

    class (transformers 5.x)    what the adapter passes                      module
    BloomAttention              alibi_slopes (BLOOM's), scaling 1/sqrt(D)    alibi_adapters.py
    MptAttention                alibi_slopes (read off MPT's position_bias)  alibi_adapters.py
    Llama4TextAttention         NoPE query temperature at global indices     llama4_adapters.py
    GPT-Neo, GPT, XGLM, GPT-NeoX-Japanese, Megatron-BERT, RemBERT, RoFormer,
    BigBird (original_full)
                                their own scale / window / rotary            inline_adapters.py

These families cannot switch ``config._attn_implementation`` (transformers keeps "eager" and warns), so a
routed layer holds the implementation it calls itself: the token-locality probe's while
``SeqParCausalLM`` probes the model (``check_token_locality`` then sees the adapted attention), then
``"ds_seqpar"`` from ``enable_sequence_parallel``; ``disable_sequence_parallel`` restores the family's own
forward.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.integrations import alibi_adapters as adapters
from ds_seqpar.integrations import inline_adapters as inline
from ds_seqpar.integrations.class_registry import registered_forward
from ds_seqpar.integrations.hf_attention import ATTN_IMPLEMENTATION
from ds_seqpar.integrations.hf_model import UnsupportedModelError, text_configs
from ds_seqpar.integrations.llama4_adapters import llama4_attention_forward

BUILTIN_ADAPTERS: dict[tuple[str, str], Callable] = {
    ("transformers.models.bloom.modeling_bloom", "BloomAttention"): adapters.bloom_forward,
    ("transformers.models.mpt.modeling_mpt", "MptAttention"): adapters.mpt_forward,
    ("transformers.models.llama4.modeling_llama4", "Llama4TextAttention"): llama4_attention_forward,
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoSelfAttention"): inline.gpt_neo_forward,
    ("transformers.models.openai.modeling_openai", "Attention"): inline.openai_gpt_forward,
    ("transformers.models.xglm.modeling_xglm", "XGLMAttention"): inline.xglm_forward,
    (
        "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese",
        "GPTNeoXJapaneseAttention",
    ): inline.gpt_neox_japanese_forward,
    (
        "transformers.models.megatron_bert.modeling_megatron_bert",
        "MegatronBertSelfAttention",
    ): inline.bert_self_attention_forward,
    (
        "transformers.models.rembert.modeling_rembert",
        "RemBertSelfAttention",
    ): inline.bert_self_attention_forward,
    ("transformers.models.roformer.modeling_roformer", "RoFormerSelfAttention"): inline.roformer_forward,
    (
        "transformers.models.big_bird.modeling_big_bird",
        "BigBirdSelfAttention",
    ): inline.bert_self_attention_forward,  # attention_type="original_full"
}
REGISTRY: dict[type, Callable] = {}
IMPL_ATTR = "_ds_seqpar_attention"  # on each routed layer: the name of the attention implementation it calls


def register_attention_layer(cls: type, forward: Callable) -> None:
    """Route every instance of ``cls`` through ``forward(self, attend, *args, **kwargs)`` while routed
    (``attend``: the attention interface function to call)."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(f"register_attention_layer takes an nn.Module subclass, got {cls!r}")
    REGISTRY[cls] = forward


def _adapter_for(module: torch.nn.Module) -> Callable | None:
    return registered_forward(module, BUILTIN_ADAPTERS, REGISTRY)


def refuse_unrouted_alibi(model: torch.nn.Module) -> None:
    """``config.alibi=True`` on a model none of whose layers this registry routes (Falcon's ALiBi variant):
    the family folds the bias into the attention mask it builds, which ds_seqpar does not receive; refused
    by name (before any collective)."""
    if not any(getattr(c, "alibi", False) is True for c in text_configs(model)):
        return
    if not any(_adapter_for(m) is not None for m in model.modules()):
        raise UnsupportedModelError(
            f"{type(model).__name__}: config.alibi=True adds ALiBi to the attention mask the model builds (Falcon: "
            "bf16(slope) · key position rounded to bfloat16, not linear in the position past 256 tokens), which "
            "ds_seqpar does not receive and cannot reproduce from global positions; this model cannot run under "
            "ds_seqpar (models with alibi=False, rotary positions, can)"
        )


def route_attention_layers(model: torch.nn.Module, implementation: str = ATTN_IMPLEMENTATION) -> int:
    """Give every registered attention layer of ``model`` its adapter forward, calling the attention
    implementation ``implementation`` (a name of transformers' registry); returns how many."""
    routed = 0
    for module in model.modules():
        forward = _adapter_for(module)
        if forward is not None:
            module.forward = types.MethodType(functools.partial(_routed, forward), module)
            module.__dict__[IMPL_ATTR] = implementation
            routed += 1
    return routed


def unroute_attention_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every routed attention layer."""
    for module in model.modules():
        if IMPL_ATTR in module.__dict__:
            module.__dict__.pop("forward", None)
            del module.__dict__[IMPL_ATTR]


def _routed(adapter: Callable, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return adapter(module, ALL_ATTENTION_FUNCTIONS[module.__dict__[IMPL_ATTR]], *args, **kwargs)
