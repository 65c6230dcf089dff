"""Team attention: the ring engine run on a team's gathered query rows (StarTrail, ATTENTION2D).

Legend: C = team size (StarTrail's team, ATTENTION2D's grid row of P_kv ranks), n = tokens per ring rank,
q ``[B, n, H, D]``, k / v ``[B, n, H_kv, D]`` this rank's tokens in the ring layout.

    forward   team all-gather q (and k, v when the schedule ``gathers_kv``)   -> Q_team [B, C·n, H, D]
              engine_forward(Q_team, K/V payload) over the schedule's blocks  -> partial out / lse of the
              team's rows over 1/C of the keys (StarTrail: the member's sub-ring; ATTENTION2D: its column)
              all-to-all of row blocks in the team + LSE merge                -> out / lse of this rank's rows
    backward  Δ = rowsum(dout · out) on the own rows; team all-gather (q, dout), (lse, Δ) (and k, v)
              engine_backward from the FINAL lse / Δ                          -> dQ_team, dK/dV of the payload
              team reduce-scatter of dQ_team (and of dK/dV when gathered)     -> this rank's gradients

Inputs are saved un-gathered (the gather is repeated in backward, intra-node): memory as the ring's.
Communication per layer: docs/comm_model.md. Every check runs before the first collective.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_seqpar.comm.layer_bytes import LayerShape
from ds_seqpar.ops.merge import inert_empty_rows, merge_attn_
from ds_seqpar.ops.precision import accumulator_bytes
from ds_seqpar.parallel.ring.engine import (
    check_qkv,
    check_sinks,
    engine_backward,
    engine_forward,
    engine_pair_backward,
    function_grads,
    save_final,
)
from ds_seqpar.parallel.ring.plan import RingPlan


def _merge_team(out_t: torch.Tensor, lse_t: torch.Tensor, team: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of the C partials of this rank's rows: ``[B, C·n, H, D]`` / ``[B, H, C·n]`` in, ``[B, n, H, D]``
    / ``[B, H, n]`` out (the accumulation dtype)."""
    outs, lses = team.exchange_rows(out_t, dim=1), team.exchange_rows(lse_t, dim=2)
    out, lse = outs[0].clone(), lses[0].clone()
    for c in range(1, outs.shape[0]):
        merge_attn_(out, lse, outs[c], lses[c], consume=True)
    return out, lse


def _query_packet_backward(
    plan: RingPlan,
    scale: float,
    seq_len: int,
    q_team: torch.Tensor,
    dout_team: torch.Tensor,
    lse_team: torch.Tensor,
    delta_team: torch.Tensor,
    k_team: torch.Tensor,
    v_team: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """StarTrail's query-packet backward: the team's (q, dout, lse, Δ) ``[B, C·n, ...]`` takes the skew hop
    and circulates the sub-ring with a dQ accumulator, while this member's team K/V stay and collect dK /
    dV from every packet that passes. Returns ``(dQ of the team's rows, after the accumulator came home and
    took the skew back; dK, dV of the team's block)``, partials over this member's share, in the
    accumulation dtype. The schedule moves the packet as it moves K/V in the other variant."""
    schedule = plan.schedule
    if plan.doc_ids is not None and bool((plan.doc_ids < 0).any()):
        dout_team, lse_team = inert_empty_rows(dout_team, lse_team)  # padding rows saw no key
    steps = schedule.backward((q_team, dout_team, lse_team.contiguous(), delta_team.contiguous()))
    del q_team, dout_team, lse_team, delta_team
    dkv = None
    owner, packet = next(steps)
    while True:
        arrived = schedule.incoming()
        dq, dk, dv = engine_pair_backward(
            plan, seq_len, scale, owner, schedule.query_rank, *packet, k_team, v_team,
            dq=None if arrived is None else arrived[0], dkv=dkv,
        )  # fmt: skip
        dkv = (dk, dv)
        del packet
        try:
            owner, packet = steps.send([dq])
        except StopIteration as done:
            (dq_home,) = done.value
            break
    return dq_home, *dkv


class _TeamAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, scale, backward):  # the arguments of ``team_attention``
        schedule = plan.schedule
        team = schedule.team_comm
        (q_team,) = team.gather(q)
        kv = team.gather(k, v) if schedule.gathers_kv else (k, v)
        out_t, lse_t, seq_len = engine_forward(q_team, *kv, plan, scale, merged=True)
        del q_team, kv
        out, lse = _merge_team(out_t, lse_t, team)
        del out_t, lse_t
        ctx.plan, ctx.scale, ctx.seq_len, ctx.backward = plan, scale, seq_len, backward
        return save_final(ctx, (q, k, v), out, lse, sinks, keep_out=True)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        schedule = plan.schedule
        team = schedule.team_comm
        dout = dout.contiguous()
        delta = (dout.to(out.dtype) * out).sum(-1)  # [B, n, H]
        q_team, dout_team = team.gather(q, dout)
        lse_team, delta_team = team.gather(lse, delta.transpose(1, 2), dim=2)
        kv = team.gather(k, v) if schedule.gathers_kv else (k, v)
        if ctx.backward == "query":
            dq_t, dk_p, dv_p = _query_packet_backward(
                plan, ctx.scale, ctx.seq_len, q_team, dout_team, lse_team, delta_team.transpose(1, 2), *kv
            )
        else:
            dq_t, dk_p, dv_p = engine_backward(
                q_team,
                *kv,
                plan,
                ctx.scale,
                ctx.seq_len,
                dout_team,
                lse_team,
                delta=delta_team.transpose(1, 2),
                merged=True,
            )
        del q_team, dout_team, lse_team, delta_team, kv
        (dq,) = team.reduce_rows(dq_t)
        dk, dv = team.reduce_rows(dk_p, dv_p) if schedule.gathers_kv else (dk_p, dv_p)
        return function_grads(ctx, (q, k, v), (dq, dk, dv), dout, out, lse, sinks)


def team_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    *,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    backward: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's queries under a team schedule (``plan.schedule`` is a ``TeamSchedule``).

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``, this rank's tokens in the ring layout.
        plan: the K/V layout of the schedule's blocks and the query layout of its teams (the schedule's spec
            gives both, ``ScheduleSpec.layouts``).
        sinks: None or ``[H]`` attention-sink logits.
        backward: StarTrail's backward, ``"kv"`` | ``"query"`` | ``"auto"`` (the variant sending fewer bytes
            for this layer's heads, ``schedule.backward_variant``); a schedule without a sub-ring
            (ATTENTION2D) always runs the engine's (K/V) backward.

    Returns:
        ``(out [B, n, H, D] in q.dtype, lse [B, H, n])``; differentiable in q, k, v and sinks.

    Contract: every ring rank passes the same shapes and dtype, and the same ``backward`` (``auto`` is decided
    from the heads, so equal shapes pick one variant everywhere); ``ds_seqpar.attention`` checks the shapes
    over the SP group first (``parallel/agree.py``), a direct caller must shard alike.
    """
    check_qkv(q, k, v, "team attention")
    check_sinks(sinks, q, "team attention")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    b = q.element_size()
    per_token = LayerShape(
        1, 1, q.shape[2], k.shape[2], q.shape[3], b, accumulator_bytes(b)
    )  # B, n, C cancel
    kind = plan.schedule.backward_variant(backward, per_token)
    return _TeamAttention.apply(q, k, v, sinks, plan, scale, kind)
