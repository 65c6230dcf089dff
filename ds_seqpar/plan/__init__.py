"""The planner: ranks sequence-parallel configurations by predicted step time among those whose predicted
peak memory fits a budget (docs/plan.md).

Three models combined, none of which runs a collective: the compute model (``compute.py``, calibrated by
``profile.py``), the communication model (bytes: ``comm/model.py``; time: ``links.py``,
``attention_time.py``, on the clusters of ``clusters.py``) and the memory model (``memory/estimate.py``).

    candidates.py  every U | P, ring schedule, layout, memory saving, micro-batch the config rules allow
    predict.py     one candidate's step seconds, peak bytes per rank, bytes per link class, reasons
    planner.py     the context, the search and the ranking
    cli.py         python -m ds_seqpar.plan
    auto.py        sequence_parallel.plan = "auto": the settings' resolver
"""

from ds_seqpar.plan.auto import resolve_auto_plan
from ds_seqpar.plan.candidates import MEMORY_SAVINGS, Candidate, candidates
from ds_seqpar.plan.clusters import CLUSTERS, Cluster
from ds_seqpar.plan.compute import ModelDims
from ds_seqpar.plan.planner import (
    NoCandidate,
    default_budget,
    load_model_config,
    plan_context,
    rank,
    read_lengths,
)
from ds_seqpar.plan.predict import PlanContext, Prediction, predict
from ds_seqpar.plan.profile import ComputeProfile, local_profile
from ds_seqpar.settings import register_plan_resolver

register_plan_resolver(resolve_auto_plan)

__all__ = [
    "CLUSTERS",
    "MEMORY_SAVINGS",
    "Candidate",
    "Cluster",
    "ComputeProfile",
    "ModelDims",
    "NoCandidate",
    "PlanContext",
    "Prediction",
    "candidates",
    "default_budget",
    "load_model_config",
    "local_profile",
    "plan_context",
    "predict",
    "rank",
    "read_lengths",
    "resolve_auto_plan",
]
