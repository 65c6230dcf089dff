"""``sequence_parallel.dit``: how a diffusion transformer's denoising runs over the world (docs/dit.md).

world = cfg_parallel x pipefusion.degree x size: ``size`` ranks split every image's tokens (exact Ulysses x
ring), ``cfg_parallel = 2`` runs the conditional and unconditional branches on two halves of the world,
``pipefusion.degree`` > 1 pipelines the transformer's layers over that many stages with patches of the image
(approximate after ``warmup_steps``: stale K/V). Only the section's own checks live here; the world and the
model are checked by ``ds_seqpar.dit.parallelize``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = ["DitConfig", "PipeFusionConfig"]


class PipeFusionConfig(BaseModel):
    """``sequence_parallel.dit.pipefusion``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    degree: StrictInt = Field(
        1, ge=1, description="Pipeline stages (ranks) over the transformer's blocks; 1 = no PipeFusion."
    )
    patches: StrictInt = Field(
        4, ge=1, description="Patches M the image tokens are cut into after the warm-up steps (M = 1: exact)."
    )
    warmup_steps: StrictInt = Field(
        1,
        ge=0,
        description="Denoising steps run exactly (the whole image as one patch) before the stale-K/V patches.",
    )


class DitConfig(BaseModel):
    """``sequence_parallel.dit``: CFG parallelism and PipeFusion for diffusion transformers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg_parallel: Literal[1, 2] = Field(
        1,
        description="2: the transformer's batch (the unconditional and conditional branches that the pipeline "
        "concatenates) is split over two halves of the world and gathered after each call; 1: off.",
    )
    pipefusion: PipeFusionConfig = Field(
        default_factory=PipeFusionConfig, description="PipeFusion (patch pipeline over the layers)."
    )

    def stages(self) -> int:
        return self.pipefusion.degree

    def replicas(self) -> int:
        """Ranks that are not the SP group: cfg_parallel x pipefusion.degree."""
        return self.cfg_parallel * self.pipefusion.degree
