"""Diagonal linear recurrences (RG-LRU, RWKV's WKV) and the token shift under sequence parallelism (docs/delta.md).

Legend: P = U · R SP ranks, n = S / P tokens per rank, C channels, c_u = C / U channels per Ulysses rank.

    x, a [B, n, C] (this rank's tokens, ``input_layout(mesh)`` order)
      -> Ulysses all-to-all over channels (x and a packed in one call)       [B, S/R, c_u]
      -> each of the ring rank's pieces from a zero state (``ops/linear/diagonal.py``)
      -> All-Scan of the entering states over the ring group (``comm/scan.py``, a ``DiagonalMap`` of
         the piece's product of a; the state is [B, c_u, 1, 1])
      -> out = h^loc + P ⊙ E_entering -> inverse all-to-all                   out [B, n, C]

Communication per rank and layer: the Ulysses all-to-alls of x, a and out, plus ONE state ``[B, c_u]`` per
ring hop and direction. Backward: autograd through the local pieces; the entering states' gradient is
the reverse scan (``StateScan.backward``). ``wkv``: RWKV-4's time mixing as ONE such recurrence of 2C
channels (numerator and denominator), after ``sequence_extremes`` (one all-reduce of ``[B, 2C]``). ``token_shift``: x_{t-1} for every local token, the one-token
halo from the rank holding the previous position (``comm/halo.py``; zeros before position 0).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq
from ds_seqpar.comm.halo import halo_exchange
from ds_seqpar.comm.reduce import GroupReducer
from ds_seqpar.comm.scan import DiagonalMap
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.linear.diagonal import diagonal_local_scan
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.delta_scan import conv_halo_plan
from ds_seqpar.parallel.linear_scan import SAME_SCAN_SHARDS, ScanPlan, check_heads, scan_plan, to_heads
from ds_seqpar.settings import input_layout

__all__ = ["diagonal_recurrence", "sequence_extremes", "token_shift", "wkv"]


class _Entering(torch.autograd.Function):
    """States entering this rank's pieces from their transitions ``gamma [m, B, c]`` and zero-state
    leaving states ``local [m, B, c]`` (m pieces, ``scan.mine`` order) -> ``[m, B, c]``."""

    @staticmethod
    def forward(ctx: Any, gamma: torch.Tensor, local: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
        scan = plan.scan
        maps = {i: DiagonalMap(gamma[j].log().unsqueeze(-1)) for j, i in enumerate(scan.mine)}
        ends = {i: local[j][..., None, None] for j, i in enumerate(scan.mine)}
        entering, _ = scan.forward(maps, ends, None)
        out = torch.stack([entering[i][..., 0, 0] for i in scan.mine])
        ctx.save_for_backward(gamma, out)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        gamma, entering = ctx.saved_tensors
        scan = ctx.plan.scan
        maps = {i: DiagonalMap(gamma[j].log().unsqueeze(-1)) for j, i in enumerate(scan.mine)}
        direct = {i: grad[j][..., None, None].contiguous() for j, i in enumerate(scan.mine)}
        leaving, _ = scan.backward(maps, direct, None)
        d_local = torch.stack([leaving[i][..., 0, 0] for i in scan.mine])
        return d_local * entering, d_local, None


def _scan(x: torch.Tensor, a: torch.Tensor, plan: ScanPlan, exclusive: bool) -> torch.Tensor:
    """The recurrence over the ring group's sequence of ``x, a [B, L, c]`` (this ring rank's rows)."""
    pieces = [diagonal_local_scan(x[:, r], a[:, r], exclusive) for r in plan.pieces]
    entering = _Entering.apply(
        torch.stack([p.gamma for p in pieces]), torch.stack([p.state for p in pieces]), plan
    )
    return torch.cat([p.out + p.carry * entering[j][:, None] for j, p in enumerate(pieces)], dim=1)


def diagonal_recurrence(
    x: torch.Tensor, a: torch.Tensor, *, mesh: SeqParMesh, exclusive: bool = False
) -> torch.Tensor:
    """``h_t = a_t ⊙ h_{t-1} + x_t`` over the whole sequence the SP group shares, from a zero state; exact.

    Args:
        x, a: ``[B, n, C]`` this rank's tokens (``input_layout(mesh)`` order); ``a`` in [0, 1], 0 resets.
        exclusive: return h_{t-1} (the state before each token) instead of h_t.

    Returns:
        ``[B, n, C]`` in the acc dtype (``ops/precision.py``); differentiable in x and a.
    """
    if x.dim() != 3 or a.shape != x.shape:
        raise ValueError(f"diagonal_recurrence takes x, a [B, n, C]; got {tuple(x.shape)}, {tuple(a.shape)}")
    _, n, c = x.shape
    layout = input_layout(mesh)
    layout.check_length(n * layout.world)
    check_heads(c, mesh, "a diagonal recurrence (channels as heads)")
    heads = HeadPlan.build(c, c, mesh.ulysses_size)
    check_same_inputs(mesh, "diagonal_recurrence", ("x", "a"), (x, a), (int(exclusive),), SAME_SCAN_SHARDS)
    lin = mesh.settings.linear
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    x2, a2 = to_heads([x.unsqueeze(-1), a.unsqueeze(-1)], heads, group, me, stats)
    plan = scan_plan(mesh, x2.shape[1], lin.chunk_size, 1, lin.scan, 1.0)
    out = _scan(x2.squeeze(-1), a2.squeeze(-1), plan, exclusive)
    (full,) = head_to_seq((out.unsqueeze(-1).contiguous(),), (heads.q_counts,), group, me, stats)
    return full.squeeze(-1)


def token_shift(x: torch.Tensor, *, mesh: SeqParMesh) -> torch.Tensor:
    """``x [B, n, C]`` -> ``[B, n, C]``: each token's row replaced by the previous position's (zeros at
    position 0), the previous row of a run's first token fetched from its owner (one row per run)."""
    if x.dim() != 3:
        raise ValueError(f"token_shift takes x [B, n, C], got shape {tuple(x.shape)}")
    plan = conv_halo_plan(mesh, x.shape[1], 1)
    check_same_inputs(mesh, "token_shift", ("x",), (x,), (1,), SAME_SCAN_SHARDS, ("halo",))
    halo = halo_exchange(x, plan, mesh.group("sp"), mesh.members["sp"], mesh.coords.sp_rank, mesh.comm_stats)
    parts = []
    for j, (start, end) in enumerate(plan.runs):
        parts += [halo[:, j : j + 1], x[:, start : end - 1]]
    return torch.cat(parts, dim=1) if parts else x


