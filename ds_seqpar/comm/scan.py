"""All-Scan: the pipelined prefix scan of per-piece affine state maps (ZeCO, docs/linear.md "Data flow of one layer"), and the
all-gather baseline (LASP-2, §16.3).

Legend: B batch, H heads, d_k x d_v state, K = number of row blocks along d_k.

The sequence is a chain of pieces in sequence order; ``owners[i]`` is the ring rank holding piece i
(contiguous layout: piece i on rank i; zigzag over R ranks: 2R pieces, up the ranks and back down).
Piece i maps the state entering it to the state leaving it,

    E_{i+1} = exp(log_gamma_i) ⊙ E_i + S_i        (E_0 = initial state; ⊙ scales the rows of E)

Forward (``StateScan.forward``): each state travels to the owner of the next piece in K row blocks;
a rank forwards block b as soon as block b has arrived, so the chain pipelines (latency about
one state transfer plus (hops - 1) block transfers, not hops x state). Between blocks the caller can
do local work: ``poll()`` forwards whatever has arrived. Backward (``StateScan.backward``) is the
reverse scan of the state gradient,

    dE_i = exp(log_gamma_i) ⊙ dE_{i+1} + dE_loc_i   (dE_{last+1} = gradient of the final state).

Bytes per rank and direction: one [B, H, d_k, d_v] state per piece boundary it sends, independent of
the sequence length (kind ``"p2p"``). ``mode="all_gather"``: every rank all-gathers every piece's
(log_gamma, S) and scans locally, receiving (pieces - 1) states (kind ``"all_gather"``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ds_seqpar.comm.stats import CommStats

SCAN_MODES = ("all_scan", "all_gather")


def chain_owners(world: int, layout: str) -> tuple[int, ...]:
    """Ring rank of each piece in sequence order: ``contiguous`` -> 0..R-1, ``zigzag`` -> 0..R-1, R-1..0."""
    if layout == "contiguous":
        return tuple(range(world))
    if layout == "zigzag":
        return tuple(range(world)) + tuple(reversed(range(world)))
    raise ValueError(
        f"linear attention scans need the sequence order of the ring layout; layout={layout!r} is not "
        "supported: use ring.layout 'contiguous' or 'zigzag' (stripes would need S/G hops)"
    )


class StateScan:
    """The chain of pieces over one ring group (explicit group, members and rank; nothing global).

    Args:
        group, members, me: the ring process group, its global ranks and this rank's index in it.
        owners: ring rank of each piece in sequence order (``chain_owners``).
        blocks: K, row blocks along d_k (1..d_k; more blocks = finer pipelining, more messages).
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

    def _rows(self, d_k: int) -> list[slice]:
        edges = torch.linspace(0, d_k, min(self.blocks, d_k) + 1).round().long().tolist()
        return [slice(a, b) for a, b in itertools.pairwise(edges)]

    def _send(self, t: torch.Tensor, to: int, tag: int, pending: list) -> None:
        t = t.contiguous()
        pending.append((dist.isend(t, self.members[to], group=self.group, tag=tag), t))
        if self.stats is not None:
            self.stats.record_tensors("p2p", t)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        log_gamma: dict[int, torch.Tensor],
        local: dict[int, torch.Tensor],
        initial: torch.Tensor | None,
        poll_work: Sequence[object] = (),
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """States entering each of this rank's pieces, and the final state (on the last piece's owner).

        Args:
            log_gamma: piece -> ``[B, H, d_k]`` total log decay of that piece (this rank's pieces).
            local: piece -> ``[B, H, d_k, d_v]`` the piece's state from a zero entering state.
            initial: ``[B, H, d_k, d_v]`` state entering piece 0 (used by its owner), or None = zeros.
            poll_work: callables run between scan blocks (local compute to overlap with the chain).
        """
        if self.mode == "all_gather":
            return self._gather_forward(log_gamma, local, initial, poll_work)
        return self._chain(
            order=self.mine,
            step=-1,
            first=0,
            start=initial,
            apply=lambda i, rows, e: (
                torch.exp(log_gamma[i][..., rows]).unsqueeze(-1) * e + local[i][..., rows, :]
            ),
            like=next(iter(local.values())),
            tag_base=0,
            poll_work=poll_work,
        )

    def backward(
        self,
        log_gamma: dict[int, torch.Tensor],
        local_grad: dict[int, torch.Tensor],
        final_grad: torch.Tensor | None,
        poll_work: Sequence[object] = (),
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Gradient of the state LEAVING each of this rank's pieces, and of the initial state (piece 0's owner).

        Args:
            local_grad: piece -> ``[B, H, d_k, d_v]`` dE_loc = Σ_t diag(A_t) q_tᵀ dO_t of that piece.
            final_grad: gradient of the final state (last piece's owner) or None = zeros.
        """
        if self.mode == "all_gather":
            return self._gather_backward(log_gamma, local_grad, final_grad, poll_work)
        return self._chain(
            order=list(reversed(self.mine)),
            step=1,
            first=len(self.owners) - 1,
            start=final_grad,
            apply=lambda i, rows, g: (
                torch.exp(log_gamma[i][..., rows]).unsqueeze(-1) * g + local_grad[i][..., rows, :]
            ),
            like=next(iter(local_grad.values())),
            tag_base=1 << 20,
            poll_work=poll_work,
        )

    def _chain(self, order, step, first, start, apply, like, tag_base, poll_work):
        """Walk this rank's pieces along the chain, row block by row block.

        For piece i the incoming value x_i comes from piece i + ``step`` (``start`` or zeros for piece
        ``first``): handed over locally when this rank owns that piece, else received. x_i is kept, and
        ``apply(i, rows, x_i)`` goes on to piece i - ``step`` (or is the result past the end).
        Returns ``({piece: x_piece}, past-the-end value or None)``.
        """
        rows = self._rows(like.shape[-2])
        n = len(self.owners)
        kept = {i: torch.empty_like(like) for i in order}
        carry: dict[tuple[int, int], torch.Tensor] = {}
        tail = None
        pending: list = []
        work = iter(poll_work)
        for b, r in enumerate(rows):
            for i in order:
                src = i + step
                if i == first:
                    incoming = (start if start is not None else torch.zeros_like(like))[..., r, :]
                elif self.owners[src] == self.me:
                    incoming = carry.pop((i, b))
                else:
                    incoming = torch.empty_like(like[..., r, :]).contiguous()
                    owner = self.members[self.owners[src]]
                    dist.irecv(incoming, owner, group=self.group, tag=tag_base + i * 4096 + b).wait()
                kept[i][..., r, :] = incoming
                passed = apply(i, r, incoming)
                dst = i - step
                if not 0 <= dst < n:
                    tail = torch.empty_like(like) if tail is None else tail
                    tail[..., r, :] = passed
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

    def _gather_forward(self, log_gamma, local, initial, poll_work):
        pieces = self._gather(
            {i: torch.cat([local[i], log_gamma[i].unsqueeze(-1)], dim=-1) for i in self.mine}, poll_work
        )
        state = initial if initial is not None else torch.zeros_like(next(iter(local.values())))
        entering = {}
        for i in range(len(self.owners)):
            if i in local:
                entering[i] = state
            piece = pieces[i]
            state = torch.exp(piece[..., -1]).unsqueeze(-1) * state + piece[..., :-1]
        return entering, state if self.owners[-1] == self.me else None

    def _gather_backward(self, log_gamma, local_grad, final_grad, poll_work):
        pieces = self._gather(
            {i: torch.cat([local_grad[i], log_gamma[i].unsqueeze(-1)], dim=-1) for i in self.mine}, poll_work
        )
        grad = final_grad if final_grad is not None else torch.zeros_like(next(iter(local_grad.values())))
        leaving = {}
        for i in reversed(range(len(self.owners))):
            if i in local_grad:
                leaving[i] = grad
            piece = pieces[i]
            grad = torch.exp(piece[..., -1]).unsqueeze(-1) * grad + piece[..., :-1]
        return leaving, grad if self.owners[0] == self.me else None
