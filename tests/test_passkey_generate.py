"""``benchmarks/passkey_generate.py``'s prompts: S tokens ending on the first ``?``, the answer the row's passkey."""

from __future__ import annotations

import pytest
import torch

from benchmarks.passkey_generate import generate_kwargs, passkey_prompts
from ds_seqpar.cli.args import DEFAULT_MODEL


def test_prompts_end_on_the_question_and_answers_are_the_passkeys():
    prompts, answers, keys = passkey_prompts(str(DEFAULT_MODEL), 512, 16, seed=7)
    assert prompts.shape == (16, 512) and keys == 8
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL)).get_vocab()
    assert bool((prompts[:, -1] == vocab["?"]).all())
    assert int((prompts == vocab["?"]).sum()) == 16  # only the first question is in the prompt
    for row, answer in zip(prompts, answers, strict=True):
        first = int(torch.nonzero(row == answer)[0])
        assert bool((row[first : first + 8] == answer).all()) and int((row == answer).sum()) == 8
        assert first + 8 <= (512 + 127) // 2  # in the first half of the row the prompt is cut from
    assert sorted(answers) == sorted(answers[:8] * 2) and len(set(answers)) == 8  # each passkey twice


def test_exact_mode_takes_no_parameters():
    assert generate_kwargs("exact", {}) == {"prefill_mode": "exact"}
    with pytest.raises(SystemExit, match="takes no --mode-param"):
        generate_kwargs("exact", {"budget": "4"})
