"""The mLSTM (xLSTM) under sequence parallelism: Ulysses over heads, two scans over the ring (docs/delta.md "mLSTM").

Legend: P = U · R SP ranks, n = S / P tokens per rank, H heads, h_u = H / U.

    q, k [B, n, H, d_k], v [B, n, H, d_v], i, f [B, n, H]
      -> Ulysses all-to-all (one call, packed)                                  [B, S/R, h_u, .]
      -> each piece in chunks of ``linear.chunk_size`` (``ops/linear/mlstm.py``):
         1. the max-stabiliser: each piece's max-plus map (g, l) [B, h_u], ONE differentiable all-gather
            over the ring group; every rank chains the maps (m = 0 before the sequence, as HF)
         2. the stabilised state [B, h_u, d_k, d_v + 1] (C and n): the chunks of a piece from a zero
            state, then All-Scan of the entering states (``comm/scan.py``, a ``DiagonalMap`` of
            e^{g + m_enter - m_leave} per head)
         3. the chunk outputs from their entering stabiliser and state
      -> inverse all-to-all                                                     h [B, n, H, d_v]

Communication per rank and layer: the Ulysses all-to-alls, ``2 · B · h_u`` numbers per piece all-gathered
(and all-reduced in backward), and one state per ring hop and direction. Backward: autograd through the
local chunks; the reverse scan for the states; the all-reduce of the gathered maps' gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq
from ds_seqpar.comm.scan import DiagonalMap
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.linear.mlstm import chunk_output, chunk_state, chunk_summary
from ds_seqpar.ops.precision import accumulation_dtype
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.linear_scan import SAME_SCAN_SHARDS, ScanPlan, check_heads, scan_plan, to_heads
from ds_seqpar.settings import input_layout

__all__ = ["mlstm_attention"]


class _GatherMaps(torch.autograd.Function):
    """``mine [m, B, h, 2]`` (this rank's pieces) -> ``[pieces, B, h, 2]`` every piece in chain order."""

    @staticmethod
    def forward(ctx: Any, mine: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
        scan = plan.scan
        parts = [torch.empty_like(mine) for _ in scan.members]
        dist.all_gather(parts, mine.contiguous(), group=scan.group)
        if scan.stats is not None:
            scan.stats.record("all_gather", mine.numel() * mine.element_size() * (len(scan.members) - 1))
        ctx.plan = plan
        return torch.stack([parts[r][list(_mine(scan, r)).index(i)] for i, r in enumerate(scan.owners)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scan = ctx.plan.scan
        grad = grad.contiguous()
        dist.all_reduce(grad, group=scan.group)
        if scan.stats is not None:
            scan.stats.record_tensors("all_reduce", grad)
        return grad[scan.mine], None


def _mine(scan: Any, rank: int) -> list[int]:
    return [i for i, r in enumerate(scan.owners) if r == rank]


class _EnteringStates(torch.autograd.Function):
    """States entering this rank's pieces: ``log_gamma [m, B, h]`` (each piece's transition, per head) and
    ``local [m, B, h, d_k, d_v]`` (its leaving state from a zero entering state) -> ``[m, B, h, d_k, d_v]``."""

    @staticmethod
    def forward(ctx: Any, log_gamma: torch.Tensor, local: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
        scan = plan.scan
        maps = _maps(scan, log_gamma, local.shape[-2])
        entering, _ = scan.forward(maps, {i: local[j] for j, i in enumerate(scan.mine)}, None)
        out = torch.stack([entering[i] for i in scan.mine])
        ctx.save_for_backward(log_gamma, out)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        log_gamma, entering = ctx.saved_tensors
        scan = ctx.plan.scan
        maps = _maps(scan, log_gamma, entering.shape[-2])
        leaving, _ = scan.backward(maps, {i: grad[j].contiguous() for j, i in enumerate(scan.mine)}, None)
        d_local = torch.stack([leaving[i] for i in scan.mine])
        d_log_gamma = (d_local * entering).sum(dim=(-1, -2)) * log_gamma.exp()
        return d_log_gamma, d_local, None


def _maps(scan: Any, log_gamma: torch.Tensor, d_k: int) -> dict[int, DiagonalMap]:
    return {
        i: DiagonalMap(log_gamma[j][..., None].expand(*log_gamma.shape[1:], d_k))
        for j, i in enumerate(scan.mine)
    }


def _chunks(length: int, size: int) -> list[slice]:
    return [slice(a, min(a + size, length)) for a in range(0, length, size)]


def _piece_maps(i: torch.Tensor, f: torch.Tensor, size: int) -> tuple[list, torch.Tensor]:
    """The chunk summaries of a piece and its max-plus map ``[B, h, 2]`` (g, l) composed over them."""
    summaries = [chunk_summary(i[:, r], f[:, r]) for r in _chunks(i.shape[1], size)]
    gain, peak = torch.zeros_like(i[:, 0]), torch.full_like(i[:, 0], float("-inf"))
    for s in summaries:
        gain, peak = gain + s.gain, torch.maximum(s.gain + peak, s.peak)
    return summaries, torch.stack([gain, peak], dim=-1)


def _stabilisers(maps: torch.Tensor) -> list[torch.Tensor]:
    """m entering each piece in chain order from every piece's map ``[pieces, B, h, 2]`` (m = 0 first)."""
    m = torch.zeros_like(maps[0, ..., 0])
    entering = []
    for piece in maps:
        entering.append(m)
        m = torch.maximum(piece[..., 0] + m, piece[..., 1])
    return entering


def _piece_local(k, v, i, summaries, m_enter, size):
    """Per chunk of a piece: its entering m, its zero-start state (None for the first) and the summed log
    forget gate before it; then the piece's log Γ ``[B, h]`` and leaving state from a zero entering state."""
    state, m, gain = None, m_enter, torch.zeros_like(m_enter)
    chunks = []
    for r, s in zip(_chunks(k.shape[1], size), summaries, strict=True):
        m_next = torch.maximum(s.gain + m, s.peak)
        chunks.append((r, s, m, state, gain))
        own = chunk_state(k[:, r], v[:, r], i[:, r], s, m_next)
        state = own if state is None else torch.exp(s.gain + m - m_next)[..., None, None] * state + own
        gain, m = gain + s.gain, m_next
    return chunks, gain + m_enter - m, state


def _run(q, k, v, i, f, plan: ScanPlan, eps: float) -> torch.Tensor:
    """The mLSTM of this ring rank's rows ``[B, L, h, .]`` (its pieces in chain order)."""
    size, scan = plan.chunk_size, plan.scan
    pieces = [(r, *_piece_maps(i[:, r], f[:, r], size)) for r in plan.pieces]
    gathered = _GatherMaps.apply(torch.stack([p[2] for p in pieces]), plan)
    m_enter = _stabilisers(gathered)
    local = [_piece_local(k[:, r], v[:, r], i[:, r], s, m_enter[idx], size)
             for (r, s, _), idx in zip(pieces, scan.mine, strict=True)]  # fmt: skip
    entering = _EnteringStates.apply(
        torch.stack([x[1] for x in local]), torch.stack([x[2] for x in local]), plan
    )
    outs = []
    for j, ((rows, _, _), (chunks, _, _)) in enumerate(zip(pieces, local, strict=True)):
        m0 = m_enter[scan.mine[j]]
        qr, kr, vr, ir = (x[:, rows] for x in (q, k, v, i))
        for r, s, m, state, gain in chunks:
            full = torch.exp(gain + m0 - m)[..., None, None] * entering[j]
            full = full if state is None else full + state
            outs.append(chunk_output(qr[:, r], kr[:, r], vr[:, r], ir[:, r], s, m, full, eps))
    # a zero-weighted term: every rank's output depends on the gathered maps (the first piece's owner would
    # not otherwise), so every rank runs the gather's backward all-reduce
    return torch.cat(outs, dim=1) + 0.0 * gathered.sum()


def mlstm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    *,
    mesh: SeqParMesh,
    eps: float = 1e-6,
) -> torch.Tensor:
    """HF's mLSTM (``mlstm_chunkwise_*`` / ``mlstm_recurrent_*``, zero initial states) of the whole sequence.

    Args:
        q, k: ``[B, n, H, d_k]``; v: ``[B, n, H, d_v]``; igate, fgate: ``[B, n, H]`` gate pre-activations;
            this rank's tokens in ``input_layout(mesh)`` order.
        eps: the denominator's eps (``config.eps``).

    Returns:
        ``h [B, n, H, d_v]`` in the acc dtype; differentiable in all inputs.
    """
    b, n, h, _ = q.shape
    if (
        k.shape != q.shape
        or v.shape[:3] != q.shape[:3]
        or igate.shape != (b, n, h)
        or fgate.shape != (b, n, h)
    ):
        raise ValueError(
            f"the mLSTM takes q, k [B, n, H, d_k], v [B, n, H, d_v], igate, fgate [B, n, H]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(igate.shape)}, {tuple(fgate.shape)}"
        )
    layout = input_layout(mesh)
    layout.check_length(n * layout.world)
    check_heads(h, mesh, "an mLSTM layer")
    heads = HeadPlan.build(h, h, mesh.ulysses_size)
    check_same_inputs(mesh, "mlstm_attention", ("q", "k", "v", "igate", "fgate"), (q, k, v, igate, fgate),
                      fix=SAME_SCAN_SHARDS)  # fmt: skip
    acc = accumulation_dtype(q.dtype)
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    parts = [x.to(acc) for x in (q, k, v, igate.unsqueeze(-1), fgate.unsqueeze(-1))]
    q2, k2, v2, i2, f2 = to_heads(parts, heads, group, me, stats)
    lin = mesh.settings.linear
    plan = scan_plan(mesh, q2.shape[1], lin.chunk_size, lin.blocks, lin.scan, 1.0)
    out = _run(q2, k2, v2, i2.squeeze(-1), f2.squeeze(-1), plan, eps)
    (full,) = head_to_seq((out.contiguous(),), (heads.q_counts,), group, me, stats)
    return full
