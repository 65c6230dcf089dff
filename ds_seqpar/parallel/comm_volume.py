"""Bytes one rank sends per attention layer: the formulas of docs/attention.md and docs/ring.md.

Legend: P = SP degree = U · R, n = S / P tokens per rank, B = batch rows, D = head dim, H / H_kv =
query / K/V heads, b = bytes per element of q, k, v, b_acc = bytes of the accumulator dtype (8 for
fp64 inputs, else 4). Counted as ``CommStats`` counts them (what a rank sends, by collective kind):

    Ulysses (kind all_to_all), rank u with h_u query and k_u K/V heads (``HeadPlan``), H_kv' the K/V
    heads after replication:
        forward   B·n·D·b · ((H − h_u) + (U − 1)·h_u + 2·(H_kv' − k_u))     q, k, v in; out back
        backward  B·n·D·b · ((H − h_u) + (U − 1)·h_u + 2·(U − 1)·k_u)       dout in; dq, dk, dv back
                  plus Δ = rowsum(dout · out): B·n·(H − h_u)·b_acc (not with sinks, nor in the
                  head-group pipeline of R = 1)
                  both = (U − 1)/U · B·n·D·(2H + 2H_kv') · b when the heads split evenly
    ring axis over R ranks with S / R tokens and k_u K/V heads per rank: the schedule's own bytes per
        peer (``ScheduleSpec.peer_bytes``, docs/comm_model.md), summed per kind (:func:`ring_bytes`)

The distributed tests (``tests/test_usp.py``, ``tests/test_ring.py``) assert these numbers against
the bytes the collectives recorded; ``python -m ds_seqpar.report`` prints them for a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_seqpar.comm.all_to_all import HeadPlan, split_heads
from ds_seqpar.comm.layer_bytes import LayerShape
from ds_seqpar.comm.model import kind_totals
from ds_seqpar.comm.schedules import RingParams, schedule_spec
from ds_seqpar.ops.precision import accumulator_bytes
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups
from ds_seqpar.settings import SeqParSettings

__all__ = [
    "LayerBytes",
    "attention_layer_bytes",
    "delta_bytes",
    "ring_bytes",
    "ulysses_bytes",
]


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one rank sends in one attention layer, per collective kind (kinds with 0 bytes left out)."""

    forward: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Forward plus backward, every kind."""
        return sum(self.forward.values()) + sum(self.backward.values())

    def __add__(self, other: LayerBytes) -> LayerBytes:
        return LayerBytes(_add(self.forward, other.forward), _add(self.backward, other.backward))


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for kind, nbytes in b.items():
        out[kind] = out.get(kind, 0) + nbytes
    return {kind: nbytes for kind, nbytes in out.items() if nbytes}


def ulysses_bytes(
    batch: int,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    degree: int,
    element_bytes: int,
    rank: int = 0,
    backward: bool = False,
) -> int:
    """Bytes Ulysses rank ``rank`` sends in one layer's forward (q, k, v in, the output back), or with
    ``backward`` in its backward (dout in; dq, dk, dv back; without :func:`delta_bytes`).

    ``tokens`` = n, this rank's tokens before the exchange; K/V heads are counted after replication
    (``HeadPlan``: U > H_kv sends each K/V head to every rank that needs it). The two directions
    differ only when the heads split unevenly over the U ranks.
    """
    if degree == 1:
        return 0
    plan = HeadPlan.build(heads, kv_heads, degree)
    h_u, k_u = plan.q_counts[rank], plan.kv_counts[rank]
    kv_sent = (degree - 1) * k_u if backward else sum(plan.kv_counts) - k_u
    heads_sent = (heads - h_u) + (degree - 1) * h_u + 2 * kv_sent
    return batch * tokens * head_dim * element_bytes * heads_sent


def delta_bytes(batch: int, tokens: int, heads: int, degree: int, acc: int, rank: int = 0) -> int:
    """Bytes of the backward's Δ = rowsum(dout · out) all-to-all (one ``acc``-byte value per token and head)."""
    if degree == 1:
        return 0
    h_u = split_heads(heads, degree)[rank]
    return batch * tokens * (heads - h_u) * acc


def ring_bytes(
    shape: LayerShape, params: RingParams, schedule: str = "p2p", ring_rank: int | None = None
) -> LayerBytes:
    """Bytes one ring rank sends in one layer under ``schedule`` for its ``shape`` (S / R tokens, its K/V
    heads): the spec's bytes per peer summed per kind; ``ring_rank`` None = the ring rank that sends the
    most (StarTrail's members differ: member 0 makes no skew hop)."""
    if params.ring == 1:
        return LayerBytes()
    spec = schedule_spec(schedule)

    def of(rank: int) -> LayerBytes:
        return LayerBytes(
            kind_totals(spec.peer_bytes(shape, params, rank, backward=False)),
            kind_totals(spec.peer_bytes(shape, params, rank, backward=True)),
        )

    if ring_rank is not None:
        return of(ring_rank)
    return max((of(rank) for rank in range(params.ring)), key=lambda b: b.total)


def attention_layer_bytes(
    settings: SeqParSettings,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    batch: int = 1,
    element_bytes: int = 4,
    sinks: bool = False,
    ulysses_rank: int = 0,
) -> LayerBytes:
    """Bytes one SP rank (Ulysses index ``ulysses_rank``) sends in one dense attention layer under resolved
    ``settings`` (``section.validate(...)``) at ``seq_len`` tokens.

    ``attention: "sparse_ring"`` moves the same bytes plus its pattern estimation (docs/sparse.md);
    linear-attention layers are not covered (docs/linear.md).
    """
    if not settings.enabled or settings.size == 1:
        return LayerBytes()
    p, u = settings.size, settings.ulysses_degree
    r = p // u
    if seq_len % p:
        raise ValueError(f"seq_len={seq_len} is not a multiple of sequence_parallel.size={p}")
    n = seq_len // p
    acc = accumulator_bytes(element_bytes)
    plan = HeadPlan.build(heads, kv_heads, u)
    a2a_fwd, a2a_bwd = (
        ulysses_bytes(batch, n, heads, kv_heads, head_dim, u, element_bytes, ulysses_rank, backward)
        for backward in (False, True)
    )
    pipelined = r == 1 and u > 1 and HeadGroups.build(plan, settings.ulysses_chunks) is not None
    delta = 0 if sinks or pipelined else delta_bytes(batch, n, heads, u, acc, ulysses_rank)
    ulysses = LayerBytes({"all_to_all": a2a_fwd}, {"all_to_all": a2a_bwd + delta})
    shape = LayerShape(
        batch,
        seq_len // r,
        plan.q_counts[ulysses_rank],
        plan.kv_counts[ulysses_rank],
        head_dim,
        element_bytes,
        acc,
    )
    return LayerBytes() + ulysses + ring_bytes(shape, settings.ring_params(), settings.ring.schedule)
