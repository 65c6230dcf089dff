"""One candidate's predicted step: seconds, peak bytes per rank, bytes per link class, and what bounds it
(docs/plan.md "The three models").

Legend: P = U·R ranks per sequence, n = S / P tokens per rank, L layers, B micro-batch. Per layer and
rank: the linear part (``plan/compute.py``), the Ulysses all-to-alls and the ring schedule's phases with
the attention compute inside its chain (``plan/attention_time.py``), the slowest representative rank's.
A step: L × (forward + backward [+ the forward again under checkpointing] [+ the MLP again when tiled])
+ the LM head and loss + the optimizer; ZeRO-3's parameter and gradient traffic overlaps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_seqpar.comm.model import startrail_backward_choice
from ds_seqpar.layout.grouped import dynamic_placement
from ds_seqpar.memory.estimate import memory_estimate
from ds_seqpar.plan.attention_time import (
    AttentionSetting,
    Result,
    collective_only,
    ring_family,
    slowest,
    startrail,
    traffic_of,
    ulysses_bytes_of,
    ulysses_phases,
)
from ds_seqpar.plan.candidates import MEMORY_SAVINGS, Candidate
from ds_seqpar.plan.clusters import Cluster
from ds_seqpar.plan.compute import AttentionWork, ModelDims, documents_work, zigzag_row_work, zigzag_work
from ds_seqpar.plan.links import Ring
from ds_seqpar.plan.profile import ComputeProfile

__all__ = ["PLACEMENT_BALANCE", "PlanContext", "Prediction", "predict"]

PLACEMENT_BALANCE = 1.02  # max / mean work of the document placement on the shipped mixes (docs/balance.md)
STEP_ALLREDUCES = 2  # per step: the loss totals over the SP group, the gradient reduction
BOUND_SHARE = 0.10  # a cost that takes more than this share of the step is named in the reasons


@dataclass(frozen=True)
class PlanContext:
    """What every candidate is evaluated against: the model, the cluster and its compute profile, the
    sequence (S, or packed rows of document lengths), the world, precision and ZeRO stage.

    ``compute_scale``: every compute second is multiplied by it (``--cluster local``: ranks per core
    when the ranks outnumber the cores)."""

    dims: ModelDims
    model_config: Any
    cluster: Cluster
    profile: ComputeProfile
    seq_len: int
    world: int
    ranks_per_node: int
    element_bytes: int = 2
    zero_stage: int = 3
    rows: tuple[tuple[int, ...], ...] = ()
    compute_scale: float = 1.0
    memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)  # attention results


@dataclass
class Prediction:
    """A candidate's predicted step: seconds, device peak bytes per rank, bytes one rank sends per step by
    link class (``inter``, ``intra``), seconds by part, and the one-line reasons."""

    candidate: Candidate
    step_s: float
    peak_bytes: int
    step_bytes: int
    bytes_by_link: dict[str, float]
    parts: dict[str, float] = field(default_factory=dict)
    reasons: str = ""
    fits: bool = True
    degrees: dict[int, int] = field(default_factory=dict)  # rows per SP degree the step runs them at

    @property
    def policy_note(self) -> str:
        """The SP-degree policy and why: ``fixed`` (every row on P ranks) or ``dynamic`` with the rows it
        runs at each degree (p = 1: no attention communication)."""
        c = self.candidate
        if not c.dynamic:
            return "fixed"
        rows = sum(self.degrees.values())
        counts = ", ".join(f"p={p}: {n}" for p, n in self.degrees.items())
        small = rows - self.degrees.get(c.size, 0)
        return f"dynamic ({counts} of {rows} rows; {small} below P={c.size})"

    @property
    def seconds_per_sequence(self) -> float:
        """Step seconds over the sequences a step trains on all ranks (B × dp)."""
        c = self.candidate
        return self.step_s / (c.micro_batch * c.data_parallel)


class _Heads:
    """The attention shape the time model reads (``HeadShape``)."""

    def __init__(self, dims: ModelDims) -> None:
        self.name, self.heads, self.kv_heads, self.head_dim = (
            dims.name,
            dims.heads,
            dims.kv_heads,
            dims.head_dim,
        )


def _work(ctx: PlanContext, c: Candidate, row: Sequence[int] | None) -> AttentionWork:
    """One rank's attention work for B rows: one document of S tokens, or the packed ``row``."""
    if row is None:
        return zigzag_work(ctx.seq_len, c.ring, c.micro_batch)
    if c.layout == "documents":
        one = documents_work(row, c.ring, PLACEMENT_BALANCE)
    else:
        one = zigzag_row_work(row, ctx.seq_len, c.ring)
    b = c.micro_batch
    return AttentionWork(one.full * b, one.causal_area * b, one.calls * b, one.visible * b, one.side)


