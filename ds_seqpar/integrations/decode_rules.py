"""Families whose decoding from a sharded cache is not exact for a reason of their own, refused by name
(docs/inference.md "What does not decode", docs/generation_models.md).

Generic rules live where their fact is (``prefill.refuse_undecodable``: position rules, ``recurrent_state``:
layers without a decoder); this registry holds what only one family does: ``UNDECODABLE_LAYERS`` maps the class
name of a layer to why HF's own generation of that family differs from what ds_seqpar decodes, and what to do.
``refuse_undecodable_family(model)`` raises ``UnsupportedModelError`` on the first such layer, before any
collective. ``benchmarks/generate_sweep.py`` finds the entries: every type it reports refused for a cause here.
"""

from __future__ import annotations

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = ["UNDECODABLE_LAYERS", "refuse_undecodable_family", "register_undecodable_layer"]

# layer class name -> (why decoding from a sharded cache does not equal the family's own generation, the fix)
UNDECODABLE_LAYERS: dict[str, tuple[str, str]] = {}


def register_undecodable_layer(class_name: str, why: str, fix: str = "generate with the plain model") -> None:
    """Refuse decoding of every model holding a layer of class ``class_name`` (``why``, ``fix`` in the message)."""
    UNDECODABLE_LAYERS[class_name] = (why, fix)


register_undecodable_layer(
    "MoshiAttention",
    "HF's cache keeps only the last config.sliding_window tokens while its full forward (the prefill, training) "
    "attends to every earlier token, so HF's generation and the model's forward disagree",
)


def refuse_undecodable_family(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first layer of ``model`` in ``UNDECODABLE_LAYERS``."""
    for name, module in model.named_modules():
        entry = UNDECODABLE_LAYERS.get(type(module).__name__)
        if entry is not None:
            why, fix = entry
            raise UnsupportedModelError(
                f"{type(model).__name__}: its layer {name} ({type(module).__name__}) does not decode from a sharded "
                f"cache: {why}; {fix}"
            )
