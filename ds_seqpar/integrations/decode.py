"""One decoding step under SP: every rank runs the model on the same new token, its attention layers read the
sharded cache (docs/inference.md "Decoding").

Legend: P SP ranks, B batch, E hidden size, V vocabulary.

``decode_step(wrapper, cache, tokens [B]) -> logits [B, V]``: the decoder runs on ``[B, 1]`` at the rows' next
RoPE positions on every rank (projections, MLPs and norms replicated); each attention layer calls
``decode_attention``: the new K/V are stored on rank ``t mod P``, then ``parallel/decode.py`` merges every
rank's partial result with one all-gather. The logits are computed on every rank from identical hidden
states. No host sync happens inside the layers (window starts are bisected on host positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.context import SeqParContext
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.sharded_cache import ShardedCache
from ds_seqpar.parallel.decode import sharded_decode_attention

__all__ = ["decode_attention", "decode_step"]


def decode_attention(
    module: torch.nn.Module,
    ctx: SeqParContext,
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scaling: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    causal: bool,
    chunk: int | None,
    alibi: bool,
) -> torch.Tensor:
    """The attention of one decoding step: HF layout ``query [B, H, 1, D]``, ``key / value [B, H_kv, 1, D]`` of
    the new token -> ``out [B, 1, H, D_v]`` in the query's dtype. Refuses by name what decoding cannot honour."""
    refused = {
        "a bidirectional attention (is_causal=False)": not causal,
        "an attention chunk (config.attention_chunk_size)": chunk is not None,
        "ALiBi (alibi_slopes)": alibi,
        f"{query.shape[2]} query tokens per step (decoding takes 1)": query.shape[2] != 1,
    }
    for what, hit in refused.items():
        if hit:
            raise UnsupportedModelError(f"{name}: decoding from a sharded cache does not support {what}")
    cache: ShardedCache = ctx.cache
    keys, values, mask = cache.read(ctx.cache_slot(module), key, value, window)
    out = sharded_decode_attention(
        query,
        keys,
        values,
        mesh=ctx.mesh,
        scale=query.shape[-1] ** -0.5 if scaling is None else scaling,
        key_mask=mask,
        softcap=softcap,
        sinks=sinks,
    )
    ctx.record(module, window, causal, chunk)
    return out.to(query.dtype)


def decode_step(wrapper: Any, cache: ShardedCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens [B]`` (the same on every SP rank) at index ``cache.seq_len``; returns float32 ``logits [B, V]``
    (identical on every rank) and advances the cache by one token."""
    tokens = tokens.reshape(-1, 1)
    positions = cache.next_positions.reshape(-1, 1).to(tokens.device)
    ctx = wrapper._context(None)
    ctx.cache = cache
    cache.decoding = True
    try:
        with torch.no_grad():
            hidden = wrapper._run_decoder(tokens, positions, ctx)
            logits = wrapper._parts.logits(hidden[:, -1:])[:, 0].float()
    finally:
        cache.decoding = False
    cache.seq_len += 1
    cache.next_positions = cache.next_positions + 1
    return logits