def _kind(c: Candidate) -> str | None:
    """Which SP-path probe a candidate's attention follows: ``ring`` (R > 1), ``ulysses`` (R = 1 < U)."""
    return None if c.size == 1 else "ring" if c.ring > 1 else "ulysses"


def _attention_forward_s(ctx: PlanContext, c: Candidate, work: AttentionWork) -> float:
    """One rank's forward attention compute in one layer (its heads H / U): full-pair equivalents ×
    4·D FLOPs per pair and head at the profile's throughput, plus the per-call overhead; under SP at the
    measured factor of ``ds_seqpar.attention`` over that block model, plus its per-call seconds
    (``sp_calibration``)."""
    seconds = _block_seconds(ctx.profile, work, ctx.dims.heads // c.ulysses, ctx.dims.head_dim)
    seconds *= ctx.compute_scale
    factor, call_s = sp_calibration(ctx, _kind(c))
    return factor * seconds + call_s / (1 + ctx.profile.attention_backward)


def _block_seconds(p: ComputeProfile, work: AttentionWork, heads: int, head_dim: int) -> float:
    """The block model: forward seconds of ``work`` on ``heads`` heads, one thread, no scale."""
    cost = work.full + p.causal_cost_at(work.side) * work.causal_area
    return cost * heads * 4 * head_dim / p.attention_flops + work.calls * p.call_overhead_s


def sp_calibration(ctx: PlanContext, kind: str | None) -> tuple[float, float]:
    """(factor, seconds per call) of ``ds_seqpar.attention`` of ``kind`` (``ring``: the ring engine over R
    ranks; ``ulysses``: the all-to-alls around one block) against the block model, from the profile's
    probe (``plan/sp_probe.py``: forward + backward at two sizes among the node's ranks): factor = the
    measured slope / the block model's slope between the two sizes (the ring's backward tiles, merges and
    accumulator moves; the Ulysses copies), seconds per call = the larger size's measured time − factor ×
    model. (1, 0) without a probe (presets, one rank)."""
    probes = ctx.profile.attention_probes or {}
    probe = probes.get(kind) if kind else None
    if not probe or ctx.cluster.name != "local":
        return 1.0, 0.0
    key = ("calibration", kind)
    if key not in ctx.memo:
        r, u, scale = probe["ranks"], probe["ulysses"], ctx.compute_scale
        model = [
            _block_seconds(ctx.profile, zigzag_work(n * r, r // u), probe["heads"] // u, probe["head_dim"])
            * (1 + ctx.profile.attention_backward)
            * scale
            for n in probe["tokens"][-2:]
        ]
        t = probe["seconds"][-2:]
        factor = min(3.0, max(0.5, (t[1] - t[0]) / max(model[1] - model[0], 1e-12)))
        ctx.memo[key] = factor, max(0.0, t[1] - factor * model[1])
    return ctx.memo[key]


def sp_step_seconds(ctx: PlanContext, c: Candidate) -> float | None:
    """The SP path's fixed seconds per step beyond the model's own (``plan/sp_probe.py``: a tiny step of
    the wrapped model minus the plain model's, among the node's ranks; it holds the step's all-reduces
    and the attention calls at that size), less the per-call seconds ``sp_calibration`` already counts
    per layer: the figure of the candidate's kind (the ring's when its own was not measured). None
    without a measurement (then the step's all-reduces are counted from the latencies)."""
    fixed, kind = ctx.profile.sp_step_s, _kind(c)
    if not fixed or kind is None or ctx.cluster.name != "local":
        return None
    kind = kind if kind in fixed else "ring"
    return max(0.0, fixed.get(kind, 0.0) - ctx.dims.layers * sp_calibration(ctx, kind)[1])


def _attention_result(ctx: PlanContext, c: Candidate, forward_s: float) -> Result:
    """The ring part (with its compute) and the Ulysses all-to-alls of one layer, slowest rank (memoised:
    memory savings do not change it)."""
    key = (c.size, c.ulysses, c.schedule, c.inner, c.team_size, c.grid, c.micro_batch, forward_s)
    if key not in ctx.memo:
        ctx.memo[key] = _attention_result_of(ctx, c, forward_s)
    return ctx.memo[key]


def _attention_result_of(ctx: PlanContext, c: Candidate, forward_s: float) -> Result:
    dims = ctx.dims
    st = AttentionSetting(ctx.cluster, _Heads(dims), ctx.seq_len, c.size, c.micro_batch, ctx.element_bytes,
                          forward_s, ctx.profile.attention_backward)  # fmt: skip
    kv = max(dims.kv_heads, c.ulysses) // c.ulysses
    shape = st.shape(ctx.seq_len // c.ring, dims.heads // c.ulysses, kv)
    ring = Ring.on(ctx.cluster, c.ring, stride=c.ulysses)
    a2a_f, a2a_b = ulysses_phases(st, c.ulysses)
    kw: dict[str, Any] = {}
    if c.schedule == "startrail":
        variant = startrail_backward_choice(shape, c.team_size)
        kw = {"team_size": c.team_size, "startrail_backward": variant}

        def phases(q: int) -> tuple[dict, dict]:
            return startrail(st, ring, shape, q, team_size=c.team_size, variant=variant)
    elif c.schedule in ("all_gather", "attention2d"):
        kw = {"grid": c.grid} if c.grid else {}

        def phases(q: int) -> tuple[dict, dict]:
            return collective_only(st, ring, shape, q, schedule=c.schedule, grid=c.grid)
    else:
        kw = {"inner": c.inner} | ({"segments": 2} if c.schedule == "tasp" else {})

        def phases(q: int) -> tuple[dict, dict]:
            return ring_family(st, ring, shape, q, schedule=c.schedule, inner=c.inner)

    def evaluate(q: int) -> tuple[dict, dict]:
        f, b = phases(q)
        return a2a_f | f, a2a_b | b

    traffic = traffic_of(ring, shape, c.schedule, **kw) if c.ring > 1 else (lambda q: (0, 0))
    res = slowest(c.schedule, c.ring_label, ring, evaluate, traffic)
    a2a = sum(ulysses_bytes_of(st, c.ulysses))
    wide = c.ulysses > ctx.cluster.gpus_per_node
    outside = (c.ulysses - ctx.cluster.gpus_per_node) / (c.ulysses - 1) if wide else 0.0
    res.inter_mb += a2a * outside / 1e6
    res.intra_mb += a2a * (1 - outside) / 1e6
    return res


def _linear_s(ctx: PlanContext, tokens: float) -> tuple[float, float]:
    """(one layer without its attention core, the LM head and loss): forward + backward seconds."""
    p, dims = ctx.profile, ctx.dims
    if p.layer_token_s is not None:
        layer = tokens * p.layer_token_s + p.layer_call_s
        head = tokens * (p.head_token_s or 0.0)
    else:
        layer = 3 * (dims.layer_matmul_flops(tokens) / p.matmul_flops
                     + dims.layer_elementwise_bytes(tokens, ctx.element_bytes) / p.memory_bw)  # fmt: skip
        head = 3 * dims.head_matmul_flops(tokens) / p.matmul_flops
    return layer * ctx.compute_scale, head * ctx.compute_scale


def _zero_seconds(ctx: PlanContext, n_params: int) -> float:
    """ZeRO-3's per-step traffic of one rank (parameters gathered forward and backward, gradients
    reduce-scattered): 3 × N × b × (W − 1) / W bytes, through the NIC when the world spans nodes."""
    w = ctx.world
    if ctx.zero_stage < 3 or w == 1:
        return 0.0
    bw = ctx.cluster.inter_bw if w > ctx.cluster.gpus_per_node else ctx.cluster.intra_bw
    return 3 * n_params * ctx.element_bytes * (w - 1) / w / bw


def _layer_seconds(
    ctx: PlanContext, c: Candidate, memory: Any, row: Sequence[int] | None
) -> dict[str, float]:
    """Seconds by part of one step for one row (or the fixed-length sequence); ``memory``: the resolved
    ``MemorySettings`` (what is recomputed)."""
    savings = {k for k in MEMORY_SAVINGS["all"] if getattr(memory, k)}
    tokens = c.micro_batch * ctx.seq_len / c.size
    layer, head = _linear_s(ctx, tokens)
    degree = row_degree(ctx, row, c.size) if c.dynamic and row is not None else c.size
    if degree < c.size:
        forward_s, res = _grouped_attention(ctx, c, row, degree)
    else:
        forward_s = _attention_forward_s(ctx, c, _work(ctx, c, row))
        res = _attention_result(ctx, c, forward_s)
    attn_compute = forward_s * (1 + ctx.profile.attention_backward)
    attn_total = res.ms / 1e3
    parts = {"linear": layer, "attention compute": attn_compute, "communication": attn_total - attn_compute}
    if "activation_checkpointing" in savings:  # the forward again in backward, exchanges included
        parts["recompute"] = layer / 3 + res.fwd_ms / 1e3
    if "tiled_mlp" in savings:  # the MLP forward again, tile by tile, in backward
        share = ctx.dims.mlp_matmul_flops(1) / ctx.dims.layer_matmul_flops(1)
        parts["recompute"] = parts.get("recompute", 0.0) + layer / 3 * share
    out = {k: v * ctx.dims.layers for k, v in parts.items()}
    out["LM head and loss"] = head
    out[f"_degree {degree}"] = 1.0
    out["_inter_bytes"] = (
        res.inter_mb * 1e6 * ctx.dims.layers * (2 if "activation_checkpointing" in savings else 1)
    )
    out["_intra_bytes"] = (
        res.intra_mb * 1e6 * ctx.dims.layers * (2 if "activation_checkpointing" in savings else 1)
    )
    return out


def row_degree(ctx: PlanContext, row: Sequence[int], size: int) -> int:
    """The SP degree ``dynamic_degree`` runs a packed row at: ``dynamic_placement``'s (docs/balance.md
    "A dynamic SP degree"), ``size`` when the row needs the whole group (memoised per row)."""
    key = ("degree", tuple(row), ctx.seq_len, size)
    if key not in ctx.memo:
        plan = dynamic_placement(row, ctx.seq_len, size)
        ctx.memo[key] = (size, None) if plan is None else (plan.degree, max(plan.work))
    return ctx.memo[key][0]


def _grouped_attention(
    ctx: PlanContext, c: Candidate, row: Sequence[int], degree: int
) -> tuple[float, Result]:
    """One layer of a row that ``dynamic_degree`` runs in groups of p = ``degree`` < P ranks, all H heads
    on every rank (docs/balance.md's table): the forward compute is the plan's largest per-rank work
    (visible pairs, at the causal rate, B rows); p = 1 sends nothing, p > 1 is a ring of the group's p
    consecutive ranks (2(p − 1)·B·n·H_kv·D elements forward) at the ring engine's calibration."""
    dims, b = ctx.dims, c.micro_batch
    worst = ctx.memo[("degree", tuple(row), ctx.seq_len, c.size)][1]
    work = AttentionWork(0.0, 2 * worst * b, 2 * degree * b, worst * b)
    seconds = _block_seconds(ctx.profile, work, dims.heads, dims.head_dim) * ctx.compute_scale
    if degree == 1:
        fwd_ms = 1e3 * seconds
        bwd_ms = fwd_ms * ctx.profile.attention_backward
        return seconds, Result("none", "p = 1", fwd_ms, bwd_ms, 0.0, 0.0, {})
    factor, call_s = sp_calibration(ctx, "ring")
    forward_s = factor * seconds + call_s / (1 + ctx.profile.attention_backward)
    key = ("grouped", degree, b, forward_s)
    if key not in ctx.memo:
        n = ctx.seq_len // c.size
        st = AttentionSetting(ctx.cluster, _Heads(dims), n * degree, degree, b, ctx.element_bytes,
                              forward_s, ctx.profile.attention_backward)  # fmt: skip
        shape = st.shape(n, dims.heads, dims.kv_heads)
        ring = Ring.on(ctx.cluster, degree, stride=1)

        def evaluate(q: int) -> tuple[dict, dict]:
            return ring_family(st, ring, shape, q, schedule="p2p", inner=None)

        ctx.memo[key] = slowest("p2p", f"ring of {degree}", ring, evaluate, traffic_of(ring, shape, "p2p"))
    return forward_s, ctx.memo[key]


def _extra_memory(ctx: PlanContext, c: Candidate) -> int:
    """What the memory model leaves out and a schedule keeps at its attention peak: all-gather's R K/V
    blocks, StarTrail's 3(C − 1) team slices (docs/comm_model.md "Limits")."""
    kv = max(ctx.dims.kv_heads, c.ulysses) // c.ulysses
    n = c.micro_batch * ctx.seq_len // c.ring  # tokens of a ring rank in the head layout
    a_kv = n * kv * ctx.dims.head_dim * ctx.element_bytes
    if c.schedule == "all_gather" and c.ring > 1:
        return 2 * (c.ring - 1) * a_kv
    if c.schedule == "startrail":
        a_q = n * ctx.dims.heads // c.ulysses * ctx.dims.head_dim * ctx.element_bytes
        return 3 * (c.team_size - 1) * (a_q + 2 * a_kv)
    return 0


def predict(ctx: PlanContext, c: Candidate, settings: Any, budget: float) -> Prediction:
    """The predicted step of ``c`` (``settings``: its resolved ``SeqParSettings``) against a memory
    ``budget`` in bytes per rank."""
    rows: list[Sequence[int] | None] = list(ctx.rows) or [None]
    per_row = [_layer_seconds(ctx, c, settings.memory, row) for row in rows]
    keys = {k for p in per_row for k in p}
    parts = {k: sum(p.get(k, 0.0) for p in per_row) / len(per_row) for k in sorted(keys)}
    inter, intra = parts.pop("_inter_bytes"), parts.pop("_intra_bytes")
    degrees = {
        int(k.split()[1]): round(parts.pop(k) * len(per_row)) for k in sorted(keys) if k.startswith("_degree")
    }
    est = memory_estimate(ctx.model_config, ctx.seq_len, settings, world_size=ctx.world,
                          zero_stage=ctx.zero_stage, micro_batch=c.micro_batch,
                          bytes_per_element=ctx.element_bytes)  # fmt: skip
    n_params = est.device.get("parameters (ZeRO shard)", 0) * (ctx.world if ctx.zero_stage >= 3 else 1)
    parts["ZeRO-3 traffic (overlapped)"] = _zero_seconds(ctx, n_params // ctx.element_bytes)
    # a step's fixed seconds outside the layers, and its all-reduces (loss totals, gradients)
    parts["step overhead"] = ctx.profile.step_call_s * ctx.compute_scale
    sp_fixed = sp_step_seconds(ctx, c)
    if sp_fixed is not None:  # measured: the SP path's per-step cost, its all-reduces included
        parts["SP path per step"] = sp_fixed
    elif c.size * c.data_parallel > 1:
        parts["step overhead"] += STEP_ALLREDUCES * ctx.profile.allreduce_s
    core = sum(v for k, v in parts.items() if not k.startswith("ZeRO"))
    step = max(core, parts["ZeRO-3 traffic (overlapped)"])
    peak = est.device_peak + _extra_memory(ctx, c)
    pred = Prediction(c, step, peak, est.step_bytes() + _extra_memory(ctx, c), {"inter": inter, "intra": intra},
                      parts, fits=peak <= budget)  # fmt: skip
    pred.degrees = dict(sorted(degrees.items()))
    pred.reasons = reasons(pred, budget)
    return pred


def reasons(pred: Prediction, budget: float) -> str:
    """One line: what bounds the step (compute, the inter-node link, the intra-node exchanges, memory)."""
    parts, step = pred.parts, pred.step_s
    comm = parts.get("communication", 0.0)
    compute = (
        parts.get("attention compute", 0.0) + parts.get("linear", 0.0) + parts.get("LM head and loss", 0.0)
    )
    recompute = parts.get("recompute", 0.0)
    out = []
    if parts.get("ZeRO-3 traffic (overlapped)", 0.0) >= step:
        out.append("bound by ZeRO-3 traffic")
    elif comm > BOUND_SHARE * step:
        where = "inter-node link" if pred.bytes_by_link["inter"] > 0 else "intra-node exchanges"
        out.append(f"bound by the {where} ({comm / step:.0%} exposed communication)")
    else:
        out.append(f"compute-bound ({compute / step:.0%} compute, {comm / step:.0%} exposed communication)")
    if parts.get("attention compute", 0.0) > 0.5 * step:
        out.append("attention dominates")
    if recompute > BOUND_SHARE * step:
        out.append(f"memory savings cost {recompute / step:.0%} in recompute")
    if pred.candidate.dynamic:
        out.append(pred.policy_note)
    use = pred.peak_bytes / budget
    out.append(f"memory {use:.0%} of budget" + (" (does not fit)" if use > 1 else ""))
    return "; ".join(out)
