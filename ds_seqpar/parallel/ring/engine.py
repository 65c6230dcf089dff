"""The ring engine: the forward and backward loops over a schedule's blocks, one autograd Function, and
the public ``ring_attention`` (docs/ring.md).

Legend:
    B, H, H_kv, D  batch, query heads, key/value heads, head dim
    R              ranks in the ring (the schedule's size); S = global length over the ring
    n = S / R      local tokens; q ``[B, n, H, D]``, k/v ``[B, n, H_kv, D]`` in the layout's order
    out ``[B, n, H, D]`` (q.dtype), lse ``[B, H, n]`` (fp32, fp64 for fp64 inputs)

A variant is a triple, not a file: the schedule (which K/V block a rank holds at each step and how blocks
move, ``comm/schedules/``), the layout (which global positions each rank holds, ``layout/``) and the block
kernel (``ops/attention/``). What one step computes is planned in ``plan.py`` / ``tasks.py`` and executed
in ``execute.py``; forward merges the partial ``(out, lse)`` in the accumulation dtype (``ops/merge.py``),
backward re-circulates K/V, carries the dK/dV accumulators with their blocks and keeps dq local. GQA moves
only the H_kv heads. Communication lives entirely in the schedule; this package never calls a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.ops.merge import apply_sink, inert_empty_rows, sink_grad
from ds_seqpar.ops.precision import accumulation_dtype
from ds_seqpar.parallel.ring.execute import Rows, pair_work
from ds_seqpar.parallel.ring.plan import RingPlan, has_padding, query_layout


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caller: str) -> None:
    """Shapes, dtypes and devices of local q ``[B, n, H, D]`` and k, v ``[B, n, H_kv, D]``."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"{caller} takes q [B, n, H, D] and k, v [B, n, H_kv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, local length and head dim"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device; got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
            f"{v.dtype}/{v.device}"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(
            f"q, k, v are {q.dtype}; attention needs float tensors (float32, bfloat16, float16 or float64)"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"query heads H={q.shape[2]} must be a multiple of key/value heads H_kv={k.shape[2]}"
        )


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, caller: str) -> None:
    """Sink logits must be one float per query head of ``q [B, n, H, D]``, on q's device."""
    if sinks is None:
        return
    h = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (h,) or not sinks.dtype.is_floating_point:
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"{caller}: sinks must be a float tensor [H] with one logit per query head (H={h}); got {got}"
        )
    if sinks.device != q.device:
        raise ValueError(
            f"{caller}: sinks are on {sinks.device} but q is on {q.device}; move them to one device"
        )


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan) -> int:
    """Validate before any communication; return the global length S (a team schedule's caller checks
    its local q, k, v itself: its rows and blocks differ in length)."""
    if plan.query_layout is None:
        check_qkv(q, k, v, "ring attention")
    layout = query_layout(plan)
    seq_len = q.shape[1] * layout.world
    layout.check_length(seq_len)
    if plan.doc_ids is not None and plan.doc_ids.shape[-1] != seq_len:
        raise ValueError(
            f"doc_ids has {plan.doc_ids.shape[-1]} tokens but the ring holds S = {q.shape[1]} x "
            f"{layout.world} = {seq_len}; pass document ids of the whole (global-order) sequence"
        )
    return seq_len


class OutputDelta:
    """Δ = rowsum(dout · out) ``[B, n, H]`` of a ring call's query rows, handed to its backward by the
    code that keeps the call's output (``parallel/usp.py``: the output in the token layout, which the
    output projection saves anyway). A call given one saves no output of its own: its backward runs
    on Δ (``_Rows.final_out``). ``give`` must come before that backward starts; ``take`` once.
    """

    def __init__(self) -> None:
        self._delta: torch.Tensor | None = None

    def give(self, delta: torch.Tensor) -> None:
        self._delta = delta

    def take(self, q: torch.Tensor) -> torch.Tensor:
        delta, self._delta = self._delta, None
        want = (q.shape[0], q.shape[1], q.shape[2])
        if delta is None or tuple(delta.shape) != want:
            got = None if delta is None else tuple(delta.shape)
            raise RuntimeError(
                f"ring attention backward needs the output's rowsum(dout * out) of shape {want}, got {got}: "
                "the call's output must reach the loss through the code that gave the OutputDelta"
            )
        return delta


