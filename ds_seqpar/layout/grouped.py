"""A dynamic SP degree: the SP group split into groups of p ranks, each holding whole documents
(docs/balance.md "A dynamic SP degree").

Legend: S tokens in the row, P SP ranks, n = S / P tokens per rank, p | P the batch's degree, G = P / p
groups (group g = SP ranks g·p .. g·p + p − 1), L_d the document lengths.

Each group receives whole documents, p·n tokens in all (its *sub-row*: its documents in row order, then its
share of the padding), so no query of one group sees a key of another. Inside a group the sub-row is placed
on its p ranks by ``place_documents`` (head-tail pieces of long documents). At p = 1 every rank attends
over its own tokens alone; at 1 < p < P the group runs a ring of p ranks.

    place_in_groups(lengths, S, P, p)    documents -> groups (least work with room first), or None when a
                                         document exceeds p·n tokens or no group has room for one
    dynamic_placement(lengths, S, P)     the smallest p < P whose plan has max / mean work within the
                                         tolerance, or None (the batch then runs at degree P)

Pure: no process group; every rank computes the same plan from the same lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds_seqpar.layout.base import LayoutError
from ds_seqpar.layout.documents import document_lengths
from ds_seqpar.layout.placement import (
    PLACEMENT_TOLERANCE,
    PlacedRow,
    Placement,
    Run,
    check_lengths,
    document_work,
    per_batch,
    place_documents,
)

__all__ = ["GroupedPlacement", "dynamic_placement", "grouped_for_batch", "place_in_groups"]


@dataclass(frozen=True)
class GroupedPlacement(PlacedRow):
    """A row placed on ``P = len(rows) · p`` ranks in groups of p: group g holds the global positions
    ``rows[g]`` (its sub-row, runs in increasing order), placed on its ranks by ``parts[g]`` (a
    ``Placement`` over p ranks in sub-row coordinates). SP rank r = g·p + c holds ``parts[g]``'s rank c."""

    rows: tuple[tuple[Run, ...], ...]
    parts: tuple[Placement, ...]
    seq_len: int

    name = "documents"
    replan = "ds_seqpar.layout.dynamic_placement"

    def __post_init__(self) -> None:
        sizes = {sum(b - a for a, b in row) for row in self.rows}
        flat = sorted(run for row in self.rows for run in row)
        covered = all(flat[i][1] == flat[i + 1][0] for i in range(len(flat) - 1))
        if len(self.rows) != len(self.parts) or len(sizes) != 1 or not flat or not covered:
            raise LayoutError("a GroupedPlacement needs one part per group and groups of equal size")
        if (
            flat[0][0] != 0
            or flat[-1][1] != self.seq_len
            or {part.world for part in self.parts} != {self.degree}
        ):
            raise LayoutError(
                f"a GroupedPlacement must cover positions 0..{self.seq_len - 1} with parts of p ranks"
            )
        if sizes.pop() != self.parts[0].seq_len:
            raise LayoutError("every part of a GroupedPlacement places its group's whole sub-row")

    @property
    def degree(self) -> int:
        """p: ranks per group."""
        return self.parts[0].world

    @property
    def group_degree(self) -> int:
        return self.degree

    @property
    def world(self) -> int:  # type: ignore[override]
        return len(self.rows) * self.degree

    @property
    def work(self) -> tuple[float, ...]:
        """Each SP rank's planned attention work, in rank order."""
        return tuple(w for part in self.parts for w in part.work)

    @property
    def needs_exchange(self) -> bool:
        return any(part.needs_exchange for part in self.parts)

    def described(self) -> str:
        return f"a document placement of {self.seq_len} tokens over {len(self.rows)} groups of {self.degree} ranks"

    def group_positions(self, group: int) -> torch.Tensor:
        """Global positions of group ``group``'s sub-row, in sub-row order: int64 ``[p · n]``."""
        return torch.cat([torch.arange(a, b) for a, b in self.rows[group]])

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check_length(seq_len)
        self.check_rank(rank)
        group, member = divmod(rank, self.degree)
        part = self.parts[group]
        return self.group_positions(group)[part.local_positions(part.seq_len, member)]

    def group_doc_ids(self, doc_ids: torch.Tensor, group: int) -> torch.Tensor:
        """Group ``group``'s document ids in sub-row order (``[p·n]`` / ``[B, p·n]``), once per tensor."""
        key = ("group", id(doc_ids), doc_ids._version, group, self)
        positions = self.group_positions
        return per_batch(key, doc_ids, lambda: doc_ids.index_select(-1, positions(group).to(doc_ids.device)))


def place_in_groups(
    lengths: Sequence[int],
    seq_len: int,
    world: int,
    degree: int,
    *,
    window: int | None = None,
    tolerance: float = PLACEMENT_TOLERANCE,
) -> GroupedPlacement | None:
    """Whole documents on ``world // degree`` groups of ``degree`` ranks (module doc), or None when some
    document cannot go whole to one group."""
    docs = check_lengths(lengths, seq_len, world)
    if degree < 1 or world % degree:
        raise LayoutError(f"degree={degree} must divide the {world} ranks of the group (1 <= p | P)")
    groups, room = world // degree, seq_len // world * degree
    if max(docs, default=0) > room:
        return None
    starts = [0]
    for length in docs:
        starts.append(starts[-1] + length)
    works = [document_work(length, window) for length in docs]
    members: list[list[int]] = [[] for _ in range(groups)]
    load, free = [0.0] * groups, [room] * groups
    for d in sorted(range(len(docs)), key=lambda d: (-works[d], d)):
        fits = [g for g in range(groups) if free[g] >= docs[d]]
        if not fits:
            return None
        g = min(fits, key=lambda g: (load[g], g))
        members[g].append(d)
        load[g] += works[d]
        free[g] -= docs[d]
    rows, parts, padding = [], [], starts[-1]
    for g in range(groups):
        mine = sorted(members[g])
        runs = [(starts[d], starts[d] + docs[d]) for d in mine]
        if free[g]:
            runs.append((padding, padding + free[g]))
            padding += free[g]
        rows.append(tuple(runs))
        parts.append(
            place_documents([docs[d] for d in mine], room, degree, window=window, tolerance=tolerance)
        )
    return GroupedPlacement(tuple(rows), tuple(parts), seq_len)


def dynamic_placement(
    lengths: Sequence[int],
    seq_len: int,
    world: int,
    *,
    window: int | None = None,
    tolerance: float = PLACEMENT_TOLERANCE,
) -> GroupedPlacement | None:
    """The plan of the smallest degree p < ``world`` (p | world) whose max / mean work is within
    ``tolerance``, or None: the batch then needs the whole group (degree P)."""
    for degree in (p for p in range(1, world) if world % p == 0):
        plan = place_in_groups(lengths, seq_len, world, degree, window=window, tolerance=tolerance)
        if plan is not None and plan.balance <= tolerance:
            return plan
    return None


def grouped_for_batch(doc_ids: torch.Tensor, world: int) -> GroupedPlacement | None:
    """``dynamic_placement`` of ``doc_ids``'s documents (``[S]`` / ``[B, S]``, rows alike) over ``world``
    SP ranks, once per tensor; None when the batch needs all of them."""
    key = ("grouped", id(doc_ids), doc_ids._version, world)
    return per_batch(
        key, doc_ids, lambda: dynamic_placement(document_lengths(doc_ids), doc_ids.shape[-1], world)
    )
