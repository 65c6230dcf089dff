"""The ``"ds_seqpar"`` attention implementation that transformers calls from every attention layer.

transformers 5.x calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, dropout=..., scaling=..., **kwargs)`` from every attention layer, with query
``[B, H, n, D]``, key/value ``[B, H_kv, n, D]`` (RoPE applied, K/V heads not repeated) and the model's
forward kwargs passed through (``position_ids``, ``sliding_window`` for sliding layers, ...).

``seqpar_attention_forward`` honours the keywords that change the result (``scaling``,
``sliding_window``, ``softcap``, ``s_aux``, ``alibi_slopes`` (passed by the ALiBi adapters of
``attention_layers.py``), ``is_causal``, ``dropout`` only 0) and refuses by name every
other keyword whose value would, and any explicit ``attention_mask`` (masks come from global positions
and the ``doc_ids`` of the batch), before any collective. Calls without a ds_seqpar context, with dropout,
or with an HF KV cache (q_len != k_len) raise a clear error instead of computing something wrong. Under
``ds_seqpar.prefill`` (``ctx.cache``) every call also stores this rank's K/V in the sharded cache; during a
decoding step the call goes to ``decode.decode_attention`` (docs/inference.md). Cross-attention calls
(encoder-decoders) go to ``ds_seqpar.cross_attention``. Image blocks (``ctx.blocks``, Gemma 3's bidirectional image
tokens) go to the exact self-attention as ``blocks=``; a decoding step, cross-attention and an approximate prefill
refuse them by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.context import CONTEXT_KEY, SeqParContext, current_context
from ds_seqpar.integrations.decode import decode_attention
from ds_seqpar.integrations.hf_model import WINDOW_FROM_CONFIG, UnsupportedModelError
from ds_seqpar.parallel.cross import cross_attention
from ds_seqpar.parallel.usp import attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FEED_FORWARD_LAYER_TYPES",
    "HONOURED_KEYWORDS",
    "NEUTRAL_KEYWORDS",
    "register_attention",
    "seqpar_attention_forward",
]

ATTN_IMPLEMENTATION = "ds_seqpar"
_UNSET: Any = object()  # a keyword the attention layer did not pass


# Keywords of transformers' attention interface that ds_seqpar honours (values checked below) and
# keywords that never change the result (positions are already in q/k through RoPE; the cache is
# refused through q_len != k_len; attention weights are not returned).
FEED_FORWARD_LAYER_TYPES = frozenset({"mlp", "moe"})  # config.layer_types entries without sequence mixing
HONOURED_KEYWORDS = ("dropout", "scaling", "sliding_window", "softcap", "s_aux", "alibi_slopes", "is_causal")
# Keywords refused with the structural reason why ds_seqpar cannot honour them (else a generic refusal).
REFUSED_KEYWORDS = {
    "position_bias": (
        "an additive [B, H, S, S] score bias the layer computes over its local tokens (a relative position bias, "
        "e.g. Inkling2's, learned and conditioned on each query's hidden states over distances 0..rel_extent-1). "
        "ds_seqpar builds no [S, S] tensor; honouring it would need the block kernels to compute it from global "
        "positions and, being learned, return its gradient (for Inkling2: a per-query distance table "
        "[B, H, n, rel_extent] in, dS summed per distance out)"
    ),
}
NEUTRAL_KEYWORDS = frozenset(
    {
        CONTEXT_KEY,
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "past_key_values",
        "past_key_value",
        "layer_idx",
        "deterministic",
        "return_dict",
    }
)


def _refuse_keywords(
    name: str, attention_mask: Any, kwargs: dict[str, Any], ctx: SeqParContext, cross: bool = False
) -> None:
    """Raise (before any collective) on a keyword whose value would change the attention, and on image
    blocks (``ctx.blocks``) where they are not honoured."""
    _refuse_blocks(name, ctx, cross)
    if attention_mask is not None:
        shape = (
            tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        )
        raise UnsupportedModelError(
            f"{name} passed attention_mask of shape {shape} to the '{ATTN_IMPLEMENTATION}' attention; ds_seqpar "
            "builds masks from global positions and document ids and cannot honour an explicit mask (no rank "
            "holds the whole [S, S] mask). This model builds its own mask, so it cannot run under ds_seqpar"
        )
    for key, value in kwargs.items():
        if key in NEUTRAL_KEYWORDS or value is None:
            continue
        if key in REFUSED_KEYWORDS:
            raise UnsupportedModelError(
                f"{name} passed {key}={_short(value)} to the attention: {REFUSED_KEYWORDS[key]}; this model "
                "cannot run under ds_seqpar"
            )
        raise UnsupportedModelError(
            f"{name} passed {key}={_short(value)} to the attention; ds_seqpar honours "
            f"{', '.join(HONOURED_KEYWORDS)} and would ignore {key!r}, which changes the result: this model "
            "cannot run under ds_seqpar (restore its attention with disable_sequence_parallel(model))"
        )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sinks(name: str, s_aux: Any, num_heads: int) -> torch.Tensor | None:
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != num_heads:
        raise UnsupportedModelError(
            f"{name} passed s_aux={_short(s_aux)}; ds_seqpar honours attention sinks as one logit per query "
            f"head ({num_heads} values)"
        )
    return s_aux.reshape(num_heads)


def _window(name: str, sliding_window: Any) -> int | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise UnsupportedModelError(
            f"{name} passed sliding_window={_short(sliding_window)}; ds_seqpar honours an int >= 1 (a query sees "
            "the last `sliding_window` positions, itself included) or None"
        )
    return sliding_window


def _module_window(module: torch.nn.Module) -> int | None:
    """The window of a layer that does not pass ``sliding_window``: kept on the module (Qwen2-MoE), or the
    config's for a family whose mask applies it to every layer (``WINDOW_FROM_CONFIG``)."""
    window = getattr(module, "sliding_window", None)
    config = getattr(module, "config", None)
    if window is None and getattr(config, "model_type", None) in WINDOW_FROM_CONFIG:
        window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of ``module``'s layer (Llama 4): ``config.attention_chunk_size`` when the layer's
    ``config.layer_types`` entry is ``"chunked_attention"``, else None."""
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if not chunk or types is None or index is None or index >= len(types):
        return None
    return chunk if types[index] == "chunked_attention" else None


def _check_call(name: str, dropout: float, query: torch.Tensor, key: torch.Tensor) -> None:
    """Refuse attention dropout and keys that are not one per query token (a KV cache), by name."""
    if dropout:
        raise UnsupportedModelError(
            f"{name}: attention dropout={dropout} is not supported under sequence parallelism; "
            "set config.attention_dropout=0.0"
        )
    if query.shape[2] != key.shape[2]:
        raise UnsupportedModelError(
            f"{name}: q_len={query.shape[2]} != k_len={key.shape[2]}: a KV cache is in use, or the layer attends "
            "to keys that are not one per token (compressed or extra keys); sequence-parallel attention needs one "
            "key per query token: pass use_cache=False, and generate with ds_seqpar.generate (docs/inference.md) or an unwrapped model"
        )


def seqpar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: Any = _UNSET,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    alibi_slopes: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"ds_seqpar"`` attention implementation: HF layout in, ``(out [B, n, H, D], None)`` out.

    Honoured keywords: ``scaling``, ``sliding_window`` (query i sees key j iff 0 <= i - j < w), ``softcap``
    (Gemma 2), ``s_aux`` (gpt-oss sinks, one logit per query head, with gradients), ``alibi_slopes`` (``[H]``,
    ALiBi from global positions), ``is_causal`` (else the module's), ``dropout`` (only 0); the layer's attention
    chunk (``layer_chunk``). Any other keyword with a non-None value, and an ``attention_mask``, raise by name
    before any collective (neutral ones pass).
    """
    ctx = current_context(kwargs)
    name = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if not isinstance(ctx, SeqParContext):
        raise RuntimeError(
            f"{name} called the '{ATTN_IMPLEMENTATION}' attention without a ds_seqpar context; run the model "
            "through ds_seqpar.SeqParCausalLM / ds_seqpar.initialize (they pass ds_seqpar_context=...), or "
            "restore the original attention with disable_sequence_parallel(model)"
        )
    if alibi_slopes is not None and (ctx.local_attention is not None or id(module) in ctx.cross_active):
        raise UnsupportedModelError(f"{name}: ALiBi (alibi_slopes) is honoured in SP self-attention only")
    if ctx.local_attention is not None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        kwargs.pop(CONTEXT_KEY, None)
        given = {"sliding_window": sliding_window, "softcap": softcap, "s_aux": s_aux, "is_causal": is_causal}
        given = {k: v for k, v in given.items() if v is not None and v is not _UNSET}
        return ALL_ATTENTION_FUNCTIONS[ctx.local_attention](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **given, **kwargs
        )
    _refuse_keywords(name, attention_mask, kwargs, ctx, id(module) in ctx.cross_active)
    if id(module) in ctx.cross_active:
        return _cross_attention_call(module, name, ctx, query, key, value, dropout, scaling,
                                     sliding_window, softcap, s_aux, is_causal), None  # fmt: skip
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if sliding_window is _UNSET:  # not passed: the module's window (its mask), or the config's (Phi-MoE)
        sliding_window = _module_window(module)
    window, chunk = _window(name, sliding_window), layer_chunk(module)
    if ctx.cache is not None and ctx.cache.decoding:
        if dropout:
            _check_call(name, dropout, query, key)
        return decode_attention(module, ctx, name, query, key, value, scaling=scaling, window=window,
                                softcap=softcap or None, sinks=_sinks(name, s_aux, query.shape[1]), causal=causal,
                                chunk=chunk, alibi=alibi_slopes is not None), None  # fmt: skip
    _check_call(name, dropout, query, key)
    if ctx.cache is not None:
        ctx.cache.store(ctx.cache_slot(module), key, value)
    query, key, value, v_dim = _common_head_dim(query, key, value)
    out = (ctx.approximate or attention)(  # approximate: APB / Star prefill (docs/inference.md)
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mesh=ctx.mesh,
        causal=causal,
        softmax_scale=scaling,
        window=window,
        doc_ids=ctx.doc_ids,
        work=ctx.work,
        layer=getattr(module, "layer_idx", None),
        step=ctx.step,
        softcap=softcap or None,
        sinks=_sinks(name, s_aux, query.shape[1]),
        chunk=chunk,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(query.device, torch.float32),
        blocks=ctx.blocks,  # refused above where not honoured; an approximate prefill takes **kwargs
    )
    ctx.record(module, window, causal, chunk)
    return (out if v_dim is None else out[..., :v_dim]), None


