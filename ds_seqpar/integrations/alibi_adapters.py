"""Adapter forwards of the ALiBi attention layers (BLOOM, MPT), registered in ``attention_layers.py``.

Both families add a per-head linear bias to the scores themselves instead of calling the attention
interface: BLOOM ``slope_h · j`` (j = the key's position among the non-padding tokens), MPT
``slope_h · (j - (L - 1))`` from a table over ``config.max_seq_len``. Under the softmax both equal
``slope_h · (j - i)`` (the difference is constant along a row), which is what ds_seqpar's kernels add
from GLOBAL positions (docs/kernels.md "ALiBi"). Each adapter keeps the module's own projections,
dropout and output, and passes q, k, v ``[B, H, n, D]`` with ``alibi_slopes`` ``[H]`` to the attention
interface function ``attend`` the registry gives (outside ds_seqpar the family's own forward runs).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError


def bloom_forward(
    self: torch.nn.Module,
    attend: Any,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
):
    """``BloomAttention.forward`` through the attention interface: hidden ``[B, n, E]`` -> ``(out, None)``.
    BLOOM's bias is ``slope_h · j`` with its own slopes (``_get_alibi_slopes``); ``beta`` is 1."""
    from transformers.models.bloom import modeling_bloom as bloom

    if self.beta != 1.0:
        raise UnsupportedModelError(
            f"BloomAttention (layer {self.layer_idx}): beta={self.beta} scales the ALiBi bias"
        )
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # [B, H, n, D] each
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    slopes = bloom._get_alibi_slopes(self.num_heads, q.device)
    out, _ = attend(
        self, q, k, v, None, dropout=self.attention_dropout.p if self.training else 0.0,
        scaling=self.inv_norm_factor, alibi_slopes=slopes, is_causal=True,
    )  # fmt: skip
    out = self.dense(out.reshape(*hidden_states.shape[:2], -1))
    return bloom.dropout_add(out, residual, self.hidden_dropout, self.training), None


def _mpt_slopes(name: str, position_bias: torch.Tensor) -> torch.Tensor:
    """MPT's slopes ``[H]`` read off its bias table ``[H, 1, L]`` = ``slope_h · (j - (L - 1))``; refused
    unless the table is exactly that linear form."""
    if position_bias is None or position_bias.dim() != 3 or position_bias.shape[-1] < 2:
        got = None if position_bias is None else tuple(position_bias.shape)
        raise UnsupportedModelError(f"{name}: position_bias {got} is not MPT's ALiBi table [H, 1, L]")
    table = position_bias[:, -1].float()  # [H, L]
    slopes = table[:, -1] - table[:, -2]
    length = table.shape[-1]
    steps = torch.arange(1 - length, 1, device=table.device, dtype=torch.int32)
    if not torch.allclose(table, steps * slopes[:, None], rtol=1e-6, atol=0.0):
        raise UnsupportedModelError(
            f"{name}: position_bias is not a per-head linear (ALiBi) bias of the key position; ds_seqpar applies "
            "ALiBi from global positions and cannot honour another bias table"
        )
    return slopes


def mpt_forward(
    self: torch.nn.Module,
    attend: Any,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
):
    """``MptAttention.forward`` through the attention interface: hidden ``[B, n, E]`` -> ``(out, None)``."""
    b, n = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(b, n, self.n_heads, self.head_dim).transpose(1, 2) for x in qkv.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    slopes = _mpt_slopes(f"MptAttention (layer {self.layer_idx})", position_bias)
    out, _ = attend(
        self, q, k, v, None, dropout=self.attn_dropout_p if self.training else 0.0,
        scaling=self.softmax_scale, alibi_slopes=slopes, is_causal=True,
    )  # fmt: skip
    return self.out_proj(out.reshape(b, n, -1)), None
