"""``sequence_parallel.dit``: how a diffusion transformer's denoising runs over the world (docs/dit.md).

world = cfg_parallel x pipefusion.degree x size: ``size`` ranks split every image's tokens (exact Ulysses x
ring), ``cfg_parallel = 2`` runs the conditional and unconditional branches on two halves of the world,
``pipefusion.degree`` > 1 pipelines the transformer's layers over that many stages with patches of the image
(approximate after ``warmup_steps``: stale K/V). Only the section's own checks live here; the world and the
model are checked by ``ds_seqpar.dit.parallelize``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

__all__ = ["DitConfig", "DitSparseConfig", "PipeFusionConfig"]


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


class DitSparseConfig(BaseModel):
    """``sequence_parallel.dit.sparse``: block-sparse attention with db-SP balancing (docs/dit_sparse.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: StrictInt = Field(64, ge=1, description="G, tokens per block of the pattern.")
    keep: float | None = Field(
        0.25, gt=0, le=1, description="Fraction of the key blocks each query block keeps (or null)."
    )
    threshold: float | None = Field(
        None, gt=0, le=1, description="Cumulative block probability each query block keeps (or null)."
    )
    balancing: Literal["none", "stripe", "dbsp"] = Field(
        "dbsp",
        description="none | stripe (blocks round-robin over the ring) | dbsp (stripes + heads + blocks).",
    )
    degrees: Literal["mesh", "auto"] | list[StrictInt] = Field(
        "mesh",
        description='"mesh" (the section\'s U x R) | "auto" (per call, the U x R with the lowest predicted cost '
        "from the pattern's ρ_s) | [U, R].",
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
    attention: Literal["dense", "block_sparse"] = Field(
        "dense",
        description="dense: exact attention (ds_seqpar.attention) | block_sparse: exact attention under a block "
        "pattern estimated per call, balanced by db-SP (ds_seqpar.block_sparse_attention; settings in `sparse`).",
    )
    sparse: DitSparseConfig = Field(
        default_factory=DitSparseConfig,
        description="Block-sparse attention settings (attention='block_sparse').",
    )

    @model_validator(mode="after")
    def _check(self) -> DitConfig:
        key = "sequence_parallel.dit"
        unused = [f"pipefusion.{k}" for k in sorted(self.pipefusion.model_fields_set - {"degree"})]
        if self.pipefusion.degree > 1:
            unused = []
        if self.attention != "block_sparse":
            unused += [f"sparse.{k}" for k in sorted(self.sparse.model_fields_set)]
        if unused:
            raise ValueError(
                f"{key}.{unused[0]} is set but {key}.pipefusion.degree={self.pipefusion.degree} / attention="
                f"{self.attention!r} does not use it; valid: pipefusion.degree > 1 (PipeFusion keys) or "
                "attention='block_sparse' (sparse keys), or remove it"
            )
        return self

    def stages(self) -> int:
        return self.pipefusion.degree

    def replicas(self) -> int:
        """Ranks that are not the SP group: cfg_parallel x pipefusion.degree."""
        return self.cfg_parallel * self.pipefusion.degree
