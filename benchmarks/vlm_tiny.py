"""Tiny random vision-language models of every image-text-to-text type, and a batch with images (and a video)
for each, built generically from the type's config (used by ``benchmarks/vlm_sweep.py``).

The text config is made tiny by ``benchmarks/tiny_configs.py``'s machinery (2 layers, hidden 64, 4 heads);
the vision config too, then shrunk further: depth 2, images of ``IMAGE`` pixels in patches of ``PATCH`` (a
4 x 4 grid), layer-index lists resized to 2 layers; ``VLM_OVERRIDES`` holds the few family fixes. Media token
ids are renumbered into the vocabulary (``MEDIA_IDS`` on), text is drawn below them.

The batch is ONE row ``[5 text, image, 7 text, (video), 3 text, image, 4 text]``: the pixel inputs are the
first form of ``_image_forms`` / ``_video_forms`` that the model's own ``get_image_features`` /
``get_video_features`` accepts, and the placeholder count of every image / video is what that function returns.
A type whose inputs cannot be built this way raises ``TinyBuildError`` (the sweep reports it as skipped).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as VLM_NAMES

from benchmarks.tiny_configs import (
    _OVERRIDES,
    _WINDOW,
    TinyBuildError,
    _config_kwargs,
    _config_values,
    _construct,
    _default_config,
    _first_line,
    _tiny_kwargs,
    instantiate,
)
from ds_seqpar.integrations.vision.split_tower import TOWER_ATTRIBUTES

VLM_TYPES: list[str] = sorted(VLM_NAMES)
IMAGE, PATCH, GRID = 16, 4, 4  # pixels per side, pixels per patch side, patches per side
TEXT_VOCAB, VOCAB, MEDIA_IDS = 96, 128, 100  # text ids in [0, 96); media ids from 100; embeddings 128
SIZES = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=TEXT_VOCAB,
    sliding_window=4096, max_positions=4096,
)  # fmt: skip
MEDIA_WORDS = ("image", "video", "vision", "boi", "eoi", "patch", "frame", "audio", "boa", "eoa")

# Family fixes (merged like tiny_configs._OVERRIDES: a dict for a sub-config merges into it).
VLM_OVERRIDES: dict[str, dict[str, Any]] = {
    # a square grid of mm_tokens_per_image pooled tokens from the 4 x 4 patches
    "gemma3": {"mm_tokens_per_image": 4},
    "shieldgemma2": {"mm_tokens_per_image": 4},
    # the thinkers' get_rope_index reads vision_start_token_id, which their default configs lack (checkpoints set it)
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652, "vision_end_token_id": 151653},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652, "vision_end_token_id": 151653},
    # the larger checkpoints' image blocks attend bidirectionally (the default, None, is the small models')
    "gemma4": {"text_config": {"use_bidirectional_attention": "vision"}},
    # the text model builds a sliding-window mask whatever its layer types (checkpoints set the window)
    "step3p7": {"text_config": {"sliding_window": 4096}},
}


def _vision_overrides(vision: PretrainedConfig) -> dict[str, Any]:
    """Sizes of a vision config beyond the generic shrink: 2 blocks, a 4 x 4 patch grid, index lists."""
    d = vision.to_dict()
    over: dict[str, Any] = {}
    for k, v in d.items():
        if k in ("depth", "num_hidden_layers", "num_layers") and isinstance(v, int) and v > 2:
            over[k] = 2
        elif k == "image_size":
            over[k] = [IMAGE, IMAGE] if isinstance(v, list | tuple) else IMAGE
        elif k == "patch_size" and isinstance(v, int):
            over[k] = PATCH
        elif k == "patch_size" and isinstance(v, list | tuple) and len(v) == 2:
            over[k] = [PATCH, PATCH]
        elif k.endswith(("_indexes", "_indices", "_visual_indexes")) and isinstance(v, list) and v:
            over[k] = [0, 1] if len(v) > 1 else [1]
        elif k == "num_position_embeddings" and isinstance(v, int):
            over[k] = GRID * GRID * 4
        elif k == "window_size" and isinstance(v, int) and v > IMAGE:
            over[k] = IMAGE // 2
        elif k == "out_hidden_size" and isinstance(v, int):
            over[k] = SIZES["hidden_size"]  # the tower's output feeds the text model
    return over


def _top_overrides(default: PretrainedConfig) -> dict[str, Any]:
    """Top-level fields tied to the image size: pinpoints, feature layers, tokens per image."""
    d = default.to_dict()
    over: dict[str, Any] = {}
    vision = getattr(default, "vision_config", None)
    base = getattr(vision, "image_size", None)
    base = base[0] if isinstance(base, list | tuple) else base
    for k, v in d.items():
        if k == "image_grid_pinpoints" and isinstance(v, list) and base:
            over[k] = [[IMAGE, IMAGE], [IMAGE, 2 * IMAGE]]
        elif k == "vision_feature_layer" and isinstance(v, list):
            over[k] = [-1, -2]
        elif k in ("mm_tokens_per_image", "vision_soft_tokens_per_image") and isinstance(v, int):
            over[k] = 4
        elif k in ("image_size",) and isinstance(v, int):
            over[k] = IMAGE
        elif k == "patch_size" and isinstance(v, int):
            over[k] = PATCH
    if isinstance(vision, PretrainedConfig):
        over["vision_config"] = _vision_overrides(vision)
    for k in d:  # adapters that pick tower layers (Molmo 2's adapter_config)
        sub = getattr(default, k, None)
        if isinstance(sub, PretrainedConfig) and isinstance(getattr(sub, "vision_feature_layer", None), list):
            over[k] = {"vision_feature_layer": [-1, -2]}
    return over


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _renumber_media(cfg: PretrainedConfig, mapping: dict[int, int]) -> None:
    """Every media token id of ``cfg`` and its sub-configs into [MEDIA_IDS, VOCAB) (same old id, same new)."""
    for k, v in _config_values(cfg).items():
        sub = v
        if isinstance(sub, PretrainedConfig):
            _renumber_media(sub, mapping)
            continue
        if not k.endswith(("_token_id", "_token_index", "_token_ids", "_patch_id")) and k != "image_patch_id":
            continue
        if not any(w in k for w in MEDIA_WORDS):
            continue
        if isinstance(v, int):
            setattr(cfg, k, mapping.setdefault(v, MEDIA_IDS + len(mapping)))
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            setattr(cfg, k, [mapping.setdefault(x, MEDIA_IDS + len(mapping)) for x in v])
    if mapping and max(mapping.values()) >= VOCAB:
        raise TinyBuildError(f"{len(mapping)} media token ids do not fit below {VOCAB}")
    for k, v in _config_values(cfg).items():  # vocab_size, vocab_size_per_layer_input (Gemma 3n / 4)
        if k.startswith("vocab_size") and v == TEXT_VOCAB:
            setattr(cfg, k, VOCAB)


def _window_overrides(default: PretrainedConfig) -> dict[str, Any]:
    """Sliding windows the family's default leaves unset stay unset (the text shrink sets every one)."""
    over: dict[str, Any] = {}
    values = _config_values(default)  # (per-layer configs: the global values)
    slides = any("sliding" in str(t) for t in values.get("layer_types") or [])
    for k, v in values.items():
        if isinstance(v, PretrainedConfig):
            over[k] = _window_overrides(v)
        elif (k in _WINDOW or k == "sliding_window") and v is None and not slides:
            over[k] = None
        elif k == "use_sliding_window" and isinstance(v, bool):
            over[k] = v
    return over