def _refuse_blocks(name: str, ctx: SeqParContext, cross: bool) -> None:
    """``ctx.blocks`` (image blocks) is honoured by the exact self-attention call only: refuse it by name in a
    decoding step, a cross-attention call and an approximate prefill (APB / Star)."""
    if ctx.blocks is None or ctx.local_attention is not None:  # a local forward applies HF's own mask
        return
    where = (
        "a decoding step (decode_attention)"
        if ctx.cache is not None and ctx.cache.decoding
        else "cross-attention"
        if cross
        else "an approximate prefill (APB / Star)"
        if ctx.approximate is not None
        else None
    )
    if where is not None:
        raise UnsupportedModelError(
            f"{name}: image blocks (ctx.blocks, bidirectional image tokens) are not honoured in {where}, only in "
            "the exact self-attention; set ctx.blocks=None there (decoding: new tokens are text), or use "
            "ds_seqpar.prefill(mode='exact')"
        )


def _cross_attention_call(
    module: torch.nn.Module,
    name: str,
    ctx: SeqParContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sliding_window: Any,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    is_causal: bool | None,
) -> torch.Tensor:
    """A cross-attention call (HF layout: query ``[B, H, n_q, D]``, key / value ``[B, H_kv, m, D]`` of this
    rank's encoder shard): ``ds_seqpar.cross_attention`` over the group -> ``[B, n_q, H, D]``. Only the scale
    is honoured; anything else that would change the result is refused by name."""
    given = {"dropout": dropout or None, "sliding_window": None if sliding_window is _UNSET else sliding_window,
             "softcap": softcap or None, "s_aux": s_aux, "is_causal": is_causal or None}  # fmt: skip
    refused = {k: v for k, v in given.items() if v is not None}
    if refused:
        key_name, value_ = next(iter(refused.items()))
        raise UnsupportedModelError(
            f"{name}: cross-attention with {key_name}={_short(value_)}; ds_seqpar's cross-attention is plain "
            "(non-causal, full) softmax attention over the encoder states with a key padding mask: set "
            "config.attention_dropout=0.0, or this model cannot run under ds_seqpar"
        )
    if query.shape[-1] != value.shape[-1]:
        raise UnsupportedModelError(
            f"{name}: cross-attention value head dim {value.shape[-1]} != query head dim {query.shape[-1]}"
        )
    out = cross_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mesh=ctx.mesh,
        kv_mask=ctx.cross_mask,
        softmax_scale=scaling,
        schedule=ctx.cross_schedule,
    )
    ctx.record(module)
    ctx.cross_calls += 1
    return out


def _common_head_dim(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """MLA families (DeepSeek V2/V3, MiniCPM3, ...) have a value head dim != the query/key head dim:
    zero-pad the smaller side (zero value columns give zero output columns, zero q/k columns add 0 to
    every score), exact; returns the value head dim to slice the output back to, or None."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk == d_v:
        return query, key, value, None
    if d_v < d_qk:
        return query, key, torch.nn.functional.pad(value, (0, d_qk - d_v)), d_v
    pad = (0, d_v - d_qk)
    return torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad), value, d_v


def register_attention() -> None:
    """Register the ``"ds_seqpar"`` implementation with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_forward)
