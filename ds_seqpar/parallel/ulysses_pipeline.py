"""Pipelined Ulysses (ring degree 1): the all-to-all of one head group overlaps the attention of another.

Legend: U = Ulysses degree, n = tokens per rank, c = head groups, h_u / k_u = query / K/V heads of
Ulysses rank u (``HeadPlan``), m_u = h_u / c query heads of rank u per group.

Every rank's heads split into c groups; group j holds query heads ``j·m_u ... (j+1)·m_u - 1`` of each
rank and the K/V heads they read. Forward and backward each run c exchanges per direction, with the
next group's exchange and the previous group's return in flight while a group is computed:

    forward:   in(0) | in(1) ~ attend(0) ~ out(0) | in(2) ~ attend(1) ~ out(1) | ... | wait out(*)
    backward:  dout(0) | dout(1) ~ grads(0) ~ back(0) | ... | wait back(*)

K/V heads (GQA): when k_u divides into the groups (``m_u`` a multiple of the group size g_u = h_u / k_u),
group j carries its own K/V heads; otherwise (one K/V head serves several groups: g_u a multiple of
m_u) group 0 carries all of them, later groups reuse them, and their gradients (summed in fp32, or
fp64 for fp64 inputs) go back with the last group. Bytes are those of the unpipelined exchange: every
head moves once each way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, PendingExchange, post_head_to_seq, post_seq_to_head
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.parallel.ulysses import gather_kv_heads

# attend(q [B, U·n, h, D], k, v [B, U·n, h_kv, D], sinks [h] | None) -> out [B, U·n, h, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class HeadGroups:
    """How each Ulysses rank's heads split into pipelined groups (per group j, per rank u).

    Attributes:
        q_counts / q_starts: query heads of rank u in group j and the first of them (global head index).
        kv_counts / kv_starts: K/V heads first sent with group j (index into the K/V that ``HeadPlan``
            gathers); 0 when group j reuses earlier ones.
        kv_source: per group, the group whose received K/V it reads; kv_rows: per group and rank, the
            ``(lo, hi)`` K/V heads of that received block it attends to.
        kv_carrier: per group, the group whose K/V gradients travel back with it (or None).
    """

    groups: int
    q_counts: tuple[tuple[int, ...], ...]
    q_starts: tuple[tuple[int, ...], ...]
    kv_counts: tuple[tuple[int, ...], ...]
    kv_starts: tuple[tuple[int, ...], ...]
    kv_source: tuple[int, ...]
    kv_rows: tuple[tuple[tuple[int, int], ...], ...]
    kv_carrier: tuple[int | None, ...]

    @staticmethod
    def _fits(heads: HeadPlan, c: int) -> bool:
        for h, k in zip(heads.q_counts, heads.kv_counts):
            if h % c or h % k:
                return False
            m, g = h // c, h // k
            if m % g and g % m:
                return False
        return True

    @classmethod
    def build(cls, heads: HeadPlan, wanted: int) -> HeadGroups | None:
        """The largest group count <= ``wanted`` that the head plan allows, or None when that is 1."""
        c = next((c for c in range(min(wanted, min(heads.q_counts)), 1, -1) if cls._fits(heads, c)), 1)
        if c == 1:
            return None
        degree = heads.degree
        q_first = [sum(heads.q_counts[:u]) for u in range(degree)]
        kv_first = [sum(heads.kv_counts[:u]) for u in range(degree)]
        m = [h // c for h in heads.q_counts]
        g = [h // k for h, k in zip(heads.q_counts, heads.kv_counts)]
        own_kv = all(m[u] % g[u] == 0 for u in range(degree))  # every group has K/V heads of its own
        q_counts = tuple(tuple(m) for _ in range(c))
        q_starts = tuple(tuple(q_first[u] + j * m[u] for u in range(degree)) for j in range(c))
        if own_kv:
            per = [k // c for k in heads.kv_counts]
            kv_counts = tuple(tuple(per) for _ in range(c))
            kv_starts = tuple(tuple(kv_first[u] + j * per[u] for u in range(degree)) for j in range(c))
            kv_source = tuple(range(c))
            kv_rows = tuple(tuple((0, per[u]) for u in range(degree)) for _ in range(c))
            kv_carrier: tuple[int | None, ...] = tuple(range(c))
        else:
            none = tuple(0 for _ in range(degree))
            kv_counts = (tuple(heads.kv_counts),) + (none,) * (c - 1)
            kv_starts = (tuple(kv_first),) + (tuple(kv_first),) * (c - 1)
            kv_source = (0,) * c
            kv_rows = tuple(
                tuple((j * m[u] // g[u], ((j + 1) * m[u] - 1) // g[u] + 1) for u in range(degree))
                for j in range(c)
            )
            kv_carrier = (None,) * (c - 1) + (0,)
        return cls(c, q_counts, q_starts, kv_counts, kv_starts, kv_source, kv_rows, kv_carrier)


@dataclass
class _Exchange:
    """Where the exchanges go: the Ulysses group, this rank's index in it, byte accounting."""

    group: Any
    me: int
    stats: Any

    def scatter(self, xs, counts, starts, async_op: bool) -> PendingExchange:
        return post_seq_to_head(xs, counts, self.group, self.me, self.stats, starts, async_op)

    def gather(self, ys, counts, into, async_op: bool) -> PendingExchange:
        return post_head_to_seq(ys, counts, self.group, self.me, self.stats, into, async_op)


