"""USP (Ulysses x Ring) and the public attention entry point ``ds_seqpar.attention``.

Legend: P = SP degree = U · R, n = S / P tokens per rank, B, H, H_kv, D as usual.

    q [B, n, H, D] (this rank's tokens in ``UspLayout`` order: ring layout, then Ulysses split)
      -> Ulysses all-to-all (U ranks)            q [B, S/R, h_u, D]
      -> ring engine over the R ring ranks        (schedule x layout x kernel from the config)
      -> inverse all-to-all                       out [B, n, H, D]

``attention: "ulysses"`` is the case R = 1 and ``attention: "ring"`` the case U = 1 of the same
code. Communication per rank and layer (fwd, docs/attention.md "Bytes per rank and layer", tested exactly):
Ulysses ``(U-1)/U · B·n·D·(2H + 2H_kv)`` + ring ``2(R-1) · B·(S/R)·(H_kv/U)·D`` elements.
Every check runs before the first collective. Then the SP ranks agree on their shapes: the first call with
a new local shape on a mesh all-gathers every rank's (``parallel/agree.py``, docs/cross_attention.md "Shapes
across ranks"); shards that differ raise ``RankShapeError`` on every rank instead of aborting in gloo or
hanging in NCCL. Later calls with that shape run no extra collective.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_seqpar.comm.all_to_all import HeadPlan, seq_to_head
from ds_seqpar.comm.p2p import RingComm
from ds_seqpar.comm.schedules import RingSchedule
from ds_seqpar.layout import ContiguousLayout, UspLayout
from ds_seqpar.mesh import SeqParMesh
from ds_seqpar.ops.attention import check_softcap, resolve_kernel
from ds_seqpar.ops.masks import MaskSpec, check_chunk, chunk_doc_ids
from ds_seqpar.ops.precision import accumulation_dtype
from ds_seqpar.ops.sparse.kernels import resolve_sparse_kernel
from ds_seqpar.parallel.activation import sparse_layer_active
from ds_seqpar.parallel.agree import check_same_inputs
from ds_seqpar.parallel.grouped import grouped_attention, grouped_plan
from ds_seqpar.parallel.image_blocks import image_block_reach
from ds_seqpar.parallel.ring import OutputDelta, RingPlan, WorkCounter, check_qkv, check_sinks, ring_attention
from ds_seqpar.parallel.sparse_ring import sparse_attention
from ds_seqpar.parallel.team import team_attention
from ds_seqpar.parallel.ulysses import gather_heads, local_sinks, scatter_heads
from ds_seqpar.parallel.ulysses_pipeline import HeadGroups, pipelined_ulysses


@dataclass(frozen=True)
class Runner:
    """How a schedule's attention runs on the ring axis: ``run(q, k, v, plan, scale, sinks, settings)`` ->
    ``(out, lse)``; ``takes_delta``: whether it can skip saving its output (``OutputDelta``)."""

    run: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    takes_delta: bool


RUNNERS: dict[str, Runner] = {
    "ring": Runner(
        lambda q, k, v, plan, scale, sinks, settings: ring_attention(q, k, v, plan, scale, sinks), True
    ),
    "team": Runner(
        lambda q, k, v, plan, scale, sinks, settings: team_attention(
            q, k, v, plan, softmax_scale=scale, sinks=sinks, backward=settings.ring.startrail_backward
        ),
        False,
    ),
}
"""``ScheduleSpec.runner`` -> how ``ds_seqpar.attention`` runs it (the ring engine, or the team wrapper)."""


AGREED_FLAGS = ("causal", "window", "chunk")  # the flags every SP rank must pass alike
AGREED = (
    "q",
    "k",
    "v",
    "sinks",
    "doc_ids",
    "alibi_slopes",
    "blocks",
)  # what every SP rank must pass alike, with causal and window
SAME_SHARDS = (
    "every SP rank must pass the same B, n, H, H_kv, D and dtype: shard each batch with ds_seqpar's layout "
    "(ds_seqpar.shard_batch / seqpar_dataloader, which pad S to the layout's multiple) so every rank holds "
    "n = S / P tokens, and run the same layers on every rank"
)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SeqParMesh,
    layout: UspLayout,
    positions: torch.Tensor | None,
    doc_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
) -> int:
    """Validate everything before any collective; return the global length S."""
    check_qkv(q, k, v, "ds_seqpar.attention")
    check_sinks(sinks, q, "ds_seqpar.attention")
    _check_alibi(alibi_slopes, q, mesh)
    h, settings = q.shape[2], mesh.settings
    if mesh.ulysses_size > h:
        raise ValueError(
            f"sequence_parallel.ulysses_degree={mesh.ulysses_size} exceeds the {h} query heads of this layer; "
            f"valid: a ulysses_degree <= {h} (move the rest of the SP degree to the ring)"
        )
    seq_len = q.shape[1] * layout.world
    layout.check_length(seq_len)
    sparse = settings.sparse
    if (
        settings.attention == "sparse_ring"
        and sparse.balancing != "none"
        and seq_len % (layout.ring.world * sparse.block_size) != 0
    ):
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of ring degree {layout.ring.world} x "
            f"sparse.block_size {sparse.block_size}; pad it (ds_seqpar.data pads for you)"
        )
    if positions is not None:
        _check_positions(positions, layout, seq_len, mesh.coords.sp_rank)
    if doc_ids is not None and doc_ids.shape[-1] != seq_len:
        raise ValueError(
            f"doc_ids has {doc_ids.shape[-1]} tokens but the sequence has S = {q.shape[1]} x {layout.world} = "
            f"{seq_len}; pass document ids of the whole sequence in global order ([S] or [B, S])"
        )
    return seq_len


def _check_alibi(slopes: torch.Tensor | None, q: torch.Tensor, mesh: SeqParMesh) -> None:
    """ALiBi slopes must be a float ``[H]`` on q's device, and the algorithm one that applies them."""
    if slopes is None:
        return
    h = q.shape[2]
    if not isinstance(slopes, torch.Tensor) or slopes.shape != (h,) or not slopes.dtype.is_floating_point:
        got = tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise ValueError(f"ds_seqpar.attention: alibi_slopes must be a float tensor [H] (H={h}); got {got}")
    if slopes.device != q.device:
        raise ValueError(f"ds_seqpar.attention: alibi_slopes are on {slopes.device} but q is on {q.device}")
    if mesh.settings.attention == "sparse_ring":
        raise ValueError(
            "ds_seqpar.attention: alibi_slopes with attention='sparse_ring': the sparse block kernels take no "
            "position bias; use attention 'usp', 'ulysses' or 'ring'"
        )


