"""Read text from disk, tokenize, and pack into fixed-length rows that keep document boundaries.

Sources: a ``.jsonl`` (or ``.json``) file of JSON Lines (one object per line, text under
``text_field``), a plain text file (documents separated by blank lines), or a directory written by
``datasets.Dataset.save_to_disk``. Files must be UTF-8 (a leading byte-order mark is accepted). Every
defect of the input (bytes that are not UTF-8, a line that is not a JSON object, a missing or
non-string field, no text at all) raises a ``SeqParConfigError`` naming the file, the line and the
fix. Blank documents are skipped.

Packing concatenates documents (each ended by EOS) into rows of ``seq_len`` tokens; ``position_ids``
restart at 0 at every document start (``ds_seqpar.data`` turns that into document ids, so attention
never crosses a boundary), and the first token of each document gets no label (it is not
predictable from the previous document). A document longer than a row continues in the next row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from ds_seqpar.errors import MissingFileError, SeqParConfigError

IGNORE_INDEX = -100
JSON_LINES = (".jsonl", ".json")
TOKENIZE_BATCH = 1024  # documents per tokenizer call
_BOM = b"\xef\xbb\xbf"
_JSON_KINDS = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


def read_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Yield the text of every record of a JSONL file, a text file, or a ``save_to_disk`` directory
    (blank ones included); a defect of the input raises ``SeqParConfigError`` naming file and line."""
    if not os.path.exists(path):
        raise MissingFileError(
            f"--data {path!r} does not exist; pass a .jsonl file, a .txt file or a dataset directory"
        )
    if os.path.isdir(path):
        yield from _dataset_rows(path, text_field)
    elif path.endswith(JSON_LINES):
        yield from _json_lines(path, text_field)
    else:
        yield from _text_documents(path)


def load_documents(path: str, text_field: str = "text") -> list[str]:
    """The non-blank documents at ``path``; refuses a source with no text in any record."""
    records = 0
    texts = []
    for text in read_documents(path, text_field):
        records += 1
        if text.strip():
            texts.append(text)
    if not texts:
        raise SeqParConfigError(f"--data {path}: {_where_empty(path, text_field, records)}")
    return texts


def _where_empty(path: str, text_field: str, records: int) -> str:
    """The message of a source without text: where it looked, and the fix."""
    fix = "fix: pass a source that holds text, or name the field that holds it with --text-field"
    if os.path.isdir(path):
        where = f"no text in column {text_field!r} in any of its {records} rows"
    elif path.endswith(JSON_LINES):
        where = f"no text in field {text_field!r} in any of its {records} lines"
    else:
        with open(path, "rb") as fh:
            where = f"no text in any of its {sum(1 for _ in fh)} lines"
        fix = "fix: pass a file that holds text (documents separated by blank lines)"
    return f"{where} (blank or whitespace only); {fix}"


def _decode(data: bytes, path: str, offset: int = 0) -> str:
    """``data`` (bytes of the file from byte ``offset`` on) as UTF-8 (a leading byte-order mark dropped);
    bytes that are not UTF-8 raise with their line and byte offset in the file."""
    body = data[len(_BOM) :] if offset == 0 and data.startswith(_BOM) else data
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start + len(data) - len(body)
        stem, ext = os.path.splitext(path)
        with open(path, "rb") as fh:
            lineno = fh.read(offset + at).count(b"\n") + 1
        raise SeqParConfigError(
            f"{path}:{lineno}: byte 0x{data[at]:02x} at byte offset {offset + at} of the file is not UTF-8 "
            f"({exc.reason}); --data must be UTF-8; fix: re-encode the file to UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > {stem}.utf8{ext} (if it is Latin-1)"
        ) from None


def _json_kind(value: Any) -> str:
    kind = _JSON_KINDS.get(type(value), "number")
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"a JSON {kind} ({shown})"


