"""The recurrent layers that decode from the state the sharded prefill leaves: a registry of layer class ->
``RecurrentDecoder`` (docs/inference_recurrent.md).

A routed recurrent layer (``recurrent_layers.py``) with an entry keeps its decoding state in
``ShardedCache.states`` while ``ds_seqpar.prefill`` runs its adapter, and while ``cache.decoding`` its routed
forward dispatches to the entry's ``step`` (one token ``[B, 1, E]`` through the layer's own per-token math,
from the state replicated on every SP rank). A layer without one is refused by name before any collective
(``recurrent_state.refuse_undecodable_layers``).

    class (transformers 5.x)                                  state per layer, kept on every SP rank
    Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,             conv rows [B, C, K - 1] + recurrent state
    Qwen3_5MoeGatedDeltaNet, LaraMiniGatedDeltaNet,           [B, H_v, d_k, d_v] float32
    Qwen4ExpTextGatedDeltaNet
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.integrations import recurrent_adapters as adapters
from ds_seqpar.integrations.class_registry import registered_forward
from ds_seqpar.integrations.context import current_context
from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = [
    "RECURRENT_DECODERS",
    "RecurrentDecoder",
    "decoder_for",
    "register_recurrent_decoder",
    "with_decoding",
]


@dataclass(frozen=True)
class RecurrentDecoder:
    """``step(module, hidden_states [B, 1, E], ctx) -> [B, 1, E]`` (the layer's first argument, or its keyword
    ``hidden_states``): one decoding token from the layer's state in
    ``ctx.cache.states`` (which the layer's adapter keeps at prefill), advancing it; ``summary``: what is kept."""

    summary: str
    step: Callable[[torch.nn.Module, torch.Tensor, Any], torch.Tensor]


_GDN_STATE = "gated DeltaNet: conv rows [B, C, K-1] + recurrent state [B, H_v, d_k, d_v] fp32"
_QWEN3_5 = RecurrentDecoder(_GDN_STATE, adapters.qwen3_5_gdn_step)

# transformers module, class name -> decoder (resolved lazily into RECURRENT_DECODERS)
BUILTIN_DECODERS: dict[tuple[str, str], RecurrentDecoder] = {
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"): RecurrentDecoder(
        _GDN_STATE, adapters.qwen3_next_gdn_step
    ),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"): _QWEN3_5,
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"): _QWEN3_5,
    ("transformers.models.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet"): _QWEN3_5,
    ("transformers.models.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet"): _QWEN3_5,
}
RECURRENT_DECODERS: dict[type, RecurrentDecoder] = {}


def register_recurrent_decoder(cls: type, decoder: RecurrentDecoder) -> None:
    """Let every instance of the routed recurrent layer class ``cls`` decode through ``decoder``."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(f"register_recurrent_decoder takes an nn.Module subclass, got {cls!r}")
    RECURRENT_DECODERS[cls] = decoder


def decoder_for(module: torch.nn.Module) -> RecurrentDecoder | None:
    """The decoder registered for ``module``'s class (or a base class), else None."""
    return registered_forward(module, BUILTIN_DECODERS, RECURRENT_DECODERS)


def with_decoding(forward: Callable) -> Callable:
    """``forward`` (a routed adapter), dispatching to the layer's decoder's ``step`` while the context's cache
    decodes (looked up per call: a decoder registered after routing counts); without a decoder it raises."""

    @functools.wraps(forward)
    def routed(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        ctx = current_context(kwargs)
        if ctx is None or ctx.cache is None or not ctx.cache.decoding:
            return forward(self, *args, **kwargs)
        decoder = decoder_for(self)
        if decoder is None:
            raise UnsupportedModelError(
                f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}) has no decoding from a sharded "
                "cache (recurrent_decoders.RECURRENT_DECODERS); generate with the plain model"
            )
        return decoder.step(self, args[0] if args else kwargs["hidden_states"], ctx)

    return routed
