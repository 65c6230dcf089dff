"""Read text from disk, tokenize, and pack into fixed-length rows that keep document boundaries.

Sources: a ``.jsonl`` file (one JSON object per line, text under ``text_field``), a plain text file
(documents separated by blank lines), or a directory written by ``datasets.Dataset.save_to_disk``.
Packing concatenates documents (each ended by EOS) into rows of ``seq_len`` tokens; ``position_ids``
restart at 0 at every document start (``ds_seqpar.data`` turns that into document ids, so attention
never crosses a boundary), and the first token of each document gets no label (it is not
predictable from the previous document). A document longer than a row continues in the next row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset

from ds_seqpar.config import MissingFileError

IGNORE_INDEX = -100


def read_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of a JSONL file, a text file, or a ``save_to_disk`` dataset directory."""
    if not os.path.exists(path):
        raise MissingFileError(
            f"--data {path!r} does not exist; pass a .jsonl file, a .txt file or a dataset directory"
        )
    if os.path.isdir(path):
        from datasets import load_from_disk

        ds = load_from_disk(path)
        if hasattr(ds, "keys") and "train" in ds:
            ds = ds["train"]
        if text_field not in ds.column_names:
            raise ValueError(
                f"dataset at {path!r} has columns {ds.column_names}; choose one with --text-field"
            )
        yield from (row[text_field] for row in ds)
        return
    with open(path, encoding="utf-8") as fh:
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from None
                if text_field not in record:
                    raise ValueError(
                        f"{path}:{lineno} has no field {text_field!r} (keys: {sorted(record)}); use --text-field"
                    )
                yield record[text_field]
        else:
            yield from (doc.strip() for doc in fh.read().split("\n\n") if doc.strip())


def pack_documents(
    token_lists: list[list[int]], seq_len: int, eos_id: int | None
) -> list[dict[str, torch.Tensor]]:
    """Pack tokenized documents into rows of ``seq_len``: input_ids, labels, position_ids (restarting)."""
    ids: list[int] = []
    pos: list[int] = []
    lab: list[int] = []
    for tokens in token_lists:
        doc = list(tokens) + ([eos_id] if eos_id is not None else [])
        ids += doc
        pos += list(range(len(doc)))
        lab += [IGNORE_INDEX, *doc[1:]]
    rows = []
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        rows.append(
            {
                "input_ids": torch.tensor(ids[start : start + seq_len]),
                "labels": torch.tensor(lab[start : start + seq_len]),
                "position_ids": _restart_first_document(torch.tensor(pos[start : start + seq_len])),
            }
        )
    return rows


def _restart_first_document(pos: torch.Tensor) -> torch.Tensor:
    """A row that starts inside a document numbers that document's tokens from 0."""
    first_end = int((pos[1:] <= pos[:-1]).nonzero()[0]) + 1 if bool((pos[1:] <= pos[:-1]).any()) else len(pos)
    pos = pos.clone()
    pos[:first_end] -= pos[0].clone()
    return pos


class PackedTextDataset(Dataset):
    """Rows of ``seq_len`` tokens packed from the documents at ``path``."""

    def __init__(self, path: str, tokenizer, seq_len: int, text_field: str = "text") -> None:
        docs = [
            tokenizer(text, add_special_tokens=False)["input_ids"]
            for text in read_documents(path, text_field)
        ]
        self.rows = pack_documents(docs, seq_len, tokenizer.eos_token_id)
        if not self.rows:
            total = sum(len(d) + 1 for d in docs)
            raise ValueError(
                f"--data {path!r} has {total} tokens, fewer than one row of --seq-len {seq_len}; "
                "use a shorter --seq-len or more data"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]