def _json_lines(path: str, text_field: str) -> Iterator[str]:
    """The ``text_field`` string of each non-empty line of a JSON Lines file."""
    example = json.dumps({text_field: "..."})
    with open(path, "rb") as fh:
        offset = 0
        for lineno, raw in enumerate(fh, 1):
            line = _decode(raw, path, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SeqParConfigError(
                    f"{path}:{lineno} is not valid JSON ({exc.msg} at column {exc.colno}); each line of a "
                    f"JSON Lines file must be one object such as {example}"
                ) from None
            if not isinstance(record, dict):
                raise SeqParConfigError(
                    f"{path}:{lineno} is {_json_kind(record)}, not a JSON object; each line must be one "
                    f"object with the text in field {text_field!r}, such as {example}"
                )
            if text_field not in record:
                raise SeqParConfigError(
                    f"{path}:{lineno} has no field {text_field!r} (its fields: {sorted(record)}); fix: "
                    "--text-field FIELD names the field that holds the text"
                )
            yield _text_value(record[text_field], f"{path}:{lineno}: field {text_field!r}")


def _text_value(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SeqParConfigError(
            f"{where} is {_json_kind(value)}, not a string; fix: store the text as a string, or name the "
            "field that holds it with --text-field"
        )
    return value


def _text_documents(path: str) -> Iterator[str]:
    """The documents of a plain text file: runs of lines separated by blank lines."""
    with open(path, "rb") as fh:
        text = _decode(fh.read(), path)
    yield from (doc.strip() for doc in text.replace("\r\n", "\n").replace("\r", "\n").split("\n\n"))


def _dataset_rows(path: str, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of a ``save_to_disk`` directory (its ``train`` split if it has splits)."""
    from datasets import load_from_disk

    try:
        ds = load_from_disk(path)
    except (OSError, ValueError) as exc:
        raise SeqParConfigError(
            f"--data {path}: a directory must be one written by datasets' save_to_disk ({exc}); fix: pass "
            "that directory, or a .jsonl or .txt file"
        ) from None
    if hasattr(ds, "keys"):
        if "train" not in ds:
            raise SeqParConfigError(
                f"--data {path}: a dataset with splits {sorted(ds)} and no 'train' split; fix: save the "
                "split to train on by itself (or under the name 'train')"
            )
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise SeqParConfigError(
            f"--data {path}: the dataset has columns {ds.column_names}, not {text_field!r}; fix: name the "
            "column with --text-field"
        )
    for index, value in enumerate(ds[text_field]):
        yield _text_value(value, f"--data {path}: row {index}, column {text_field!r}")


@dataclass(frozen=True)
class TokenizedText:
    """The tokens of a source's documents: ``ids`` (1-D int64, the documents one after another, no EOS)
    and ``lengths`` (tokens per document, every one >= 1)."""

    source: str
    ids: torch.Tensor
    lengths: list[int]

    def documents(self) -> tuple[torch.Tensor, ...]:
        """One 1-D tensor per document (views of ``ids``)."""
        return self.ids.split(self.lengths)

    def rows(self, seq_len: int, eos_id: int | None) -> int:
        """How many rows of ``seq_len`` packing makes (each document ended by EOS, if any)."""
        return (len(self.ids) + (len(self.lengths) if eos_id is not None else 0)) // seq_len

    def require_rows(self, seq_len: int, eos_id: int | None) -> None:
        """Refuse a source too short for one row of ``seq_len``."""
        if self.rows(seq_len, eos_id) < 1:
            total = len(self.ids) + (len(self.lengths) if eos_id is not None else 0)
            raise SeqParConfigError(
                f"--data {self.source}: {total} tokens in {len(self.lengths)} documents, fewer than one row "
                f"of --seq-len {seq_len}; fix: a shorter --seq-len (or --curriculum), or more data"
            )


def tokenize_documents(texts: Sequence[str], tokenizer: Any, source: str) -> TokenizedText:
    """The tokens of ``texts`` (no special tokens); documents with no token are dropped. Refuses a
    source none of whose documents has a token."""
    ids: list[torch.Tensor] = []
    lengths: list[int] = []
    for first in range(0, len(texts), TOKENIZE_BATCH):
        batch = tokenizer(list(texts[first : first + TOKENIZE_BATCH]), add_special_tokens=False)
        for tokens in batch["input_ids"]:
            if len(tokens):
                ids.append(torch.as_tensor(tokens, dtype=torch.long))
                lengths.append(len(tokens))
    if not lengths:
        raise SeqParConfigError(
            f"--data {source}: the tokenizer makes no token of any of its {len(texts)} documents; fix: "
            "pass a source that holds text, or the model whose tokenizer reads it"
        )
    return TokenizedText(source, torch.cat(ids), lengths)


def pack_documents(
    token_lists: Iterable[Sequence[int] | torch.Tensor], seq_len: int, eos_id: int | None
) -> list[dict[str, torch.Tensor]]:
    """Pack tokenized documents into rows of ``seq_len``: input_ids, labels, position_ids (restarting);
    the tail shorter than a row is dropped."""
    eos = torch.tensor([] if eos_id is None else [eos_id], dtype=torch.long)
    docs = [torch.cat([torch.as_tensor(t, dtype=torch.long).reshape(-1), eos]) for t in token_lists]
    docs = [d for d in docs if len(d)]
    if not docs:
        return []
    ids = torch.cat(docs)
    lengths = torch.tensor([len(d) for d in docs])
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(len(ids)) - torch.repeat_interleave(starts, lengths)
    labels = ids.clone()
    labels[starts] = IGNORE_INDEX
    rows = []
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        row = slice(start, start + seq_len)
        rows.append(
            {
                "input_ids": ids[row].clone(),
                "labels": labels[row].clone(),
                "position_ids": _restart_first_document(pos[row]),
            }
        )
    return rows


def _restart_first_document(pos: torch.Tensor) -> torch.Tensor:
    """A row that starts inside a document numbers that document's tokens from 0."""
    first_end = int((pos[1:] <= pos[:-1]).nonzero()[0]) + 1 if bool((pos[1:] <= pos[:-1]).any()) else len(pos)
    pos = pos.clone()
    pos[:first_end] -= pos[0].clone()
    return pos


PACKINGS = ("fixed", "balanced")


class PackedTextDataset(Dataset):
    """Rows of ``seq_len`` tokens packed from the documents at ``path`` (or from ``tokens``, that
    source already tokenized: ``train.py`` reads and checks ``--data`` before any process group).

    ``packing``: ``"fixed"`` (concat-and-chunk, ``pack_documents``: every row full, documents cut at row
    ends) or ``"balanced"`` (whole documents grouped by the SP degree they need, ``tasks/packing.py``;
    needs ``sp_size``)."""

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        seq_len: int,
        text_field: str = "text",
        tokens: TokenizedText | None = None,
        packing: str = "fixed",
        sp_size: int = 1,
    ) -> None:
        if packing not in PACKINGS:
            raise SeqParConfigError(f"packing={packing!r} is not valid; valid: {', '.join(PACKINGS)}")
        if tokens is None:
            tokens = tokenize_documents(load_documents(path, text_field), tokenizer, path)
        tokens.require_rows(seq_len, tokenizer.eos_token_id)
        if packing == "fixed":
            self.rows = pack_documents(tokens.documents(), seq_len, tokenizer.eos_token_id)
        else:
            from ds_seqpar.tasks.packing import pack_by_degree

            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            self.rows = pack_by_degree(tokens.documents(), seq_len, sp_size, tokenizer.eos_token_id, pad)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]
