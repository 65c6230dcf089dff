"""Tiny random-init HuggingFace models built from configs (no downloads), shared by the HF tests."""

from __future__ import annotations

import itertools

import torch

VOCAB = 96


# families whose logits or attention go beyond plain softmax attention + LM head, with binding values
FEATURE_MODELS = {
    "gemma2": dict(attn_logit_softcapping=1.0, final_logit_softcapping=1.5, sliding_window=12),
    "granite": dict(logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    "gpt_oss": dict(sliding_window=12),  # attention sinks (s_aux) on every layer
    # chunked attention (layer 0) and a NoPE layer's query temperature from the global index (layer 1)
    "llama4_text": dict(
        attention_chunk_size=16,
        floor_scale=4,
        attn_scale=0.5,
        no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"],
        intermediate_size_mlp=96,
        num_local_experts=2,
    ),
}


# bidirectional encoders with a masked-LM head
ENCODER_MODELS = ("modernbert", "bert")
# models whose recurrent layers ds_seqpar routes (GDN, KDA, Mamba2, Mamba v1, short convs, ZAYA's convolved
# projections, RG-LRU, RWKV, mLSTM), built by benchmarks/tiny_configs.py
HYBRID_MODELS = ("qwen3_next", "qwen3_5", "kimi_linear", "nemotron_h", "bamba", "granitemoehybrid", "zamba2",
                 "olmo_hybrid", "bailing_hybrid", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "zaya",
                 "mamba", "falcon_mamba", "jamba", "zamba", "mamba2", "falcon_h1", "recurrent_gemma", "rwkv",
                 "xlstm")  # fmt: skip
# families with ALiBi attentions ds_seqpar routes (integrations/attention_layers.py), built by benchmarks/tiny_configs.py
ALIBI_MODELS = ("bloom", "mpt")
# DeepSeek sparse attention (MLA + a top-k indexer, routed by integrations/dsa_adapters.py), built likewise
DSA_MODELS = ("deepseek_v32",)
# attention computed inline, routed by integrations/inline_adapters.py (the BERT-style ones need is_decoder=True
# as causal LMs: pass it as an override), built likewise
INLINE_MODELS = (
    "gpt_neo",
    "openai-gpt",
    "xglm",
    "gpt_neox_japanese",
    "megatron-bert",
    "rembert",
    "roformer",
    "big_bird",
)
# a separate key projection bias: its gradient is exactly zero (rounding noise on both sides), see hf_ab.grad_floor
KEY_BIAS_MODELS = ("xglm", "megatron-bert", "rembert", "roformer", "big_bird")
MASK_ID = 4  # the tiny encoders' mask token
# BERT-style decoders (is_decoder=True) whose positions come from a position rule (ds_seqpar/integrations/
# positions.py: RoBERTa's padding offset; pad token 1), built by benchmarks/tiny_configs.py
BERT_DECODERS = ("roberta",)


def tiny_encoder(kind: str, seed: int = 0) -> torch.nn.Module:
    """A float32 masked-LM encoder of 3 layers: ``modernbert`` (RoPE, local attention of 16 = a symmetric
    window of 8 on layers 0 and 1, global layer 2) or ``bert`` (absolute learned positions)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=512, pad_token_id=0)  # fmt: skip
    if kind == "modernbert":
        cfg = transformers.ModernBertConfig(
            local_attention=16, global_attn_every_n_layers=3, attention_dropout=0.0, mlp_dropout=0.0,
            embedding_dropout=0.0, classifier_dropout=0.0, mask_token_id=MASK_ID, bos_token_id=1, eos_token_id=2,
            sep_token_id=2, cls_token_id=1, **common,
        )  # fmt: skip
        cls = transformers.ModernBertForMaskedLM
    elif kind == "bert":
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        cls = transformers.BertForMaskedLM
    else:
        raise ValueError(f"unknown tiny encoder kind {kind!r}")
    torch.manual_seed(seed)
    model = cls(cfg).float()
    model.set_attn_implementation("sdpa")
    return model


ENCODER_INPUTS = ("input_features",)  # what an encoder-decoder batch adds


def tiny_whisper(seed: int = 0, frames: int = 64) -> torch.nn.Module:
    """A float32 Whisper of 2 encoder and 2 decoder layers (E = 64, 4 heads): ``input_features [B, 8, 2·frames]``
    give ``frames`` encoder states."""
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=8,
        max_source_positions=frames, max_target_positions=128, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(cfg).float()
    model.set_attn_implementation("sdpa")
    return model


def speech_batches(num: int, batch_size: int, tokens: int, frames: int = 64, seed: int = 1) -> list[dict]:
    """``num`` batches of decoder ids ``[batch_size, tokens]`` and ``input_features [batch_size, 8, 2·frames]``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, VOCAB, (batch_size, tokens), generator=g),
            "input_features": torch.randn(batch_size, 8, 2 * frames, generator=g),
        }
        for _ in range(num)
    ]


