"""Which layers can decode from a sharded cache, and the decoding of recurrent layers (docs/inference.md).

Softmax attention layers that call the ``"ds_seqpar"`` attention decode through ``decode.py``. A recurrent
layer decodes only with an entry in ``RECURRENT_DECODERS`` (layer class -> how its state is kept at prefill
and stepped while decoding); layers routed around the attention interface (``attention_layers.py``: ALiBi,
inline softmax attention, Llama 4's) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.integrations.attention_layers import _adapter_for as attention_adapter_for
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_layers import adapter_for as recurrent_adapter_for

__all__ = ["RECURRENT_DECODERS", "refuse_undecodable_layers"]

RECURRENT_DECODERS: dict[type, Any] = {}


def refuse_undecodable_layers(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first layer of ``model`` that cannot decode from a sharded cache."""
    for name, module in model.named_modules():
        cls = type(module)
        if recurrent_adapter_for(module) is not None and cls not in RECURRENT_DECODERS:
            decodable = ", ".join(sorted(c.__name__ for c in RECURRENT_DECODERS)) or "none yet"
            raise UnsupportedModelError(
                f"{type(model).__name__}: its recurrent layer {name} ({cls.__name__}) has no decoding from a sharded "
                f"cache (recurrent layers that decode: {decodable}); generate with the plain model"
            )
        if attention_adapter_for(module) is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its layer {name} ({cls.__name__}) computes its attention scores itself "
                "(ALiBi, inline softmax or Llama 4's temperature), which decoding from a sharded cache does not "
                "reproduce; generate with the plain model"
            )