def _mrope_sections(cfg: PretrainedConfig, model_cls: type) -> None:
    """Families whose text model splits its rotary frequencies into (t, h, w) sections (mRoPE) and default
    them in code: sections that sum to the tiny head's rotary half (``[2, 3, 3]`` for 16-dim heads)."""
    text = cfg.get_text_config()
    modeling = type(text).__module__.replace(".configuration_", ".modeling_")
    source = inspect.getsource(inspect.getmodule(model_cls)) + inspect.getsource(
        importlib.import_module(modeling)
    )
    rope = getattr(text, "rope_parameters", None)
    if "mrope_section" not in source or not isinstance(rope, dict) or "rope_type" not in rope:
        return
    text.rope_parameters = {**rope, "mrope_section": _sections(_config_values(text), rope)}


def _sections(text: dict[str, Any], rope: dict[str, Any]) -> list[int]:
    """(t, h, w) mRoPE sections summing to half the tiny text head's rotary dims (``[2, 3, 3]`` for 16)."""
    if isinstance(text.get("qk_rope_head_dim"), int):  # MLA: the rotary part of the head (tiny: 8)
        half = 4
    else:
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor") or 1.0)
        half = int(SIZES["head_dim"] * factor) // 2
    part = 3 * half // 8
    return [half - 2 * part, part, part]


def _mrope_overrides(default: PretrainedConfig) -> dict[str, Any]:
    """Sections the default text config sets (validated at construction): scaled to the tiny head."""
    text_key = next(
        (k for k in ("text_config",) if isinstance(getattr(default, k, None), PretrainedConfig)), None
    )
    if text_key is None:
        return {}
    values = _config_values(getattr(default, text_key))
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict) or "mrope_section" not in rope:
        return {}
    return {text_key: {"rope_parameters": {**rope, "mrope_section": _sections(values, rope)}}}


