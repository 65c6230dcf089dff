"""Synthetic long-context passkey retrieval: the answer sits far before the question.

A sample of S tokens: the passkey (one of ``num_keys`` ``k*`` words) repeated ``prefix`` times at a random
place in the first half, random filler words (``f*``) everywhere else, and in the last
``2 · num_questions`` tokens a ``?`` every other token. The label of each ``?`` is the passkey; the
token after a ``?`` in the INPUT is filler, so the answer never appears near the question: every
question must be answered from the first half of the row, which under sequence parallelism lives on
another rank. Chance accuracy is 1 / num_keys.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


class PasskeyTask:
    """Token ids of the task, looked up in a tokenizer that has the ``?``, ``f*`` and ``k*`` words."""

    def __init__(self, tokenizer, num_questions: int = 64, num_keys: int = 16, prefix: int = 1) -> None:
        vocab = tokenizer.get_vocab()
        missing = [w for w in ("?", "f0", "k0") if w not in vocab]
        if missing:
            raise ValueError(
                f"the passkey task needs the words {missing} in the tokenizer; use the shipped tokenizer "
                "(assets/tiny-llama) or pass --data to train on your own text"
            )
        self.question = vocab["?"]
        self.filler = torch.tensor(sorted(v for w, v in vocab.items() if w[:1] == "f" and w[1:].isdigit()))
        keys = sorted(v for w, v in vocab.items() if w[:1] == "k" and w[1:].isdigit())
        if not 2 <= num_keys <= len(keys):
            raise ValueError(
                f"passkey num_keys={num_keys} must be in 2..{len(keys)} (k-words in the tokenizer)"
            )
        self.keys = torch.tensor(keys[:num_keys])
        self.num_questions = num_questions
        self.prefix = prefix

    def sample(
        self, seq_len: int, generator: torch.Generator, key_index: int | None = None
    ) -> dict[str, torch.Tensor]:
        """``input_ids [S]`` and ``labels [S]`` (already next-token aligned: label t is the answer at t).

        ``key_index`` picks the passkey (``0 .. num_keys - 1``); None draws it from ``generator``."""
        nq = self.num_questions
        if seq_len < 2 * nq + self.prefix + 1:
            raise ValueError(
                f"passkey seq_len={seq_len} must be >= {2 * nq + self.prefix + 1} (2 x num_questions + prefix + 1)"
            )
        ids = self.filler[torch.randint(len(self.filler), (seq_len,), generator=generator)]
        # always drawn, so the filler and the passkey's place are those of the unbalanced stream
        drawn = torch.randint(len(self.keys), (1,), generator=generator)
        key = self.keys[drawn if key_index is None else torch.tensor([key_index])]
        start = int(torch.randint(0, seq_len // 2 - self.prefix + 1, (1,), generator=generator))
        ids[start : start + self.prefix] = key  # anywhere in the first half: no fixed offset to learn
        questions = torch.arange(seq_len - 2 * nq, seq_len, 2)
        ids[questions] = self.question
        # labels in HF convention (label at t+1 is predicted at t): the token after each "?"
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[questions + 1] = key
        return {"input_ids": ids, "labels": labels}


class PasskeyDataset(Dataset):
    """``num_samples`` deterministic samples; sample i uses seed ``seed + i`` (resumable by index).

    With ``balanced`` (the default), every block of ``num_keys`` consecutive samples asks each passkey
    once, in a shuffled order per block. Read in index order (``train.py`` does not shuffle this data),
    no passkey is missing from a stretch of training, so the model cannot lower its loss by predicting
    the recent passkeys, the shortcut that left whole passkeys unlearned when they were drawn at random
    (docs/train.md, "The embedded default").
    """

    def __init__(
        self, task: PasskeyTask, num_samples: int, seq_len: int, seed: int = 0, balanced: bool = True
    ) -> None:
        self.task, self.num_samples, self.seq_len, self.seed = task, num_samples, seq_len, seed
        self.balanced = balanced
        task.sample(seq_len, torch.Generator().manual_seed(seed))  # validate now, not in a worker

    def __len__(self) -> int:
        return self.num_samples

    def key_index(self, index: int) -> int | None:
        """The passkey (its number) that sample ``index`` asks, or None when it is drawn at random."""
        if not self.balanced:
            return None
        keys = len(self.task.keys)
        block, place = divmod(index, keys)
        order = torch.randperm(keys, generator=torch.Generator().manual_seed(_block_seed(self.seed, block)))
        return int(order[place])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = operator.index(index)  # numpy and 0-d tensor indexes too
        if not 0 <= index < self.num_samples:
            raise IndexError(f"passkey sample {index} is out of range 0..{self.num_samples - 1}")
        generator = torch.Generator().manual_seed(self.seed + index)
        return self.task.sample(self.seq_len, generator, self.key_index(index))


def _block_seed(seed: int, block: int) -> int:
    """The seed of one block's passkey order (it may equal some sample's seed ``seed + i``: the two
    generators draw different things, a permutation and a row)."""
    return (seed * 2_654_435_761 + 97 * block + 1) % 2**63
