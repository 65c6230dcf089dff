"""The memory model's inference phase: predicted peak bytes per rank of a sharded prefill, and the K/V
cache that decoding adds (docs/memory.md "Inference (prefill and decoding)").

A prefill runs without gradients, so nothing is kept for a backward: what a rank holds is the weights,
the K/V cache of its own n = ceil(S / P) tokens (every attention layer), the recurrent layers' final
states, and the transient tensors of the one layer (or the logits) being computed. The transient counts
were read off live-tensor traces (``ds_seqpar/memory/trace.py``) of the no-grad forward of the tiny
Llama at P = 1, 2, 4; sizes come from ``estimate._Tensors`` (one home per byte formula).
"""

from __future__ import annotations

import math
from typing import Any

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.memory.estimate import MemoryEstimate, _Dims, _settings, _Tensors
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups
from ds_seqpar.settings import SeqParSettings, model_value

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
WEIGHTS = "weights"
PREFILL_CACHE = "KV cache (prefill: this rank's tokens)"
DECODE_CACHE = "KV cache (decoded tokens, round robin)"
STATES = "recurrent states (replicated)"


def prefill_memory_estimate(
    model_config: Any,
    seq_len: int,
    config: Any,
    *,
    micro_batch: int = 1,
    bytes_per_element: int = 4,
    new_tokens: int = 0,
    state_bytes: int | None = None,
) -> MemoryEstimate:
    """Predicted peak bytes per rank of ``ds_seqpar.prefill`` on ``input_ids [B, S]``, then ``new_tokens``
    decoded tokens (their K/V appended round robin: the rank with the most holds ceil(T / P) of them).

    Categories: ``weights`` (the whole model, b bytes per parameter, the only resting one), the K/V cache
    (2 · L_attn · B · n · H_kv · D · b with n = ceil(S / P)), the recurrent layers' states, and the
    activations of the phase holding the peak (``est.phase``: "RoPE", "attention", "MLP" or "logits").
    ``est.step_bytes()`` is what the prefill allocates (what ``LiveBytes`` measures).

    Args:
        model_config: the HF config (or a dict) of a Llama-style decoder, as for ``memory_estimate``.
        seq_len: S, prompt tokens (split over the ``size`` SP ranks); micro_batch: B.
        config: the ``sequence_parallel`` section (or its ``SeqParSettings``).
        bytes_per_element: 4 (fp32) or 2 (bf16 / fp16) for weights, activations and the cache.
        state_bytes: the recurrent layers' final states per rank; required when ``layer_types`` names
            layers other than attention.
    """
    _check(seq_len, micro_batch, bytes_per_element, new_tokens, state_bytes)
    settings = _settings(config, model_config)
    dims = _Dims.read(model_config)
    attn_layers, recurrent = _layer_kinds(model_config, dims.layers)
    if recurrent and state_bytes is None:
        raise ValueError(
            f"prefill_memory_estimate: layer_types has {recurrent} recurrent layers ({_recurrent_names(model_config)}) "
            "whose final states the cache keeps replicated; pass state_bytes=<their bytes per rank>"
        )
    p, b, batch = settings.size, bytes_per_element, micro_batch
    n = math.ceil(seq_len / p)
    t = _Tensors.of(dims, n, batch, b, settings.ulysses_degree)
    est = MemoryEstimate()
    est.device[WEIGHTS] = dims.params()[0] * b
    est.resting.add(WEIGHTS)
    est.device[PREFILL_CACHE] = 2 * attn_layers * t.kv
    if new_tokens:
        per_token = 2 * attn_layers * batch * dims.kv_heads * dims.head_dim * b
        est.device[DECODE_CACHE] = math.ceil(new_tokens / p) * per_token
    if state_bytes:
        est.device[STATES] = state_bytes
    phases = _phases(settings, dims, t, n, batch, b)
    est.phase = max(phases, key=phases.__getitem__)
    est.device[f"activations (one layer's forward, peak in {est.phase})"] = phases[est.phase]
    return est


