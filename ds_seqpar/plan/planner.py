"""The search: build the context (model, cluster, profile, sequence), evaluate every candidate, rank those
that fit the memory budget by predicted seconds per sequence (docs/plan.md).

    ctx = plan_context(model_config, world=8, ranks_per_node=8, cluster="h100-ib", seq_len=131072)
    ranked = rank(ctx, budget_bytes=80 * 2**30)       # [Prediction], fastest first
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ds_seqpar.config import parse_section
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.plan.candidates import MEMORY_SAVINGS, Candidate, candidates
from ds_seqpar.plan.clusters import CLUSTERS, GIB
from ds_seqpar.plan.compute import ModelDims
from ds_seqpar.plan.predict import PlanContext, Prediction, predict
from ds_seqpar.plan.profile import local_cluster, local_profile, preset_profile
from ds_seqpar.settings import divisors, resolve_settings

__all__ = [
    "CLUSTER_CHOICES",
    "NoCandidate",
    "default_budget",
    "load_model_config",
    "plan_context",
    "rank",
    "read_lengths",
]

CLUSTER_CHOICES = (*CLUSTERS, "local")
SIZES_PAST_FIRST_FIT = 3  # SP degrees evaluated once one fits (larger ones only add communication)


class NoCandidate(ValueError):
    """No candidate fits the memory budget (the message names the lightest and its peak)."""


def load_model_config(path: str | Path) -> tuple[Any, str]:
    """A transformers config from a ``config.json`` or a model directory (local files only); (config, name)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(
            f"--model {str(path)!r} does not exist; pass a transformers config.json or a model directory"
        )
    from transformers import AutoConfig

    try:
        if file.is_dir():
            config = AutoConfig.from_pretrained(str(file), local_files_only=True)
        else:
            data = json.loads(file.read_text())
            kind = data.get("model_type")
            config = (
                AutoConfig.for_model(kind, **{k: v for k, v in data.items() if k != "model_type"})
                if kind
                else data
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"--model {str(path)!r} is not a readable transformers config ({type(exc).__name__}: {exc}); pass a "
            "config.json or a directory holding one"
        ) from None
    if file.is_dir():
        return config, file.name
    return config, file.parent.name if file.name == "config.json" else file.stem


def read_lengths(path: str | Path) -> tuple[int, list[list[int]]]:
    """A length mix of ``benchmarks/lengths/`` (``{"seq_len": S, "rows": [[document lengths], ...]}``)."""
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text())
        seq_len, rows = int(data["seq_len"]), [[int(x) for x in row] for row in data["rows"]]
    except OSError as exc:
        raise ValueError(
            f"--lengths {str(path)!r} cannot be read ({exc.strerror}); pass a length-mix JSON file"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--lengths {str(path)!r} is not a length mix ({type(exc).__name__}: {exc}); expected "
            '{"seq_len": S, "rows": [[document lengths of row 0], ...]} as in benchmarks/lengths/'
        ) from None
    bad = [i for i, row in enumerate(rows) if not row or sum(row) > seq_len or min(row) < 1]
    if seq_len < 1 or not rows or bad:
        raise ValueError(
            f"--lengths {str(path)!r}: rows {bad[:5]} are empty, hold a length < 1 or sum past seq_len={seq_len}; "
            "every row's documents must fit one sequence of seq_len tokens"
        )
    return seq_len, rows


def plan_context(
    model_config: Any,
    *,
    world: int,
    ranks_per_node: int,
    cluster: str,
    seq_len: int,
    rows: Sequence[Sequence[int]] = (),
    dtype: str | None = None,
    zero_stage: int = 3,
    profile_path: str | Path | None = None,
    name: str = "model",
) -> PlanContext:
    """The context every candidate is evaluated in; ``cluster`` 'local' measures this machine (cached)."""
    if cluster not in CLUSTER_CHOICES:
        raise ValueError(f"cluster={cluster!r} is not known; valid: {', '.join(CLUSTER_CHOICES)}")
    if world < 1 or ranks_per_node < 1:
        raise ValueError(f"world={world} and ranks_per_node={ranks_per_node} must be >= 1")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2 tokens")
    dims = ModelDims.read(model_config, name)
    dtype = dtype or ("fp32" if cluster == "local" else "bf16")
    element_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    scale = 1.0
    if cluster == "local":
        profile = local_profile(
            dims, dtype, profile_path, ranks=min(ranks_per_node, world), model_config=model_config
        )
        node = local_cluster(min(ranks_per_node, world), profile)
        scale = max(1.0, min(ranks_per_node, world) / (os.cpu_count() or 1))  # ranks share the cores
    else:
        node = CLUSTERS[cluster]
        profile = preset_profile(cluster, node)
    return PlanContext(dims, model_config, node, profile, seq_len, world, ranks_per_node, element_bytes,
                       zero_stage, tuple(tuple(r) for r in rows), scale)  # fmt: skip


