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

from ds_seqpar.ops.merge import apply_sink, merge_attn_, sink_grad
from ds_seqpar.parallel.ring import RingPlan, check_qkv, check_sinks, engine_backward, engine_forward


def _merge_team(out_t: torch.Tensor, lse_t: torch.Tensor, team: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE merge of the C partials of this rank's rows: ``[B, C·n, H, D]`` / ``[B, H, C·n]`` in, ``[B, n, H, D]``
    / ``[B, H, n]`` out (the accumulation dtype)."""
    outs, lses = team.exchange_rows(out_t, dim=1), team.exchange_rows(lse_t, dim=2)
    out, lse = outs[0].clone(), lses[0].clone()
    for c in range(1, outs.shape[0]):
        merge_attn_(out, lse, outs[c], lses[c], consume=True)
    return out, lse


class _TeamAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: RingPlan,
        scale: float,
    ):
        schedule = plan.schedule
        team = schedule.team_comm
        (q_team,) = team.gather(q)
        kv = team.gather(k, v) if schedule.gathers_kv else (k, v)
        out_t, lse_t, seq_len = engine_forward(q_team, *kv, plan, scale, merged=True)
        del q_team, kv
        out, lse = _merge_team(out_t, lse_t, team)
        del out_t, lse_t
        if sinks is not None:
            out, lse = apply_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.scale, ctx.seq_len = plan, scale, seq_len
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

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
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None


def team_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's queries under a team schedule (``plan.schedule`` has ``team_comm``).

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``, this rank's tokens in the ring layout.
        plan: built by ``parallel/ring.py`` ``team_plan`` (K/V layout of the schedule's blocks, query layout
            of its teams).
        sinks: None or ``[H]`` attention-sink logits.

    Returns:
        ``(out [B, n, H, D] in q.dtype, lse [B, H, n])``; differentiable in q, k, v and sinks.
    """
    check_qkv(q, k, v, "team attention")
    check_sinks(sinks, q, "team attention")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _TeamAttention.apply(q, k, v, sinks, plan, scale)
