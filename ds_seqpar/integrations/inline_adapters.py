"""Adapter forwards of attention layers that compute their scores inline, registered in ``attention_layers.py``.

GPT-Neo, GPT (openai-gpt), XGLM, GPT-NeoX-Japanese, Megatron-BERT, RemBERT and RoFormer multiply q by k
themselves instead of calling transformers' attention interface. Each adapter keeps the module's own
projections, rotary code, head split/merge, output projection and return convention, and hands q, k, v
``[B, H, n, D]`` to the attention interface function ``attend`` with the family's exact score scale (see
docs/integration.md "Routed attention layers"):

    family              scale of q·k            positions                      causal / window
    GPT-Neo             1 (no 1/sqrt(D))        learned, from position_ids     local layers: window_size
    GPT                 1/sqrt(D) or 1          learned, from position_ids     causal
    XGLM                q pre-scaled 1/sqrt(D)  sinusoidal + 2, position_ids   causal
    GPT-NeoX-Japanese   1/sqrt(D)               rotary from position_ids       causal
    Megatron-BERT/RemBERT 1/sqrt(D)             learned, from position_ids     causal iff is_decoder
    BigBird (original_full) likewise (its block-sparse attention is refused, see REFUSED_LAYERS)
    RoFormer            1/sqrt(D)               rotary at GLOBAL token index   causal iff is_decoder

GPT-Neo's local mask lets query i see key j iff 0 <= i - j < window_size, which is the ``sliding_window``
convention of the ds_seqpar attention (applied from global positions). Nothing is communicated here.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.llama4_adapters import global_token_index


def _dropout(self: torch.nn.Module, p: float) -> float:
    return float(p) if self.training else 0.0


def _merge(out: torch.Tensor) -> torch.Tensor:
    """Interface output ``[B, n, H, D]`` -> ``[B, n, H·D]``."""
    return out.reshape(*out.shape[:2], -1)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, n, H·D]`` -> ``[B, H, n, D]``."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def gpt_neo_forward(
    self: torch.nn.Module, attend: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
    layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False, **kwargs: Any,
):  # fmt: skip
    """``GPTNeoSelfAttention.forward``: hidden ``[B, n, E]`` -> ``(out, None)``; unscaled scores, local layers
    pass ``config.window_size`` as the sliding window."""
    q, k, v = (_heads(p(hidden_states), self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_id)
    window = int(self.config.window_size) if self.attention_type == "local" else None
    out, _ = attend(
        self, q, k, v, None, dropout=_dropout(self, self.attn_dropout.p), scaling=1.0,
        sliding_window=window, is_causal=True,
    )  # fmt: skip
    return self.resid_dropout(self.out_proj(_merge(out))), None


def openai_gpt_forward(
    self: torch.nn.Module, attend: Any, x: torch.Tensor, attention_mask: Any = None,
    output_attentions: bool = False, **kwargs: Any,
):  # fmt: skip
    """GPT's ``Attention.forward``: hidden ``[B, n, E]`` -> ``[out]``; scale 1/sqrt(D) when ``self.scale``."""
    query, key, value = self.c_attn(x).split(self.split_size, dim=2)
    head_dim = self.split_size // self.n_head
    q, k, v = (_heads(t, head_dim) for t in (query, key, value))
    scaling = head_dim**-0.5 if self.scale else 1.0
    out, _ = attend(
        self, q, k, v, None, dropout=_dropout(self, self.attn_dropout.p), scaling=scaling, is_causal=True
    )
    return [self.resid_dropout(self.c_proj(_merge(out)))]


