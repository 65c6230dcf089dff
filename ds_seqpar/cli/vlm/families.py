"""What the multimodal reader knows of a model family (``FAMILIES``), and loading its processor.

A ``VlmFamily`` says how a placeholder of the record format becomes the family's own text (the processor
then expands its image / video token to one per merged patch), which token ids never get a label, which
processor outputs it concatenates (and along which dimension), and how positions are computed (the
model's own rope-index function, or a restarting arange). Families without an entry are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ds_seqpar.cli.vlm.video import qwen2_vl_video
from ds_seqpar.errors import SeqParConfigError

# processor outputs of one token each, [1, L]
TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")


@dataclass(frozen=True)
class VlmFamily:
    """``image_text`` / ``video_text``: what ``<image>`` / ``<video>`` become before the processor runs;
    ``masked_ids``: config attributes of token ids that get label -100; ``vision_keys``: processor outputs
    concatenated over the records of a row along dim 0; ``reserved``: the family's token strings a record
    may not write itself (it writes ``<image>`` / ``<video>``); ``rope_index``: the model -> its
    ``get_rope_index`` (mRoPE families, positions ``[3, 1, L]`` per record) or None (``arange(L)``);
    ``videos``: whether records with videos are read (False: refused by name, with ``no_videos`` the reason);
    ``encode_video``: ``(image_processor, frames, where) -> {pixel_values_videos, video_grid_thw}``, a video
    built from its frames without torchvision (``video.py``), or None (the processor's own video path);
    ``video_seconds``: whether a video also gives ``second_per_grid_ts [videos]`` = temporal_patch_size / fps
    (its positions space temporal patches by it), from the record's ``fps`` (refused without it)."""

    model_type: str
    image_text: str
    video_text: str
    masked_ids: tuple[str, ...]
    vision_keys: tuple[str, ...]
    reserved: tuple[str, ...]
    rope_index: Callable[[Any], Callable[..., Any]] | None
    videos: bool = True
    no_videos: str = ""
    encode_video: Callable[[Any, list[Any], str], dict[str, Any]] | None = None
    video_seconds: bool = False


def _qwen2_vl_rope_index(model: Any) -> Callable[..., Any]:
    """``Qwen2VLModel.get_rope_index`` of a ``Qwen2VLForConditionalGeneration`` (or of the base model)."""
    inner = getattr(model, "model", model)
    return inner.get_rope_index


QWEN2_VL = VlmFamily(
    model_type="qwen2_vl",
    image_text="<|vision_start|><|image_pad|><|vision_end|>",
    video_text="<|vision_start|><|video_pad|><|vision_end|>",
    masked_ids=("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"),
    vision_keys=("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"),
    reserved=("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
    rope_index=_qwen2_vl_rope_index,
    encode_video=qwen2_vl_video,
)
FAMILIES: dict[str, VlmFamily] = {
    "qwen2_vl": QWEN2_VL,
    # Qwen2.5-VL: Qwen2-VL's tokens, images and video layout; its videos' temporal positions need
    # second_per_grid_ts, from the record's fps
    "qwen2_5_vl": replace(
        QWEN2_VL,
        model_type="qwen2_5_vl",
        vision_keys=(*QWEN2_VL.vision_keys, "second_per_grid_ts"),
        video_seconds=True,
    ),
}


def family_of(config: Any) -> VlmFamily:
    """The family entry of a model config; refused by name when there is none."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise SeqParConfigError(
            f"--data with images/videos: model_type {kind!r} has no multimodal data rule (supported: "
            f"{', '.join(sorted(FAMILIES))}); fix: use a supported model, or add a VlmFamily to "
            "ds_seqpar/cli/vlm/families.py"
        )
    return FAMILIES[kind]


def masked_token_ids(family: VlmFamily, config: Any) -> list[int]:
    """The ids of the family's visual tokens (placeholders, vision start / end): never labelled."""
    ids = [getattr(config, name, None) for name in family.masked_ids]
    missing = [name for name, value in zip(family.masked_ids, ids) if value is None]
    if missing:
        raise SeqParConfigError(
            f"model config (model_type {family.model_type!r}) has no {missing}; the reader masks those tokens "
            "out of the labels; fix: a config.json that sets them"
        )
    return [int(i) for i in ids]


def load_processor(model_path: str) -> tuple[Any, bool]:
    """``(processor, videos_supported)``: ``AutoProcessor.from_pretrained(model_path)``. transformers'
    video processors need torchvision; without it the same processor class is built with its image
    processor and tokenizer only (videos are then refused by name)."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_path), True
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import processor_class_from_name

    cls = processor_class_from_name(_processor_class(model_path))
    if cls is None:
        raise SeqParConfigError(f"{model_path}: processor class not found in transformers")

    def check(self: Any, name: str, arg: Any) -> Any:  # the video processor is the one left out
        return None if arg is None else cls.check_argument_for_proper_class(self, name, arg)

    image_only = type(cls.__name__, (cls,), {"check_argument_for_proper_class": check})
    processor = image_only(
        image_processor=AutoImageProcessor.from_pretrained(model_path),
        tokenizer=AutoTokenizer.from_pretrained(model_path),
        video_processor=None,
    )
    return processor, False


def _processor_class(model_path: str) -> str:
    import json
    import os

    path = os.path.join(model_path, "processor_config.json")
    if not os.path.isfile(path):
        raise SeqParConfigError(
            f"{model_path} has no processor_config.json; the multimodal reader runs the model's own processor "
            "(AutoProcessor); fix: save it next to the model with processor.save_pretrained(DIR)"
        )
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)["processor_class"]
