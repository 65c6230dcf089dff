"""``all_gather``: all-gather K/V over the ring group, reduce-scatter dK/dV back to the owners (Llama-3 CP).

Suited to irregular packed batches and the most accurate (no travelling accumulators). Bytes per peer
(docs/comm_model.md): to every other member, forward 2E_kv·b (all_gather); backward 2E_kv·b (all_gather)
+ 2E_kv·a (reduce_scatter). Rounds: 1 forward, 2 backward.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch

from ds_seqpar.comm.collectives import all_gather_single, reduce_scatter_single
from ds_seqpar.comm.layer_bytes import LayerShape, PeerBytes, add_bytes
from ds_seqpar.comm.p2p import Block, Payload
from ds_seqpar.comm.schedules.base import RingParams, ScheduleSpec
from ds_seqpar.comm.stats import CommStats

__all__ = ["AllGatherSchedule", "AllGatherSpec"]


class AllGatherSchedule:
    """All-gather K/V over the ring group; reduce-scatter dK/dV back to the owners.

    Args:
        group: ring process group; members: its global ranks in ring order; index: this rank's
        position; stats: counter (kinds ``"all_gather"`` and ``"reduce_scatter"``).
    """

    def __init__(
        self, group: object, members: Sequence[int], index: int, stats: CommStats | None = None
    ) -> None:
        self.group = group
        self.members = list(members)
        self.index = index
        self.stats = stats

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def ring_rank(self) -> int:
        return self.index

    def _gather(self, kv: Payload) -> list[Payload]:
        """Every rank's payload, indexed by ring rank: one all-gather of the stacked payload."""
        if self.size == 1:
            return [kv]
        stacked = torch.stack(kv)  # [T, ...]: K and V travel in one collective
        out = stacked.new_empty((self.size * len(kv), *stacked.shape[1:]))
        all_gather_single(out, stacked, group=self.group)
        if self.stats is not None:
            self.stats.record_tensors("all_gather", stacked, peers=self._peers())
        gathered = out.view(self.size, *stacked.shape)
        return [tuple(gathered[j]) for j in range(self.size)]

    def _peers(self) -> list[int]:
        return [m for j, m in enumerate(self.members) if j != self.index]

    def _order(self) -> list[int]:
        """Own block first, then the others (the same order as the ring's first step)."""
        return [(self.index - s) % self.size for s in range(self.size)]

    def forward(self, kv: Payload) -> Iterator[Block]:
        blocks = self._gather(kv)
        for j in self._order():
            yield j, blocks[j]

    def incoming(self) -> None:
        """No accumulator travels: gradients are summed here and reduce-scattered at the end."""
        return None

    def backward(self, kv: Payload) -> Generator[Block, list[torch.Tensor], Payload]:
        blocks = self._gather(kv)
        sums: torch.Tensor | None = None  # [R, T, ...]: gradients for every owner's payload
        for j in self._order():
            grads = yield j, blocks[j]
            if sums is None:
                sums = grads[0].new_zeros((self.size, len(grads), *grads[0].shape))
            sums[j] += torch.stack(grads)
            grads.clear()
        assert sums is not None
        if self.size == 1:
            return tuple(sums[0])
        local = sums.new_empty(sums.shape[1:])
        reduce_scatter_single(local, sums.flatten(0, 1), group=self.group)  # dK and dV in one collective
        if self.stats is not None:
            self.stats.record_tensors("reduce_scatter", local, peers=self._peers())
        return tuple(local)


class AllGatherSpec(ScheduleSpec):
    """The ``all_gather`` schedule (one level: no double ring)."""

    name = "all_gather"
    summary = "Llama-3 style all-gather K/V + reduce-scatter dK/dV; for irregular packed batches"
    sparse_ring = True

    def check_section(self, ring: Any) -> None:
        if ring.inner_size is not None:
            raise ValueError(
                f"sequence_parallel.ring.inner_size={ring.inner_size} needs ring.schedule='p2p' (a double "
                "ring is a P2P schedule); valid: ring.inner_size=null or ring.schedule='p2p'"
            )

    def build(self, mesh: Any, params: RingParams) -> AllGatherSchedule:
        return AllGatherSchedule(
            mesh.group("ring"), mesh.members["ring"], mesh.coords.ring_rank, mesh.comm_stats
        )

    def cache_key(self, params: RingParams) -> tuple:
        return (self.name,)

    def peer_bytes(self, shape: LayerShape, params: RingParams, rank: int, backward: bool) -> PeerBytes:
        kv, out = 2 * shape.kv_elements, {}
        for peer in range(params.ring):
            add_bytes(out, rank, peer, "all_gather", kv * shape.element_bytes)
            if backward:
                add_bytes(out, rank, peer, "reduce_scatter", kv * shape.acc_bytes)
        return out

    def rounds(self, params: RingParams, backward: bool) -> int:
        return 2 if backward else 1
