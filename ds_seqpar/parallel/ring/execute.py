"""Executing one ring step: the kernel calls of a (query rows, K/V block) pair, forward and backward.

Legend: q ``[B, n, H, D]``, a K/V block ``[B, m, H_kv, D]``, out ``[B, n, H, D]`` and lse ``[B, H, n]`` in the
accumulation dtype (``ops/precision.py``).

``PairWork`` runs the calls ``plan.pair_calls`` / ``plan.backward_calls`` give through ONE table shared by
forward and backward (``CALLS``): a call is ``block`` (the block kernel, with the task's mask or causal
flag), ``band`` (a sliding-window band through the kernel's window mode, no mask), ``varlen`` (runs of
packed documents through the kernel's varlen entry point) or ``batched`` (equal-length documents as batch
rows of one block call). ``Rows`` holds what the call accumulates for this rank's query rows.
``SparsePairWork`` is the sparse ring's step: one sparse block kernel call on the whole pair.

With ALiBi (``plan.alibi``) every call is a ``block`` call given the ``Alibi`` of its rows: the slopes and
the GLOBAL positions of its query rows and keys (packed runs are run one document at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.ops.attention import (
    Alibi,
    AttentionKernel,
    block_attn_backward,
    block_attn_forward,
    kernel_for,
)
from ds_seqpar.ops.masks import BlockKind
from ds_seqpar.ops.merge import merge_attn_
from ds_seqpar.ops.sparse.kernels import resolve_sparse_kernel, visible_pairs
from ds_seqpar.parallel.ring.plan import (
    RingPlan,
    backward_calls,
    pair_calls,
    query_meta,
    query_rank,
    segment_pairs,
    tokens,
)
from ds_seqpar.parallel.ring.tasks import BlockTask, VarlenTask

__all__ = ["CALLS", "PairWork", "Rows", "SparsePairWork", "pair_work"]

Task = BlockTask | VarlenTask
Incoming = Callable[[], tuple[torch.Tensor, ...] | None] | None
"""A schedule's ``incoming``: the dK/dV accumulator that arrived with the current block, or None."""
KVGrads = tuple[torch.Tensor, torch.Tensor]


def _covers(rows: slice, n: int) -> bool:
    return rows.start == 0 and rows.stop == n


def _only_call(plan: RingPlan, tasks: list[Task], n: int) -> bool:
    """One ring rank and one kernel call covering the whole block: nothing is ever merged."""
    return (
        plan.schedule.size == 1
        and plan.query_layout is None  # team rows are merged with the teammates' afterwards
        and len(tasks) == 1
        and _covers(tasks[0].q_rows, n)
        and _covers(tasks[0].k_rows, n)
    )


