"""Tiny vision-language models built from configs, and batches with images and videos placed where the SP shards
cut them (shared by tests/test_vlm.py and benchmarks/model_sweep.py's multimodal section).

``tiny_vlm(kind)`` builds the model (seeded, eval mode); ``vlm_batch(model, kind, spec, seed)`` builds one
batch ``{"input_ids", "labels", **vision inputs}``: ``spec`` is a list of rows, each a list of pieces:
``int`` = that many text tokens, ``"image"`` = one image, ``"video"`` = one video; shorter rows are padded on
the right (``attention_mask`` 0, labels -100). Placeholder counts come from
the model's own feature functions (``get_image_features`` / ``get_video_features``), so any family whose
features are computed per image works. Labels are -100 at every vision token.
"""

from __future__ import annotations

import torch
import transformers as tf

TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    head_dim=16,
)
MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
QWEN_IDS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)
QWEN_VISION = dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
SIGLIP = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=8,
    patch_size=2,
)


def _configs() -> dict[str, tuple]:
    return {
        "qwen2_vl": (
            tf.Qwen2VLConfig,
            tf.Qwen2VLForConditionalGeneration,
            dict(
                text_config=dict(TEXT, rope_parameters=MROPE),
                vision_config=dict(
                    QWEN_VISION, depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2
                ),
                **QWEN_IDS,
            ),
        ),
        "qwen2_5_vl": (
            tf.Qwen2_5_VLConfig,
            tf.Qwen2_5_VLForConditionalGeneration,
            dict(
                text_config=dict(TEXT, rope_parameters=MROPE),
                vision_config=dict(
                    QWEN_VISION,
                    depth=2,
                    hidden_size=32,
                    intermediate_size=48,
                    num_heads=2,
                    out_hidden_size=64,
                    window_size=4,
                    fullatt_block_indexes=[1],
                ),
                **QWEN_IDS,
            ),
        ),
        "qwen3_vl": (
            tf.Qwen3VLConfig,
            tf.Qwen3VLForConditionalGeneration,
            dict(
                text_config=dict(TEXT, rope_parameters=MROPE | {"mrope_interleaved": True}),
                vision_config=dict(
                    QWEN_VISION,
                    depth=3,
                    hidden_size=32,
                    intermediate_size=48,
                    num_heads=2,
                    out_hidden_size=64,
                    num_position_embeddings=64,
                    deepstack_visual_indexes=[0, 1],
                ),
                **QWEN_IDS,
            ),
        ),
        "llava_onevision": (
            tf.LlavaOnevisionConfig,
            tf.LlavaOnevisionForConditionalGeneration,
            dict(
                text_config=dict(TEXT, model_type="qwen2"),
                vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
                image_token_index=150,
                video_token_index=151,
                image_grid_pinpoints=[[8, 8], [8, 16]],
                vision_feature_layer=-1,
            ),
        ),
        "llava_next_video": (
            tf.LlavaNextVideoConfig,
            tf.LlavaNextVideoForConditionalGeneration,
            dict(
                text_config=dict(TEXT, model_type="llama"),
                vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
                image_token_index=150,
                video_token_index=151,
                image_grid_pinpoints=[[8, 8], [8, 16]],
                vision_feature_layer=-2,
                vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
            ),
        ),
        "gemma3": (
            tf.Gemma3Config,
            tf.Gemma3ForConditionalGeneration,
            dict(
                text_config=dict(
                    TEXT, model_type="gemma3_text", sliding_window=4096, query_pre_attn_scalar=16
                ),
                vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
                mm_tokens_per_image=4,
                boi_token_index=152,
                eoi_token_index=153,
                image_token_index=150,
            ),
        ),
    } | {"gemma3_window": _gemma3_window()}


def _gemma3_window() -> tuple:
    """Gemma 3 with a sliding window of 6 tokens on its first layer (an image block of 4 + its border tokens is
    cut by the window) and full attention on the second."""
    config_cls, model_cls, kwargs = tf.Gemma3Config, tf.Gemma3ForConditionalGeneration, {}
    text = dict(TEXT, model_type="gemma3_text", sliding_window=6, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    kwargs = dict(text_config=text, vision_config=dict(SIGLIP, model_type="siglip_vision_model"),
                  mm_tokens_per_image=4, boi_token_index=152, eoi_token_index=153, image_token_index=150)  # fmt: skip
    return config_cls, model_cls, kwargs


VLM_KINDS = tuple(_configs())
QWEN3_FRAMES = 3  # temporal patches of a test video (video_grid_thw t = 3)
VIDEO_KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "llava_next_video")


def tiny_vlm(kind: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, kwargs = _configs()[kind]
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).eval()


