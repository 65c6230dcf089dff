"""Features of a vision-language model that ``SeqParVisionLM`` cannot honour, refused by name when the model is
wrapped, before any collective (docs/models.md "Vision-language models": found by ``benchmarks/vlm_sweep.py``).

``VLM_REFUSALS``: one entry per feature, ``check(hf model) -> why it cannot run (with the fix), or None``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["VLM_REFUSALS", "refuse_unsupported_vlm", "register_vlm_refusal"]

VLM_REFUSALS: dict[str, Callable[[torch.nn.Module], str | None]] = {}


def register_vlm_refusal(name: str, check: Callable[[torch.nn.Module], str | None]) -> None:
    """Refuse every VLM for which ``check(model)`` returns a message (replacing an entry of the same name)."""
    VLM_REFUSALS[name] = check


def refuse_unsupported_vlm(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first feature of ``model`` that a registered check refuses."""
    for check in VLM_REFUSALS.values():
        why = check(model)
        if why:
            raise UnsupportedModelError(f"{type(model).__name__}: {why}")


def _bidirectional_vision(model: torch.nn.Module) -> str | None:
    """Gemma 4's larger checkpoints: the base model builds a mask in which each image's tokens attend to each
    other both ways (from mm_token_type_ids); the language model's attention under SP applies the causal mask."""
    text = model.config.get_text_config()
    mode = getattr(text, "use_bidirectional_attention", None)
    if mode != "vision":
        return None
    return (
        "text_config.use_bidirectional_attention='vision' lets the tokens of each image attend to each other "
        "bidirectionally (a block mask the model builds from mm_token_type_ids), which ds_seqpar's attention does "
        "not apply; set text_config.use_bidirectional_attention=None to train with the causal mask (a different "
        "model), or train without sequence parallelism"
    )


register_vlm_refusal("bidirectional_vision", _bidirectional_vision)