def _accumulate(
    acc_tensor: torch.Tensor | None, part: torch.Tensor, rows: slice, like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``acc_tensor[:, rows] += part``; the first part covering every row becomes the accumulator."""
    if acc_tensor is None:
        if _covers(rows, like.shape[1]):
            return part.contiguous()  # it may travel to the next rank (P2P needs contiguous memory)
        acc_tensor = torch.zeros_like(like, dtype=dtype)
    acc_tensor[:, rows] += part
    return acc_tensor


@dataclass
class Rows:
    """What one ring attention call accumulates for this rank's query rows.

    Forward: ``out [B, n, H, D]`` / ``lse [B, H, n]`` (the first block covering every row becomes the
    accumulator; no zero-filled buffer). Backward: ``dq``, with ``dout``, ``lse`` and either ``out``
    (the final output of the rows) or ``delta`` ``[B, n, H]`` = rowsum(dout · out) (``OutputDelta``).
    """

    q: torch.Tensor
    acc: torch.dtype
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    dout: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    delta: torch.Tensor | None = None

    def final_out(self, rows: slice) -> torch.Tensor:
        """What a backward kernel call takes as the final output of ``rows``: ``out`` itself, or, with
        ``delta`` instead, the projection of out onto dout, ``dout · Δ / |dout|²``. A kernel reads out
        only through Δ = rowsum(dout · out), and the projection has the same Δ (exact up to rounding;
        a row whose |dout|² underflows gets 0, which its gradient is then within rounding of). One
        ``[B, len(rows), H, D]`` temporary in the acc dtype, for the call only."""
        if self.out is not None:
            return self.out[:, rows]
        dout = self.dout[:, rows]
        copied = dout.dtype != self.acc  # then the cast below is a fresh tensor, scaled in place
        dout = dout.to(self.acc)
        norm = dout.square().sum(-1, keepdim=True)
        scale = torch.where(norm > 0, self.delta[:, rows, :, None] / norm, torch.zeros_like(norm))
        return dout.mul_(scale) if copied else dout * scale

    def zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, h, d = self.q.shape
        return (
            torch.zeros(b, n, h, d, dtype=self.acc, device=self.q.device),
            torch.full((b, h, n), float("-inf"), dtype=self.acc, device=self.q.device),
        )

    def merge(self, rows: slice, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
        if self.out is None and _covers(rows, self.q.shape[1]):
            self.out, self.lse = out_blk.contiguous(), lse_blk.contiguous()
            return
        if self.out is None:
            self.out, self.lse = self.zeros()
        merge_attn_(self.out, self.lse, out_blk, lse_blk, rows=rows, consume=True)


@dataclass(frozen=True)
class Step:
    """What every call of one pair needs besides the task and the block."""

    kernel: AttentionKernel
    rows: Rows
    scale: float
    softcap: float | None
    alibi: Alibi | None = None  # the slopes and positions of (this rank's rows, the current K/V block)

    def bias(self, task: BlockTask) -> Alibi | None:
        return None if self.alibi is None else self.alibi.rows(task.q_rows, task.k_rows)


def _packed(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``[B, n, H, D]`` flattened to ``[B·L, H, D]``."""
    return x[:, rows].reshape(-1, *x.shape[2:])


def _as_batch(x: torch.Tensor, rows: slice, length: int) -> torch.Tensor:
    """Rows ``rows`` of ``[B, n, H, D]`` as ``[B·m, length, H, D]`` (m = len(rows) / length sequences)."""
    return x[:, rows].reshape(-1, length, *x.shape[2:])


def _block_forward(step: Step, task: BlockTask, k: torch.Tensor, v: torch.Tensor, out_dtype: Any):
    q = step.rows.q
    return block_attn_forward(
        q[:, task.q_rows], k[:, task.k_rows], v[:, task.k_rows], scale=step.scale, mask=task.mask,
        causal=task.kind is BlockKind.CAUSAL, kernel=step.kernel, out_dtype=out_dtype, softcap=step.softcap,
        alibi=step.bias(task),
    )  # fmt: skip


def _block_backward(step: Step, task: BlockTask, k: torch.Tensor, v: torch.Tensor, grad_dtype: Any):
    rows, q = step.rows, step.rows.q
    return block_attn_backward(
        rows.dout[:, task.q_rows], q[:, task.q_rows], k[:, task.k_rows], v[:, task.k_rows],
        rows.final_out(task.q_rows), rows.lse[:, :, task.q_rows], scale=step.scale, mask=task.mask,
        causal=task.kind is BlockKind.CAUSAL, kernel=step.kernel, grad_dtype=grad_dtype, softcap=step.softcap,
        inert=True, alibi=step.bias(task),
    )  # fmt: skip


def _band_forward(step: Step, task: BlockTask, k: torch.Tensor, v: torch.Tensor, out_dtype: Any):
    q, acc = step.rows.q, step.rows.acc
    out, lse = step.kernel.band.forward(
        q[:, task.q_rows], k[:, task.k_rows], v[:, task.k_rows], step.scale, task.band, step.softcap
    )
    return out.to(acc), lse.to(acc)


def _band_backward(step: Step, task: BlockTask, k: torch.Tensor, v: torch.Tensor, grad_dtype: Any):
    rows, q = step.rows, step.rows.q  # band rows always see a key: lse finite
    return step.kernel.band.backward(
        rows.dout[:, task.q_rows], q[:, task.q_rows], k[:, task.k_rows], v[:, task.k_rows],
        rows.final_out(task.q_rows), rows.lse[:, :, task.q_rows], step.scale, task.band, step.softcap,
    )  # fmt: skip


def _varlen_forward(step: Step, task: VarlenTask, k: torch.Tensor, v: torch.Tensor, out_dtype: Any):
    """One varlen call for ``task``: ``out [B, Lq, H, D]``, ``lse [B, H, Lq]``."""
    q, acc = step.rows.q, step.rows.acc
    b, h = q.shape[0], q.shape[2]
    out, lse = step.kernel.varlen.forward(
        _packed(q, task.q_rows), _packed(k, task.k_rows), _packed(v, task.k_rows),
        task.cu_q, task.cu_k, task.max_q, task.max_k, step.scale, task.causal, step.softcap,
    )  # fmt: skip
    return out.view(b, -1, h, q.shape[3]).to(acc), lse.view(h, b, -1).transpose(0, 1).to(acc)


def _varlen_backward(step: Step, task: VarlenTask, k: torch.Tensor, v: torch.Tensor, grad_dtype: Any):
    """Gradients of ``task`` given the final out / lse of its rows: dq ``[B, Lq, H, D]``, dk, dv ``[B, Lk, H_kv, D]``."""
    rows, q = step.rows, step.rows.q
    b, h = q.shape[0], q.shape[2]
    dout = rows.dout[:, task.q_rows]  # padding rows were made inert once for the whole backward
    lse = rows.lse[:, :, task.q_rows].transpose(0, 1).reshape(h, -1)  # [H, B·Lq]
    dq, dk, dv = step.kernel.varlen.backward(
        dout.reshape(-1, h, q.shape[3]), _packed(q, task.q_rows), _packed(k, task.k_rows),
        _packed(v, task.k_rows), rows.final_out(task.q_rows).reshape(-1, h, q.shape[3]), lse, task.cu_q, task.cu_k,
        task.max_q, task.max_k, step.scale, task.causal, step.softcap,
    )  # fmt: skip
    return dq.view(b, -1, *dq.shape[1:]), dk.view(b, -1, *dk.shape[1:]), dv.view(b, -1, *dv.shape[1:])


def _batched_forward(step: Step, task: VarlenTask, k: torch.Tensor, v: torch.Tensor, out_dtype: Any):
    """Equal-length sequences as batch rows of one block call: ``out [B, Lq, H, D]``, ``lse [B, H, Lq]``."""
    q, acc = step.rows.q, step.rows.acc
    b, h, length = q.shape[0], q.shape[2], task.uniform
    out, lse = block_attn_forward(
        _as_batch(q, task.q_rows, length), _as_batch(k, task.k_rows, length), _as_batch(v, task.k_rows, length),
        scale=step.scale, causal=task.causal, kernel=step.kernel, softcap=step.softcap,
    )  # fmt: skip
    lse = lse.view(b, -1, h, length).transpose(1, 2).reshape(b, h, -1)
    return out.view(b, -1, h, q.shape[3]).to(acc), lse.to(acc)


def _batched_backward(step: Step, task: VarlenTask, k: torch.Tensor, v: torch.Tensor, grad_dtype: Any):
    """Gradients of equal-length sequences run as batch rows: dq ``[B, Lq, H, D]``, dk, dv ``[B, Lk, H_kv, D]``."""
    rows, q = step.rows, step.rows.q
    b, h, length = q.shape[0], q.shape[2], task.uniform
    lse = rows.lse[:, :, task.q_rows].reshape(b, h, -1, length).transpose(1, 2).reshape(-1, h, length)
    dq, dk, dv = block_attn_backward(
        _as_batch(rows.dout, task.q_rows, length), _as_batch(q, task.q_rows, length),
        _as_batch(k, task.k_rows, length), _as_batch(v, task.k_rows, length),
        rows.final_out(task.q_rows).reshape(-1, length, h, q.shape[3]), lse, scale=step.scale, causal=task.causal,
        kernel=step.kernel, softcap=step.softcap, inert=True,
    )  # fmt: skip
    return dq.view(b, -1, *dq.shape[2:]), dk.view(b, -1, *dk.shape[2:]), dv.view(b, -1, *dv.shape[2:])


@dataclass(frozen=True)
class Call:
    """One kind of kernel call: ``forward(step, task, k, v, out_dtype) -> (out, lse)`` in the accumulation
    dtype (``out_dtype``: the block kernel's output dtype when nothing is merged), and ``backward(step,
    task, k, v, grad_dtype) -> (dq, dk, dv)`` from the FINAL out / lse of the rows."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


CALLS: dict[str, Call] = {
    "block": Call(_block_forward, _block_backward),
    "band": Call(_band_forward, _band_backward),
    "varlen": Call(_varlen_forward, _varlen_backward),
    "batched": Call(_batched_forward, _batched_backward),
}
"""The kernel-call table the forward and backward loops of ``PairWork`` share."""


class PairWork:
    """The work of one ring step for (this rank's queries, one K/V block): the one interface the engine's
    forward and backward loops call. Dense: the plan's calls of the pair through ``CALLS``. Sparse
    (``SparsePairWork``): the sparse block kernel on the whole pair."""

    def __init__(self, plan: RingPlan, seq_len: int, scale: float, rows: Rows, merged: bool) -> None:
        self.plan, self.seq_len, self.scale, self.rows = plan, seq_len, scale, rows
        self.q_pos, self.q_doc = query_meta(plan, seq_len, rows.q.device)
        self.merged = merged  # sinks are folded in after the loop: never adopt a q.dtype output
        q, alibi = rows.q, plan.alibi is not None
        kernel = kernel_for(plan.kernel, q.device, q.dtype, plan.softcap, alibi)
        self.step = Step(kernel, rows, scale, plan.softcap)
        self.varlen = not alibi and kernel.varlen is not None and kernel.varlen.takes(q)
        self.banded = not alibi and kernel.band is not None and kernel.band.takes(q)

    def _call(self, task: Task) -> Call:
        if isinstance(task, VarlenTask):
            return CALLS["varlen" if self.varlen else "batched"]
        return CALLS["band" if task.band is not None and self.banded else "block"]

    def _calls(self, owner: int, backward: bool) -> list[Task]:
        find = backward_calls if backward else pair_calls
        calls = find(
            self.plan, self.seq_len, owner, self.q_pos, self.q_doc, self.rows.q.shape[0], self.varlen
        )
        if self.plan.alibi is None:
            return calls
        return [t for call in calls for t in (call.tasks if isinstance(call, VarlenTask) else (call,))]

    def _step(self, owner: int) -> Step:
        """The step's calls' common inputs; with ALiBi, the positions of ``owner``'s keys."""
        if self.plan.alibi is None:
            return self.step
        k_pos, _ = tokens(self.plan, self.seq_len, owner, self.rows.q.device)
        return dataclasses.replace(self.step, alibi=Alibi(self.plan.alibi, self.q_pos, k_pos))

    def forward(self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int) -> None:
        plan, q = self.plan, self.rows.q
        tasks = self._calls(owner, backward=False)
        out_dtype = q.dtype if _only_call(plan, tasks, q.shape[1]) and not self.merged else None
        step = self._step(owner)
        for task in tasks:  # nothing to merge: the one block call skips the fp32 round trip
            out_blk, lse_blk = self._call(task).forward(step, task, k_blk, v_blk, out_dtype)
            self.rows.merge(task.q_rows, out_blk, lse_blk)
            del out_blk, lse_blk  # not alive during the next kernel call
        if plan.work is not None:
            plan.work.forward_pairs += sum(task.pairs for task in tasks)
            covered = sum(task.segment_pairs for task in tasks)
            plan.work.blocks += covered
            plan.work.skipped_blocks += segment_pairs(plan, self.seq_len) - covered

    def backward(
        self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int, into: Incoming = None
    ) -> KVGrads:
        """dq into ``rows.dq``; returns (dk, dv) of the block.

        ``into`` (the schedule's ``incoming``) gives the block's travelling dK/dV accumulator; the
        step's parts are added into it, so the step has no accumulator of its own. It is asked for
        before the first kernel call: waiting for it also completes the previous step's send, whose
        dK/dV are then freed before this step's kernel outputs exist. The accumulator's transfer is
        not hidden behind this step's compute (one dK/dV transfer per step, linear in n against the
        quadratic block work); the next K/V block's transfer still is.
        """
        plan, rows, q = self.plan, self.rows, self.rows.q
        tasks = self._calls(owner, backward=True)
        grad_dtype = q.dtype if _only_call(plan, tasks, q.shape[1]) else None
        dk, dv = (into() if into is not None else None) or (None, None)
        step = self._step(owner)
        for task in tasks:
            dq_p, dk_p, dv_p = self._call(task).backward(step, task, k_blk, v_blk, grad_dtype)
            rows.dq = _accumulate(rows.dq, dq_p, task.q_rows, q, rows.acc)
            dk = _accumulate(dk, dk_p, task.k_rows, k_blk, rows.acc)
            dv = _accumulate(dv, dv_p, task.k_rows, v_blk, rows.acc)
            del dq_p, dk_p, dv_p  # not alive during the next kernel call
            if plan.work is not None:
                plan.work.backward_pairs += task.pairs
        if dk is None:  # no block of this step was computed, and nothing arrived
            dk, dv = torch.zeros_like(k_blk, dtype=rows.acc), torch.zeros_like(v_blk, dtype=rows.acc)
        return dk, dv


def _check_sparse(plan: RingPlan, q: torch.Tensor, seq_len: int) -> None:
    pattern = plan.sparse
    if pattern.seq_len != seq_len or pattern.num_heads != q.shape[2] or pattern.batch not in (1, q.shape[0]):
        raise ValueError(
            f"the sparse pattern covers B={pattern.batch}, H={pattern.num_heads}, S={pattern.seq_len} but the ring "
            f"holds B={q.shape[0]}, H={q.shape[2]}, S={seq_len}; estimate it for this rank's heads and sequence"
        )


def _sparse_pair(
    plan: RingPlan, seq_len: int, owner: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Positions of this rank's queries and ``owner``'s keys, and the sparse kernel's mask keywords."""
    q_pos, q_doc = tokens(plan, seq_len, query_rank(plan), device, queries=True)
    k_pos, k_doc = tokens(plan, seq_len, owner, device)
    return q_pos, k_pos, dict(spec=plan.spec, q_doc=q_doc, k_doc=k_doc, softcap=plan.softcap)


class SparsePairWork(PairWork):
    """The sparse ring's step: the whole local query shard against a K/V block, one sparse kernel call
    (``ops/sparse/kernels.py``, resolved once per call of the engine)."""

    def __init__(self, plan: RingPlan, seq_len: int, scale: float, rows: Rows, merged: bool) -> None:
        super().__init__(plan, seq_len, scale, rows, merged)
        _check_sparse(plan, rows.q, seq_len)
        name = plan.sparse_kernel  # a name of the registry, or a kernel object (docs/dit_sparse.md)
        self.kernel = (
            resolve_sparse_kernel(name, rows.q.device, rows.q.dtype) if isinstance(name, str) else name
        )

    def forward(self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int) -> None:
        plan, q = self.plan, self.rows.q
        q_pos, k_pos, kw = _sparse_pair(plan, self.seq_len, owner, q.device)
        out_blk, lse_blk, pairs = self.kernel.forward(
            q, k_blk, v_blk, q_pos, k_pos, plan.sparse, scale=self.scale, **kw
        )
        if self.rows.out is None:
            self.rows.out, self.rows.lse = self.rows.zeros()
        merge_attn_(self.rows.out, self.rows.lse, out_blk, lse_blk)
        if plan.work is not None:
            if pairs is None:  # a sync-free kernel: count the visible pairs (a diagnostic host sync)
                pairs = visible_pairs(
                    q_pos, k_pos, plan.sparse, plan.spec, kw["q_doc"], kw["k_doc"], batch=q.shape[0]
                )
            plan.work.forward_pairs += pairs // q.shape[2]
            plan.work.blocks += 1 if pairs else 0
            plan.work.skipped_blocks += 0 if pairs else 1

    def backward(
        self, k_blk: torch.Tensor, v_blk: torch.Tensor, owner: int, into: Incoming = None
    ) -> KVGrads:
        plan, rows = self.plan, self.rows  # one kernel call: fresh dk, dv (the schedule adds them)
        q_pos, k_pos, kw = _sparse_pair(plan, self.seq_len, owner, rows.q.device)
        dq_p, dk, dv = self.kernel.backward(
            rows.dout,
            rows.q,
            k_blk,
            v_blk,
            rows.final_out(slice(None)),
            rows.lse,
            q_pos,
            k_pos,
            plan.sparse,
            scale=self.scale,
            **kw,
        )
        rows.dq = dq_p if rows.dq is None else rows.dq.add_(dq_p)
        return dk, dv


def pair_work(plan: RingPlan, seq_len: int, scale: float, rows: Rows, merged: bool) -> PairWork:
    """The step work of ``plan``: dense (``PairWork``) or sparse (``SparsePairWork``)."""
    cls = PairWork if plan.sparse is None else SparsePairWork
    return cls(plan, seq_len, scale, rows, merged)
