"""Families whose decoding from a sharded cache is not exact for a reason of their own, refused by name
(docs/inference.md "What does not decode", docs/generation_models.md).

Generic rules live where their fact is (``prefill.refuse_undecodable``: position rules, ``recurrent_state``:
layers without a decoder); this registry holds what only one family does: ``UNDECODABLE_LAYERS`` maps the class
name of a layer to an ``UndecodableLayer``: why HF's own generation of that family differs from what ds_seqpar
decodes (under which config), and what to do. ``refuse_undecodable_family(model)`` raises
``UnsupportedModelError`` on the first such layer, before any collective. ``benchmarks/generate_sweep.py``
finds the entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = [
    "UNDECODABLE_LAYERS",
    "UndecodableLayer",
    "refuse_undecodable_family",
    "register_undecodable_layer",
]


@dataclass(frozen=True)
class UndecodableLayer:
    """``why`` decoding from a sharded cache does not equal the family's own generation, the ``fix``, and
    ``applies(config)``: whether the model's config asks for it (always, by default)."""

    why: str
    fix: str = "generate with the plain model"
    applies: Callable[[Any], bool] = lambda config: True


UNDECODABLE_LAYERS: dict[str, UndecodableLayer] = {}


def register_undecodable_layer(class_name: str, entry: UndecodableLayer) -> None:
    """Refuse decoding of every model holding a layer of class ``class_name`` for which ``entry.applies``."""
    UNDECODABLE_LAYERS[class_name] = entry


register_undecodable_layer(
    "MoshiAttention",
    UndecodableLayer(
        "HF's cache keeps only the last config.sliding_window tokens while its full forward (the prefill, "
        "training) attends to every earlier token, so HF's generation and the model's forward disagree"
    ),
)
register_undecodable_layer(
    "DoryAttention",
    UndecodableLayer(
        "with config.recurrent_kv_cache_mode='last_loop' HF's generation lets the loops before the last read the "
        "last loop's cache, while the forward (the prefill, training) gives every loop its own keys",
        "set recurrent_kv_cache_mode='per_loop' (one cache entry per loop, decoded exactly), or generate with the "
        "plain model",
        lambda config: getattr(config, "recurrent_kv_cache_mode", None) == "last_loop",
    ),
)


def refuse_undecodable_family(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first layer of ``model`` in ``UNDECODABLE_LAYERS`` that applies."""
    for name, module in model.named_modules():
        entry = UNDECODABLE_LAYERS.get(type(module).__name__)
        if entry is not None and entry.applies(model.config):
            raise UnsupportedModelError(
                f"{type(model).__name__}: its layer {name} ({type(module).__name__}) does not decode from a sharded "
                f"cache: {entry.why}; {entry.fix}"
            )
