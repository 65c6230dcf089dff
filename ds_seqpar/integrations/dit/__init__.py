"""Diffusion transformers (diffusers) under sequence parallelism: docs/dit.md."""

from ds_seqpar.integrations.dit.attention import (
    ATTENTION_RULES,
    AttentionCall,
    AttentionSite,
    register_dit_attention,
)
from ds_seqpar.integrations.dit.cfg import CfgParallel
from ds_seqpar.integrations.dit.hooks import (
    DitParallel,
    check_dit_settings,
    check_no_dit_settings,
    dit_section,
    is_dit,
    sparse_settings,
)
from ds_seqpar.integrations.dit.pipefusion import PipeFusion
from ds_seqpar.integrations.dit.plans import (
    DIT_PLANS,
    GatherOutput,
    SplitInput,
    TokenPlan,
    plan_of,
    register_dit_plan,
)
from ds_seqpar.integrations.dit.training import SeqParDiT

__all__ = [
    "ATTENTION_RULES",
    "DIT_PLANS",
    "AttentionCall",
    "AttentionSite",
    "CfgParallel",
    "DitParallel",
    "GatherOutput",
    "PipeFusion",
    "SeqParDiT",
    "SplitInput",
    "TokenPlan",
    "check_dit_settings",
    "check_no_dit_settings",
    "dit_section",
    "is_dit",
    "plan_of",
    "register_dit_attention",
    "register_dit_plan",
    "sparse_settings",
]