def tiny_vlm_config(model_type: str, model_cls: type | None = None) -> PretrainedConfig:
    """The config of ``model_type`` made tiny (see the module)."""
    default = _default_config(model_type)
    vision_cls = (getattr(type(default), "sub_configs", None) or {}).get("vision_config")
    if getattr(default, "vision_config", 0) is None and vision_cls is not None:  # a default without a tower
        default = _construct(type(default), {**_config_kwargs(default), "vision_config": vision_cls()})
    over = _merge(
        _merge(_window_overrides(default), _mrope_overrides(default)), _OVERRIDES.get(model_type, {})
    )
    over = _merge(_merge(over, _top_overrides(default)), VLM_OVERRIDES.get(model_type, {}))
    try:
        cfg = _construct(type(default), _tiny_kwargs(default, dict(SIZES), is_text=True, overrides=over))
    except TinyBuildError as e:  # the validator's own reason, not the wrapper's first line
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise TinyBuildError(f"tiny config rejected: {_first_line(cause)}") from e
    _renumber_media(cfg, {})
    if model_cls is not None:
        _mrope_sections(cfg, model_cls)
    return cfg


def build_tiny_vlm(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random-init float32 CPU model of ``model_type`` (its image-text-to-text class), eval mode, SDPA."""
    class_name = VLM_NAMES[model_type]
    try:
        model_cls = getattr(transformers, class_name)
    except Exception as e:
        raise TinyBuildError(f"cannot import {class_name}: {_first_line(e)}") from e
    try:
        cfg = tiny_vlm_config(model_type, model_cls)
    except TinyBuildError:
        raise
    except Exception as e:
        raise TinyBuildError(f"tiny config: {_first_line(e)}") from e
    return instantiate(model_cls, cfg, seed).eval()


# ---- the batch ------------------------------------------------------------------------------------------------


def _vision_dims(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(channels, temporal patch, patch side, image side) of the model's vision config."""
    vc = getattr(model.config, "vision_config", None) or model.config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", None) or 3
    temporal = getattr(vc, "temporal_patch_size", None) or 1
    patch = getattr(vc, "patch_size", PATCH)
    patch = patch[0] if isinstance(patch, list | tuple) else patch
    side = getattr(vc, "image_size", IMAGE)
    side = side[0] if isinstance(side, list | tuple) else side
    return int(channels), int(temporal), int(patch or PATCH), int(side or IMAGE)


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _image_forms(model: torch.nn.Module, n: int, g: torch.Generator) -> list[dict[str, Any]]:
    """Candidate pixel inputs of ``n`` images, most specific first (see the module)."""
    c, tp, p, s = _vision_dims(model)
    params = _params(model.model.get_image_features)
    forms = []
    if "image_grid_thw" in params:
        grid = torch.tensor([[1, GRID, GRID]] * n)
        rows = n * GRID * GRID
        for shape in ((rows, c * tp * p * p), (rows, c * 2 * p * p), (rows, c, p, p), (1, rows, c, p, p)):
            forms.append({"pixel_values": torch.randn(*shape, generator=g), "image_grid_thw": grid})
    if "image_position_ids" in params:  # patches [N, P, C·p·p] at (x, y) grid positions (Gemma 4)
        side = 2 * (getattr(getattr(model.config, "vision_config", None), "pooling_kernel_size", None) or 2)
        xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(
            -1, 2
        )
        forms.append(
            {
                "pixel_values": torch.randn(n, side * side, c * p * p, generator=g),
                "image_position_ids": xy.expand(n, -1, -1).clone(),
            }
        )
    if (
        "spatial_shapes" in params
    ):  # NaFlex patches [N, P, C·p·p] of a (h, w) grid each, a patch mask (SigLIP 2)
        forms.append(
            {
                "pixel_values": torch.randn(n, GRID * GRID, c * p * p, generator=g),
                "spatial_shapes": torch.tensor([[GRID, GRID]] * n),
                "pixel_attention_mask": torch.ones(n, GRID * GRID, dtype=torch.long),
            }
        )
    sizes = torch.tensor([[s, s]] * n)
    if "image_sizes" in params:
        forms.append({"pixel_values": torch.randn(n, 3, c, s, s, generator=g), "image_sizes": sizes})
        forms.append({"pixel_values": torch.randn(n, c, s, s, generator=g), "image_sizes": sizes})
    forms.append({"pixel_values": torch.randn(n, c, s, s, generator=g)})
    forms.append({"pixel_values": torch.randn(1, n, c, s, s, generator=g)})
    merge = getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", None) or 1
    for form in forms:
        if "batch_num_images" in params:
            form["batch_num_images"] = torch.tensor([n])
        if "image_merge_sizes" in params:
            form["image_merge_sizes"] = torch.tensor([merge] * n)
    return forms


def _video_forms(model: torch.nn.Module, g: torch.Generator) -> list[dict[str, Any]]:
    """Candidate inputs of one video (2 temporal patches / frames)."""
    if not hasattr(model.model, "get_video_features"):
        return []
    c, tp, p, s = _vision_dims(model)
    params = _params(model.model.get_video_features)
    forms = []
    if "video_grid_thw" in params:
        forms.append(
            {
                "pixel_values_videos": torch.randn(2 * GRID * GRID, c * tp * p * p, generator=g),
                "video_grid_thw": torch.tensor([[2, GRID, GRID]]),
            }
        )
    forms.append({"pixel_values_videos": torch.randn(1, 2, c, s, s, generator=g)})
    return forms


def _counts(out: Any, n: int) -> list[int]:
    """Placeholder tokens of each of ``n`` images / videos from a feature function's output."""
    feats = out
    for field in ("pooler_output", "last_hidden_state"):
        if not isinstance(feats, torch.Tensor | list | tuple) and getattr(out, field, None) is not None:
            feats = getattr(out, field)
    if isinstance(feats, list | tuple) and len(feats) == n and all(torch.is_tensor(f) for f in feats):
        return [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in feats]
    if isinstance(feats, list | tuple):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    if not torch.is_tensor(feats):
        raise TinyBuildError(f"feature function returned {type(out).__name__}, not features per image")
    total = int(feats.reshape(-1, feats.shape[-1]).shape[0])
    if total % n:
        raise TinyBuildError(f"{total} feature rows for {n} images")
    return [total // n] * n


def _first_form(model: torch.nn.Module, fn_name: str, forms: list[dict], n: int) -> tuple[dict, list[int]]:
    """The first form the model's own ``fn_name`` and forward accept, and its placeholder counts."""
    forward = _params(type(model).forward)
    errors = []
    for form in forms:
        if not set(form) <= forward and "kwargs" not in forward:
            errors.append(f"forward takes no {sorted(set(form) - forward)}")
            continue
        fn = getattr(model.model, fn_name)
        args = {k: v for k, v in form.items() if k in _params(fn)}
        try:
            with torch.no_grad():
                return form, _counts(fn(**args), n)
        except Exception as e:
            errors.append(_first_line(e, 100))
    raise TinyBuildError(f"{fn_name}: no generic pixel input fits ({'; '.join(errors[-2:])})")


def _special_ids(cfg: PretrainedConfig, kind: str) -> tuple[int, int | None, int | None]:
    """(placeholder, start, end) token ids of ``kind`` ("image" / "video")."""

    def first(*names: str) -> int | None:
        return next((getattr(cfg, k) for k in names if isinstance(getattr(cfg, k, None), int)), None)

    token = first(f"{kind}_token_id", f"{kind}_token_index")
    if token is None:
        raise TinyBuildError(f"no {kind} token id in the config")
    start = first(f"{kind}_start_token_id", "vision_start_token_id", "boi_token_id", "boi_token_index")
    end = first(f"{kind}_end_token_id", "vision_end_token_id", "eoi_token_id", "eoi_token_index")
    return token, start, end


def vlm_batch(model: torch.nn.Module, with_video: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row ``[5, image, 7, (video), 3, image, 4]`` and its vision inputs (see the module)."""
    g = torch.Generator().manual_seed(seed)
    towers = [getattr(model.model, a, 0) for a in TOWER_ATTRIBUTES]
    if None in towers and not any(isinstance(t, torch.nn.Module) for t in towers):
        raise TinyBuildError("the default config builds no vision tower")
    vision, counts = _first_form(model, "get_image_features", _image_forms(model, 2, g), 2)
    pieces: list[Any] = [5, ("image", counts[0]), 7, 3, ("image", counts[1]), 4]
    if with_video:
        video, vcount = _first_form(model, "get_video_features", _video_forms(model, g), 1)
        vision |= video
        pieces.insert(3, ("video", vcount[0]))
    ids: list[int] = []
    types: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids += torch.randint(0, TEXT_VOCAB, (piece,), generator=g).tolist()
            types += [0] * piece
            continue
        kind, count = piece
        token, start, end = _special_ids(model.config, kind)
        wrap = ([start] if start is not None else []), ([end] if end is not None else [])
        ids += wrap[0] + [token] * count + wrap[1]
        types += [0] * len(wrap[0]) + [1 if kind == "image" else 2] * count + [0] * len(wrap[1])
    row = torch.tensor([ids])
    batch = {"input_ids": row, "labels": row.masked_fill(row >= MEDIA_IDS, -100)}
    batch["attention_mask"] = torch.ones_like(row)  # what a processor gives (some families need it for mRoPE)
    if "mm_token_type_ids" in _params(
        type(model.model).forward
    ):  # (a model passing it on in **kwargs ignores it)
        batch["mm_token_type_ids"] = torch.tensor([types])
    return batch | vision


def takes_video(model: torch.nn.Module) -> bool:
    return bool(_video_forms(model, torch.Generator())) and "pixel_values_videos" in _params(
        type(model).forward
    )
