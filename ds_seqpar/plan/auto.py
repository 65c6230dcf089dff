"""``"sequence_parallel": {"plan": "auto"}``: the planner picks U and the ring schedule at load
(docs/plan.md "plan: auto", docs/configuration.md).

``settings.resolve_settings`` calls :func:`resolve_auto_plan` (registered by ``ds_seqpar.plan``) when the
section says ``plan: "auto"``: the candidates of the section's ``size`` on the known world, for the
model config, ``plan_seq_len`` tokens (default 32768) and ``plan_cluster`` ("local": this machine,
measured once and cached), with the section's own ``memory`` and ``ring.layout``, are ranked; the
fastest that fits the memory of a rank fills ``ulysses_degree`` and the ring's ``schedule``,
``inner_size``, ``team_size``, ``grid``. A value the user set that differs from the choice is refused by
name. One line on the ``ds_seqpar`` logger says what was chosen and why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ds_seqpar.config import SequenceParallelConfig
from ds_seqpar.errors import SeqParConfigError
from ds_seqpar.plan.clusters import GIB
from ds_seqpar.plan.compute import ModelDims
from ds_seqpar.plan.planner import CLUSTER_CHOICES, NoCandidate, default_budget, plan_context, rank
from ds_seqpar.plan.predict import Prediction

__all__ = ["DEFAULT_PLAN_SEQ_LEN", "resolve_auto_plan"]

DEFAULT_PLAN_SEQ_LEN = 32768
PLAN_KEYS = ("plan", "plan_seq_len", "plan_cluster")
logger = logging.getLogger("ds_seqpar")
_CHOSEN: dict[tuple, tuple[Prediction, int]] = {}  # the plan of a (section, model, world) once made


def _ranks_per_node(section: Any, world: int, environ: Mapping[str, str]) -> int:
    wanted = section.ranks_per_node
    if wanted == "auto":
        wanted = int(environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, min(int(wanted), world))


def _choose(section: Any, model_config: Any, world: int, per_node: int) -> tuple[Prediction, int]:
    seq_len = section.plan_seq_len or DEFAULT_PLAN_SEQ_LEN
    dims = ModelDims.read(model_config)
    key = (section.model_dump_json(), dims, world, per_node)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if section.plan_cluster not in CLUSTER_CHOICES:
        raise SeqParConfigError(
            f"sequence_parallel.plan_cluster={section.plan_cluster!r} is not known; valid: {', '.join(CLUSTER_CHOICES)}"
        )
    try:
        ctx = plan_context(model_config, world=world, ranks_per_node=per_node, cluster=section.plan_cluster,
                           seq_len=seq_len)  # fmt: skip
    except ValueError as exc:
        raise SeqParConfigError(f'sequence_parallel.plan="auto": {exc}') from None
    base = {"memory": section.memory.model_dump(exclude_unset=True), "ring": {"layout": section.ring.layout}}
    try:
        ranked = rank(ctx, default_budget(ctx), sizes=[section.size], memory=("none",), base_section=base,
                      keep_unfit=True)  # fmt: skip
    except NoCandidate as exc:
        raise SeqParConfigError(f'sequence_parallel.plan="auto": {exc}') from None
    if not ranked:
        raise SeqParConfigError(
            f'sequence_parallel.plan="auto" found no configuration of size={section.size} for this model; '
            'set plan="manual" and choose ulysses_degree and ring yourself'
        )
    _CHOSEN[key] = (ranked[0], len(ranked))
    return _CHOSEN[key]


def _conflicts(section: Any, chosen: dict[str, Any], reason: str) -> None:
    """Refuse a value the user set that differs from the plan's choice, by name."""
    given = {"ulysses_degree": section.ulysses_degree} if "ulysses_degree" in section.model_fields_set else {}
    given |= {f"ring.{k}": getattr(section.ring, k) for k in section.ring.model_fields_set}
    for key, value in chosen.items():
        mine = given.get(key, "auto")
        mine = list(mine) if isinstance(mine, tuple) else mine
        if mine != "auto" and key in given and mine != value:
            raise SeqParConfigError(
                f"sequence_parallel.{key}={mine!r} conflicts with plan='auto', which chose {key}={value!r} ({reason}); "
                f"valid: remove {key} to let the plan choose, or set plan='manual'"
            )


def resolve_auto_plan(
    section: Any, model_config: Any, world_size: int | None, environ: Mapping[str, str] | None = None
) -> SequenceParallelConfig:
    """The section with the plan's choice filled in (``plan`` back to "manual"); see the module doc."""
    if model_config is None:
        raise SeqParConfigError(
            'sequence_parallel.plan="auto" needs the model config (heads, widths, layers) to predict step times; '
            'pass model_config to section.validate / SeqParMesh.from_config, or set plan="manual"'
        )
    world = world_size if world_size is not None else section.size * (section.data_parallel_size or 1)
    per_node = _ranks_per_node(section, world, os.environ if environ is None else environ)
    if section.plan_cluster == "local" and world > per_node:
        raise SeqParConfigError(
            f"sequence_parallel.plan_cluster='local' profiles each node on its own, and {world // per_node} nodes "
            f"could choose differently; valid: plan_cluster {', '.join(repr(c) for c in CLUSTER_CHOICES[:-1])}"
        )
    best, count = _choose(section, model_config, world, per_node)
    c = best.candidate
    ring = {"schedule": c.schedule, "inner_size": c.inner, "team_size": c.team_size,
            "grid": list(c.grid) if c.grid else None}  # fmt: skip
    chosen = {"ulysses_degree": c.ulysses} | {
        f"ring.{k}": v for k, v in ring.items() if v is not None or k == "inner_size"
    }
    _conflicts(section, chosen, best.reasons)
    data = section.model_dump(exclude_unset=True)
    for key in PLAN_KEYS:
        data.pop(key, None)
    data["ulysses_degree"] = c.ulysses
    data["ring"] = {**data.get("ring", {}), **{k: v for k, v in ring.items() if v is not None}}
    seq_len = section.plan_seq_len or DEFAULT_PLAN_SEQ_LEN
    logger.info(
        "sequence_parallel.plan='auto' chose ulysses_degree=%d, ring %s (R=%d), layout %s: predicted %.3g s per "
        "step and %.1f MiB per rank at S=%d on cluster %s, the fastest of %d candidates; %s",
        c.ulysses, c.ring_label, c.ring, c.layout, best.step_s, best.peak_bytes / 2**20, seq_len,
        section.plan_cluster, count, best.reasons,
    )  # fmt: skip
    if not best.fits:
        logger.warning(
            "sequence_parallel.plan='auto': no candidate fits %.1f GiB per rank", best.peak_bytes / GIB
        )
    return SequenceParallelConfig.model_validate(data)
