"""What every token layout is: which global positions each rank holds, and what follows from that.

Legend: S = global sequence length, P = ranks in the layout (``world``), n = S / P local tokens.

A layout answers three questions and derives everything else from them:

    local_positions(S, r)   global positions of rank r's tokens, in its local order: int64 ``[n]``
    segments(S)             local index ranges that are runs of consecutive positions (the attention
                            engine classifies blocks per segment pair, so masks need no layout code)
    multiple                what S must be a multiple of; ``check_length`` names it and the padded length

``shard`` / ``unshard`` / ``permutation`` and ``scan_chain`` (the order of all ranks' segments along the
sequence, for the recurrent scans) are written once here from ``local_positions``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Layout", "LayoutError", "padded_length"]


class LayoutError(ValueError):
    """A length, rank or tensor that a layout cannot handle; the message says what to change."""


def padded_length(seq_len: int, multiple: int) -> int:
    """The smallest positive multiple of ``multiple`` that is >= ``seq_len``."""
    return max(multiple, -(-seq_len // multiple) * multiple)


class Layout:
    """Shared by every layout: everything follows from ``local_positions``, ``segments`` and ``world``."""

    world: int

    @property
    def multiple(self) -> int:
        raise NotImplementedError

    def local_positions(self, seq_len: int, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def segments(self, seq_len: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def described(self) -> str:
        """What the length error says splits the sequence (e.g. ``layout='zigzag' over 4 ranks``)."""
        raise NotImplementedError

    def for_batch(self, doc_ids: torch.Tensor | None) -> Layout:
        """The layout of a batch whose document ids (global order, ``[S]`` / ``[B, S]``) are ``doc_ids``:
        this layout itself, unless it places each batch's documents (``layout/placement.py``)."""
        return self

    @property
    def needs_exchange(self) -> bool:
        """Whether some rank's queries see another rank's keys (False: a document placement that keeps
        every document on one rank; the attention then runs on each rank alone)."""
        return True

    @property
    def group_degree(self) -> int | None:
        """None: the whole SP group runs the batch's attention together (Ulysses x ring). p: the batch runs
        in groups of p ranks, each over whole documents of its own (a dynamic SP degree,
        ``layout/grouped.py``)."""
        return None

    def length_rule(self) -> str:
        """Why S must be a multiple of ``multiple``, for the length error."""
        return str(self.multiple)

    def check_length(self, seq_len: int) -> None:
        """Raise ``LayoutError`` naming the length, the required multiple and the padded length."""
        mult = self.multiple
        if seq_len < 1 or seq_len % mult != 0:
            raise LayoutError(
                f"sequence length {seq_len} cannot be split by {self.described()}: it must be a multiple of "
                f"{self.length_rule()}; pad it to {padded_length(seq_len, mult)} (ds_seqpar.data pads for you) "
                "or change the layout"
            )

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise LayoutError(
                f"rank={rank} is outside the layout's {self.world} ranks; valid: 0..{self.world - 1}"
            )

    def permutation(self, seq_len: int) -> torch.Tensor:
        """All ranks' positions concatenated in rank order: ``x[:, perm]`` is the sharded order."""
        return torch.cat([self.local_positions(seq_len, r) for r in range(self.world)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """This rank's part of a global tensor ``x`` (sequence along ``dim``)."""
        seq_len = x.shape[dim]
        return x.index_select(dim, self.local_positions(seq_len, rank).to(x.device))

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassemble the global tensor from every rank's shard (rank order)."""
        if len(shards) != self.world:
            raise LayoutError(f"unshard got {len(shards)} shards for a layout over {self.world} ranks")
        stacked = torch.cat(list(shards), dim=dim)
        perm = self.permutation(stacked.shape[dim]).to(stacked.device)
        return stacked.index_select(dim, torch.argsort(perm))

    def scan_chain(self) -> tuple[int, ...] | None:
        """The rank holding each segment along the sequence (every segment a run of consecutive
        positions, each rank's segments in increasing order), or None when the layout's runs depend on
        S (stripes: S / G runs) or are not consecutive. What a recurrent scan hands its state along."""
        chains = {self._chain(k * self.multiple) for k in (2, 3)}  # the same at every length, or no chain
        return chains.pop() if len(chains) == 1 else None

    def _chain(self, seq_len: int) -> tuple[int, ...] | None:
        runs = []
        for rank in range(self.world):
            pos = self.local_positions(seq_len, rank)
            starts = []
            for a, b in self.segments(seq_len):
                run = pos[a:b]
                if not torch.equal(run, torch.arange(int(run[0]), int(run[0]) + b - a)):
                    return None
                starts.append(int(run[0]))
            if starts != sorted(starts):
                return None
            runs += [(start, rank) for start in starts]
        return tuple(rank for _, rank in sorted(runs))
