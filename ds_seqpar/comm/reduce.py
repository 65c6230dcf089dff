"""Small in-place reductions over one process group, with their bytes recorded.

Used by pattern estimation (``ops/sparse/pattern.py`` takes any object with ``sum_`` / ``max_`` /
``broadcast_``): the ranks that share a sequence complete each other's partial scores.
Bytes recorded (kinds ``"all_reduce"`` and ``"broadcast"``): the tensor size per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats


class GroupReducer:
    """``sum_`` / ``max_`` (all-reduce) and ``broadcast_`` (from the group's first member) over ``group``.

    Args:
        group: the process group; members: its global ranks (``members[0]`` is the broadcast source).
        stats: optional byte counter.
    """

    def __init__(self, group: object, members: Sequence[int], stats: CommStats | None = None) -> None:
        self.group = group
        self.members = list(members)
        self.stats = stats

    def _record(self, kind: str, t: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.record_tensors(kind, t)

    def sum_(self, t: torch.Tensor) -> None:
        if len(self.members) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            self._record("all_reduce", t)

    def max_(self, t: torch.Tensor) -> None:
        if len(self.members) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            self._record("all_reduce", t)

    def broadcast_(self, t: torch.Tensor) -> None:
        if len(self.members) > 1:
            dist.broadcast(t, src=self.members[0], group=self.group)
            self._record("broadcast", t)