def token_ids(model: torch.nn.Module) -> tuple[int, int, int | None, int | None]:
    c = model.config
    image = getattr(c, "image_token_id", None) or c.image_token_index
    video = getattr(c, "video_token_id", None) or getattr(c, "video_token_index", None)
    start = getattr(c, "vision_start_token_id", None) or getattr(c, "boi_token_index", None)
    end = getattr(c, "vision_end_token_id", None) or getattr(c, "eoi_token_index", None)
    return image, video, start, end


def _image_inputs(kind: str, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    if kind.startswith("qwen"):
        return {
            "pixel_values": torch.randn(n * 16, 24, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * n),
        }
    if kind in ("llava_onevision", "llava_next_video"):
        sizes = torch.tensor([[8, 16] if i % 2 and kind == "llava_onevision" else [8, 8] for i in range(n)])
        return {"pixel_values": torch.randn(n, 3, 3, 8, 8, generator=g), "image_sizes": sizes}
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g)}


def _video_inputs(kind: str, n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    if kind.startswith("qwen"):
        return {
            "pixel_values_videos": torch.randn(n * 16 * QWEN3_FRAMES, 24, generator=g),
            "video_grid_thw": torch.tensor([[QWEN3_FRAMES, 4, 4]] * n),
        }
    return {"pixel_values_videos": torch.randn(n, 4, 3, 8, 8, generator=g)}


def _feature_counts(
    model: torch.nn.Module, kind: str, inputs: dict, video: bool, per_row: torch.Tensor | None = None
) -> list[int]:
    """Placeholder tokens of every image / video, from the model's own feature function."""
    base = model.model
    with torch.no_grad():
        if video:
            args = {k: v for k, v in inputs.items() if "video" in k}
            out = base.get_video_features(**args)
        else:
            args = {k: v for k, v in inputs.items() if "video" not in k}
            if kind == "llava_onevision":  # images per row: a row of one image is tiled (anyres), others not
                args["batch_num_images"] = per_row
            out = base.get_image_features(**args)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, torch.Tensor) and feats.dim() == 3:
        return [feats.shape[1]] * feats.shape[0]
    return [f.shape[0] for f in feats]


def vlm_batch(model: torch.nn.Module, kind: str, spec: list[list], seed: int = 0) -> dict[str, torch.Tensor]:
    """One batch of the rows in ``spec`` (see the module); rows must have equal lengths (pad with text)."""
    g = torch.Generator().manual_seed(seed)
    n_img = sum(p == "image" for row in spec for p in row)
    n_vid = sum(p == "video" for row in spec for p in row)
    vision = {}
    if n_img:
        vision |= _image_inputs(kind, n_img, g)
    if n_vid:
        vision |= _video_inputs(kind, n_vid, g)
    per_row = torch.tensor([sum(p == "image" for p in row) for row in spec])
    img_counts = iter(_feature_counts(model, kind, vision, False, per_row) if n_img else [])
    vid_counts = iter(_feature_counts(model, kind, vision, True) if n_vid else [])
    image, video, start, end = token_ids(model)
    rows, types = [], []
    for row in spec:
        ids, mm = [], []
        for piece in row:
            if isinstance(piece, int):
                ids += torch.randint(0, 140, (piece,), generator=g).tolist()
                mm += [0] * piece
                continue
            count, token, kind_id = (
                (next(img_counts), image, 1) if piece == "image" else (next(vid_counts), video, 2)
            )
            groups = QWEN3_FRAMES if kind == "qwen3_vl" and piece == "video" else 1  # a group per frame
            for _ in range(groups):
                wrap = [start] if start is not None else []
                stamp = [7, 8] if groups > 1 else []  # Qwen3-VL's timestamp text before every frame
                ids += stamp + wrap + [token] * (count // groups) + ([end] if end is not None else [])
                mm += (
                    [0] * (len(stamp) + len(wrap))
                    + [kind_id] * (count // groups)
                    + ([0] if end is not None else [])
                )
        rows.append(ids)
        types.append(mm)
    width = max(len(r) for r in rows)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # right padding, attention_mask 0
    types = [t + [0] * (width - len(t)) for t in types]
    batch = {"input_ids": ids, "labels": ids.masked_fill((torch.tensor(types) > 0) | (mask == 0), -100)}
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    if start is not None:
        batch["labels"] = batch["labels"].masked_fill((ids == start) | (ids == end), -100)
    if kind.startswith("qwen"):
        batch["mm_token_type_ids"] = torch.tensor(types)
    if kind.startswith("gemma3"):  # image tokens attend to each other bidirectionally (an image block each)
        batch["token_type_ids"] = (torch.tensor(types) == 1).long()
    if kind == "llava_onevision" and n_img:
        vision["batch_num_images"] = per_row
    return batch | vision
