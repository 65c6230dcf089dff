"""Tiny random-init models for every type in transformers' causal-LM auto mapping.

Used for an A/B test of sequence-parallel training against the plain model: ``build_tiny_model(t)``
gives a small model of type ``t`` whose forward on text-only ``input_ids`` is cheap.

The config is made tiny generically, by inspecting the fields of the type's default config: sizes,
head counts, intermediate sizes, expert counts, MLA ranks, dropouts, per-layer patterns (resized to
keep a mix of the original layer kinds), sliding windows and special token ids. Fields whose class
default is ``None`` but which the default config fills in (``__post_init__`` derives them from
other fields) are left for ``__post_init__`` to derive again from the tiny sizes. ``_OVERRIDES``
holds the few family-specific fixes, ``_UNSUPPORTED`` the types that cannot train on text alone.

Run ``python -m benchmarks.tiny_configs [TYPE ...]`` to probe a plain forward+backward for every
(or the given) type; it prints ``type<TAB>class<TAB>ok|reason`` lines and a summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import logging
import sys
import warnings
from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

CAUSAL_LM_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class TinyBuildError(Exception):
    """A tiny model cannot be built (or run text-only) for this model type; the message says why."""


# ----------------------------------------------------------------------------------------------
# Field roles. A config field gets a role from its name (these sets), or from the config's
# ``attribute_map`` (e.g. GPT-2 maps ``hidden_size`` -> ``n_embd``).
# ----------------------------------------------------------------------------------------------

_HIDDEN = {
    "hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "embedding_size",
    "word_embed_proj_dim", "attention_hidden_size", "lru_width", "embedding_dim", "d_embed",
}  # fmt: skip
_LAYERS = {
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers",
}  # fmt: skip
_HEADS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
    "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
    "num_encoder_attention_heads", "swa_num_attention_heads",
}  # fmt: skip
_KV_HEADS = {
    "num_key_value_heads",
    "num_kv_heads",
    "swa_num_key_value_heads",
    "num_query_groups",
    "kv_n_heads",
}
_HEAD_DIM = {"head_dim", "swa_head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels",
             "attention_head_size"}  # fmt: skip
_INTERMEDIATE_EXTRA = {
    "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "dim_ff", "dff", "ffn_hidden_size",
    "feed_forward_size", "expert_ffn_hidden_size", "d_inner", "intermediate_size_mlp", "d_ff", "mlp_dim",
}  # fmt: skip
_EXPERTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOPK = {"num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts", "top_k"}
_SHARED_EXPERTS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
_EXPERT_GROUPS = {"n_group", "num_expert_group", "topk_group"}
_DENSE_PREFIX = {"first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"}
_POSITIONS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
    "max_source_positions", "context_length", "max_sequence_length", "model_max_length",
}  # fmt: skip
_WINDOW = {"sliding_window", "sliding_window_size", "attention_window_size", "window_size",
           "local_attention_window_len", "attention_chunk_size", "keep_window_size"}  # fmt: skip
_STANDARD = _HIDDEN | _LAYERS | _HEADS | _KV_HEADS | _HEAD_DIM | _EXPERTS | _POSITIONS | _WINDOW | {
    "vocab_size", "intermediate_size", "layer_types",
}  # fmt: skip
# Set even when the default is None: several default configs leave these None although the model
# needs a number (real checkpoints always set them).
_NONE_IS_BROKEN = _HEAD_DIM | _KV_HEADS | _EXPERTS | _TOPK
# MLA (DeepSeek-style multi-head latent attention): the head parts are all divided by the factor
# that takes qk_rope_head_dim to 8, which keeps their sums (qk_head_dim = nope + rope, a head_dim
# that equals nope + rope...); the low ranks become 32 (per-layer overrides scale alike).
_MLA_HEAD_PARTS = {"qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim"}
_MLA_RANKS = {"q_lora_rank", "kv_lora_rank", "o_lora_rank"}
_MLA_ROPE, _MLA_RANK = 8, 32
# Sparse-attention indexers (DeepSeek V3.2 DSA, Qwen4-Exp QSA...): small, and a top-k / budget
# below the 64-token probe length so that the selection binds.
_INDEXER = {"index_topk": 16, "indexer_budget": 16, "index_n_heads": 2, "indexer_n_heads": 2,
            "index_head_dim": 16, "indexer_head_dim": 16}  # fmt: skip
_ZERO_NOISE = {"router_jitter_noise", "input_jitter_noise", "mask_time_prob", "mask_feature_prob"}
_FALSE_FLAGS = {"use_cache", "tie_word_embeddings", "output_router_logits", "apply_spec_augment",
                "use_mamba_kernels"}  # fmt: skip
# Token ids that a text-only forward must never see (they trigger image/audio merging): moved out
# of the sampled range [0, vocab) when they fall inside it.
_MEDIA_TOKEN_WORDS = ("image", "video", "audio", "vision", "boi", "eoi", "boa", "eoa", "patch", "frame")
# Token ids that must be valid embeddings (pad is a padding_idx, bos/eos start/shift sequences).
_TEXT_TOKEN_ORDER = ("pad", "bos", "eos", "decoder_start", "sep", "cls", "unk", "mask", "eod")
_BOOKKEEPING = {"transformers_version", "_name_or_path", "model_type", "architectures", "id2label",
                "label2id", "output_attentions", "dtype", "per_layer_config"}  # fmt: skip

# Explicit per-type overrides, applied after the generic rules (real field names; a dict value
# for a sub-config key is merged into that sub-config's kwargs; a callable value gets the sizes).
_OVERRIDES: dict[str, dict[str, Any]] = {
    # Local/global pattern is a run-length list [[kinds, repeats]]; one global + one local layer.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Mamba-2 checks num_heads * head_dim == expand * hidden_size (2 * 64 = 8 * 16).
    "mamba2": {"num_heads": 8},
    # The default config has layer_types None, which the model indexes: one conv + one attention layer.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Reformer: causal LM needs is_decoder; in training the axial position shape must multiply to the
    # sequence length (64) and its dims sum to hidden_size; chunks of 16 so chunked attention binds.
    # hash_seed: LSH bucketing draws random rotations at every forward unless seeded.
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [8, 8],
        "axial_pos_embds_dim": [16, 48],
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
        "hash_seed": 0,
    },
    # block_types is a pattern cycled over the layers ([recurrent, recurrent, attention]): with two
    # layers keep one of each.
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # The default makes every layer attention (full_attn_idxs=None); LFM2 checkpoints mix in conv layers.
    "lfm2": {"full_attn_idxs": [1]},
    # The default DBRX attention config lacks the rope_theta its attention reads, and its
    # clip_qkv=None reaches clamp(min=None, max=None); real checkpoints set both (clip_qkv=8).
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # Default n_shared_experts is None, which the MoE block multiplies by; the checkpoints use 1.
    "dots1": {"n_shared_experts": 1},
    # The local encoder/decoder project to/from the global transformer's width (hidden_size_global).
    "blt": {
        "encoder_config": {"hidden_size_global": lambda sizes: sizes["hidden_size"]},
        "decoder_config": {"hidden_size_global": lambda sizes: sizes["hidden_size"]},
    },
    # Default rope_parameters is {} though the rotary embedding reads one entry per layer type;
    # multimodal RoPE sections must sum to head_dim / 2.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        }
    },
    # "indexed_attention" layers always build the QSA indexer, whose fields default to None.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    "qwen4_exp": {
        "text_config": {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 16,
            "indexer_compress_ratio": 4,
        }
    },
}
# BERT- and RoBERTa-style encoders whose *ForCausalLM class is a causal LM only with is_decoder=True
# (transformers warns "add is_decoder=True"); without it their attention is bidirectional, an encoder, which
# SeqParCausalLM refuses by name.
_OVERRIDES.update(
    {
        t: {"is_decoder": True}
        for t in (
            "roberta", "roberta-prelayernorm", "camembert", "xlm-roberta", "xlm-roberta-xl", "data2vec-text", "xmod",
            "bert", "bert-generation", "electra", "ernie", "roc_bert", "megatron-bert", "rembert", "roformer",
            "big_bird",
        )
    }
)  # fmt: skip

# Types whose causal-LM class cannot train on text-only input_ids.
_UNSUPPORTED: dict[str, str] = {
    "git": "GitForCausalLM's loss drops the image-token positions: needs pixel_values",
    "musicgen": "audio-code LM: input_ids are (batch * num_codebooks, seq), labels (batch, seq, num_codebooks)",
    "musicgen_melody": "audio-code LM: input_ids are (batch * num_codebooks, seq), labels (batch, seq, num_codebooks)",
    "gemma4_assistant": "draft model: forward needs the target model's inputs_embeds and shared_kv_states",
    "gemma4_unified_assistant": "draft model: forward needs the target model's inputs_embeds and shared_kv_states",
}


def _roles(cfg: PretrainedConfig) -> dict[str, str]:
    """Field name -> standard role name, from ``attribute_map`` (e.g. ``n_embd`` -> ``hidden_size``).

    Only standard names count as roles: some maps go the other way (XLM: ``n_words`` -> ``vocab_size``).
    """
    return {real: std for std, real in type(cfg).attribute_map.items() if std in _STANDARD}


def _config_values(cfg: PretrainedConfig) -> dict[str, Any]:
    """Field values of ``cfg`` (sub-configs as instances; per-layer overrides as the raw dict)."""
    d = cfg.to_dict()
    if getattr(cfg, "is_heterogeneous", False):
        cfg.allow_global_per_layer_attribute_access = True
    out = {}
    for k in d:
        try:
            out[k] = getattr(cfg, k)
        except Exception:
            out[k] = d[k]
        if isinstance(out[k], tuple):  # per-layer patterns may be tuples (Reformer's attn_layers)
            out[k] = list(out[k])
    if "per_layer_config" in d:
        out["per_layer_config"] = d["per_layer_config"]
    return out


def _derived_fields(cfg: PretrainedConfig, values: dict[str, Any]) -> set[str]:
    """Fields the config fills in itself: no dataclass field, or a None default that got a value."""
    amap = type(cfg).attribute_map  # a field may be stored under its mapped name (num_experts)
    defaults = {}
    for f in dataclasses.fields(type(cfg)):
        name = amap.get(f.name, f.name)
        if f.default is not dataclasses.MISSING:
            defaults[name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[name] = "<factory>"
    return {k for k, v in values.items() if k not in defaults or (defaults[k] is None and v is not None)}


def _layer_picks(
    per_layer: dict[str, list],
    index_lists: dict[str, list[int]],
    overrides: dict[int, Any],
    n_orig: int,
    n: int,
) -> list[int]:
    """``n`` original layer indices (sorted) that keep a mix of the original layer kinds.

    A layer shows one kind per per-layer list (its entry), per index list (member or not) and its
    per-layer overrides. Layers are picked greedily, each adding the most kinds not yet shown
    (earliest first on ties), then the first unpicked layers fill up to ``n``.
    """
    shows = [
        {(k, str(v[j])) for k, v in per_layer.items()}
        | {(k, j in idx) for k, idx in index_lists.items()}
        | {("per_layer_config", str(overrides.get(j)))}
        for j in range(n_orig)
    ]
    picks: list[int] = []
    seen: set = set()
    while len(picks) < min(n, n_orig):
        j = max((j for j in range(n_orig) if j not in picks), key=lambda j: (len(shows[j] - seen), -j))
        if not shows[j] - seen:
            break
        picks.append(j)
        seen |= shows[j]
    picks += [j for j in range(n_orig) if j not in picks][: n - len(picks)]
    return sorted(picks) + [n_orig - 1] * max(0, n - n_orig)


def _mla_value(k: str, v: int, d: dict[str, Any]) -> int:
    """Tiny value of MLA field ``k`` (``head_dim`` included) given the original config values ``d``."""
    if k in _MLA_RANKS:
        return _scaled(v, d.get(k), _MLA_RANK)
    rope = d.get("qk_rope_head_dim")
    if isinstance(rope, int) and rope % _MLA_ROPE == 0 and v % (rope // _MLA_ROPE) == 0:
        return v // (rope // _MLA_ROPE)
    return {"qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}.get(k, 24)


def _scaled(v: int, base: int | None, tiny: int) -> int:
    """``v`` scaled like ``base`` -> ``tiny`` when ``v`` is a multiple or divisor of ``base``, else ``tiny``."""
    if not base or v == base:
        return tiny
    if v % base == 0:
        return tiny * (v // base)
    if base % v == 0 and tiny % (base // v) == 0:
        return tiny // (base // v)
    return tiny


def _tiny_kwargs(
    cfg: PretrainedConfig,
    sizes: dict[str, int],
    *,
    is_text: bool,
    overrides: dict[str, Any] | None = None,
    n_orig_hint: int | None = None,
    explicit_layers: frozenset[str] = frozenset(),
    outer_hidden: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """Constructor kwargs that shrink ``cfg`` (an instance with default values).

    ``explicit_layers``: per-layer list fields to pass resized even where ``__post_init__`` derives them.
    ``outer_hidden``: hidden sizes of the enclosing configs (adapter widths in sub-configs match them).
    """
    overrides = dict(overrides or {})
    hidden, n_layers = sizes["hidden_size"], sizes["num_layers"]
    heads, kv_heads, head_dim = sizes["num_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    vocab, window, inter = sizes["vocab_size"], sizes["sliding_window"], hidden * 3 // 2
    roles = _roles(cfg)
    d = _config_values(cfg)
    derived = _derived_fields(cfg, d)
    kw: dict[str, Any] = {}

    def role(k: str) -> str:
        return roles.get(k, k)

    n_orig = next(
        (v for k, v in d.items() if role(k) in _LAYERS and isinstance(v, int) and not isinstance(v, bool)),
        n_orig_hint,
    )
    orig_hidden = next((v for k, v in d.items() if role(k) == "hidden_size" and isinstance(v, int)), None)
    orig_head_dim = next((v for k, v in d.items() if role(k) == "head_dim" and isinstance(v, int)), None)
    orig_heads = next(
        (v for k, v in d.items() if role(k) == "num_attention_heads" and isinstance(v, int)), None
    )
    is_mla = d.get("kv_lora_rank") is not None
    text_cfg = d.get("text_config")
    hidden_vals = (
        set(outer_hidden)
        | {orig_hidden}
        | ({getattr(text_cfg, "hidden_size", None)} if isinstance(text_cfg, PretrainedConfig) else set())
    )
    hidden_vals = frozenset(h for h in hidden_vals if isinstance(h, int) and h > hidden)

    for k, v in d.items():
        r = role(k)
        if k in _BOOKKEEPING:
            continue
        if isinstance(v, PretrainedConfig):
            sub_over = overrides.pop(k, None)
            sub_is_text = k in ("text_config", "decoder", "decoder_config", "global_config")
            sub_kw = _tiny_kwargs(
                v, sizes, is_text=sub_is_text, overrides=sub_over, n_orig_hint=n_orig,
                explicit_layers=explicit_layers, outer_hidden=hidden_vals,
            )  # fmt: skip
            kw[k] = _construct(type(v), sub_kw)
            continue
        is_window = is_text and (r in _WINDOW or r == "sliding_window")
        if k in derived and not is_window:
            continue
        if isinstance(v, bool):
            if k in _FALSE_FLAGS:
                kw[k] = False
            elif k == "use_sliding_window":
                kw[k] = True
            continue
        # Dropout-like probabilities and training noise.
        if isinstance(v, float) and (
            "dropout" in k or "pdrop" in k or "drop_prob" in k or k.endswith("layerdrop") or k in _ZERO_NOISE
        ):
            kw[k] = 0.0
            continue
        if r in _MLA_RANKS or r in _MLA_HEAD_PARTS:
            if isinstance(v, int):
                kw[k] = _mla_value(r, v, d)
            continue
        if r in _INDEXER:
            if v is not None:
                kw[k] = _INDEXER[r]
            continue
        if v is None and not (is_window or r in _NONE_IS_BROKEN):
            continue
        if is_window:
            if v is None or isinstance(v, int):
                kw[k] = window
            continue
        if r in _HIDDEN:
            if isinstance(v, int):
                kw[k] = _scaled(v, orig_hidden, hidden)
        elif r in _LAYERS:
            if isinstance(v, int) and v > 0:
                kw[k] = n_layers
        elif r in _HEADS:
            if isinstance(v, int):
                kw[k] = heads
        elif r in _KV_HEADS:
            if is_mla:
                kw[k] = heads  # MLA expands keys/values per query head
            elif v is None or v > 1:
                kw[k] = min(kv_heads, heads)
        elif r in _HEAD_DIM:
            if is_mla and r == "head_dim" and isinstance(v, int):
                kw[k] = _mla_value(r, v, d)
            elif v is None or isinstance(v, int):
                kw[k] = _scaled(v, orig_head_dim, head_dim) if r != "head_dim" and v else head_dim
        elif k == "rotary_dim":
            if isinstance(v, int):
                kw[k] = head_dim // 2  # partial rotary, like GPT-J's 64 of 256
        elif "intermediate_size" in k or r == "intermediate_size" or k in _INTERMEDIATE_EXTRA:
            if isinstance(v, int) and v > 0:
                kw[k] = inter
            elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                kw[k] = [inter] * (n_layers if len(v) == n_orig else len(v))
        elif r in _EXPERTS:
            if v is None or v > 1:
                kw[k] = 4
        elif r in _TOPK:
            if v is None or v > 1:
                kw[k] = 2
        elif k in _SHARED_EXPERTS or k in _EXPERT_GROUPS:
            if isinstance(v, int) and v > 1:
                kw[k] = 1
        elif k in _DENSE_PREFIX:
            if isinstance(v, int) and v > 0:
                kw[k] = 1  # layer 0 dense, layer 1 MoE
        elif k in ("decoder_sparse_step", "moe_layer_interval", "interleave_moe_layer_step"):
            if isinstance(v, int) and v > 1:
                kw[k] = 1
        elif k == "moe_layer_end_index":
            if isinstance(v, int):
                kw[k] = n_layers - 1
        elif k.endswith("_layer_period") and isinstance(v, int) and v > 1:
            kw[k] = 2  # e.g. Jamba: attention every 8 layers at offset 4 -> one of the two layers
        elif k.endswith("_layer_offset") and isinstance(v, int) and d.get(k.replace("offset", "period")):
            kw[k] = 1
        elif k == "max_window_layers":
            if isinstance(v, int):
                kw[k] = 1  # Qwen2-style: layers >= max_window_layers slide -> layer 0 full, 1 sliding
        elif k == "num_kv_shared_layers":
            if isinstance(v, int):
                kw[k] = 0  # sharing needs earlier layers of every kind: not possible in 2 layers
        elif r in _POSITIONS:
            if isinstance(v, int) and v > 0:
                kw[k] = sizes["max_positions"]
        elif k == "local_attention" and is_text and isinstance(v, int):
            kw[k] = 2 * window  # ModernBERT: the full local window, half of it on each side
        elif k == "zero_expert_num" and isinstance(v, int) and v > 2:
            kw[k] = 2  # LongCat's identity ("zero") experts
        elif k in ("chunk_size", "mamba_chunk_size") and is_text and isinstance(v, int) and v > 16:
            kw[k] = 16  # SSM / linear-attention scans over several chunks at 64 tokens
        elif r == "vocab_size" or k in (
            "vocab_size_per_layer_input",
            "decoder_vocab_size",
            "unpadded_vocab_size",
        ):
            if is_text and isinstance(v, int) and v > 0:
                kw[k] = vocab
        elif "vocab" in k and isinstance(v, int) and v > vocab:
            if is_text:
                kw[k] = vocab  # auxiliary vocabularies (hash n-grams, glyph shapes...)
        elif "head_dim" in k and isinstance(v, int) and v > head_dim:
            kw[k] = max(8, _scaled(v, orig_head_dim, head_dim))  # linear-attention / SSM head dims
        elif "heads" in k and ("num" in k or k.startswith("n_")) and isinstance(v, int) and v > heads:
            kw[k] = max(1, _scaled(v, orig_heads, heads))  # linear-attention / SSM head counts
        elif "hidden_size" in k and isinstance(v, int) and v > hidden:
            kw[k] = _scaled(v, orig_hidden, hidden)  # e.g. per-layer-input sizes, global hidden sizes
        elif (
            isinstance(v, int)
            and v in hidden_vals
            and k.endswith(("_dim", "_size", "_channel", "_channels"))
            and not any(w in k for w in ("image", "patch", "vocab", "position", "chunk", "window"))
        ):
            kw[k] = hidden  # widths that must match a hidden size (e.g. multimodal adapters)

    kw.update(
        _per_layer_kwargs(d, derived, n_orig, n_layers, explicit_layers, sizes, orig_hidden, orig_head_dim)
    )
    if is_text:
        kw.update(_token_id_kwargs(d, vocab))
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(kw.get(k), PretrainedConfig):
            kw[k] = _construct(type(kw[k]), {**_config_kwargs(kw[k]), **v})
        else:
            kw[k] = v(sizes) if callable(v) else v
    return kw


def _per_layer_kwargs(
    d: dict[str, Any],
    derived: set[str],
    n_orig: int | None,
    n: int,
    explicit: frozenset[str],
    sizes: dict[str, int],
    orig_hidden: int | None,
    orig_head_dim: int | None,
) -> dict[str, Any]:
    """Per-layer lists, layer-index lists and ``per_layer_config`` resized to ``n`` layers."""
    if not n_orig or n_orig < 2:
        return {}
    per_layer, index_lists = {}, {}
    for k, v in d.items():
        if not isinstance(v, list) or not v or "intermediate_size" in k:
            continue
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        increasing = ints and all(a < b for a, b in itertools.pairwise(v)) and max(v) < n_orig
        if (
            increasing
            and k.endswith(("layers", "_idxs", "_ids", "_indices"))
            and (len(v) < n_orig or v == list(range(n_orig)))
        ):
            index_lists[k] = v
        elif len(v) == n_orig:
            per_layer[k] = v
    raw_over = d.get("per_layer_config") or {}
    layer_over = {int(i): o for i, o in raw_over.items()} if isinstance(raw_over, dict) else {}
    if not per_layer and not index_lists and not layer_over:
        return {}
    picks = _layer_picks(per_layer, index_lists, layer_over, n_orig, n)
    kw: dict[str, Any] = {}
    for k, v in per_layer.items():
        if k in explicit or k not in derived:
            kw[k] = [v[j] for j in picks]
    for k, v in index_lists.items():
        if k in explicit or k not in derived:
            kw[k] = [i for i, j in enumerate(picks) if j in v]
    if layer_over:
        new_over = {}
        for i, j in enumerate(picks):
            if j in layer_over:
                new_over[str(i)] = _shrink_layer_override(layer_over[j], d, sizes, orig_hidden, orig_head_dim)
        kw["per_layer_config"] = new_over
    return kw


def _shrink_layer_override(
    over: dict[str, Any],
    d: dict[str, Any],
    sizes: dict[str, int],
    orig_hidden: int | None,
    orig_head_dim: int | None,
) -> dict[str, Any]:
    """One layer's overrides (heterogeneous configs) scaled like the global fields they override."""
    out = {}
    tiny_of = {"head_dim": sizes["head_dim"], "hidden_size": sizes["hidden_size"], "num_attention_heads":
               sizes["num_heads"], "num_key_value_heads": sizes["num_kv_heads"]}  # fmt: skip
    is_mla = (over.get("kv_lora_rank") or d.get("kv_lora_rank")) is not None
    for k, v in over.items():
        if not isinstance(v, int) or isinstance(v, bool):
            out[k] = v
        elif k in _MLA_RANKS or k in _MLA_HEAD_PARTS or (k == "head_dim" and is_mla):
            out[k] = _mla_value(k, v, d)
        elif k in ("num_attention_heads", "num_key_value_heads") and is_mla:
            out[k] = sizes["num_heads"]
        elif k in tiny_of:
            base = d.get(k)
            out[k] = _scaled(v, base if isinstance(base, int) else None, tiny_of[k])
        elif "intermediate_size" in k:
            out[k] = sizes["hidden_size"] * 3 // 2
        elif k in _WINDOW:
            out[k] = sizes["sliding_window"]
        else:
            out[k] = v
    return out


