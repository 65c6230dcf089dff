"""``train.py --eval-data FILE``: a held-out text set, packed at ``--seq-len`` like ``--data`` and evaluated
(loss, perplexity, accuracy) at the same steps as the built-in evaluation (docs/train.md, "Held-out
perplexity").

The file is read, tokenized and checked by ``parse_args`` (``check_eval_data``), before any process
group: a missing file, an unreadable one or one with fewer tokens than one row raises by name.
"""

from __future__ import annotations

import argparse
from typing import Any

from ds_seqpar.errors import SeqParConfigError

__all__ = ["add_eval_data_flag", "check_eval_data", "heldout_dataset"]


def add_eval_data_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eval-data",
        default=None,
        help="held-out text (same formats as --data), packed at --seq-len: its loss and perplexity are logged "
        "at every evaluation (metrics.jsonl heldout_loss, heldout_ppl; causal objective only)",
    )


def check_eval_data(args: argparse.Namespace, tokenizer: Any, parser: argparse.ArgumentParser) -> Any:
    """``--eval-data`` read, tokenized and checked (None without it): at least one row of ``--seq-len``."""
    import os

    from ds_seqpar.tasks.text import load_documents, tokenize_documents

    path = args.eval_data
    if path is None:
        return None
    if not os.path.exists(path):
        parser.error(f"--eval-data {path!r} does not exist")
    if args.objective != "causal":
        parser.error(
            f"--eval-data measures next-token perplexity; --objective {args.objective} has none: drop --eval-data "
            "(the masked-token accuracy is in eval_accuracy)"
        )
    try:
        tokens = tokenize_documents(load_documents(path, args.text_field), tokenizer, path)
    except SeqParConfigError as exc:  # its messages name --data; this is --eval-data
        raise SeqParConfigError(str(exc).replace(f"--data {path}", f"--eval-data {path}", 1)) from exc
    if tokens.rows(args.seq_len, tokenizer.eos_token_id) < 1:
        total = len(tokens.ids) + (len(tokens.lengths) if tokenizer.eos_token_id is not None else 0)
        raise SeqParConfigError(
            f"--eval-data {path}: {total} tokens in {len(tokens.lengths)} documents, fewer than one row of "
            f"--seq-len {args.seq_len}; fix: more held-out text, or a shorter --seq-len"
        )
    return tokens


def heldout_dataset(args: argparse.Namespace, tokenizer: Any) -> Any:
    """The packed rows of ``--eval-data`` at ``--seq-len`` (``--packing`` as for --data), or None."""
    from ds_seqpar.tasks.text import PackedTextDataset

    if args.eval_data is None:
        return None
    return PackedTextDataset(
        args.eval_data,
        tokenizer,
        args.seq_len,
        args.text_field,
        args.eval_tokens,
        args.packing,
        args.settings.size,
    )