def masked_batches(
    num: int, batch_size: int, seq_len: int, seed: int = 1, lengths: list[int] | None = None
) -> list[dict[str, torch.Tensor]]:
    """``num`` masked-LM batches ``{"input_ids", "labels"[, "position_ids"]}`` (15 % of the tokens masked);
    ``lengths``: every row packs documents of these lengths (positions restart at 0 per document)."""
    from ds_seqpar.tasks.masking import mask_tokens

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = torch.randint(MASK_ID + 1, VOCAB, (batch_size, seq_len), generator=g)
        ids, labels = mask_tokens(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, generator=g)
        batch = {"input_ids": ids, "labels": labels}
        if lengths is not None:
            batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).expand(batch_size, seq_len)
        out.append(batch)
    return out


def tiny_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 causal LM: ``llama``, ``mistral`` (sliding window), ``qwen3`` (H=8, H_kv=2), ``qwen3_moe``, or one of
    :data:`FEATURE_MODELS` (Gemma 2 soft-caps, Granite logit divisor, Cohere logit scale, gpt-oss sinks); one of
    :data:`ENCODER_MODELS` gives :func:`tiny_encoder`, one of :data:`HYBRID_MODELS` (or :data:`BERT_DECODERS`) the sweep's tiny model."""
    if kind in ENCODER_MODELS:
        return tiny_encoder(kind, seed)
    if kind in DSA_MODELS and overrides:  # config fields of the tiny model (e.g. more indexer heads)
        from benchmarks.tiny_configs import tiny_config

        cfg = tiny_config(kind)
        for key, value in overrides.items():
            setattr(cfg, key, value)
        torch.manual_seed(seed)
        model = transformers_class(kind)(cfg).float().train()
        model.set_attn_implementation("sdpa")
        return model
    if kind in (*HYBRID_MODELS, *BERT_DECODERS, *ALIBI_MODELS, *DSA_MODELS, *INLINE_MODELS):
        from benchmarks.tiny_configs import build_tiny_model

        model = build_tiny_model(kind, seed=seed)
        if overrides:  # fields of the tiny hybrid's config (Falcon-H1's multipliers, Mamba's dt range)
            model.config.update(overrides)
            torch.manual_seed(seed)
            model = type(model)(model.config).float().train()
            model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
        return model
    if kind == "whisper":
        return tiny_whisper(seed)
    import transformers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        cfg, cls = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common), LlamaForCausalLM
    elif kind == "mistral":
        cfg = MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=12, **common)
        cls = MistralForCausalLM
    elif kind == "qwen3":
        cfg = Qwen3Config(num_attention_heads=8, num_key_value_heads=2, head_dim=8, **common)
        cls = Qwen3ForCausalLM
    elif kind == "qwen3_moe":  # MoE block on every layer: 4 experts, 2 per token
        cfg = transformers.Qwen3MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, **common,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "gemma3_vlm":  # composite: Gemma 3 language model under text_config + a vision tower
        cfg = transformers.Gemma3Config(
            text_config=dict(
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12, **common
            ),
            vision_config=dict(
                hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        )  # fmt: skip
        cls = transformers.Gemma3ForConditionalGeneration
    elif kind in FEATURE_MODELS:
        cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[transformers.AutoConfig.for_model(kind).__class__]
        extra = dict(head_dim=16, **FEATURE_MODELS[kind])
        if kind == "gpt_oss":  # MoE: 4 experts, 2 per token; sink logits are zeros at init, so draw them
            extra.update(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention"] * 2)
        cfg = transformers.AutoConfig.for_model(
            kind, num_attention_heads=4, num_key_value_heads=2, **common, **extra
        )
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).float()
    model.set_attn_implementation("eager" if kind in FEATURE_MODELS or kind == "gemma3_vlm" else "sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.normal_()
    return model


def transformers_class(kind: str) -> type:
    """The causal-LM class of a model type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])


def batches(num: int, batch_size: int, seq_len: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``num`` random token batches ``{"input_ids": [batch_size, seq_len]}`` (ids below VOCAB - 3, so
    no image token of the multimodal model appears)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, VOCAB - 3, (batch_size, seq_len), generator=g)} for _ in range(num)
    ]


def reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Non-SP token-mean next-token loss of a full batch (labels = input ids, shifted over the row); for a
    masked-LM model the token-mean loss of ``labels`` at their own tokens (not shifted).

    Packed rows (``position_ids`` restarting per document) run each document as its own forward
    (HF's sdpa path does not separate packed documents when no mask is given), then the logits
    are concatenated, so the reference attention never crosses a document boundary.
    """
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    if "attention_mask" in batch:
        labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
    if "position_ids" in batch:
        logits = []
        for row, pos in zip(ids, batch["position_ids"]):
            starts = [0, *(i for i in range(1, len(pos)) if pos[i] <= pos[i - 1]), len(pos)]
            docs = [row[a:b][None] for a, b in itertools.pairwise(starts)]
            logits.append(torch.cat([model(input_ids=d).logits for d in docs], dim=1))
        logits = torch.cat(logits)
    elif "input_features" in batch:  # an encoder-decoder: the decoder's next-token loss
        logits = model(input_features=batch["input_features"], decoder_input_ids=ids).logits
    else:
        kwargs = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
        logits = model(input_ids=ids, **kwargs).logits
    from ds_seqpar.integrations.hf_model import objective_of

    shifted = (
        labels
        if objective_of(model) == "masked"
        else torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    )
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1)
    )