def default_budget(ctx: PlanContext) -> float:
    """Bytes per rank: the preset's device memory, or (local) this machine's memory over its ranks."""
    if ctx.cluster.name == "local":
        return ctx.profile.memory_bytes / min(ctx.ranks_per_node, ctx.world)
    return ctx.profile.memory_bytes


def _settings(ctx: PlanContext, c: Candidate, base: dict[str, Any] | None = None) -> Any | None:
    """The candidate's resolved settings (``base``: keys of a section that win over the candidate's, e.g.
    the user's ``memory``), or None when the config rules refuse it."""
    data = {**c.section(), "ranks_per_node": ctx.ranks_per_node}
    for key, value in (base or {}).items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    try:
        section = parse_section(data)
        return resolve_settings(section, ctx.model_config, ctx.world)
    except (SeqParConfigError, ValueError):
        return None


def rank(
    ctx: PlanContext,
    budget_bytes: float,
    *,
    sizes: Sequence[int] | None = None,
    memory: Sequence[str] = tuple(MEMORY_SAVINGS),
    micro_batches: Sequence[int] = (1,),
    layouts: Sequence[str] | None = None,
    keep_unfit: bool = False,
    base_section: dict[str, Any] | None = None,
) -> list[Prediction]:
    """Every candidate evaluated, those that fit ``budget_bytes`` ranked by predicted seconds per sequence
    (``keep_unfit``: the others after them, by peak). ``sizes``: SP degrees (default: the divisors of the
    world, smallest first, up to the third that has a candidate that fits); ``base_section``: section keys
    every candidate takes (``plan: "auto"``: the user's memory savings and ring layout)."""
    layouts = layouts or (("zigzag", "documents") if ctx.rows else ("zigzag",))
    explicit = sizes is not None
    sizes = [s for s in (sizes or divisors(ctx.world)) if ctx.world % s == 0 and 2 * s <= ctx.seq_len]
    if not sizes:
        raise ValueError(
            f"no SP degree divides world={ctx.world} with at least 2 tokens per rank of seq_len={ctx.seq_len}; "
            "pass a longer --seq-len or a world size it divides"
        )
    fitting, unfit, sizes_fit = [], [], 0
    for size in sizes:
        found = False
        for c in candidates([size], ctx.world, ctx.dims.heads, ctx.dims.kv_heads, ctx.ranks_per_node,
                            layouts=layouts, memory=memory, micro_batches=micro_batches):  # fmt: skip
            # packed rows: a documents candidate also under a dynamic SP degree (docs/balance.md)
            dynamic = ctx.rows and c.layout == "documents" and size > 1
            for one in (c, replace(c, dynamic=True)) if dynamic else (c,):
                settings = _settings(ctx, one, base_section)
                if settings is None:
                    continue
                pred = predict(ctx, one, settings, budget_bytes)
                (fitting if pred.fits else unfit).append(pred)
                found |= pred.fits
        sizes_fit += found
        if not explicit and sizes_fit >= SIZES_PAST_FIRST_FIT:
            break
    fitting.sort(key=lambda p: (p.seconds_per_sequence, p.peak_bytes))
    if not fitting and not keep_unfit:
        lightest = min(unfit, key=lambda p: p.peak_bytes, default=None)
        need = (
            f"; the lightest ({_describe(lightest.candidate)}) needs {lightest.peak_bytes / GIB:.2f} GiB"
            if lightest
            else ""
        )
        raise NoCandidate(
            f"no candidate fits --memory-budget {budget_bytes / GIB:.2f} GiB per rank{need}; raise the budget, "
            "use more ranks (--world), or a shorter --seq-len"
        )
    return fitting + (sorted(unfit, key=lambda p: p.peak_bytes) if keep_unfit else [])


def _describe(c: Candidate) -> str:
    return f"P={c.size} U={c.ulysses} R={c.ring} {c.ring_label}, memory {c.memory}"
