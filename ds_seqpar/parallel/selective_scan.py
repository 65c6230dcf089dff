"""Mamba selective scans under sequence parallelism: Ulysses over channels, All-Scan over the ring (docs/delta.md
"Mamba v1").

Legend: P = U · R SP ranks, n = S / P tokens per rank, D channels (Mamba v1's intermediate size), N state size,
G groups of channels sharing B and C (1 for Mamba, the Mamba heads for Zamba), d_u = D / U channels per rank.

Mamba v1 (``selective_scan``): per channel c and state index m,

    h_t[c, m] = exp(dt_t[c] A[c, m]) h_{t-1}[c, m] + dt_t[c] B_t[g(c), m] x_t[c],
    y_t[c]    = sum_m C_t[g(c), m] h_t[c, m]

which is linear attention with one head per channel, d_k = N, d_v = 1: q = C, k = B, v = dt · x and the
per-token, per-key-channel log decay dt[c] · A[c, m]. The gate and the expanded q / k are built AFTER the
all-to-all from what each rank needs, so the exchange carries, per token,

    dt · x and dt  [D] each   (seq -> channels, all-to-all)
    B and C        [G · N]    (gathered over the Ulysses group: every rank needs them for all its channels)

and the ring carries one state ``[B, d_u, N, 1]`` per hop (``parallel/linear_scan.py``).

Mamba2 / SSD (``ssd_scan``): q = C, k = B, v = dt · x, log decay dt · A_h per token and head; when the layer
has fewer heads than U, each head's value columns (head_dim) are split into sub-heads, which the
recurrence keeps independent (the state's columns never mix), so Ulysses can split them.
"""

from __future__ import annotations

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, head_to_seq
from ds_seqpar.comm.scan import chain_owners
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.linear_scan import (
    SAME_SCAN_SHARDS,
    _LinearScan,
    check_heads,
    linear_attention,
    scan_plan,
    to_heads,
)
from ds_seqpar.settings import input_layout

__all__ = ["selective_scan", "ssd_scan", "value_split"]


def _check_selective(x, dt, a, b, c) -> None:
    bsz, n, d = x.shape
    if dt.shape != x.shape or a.dim() != 2 or a.shape[0] != d:
        raise ValueError(
            f"selective scan takes x, dt [B, n, D] and A [D, N]; got {tuple(x.shape)}, {tuple(dt.shape)}, "
            f"{tuple(a.shape)}"
        )
    groups, state = b.shape[2], a.shape[1]
    if b.shape != c.shape or tuple(b.shape) != (bsz, n, groups, state) or d % groups:
        raise ValueError(
            f"selective scan takes B, C [B, n, G, N] = {(bsz, n, 'G', state)} with G dividing D={d}; got "
            f"{tuple(b.shape)}, {tuple(c.shape)}"
        )


def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, mesh: SeqParMesh
) -> torch.Tensor:
    """Mamba v1's selective scan of the whole sequence the SP group shares, from a zero state (the D skip and
    the gate stay with the caller).

    Args:
        x, dt: ``[B, n, D]`` this rank's tokens (``input_layout(mesh)`` order); dt after softplus.
        a: ``[D, N]`` the (negative) state matrix A = -exp(A_log).
        b, c: ``[B, n, G, N]``; channel ch uses group ch // (D / G).

    Returns:
        ``y [B, n, D]`` in float32 (float64 for float64 inputs); differentiable in x, dt, a, b and c.
    """
    _check_selective(x, dt, a, b, c)
    bsz, n, d = x.shape
    groups, state = b.shape[2], a.shape[1]
    layout = input_layout(mesh)
    layout.check_length(n * layout.world)
    chain_owners(layout.ring)  # the ring layout must have a scan order: checked before any collective
    check_heads(d, mesh, "a Mamba selective-scan layer (its channels are the heads)")
    u = mesh.ulysses_size
    check_same_inputs(
        mesh, "selective_scan", ("x", "dt", "A", "B", "C"), (x, dt, a, b, c), fix=SAME_SCAN_SHARDS
    )
    acc = torch.promote_types(x.dtype, torch.float32)
    group, me, stats = mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats
    heads = HeadPlan.build(d, d, u)
    dt = dt.to(acc)
    v2, dt2 = to_heads([(dt * x.to(acc))[..., None], dt[..., None]], heads, group, me, stats)
    bc = torch.cat([b, c], dim=2).to(acc).reshape(bsz, n, 1, 2 * groups * state)  # (B | C, G, N)
    (bc2,) = to_heads([bc.expand(-1, -1, u, -1)], HeadPlan.build(u, u, u), group, me, stats)
    start = sum(heads.q_counts[:me])
    mine = torch.arange(start, start + heads.q_counts[me], device=x.device)
    b2, c2 = bc2[:, :, 0].unflatten(-1, (2, groups, state)).unbind(2)  # [B, U·n, G, N] each
    k2, q2 = (t[:, :, mine // (d // groups)] for t in (b2, c2))  # [B, U·n, d_u, N]
    gate = dt2 * a.to(acc)[mine]  # [B, U·n, d_u, N], <= 0
    lin = mesh.settings.linear
    plan = scan_plan(mesh, q2.shape[1], lin.chunk_size, lin.blocks, lin.scan, 1.0)
    out, _ = _LinearScan.apply(q2, k2, v2, gate, None, plan)
    (full,) = head_to_seq((out,), (heads.q_counts,), group, me, stats)
    return full[..., 0]


def value_split(heads: int, head_dim: int, ulysses: int) -> int:
    """Sub-heads per head so that Ulysses can split the heads: the smallest divisor s of ``head_dim`` with
    ``heads · s >= ulysses`` (1 when heads >= U; head_dim when no divisor suffices, and the scan refuses)."""
    for s in range(1, head_dim + 1):
        if head_dim % s == 0 and heads * s >= ulysses:
            return s
    return head_dim


def ssd_scan(
    c: torch.Tensor, b: torch.Tensor, x: torch.Tensor, log_decay: torch.Tensor, *, mesh: SeqParMesh
) -> torch.Tensor:
    """Mamba2's SSD scan: ``c, b [B, n, H, N]``, ``x [B, n, H, P]`` (already dt · x), ``log_decay [B, n, H]``
    (dt · A_h) -> ``y [B, n, H, P]`` = linear attention of the whole sequence; heads < U are split along P."""
    bsz, n, h, p = x.shape
    s = value_split(h, p, mesh.ulysses_size)
    if s == 1:
        return linear_attention(c, b, x, mesh=mesh, log_decay=log_decay)
    c, b, log_decay = (t.repeat_interleave(s, dim=2) for t in (c, b, log_decay))
    y = linear_attention(c, b, x.reshape(bsz, n, h * s, p // s), mesh=mesh, log_decay=log_decay)
    return y.reshape(bsz, n, h, p)
