"""Attention layers whose own forward does something per token that depends on the whole sequence.

Most attention layers need nothing but the ``"ds_seqpar"`` attention implementation
(``integrations/hf_attention.py``). A few compute, before their attention call, a per-token quantity from
the token's index in the tensor they hold (Llama 4's query temperature on its NoPE layers); on a shard that
index is the local one. Each such class is one entry here: ``register_attention_layer(cls, forward)``; the
forward keeps every weight and step of the module and reads the GLOBAL index of its tokens from the
forward's ``SeqParContext``. Routed by ``enable_sequence_parallel`` (``integrations/routing.py``) with the
recurrent layers; entries resolve lazily, like the recurrent registry's.

    class (transformers 5.x)     what changes under SP
    Llama4TextAttention          attn_temperature_tuning: the query scale from each token's global index
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ds_seqpar.integrations.context import SeqParContext, current_context
from ds_seqpar.settings import input_layout

# transformers module, class name -> forward (resolved lazily into ATTENTION_LAYERS)
BUILTIN_ATTENTION_LAYERS: dict[tuple[str, str], Callable] = {}
ATTENTION_LAYERS: dict[type, Callable] = {}


def register_attention_layer(cls: type, forward: Callable) -> None:
    """Route every instance of ``cls`` through ``forward(self, hidden_states, ...)`` under ds_seqpar."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise TypeError(f"register_attention_layer takes an nn.Module subclass, got {cls!r}")
    ATTENTION_LAYERS[cls] = forward


def attention_layer_forward(module: torch.nn.Module) -> Callable | None:
    """The registered forward for ``module``'s class (or a base class), else None."""
    for (module_name, class_name), forward in BUILTIN_ATTENTION_LAYERS.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and cls not in ATTENTION_LAYERS:
            ATTENTION_LAYERS[cls] = forward
    for cls in type(module).__mro__:
        if cls in ATTENTION_LAYERS:
            return ATTENTION_LAYERS[cls]
    return None


def route_attention_layers(model: torch.nn.Module) -> int:
    """Give every registered attention layer of ``model`` its sequence-parallel forward; the number routed."""
    routed = 0
    for module in model.modules():
        forward = attention_layer_forward(module)
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            routed += 1
    return routed


def unroute_attention_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every routed attention layer."""
    for module in model.modules():
        if attention_layer_forward(module) is not None and "forward" in module.__dict__:
            del module.forward


def global_token_index(
    module: torch.nn.Module, kwargs: dict, tokens: int, device: torch.device
) -> torch.Tensor:
    """``[n]`` the index in the whole row of each of this rank's ``tokens`` tokens (the forward's layout);
    ``arange(n)`` when the layer runs outside ds_seqpar (no context, or a local-attention pass)."""
    ctx = current_context(kwargs)
    if not isinstance(ctx, SeqParContext) or ctx.local_attention is not None:
        return torch.arange(tokens, device=device)
    layout = input_layout(ctx.mesh, ctx.doc_ids)
    index = torch.arange(tokens * layout.world, device=device)
    return layout.shard(index, ctx.mesh.coords.sp_rank, dim=0)


def llama4_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``Llama4TextAttention.forward`` (training path) with the NoPE layers' query temperature
    ``1 + attn_scale · log1p(floor((i + 1) / floor_scale))`` taken at each token's GLOBAL index ``i``."""
    family = sys.modules[type(self).__module__]
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = self.q_proj(hidden_states).view(shape)
    key = self.k_proj(hidden_states).view(shape)
    value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    if self.use_rope:
        query, key = family.apply_rotary_emb(query, key, position_embeddings.to(query.device))
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        if cache is not None:
            raise RuntimeError(
                "Llama4TextAttention under ds_seqpar: a KV cache is in use (generation); pass use_cache=False, "
                "and generate with an unwrapped model"
            )
        index = global_token_index(self, kwargs, hidden_states.shape[1], hidden_states.device)
        scales = torch.log1p(torch.floor((index.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, -1, 1, 1)).to(query.dtype)
    interface = family.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, family.eager_attention_forward
    )
    out, weights = interface(
        self,
        query.transpose(1, 2),
        key.transpose(1, 2),
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


BUILTIN_ATTENTION_LAYERS[("transformers.models.llama4.modeling_llama4", "Llama4TextAttention")] = (
    llama4_attention_forward
)