def xglm_forward(
    self: torch.nn.Module, attend: Any, hidden_states: torch.Tensor, key_value_states: Any = None,
    cache: Any = None, attention_mask: Any = None, **kwargs: Any,
):  # fmt: skip
    """``XGLMAttention.forward`` (self-attention): hidden ``[B, n, E]`` -> ``(out, None)``; q is scaled by
    1/sqrt(D) before the product (as XGLM does), so the interface gets ``scaling=1``."""
    if key_value_states is not None:
        raise UnsupportedModelError(
            f"XGLMAttention (layer {self.layer_idx}): cross-attention over encoder states is not routed by ds_seqpar"
        )
    q = _heads(self.q_proj(hidden_states) * self.scaling, self.head_dim)
    k, v = (
        _heads(self.k_proj(hidden_states), self.head_dim),
        _heads(self.v_proj(hidden_states), self.head_dim),
    )
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    out, _ = attend(self, q, k, v, None, dropout=_dropout(self, self.dropout), scaling=1.0, is_causal=True)
    return self.out_proj(_merge(out)), None


def gpt_neox_japanese_forward(
    self: torch.nn.Module, attend: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
    position_ids: Any = None, layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
    position_embeddings: Any = None, **kwargs: Any,
):  # fmt: skip
    """``GPTNeoXJapaneseAttention.forward``: hidden ``[B, n, E]`` -> ``(out, None, dense_bias)``; the rotary
    ``(cos, sin)`` come from the model's (global) position ids."""
    family = sys.modules[type(self).__module__]
    d, r = self.head_size, self.rotary_ndims
    qkv = self.query_key_value(hidden_states).view(*hidden_states.shape[:2], self.num_attention_heads, 3 * d)
    q, k, v = (qkv[..., i * d : (i + 1) * d].permute(0, 2, 1, 3) for i in range(3))
    cos, sin = position_embeddings
    q_rot, k_rot = family.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    out, _ = attend(
        self, q, k, v, None, dropout=_dropout(self, self.attention_dropout.p), scaling=1.0 / self.norm_factor,
        is_causal=True,
    )  # fmt: skip
    return self.dense(_merge(out)), None, self.dense_bias


def _bert_qkv(self: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: Any, cache: Any):
    """BERT-style separate ``query``/``key``/``value`` projections -> q, k, v ``[B, H, n, D]``."""
    if encoder_hidden_states is not None:
        raise UnsupportedModelError(
            f"{type(self).__name__}: cross-attention over encoder states is not routed by ds_seqpar"
        )
    d = self.attention_head_size
    return tuple(_heads(p(hidden_states), d) for p in (self.query, self.key, self.value))


def _bert_attend(self: torch.nn.Module, attend: Any, q, k, v, cache: Any) -> tuple[torch.Tensor, None]:
    """The BERT-style layers' attention call on ``[B, H, n, D]`` q, k, v: ``1/sqrt(D)`` scaling, causal iff
    ``config.is_decoder``; ``(context [B, n, E], None)``."""
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    out, _ = attend(
        self, q, k, v, None, dropout=_dropout(self, self.dropout.p), scaling=self.attention_head_size**-0.5,
        is_causal=bool(self.is_decoder),
    )  # fmt: skip
    return _merge(out), None


def bert_self_attention_forward(
    self: torch.nn.Module, attend: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
    encoder_hidden_states: Any = None, cache: Any = None, output_attentions: bool = False, **kwargs: Any,
):  # fmt: skip
    """``MegatronBertSelfAttention`` / ``RemBertSelfAttention`` / ``BigBirdSelfAttention.forward``: hidden ``[B, n, E]`` ->
    ``(context [B, n, E], None)``; causal iff ``config.is_decoder``."""
    q, k, v = _bert_qkv(self, hidden_states, encoder_hidden_states, cache)
    return _bert_attend(self, attend, q, k, v, cache)


@functools.lru_cache(maxsize=8)
def _roformer_table(module_name: str, positions: int, dim: int) -> torch.Tensor:
    """RoFormer's sinusoid table ``[positions, dim]``, made by the family's own ``create_weight``."""
    family = sys.modules[module_name]
    return family.RoFormerSinusoidalPositionalEmbedding(positions, dim).create_weight()


