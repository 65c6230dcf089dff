"""All-Scan: the pipelined prefix scan of per-piece affine state maps (ZeCO, docs/linear.md "Data flow of one layer"), and the
all-gather baseline (LASP-2).

Legend: B batch, H heads, d_k x d_v state, K = number of row blocks along d_k.

The sequence is a chain of pieces in sequence order; ``owners[i]`` is the ring rank holding piece i
(the ring layout's ``scan_chain``: contiguous, piece i on rank i; zigzag over R ranks, 2R pieces, up the
ranks and back down).
Piece i maps the state entering it to the state leaving it, affinely,

    E_{i+1} = T_i(E_i) + S_i        (E_0 = initial state)

with T_i one of two transition kinds (the ``transitions`` argument, one per piece):
    ``DiagonalMap(log_gamma [B, H, d_k])``   T(E) = exp(log_gamma) ⊙ E, scaling the rows of E
        (linear attention, GLA, Mamba2); blocks are row blocks along d_k;
    ``MatrixMap(matrix [B, H, d_k, d_k])``   T(E) = M E (delta rules: GDN, KDA); M mixes the rows, so
        blocks are column blocks along d_v (the columns of E transform independently).
A plain tensor is read as a ``DiagonalMap``.

Forward (``StateScan.forward``): each state travels to the owner of the next piece in K blocks;
a rank forwards block b as soon as block b has arrived, so the chain pipelines (latency about
one state transfer plus (hops - 1) block transfers, not hops x state). Between blocks the caller can
do local work: ``poll()`` forwards whatever has arrived. Backward (``StateScan.backward``) is the
reverse scan of the state gradient,

    dE_i = T_iᵀ(dE_{i+1}) + dE_loc_i   (dE_{last+1} = gradient of the final state).

Bytes per rank and direction: one [B, H, d_k, d_v] state per piece boundary it sends, independent of
the sequence length (kind ``"p2p"``). ``mode="all_gather"``: every rank all-gathers every piece's
(transition, S) and scans locally, receiving (pieces - 1) states plus transitions (kind
``"all_gather"``): d_k·(d_v + 1) elements per piece and head for a diagonal map, d_k·(d_v + d_k) for a
matrix (``gathered_elements``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats
from ds_seqpar.layout.ring import LAYOUTS

SCAN_MODES = ("all_scan", "all_gather")


class DiagonalMap(NamedTuple):
    """``T(E) = exp(log_gamma) ⊙ E`` over the rows of E; ``log_gamma [B, H, d_k]``. Blocks: rows."""

    log_gamma: torch.Tensor

    axis = -2

    def apply(self, x: torch.Tensor, block: slice) -> torch.Tensor:
        """T on a row block ``x [B, H, rows, d_v]`` (its own transpose: diagonal)."""
        return torch.exp(self.log_gamma[..., block]).unsqueeze(-1) * x

    apply_transposed = apply

    def packed(self) -> torch.Tensor:
        """The map as trailing columns for the all-gather, ``[B, H, d_k, 1]``."""
        return self.log_gamma.unsqueeze(-1)

    @staticmethod
    def unpack(columns: torch.Tensor) -> DiagonalMap:
        return DiagonalMap(columns.squeeze(-1))


class MatrixMap(NamedTuple):
    """``T(E) = M E``; ``matrix [B, H, d_k, d_k]``. Blocks: columns of E (M mixes its rows)."""

    matrix: torch.Tensor

    axis = -1

    def apply(self, x: torch.Tensor, block: slice) -> torch.Tensor:
        """T on a column block ``x [B, H, d_k, cols]``."""
        return self.matrix @ x

    def apply_transposed(self, x: torch.Tensor, block: slice) -> torch.Tensor:
        """Tᵀ on a column block of a state gradient."""
        return self.matrix.transpose(-1, -2) @ x

    def packed(self) -> torch.Tensor:
        return self.matrix

    @staticmethod
    def unpack(columns: torch.Tensor) -> MatrixMap:
        return MatrixMap(columns)


Transition = DiagonalMap | MatrixMap


def _as_map(t: torch.Tensor | Transition) -> Transition:
    return t if isinstance(t, DiagonalMap | MatrixMap) else DiagonalMap(t)


def gathered_elements(kind: str, d_k: int, d_v: int) -> int:
    """Elements per piece and head that ``mode="all_gather"`` moves: the state plus its transition."""
    extra = {"diagonal": 1, "matrix": d_k}
    if kind not in extra:
        raise ValueError(f"transition kind {kind!r} is unknown; valid: diagonal, matrix")
    return d_k * (d_v + extra[kind])


def _at(axis: int, block: slice) -> tuple:
    """Index of a block along ``axis`` (-2 rows, -1 columns) of a ``[..., d_k, d_v]`` state."""
    return (Ellipsis, block, slice(None)) if axis == -2 else (Ellipsis, block)


def chain_owners(layout: Any) -> tuple[int, ...]:
    """Ring rank of each piece (a segment of some rank) in sequence order, from the ring layout's
    ``scan_chain``: contiguous -> 0..R-1, zigzag -> 0..R-1, R-1..0. A layout without one is refused."""
    owners = layout.scan_chain()
    if owners is None:
        chained = " or ".join(f"'{name}'" for name, cls in LAYOUTS.items() if cls(2).scan_chain() is not None)
        raise ValueError(
            f"linear attention scans need the sequence order of the ring layout; layout={layout.name!r} is not "
            f"supported: use ring.layout {chained} (a layout whose runs depend on S, such as stripes, would need "
            "S/G hops)"
        )
    return owners


class StateScan:
    """The chain of pieces over one ring group (explicit group, members and rank; nothing global).

    Args:
        group, members, me: the ring process group, its global ranks and this rank's index in it.
        owners: ring rank of each piece in sequence order (``chain_owners``).
        blocks: K, blocks along d_k (diagonal maps) or d_v (matrix maps); more blocks = finer
            pipelining, more messages.
        mode: ``all_scan`` or ``all_gather``.
        stats: byte counter.
    """

    def __init__(
        self,
        group: object,
        members: Sequence[int],
        me: int,
        owners: Sequence[int],
        blocks: int = 4,
        mode: str = "all_scan",
        stats: CommStats | None = None,
    ) -> None:
        if mode not in SCAN_MODES:
            raise ValueError(f"scan mode {mode!r} is unknown; valid: {', '.join(SCAN_MODES)}")
        if blocks < 1:
            raise ValueError(f"scan blocks K={blocks} must be >= 1")
        self.group, self.members, self.me = group, list(members), me
        self.owners, self.blocks, self.mode, self.stats = tuple(owners), blocks, mode, stats

    @property
    def mine(self) -> list[int]:
        """This rank's pieces, in sequence order."""
        return [i for i, r in enumerate(self.owners) if r == self.me]

    def _blocks(self, size: int) -> list[slice]:
        edges = torch.linspace(0, size, min(self.blocks, size) + 1).round().long().tolist()
        return [slice(a, b) for a, b in itertools.pairwise(edges)]

    def _send(self, t: torch.Tensor, to: int, tag: int, pending: list) -> None:
        t = t.contiguous()
        pending.append((dist.isend(t, self.members[to], group=self.group, tag=tag), t))
        if self.stats is not None:
            self.stats.record_tensors("p2p", t)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        transitions: dict[int, torch.Tensor | Transition],
        local: dict[int, torch.Tensor],
        initial: torch.Tensor | None,
        poll_work: Sequence[object] = (),
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """States entering each of this rank's pieces, and the final state (on the last piece's owner).

        Args:
            transitions: piece -> its map (``DiagonalMap`` / ``MatrixMap``; a ``[B, H, d_k]`` tensor is
                a piece's total log decay) for this rank's pieces; all of one kind.
            local: piece -> ``[B, H, d_k, d_v]`` the piece's state from a zero entering state.
            initial: ``[B, H, d_k, d_v]`` state entering piece 0 (used by its owner), or None = zeros.
            poll_work: callables run between scan blocks (local compute to overlap with the chain).
        """
        maps = {i: _as_map(t) for i, t in transitions.items()}
        if self.mode == "all_gather":
            return self._gather_forward(maps, local, initial, poll_work)
        axis = next(iter(maps.values())).axis
        return self._chain(
            order=self.mine,
            step=-1,
            first=0,
            start=initial,
            apply=lambda i, blk, e: maps[i].apply(e, blk) + local[i][_at(axis, blk)],
            like=next(iter(local.values())),
            axis=axis,
            tag_base=0,
            poll_work=poll_work,
        )

    def backward(
        self,
        transitions: dict[int, torch.Tensor | Transition],
        local_grad: dict[int, torch.Tensor],
        final_grad: torch.Tensor | None,
        poll_work: Sequence[object] = (),
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Gradient of the state LEAVING each of this rank's pieces, and of the initial state (piece 0's owner).

        Args:
            transitions: as in :meth:`forward` (their transposes are applied).
            local_grad: piece -> ``[B, H, d_k, d_v]`` dE_loc, the gradient of the piece's outputs with
                respect to its entering state (linear attention: Σ_t diag(A_t) q_tᵀ dO_t).
            final_grad: gradient of the final state (last piece's owner) or None = zeros.
        """
        maps = {i: _as_map(t) for i, t in transitions.items()}
        if self.mode == "all_gather":
            return self._gather_backward(maps, local_grad, final_grad, poll_work)
        axis = next(iter(maps.values())).axis
        return self._chain(
            order=list(reversed(self.mine)),
            step=1,
            first=len(self.owners) - 1,
            start=final_grad,
            apply=lambda i, blk, g: maps[i].apply_transposed(g, blk) + local_grad[i][_at(axis, blk)],
            like=next(iter(local_grad.values())),
            axis=axis,
            tag_base=1 << 20,
            poll_work=poll_work,
        )

    def _chain(self, order, step, first, start, apply, like, axis, tag_base, poll_work):
        """Walk this rank's pieces along the chain, block by block along ``axis`` (-2 rows, -1 columns).

        For piece i the incoming value x_i comes from piece i + ``step`` (``start`` or zeros for piece
        ``first``): handed over locally when this rank owns that piece, else received. x_i is kept, and
        ``apply(i, rows, x_i)`` goes on to piece i - ``step`` (or is the result past the end).
        Returns ``({piece: x_piece}, past-the-end value or None)``.
        """
        blocks = self._blocks(like.shape[axis])
        n = len(self.owners)
        kept = {i: torch.empty_like(like) for i in order}
        carry: dict[tuple[int, int], torch.Tensor] = {}
        tail = None
        pending: list = []
        work = iter(poll_work)
        for b, blk in enumerate(blocks):
            at = _at(axis, blk)
            for i in order:
                src = i + step
                if i == first:
                    incoming = (start if start is not None else torch.zeros_like(like))[at]
                elif self.owners[src] == self.me:
                    incoming = carry.pop((i, b))
                else:
                    incoming = torch.empty_like(like[at]).contiguous()
                    owner = self.members[self.owners[src]]
                    dist.irecv(incoming, owner, group=self.group, tag=tag_base + i * 4096 + b).wait()
                kept[i][at] = incoming
                passed = apply(i, blk, incoming)
                dst = i - step
                if not 0 <= dst < n:
                    tail = torch.empty_like(like) if tail is None else tail
                    tail[at] = passed
                elif self.owners[dst] == self.me:
                    carry[(dst, b)] = passed
                else:
                    self._send(passed, self.owners[dst], tag_base + dst * 4096 + b, pending)
            task = next(work, None)
            if task is not None:
                task()
        for task in work:
            task()
        for req, _ in pending:
            req.wait()
        return kept, tail

    # ------------------------------------------------------------------------------------------
    def _gather(self, parts: dict[int, torch.Tensor], poll_work: Sequence[object]) -> dict[int, torch.Tensor]:
        """Every piece's tensor on every rank (one all-gather of this rank's pieces, stacked); the
        ``poll_work`` runs while the all-gather is in flight."""
        mine = self.mine
        local = torch.stack([parts[i] for i in mine]).contiguous()
        out = [torch.empty_like(local) for _ in self.members]
        work = dist.all_gather(out, local, group=self.group, async_op=True)
        for task in poll_work:
            task()
        work.wait()
        if self.stats is not None:
            self.stats.record("all_gather", local.numel() * local.element_size() * (len(self.members) - 1))
        every = {}
        for rank, stacked in enumerate(out):
            for slot, piece in enumerate(i for i, r in enumerate(self.owners) if r == rank):
                every[piece] = stacked[slot]
        return every

    def _gathered(self, maps, parts, poll_work) -> dict[int, tuple[Transition, torch.Tensor]]:
        """Every piece's (map, state) on every rank: one all-gather of ``[state | packed map]`` columns."""
        kind = type(next(iter(maps.values())))
        d_v = next(iter(parts.values())).shape[-1]
        every = self._gather(
            {i: torch.cat([parts[i], maps[i].packed()], dim=-1) for i in self.mine}, poll_work
        )
        return {i: (kind.unpack(t[..., d_v:]), t[..., :d_v]) for i, t in every.items()}

    def _gather_forward(self, maps, local, initial, poll_work):
        pieces = self._gathered(maps, local, poll_work)
        state = initial if initial is not None else torch.zeros_like(next(iter(local.values())))
        whole = slice(None)
        entering = {}
        for i in range(len(self.owners)):
            if i in local:
                entering[i] = state
            t, offset = pieces[i]
            state = t.apply(state, whole) + offset
        return entering, state if self.owners[-1] == self.me else None

    def _gather_backward(self, maps, local_grad, final_grad, poll_work):
        pieces = self._gathered(maps, local_grad, poll_work)
        grad = final_grad if final_grad is not None else torch.zeros_like(next(iter(local_grad.values())))
        whole = slice(None)
        leaving = {}
        for i in reversed(range(len(self.owners))):
            if i in local_grad:
                leaving[i] = grad
            t, local = pieces[i]
            grad = t.apply_transposed(grad, whole) + local
        return leaving, grad if self.owners[0] == self.me else None
