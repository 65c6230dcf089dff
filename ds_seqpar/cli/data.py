"""``train.py``'s data: the training sets of the curriculum's phases and the held-out set (the embedded
passkey task, or packed text from --data; masked for --objective mlm), and the endless batch stream.

``--data`` is read, checked and tokenized once, by ``parse_args`` before any process group
(``args.data_tokens``); each phase packs those tokens into its rows."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch

from ds_seqpar.cli.args import MLM_PROBABILITY, PASSKEY_PREFIX, PASSKEY_QUESTIONS, PASSKEYS

__all__ = ["batches", "datasets"]


def datasets(
    args: argparse.Namespace, tokenizer: Any, num_train: int, model: Any = None
) -> tuple[list[Any], Any]:
    """One training dataset per curriculum phase, and the held-out set (at ``--seq-len``); masked per
    sample for ``--objective mlm`` (the held-out set with another seed); multimodal records (read by
    ``parse_args``) packed with ``model``'s positions (cli/vlm)."""
    if getattr(args, "vlm_records", None) is not None:
        from ds_seqpar.cli.vlm.cli import vlm_datasets

        return vlm_datasets(args, model, tokenizer.pad_token_id or 0)
    train, held = _token_datasets(args, tokenizer, num_train)
    if args.objective != "mlm":
        return train, held
    from ds_seqpar.tasks.masking import MaskedAnswers, MaskedLMDataset

    if args.data is None:  # the passkey rows: mask the answers, fill them from the far-away passkey
        return [MaskedAnswers(d, mask_token_id=tokenizer.mask_token_id) for d in train], MaskedAnswers(
            held, mask_token_id=tokenizer.mask_token_id
        )

    def masked(data: Any, seed: int) -> MaskedLMDataset:
        return MaskedLMDataset(
            data,
            mask_token_id=tokenizer.mask_token_id,
            vocab_size=len(tokenizer),
            probability=MLM_PROBABILITY,
            special_ids=tokenizer.all_special_ids,
            seed=seed,
        )

    return [masked(d, args.seed * 7 + i) for i, d in enumerate(train)], masked(held, 10**6 + args.seed)


def _token_datasets(args: argparse.Namespace, tokenizer: Any, num_train: int) -> tuple[list[Any], Any]:
    from ds_seqpar.tasks.passkey import PasskeyDataset, PasskeyTask
    from ds_seqpar.tasks.text import PackedTextDataset

    if args.data is None:
        task = PasskeyTask(
            tokenizer, num_questions=PASSKEY_QUESTIONS, num_keys=PASSKEYS, prefix=PASSKEY_PREFIX
        )
        train = [
            PasskeyDataset(task, num_train, seq_len, seed=args.seed * 1_000_003 + 7919 * i)
            for i, (seq_len, _) in enumerate(args.phases)
        ]
        return train, PasskeyDataset(task, args.eval_samples, args.seq_len, seed=10**9 + args.seed)
    train, held = [], None
    for seq_len, _ in args.phases:
        tokens = getattr(args, "data_tokens", None)  # read and checked by parse_args
        data = PackedTextDataset(
            args.data, tokenizer, seq_len, args.text_field, tokens, args.packing, args.settings.size
        )
        n_eval = min(args.eval_samples, max(1, len(data) // 10))
        train.append(torch.utils.data.Subset(data, range(len(data) - n_eval)) if len(data) > n_eval else data)
        if seq_len == args.seq_len:
            held = torch.utils.data.Subset(data, range(len(data) - n_eval, len(data)))
    return train, held


def batches(loader: Any, skip: int) -> Iterator[dict[str, Any]]:
    """Endless batches of ``loader`` (one epoch after another), the first ``skip`` ones dropped (resume)."""
    epoch, index = divmod(skip, len(loader))
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            if index:
                index -= 1
                continue
            yield batch
        epoch += 1
