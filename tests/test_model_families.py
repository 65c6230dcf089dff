"""HF causal-LM families under ds_seqpar vs the plain model: exact, or refused by name (never silently wrong).

The default suite runs a fixed subset that covers every mechanism ds_seqpar honours or refuses:
plain attention, attention soft-capping and a final logit soft-cap, logit divisors and scales,
attention sinks, sliding windows, per-layer attention types, parallel blocks, MoE routing, a
composite (multimodal) model on text, MLA head dims, nested decoders, layers that do not forward
their keyword arguments, routed recurrent layers (gated DeltaNet, KDA, Mamba2, Mamba v1, short
convolutions), DeepSeek sparse attention, routed ALiBi attentions, positions a family derives from the token ids (a position rule),
chunked attention (Llama 4); and every kind of refusal: a recurrent layer kind without an adapter, token
mixing outside the attention (the probe names the module), attention computed inline, another loss
convention, indexed (QSA) attention, Doge's dynamic mask, a learned score bias. The slow suite
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
    "olmo_hybrid": "exact",  # gated DeltaNet with beta in [0, 2] (allow_neg_eigval)
    "lfm2": "exact",  # gated short convolutions (conv halo only)
    "zaya": "exact",  # causal Conv1d inside the attention's projections: halo exchange (a routed layer)
    "mamba": "exact",  # Mamba v1 selective scan (one head per channel), attention-free
    "falcon_mamba": "exact",  # Mamba v1 with RMS norms on dt, B, C
    "jamba": "exact",  # Mamba v1 + attention + MoE
    "zamba": "exact",  # Mamba v1 with per-head B, C and a shared attention block
    "mamba2": "exact",  # Mamba2 mixers, attention-free
    "falcon_h1": "exact",  # Mamba2 + attention in parallel, muP multipliers
    "zamba2": "exact",  # one Mamba2 head < U = 2: split along head_dim
    "recurrent_gemma": "exact",  # RG-LRU (diagonal scan, reset at position 0) + conv1d halo, sliding attention
    "rwkv": "exact",  # RWKV-4: token shifts + WKV (numerator and denominator as one diagonal scan)
    "xlstm": "exact",  # mLSTM blocks: the max-stabiliser chained exactly, C / n scanned
    "bert": "exact",  # BertLMHeadModel built as a decoder (is_decoder=True), as its causal-LM use needs
    "roberta": "exact",  # as a decoder: positions from the token ids (padding offset), a position rule
    "blt": "refused",  # hashed byte n-grams of the preceding tokens (probe: the first diverging module)
    "openai-gpt": "exact",  # attention computed inline, routed through the interface (inline_adapters.py)
    "reformer": "refused",  # LSH / chunk-grid local attention computed inline: refused by class
    "whisper": "refused",  # its loss does not shift the labels
    "llama4": "exact",  # chunked attention (documents cut at chunk borders), NoPE layers' query temperature
    "phimoe": "exact",  # sliding window only in the mask: read from the config (WINDOW_FROM_CONFIG)
    "doge": "refused",  # a learned per-key bias and a top-k key selection over the whole row
    "moshi": "exact",  # config.sliding_window that its mask never applies (WINDOW_UNUSED)
    "qwen4_exp_text": "refused",  # QSA indexed attention (learned selection of compressed key blocks)
    "bloom": "exact",  # ALiBi: an attention that computes scores itself, routed (integrations/attention_layers.py)
    "mpt": "exact",  # ALiBi from a bias table over max_seq_len
    "inkling2_text": "refused",  # position_bias: a learned relative bias conditioned on each query's states
    "deepseek_v32": "exact",  # DeepSeek sparse attention: top-k indexer over the gathered sequence (docs/dsa.md)
    "glm_moe_dsa": "exact",  # DSA, interleaved indexer RoPE
    "axk2": "exact",  # DSA, fused query + output gate
    "dots3_note": "exact",  # DSA on indexed layers (composite), sliding / full layers through the attention
    "dots3_note_text": "exact",
    "hy_v4": "exact",  # DSA with a shared-top-k layer, attention sinks, per-head gate, hyper-connections
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
    assert sum(r["status"] == "exact" for r in rows) >= 150, [(r["type"], r["status"]) for r in rows]


def bert_as_encoder() -> str:
    """BertLMHeadModel built WITHOUT is_decoder (the sweep builds it as a decoder): a bidirectional encoder,
    which SeqParCausalLM must refuse by name after its first forward, identically on every rank."""
    import torch

    from benchmarks.model_sweep import _mesh
    from benchmarks.tiny_configs import build_tiny_model
    from ds_seqpar import SeqParCausalLM, UnsupportedModelError, shard_batch

    decoder = build_tiny_model("bert")
    decoder.config.is_decoder = False
    torch.manual_seed(0)
    encoder = type(decoder)(decoder.config).float()
    mesh = _mesh()
    ids = torch.randint(0, 90, (2, 64), generator=torch.Generator().manual_seed(1))
    try:
        SeqParCausalLM(encoder, mesh)(**shard_batch({"input_ids": ids}, mesh))
    except UnsupportedModelError as exc:
        return str(exc)
    return "not refused"


def test_an_encoder_built_as_a_causal_lm_is_refused_by_name(dist_pool):
    for message in dist_pool(4).run(bert_as_encoder):
        assert "bidirectional (is_causal=False): it is an encoder" in message, message
