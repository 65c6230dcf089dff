"""Length-aware packing: rows whose documents run at the smallest SP degree (docs/balance.md
"Length-aware packing").

Legend: S = ``seq_len`` tokens per row, P = the SP degree, n = S / P tokens per rank, p | P a degree.

Concat-and-chunk packing (``tasks/text.py``) fills every row to the last token, cutting documents at row
ends, so most rows mix short and long documents and need the whole SP group. This packer keeps each
document whole (a document longer than S is cut into pieces of S) and groups documents by the degree they
need, the smallest p | P with ``L <= p·n``:

    documents in decreasing causal work go to the first row of their degree or more that has room, into
    its least-loaded group with room (a row of degree q has P / q groups of q·n tokens); a row of the
    document's own degree is opened when none has room. Short documents thus top up the rows of long ones
    before they fill rows of their own.

A row of degree-p documents is what ``dynamic_degree`` places in groups of p ranks (p = 1: every rank its
own documents, no attention communication). The rest of a row is padding (``attention_mask`` 0, no label).
Rows are dicts of ``input_ids``, ``labels``, ``position_ids`` (restarting per document) and
``attention_mask``, all ``[S]``; the first token of each document is unlabelled, as in ``pack_documents``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.layout.placement import document_work

IGNORE_INDEX = -100
WINDOW_DOCS = 4096  # documents packed together (consecutive in the source; bounds the search per document)

__all__ = ["degree_of", "pack_by_degree"]


def degree_of(length: int, seq_len: int, sp_size: int) -> int:
    """The smallest p | P whose groups hold a document of ``length`` tokens whole (p·n >= length)."""
    n = seq_len // sp_size
    return next(p for p in range(1, sp_size + 1) if sp_size % p == 0 and p * n >= length)


@dataclass
class _Row:
    """An open row of degree ``degree``: the documents (indices) and work of each of its P / p groups."""

    degree: int
    groups: list[list[int]]
    work: list[float]
    free: list[int]

    @classmethod
    def empty(cls, degree: int, seq_len: int, sp_size: int) -> _Row:
        groups, room = sp_size // degree, seq_len // sp_size * degree
        return cls(degree, [[] for _ in range(groups)], [0.0] * groups, [room] * groups)

    def take(self, doc: int, length: int, work: float) -> bool:
        """Put document ``doc`` in the least-loaded group with room; False when no group has room."""
        fits = [g for g in range(len(self.free)) if self.free[g] >= length]
        if not fits:
            return False
        g = min(fits, key=lambda g: (self.work[g], g))
        self.groups[g].append(doc)
        self.work[g] += work
        self.free[g] -= length
        return True


def _pieces(token_lists: Iterable[Sequence[int] | torch.Tensor], seq_len: int, eos_id: int | None):
    """Every document (EOS appended) as pieces of at most ``seq_len`` tokens: ``(tokens, is_start)``."""
    eos = torch.tensor([] if eos_id is None else [eos_id], dtype=torch.long)
    for tokens in token_lists:
        doc = torch.cat([torch.as_tensor(tokens, dtype=torch.long).reshape(-1), eos])
        for start in range(0, len(doc), seq_len):
            yield doc[start : start + seq_len], start == 0


def pack_by_degree(
    token_lists: Iterable[Sequence[int] | torch.Tensor],
    seq_len: int,
    sp_size: int,
    eos_id: int | None,
    pad_id: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Rows of ``seq_len`` tokens of whole documents, each row at one degree (module doc).

    Args:
        token_lists: the tokenized documents (no EOS; it is appended when ``eos_id`` is not None).
        seq_len: S, a multiple of ``sp_size``.
        sp_size: P, the SP degree the rows are for.
        eos_id: appended to every document, or None.
        pad_id: input id of the padding (its attention mask is 0 and it has no label).
    """
    if sp_size < 1 or seq_len < 1 or seq_len % sp_size:
        raise SeqParConfigError(
            f"length-aware packing needs rows of S tokens split evenly over the SP degree P; got S={seq_len}, "
            f"P={sp_size}; fix: a --seq-len that is a multiple of {max(sp_size, 1)}"
        )
    pieces = list(_pieces(token_lists, seq_len, eos_id))
    rows = []
    for first in range(0, len(pieces), WINDOW_DOCS):
        window = range(first, min(first + WINDOW_DOCS, len(pieces)))
        rows += [_row(row, pieces, seq_len, pad_id) for row in _pack_window(window, pieces, seq_len, sp_size)]
    return rows


def _pack_window(docs: range, pieces: list, seq_len: int, sp_size: int) -> list[_Row]:
    """First fit in decreasing work: each document into the first open row of its degree or more that
    has a group with room (the least-loaded such group), else a new row of its own degree."""
    works = {d: float(document_work(len(pieces[d][0]), None)) for d in docs}
    rows: list[_Row] = []
    for d in sorted(docs, key=lambda d: (-works[d], d)):
        length = len(pieces[d][0])
        degree = degree_of(length, seq_len, sp_size)
        if not any(row.degree >= degree and row.take(d, length, works[d]) for row in rows):
            rows.append(_Row.empty(degree, seq_len, sp_size))
            rows[-1].take(d, length, works[d])
    return rows


def _row(row: _Row, pieces: list, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row: its documents one after another (group by group, each in source order), then padding."""
    ids, labels, positions = [], [], []
    for d in (d for group in row.groups for d in sorted(group)):
        tokens, is_start = pieces[d]
        label = tokens.clone()
        if is_start:
            label[0] = IGNORE_INDEX
        ids.append(tokens)
        labels.append(label)
        positions.append(torch.arange(len(tokens)))
    used = sum(len(t) for t in ids)
    pad = seq_len - used
    mask = torch.cat([torch.ones(used, dtype=torch.long), torch.zeros(pad, dtype=torch.long)])
    return {
        "input_ids": torch.cat([*ids, torch.full((pad,), pad_id, dtype=torch.long)]),
        "labels": torch.cat([*labels, torch.full((pad,), IGNORE_INDEX, dtype=torch.long)]),
        "position_ids": torch.cat([*positions, torch.arange(pad)]),
        "attention_mask": mask,
    }