def _token_id_kwargs(d: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Special token ids: text ones within the vocab; media ones outside the sampled range."""
    kw: dict[str, Any] = {}
    next_media = vocab
    for k, v in d.items():
        if not k.endswith(("_token_id", "_token_index", "_token_ids")):
            continue
        base = k.rsplit("_token", 1)[0]
        if any(w in base for w in _MEDIA_TOKEN_WORDS):
            if isinstance(v, int) and 0 <= v < vocab:
                kw[k] = next_media
                next_media += 1
            continue
        slot = _TEXT_TOKEN_ORDER.index(base) if base in _TEXT_TOKEN_ORDER else len(_TEXT_TOKEN_ORDER)
        if isinstance(v, int) and not 0 <= v < vocab:
            kw[k] = min(slot, vocab - 1)
        elif isinstance(v, list):
            kept = [x for x in v if isinstance(x, int) and 0 <= x < vocab]
            kw[k] = kept or [min(slot, vocab - 1)]
    return kw


def _config_kwargs(cfg: PretrainedConfig) -> dict[str, Any]:
    """Constructor kwargs that rebuild ``cfg`` (its non-derived fields)."""
    d = _config_values(cfg)
    derived = _derived_fields(cfg, d)
    return {k: v for k, v in d.items() if k not in derived and k not in _BOOKKEEPING}


def _construct(cls: type[PretrainedConfig], kw: dict[str, Any]) -> PretrainedConfig:
    try:
        return cls(**kw)
    except Exception as e:
        raise TinyBuildError(f"tiny {cls.__name__} rejected: {_first_line(e)}") from e


def _default_config(model_type: str) -> PretrainedConfig:
    try:
        cls = CONFIG_MAPPING[model_type]
    except Exception as e:  # missing package or remote code
        raise TinyBuildError(f"config class unavailable: {_first_line(e)}") from e
    try:
        return cls()
    except Exception as e:
        raise TinyBuildError(f"default config fails: {_first_line(e)}") from e


def _kinds(cfg: PretrainedConfig) -> dict[str, set]:
    """Kinds per per-layer list field (``layer_types``, ``no_rope_layers``...), to check a resize kept the mix."""
    out = {}
    d = _config_values(cfg)
    roles = _roles(cfg)
    n = next((v for k, v in d.items() if roles.get(k, k) in _LAYERS and isinstance(v, int)), None)
    for k, v in d.items():
        if isinstance(v, list) and v and (len(v) == n or all(isinstance(x, str) for x in v)):
            if all(isinstance(x, str | int | float) for x in v):
                out[k] = set(v)
        elif isinstance(v, PretrainedConfig):
            out.update({f"{k}.{s}": kinds for s, kinds in _kinds(v).items()})
    return out


def tiny_config(
    model_type: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 96,
    sliding_window: int = 8,
    max_positions: int = 512,
) -> PretrainedConfig:
    """The config of ``model_type`` with tiny sizes, no dropout, no cache and untied embeddings."""
    sizes = {
        "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
        "num_kv_heads": num_kv_heads, "head_dim": head_dim, "vocab_size": vocab_size,
        "sliding_window": sliding_window, "max_positions": max_positions,
    }  # fmt: skip
    default = _default_config(model_type)
    over = _OVERRIDES.get(model_type)
    try:
        cfg = _construct(type(default), _tiny_kwargs(default, sizes, is_text=True, overrides=over))
    except TinyBuildError as e:  # (sub-configs are built inside _tiny_kwargs)
        cfg, error = None, e
    # Derived per-layer lists (e.g. layer_types from a 1-in-6 sliding pattern) may have lost a kind
    # at this depth, or not fit it: then pass those resized original lists explicitly.
    want = _kinds(default)
    got = _kinds(cfg) if cfg is not None else {}
    lost = frozenset(
        k.rsplit(".", 1)[-1]
        for k, kinds in want.items()
        if len(got.get(k, kinds)) < min(len(kinds), num_layers)
    )
    if cfg is None or lost:
        explicit = lost or frozenset(k.rsplit(".", 1)[-1] for k in want)
        try:
            kw = _tiny_kwargs(default, sizes, is_text=True, overrides=over, explicit_layers=explicit)
            cfg = _construct(type(default), kw)
        except TinyBuildError:
            if cfg is None:
                raise error from None
    return cfg


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    msg = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _model_config(cfg: PretrainedConfig, model_cls: type) -> PretrainedConfig:
    """``cfg`` or its sub-config of the class ``model_cls`` expects (composite config, text-only class)."""
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for k in cfg.to_dict():
        sub = getattr(cfg, k, None)
        if isinstance(sub, want):
            return sub
    return cfg


def instantiate(model_cls: type, cfg: PretrainedConfig, seed: int) -> torch.nn.Module:
    """``model_cls(cfg)`` seeded, in float32, with the sdpa attention (eager where sdpa is refused);
    ``TinyBuildError`` naming why it cannot be built."""
    torch.manual_seed(seed)
    try:
        model = model_cls(cfg)
    except ImportError as e:
        raise TinyBuildError(f"missing package: {_first_line(e)}") from e
    except Exception as e:
        raise TinyBuildError(f"cannot instantiate {model_cls.__name__}: {_first_line(e)}") from e
    model = model.float()
    for impl in ("sdpa", "eager"):
        try:
            model.set_attn_implementation(impl)
            break
        except Exception:
            continue
    return model


def build_tiny_model(model_type: str, seed: int = 0, **sizes: int) -> torch.nn.Module:
    """A random-init float32 CPU model of ``model_type`` from ``tiny_config``, in train mode, SDPA attention."""
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TinyBuildError(f"{model_type!r} is not in the causal-LM mapping")
    if model_type in _UNSUPPORTED:
        raise TinyBuildError(_UNSUPPORTED[model_type])
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    try:
        model_cls = getattr(transformers, class_name)
    except Exception as e:
        raise TinyBuildError(f"cannot import {class_name}: {_first_line(e)}") from e
    cfg = _model_config(tiny_config(model_type, **sizes), model_cls)
    model = instantiate(model_cls, cfg, seed).train()
    if hasattr(model, "set_default_language"):  # X-MOD routes through per-language adapters
        model.set_default_language(getattr(cfg, "default_language", None) or cfg.languages[0])
    return model


def _vocab_of(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", 0) or model.config.get_text_config().vocab_size)


def probe(model_type: str) -> str:
    """Build the tiny model and run a plain forward+backward on random text; ``"ok"`` or a short reason."""
    try:
        model = build_tiny_model(model_type)
        vocab = min(_vocab_of(model), 96)
        torch.manual_seed(1)
        input_ids = torch.randint(0, vocab, (2, 64))
        try:
            out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        except TypeError as e:
            if "use_cache" not in str(e):
                raise
            out = model(input_ids=input_ids, labels=input_ids)
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            return "forward with labels returned no loss"
        if not torch.isfinite(loss).all():
            return f"non-finite loss {loss.item()}"
        loss.backward()
        bad = [
            n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()
        ]
        if bad:
            return f"non-finite grad in {bad[0]}"
        return "ok"
    except TinyBuildError as e:
        return str(e)[:160]
    except Exception as e:
        return _first_line(e)


def _main(argv: list[str]) -> int:
    types = argv or CAUSAL_LM_TYPES
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    failed: list[str] = []
    for t in types:
        with contextlib.redirect_stdout(io.StringIO()):
            result = probe(t)
        if result != "ok":
            failed.append(t)
        print(f"{t}\t{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t, '?')}\t{result}", flush=True)
    print(
        f"# {len(types) - len(failed)}/{len(types)} ok, {len(failed)} failed: {' '.join(failed)}", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
