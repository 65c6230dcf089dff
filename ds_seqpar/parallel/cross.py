"""Exact cross-attention under SP: rotate the queries (LV-XAttn) or rotate K/V (the ring), chosen by size,
optionally with Ulysses over heads inside each ring rank.

Legend: P = U·R SP ranks (U Ulysses, R ring), q ``[B, n_q, H, D]`` this rank's part of the S_q queries,
k / v ``[B, n_kv, H_kv, D]`` its part of the S_kv keys (n = S / P; any split: cross-attention does not
depend on token order), b / a bytes per element of the inputs / of the accumulator dtype (fp32, fp64 for
fp64 inputs). No causal mask (the query and key sequences differ); ``kv_mask`` ``[B, n_kv]`` marks real
keys (False = padding).

Ulysses (U > 1): q, k and v go through the Ulysses all-to-all (sequence -> heads; ``HeadPlan``, K/V heads
replicated when U > H_kv), the key mask is all-gathered over the Ulysses group, the ring part below runs
on ``[B, U·n, h_u, D]`` with U·n tokens per ring rank, and the output goes back (heads -> sequence). Extra
bytes one rank sends (:func:`cross_ulysses_bytes`; h = its query heads, k = its K/V heads, K = all sent
K/V heads, replicas included):
    fwd B·D·b·(n_q·(H − h) + 2·n_kv·(K − k) + (U − 1)·n_q·h) + (U − 1)·B·n_kv   (the mask, if any)
    bwd B·D·b·((U − 1)·n_q·h + 2·(U − 1)·n_kv·k + n_q·(H − h))

``rotate_q`` (docs/cross_attention.md): K/V stay. The query block travels the ring with its partial
(out, lse), which every rank merges its block into and which is home after R sends; backward moves
(q, dout, out, lse) with a dQ accumulator, and dK / dV never move. ``rotate_kv``: the ring: K/V (and
the key mask) travel, dK / dV accumulators follow them home in backward. Both run on the ring's own
``RingSchedule`` (``comm/p2p.py``), whose travelling accumulators carry the partial results.

Bytes one rank sends per layer (kind ``p2p``, :func:`cross_bytes`, tested exactly):
    rotate_q   fwd (R − 1)·B·n_q·H·D·b + R·B·n_q·H·(D + 1)·a
               bwd (R − 1)·B·n_q·H·(3D·b + a) + R·B·n_q·H·D·a
    rotate_kv  fwd (R − 1)·B·n_kv·(2·H_kv·D·b + m)                 m = 1 with a key mask, else 0
               bwd (R − 1)·B·n_kv·(2·H_kv·D·b + m) + R·2·B·n_kv·H_kv·D·a
``schedule="auto"`` rotates the queries when S_q·H < S_kv·H_kv (the smaller side moves), else K/V.

Shapes across ranks (docs/cross_attention.md): before the first exchange the SP ranks all-gather their
shapes (:func:`cross_plan`, 48 int64 per rank). n_q and n_kv may differ between ranks: every shard is
padded to the largest, N_q / N_kv (padded keys masked out, padded query rows dropped; exact), and the
formulas above hold with n = N and m = 1 whenever a rank has a mask or the n_kv differ. ``auto`` decides
from N_q·H vs N_kv·H_kv, the same on every rank. B, H, H_kv, D, the dtype and the schedule must agree:
``RankShapeError`` on every rank, naming each rank's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_seqpar.comm.all_to_all import HeadPlan
from ds_seqpar.comm.p2p import RingComm
from ds_seqpar.comm.schedules.ring import RingSchedule
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.attention import block_attn_backward, block_attn_forward, resolve_kernel
from ds_seqpar.ops.merge import merge_attn_
from ds_seqpar.ops.precision import accumulation_dtype, accumulator_bytes
from ds_seqpar.parallel.agree import RankInputs, RankShapeError, different_callers, gather_inputs
from ds_seqpar.parallel.ulysses import gather_heads, scatter_heads

CROSS_SCHEDULES = ("auto", "rotate_q", "rotate_kv")
CALLER = "cross_attention"


def choose_cross_schedule(q_tokens: int, heads: int, kv_tokens: int, kv_heads: int) -> str:
    """``rotate_q`` when S_q·H < S_kv·H_kv (the queries are the smaller side), else ``rotate_kv``."""
    return "rotate_q" if q_tokens * heads < kv_tokens * kv_heads else "rotate_kv"


def cross_bytes(
    schedule: str, batch: int, q_tokens: int, kv_tokens: int, heads: int, kv_heads: int, head_dim: int,
    element_bytes: int, ring: int, kv_mask: bool = False, backward: bool = False,
) -> int:  # fmt: skip
    """Bytes one rank sends in one cross-attention layer's ring part (the module docstring's formulas);
    ``q_tokens`` / ``kv_tokens`` = n_q / n_kv per ring rank (U·n after a Ulysses exchange), ``heads`` /
    ``kv_heads`` its heads."""
    if ring == 1:
        return 0
    b, a = element_bytes, accumulator_bytes(element_bytes)
    if schedule == "rotate_q":
        rows = batch * q_tokens * heads
        if backward:
            return (ring - 1) * rows * (3 * head_dim * b + a) + ring * rows * head_dim * a
        return (ring - 1) * rows * head_dim * b + ring * rows * (head_dim + 1) * a
    if schedule == "rotate_kv":
        kv = (ring - 1) * batch * kv_tokens * (2 * kv_heads * head_dim * b + (1 if kv_mask else 0))
        return kv + (ring * 2 * batch * kv_tokens * kv_heads * head_dim * a if backward else 0)
    raise ValueError(f"cross-attention schedule={schedule!r}; valid: rotate_q, rotate_kv")


def cross_ulysses_bytes(
    batch: int, q_tokens: int, kv_tokens: int, heads: int, kv_heads: int, ulysses: int, rank: int,
    head_dim: int, element_bytes: int, kv_mask: bool = False, backward: bool = False,
) -> int:  # fmt: skip
    """Bytes Ulysses rank ``rank`` of ``ulysses`` sends in one layer's all-to-alls (and the key mask's
    all-gather), before / after the ring part; ``q_tokens`` / ``kv_tokens`` = n per SP rank."""
    if ulysses == 1:
        return 0
    plan = HeadPlan.build(heads, kv_heads, ulysses)
    h, k, total_kv = plan.q_counts[rank], plan.kv_counts[rank], sum(plan.kv_counts)
    unit = batch * head_dim * element_bytes
    if backward:
        return unit * (
            (ulysses - 1) * q_tokens * h + 2 * (ulysses - 1) * kv_tokens * k + q_tokens * (heads - h)
        )
    mask = (ulysses - 1) * batch * kv_tokens if kv_mask else 0
    return (
        unit * (q_tokens * (heads - h) + 2 * kv_tokens * (total_kv - k) + (ulysses - 1) * q_tokens * h) + mask
    )


def _gather_mask(kv_mask: torch.Tensor | None, mesh: SeqParMesh) -> torch.Tensor | None:
    """The key masks ``[B, n_kv]`` of the Ulysses group, in its rank order: ``[B, U·n_kv]`` (all-gather)."""
    if kv_mask is None:
        return None
    mine = kv_mask.to(torch.uint8).contiguous()
    parts = [torch.empty_like(mine) for _ in range(mesh.ulysses_size)]
    dist.all_gather(parts, mine, group=mesh.group("ulysses"))
    mesh.comm_stats.record("all_gather", (mesh.ulysses_size - 1) * mine.numel() * mine.element_size())
    return torch.cat(parts, dim=1).bool()


def _mask(q: torch.Tensor, kv_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A key mask ``[B, n_kv]`` as the kernels' ``[B, n_q, n_kv]``."""
    if kv_mask is None:
        return None
    return kv_mask.bool()[:, None, :].expand(q.shape[0], q.shape[1], kv_mask.shape[-1])


