"""Position rules: families whose embeddings derive position ids from the token ids themselves.

ds_seqpar passes every rank the GLOBAL positions of its tokens (``position_ids``, see ``data.py``).
Some families do not number tokens 0..S-1 but compute their own position ids from the whole row when
none are given: RoBERTa and its descendants (CamemBERT, XLM-R, Data2Vec-text, X-MOD, ...) number the
non-padding tokens ``padding_idx + 1, padding_idx + 2, ...`` and give padding tokens ``padding_idx``,
so a token's position depends on how many padding tokens precede it in the row.

A :class:`PositionRule` finds that code in a decoder and returns it as a function
``ids [B, S] -> position ids [B, S]``; :func:`model_position_ids` runs it on the WHOLE row (the SP
group's shards of ``input_ids`` are gathered, ints only) and keeps this rank's part, so the decoder sees
exactly the position ids the plain model computes. ``POSITION_RULES`` is the one list of rules
(:func:`register_position_rule` adds one); docs/integration.md "Position rules" describes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

PositionFn = Callable[[torch.Tensor], torch.Tensor]  # token ids [B, S] -> the model's position ids [B, S]


@dataclass(frozen=True)
class PositionRule:
    """``find(decoder)``: the decoder's own position function (``ids [B, S] -> [B, S]``), or None when the
    rule does not apply to this decoder. ``summary`` names the rule in refusals and docs."""

    name: str
    summary: str
    find: Callable[[torch.nn.Module], PositionFn | None]


def _padding_offset(decoder: torch.nn.Module) -> PositionFn | None:
    """RoBERTa-style embeddings: a module with ``create_position_ids_from_input_ids(ids, padding_idx)``
    and an integer ``padding_idx``; its own function, called on the whole row."""
    for module in decoder.modules():
        make = getattr(module, "create_position_ids_from_input_ids", None)
        padding_idx = getattr(module, "padding_idx", None)
        if callable(make) and isinstance(padding_idx, int) and not isinstance(padding_idx, bool):
            return lambda ids, make=make, padding_idx=padding_idx: make(ids, padding_idx)
    return None


POSITION_RULES: list[PositionRule] = [
    PositionRule(
        "padding_offset",
        "positions padding_idx + 1 + (non-padding tokens before it in the row); padding tokens get padding_idx "
        "(RoBERTa's embeddings)",
        _padding_offset,
    ),
]


def register_position_rule(rule: PositionRule) -> None:
    """Add a rule; rules are tried in registration order, the first that applies wins."""
    POSITION_RULES.append(rule)


def position_rule_of(decoder: torch.nn.Module) -> tuple[PositionRule, PositionFn] | None:
    """The first rule that applies to ``decoder`` and its position function, or None (positions 0..S-1)."""
    for rule in POSITION_RULES:
        fn = rule.find(decoder)
        if fn is not None:
            return rule, fn
    return None


def model_position_ids(
    fn: PositionFn, input_ids: torch.Tensor, rank: int, layout, group
) -> torch.Tensor:  # fmt: skip
    """This rank's model position ids ``[B, n]``: the SP group's ``input_ids`` shards ``[B, n]`` are
    all-gathered (int64, ``P x B x n``), reassembled into the whole rows ``[B, S]`` with ``layout``
    (``unshard``), ``fn`` runs on them, and ``layout.shard`` keeps this rank's part.

    ``layout`` must cover the whole group (``layout.world`` ranks, one shard each); the caller checks that.
    """
    local = input_ids.long().contiguous()
    shards = [torch.empty_like(local) for _ in range(layout.world)]
    torch.distributed.all_gather(shards, local, group=group)
    whole = layout.unshard(shards)
    return layout.shard(fn(whole).to(local.device), rank)