class _PipelinedUlysses(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        groups: HeadGroups,
        attend: Attend,
        exchange: _Exchange,
        needs_grad: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        me, c = exchange.me, groups.groups
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        sinks_leaf = None if sinks is None else sinks.detach().requires_grad_(needs_grad)

        def post_in(j: int) -> PendingExchange:
            counts = (groups.q_counts[j], groups.kv_counts[j], groups.kv_counts[j])
            starts = (groups.q_starts[j], groups.kv_starts[j], groups.kv_starts[j])
            return exchange.scatter((q, k, v), counts, starts, async_op=j > 0)

        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # received K/V per group (grad leaves)
        last_use = {source: j for j, source in enumerate(groups.kv_source)}
        saved, returns = [], []
        pending = post_in(0)
        for j in range(c):
            q_j, k_new, v_new = pending.wait()
            if j + 1 < c:
                pending = post_in(j + 1)
            if groups.kv_counts[j][me]:
                kv[j] = (k_new.detach().requires_grad_(needs_grad), v_new.detach().requires_grad_(needs_grad))
            k_blk, v_blk = kv[groups.kv_source[j]]
            lo, hi = groups.kv_rows[j][me]
            q_j = q_j.detach().requires_grad_(needs_grad)
            with torch.set_grad_enabled(needs_grad):
                first = groups.q_starts[j][me]  # this rank's query heads in group j (global indices)
                sinks_j = None if sinks_leaf is None else sinks_leaf[first : first + groups.q_counts[j][me]]
                out_j = attend(q_j, k_blk[:, :, lo:hi], v_blk[:, :, lo:hi], sinks_j)
            returns.append(
                exchange.gather(
                    (out_j.detach(),), (groups.q_counts[j],), [(out, groups.q_starts[j])], async_op=True
                )
            )
            _settle_previous(returns)
            if needs_grad:
                saved.append((q_j, out_j))
            else:  # no backward (evaluation, a checkpointed layer's first run): free the group's buffers now
                del q_j, out_j, k_blk, v_blk
                if last_use[groups.kv_source[j]] == j:
                    del kv[groups.kv_source[j]]
        for pending_out in returns:
            if pending_out is not None:
                pending_out.wait()
        ctx.state = (groups, exchange, saved, kv, q.shape, k.shape, k.dtype, sinks_leaf)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        groups, exchange, saved, kv, q_shape, kv_shape, kv_dtype, sinks_leaf = ctx.state
        ctx.state = None
        dsinks = None if sinks_leaf is None else torch.zeros_like(sinks_leaf)
        c = groups.groups
        dq = dout.new_empty(q_shape)
        dk, dv = (dout.new_empty(kv_shape, dtype=kv_dtype) for _ in range(2))
        readers = Counter(groups.kv_source)  # groups reading each received K/V block
        left = Counter(readers)  # ... of which have not run their backward yet
        kv_grads: dict[int, list[torch.Tensor]] = {}

        def post_dout(j: int) -> PendingExchange:
            return exchange.scatter((dout,), (groups.q_counts[j],), (groups.q_starts[j],), async_op=j > 0)

        returns = []
        pending = post_dout(0)
        for j in range(c):
            (dout_j,) = pending.wait()
            if j + 1 < c:
                pending = post_dout(j + 1)
            q_j, out_j = saved[j]
            saved[j] = None  # this group's received q and its output go as soon as its gradients exist
            source = groups.kv_source[j]
            left[source] -= 1  # the last reader takes the K/V heads out: they go with its graph
            k_blk, v_blk = kv.pop(source) if left[source] == 0 else kv[source]
            leaves = (q_j, k_blk, v_blk) if sinks_leaf is None else (q_j, k_blk, v_blk, sinks_leaf)
            dq_j, dk_j, dv_j, *dsinks_j = torch.autograd.grad(out_j, leaves, dout_j)
            if dsinks_j:
                dsinks += dsinks_j[0]
            del q_j, out_j, k_blk, v_blk, leaves
            if readers[source] == 1:
                kv_grads[source] = [dk_j, dv_j]
            elif source not in kv_grads:  # several groups read these K/V heads: sum their parts in >= fp32
                acc = torch.promote_types(dk_j.dtype, torch.float32)
                kv_grads[source] = [dk_j.to(acc), dv_j.to(acc)]
            else:
                kv_grads[source][0] += dk_j
                kv_grads[source][1] += dv_j
            ys, counts, into = [dq_j], [groups.q_counts[j]], [(dq, groups.q_starts[j])]
            carried = groups.kv_carrier[j]
            if carried is not None:
                dk_c, dv_c = (g.to(kv_dtype) for g in kv_grads.pop(carried))
                ys += [dk_c, dv_c]
                counts += [groups.kv_counts[carried]] * 2
                into += [(dk, groups.kv_starts[carried]), (dv, groups.kv_starts[carried])]
            returns.append(exchange.gather(ys, tuple(counts), into, async_op=True))
            _settle_previous(returns)
        saved.clear()
        for pending_back in returns:
            if pending_back is not None:
                pending_back.wait()
        return None, None, None, None, dq, dk, dv, dsinks


def _settle_previous(returns: list[PendingExchange | None]) -> None:
    """Wait for the return before the newest (it had a whole group's attention to finish) and drop it, so
    at most two groups' return buffers are alive (docs/memory.md "Attention buffers")."""
    if len(returns) >= 2 and returns[-2] is not None:
        returns[-2].wait()
        returns[-2] = None


def pipelined_ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    heads: HeadPlan,
    groups: HeadGroups,
    mesh: SeqParMesh,
    attend: Attend,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses attention with the head exchange pipelined against ``attend`` (ring degree 1).

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``: this rank's n tokens, all heads.
        heads: the head plan of the Ulysses group (K/V replication is applied here, before the exchange).
        groups: ``HeadGroups.build(heads, c)``.
        attend: ``attend(q [B, U·n, h, D], k, v [B, U·n, h_kv, D], sinks [h] | None) -> out [B, U·n, h, D]``
            over the whole sequence (differentiable; called once per group).
        sinks: None, or ``[H]`` attention-sink logits of every query head (not communicated: each
            group's attend gets the slice of its own heads).

    Returns:
        ``out [B, n, H, D]``; differentiable in q, k, v and sinks. Communicates what ``scatter_heads`` and
        ``gather_heads`` do, in ``groups.groups`` all-to-alls per direction.
    """
    k, v = gather_kv_heads(k, v, heads)
    exchange = _Exchange(mesh.group("ulysses"), mesh.coords.ulysses_rank, mesh.comm_stats)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    return _PipelinedUlysses.apply(groups, attend, exchange, needs_grad, q, k, v, sinks)
