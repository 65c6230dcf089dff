"""Masked-LM inputs: choose tokens to predict, corrupt them, label them (BERT's 80 / 10 / 10 rule), or
mask the labelled answers of a task (``MaskedAnswers``: the passkey rows for ``train.py --objective mlm``).

Every SP rank of a group must see the SAME masked batch (each shards it), so the choice is a pure
function of the sample and a seed: ``MaskedLMDataset`` seeds a generator with ``(seed, index)`` per
sample (static masking: a sample is masked the same way every epoch), never with global RNG state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    probability: float = 0.15,
    special_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(corrupted ids, labels)`` for ids ``[..., S]``.

    Each non-special token is chosen with ``probability``; a chosen token is replaced by
    ``mask_token_id`` (80 %), by a random id (10 %) or kept (10 %), and its label is its original id;
    every other label is -100. At least one token of a row with a non-special token is chosen, so no
    row is without a target.
    """
    if not 0.0 < probability < 1.0:
        raise ValueError(f"masking probability={probability}; valid: 0 < probability < 1 (BERT uses 0.15)")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(
            f"mask_token_id={mask_token_id} is not an id of the vocabulary of {vocab_size} tokens"
        )
    ids = torch.as_tensor(input_ids)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    for special in set(special_ids) | {mask_token_id}:
        maskable &= ids != special
    draw = torch.rand(ids.shape, generator=generator)
    chosen = maskable & (draw < probability)
    first = torch.where(maskable, draw, torch.full_like(draw, 2.0)).argmin(-1, keepdim=True)
    none = ~chosen.any(-1, keepdim=True) & maskable.any(-1, keepdim=True)
    chosen |= torch.zeros_like(chosen).scatter(-1, first, none)
    how = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=generator, dtype=ids.dtype)
    corrupted = torch.where(chosen & (how < 0.8), torch.full_like(ids, mask_token_id), ids)
    corrupted = torch.where(chosen & (how >= 0.8) & (how < 0.9), random_ids, corrupted)
    return corrupted, torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))


class MaskedLMDataset(Dataset):
    """Wraps a dataset of ``{"input_ids": [S], ...}`` samples: ``input_ids`` corrupted and ``labels`` set
    by :func:`mask_tokens`, seeded by ``(seed, index)``; ``position_ids`` / ``attention_mask`` kept
    (packed documents stay packed); the base sample's own ``labels`` are replaced."""

    def __init__(
        self,
        base: Dataset,
        *,
        mask_token_id: int,
        vocab_size: int,
        probability: float = 0.15,
        special_ids: Iterable[int] = (),
        seed: int = 0,
    ) -> None:
        self.base = base
        self.mask_token_id = mask_token_id
        self.vocab_size = vocab_size
        self.probability = probability
        self.special_ids = tuple(int(i) for i in special_ids if i is not None)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.base[index])
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        sample["input_ids"], sample["labels"] = mask_tokens(
            torch.as_tensor(sample["input_ids"]),
            mask_token_id=self.mask_token_id,
            vocab_size=self.vocab_size,
            probability=self.probability,
            special_ids=self.special_ids,
            generator=generator,
        )
        return sample


class MaskedAnswers(Dataset):
    """Wraps a dataset whose samples label a few answer tokens (``labels`` != -100, in the HF causal
    convention: the label sits at the position whose token the answer is): the input token at every
    labelled position becomes ``mask_token_id``, the labels stay. A bidirectional model fills each mask
    from the rest of the row; for the passkey rows (``ds_seqpar.tasks.passkey``) the passkey sits
    anywhere in the first half, far from every masked answer."""

    def __init__(self, base: Dataset, *, mask_token_id: int) -> None:
        self.base = base
        self.mask_token_id = mask_token_id

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.base[index])
        labels = torch.as_tensor(sample["labels"])
        sample["input_ids"] = torch.as_tensor(sample["input_ids"]).masked_fill(
            labels != IGNORE_INDEX, self.mask_token_id
        )
        return sample
