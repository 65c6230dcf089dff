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
    ring over R ranks with n_r = S / R tokens and k_u K/V heads per rank, blk = B·n_r·k_u·D:
        p2p forward   2(R − 1)·blk·b
        p2p backward  2(R − 1)·blk·b + 2(R·[R_in > 1] + R_out·[R_out > 1])·blk·b_acc (dK/dV accumulators)
        all_gather    forward 2(R − 1)·blk·b; backward the same again + reduce_scatter 2(R − 1)·blk·b_acc
        tasp, startrail, attention2d: comm/model.py per peer (docs/comm_model.md), summed per kind

The distributed tests (``tests/test_usp.py``, ``tests/test_ring.py``) assert these numbers against
the bytes the collectives recorded; ``python -m ds_seqpar.report`` prints them for a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_seqpar.comm import model
from ds_seqpar.comm.all_to_all import HeadPlan, split_heads
from ds_seqpar.config import SequenceParallelConfig
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups
from ds_seqpar.parallel.usp import DEFAULT_ULYSSES_CHUNKS

__all__ = [
    "LayerBytes",
    "acc_bytes",
    "attention_layer_bytes",
    "delta_bytes",
    "model_arguments",
    "ring_bytes",
    "topology_ring_bytes",
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


def acc_bytes(element_bytes: int) -> int:
    """Bytes of the accumulator dtype for inputs of ``element_bytes``: fp64 for fp64, else fp32."""
    return 8 if element_bytes == 8 else 4


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
    batch: int,
    tokens: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    element_bytes: int,
    acc: int,
    *,
    inner: int | None = None,
    schedule: str = "p2p",
) -> LayerBytes:
    """Bytes one ring rank sends in one layer for ``tokens`` = S / R tokens and ``kv_heads`` K/V heads
    on this rank; ``inner`` = R_in of the double ring (None = single ring), ``schedule`` p2p | all_gather."""
    if ring == 1:
        return LayerBytes()
    blk = batch * tokens * kv_heads * head_dim  # elements of one of K or V on one rank
    kv = 2 * (ring - 1) * blk * element_bytes
    if schedule == "all_gather":
        return LayerBytes(
            {"all_gather": kv}, {"all_gather": kv, "reduce_scatter": 2 * (ring - 1) * blk * acc}
        )
    if schedule != "p2p":
        raise ValueError(f"schedule={schedule!r} is not a ring schedule; valid: p2p, all_gather")
    r_in = inner or ring
    if ring % r_in:
        raise ValueError(f"inner={inner} does not divide the ring degree R={ring}")
    r_out = ring // r_in
    sends = (ring if r_in > 1 else 0) + (r_out if r_out > 1 else 0)  # accumulator sends of dK and dV
    return LayerBytes({"p2p": kv}, {"p2p": kv + 2 * sends * blk * acc})


def attention_layer_bytes(
    config: SequenceParallelConfig,
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
    """Bytes one SP rank (Ulysses index ``ulysses_rank``) sends in one dense attention layer under
    ``config`` (a section with ``ulysses_degree`` resolved, e.g. by ``validate``) at ``seq_len`` tokens.

    ``attention: "sparse_ring"`` moves the same bytes plus its pattern estimation (docs/sparse.md);
    linear-attention layers are not covered (docs/linear.md).
    """
    if not config.enabled or config.size == 1:
        return LayerBytes()
    p, u = config.size, config.resolved_ulysses_degree
    r = p // u
    if seq_len % p:
        raise ValueError(f"seq_len={seq_len} is not a multiple of sequence_parallel.size={p}")
    n = seq_len // p
    acc = acc_bytes(element_bytes)
    plan = HeadPlan.build(heads, kv_heads, u)
    a2a_fwd, a2a_bwd = (
        ulysses_bytes(batch, n, heads, kv_heads, head_dim, u, element_bytes, ulysses_rank, backward)
        for backward in (False, True)
    )
    pipelined = False
    if r == 1 and u > 1:
        chunks = config.ulysses_chunks
        groups = HeadGroups.build(plan, DEFAULT_ULYSSES_CHUNKS if chunks == "auto" else chunks)
        pipelined = groups is not None
    delta = 0 if sinks or pipelined else delta_bytes(batch, n, heads, u, acc, ulysses_rank)
    ulysses = LayerBytes({"all_to_all": a2a_fwd}, {"all_to_all": a2a_bwd + delta})
    args = (batch, seq_len // r, plan.kv_counts[ulysses_rank], head_dim, r, element_bytes, acc)
    if config.ring.schedule in ("p2p", "all_gather"):
        ring = ring_bytes(*args, inner=config.ring.inner_size, schedule=config.ring.schedule)
    else:
        ring = topology_ring_bytes(config, plan.q_counts[ulysses_rank], *args)
    return LayerBytes() + ulysses + ring


def model_arguments(config: SequenceParallelConfig, shape: model.LayerShape) -> tuple[model.LayerShape, dict]:
    """``(shape, keywords)`` of ``comm.model.peer_bytes`` for the ring axis of a resolved section (StarTrail's
    ``"auto"`` backward resolved for this shape)."""
    cfg = config.ring
    backward = "kv"
    if cfg.schedule == "startrail":
        backward = cfg.startrail_backward
        if backward == "auto":
            backward = model.startrail_backward_choice(shape, cfg.team_size)
    return shape, dict(
        inner=cfg.inner_size,
        team_size=cfg.team_size,
        grid=tuple(cfg.grid) if cfg.grid else None,
        segments=2 if cfg.layout == "zigzag" else 1,
        startrail_backward=backward,
    )


def topology_ring_bytes(
    config: SequenceParallelConfig,
    heads: int,
    batch: int,
    tokens: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    element_bytes: int,
    acc: int,
    ring_rank: int | None = None,
) -> LayerBytes:
    """Bytes one ring rank sends in one layer under ``tasp``, ``startrail`` or ``attention2d``
    (``comm/model.py``, per collective kind), with ``heads`` / ``kv_heads`` on the rank; ``ring_rank``
    None = the ring rank that sends the most (StarTrail's members differ: member 0 makes no skew hop)."""
    cfg = config.ring
    shape, kw = model_arguments(
        config, model.LayerShape(batch, tokens, heads, kv_heads, head_dim, element_bytes, acc)
    )

    def of(rank: int) -> LayerBytes:
        return LayerBytes(
            model.kind_totals(model.peer_bytes(cfg.schedule, shape, ring, rank, backward=False, **kw)),
            model.kind_totals(model.peer_bytes(cfg.schedule, shape, ring, rank, backward=True, **kw)),
        )

    if ring_rank is not None:
        return of(ring_rank)
    return max((of(rank) for rank in range(ring)), key=lambda b: b.total)