def _check_positions(positions: torch.Tensor, layout: UspLayout, seq_len: int, rank: int) -> None:
    """The global positions of this rank's tokens must be the layout's (catches data sharded another way)."""
    expected = layout.local_positions(seq_len, rank).to(positions.device)
    got = positions if positions.dim() == 1 else positions[0]
    if got.shape != expected.shape or not torch.equal(got.long(), expected):
        raise ValueError(
            f"positions of this rank's tokens do not match the '{layout.ring.name}' layout over "
            f"{layout.world} SP ranks (expected {expected[:4].tolist()}..., got {got[:4].tolist()}...); "
            "shard the batch with ds_seqpar's layout (ds_seqpar.input_layout(mesh)) and pass "
            "global token positions, not per-document ones (those go in doc_ids)"
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SeqParMesh,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    work: WorkCounter | None = None,
    layer: int | None = None,
    step: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence that the SP group shares; the configured algorithm.

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, n, H_kv, D]``: this rank's n tokens, sharded with
            ``input_layout(mesh)`` (RoPE already applied with GLOBAL positions).
        mesh: the ``SeqParMesh``; its ``settings`` pick the algorithm (usp | ulysses | ring | sparse_ring),
            ring layout, schedule, overlap and kernel.
        causal: causal mask in global positions (False = encoder attention).
        softmax_scale: default ``D ** -0.5``.
        window: sliding window in positions: query i sees key j iff ``0 <= i - j < window`` (causal; the
            query itself included; non-causal: ``|i - j| < window``), or None.
        positions: optional global positions of this rank's tokens ``[n]`` / ``[B, n]``; checked
            against the layout (catches data sharded another way).
        doc_ids: document id per token of the whole sequence in global order, ``[S]`` or ``[B, S]``
            (packed batches; negative = padding), or None.
        work: optional counter of the attention work this rank computes.
        layer, step: layer index and training step, for ``attention: "sparse_ring"`` (which layers are
            sparse, dense warm-up, per-layer statistics); other algorithms ignore them.
        softcap: None, or c > 0: scores become ``c · tanh(score / c)`` before the softmax (Gemma 2's
            attention logit soft-capping); ``kernel: auto`` picks a kernel that applies it.
        sinks: None, or ``[H]`` attention-sink logits, one per query head (gpt-oss ``s_aux``): each
            joins every row's softmax denominator with a zero value; differentiable.
        chunk: None, or c >= 1: chunked attention (Llama 4's ``attention_chunk_size``): a query sees only
            the keys of its own chunk of c consecutive tokens of its row (counted from the row's first
            real token), with ``causal`` and ``window`` inside; run as documents cut at every chunk border.
        alibi_slopes: None, or ``[H]`` ALiBi slopes, one per query head (BLOOM, MPT): score (i, j) of head h
            gains ``alibi_slopes[h] · (j - i)`` in GLOBAL positions (a constant: no gradient). Each Ulysses rank
            applies the slopes of the heads it holds; nothing more is communicated.
        blocks: None, or bidirectional image block ids ``[S]`` / ``[B, S]`` (Gemma 3): ``parallel/image_blocks.py``.

    Returns:
        ``out [B, n, H, D]`` in q.dtype; differentiable in q, k, v (and sinks). Exact for every
        algorithm except ``sparse_ring``, which is exact attention under the estimated vertical-slash
        pattern. A query that sees no key (padding, doc id < 0) outputs 0.
    """
    settings = mesh.settings
    layout = settings.input_layout().for_batch(doc_ids)  # ring.layout='documents': the batch's placement
    seq_len = _check(q, k, v, mesh, layout, positions, doc_ids, sinks, alibi_slopes)
    reach = image_block_reach(blocks, causal, chunk, seq_len, q, doc_ids, settings.attention, layout)
    softcap = check_softcap(softcap)
    # an unavailable kernel fails here, not mid-collective
    resolve_kernel(settings.kernel, q.device, q.dtype, softcap, alibi_slopes is not None)
    flags = tuple(-1 if x is None else int(x) for x in (causal, window, chunk))
    agree = functools.partial(check_same_inputs, mesh, "ds_seqpar.attention", AGREED,
                              (q, k, v, sinks, doc_ids, alibi_slopes, blocks), flags, SAME_SHARDS, AGREED_FLAGS)  # fmt: skip
    doc_ids = _chunked(doc_ids, chunk, seq_len, q.device, settings.attention)  # the mask's documents
    if settings.attention == "sparse_ring" and causal and sparse_layer_active(settings.sparse, layer, step):
        resolve_sparse_kernel(settings.sparse.kernel, q.device, q.dtype)  # fails here, not mid-collective
        agree()
        mask = dict(window=window, doc_ids=doc_ids, work=work, layer=layer, softcap=softcap, sinks=sinks)
        return sparse_attention(q, k, v, mesh=mesh, layout=layout, schedule=mesh.schedule(), seq_len=seq_len,
                                softmax_scale=softmax_scale, **mask)  # fmt: skip
    mask = MaskSpec(causal=causal, window=window)
    if layout.group_degree is not None:  # dynamic_degree: this batch runs in groups over their own documents
        plan = grouped_plan(mesh, layout, mask, doc_ids, work, softcap, reach)
        agree()
        return grouped_attention(q, k, v, dataclasses.replace(plan, alibi=alibi_slopes), softmax_scale, sinks)
    plan = _ring_plan(mesh, layout, mask, doc_ids, work, softcap, reach)
    agree()
    return _ulysses_over_ring(q, k, v, mesh, plan, softmax_scale, sinks, alibi_slopes)


CHUNK_IDS: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}  # (ids tensor or None, chunked ids)


def _chunked(
    doc_ids: torch.Tensor | None, chunk: int | None, seq_len: int, device: torch.device, algorithm: str
) -> torch.Tensor | None:
    """The document ids of the mask: ``doc_ids`` itself without a chunk, else ``chunk_doc_ids``, built once
    per batch (every chunked layer of a step asks with the same ids, and the ring plan is cached per ids
    tensor). The layout keeps following ``doc_ids``."""
    if check_chunk(chunk) is None:
        return doc_ids
    if algorithm == "sparse_ring":
        raise ValueError(
            f"chunk={chunk} (chunked attention) is not supported with sequence_parallel.attention='sparse_ring': "
            "its pattern is estimated over the whole row; use attention 'usp' for a model with chunked layers"
        )
    key = (None if doc_ids is None else id(doc_ids), chunk, seq_len, str(device))
    entry = CHUNK_IDS.get(key)
    if entry is not None and entry[0] is doc_ids:
        return entry[1]
    if len(CHUNK_IDS) >= 16:
        CHUNK_IDS.clear()
    ids = chunk_doc_ids(doc_ids, chunk, seq_len, device)
    CHUNK_IDS[key] = (doc_ids, ids)
    return ids


def _ring_plan(
    mesh: SeqParMesh,
    layout: UspLayout,
    mask: MaskSpec,
    doc_ids: torch.Tensor | None,
    work: WorkCounter | None,
    softcap: float | None,
    reach: torch.Tensor | None = None,
) -> RingPlan:
    """The ring engine's plan under the mesh's schedule: its K/V and query layouts over the ring layout.
    A document placement that keeps every document on one ring rank needs no exchange: each rank then
    attends over its own ring shard alone."""
    if not layout.ring.needs_exchange and doc_ids is not None:
        # a ring of one: this ring rank's shard against itself, nothing sent (docs/balance.md "Rows of
        # short documents"); positions are the shard's own indices: each document is one run of it, so
        # causal order and window distances are the global ones
        local_docs = layout.ring.local_doc_ids(doc_ids, mesh.coords.ring_rank)
        alone = RingSchedule(RingComm(None, [mesh.coords.rank], 0, mesh.comm_stats))
        local_reach = None if reach is None else layout.ring.local_doc_ids(reach, mesh.coords.ring_rank)
        return RingPlan(
            alone, ContiguousLayout(1), mask, local_docs, mesh.settings.kernel, work, softcap=softcap,
            reach=local_reach,
        )  # fmt: skip
    settings, schedule = mesh.settings, mesh.schedule()
    kv_layout, query_layout = settings.schedule.layouts(schedule, layout.ring)
    return RingPlan(
        schedule, kv_layout, mask, doc_ids, settings.kernel, work, softcap=softcap, query_layout=query_layout,
        reach=reach,
    )  # fmt: skip


def _ulysses_over_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SeqParMesh,
    plan: RingPlan,
    scale: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses all-to-all over heads (pipelined in head groups when R = 1, not with ALiBi), the schedule's
    ring-axis attention, and the inverse all-to-all: ``[B, n, H, D]`` in, the same out."""
    runner = RUNNERS[mesh.settings.schedule.runner]
    heads = HeadPlan.build(q.shape[2], k.shape[2], mesh.ulysses_size)
    if alibi_slopes is not None:  # this rank's heads' slopes (the same slicing as the sinks)
        plan = dataclasses.replace(plan, alibi=local_sinks(alibi_slopes, heads, mesh))
    run = functools.partial(_run, runner, plan, scale, mesh.settings)
    groups = None if alibi_slopes is not None else _head_groups(mesh, heads)
    if groups is not None:
        return pipelined_ulysses(q, k, v, heads, groups, mesh, run, sinks)
    q2, k2, v2 = scatter_heads(q, k, v, heads, mesh, separate=mesh.ring_size > 1)
    if sinks is not None or mesh.sp_size == 1 or not runner.takes_delta:  # one rank: nothing is kept twice
        return gather_heads(run(q2, k2, v2, local_sinks(sinks, heads, mesh)), heads, mesh)
    delta = OutputDelta()
    out, _ = ring_attention(q2, k2, v2, plan, scale, delta=delta)
    return _OutputDeltaTap.apply(gather_heads(out, heads, mesh), delta, heads, mesh)


def _run(
    runner: Runner, plan: RingPlan, scale: float | None, settings: object, q, k, v, sinks
) -> torch.Tensor:
    """The ring-axis attention of Ulysses-scattered q, k, v ``[B, S/R, h_u, D]``: its output."""
    return runner.run(q, k, v, plan, scale, sinks, settings)[0]


DELTA_CHUNK_TOKENS = 8192  # tokens per chunk of the rowsum(dout * out) in the output's backward


class _OutputDeltaTap(torch.autograd.Function):
    """Identity on the attention output ``[B, n, H, D]`` (token layout). Backward: Δ = rowsum(dout · out)
    per token and head, moved to the ring's head layout ``[B, U·n, h_u]`` (one all-to-all of B·n·H
    elements, 1/D of the output's) and given to the ring call's ``OutputDelta``.

    The ring then keeps no head-layout copy of the output between forward and backward (the output
    projection saves this token-layout one anyway), and its backward holds no output at all.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, delta: OutputDelta, heads: HeadPlan, mesh: SeqParMesh):
        ctx.save_for_backward(out)
        ctx.delta, ctx.heads, ctx.mesh = delta, heads, mesh
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        (out,) = ctx.saved_tensors
        acc = accumulation_dtype(out.dtype)
        rowdot = torch.empty(out.shape[:-1], dtype=acc, device=out.device)  # [B, n, H]
        for s in range(0, out.shape[1], DELTA_CHUNK_TOKENS):
            part = slice(s, s + DELTA_CHUNK_TOKENS)
            rowdot[:, part] = (dout[:, part].to(acc) * out[:, part].to(acc)).sum(-1)
        mesh, heads = ctx.mesh, ctx.heads
        if mesh.ulysses_size > 1:
            group, me = mesh.group("ulysses"), mesh.coords.ulysses_rank
            (moved,) = seq_to_head((rowdot.unsqueeze(-1),), (heads.q_counts,), group, me, mesh.comm_stats)
            rowdot = moved.squeeze(-1)
        ctx.delta.give(rowdot)
        return dout, None, None, None


def _head_groups(mesh: SeqParMesh, heads: HeadPlan) -> HeadGroups | None:
    """Pipelined head groups for a Ulysses-only mesh (R = 1, U > 1), or None for one exchange."""
    if mesh.ring_size != 1 or mesh.ulysses_size == 1:
        return None
    return HeadGroups.build(heads, mesh.settings.ulysses_chunks)