def _roformer_global_sinusoid(
    self: torch.nn.Module, sinusoidal_pos: torch.Tensor, kwargs: dict
) -> torch.Tensor:
    """``[1, 1, n, D]`` the sinusoid rows at this rank's GLOBAL token indices: RoFormer computes them from
    ``arange(n)`` of the tensor it holds (it ignores position_ids), i.e. local indices on a shard."""
    n, dim = sinusoidal_pos.shape[-2:]
    index = global_token_index(kwargs, n, sinusoidal_pos.device)
    size = 1 << max(int(index.max()) + 1, n).bit_length()  # >= every index, a power of two: few tables
    table = _roformer_table(type(self).__module__, size, dim)
    table = table.to(device=sinusoidal_pos.device, dtype=sinusoidal_pos.dtype)
    if not torch.equal(table[:n], sinusoidal_pos.reshape(n, dim)):
        raise UnsupportedModelError(
            f"{type(self).__name__}: sinusoidal_pos is not RoFormer's sinusoid table at positions 0..n-1; ds_seqpar "
            "recomputes it at global positions and cannot honour another table"
        )
    return table[index].view(1, 1, n, dim)


def roformer_forward(
    self: torch.nn.Module, attend: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
    sinusoidal_pos: Any = None, encoder_hidden_states: Any = None, cache: Any = None,
    output_attentions: bool = False, **kwargs: Any,
):  # fmt: skip
    """``RoFormerSelfAttention.forward``: hidden ``[B, n, E]`` -> ``(context [B, n, E], None)``; rotary on q, k
    (and v with ``config.rotary_value``) at global token indices; causal iff ``config.is_decoder``."""
    q, k, v = _bert_qkv(self, hidden_states, encoder_hidden_states, cache)
    if sinusoidal_pos is not None:
        pos = _roformer_global_sinusoid(self, sinusoidal_pos, kwargs)
        if self.rotary_value:
            q, k, v = self.apply_rotary_position_embeddings(pos, q, k, v)
        else:
            q, k = self.apply_rotary_position_embeddings(pos, q, k)
    return _bert_attend(self, attend, q, k, v, cache)


# Inline attention layers that no adapter can express exactly: refused by class, naming the structural cause.
REFUSED_LAYERS: dict[tuple[str, str], str] = {
    ("transformers.models.big_bird.modeling_big_bird", "BigBirdBlockSparseAttention"): (
        "block-sparse attention (config.attention_type='block_sparse'): each query block sees the global first and "
        "last blocks, a band of 3 blocks and config.num_random_blocks key blocks drawn at random over the whole "
        "sequence, and transformers falls back to full attention when the length it receives is below "
        "(5 + 2·num_random_blocks)·block_size, a choice each rank would make on its shard; ds_seqpar's kernels have "
        "no random block pattern (set attention_type='original_full' for full attention)"
    ),
    ("transformers.models.reformer.modeling_reformer", "LSHSelfAttention"): (
        "LSH self-attention: tokens are hashed into buckets by random rotations and attend within sorted chunks "
        "of the whole sequence, which ds_seqpar does not split over the sequence"
    ),
    ("transformers.models.reformer.modeling_reformer", "LocalSelfAttention"): (
        "local self-attention over fixed chunks of config.local_attn_chunk_length tokens plus "
        "local_num_chunks_before/after neighbouring chunks, aligned to the chunk grid of the tensor the layer "
        "holds (not a sliding window of global positions), which ds_seqpar's kernels do not express"
    ),
}


def refuse_unroutable_layers(model: torch.nn.Module) -> None:
    """A layer of :data:`REFUSED_LAYERS` in ``model``: raise naming the class and its reason (before any
    collective)."""
    for module in model.modules():
        cls = type(module)
        reason = REFUSED_LAYERS.get((cls.__module__, cls.__name__))
        if reason is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: {cls.__name__} computes {reason}; this model cannot run under ds_seqpar"
            )
