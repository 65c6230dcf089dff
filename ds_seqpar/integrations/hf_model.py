"""The parts of a HuggingFace causal LM that ds_seqpar runs itself: the decoder and the logits.

Under sequence parallelism the decoder runs once over this rank's tokens (``get_decoder()``), and
the loss needs logits of chunks of its final hidden states. Families differ in what happens between
the two (a final norm outside the decoder, a hidden-state multiplier, the LM head, a final logit
soft-cap, a logit scale or divisor, ...), and new families arrive every month. So no per-family
table: :class:`ModelLogits` runs the model's OWN forward with the decoder replaced by a stand-in
that returns the given hidden states. Whatever the family's forward does after its decoder is
exactly what the SP loss sees; an unknown step cannot be skipped silently.

Wrappers: a PEFT model (``PeftModel`` -> ``LoraModel`` -> the HF model) is unwrapped to the HF model
it adapts (its LoRA layers are in place there); composite models (a language model under a nested
``text_config``, e.g. Gemma 3 with a vision tower) run text-only batches: the decoder is the language
model, the vision tower is never called, and any image or other non-text input is refused.
"""

from __future__ import annotations

from typing import Any

import torch


def unwrap_hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``PreTrainedModel`` inside ``model`` (itself, or the model a PEFT wrapper adapts)."""
    seen = 0
    while hasattr(model, "get_base_model") and seen < 4:  # PeftModel -> LoraModel.model
        inner = model.get_base_model()
        if inner is model:
            break
        model, seen = inner, seen + 1
    return model


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module that maps token ids to final hidden states (the language model of composite models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "base_model", None)
    if decoder is None or decoder is model:
        raise TypeError(
            f"{type(model).__name__} has no separate decoder module (get_decoder() / base_model); ds_seqpar "
            "runs the decoder over each rank's tokens and the model's own head on the result"
        )
    return decoder


def refuse_unhonoured_features(model: torch.nn.Module) -> None:
    """Model-level features the SP loss would silently drop: raise naming them (before any collective)."""
    name = type(model).__name__
    configs = [model.config, getattr(model.config, "text_config", None)]
    for config in (c for c in configs if c is not None):
        if getattr(config, "output_router_logits", False):
            coef = getattr(config, "router_aux_loss_coef", None)
            raise ValueError(
                f"{name}: config.output_router_logits=True adds the MoE load-balancing loss (router_aux_loss_coef="
                f"{coef}) to the model's loss, which ds_seqpar's sequence-parallel loss does not compute; set "
                "model.config.output_router_logits=False (the router still routes every token the same way)"
            )


class _HiddenStates(torch.nn.Module):
    """Stands in for the decoder inside the model's forward: returns the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden
        self.called = False

    def forward(self, *args: Any, **kwargs: Any) -> _DecoderOutput:
        self.called = True
        return _DecoderOutput(self.hidden)


class _DecoderOutput:
    """What a decoder returns, reduced to the hidden states: ``out[0]``, ``out.last_hidden_state``,
    ``out["last_hidden_state"]``; every other field (caches, router logits, image states) is None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, key: int | str) -> Any:
        if key == 0 or key == "last_hidden_state":
            return self.last_hidden_state
        if isinstance(key, slice):
            return (self.last_hidden_state,)[key]
        return None

    def to_tuple(self) -> tuple[torch.Tensor]:
        return (self.last_hidden_state,)


class ModelLogits:
    """Logits of final hidden states through the model's own forward after its decoder.

    ``logits(hidden [B, c, E]) -> [B, c, V]``: the model's forward runs with the top-level child that
    holds the decoder swapped for a stand-in returning ``hidden`` (dummy token ids, no labels, no
    cache), so the final norm / multipliers / LM head / soft-cap / logit scale of the family apply as
    in the plain model, and under ZeRO-3 the head's parameters are gathered by the same hooks.
    """

    def __init__(self, model: torch.nn.Module, decoder: torch.nn.Module) -> None:
        self.model = model
        self.slot = next(
            (name for name, child in model.named_children() if any(m is decoder for m in child.modules())),
            None,
        )
        if self.slot is None:
            raise TypeError(
                f"{type(model).__name__}: its decoder {type(decoder).__name__} is not one of its submodules; "
                "ds_seqpar cannot run the model's own head on sequence-parallel hidden states"
            )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        stand_in = _HiddenStates(hidden)
        original = self.model._modules[self.slot]
        self.model._modules[self.slot] = stand_in
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            out = self.model(input_ids=ids, use_cache=False)
        finally:
            self.model._modules[self.slot] = original
        logits = out.logits if hasattr(out, "logits") else out[0]
        if not stand_in.called or logits is None or tuple(logits.shape[:2]) != tuple(hidden.shape[:2]):
            raise RuntimeError(
                f"{type(self.model).__name__}.forward did not turn the hidden states {tuple(hidden.shape)} into "
                f"logits through its '{self.slot}' submodule; ds_seqpar cannot reproduce this model's logits"
            )
        return logits