def _ring(mesh: SeqParMesh) -> RingSchedule:
    c = mesh.coords
    return RingSchedule(RingComm(mesh.group("ring"), mesh.members["ring"], c.ring_rank, mesh.comm_stats))


class _CrossAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, kv_mask, mesh, scale, schedule, kernel):
        ring = _ring(mesh)
        acc = accumulation_dtype(q.dtype)
        out = lse = None
        if schedule == "rotate_kv":
            payload = (k, v) if kv_mask is None else (k, v, kv_mask.to(torch.uint8))
            for _, block in ring.forward(payload):
                o, o_lse = block_attn_forward(
                    q, block[0], block[1], scale=scale, mask=_mask(q, *block[2:3] or (None,)), kernel=kernel
                )
                if out is None:
                    out, lse = o.to(acc), o_lse
                else:
                    merge_attn_(out, lse, o.to(acc), o_lse, consume=True)
        else:  # the query block and its partial (out, lse) travel; K/V stay
            steps = ring.backward((q,))
            _, (q_blk,) = next(steps)
            while True:
                o, o_lse = block_attn_forward(
                    q_blk, k, v, scale=scale, mask=_mask(q_blk, kv_mask), kernel=kernel
                )
                arrived = ring.incoming()
                if arrived is None:
                    partial = [o.to(acc).contiguous(), o_lse.contiguous()]
                else:
                    merge_attn_(arrived[0], arrived[1], o.to(acc), o_lse, consume=True)
                    partial = list(arrived)
                try:
                    _, (q_blk,) = steps.send(partial)
                except StopIteration as done:
                    out, lse = done.value
                    break
        ctx.save_for_backward(q, k, v, kv_mask, out.to(q.dtype), lse)
        ctx.mesh, ctx.scale, ctx.schedule, ctx.kernel = mesh, scale, schedule, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        q, k, v, kv_mask, out, lse = ctx.saved_tensors
        ring, scale, kernel = _ring(ctx.mesh), ctx.scale, ctx.kernel
        dout = dout.contiguous()
        if ctx.schedule == "rotate_kv":
            dq = None
            payload = (k, v) if kv_mask is None else (k, v, kv_mask.to(torch.uint8))
            steps = ring.backward(payload)
            _, block = next(steps)
            while True:
                dq_p, dk_p, dv_p = block_attn_backward(
                    dout,
                    q,
                    block[0],
                    block[1],
                    out,
                    lse,
                    scale=scale,
                    mask=_mask(q, *block[2:3] or (None,)),
                    kernel=kernel,
                )
                dq = dq_p if dq is None else dq.add_(dq_p)
                try:
                    _, block = steps.send([dk_p, dv_p])
                except StopIteration as done:
                    dk, dv = done.value
                    break
        else:  # (q, dout, out, lse) travel with a dQ accumulator; dK / dV stay
            dk = dv = None
            steps = ring.backward((q, dout, out, lse))
            _, packet = next(steps)
            while True:
                dq_p, dk_p, dv_p = block_attn_backward(*packet[1:2], packet[0], k, v, *packet[2:], scale=scale,
                                                       mask=_mask(packet[0], kv_mask), kernel=kernel)  # fmt: skip
                dk = dk_p if dk is None else dk.add_(dk_p)
                dv = dv_p if dv is None else dv.add_(dv_p)
                try:
                    _, packet = steps.send([dq_p])
                except StopIteration as done:
                    (dq,) = done.value
                    break
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


