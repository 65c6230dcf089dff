"""Regenerate ``assets/tiny-qwen2-vl`` (config, word-level tokenizer, processor; no weights).

Run once: ``.venv/bin/python assets/make_tiny_qwen2_vl.py``. The files it writes are committed; nothing is
downloaded. The model is built from the config with seeded random weights::

    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained("assets/tiny-qwen2-vl"))

Text: hidden 64, 2 layers, 4 heads / 2 KV heads (head dim 16, mRoPE sections [2, 3, 3]). Vision: depth 2,
embed dim 32, 2 heads, patch 14, spatial merge 2, temporal patch 2. The processor keeps images between
28 x 28 and 112 x 112 pixels, so a 56 x 56 image is 4 x 4 patches = 4 placeholder tokens. The tokenizer
has Qwen2-VL's special tokens and the words of ``assets/vlm_data`` (``make_vlm_data.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

OUT = Path(__file__).resolve().parent / "tiny-qwen2-vl"
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
WORDS = [
    "<unk>", "what", "is", "in", "the", "picture", "video", "a", "an", "?", ".", ",", ":", "describe",
    "it", "shows", "moves", "to", "left", "right", "up", "down", "and", "on", "of", "color", "shape",
    "red", "green", "blue", "yellow", "white", "black", "square", "circle", "bar", "small", "big",
    "background", "which", "way", "does", "go", "user", "assistant", "first", "second", "then",
]  # fmt: skip
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112


def build_tokenizer() -> Tokenizer:
    """Words on whitespace; the special tokens are split out first (no spaces needed around them)."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def text_config(vocab_size: int, ids: dict[str, int]) -> dict:
    return {
        "model_type": "qwen2_vl_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def model_config(vocab_size: int, ids: dict[str, int]) -> dict:
    vision = {
        "model_type": "qwen2_vl_vision",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,  # the text model's width (the merger's output)
        "mlp_ratio": 2,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": text_config(vocab_size, ids),
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def processor_files(tok_path: Path) -> None:
    """tokenizer_config.json and the image processor's config through HF's own classes; the video processor's
    config (same sizes) and processor_config.json written as JSON (transformers builds a video processor
    only with torchvision installed)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_path),
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=32768,
    )
    tokenizer.save_pretrained(OUT)
    image = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image.save_pretrained(OUT)
    video = json.loads((OUT / "preprocessor_config.json").read_text())
    del video["image_processor_type"]
    video["video_processor_type"] = "Qwen2VLVideoProcessor"
    (OUT / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
    (OUT / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n"
    )


def main() -> None:
    OUT.mkdir(exist_ok=True)
    tok = build_tokenizer()
    tok_path = OUT / "tokenizer.json"
    tok.save(str(tok_path))
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    config = model_config(tok.get_vocab_size(), ids)
    processor_files(tok_path)
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
