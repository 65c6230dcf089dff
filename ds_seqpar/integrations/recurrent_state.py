"""Which layers can decode from a sharded cache, and the decoding of recurrent layers (docs/inference.md).

Softmax attention layers that call the ``"ds_seqpar"`` attention decode through ``decode.py``. A recurrent
layer decodes only with an entry in ``RECURRENT_DECODERS`` (``recurrent_decoders.py``: layer class -> how its
state is stepped while decoding, docs/inference_recurrent.md); layers routed around the attention interface (``attention_layers.py``: ALiBi,
inline softmax attention, Llama 4's) are refused by name.
"""

from __future__ import annotations

import torch

from ds_seqpar.integrations.attention_layers import _adapter_for as attention_adapter_for
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.integrations.recurrent_decoders import BUILTIN_DECODERS, RECURRENT_DECODERS, decoder_for
from ds_seqpar.integrations.recurrent_layers import adapter_for as recurrent_adapter_for

__all__ = ["RECURRENT_DECODERS", "refuse_packed_recurrent", "refuse_undecodable_layers"]


def refuse_undecodable_layers(model: torch.nn.Module) -> None:
    """Raise ``UnsupportedModelError`` naming the first layer of ``model`` that cannot decode from a sharded cache."""
    for name, module in model.named_modules():
        cls = type(module)
        if recurrent_adapter_for(module) is not None and decoder_for(module) is None:
            known = {name for _, name in BUILTIN_DECODERS} | {c.__name__ for c in RECURRENT_DECODERS}
            decodable = ", ".join(sorted(known))
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


def refuse_packed_recurrent(model: torch.nn.Module) -> None:
    """Packed prompts (position ids restarting per document) decode each row's last document only; a recurrent
    layer's state carries every document of the row, so such prompts are refused by name."""
    for name, module in model.named_modules():
        if decoder_for(module) is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: packed prompts (position_ids restarting per document) decode each row's "
                f"last document, but the recurrent layer {name} ({type(module).__name__}) carries its state across "
                "every document of the row; prefill one document per row (position_ids=None)"
            )
