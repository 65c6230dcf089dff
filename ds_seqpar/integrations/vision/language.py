"""The language model of a VLM on this rank's tokens only (docs/multimodal.md "The language model").

The VLM's own forward (its base model: ``Qwen2VLModel``, ``LlavaOnevisionModel``, ``Gemma3Model``, ...) runs on
the WHOLE rows on every rank: it embeds the tokens, scatters the visual embeddings into the placeholder
positions and computes the position ids of every kind the family uses (Qwen's 3-D mRoPE). Only its call of
the language model is cut: ``sharded_language_model`` patches that call so that every input with a sequence
dimension keeps this rank's tokens (``LANGUAGE_INPUTS``: one rule per keyword), and the decoder runs under
sequence parallelism with the forward's ``SeqParContext``. A keyword without a rule is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.integrations.context import ACTIVE_CONTEXT, CONTEXT_KEY, SeqParContext
from ds_seqpar.integrations.hf_model import UnsupportedModelError
from ds_seqpar.layout import UspLayout

__all__ = ["LANGUAGE_INPUTS", "TokenShard", "register_language_input", "sharded_language_model"]


@dataclass(frozen=True)
class TokenShard:
    """This rank's tokens of rows ``[B, S]``: ``layout.shard(x, rank, dim)`` keeps them; ``masks_handled``: the
    wrapper turned every input that shapes the attention mask into the context (a mask the VLM builds may
    then be dropped); ``positions``: the rows' text positions ``[B, S]``, given to a language model that the VLM
    calls without position ids (it would number this rank's tokens from 0)."""

    layout: UspLayout
    rank: int
    seq_len: int
    masks_handled: bool
    positions: torch.Tensor | None = None

    def keep(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"a language-model input has {x.shape[dim]} tokens along dim {dim}, the rows {self.seq_len}"
            )
        return self.layout.shard(x, self.rank, dim=dim)


# rule(name, value, all keyword arguments, shard) -> this rank's value (None: drop the keyword)
InputRule = Callable[[str, Any, dict[str, Any], TokenShard], Any]
LANGUAGE_INPUTS: dict[str, InputRule] = {}


def register_language_input(name: str, rule: InputRule) -> None:
    """How the keyword ``name`` of a language model's call is cut to this rank's tokens."""
    LANGUAGE_INPUTS[name] = rule


def _embeds(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> Any:
    return None if value is None else shard.keep(value, 1)


def _positions(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> Any:
    """``[B, S]``, or a family's stacked position ids ``[k, B, S]`` (Qwen's mRoPE, with or without the text row)."""
    if value is None:
        return None
    return shard.keep(value, value.dim() - 1)


def _attention_mask(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> None:
    """Padding and packed documents reach the attention as the context's document ids; a 2-D padding mask is
    what the wrapper gave. A mask the VLM built (4-D, or one per layer type) is dropped only when the wrapper
    honoured what shaped it (``masks_handled``)."""
    if value is None or (isinstance(value, torch.Tensor) and value.dim() == 2) or shard.masks_handled:
        return None
    shape = {k: tuple(v.shape) for k, v in value.items()} if isinstance(value, dict) else tuple(value.shape)
    raise UnsupportedModelError(
        f"the VLM built an attention mask ({shape}) from an input ds_seqpar does not turn into its own masks; "
        "pass only the inputs docs/multimodal.md lists for this family"
    )


def _dropped(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> None:
    if name in ("use_cache", "cache", "past_key_values") and value is not None and value is not False:
        raise ValueError(f"{name}={value!r}: training under sequence parallelism keeps no KV cache")
    return None


def _visual_rows(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> Any:
    """Qwen3-VL's deepstack features: one ``[visual tokens of the rows, D]`` per layer, in (B, S) order of
    ``visual_pos_masks``; this rank keeps the rows of its own visual tokens."""
    if value is None:
        return None
    mask = kwargs.get("visual_pos_masks")
    if mask is None:
        raise ValueError(f"{name} without visual_pos_masks: ds_seqpar cannot tell which rows are this rank's")
    index = torch.cumsum(mask.reshape(-1).long(), 0).reshape(mask.shape) - 1
    mine = shard.keep(index, 1)[shard.keep(mask, 1)]
    return [v.index_select(0, mine.to(v.device)) for v in value]


for _name in ("inputs_embeds", "input_ids"):
    register_language_input(_name, _embeds)
register_language_input("position_ids", _positions)
register_language_input("attention_mask", _attention_mask)
register_language_input("visual_pos_masks", _embeds)
register_language_input("per_layer_inputs", _embeds)  # Gemma 3n / 4: [B, S, layers, D] per token
register_language_input("deepstack_visual_embeds", _visual_rows)
for _name in ("use_cache", "cache", "past_key_values", "return_dict", "output_hidden_states"):
    register_language_input(_name, _dropped)


def _router_logits(name: str, value: Any, kwargs: dict[str, Any], shard: TokenShard) -> Any:
    """Dropped when False (the VLM adds no load-balancing loss; the SP loss reads only the hidden states); True
    asks for the MoE load-balancing loss, which the SP loss does not add."""
    if value:
        raise UnsupportedModelError(
            f"the VLM passed {name}=True to its language model: the MoE load-balancing loss it adds to the "
            "model's loss is not computed by ds_seqpar's sequence-parallel loss; set output_router_logits=False "
            "in the model's config and its text_config"
        )
    return None


register_language_input("output_router_logits", _router_logits)


def _local_inputs(kwargs: dict[str, Any], shard: TokenShard) -> dict[str, Any]:
    unknown = sorted(k for k, v in kwargs.items() if k not in LANGUAGE_INPUTS and v is not None)
    if unknown:
        raise UnsupportedModelError(
            f"the VLM passed {unknown} to its language model, which ds_seqpar does not know how to cut to this "
            "rank's tokens; register a rule (ds_seqpar.integrations.vision.language.register_language_input)"
        )
    local = {k: LANGUAGE_INPUTS[k](k, v, kwargs, shard) for k, v in kwargs.items() if k in LANGUAGE_INPUTS}
    local = {k: v for k, v in local.items() if v is not None}
    if "position_ids" not in local and shard.positions is not None:
        local["position_ids"] = shard.keep(shard.positions, 1)
    return local


@contextlib.contextmanager
def sharded_language_model(
    decoder: torch.nn.Module, ctx: SeqParContext, shard: TokenShard
) -> Iterator[list[int]]:
    """While open, ``decoder``'s calls run on this rank's tokens under ``ctx`` (see the module); yields a list
    that counts the calls."""
    calls: list[int] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise UnsupportedModelError(
                f"the VLM called its language model with {len(args)} positional arguments; ds_seqpar cuts "
                "keyword arguments only"
            )
        local = _local_inputs(kwargs, shard)
        token = ACTIVE_CONTEXT.set(ctx)
        try:
            calls.append(1)
            return type(decoder).forward(decoder, **local, use_cache=False, **{CONTEXT_KEY: ctx})
        finally:
            ACTIVE_CONTEXT.reset(token)

    decoder.forward = forward
    try:
        yield calls
    finally:
        del decoder.forward