def sequence_extremes(x: torch.Tensor, *, mesh: SeqParMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, n, C]`` -> the max and min over the whole sequence ``[B, C]`` each (float64, no gradient):
    one all-reduce (max) of ``[B, 2C]`` over the SP group."""
    x = x.detach().double()
    both = torch.cat([x.amax(dim=1), -x.amin(dim=1)], dim=-1)
    GroupReducer(mesh.group("sp"), mesh.members["sp"], mesh.comm_stats).max_(both)
    top, low = both.chunk(2, dim=-1)
    return top, -low


def wkv(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shift: torch.Tensor,
    mesh: SeqParMesh,
) -> torch.Tensor:
    """RWKV-4's WKV over the whole sequence: with w = -exp(time_decay), u = time_first ``[C]`` and
    ``key, value [B, n, C]``,

        out_t = (N_t + e^{u + k_t} v_t) / (D_t + e^{u + k_t}),   N_t = Σ_{s<t} e^{(t-1-s) w + k_s} v_s,
        D_t = Σ_{s<t} e^{(t-1-s) w + k_s}

    N and D are exclusive diagonal recurrences with decay e^w (one call, 2C channels), in float64 with
    every exponent shifted by ``shift [B, C]`` (the sequence's max of k: the ratio does not change, so
    no stabiliser has to travel). Returns ``[B, n, C]`` in key's dtype; differentiable in all four."""
    decay = torch.exp(-torch.exp(time_decay.double()))
    k = key.double() - shift[:, None]
    weight = torch.exp(k)
    x = torch.cat([weight * value.double(), weight], dim=-1)
    states = diagonal_recurrence(x, decay.repeat(2).expand_as(x), mesh=mesh, exclusive=True)
    num, den = states.chunk(2, dim=-1)
    bonus = torch.exp(time_first.double() + k)
    return ((num + bonus * value.double()) / (den + bonus)).to(key.dtype)