def engine_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float, merged: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward loop: ``(out, lse, S)`` of this rank's query rows over every block the schedule yields,
    out ``[B, n, H, D]`` and lse ``[B, H, n]`` in the accumulation dtype (fp32, fp64 for fp64 inputs);
    ``merged``: the caller merges more into them (sinks, a team's partials), so a single kernel call
    never returns q.dtype. Checks every input first."""
    seq_len = check_inputs(q, k, v, plan)
    rows = Rows(q, accumulation_dtype(q.dtype))
    work = pair_work(plan, seq_len, scale, rows, merged=merged)
    for owner, (k_blk, v_blk) in plan.schedule.forward((k, v)):
        work.forward(k_blk, v_blk, owner)
    out, lse = (rows.out, rows.lse) if rows.out is not None else rows.zeros()  # all EMPTY: padding only
    return out, lse, seq_len


def engine_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    scale: float,
    seq_len: int,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    merged: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward loop from the FINAL ``lse`` and ``out`` (or Δ = rowsum(dout · out) ``[B, n, H]``) of
    this rank's query rows: ``(dq, dk, dv)`` in the accumulation dtype, dq of the rows, dk / dv of the
    K/V payload ``(k, v)`` the schedule started from (returned by its backward)."""
    acc = accumulation_dtype(q.dtype)
    rows = Rows(q, acc, out=out, lse=lse, dout=dout, delta=delta)
    if has_padding(plan, q.device):  # padding rows saw no key: inert once here, not per block
        rows.dout, rows.lse = inert_empty_rows(dout, lse)
    work = pair_work(plan, seq_len, scale, rows, merged=merged)
    steps = plan.schedule.backward((k, v))
    owner, block = next(steps)
    while True:
        grads = list(work.backward(*block, owner, into=plan.schedule.incoming))
        del block  # the schedule keeps the block while it still needs it
        try:  # the schedule owns (and empties) the step's dK/dV from here: sent on, freed once delivered
            owner, block = steps.send(grads)
        except StopIteration as done:
            dk_local, dv_local = done.value
            break
    dq = rows.dq if rows.dq is not None else torch.zeros_like(q, dtype=acc)
    return dq, dk_local, dv_local


@dataclass(frozen=True)
class _QueryRows:
    """A schedule stand-in naming whose query rows one pair call computes (``engine_pair_backward``)."""

    size: int
    ring_rank: int
    query_rank: int


def engine_pair_backward(
    plan: RingPlan,
    seq_len: int,
    scale: float,
    rows_of: int,
    owner: int,
    q: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dq: torch.Tensor | None = None,
    dkv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ONE pair: the query rows of ``rows_of`` (in ``plan.query_layout``; q, dout ``[B, L, H, D]``,
    final lse ``[B, H, L]``, Δ ``[B, L, H]``) against ``owner``'s K/V block (``plan.layout``). Gradients are
    added in place into ``dq`` and ``dkv`` when given (accumulators that travel or stay), else fresh;
    returns ``(dq, dk, dv)`` in the accumulation dtype. StarTrail's query-packet backward calls it once per
    packet that passes (``parallel/team.py``)."""
    acc = accumulation_dtype(q.dtype)
    pair_plan = dataclasses.replace(
        plan, schedule=_QueryRows(plan.schedule.size, plan.schedule.ring_rank, rows_of)
    )
    rows = Rows(q, acc, lse=lse, dout=dout, delta=delta, dq=dq)
    work = pair_work(pair_plan, seq_len, scale, rows, merged=True)
    dk, dv = work.backward(k, v, owner, into=None if dkv is None else (lambda: dkv))
    return (rows.dq if rows.dq is not None else torch.zeros_like(q, dtype=acc)), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, scale, delta):  # the arguments of ``ring_attention``
        check_sinks(sinks, q, "ring attention")
        out, lse, seq_len = engine_forward(q, k, v, plan, scale, merged=sinks is not None)
        ctx.plan, ctx.scale, ctx.seq_len, ctx.delta = plan, scale, seq_len, delta
        return save_final(ctx, (q, k, v), out, lse, sinks, keep_out=delta is None)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        delta = None if ctx.delta is None else ctx.delta.take(q)
        dq, dk_local, dv_local = engine_backward(
            q,
            k,
            v,
            ctx.plan,
            ctx.scale,
            ctx.seq_len,
            dout,
            lse,
            out=out,
            delta=delta,
            merged=sinks is not None,
        )
        return function_grads(ctx, (q, k, v), (dq, dk_local, dv_local), dout, out, lse, sinks)


def save_final(
    ctx: Any,
    qkv: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    keep_out: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of a ring autograd Function's forward: the sink folded into the FINAL (out, lse) that the
    backward sees, q, k, v, lse, sinks (and out when ``keep_out``) saved, lse marked non-differentiable.
    Returns (out in q's dtype, lse)."""
    if sinks is not None:
        out, lse = apply_sink(out, lse, sinks)
    ctx.save_for_backward(*qkv, out if keep_out else None, lse, sinks)
    ctx.mark_non_differentiable(lse)
    return out.to(qkv[0].dtype), lse


def function_grads(
    ctx: Any,
    qkv: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """What a ring autograd Function's backward returns for (q, k, v, sinks, and three non-tensor inputs):
    dq, dk, dv in the inputs' dtypes and the sinks' gradient when asked (``ops/merge.sink_grad``)."""
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3]:
        dsinks = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
    dq, dk, dv = (g.to(x.dtype) for g, x in zip(grads, qkv, strict=True))
    return dq, dk, dv, dsinks, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    delta: OutputDelta | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's queries over the keys of every rank in the ring.

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``, this rank's tokens in ``plan.layout`` order.
        plan: schedule, layout, mask spec, document ids, kernel, softcap, work counter.
        softmax_scale: default ``D ** -0.5``.
        sinks: None, or ``[H]`` attention-sink logits of these query heads (``ops/merge.apply_sink``).
        delta: None (the call saves its output for backward), or an ``OutputDelta`` that the caller
            fills with rowsum(dout · out) before this call's backward runs; the output is then not
            saved. Not with ``sinks`` (their gradient reads the output).

    Returns:
        ``(out [B, n, H, D] in q.dtype, lse [B, H, n])`` (lse includes the sinks); differentiable in
        q, k, v and sinks.

    Contract: every rank of the ring passes the same shapes and dtype (the schedule's P2P sizes assume it).
    This engine entry takes no mesh and runs no collective to check; ``ds_seqpar.attention`` checks it over
    the SP group before its first call with a shape (``parallel/agree.py``), and a direct caller must shard
    alike (docs/cross_attention.md "Shapes across ranks").
    """
    if delta is not None and sinks is not None:
        raise ValueError(
            "ring_attention: delta= cannot be used with sinks (the sink gradient needs the output)"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return _RingAttention.apply(q, k, v, sinks, plan, scale, delta)