def _check(seq_len: int, batch: int, b: int, new_tokens: int, state_bytes: int | None) -> None:
    bad = {
        "seq_len": (seq_len, "a token count >= 1"),
        "micro_batch": (batch, "a batch size >= 1"),
        "new_tokens": (new_tokens, "a token count >= 0"),
    }
    for name, (value, want) in bad.items():
        low = 0 if name == "new_tokens" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"prefill_memory_estimate: {name}={value!r} must be {want}")
    if b not in (2, 4):
        raise ValueError(
            f"prefill_memory_estimate: bytes_per_element={b!r} must be 2 (bf16 / fp16) or 4 (fp32)"
        )
    if state_bytes is not None and (not isinstance(state_bytes, int) or state_bytes < 0):
        raise ValueError(f"prefill_memory_estimate: state_bytes={state_bytes!r} must be a byte count >= 0")


def _layer_kinds(model_config: Any, layers: int) -> tuple[int, int]:
    """(attention layers, recurrent layers) from the config's ``layer_types`` (all attention without)."""
    types = model_value(model_config, "layer_types") or ()
    if not types:
        return layers, 0
    attn = sum(1 for kind in types if kind in ATTENTION_LAYER_TYPES)
    return attn, len(types) - attn


def _recurrent_names(model_config: Any) -> str:
    types = model_value(model_config, "layer_types") or ()
    return ", ".join(sorted({kind for kind in types if kind not in ATTENTION_LAYER_TYPES}))


def _phases(settings: SeqParSettings, dims: _Dims, t: _Tensors, n: int, batch: int, b: int) -> dict[str, int]:
    """Transient bytes of each phase of one layer's no-grad forward on n tokens (and of the last
    position's logits [B, V]).

    Alive throughout: the embedding output (the decoder loop holds it), the layer's input, RoPE's cos/sin.
    """
    base = 2 * t.h + t.rope
    mem = settings.memory
    # tiled: one tile's gate (its activation), up and product, and the output the tiles fill;
    # untiled: gate (its activation), up, their product
    tile = min(n, mem.mlp_tile_tokens)
    mlp = 3 * batch * tile * dims.inter * b + t.h if mem.tiled_mlp else 3 * t.m
    return {
        # q's rotation: q, q·cos, rotate_half(q), its product with sin; k and v as projected
        "RoPE": base + t.h + 4 * t.a_q + 2 * t.kv,
        "attention": base + t.h + _attention(settings, dims, t),
        "MLP": base + 2 * t.h + mlp,  # + the residual sum and the norm's output
        "logits": base + t.h + 2 * batch * dims.vocab * 4,  # final norm; [B, V] fp32 and its copy
    }


def _attention(settings: SeqParSettings, dims: _Dims, t: _Tensors) -> int:
    """One attention call's transient bytes at its peak (the return exchange; docs/memory.md "Attention
    buffers"). q, k, v are alive in the token layout throughout (a_q + 2 kv)."""
    local = t.a_q + 2 * t.kv
    p, u = settings.size, settings.ulysses_degree
    if p == 1:  # the kernel's output and its copy back to [B, n, H·D]
        return local + 2 * t.a_q
    groups = (
        HeadGroups.build(HeadPlan.build(dims.heads, dims.kv_heads, u), settings.ulysses_chunks)
        if p == u
        else None
    )
    if groups is None:  # one exchange: q sent and received, k/v received, the kernel's output, the output
        return local + 4 * t.a_q + 2 * t.a_kv + 2 * t.lse
    c = groups.groups
    own_kv = groups.kv_source == tuple(range(c))
    group_kv = 2 * t.a_kv // c if own_kv else 2 * t.a_kv  # a group's K/V (all of it, carried by group 0)
    # the output; group 0's send and receive; two groups' kernel outputs; the next group's exchange
    return local + t.a_q + 2 * (t.a_q // c + group_kv) + 2 * t.a_q // c + (2 * t.a_q // c if c > 2 else 0)