@dataclass(frozen=True)
class CrossPlan:
    """What the ranks agreed (:func:`cross_plan`): the padded shard sizes every rank runs with, whether every
    rank carries a key mask, and the schedule (the same on every rank)."""

    q_tokens: int
    kv_tokens: int
    kv_mask: bool
    schedule: str


def cross_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor | None, mesh: SeqParMesh,
    schedule: str,
) -> CrossPlan:  # fmt: skip
    """The SP ranks' agreed plan: one all-gather of every rank's shapes (``parallel/agree.py``), then the
    same decision on every rank. n_q and n_kv may differ between ranks: every shard is padded to the
    largest (padded keys masked out, padded query rows dropped: exact). Everything else must agree, else
    ``RankShapeError`` on every rank, naming each rank's shapes."""
    ranks = gather_inputs(mesh, CALLER, (q, k, v, kv_mask), (CROSS_SCHEDULES.index(schedule),))
    problem = different_callers(ranks, CALLER)
    if problem is None and len({_must_agree(r) for r in ranks}) > 1:
        listed = "; ".join(r.describe(("q", "k", "v", "kv_mask")) + f" schedule={CROSS_SCHEDULES[r.flags[0]]}"
                           for r in ranks)  # fmt: skip
        problem = (
            f"{CALLER}: the ranks of the SP group disagree on batch, heads, head dim, dtype or schedule "
            f"({listed}); only the token counts n_q and n_kv may differ between ranks (they are padded): "
            "pass every rank the same B, H, H_kv, D, dtype and schedule"
        )
    if problem is not None:
        raise RankShapeError(problem)
    n_q, n_kv = max(r.shapes[0][1] for r in ranks), max(r.shapes[1][1] for r in ranks)
    if n_q == 0 or n_kv == 0:
        raise RankShapeError(
            f"{CALLER}: no rank of the SP group holds a {'query' if n_q == 0 else 'key'} (every shard has 0 "
            "tokens); pass at least one query and one key in the group"
        )
    mask = len({r.shapes[1][1] for r in ranks}) > 1 or any(r.shapes[3] is not None for r in ranks)
    heads, kv_heads = q.shape[2], k.shape[2]
    if mesh.ring_size == 1:
        schedule = "rotate_kv"  # one ring rank: a single block either way
    elif schedule == "auto":
        schedule = choose_cross_schedule(n_q, heads, n_kv, kv_heads)  # agreed sizes: the same on every rank
    return CrossPlan(n_q, n_kv, mask, schedule)


