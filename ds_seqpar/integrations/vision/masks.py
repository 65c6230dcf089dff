"""Inputs of a VLM that shape its attention mask beyond causal + padding (docs/multimodal.md "Image blocks").

Some families let groups of tokens attend to each other bidirectionally, groups they read off an input: Gemma 3
marks image tokens with ``token_type_ids == 1`` and every run of them is a block. ``BLOCK_RULES`` maps such an
input, for the families that a rule claims, to block ids ``[B, S]`` (the same id for the tokens of one block,
-1 elsewhere), which the attention applies (``SeqParContext.blocks``, docs/kernels.md). The same input given to a
family that no rule claims is refused by name: its meaning is the family's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.integrations.hf_model import UnsupportedModelError

__all__ = [
    "BLOCK_RULES",
    "MASK_INPUTS",
    "BlockRule",
    "MaskProbe",
    "block_ids",
    "probe_masks",
    "register_block_rule",
]

MASK_INPUTS = ("token_type_ids",)  # inputs that shape a VLM's mask; refused unless a rule claims the family


@dataclass(frozen=True)
class BlockRule:
    """``key``: the input; ``model_types``: the ``config.model_type`` values it claims; ``blocks(value [B, S])`` ->
    block ids ``[B, S]`` (-1 = no block)."""

    key: str
    model_types: frozenset[str]
    summary: str
    blocks: Callable[[torch.Tensor], torch.Tensor]


BLOCK_RULES: list[BlockRule] = []


def register_block_rule(rule: BlockRule) -> BlockRule:
    BLOCK_RULES.append(rule)
    return rule


def runs_of_ones(types: torch.Tensor) -> torch.Tensor:
    """Every run of consecutive 1s of ``types [B, S]`` becomes one block (ids 0, 1, ... along the row)."""
    ones = types == 1
    starts = ones & ~torch.nn.functional.pad(ones, (1, 0))[:, :-1]
    return torch.where(
        ones, torch.cumsum(starts.long(), dim=1) - 1, torch.full_like(types, -1, dtype=torch.long)
    )


register_block_rule(
    BlockRule(
        "token_type_ids",
        frozenset({"gemma3"}),
        "each run of image tokens (token_type_ids == 1)",
        runs_of_ones,
    )
)


def block_ids(model_type: str, inputs: dict[str, Any]) -> torch.Tensor | None:
    """The block ids ``[B, S0]`` the mask inputs among ``inputs`` ask for (None: none asked), or a refusal naming
    an input no rule claims for ``model_type``."""
    found = None
    for key in MASK_INPUTS:
        value = inputs.get(key)
        if value is None:
            continue
        rule = next((r for r in BLOCK_RULES if r.key == key and model_type in r.model_types), None)
        if rule is None:
            raise UnsupportedModelError(
                f"{key} given to a {model_type!r} model: this family reads an attention mask from it that "
                "ds_seqpar has no rule for (integrations/vision/masks.py BLOCK_RULES); drop it or add a rule"
            )
        blocks = rule.blocks(torch.as_tensor(value))
        found = blocks if found is None else torch.maximum(found, blocks)
    return None if found is None or bool((found < 0).all()) else found


class MaskProbe:
    """A transformers mask function for the ``"ds_seqpar"`` implementation, active during a VLM's forward
    (``probe_masks``): it builds no mask (the attention applies causality, windows, documents and blocks itself)
    and checks that every mask the model asks for lets a query see a LATER token only where ``blocks`` say so
    (query and the next key in the same block), by evaluating the model's own mask function at each (q, q + 1).
    A family whose mask deviates (a prefix-LM, an image block no rule knows) is refused by name."""

    def __init__(
        self, blocks: torch.Tensor | None, seq_len: int, model_type: str, packed: bool = False
    ) -> None:
        self.blocks, self.seq_len, self.model_type = blocks, seq_len, model_type
        # Packed rows: transformers numbers the tokens of each document from 0 in the masks it builds and looks
        # the blocks up at those numbers, not at the row's (a mask the plain model never builds, since it sees
        # every document alone): the blocks' rule is trusted there, and only rows without blocks are checked.
        self.skip = packed and blocks is not None

    def expected(self, batch: int, length: int, device: torch.device) -> torch.Tensor:
        """Whether query q sees key q + 1 ``[B, length]``: inside a block on the whole rows, else never."""
        if self.blocks is None or length != self.seq_len - 1:
            return torch.zeros(batch, length, dtype=torch.bool, device=device)
        b = self.blocks.to(device)
        return (b[:, :-1] >= 0) & (b[:, :-1] == b[:, 1:])

    def __call__(self, batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Callable | None = None, device: Any = None, **_: Any) -> None:  # fmt: skip
        length = min(q_length, kv_length - 1 + kv_offset - q_offset)
        if mask_function is None or length <= 0 or self.skip:
            return None
        q = torch.arange(length, device=device) + q_offset
        b = torch.arange(batch_size, device=device)[:, None]
        seen = torch.as_tensor(mask_function(b, torch.zeros((), dtype=torch.long), q[None], q[None] + 1))
        seen = seen.expand(batch_size, length).bool()
        want = self.expected(batch_size, length, seen.device)
        if not torch.equal(seen, want):
            extra = (seen & ~want).nonzero()
            where = (
                f"query {extra[0, 1].item()} sees key {extra[0, 1].item() + 1}" if len(extra) else "a block"
            )
            raise UnsupportedModelError(
                f"the {self.model_type!r} model builds an attention mask in which a token sees later tokens ({where}) "
                "beyond what ds_seqpar's block rules give it (a prefix-LM or bidirectional span): ds_seqpar's "
                "attention would apply a causal mask instead; this input or family is not supported under SP"
            )
        return None


@contextlib.contextmanager
def probe_masks(probe: MaskProbe) -> Iterator[None]:
    """While open, the masks a model builds for the ``"ds_seqpar"`` implementation go through ``probe``."""
    from transformers.masking_utils import AttentionMaskInterface

    from ds_seqpar.integrations.hf_attention import ATTN_IMPLEMENTATION

    mapping = AttentionMaskInterface._global_mapping
    before = mapping.get(ATTN_IMPLEMENTATION)
    mapping[ATTN_IMPLEMENTATION] = probe
    try:
        yield
    finally:
        if before is None:
            del mapping[ATTN_IMPLEMENTATION]
        else:
            mapping[ATTN_IMPLEMENTATION] = before
