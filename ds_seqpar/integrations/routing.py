"""Switching a model's sequence mixing to ds_seqpar and back: its attention implementation (``"ds_seqpar"``,
selected for this model only with ``model.set_attn_implementation``; overriding ``"sdpa"`` process-wide
would change every other model in the process), its routed recurrent layers (``recurrent_layers.py``) and
its routed attention layers that compute scores themselves (``attention_layers.py``: ALiBi families).

The model's own code paths stay as they are: RoPE, sliding-window layers, GQA, per-layer types. HF builds
no 4-D mask for this implementation (``attention_mask`` is None).
"""

from __future__ import annotations

import torch

from ds_seqpar.integrations.attention_layers import route_attention_layers, unroute_attention_layers
from ds_seqpar.integrations.hf_attention import ATTN_IMPLEMENTATION, register_attention
from ds_seqpar.integrations.hf_model import UnsupportedModelError, unwrap_hf_model
from ds_seqpar.integrations.recurrent_layers import route_recurrent_layers, unroute_recurrent_layers

__all__ = ["disable_sequence_parallel", "enable_sequence_parallel"]


def enable_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model``'s attention to ``"ds_seqpar"``; remember the original to restore it.

    Raises an error naming the model class and its attention implementation when the model does
    not dispatch through transformers' attention interface. A PEFT wrapper is unwrapped to the HF
    model it adapts; the wrapper itself is returned.
    """
    wrapper, model = model, unwrap_hf_model(model)
    config = getattr(model, "config", None)
    original = getattr(config, "_attn_implementation", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a HuggingFace PreTrainedModel with a config; ds_seqpar routes the "
            "attention of transformers models (e.g. LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM)"
        )
    if original == ATTN_IMPLEMENTATION:
        return wrapper
    register_attention()
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(
            f"{type(model).__name__} (attn_implementation={original!r}) cannot route its attention through "
            f"ds_seqpar: transformers refused a custom attention implementation ({exc})"
        ) from exc
    model._ds_seqpar_original_attn = original
    route_recurrent_layers(model)
    route_attention_layers(model)
    return wrapper


def disable_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Restore the attention implementation the model had before ``enable_sequence_parallel``."""
    wrapper, model = model, unwrap_hf_model(model)
    original = getattr(model, "_ds_seqpar_original_attn", None)
    if original is not None:
        model.set_attn_implementation(original)
        del model._ds_seqpar_original_attn
    unroute_recurrent_layers(model)
    unroute_attention_layers(model)
    return wrapper
