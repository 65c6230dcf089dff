"""HF causal-LM families under ds_seqpar vs the plain model: exact, or refused by name (never silently wrong).

The default suite runs a fixed subset that covers every mechanism ds_seqpar honours or refuses:
plain attention, attention soft-capping and a final logit soft-cap, logit divisors and scales,
attention sinks, sliding windows, per-layer attention types, parallel blocks, MoE routing, a
composite (multimodal) model on text, MLA head dims, nested decoders, layers that do not forward
their keyword arguments, routed recurrent layers (gated DeltaNet, KDA, Mamba2), DeepSeek sparse attention; and every kind of
refusal: Mamba (v1) layers, convolutions, positions derived outside ``position_ids``, another loss
convention, chunked attention, a window that only lives in a mask. The slow suite
runs ``benchmarks/model_sweep.py`` over every causal-LM type of the installed transformers.
"""

from __future__ import annotations

import pytest

from benchmarks.model_sweep import sweep_many

EXPECTED = {
    "llama": "exact",
    "gemma2": "exact",  # attention softcap + final logit softcap, sliding layers
    "gemma3_text": "exact",  # sliding / full layer types
    "gemma3": "exact",  # composite: language model under text_config, vision tower untouched
    "granite": "exact",  # logits_scaling (divisor), residual / embedding multipliers
    "cohere": "exact",  # logit_scale, parallel attention + MLP block
    "gpt_oss": "exact",  # attention sinks (s_aux), MoE
    "phi3": "exact",
    "gpt_neox": "exact",  # partial rotary, parallel residual
    "qwen2": "exact",
    "olmo2": "exact",
    "mixtral": "exact",  # MoE
    "deepseek_v3": "exact",  # MLA: value head dim != query/key head dim (zero-padded, exact)
    "opt": "exact",  # decoder nested one level down (model.decoder): the logits stand-in follows the path
    "stablelm": "exact",  # layers do not forward **kwargs to the attention: the context of the forward
    "diffllama": "exact",  # two attention calls per layer
    "qwen3_next": "exact",  # gated DeltaNet layers (conv1d halo + matrix All-Scan), MoE
    "kimi_linear": "exact",  # Kimi Delta Attention: per-channel decay
    "nemotron_h": "exact",  # Mamba2 mixers, MLP-only layers
    "deepseek_v32": "exact",  # DeepSeek sparse attention: top-k indexer over the gathered sequence (docs/dsa.md)
    "glm_moe_dsa": "exact",  # DSA, interleaved indexer RoPE
    "axk2": "exact",  # DSA, fused query + output gate
    "dots3_note": "exact",  # DSA on indexed layers (composite), sliding / full layers through the attention
    "dots3_note_text": "exact",
    "hy_v4": "exact",  # DSA with a shared-top-k layer, attention sinks, per-head gate, hyper-connections
    "jamba": "refused",  # Mamba (v1) layers
    "zaya": "refused",  # a causal Conv1d inside the attention's projections
    "roberta": "refused",  # positions derived from padding (probe: a shard differs from the whole)
    "whisper": "refused",  # its loss does not shift the labels
    "llama4": "refused",  # chunked attention (a mask ds_seqpar does not receive)
    "phimoe": "refused",  # sliding window only in the mask, never passed to the attention
    "deepseek_v4": "refused",  # DSA over compressed keys (a learned compressor), not one key per token
}


def test_family_subset_is_exact_or_refused(dist_pool):
    rows = dist_pool(4).run(sweep_many, list(EXPECTED))
    for rank_rows in rows:
        got = {r["type"]: (r["status"], r["detail"]) for r in rank_rows}
        for model_type, status in EXPECTED.items():
            assert got[model_type][0] == status, (model_type, got[model_type])


@pytest.mark.slow
def test_every_causal_lm_type_has_no_silent_mismatch(dist_pool):
    from benchmarks.tiny_configs import CAUSAL_LM_TYPES

    rows = dist_pool(4).run(sweep_many, CAUSAL_LM_TYPES, timeout=3600)[0]
    mismatches = [r for r in rows if r["status"] == "mismatch"]
    assert not mismatches, mismatches
    assert sum(r["status"] == "exact" for r in rows) >= 110, [(r["type"], r["status"]) for r in rows]
