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
from ds_seqpar.layout.base import padded_length
from ds_seqpar.memory.estimate import MemoryEstimate, _Dims, _settings, _Tensors
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups
from ds_seqpar.settings import SeqParSettings, model_value

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
WEIGHTS = "weights"
PREFILL_CACHE = "KV cache (prefill: this rank's tokens)"
RESERVED = "KV cache (reserved slots for decoded tokens)"
STATES = "recurrent states (replicated)"


def prefill_memory_estimate(
    model_config: Any,
    seq_len: int,
    config: Any,
    *,
    micro_batch: int = 1,
    bytes_per_element: int = 4,
    reserve: int = 0,
    state_bytes: int | None = None,
) -> MemoryEstimate:
    """Predicted peak bytes per rank of ``ds_seqpar.prefill(model, input_ids [B, S], reserve=...)``.

    Categories: ``weights`` (the whole model, b bytes per parameter, the only resting one); the K/V cache,
    L_attn · n_r · (2 · B · H_kv · D · b + 8): K, V and the int64 global index of each of the n_r real tokens a
    rank holds (S / P when S is a multiple of the layout's; packed prompts, ``position_ids=``, add an int64
    document id per slot and row, not counted); the ``reserve`` slots every layer allocates alike; the
    recurrent layers' states; and the activations of the phase holding the peak (``est.phase``: "RoPE",
    "attention", "MLP" or "logits") on the n = S_padded / P tokens a rank computes. ``est.step_bytes()`` is
    what the prefill allocates (what ``LiveBytes`` measures). Decoded tokens: ``decode_cache_bytes``.

    Args:
        model_config: the HF config (or a dict) of a Llama-style decoder, as for ``memory_estimate``.
        seq_len: S, prompt tokens (split over the ``size`` SP ranks); micro_batch: B.
        config: the ``sequence_parallel`` section (or its ``SeqParSettings``).
        bytes_per_element: 4 (fp32) or 2 (bf16 / fp16) for weights, activations and the cache.
        reserve: ``prefill``'s ``reserve``: free cache slots per layer on every rank.
        state_bytes: the recurrent layers' final states per rank; required when ``layer_types`` names
            layers other than attention.
    """
    _check(
        "prefill_memory_estimate", bytes_per_element, state_bytes,
        seq_len=(seq_len, 1), micro_batch=(micro_batch, 1), reserve=(reserve, 0),
    )  # fmt: skip
    settings = _settings(config, model_config)
    dims = _Dims.read(model_config)
    attn_layers, recurrent = _layer_kinds(model_config, dims.layers)
    if recurrent and state_bytes is None:
        raise ValueError(
            f"prefill_memory_estimate: layer_types has {recurrent} recurrent layers ({_recurrent_names(model_config)}) "
            "whose final states the cache keeps replicated; pass state_bytes=<their bytes per rank>"
        )
    b, batch = bytes_per_element, micro_batch
    n, held = _local_tokens(settings, seq_len)
    t = _Tensors.of(dims, n, batch, b, settings.ulysses_degree)
    slot = _Tensors.of(dims, 1, batch, b, settings.ulysses_degree).kv  # one token's K or V, one layer
    est = MemoryEstimate()
    est.device[WEIGHTS] = dims.params()[0] * b
    est.resting.add(WEIGHTS)
    slot = 2 * slot + 8  # K and V of one token in one layer, and its global index (int64)
    est.device[PREFILL_CACHE] = attn_layers * held * slot
    if reserve:
        est.device[RESERVED] = attn_layers * reserve * slot
    if state_bytes:
        est.device[STATES] = state_bytes
    phases = _phases(settings, dims, t, n, batch, b)
    est.phase = max(phases, key=phases.__getitem__)
    est.device[f"activations (one layer's forward, peak in {est.phase})"] = phases[est.phase]
    return est


def _check(fn: str, b: int, state_bytes: int | None, **counts: tuple[int, int]) -> None:
    """Refuse, by name, a count (name -> (value, lowest allowed)) or a size ``fn`` cannot honour."""
    for name, (value, low) in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{fn}: {name}={value!r} must be an integer >= {low}")
    if b not in (2, 4):
        raise ValueError(f"{fn}: bytes_per_element={b!r} must be 2 (bf16 / fp16) or 4 (fp32)")
    if state_bytes is not None and (not isinstance(state_bytes, int) or state_bytes < 0):
        raise ValueError(f"{fn}: state_bytes={state_bytes!r} must be a byte count >= 0")


def _local_tokens(settings: SeqParSettings, seq_len: int) -> tuple[int, int]:
    """(n: tokens a rank computes, S padded to the layout's multiple over P; the most real tokens a rank
    keeps in the cache: the padding is dropped)."""
    layout = settings.input_layout()
    padded, p = padded_length(seq_len, layout.multiple), settings.size
    if padded == seq_len:
        return seq_len // p, seq_len // p
    held = max(int((layout.local_positions(padded, r) < seq_len).sum()) for r in range(p))
    return padded // p, held


def decode_cache_bytes(
    model_config: Any, new_tokens: int, sp_size: int, *, micro_batch: int = 1, bytes_per_element: int = 4
) -> int:
    """K/V bytes (what ``ShardedCache.bytes()`` counts) that ``new_tokens`` decoded tokens add on the rank
    holding most of them: round robin, so ceil(T / P) tokens of 2 · L_attn · B · H_kv · D · b each. They fill
    the slots ``prefill(reserve=...)`` allocated; beyond those the cache grows (docs/memory.md "Inference
    (prefill and decoding)")."""
    _check(
        "decode_cache_bytes", bytes_per_element, None,
        new_tokens=(new_tokens, 0), sp_size=(sp_size, 1), micro_batch=(micro_batch, 1),
    )  # fmt: skip
    dims = _Dims.read(model_config)
    attn_layers, _ = _layer_kinds(model_config, dims.layers)
    per_token = 2 * attn_layers * micro_batch * dims.kv_heads * dims.head_dim * bytes_per_element
    return math.ceil(new_tokens / sp_size) * per_token


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

    Alive throughout: the embedding output (the decoder loop holds it), the layer's input, RoPE's cos/sin,
    and the prompt's shard (token ids, position ids, document ids: int64 [B, n]).
    """
    base = 2 * t.h + t.rope + 3 * batch * n * 8
    mem = settings.memory
    # tiled: one tile's gate (its activation), up and product, and its down projection; untiled: gate (its
    # activation), up, their product
    tile = min(n, mem.mlp_tile_tokens)
    mlp = batch * tile * (3 * dims.inter + dims.hidden) * b if mem.tiled_mlp else 3 * t.m
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
