"""Diffusion transformers (diffusers) under sequence parallelism: docs/dit.md."""

from ds_seqpar.integrations.dit.attention import (
    ATTENTION_RULES,
    AttentionCall,
    AttentionSite,
    register_attention_site,
)
from ds_seqpar.integrations.dit.cfg import CfgParallel
from ds_seqpar.integrations.dit.hooks import DitParallel, is_dit
from ds_seqpar.integrations.dit.plans import (
    DIT_PLANS,
    GatherOutput,
    SplitInput,
    TokenPlan,
    plan_of,
    register_dit_plan,
)

__all__ = [
    "ATTENTION_RULES",
    "DIT_PLANS",
    "AttentionCall",
    "AttentionSite",
    "CfgParallel",
    "DitParallel",
    "GatherOutput",
    "SplitInput",
    "TokenPlan",
    "is_dit",
    "plan_of",
    "register_attention_site",
    "register_dit_plan",
]