def _must_agree(r: RankInputs) -> tuple:
    """A rank's (B, H, D, H_kv, dtypes, schedule): what every rank of one call must share."""
    (b, _, h, d), kv = r.shapes[0], r.shapes[1]
    return b, h, d, kv[2], r.dtypes[:3], r.flags


def _pad_tokens(x: torch.Tensor, tokens: int, value: float | bool = 0) -> torch.Tensor:
    """``x`` padded along dim 1 to ``tokens`` (differentiable; no copy when it already has them)."""
    extra = tokens - x.shape[1]
    return x if extra == 0 else F.pad(x, [0, 0] * (x.dim() - 2) + [0, extra], value=value)


def _check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_mask: torch.Tensor | None,
                 mesh: SeqParMesh) -> None:  # fmt: skip
    """This rank's shapes (before any collective)."""
    if (
        q.dim() != 4
        or k.dim() != 4
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"cross_attention takes q [B, n_q, H, D] and k, v [B, n_kv, H_kv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"cross_attention: H={q.shape[2]} query heads are not a multiple of H_kv={k.shape[2]}"
        )
    if q.shape[2] < mesh.ulysses_size:
        raise ValueError(
            f"cross_attention: ulysses_degree U={mesh.ulysses_size} exceeds the H={q.shape[2]} query heads; valid: "
            f"U <= {q.shape[2]} (move the rest of the SP degree to the ring)"
        )
    if kv_mask is not None and tuple(kv_mask.shape) != tuple(k.shape[:2]):
        raise ValueError(f"kv_mask {tuple(kv_mask.shape)} must be [B, n_kv] = {tuple(k.shape[:2])}")


def cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    kv_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    schedule: str = "auto",
) -> torch.Tensor:
    """Exact (non-causal) attention of this rank's queries over the keys of every rank of the ring.

    Args:
        q: ``[B, n_q, H, D]``, this rank's contiguous part of the queries; k, v: ``[B, n_kv, H_kv, D]``, its
            contiguous part of the keys / values (H % H_kv == 0). n_q and n_kv may differ between ranks
            (e.g. ``torch.chunk`` of a length P does not divide); B, H, H_kv, D and the dtype may not.
        kv_mask: None, or bool ``[B, n_kv]``: True for real keys (padding False).
        schedule: ``auto`` (:func:`choose_cross_schedule` on the agreed shard sizes), ``rotate_q`` or
            ``rotate_kv``; the same on every rank.
    The block kernel is the mesh's ``sequence_parallel.kernel`` ("auto" when the mesh has no section).

    Returns ``out [B, n_q, H, D]`` in q.dtype, differentiable in q, k, v. Local checks run before any
    collective; then one all-gather of every rank's shapes (:func:`cross_plan`) before the first exchange.
    """
    if schedule not in CROSS_SCHEDULES:
        raise ValueError(f"cross_attention schedule={schedule!r}; valid: {', '.join(CROSS_SCHEDULES)}")
    _check_local(q, k, v, kv_mask, mesh)
    kernel = mesh.settings.kernel  # sequence_parallel.kernel
    resolve_kernel(kernel, q.device, q.dtype, None)  # an unavailable kernel fails here, not mid-ring
    plan = cross_plan(q, k, v, kv_mask, mesh, schedule)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    local_q = q.shape[1]
    if plan.kv_mask and kv_mask is None:
        kv_mask = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
    if kv_mask is not None:
        kv_mask = _pad_tokens(kv_mask.bool(), plan.kv_tokens, value=False)
    q = _pad_tokens(q, plan.q_tokens)
    k, v = _pad_tokens(k, plan.kv_tokens), _pad_tokens(v, plan.kv_tokens)
    if mesh.ulysses_size == 1:
        out = _CrossAttention.apply(q, k, v, kv_mask, mesh, scale, plan.schedule, kernel)
    else:
        heads = HeadPlan.build(q.shape[2], k.shape[2], mesh.ulysses_size)
        q, k, v = scatter_heads(q, k, v, heads, mesh, separate=True)  # q and k/v have different token counts
        out = _CrossAttention.apply(q, k, v, _gather_mask(kv_mask, mesh), mesh, scale, plan.schedule, kernel)
        out = gather_heads(out, heads, mesh)
    return out if out.shape[1] == local_q else out[:, :local_q]
