"""Llama 4's attention under sequence parallelism: the NoPE layers' query temperature at GLOBAL indices.

Llama 4 scales each query of its NoPE layers (``attn_temperature_tuning``) by
``1 + attn_scale · log1p(floor((i + 1) / floor_scale))``, with i the token's index in the tensor the layer
holds. On a shard that is the local index; the routed forward (``attention_layers.py``) keeps every step
of ``Llama4TextAttention.forward`` and takes i from the batch's layout instead. Nothing is communicated.
Below ``floor_scale`` tokens (8192 in the released models) every scale is 1, which is why the token-locality
probe cannot see the difference and the layer is routed by class. Its chunked layers need nothing here:
the chunk is read per layer by the ``"ds_seqpar"`` attention (``hf_attention.layer_chunk``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ds_seqpar.integrations.context import SeqParContext, current_context
from ds_seqpar.settings import input_layout


def global_token_index(kwargs: dict, tokens: int, device: torch.device) -> torch.Tensor:
    """``[n]`` the index in the whole row of each of this rank's ``tokens`` tokens (the forward's layout);
    ``arange(n)`` outside a ds_seqpar forward (the one-process probe, a local-attention pass)."""
    ctx = current_context(kwargs)
    if not isinstance(ctx, SeqParContext) or ctx.local_attention is not None:
        return torch.arange(tokens, device=device)
    layout = input_layout(ctx.mesh, ctx.doc_ids)
    return layout.shard(torch.arange(tokens * layout.world, device=device), ctx.mesh.coords.sp_rank, dim=0)


def llama4_attention_forward(
    self: torch.nn.Module,
    attend: Any,
    hidden_states: torch.Tensor,
    position_embeddings: Any,
    attention_mask: Any,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``Llama4TextAttention.forward`` (no cache) through ``attend``: hidden ``[B, n, E]`` -> ``(out, weights)``."""
    if cache is not None:
        raise RuntimeError(
            "Llama4TextAttention under ds_seqpar: a KV cache is in use (generation); pass use_cache=False, and "
            "generate with ds_seqpar.generate (docs/inference.md) or an unwrapped model"
        )
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
        index = global_token_index(kwargs, hidden_states.shape[1], hidden_states.device)
        scales = torch.log1p(torch.floor((index.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, -1, 1, 1)).to(query.dtype)
    out, weights = attend(
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
